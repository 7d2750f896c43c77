//! The decode side's machine: one per request and generation. It waits for
//! every expected producer rank's notice (rules 2, 3, 4) and holds the
//! blocks while a write may still land in them (rule 6, and the quarantine).

use std::collections::BTreeSet;

use super::Dropped;
use crate::ids::{Generation, NoticeKey, ProducerRank, RequestId};
use crate::wire::{Notice, Outcome};

/// Events of a consumer request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConsumerEvent {
    /// A producer's notice as it came off the network (Mooncake), routed
    /// here by request ID and generation. Believed only with its tag under
    /// the authorization's notice key (rule 2a).
    Notice(Notice),
    /// What this rank learnt over its own side channel, not from a notice:
    /// producer rank `rank` will write nothing (more) into `generation`'s
    /// blocks — it refused the handshake or could not be reached
    /// (`Failed`), or it answered a cancel with [`crate::wire::Fence::Fenced`]
    /// (`Aborted`). The rank counts as ended.
    RankEnded {
        generation: Generation,
        rank: ProducerRank,
        outcome: Outcome,
        reason: String,
    },
    /// The wait for producers exceeded its deadline.
    TimedOut,
    /// The quarantine after the deadline passed: blocks a producer never
    /// accounted for may be given back even so (a producer that stays
    /// silent this long is taken as gone; see the known limitations).
    QuarantineOver,
    /// vLLM is done with the request (decoded, aborted, or failed): the
    /// authorization is to be revoked and the blocks given back.
    Release,
}

/// What the consumer actor must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConsumerEffect {
    /// Every expected producer reported done: the KV is in place.
    Completed { bytes: u64 },
    /// The KV will not be complete; vLLM must treat the blocks as failed
    /// loads. Emitted once every producer ended, or at the deadline: then
    /// `held`, some producer never ended and its writes may still land, so
    /// the blocks may be reused (recomputed or freed) only after `Quiesced`
    /// or `Released`.
    Failed { reason: String, held: bool },
    /// After a `held` failure: every producer ended, or the quarantine
    /// passed; nothing more is waited for.
    Quiesced,
    /// An event was ignored (counted, traced).
    Dropped(Dropped),
    /// No producer can write into the blocks any more: they may be freed.
    Released,
    /// vLLM released the request while these producer ranks had not ended:
    /// ask each (a cancel carrying the generation) whether anything can
    /// still be written, so that the blocks go back as soon as nothing can
    /// (a [`ConsumerEvent::RankEnded`] per rank that answers
    /// [`crate::wire::Fence::Fenced`]), not at the quarantine.
    Fence { ranks: Vec<ProducerRank> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumerPhase {
    Waiting,
    Complete,
    Failed,
    /// vLLM released the request before every producer ended; the blocks stay
    /// held until they all did (or the quarantine after the deadline passed).
    Releasing,
    Released,
}

impl ConsumerPhase {
    pub fn name(self) -> &'static str {
        match self {
            Self::Waiting => "waiting",
            Self::Complete => "complete",
            Self::Failed => "failed",
            Self::Releasing => "releasing",
            Self::Released => "released",
        }
    }
}

/// The decode side of one request.
#[derive(Debug, Clone)]
pub struct ConsumerMachine {
    pub request: RequestId,
    pub generation: Generation,
    /// This authorization's notice key (`Handshake::notice_key`): the key
    /// of its notices' tags. Never printed (its `Debug` is redacted).
    notice_key: NoticeKey,
    expected: BTreeSet<ProducerRank>,
    /// Ranks whose counted done notice said they wrote into the staging grant.
    staged: BTreeSet<ProducerRank>,
    done: BTreeSet<ProducerRank>,
    /// Producers that reported anything terminal (done, failed, aborted).
    ended: BTreeSet<ProducerRank>,
    phase: ConsumerPhase,
    bytes: u64,
    reason: Option<String>,
    /// The quarantine after the deadline passed.
    quarantine_over: bool,
    /// Failed at the deadline with a producer not ended, and not yet quiesced.
    held: bool,
}

impl ConsumerMachine {
    /// `expected`: the producer ranks that hold heads of this consumer rank;
    /// `notice_key`: the one this authorization's handshake carries, which
    /// keys its notices' tags.
    pub fn new(
        request: RequestId,
        generation: Generation,
        expected: BTreeSet<ProducerRank>,
        notice_key: NoticeKey,
    ) -> Self {
        assert!(!expected.is_empty(), "a consumer expects at least one producer");
        Self {
            request,
            generation,
            notice_key,
            expected,
            staged: BTreeSet::new(),
            done: BTreeSet::new(),
            ended: BTreeSet::new(),
            phase: ConsumerPhase::Waiting,
            bytes: 0,
            reason: None,
            quarantine_over: false,
            held: false,
        }
    }

    /// The producer ranks a consumer rank waits for, given the model's KV
    /// heads and both TP sizes (`KvLayout::producer_ranks`, the one source).
    pub fn expected_ranks(
        total_kv_heads: u32,
        consumer_rank: u32,
        consumer_tp: u32,
        producer_tp: u32,
    ) -> BTreeSet<ProducerRank> {
        crate::layout::producer_ranks_for(total_kv_heads, consumer_rank, consumer_tp, producer_tp)
            .into_iter()
            .map(ProducerRank)
            .collect()
    }

    pub fn phase(&self) -> ConsumerPhase {
        self.phase
    }

    pub fn reason(&self) -> Option<&str> {
        self.reason.as_deref()
    }

    pub fn done_count(&self) -> usize {
        self.done.len()
    }

    /// The producer ranks whose counted `done` notice said they wrote into
    /// the staging grant (the worker scatters their heads).
    pub fn staged_ranks(&self) -> &BTreeSet<ProducerRank> {
        &self.staged
    }

    /// The expected ranks that have not ended yet.
    fn pending(&self) -> Vec<ProducerRank> {
        self.expected.difference(&self.ended).copied().collect()
    }

    pub fn expected_count(&self) -> usize {
        self.expected.len()
    }

    fn all_ended(&self) -> bool {
        self.ended.len() == self.expected.len()
    }

    /// Rank `rank` ended its part of `generation` with `outcome` (a notice
    /// that passed its tag, or what the side channel told this rank).
    fn rank_ended(
        &mut self,
        generation: Generation,
        rank: ProducerRank,
        outcome: Outcome,
        reason: Option<String>,
        bytes: u64,
        staged: bool,
    ) -> Vec<ConsumerEffect> {
        use ConsumerEffect as E;
        use ConsumerPhase as P;
        if generation != self.generation {
            return vec![E::Dropped(Dropped::StaleGeneration {
                got: generation,
                current: self.generation,
            })];
        }
        if !self.expected.contains(&rank) {
            return vec![E::Dropped(Dropped::UnexpectedRank(rank))];
        }
        if !self.ended.insert(rank) {
            return vec![E::Dropped(Dropped::Duplicate(rank))];
        }
        match self.phase {
            P::Released => vec![E::Dropped(Dropped::AfterTerminal)],
            P::Releasing => {
                if self.all_ended() {
                    self.phase = P::Released;
                    vec![E::Released]
                } else {
                    vec![]
                }
            }
            P::Complete => vec![E::Dropped(Dropped::AfterTerminal)],
            // Failed at the deadline: the notice no longer changes
            // the outcome, but it accounts for that producer (its
            // writes ended); once all did, nothing is waited for.
            P::Failed if self.held && self.all_ended() => {
                self.held = false;
                vec![E::Quiesced]
            }
            P::Failed => vec![],
            P::Waiting => {
                match outcome {
                    Outcome::Done => {
                        self.done.insert(rank);
                        self.bytes += bytes;
                        if staged {
                            self.staged.insert(rank);
                        }
                    }
                    Outcome::Failed | Outcome::Aborted => {
                        let why = reason.unwrap_or_else(|| "no reason given".into());
                        let what = if outcome == Outcome::Failed {
                            "failure"
                        } else {
                            "abort"
                        };
                        if self.reason.is_none() {
                            self.reason = Some(format!("producer rank {} reported {what}: {why}", rank.0));
                        }
                    }
                }
                if !self.all_ended() {
                    // A failure is published only once every producer
                    // ended, so no write can land after vLLM reuses
                    // or recomputes the blocks.
                    return vec![];
                }
                match &self.reason {
                    None => {
                        self.phase = P::Complete;
                        vec![E::Completed { bytes: self.bytes }]
                    }
                    Some(r) => {
                        self.phase = P::Failed;
                        vec![E::Failed {
                            reason: r.clone(),
                            held: false,
                        }]
                    }
                }
            }
        }
    }

    pub fn on_event(&mut self, ev: ConsumerEvent) -> Vec<ConsumerEffect> {
        use ConsumerEffect as E;
        use ConsumerPhase as P;
        match ev {
            ConsumerEvent::Notice(n) => {
                // Rule 2a: a notice is believed only with its tag under this
                // authorization's notice key, whatever its request ID and
                // generation say (both can be learnt or guessed; the
                // capability too, by the client that sent the request). A
                // notice of another generation is dropped as stale first:
                // tagged under its own authorization's key, it cannot carry
                // this one's tag, and an honest late notice is no forgery.
                if n.request_id != self.request {
                    return vec![E::Dropped(Dropped::OtherRequest)];
                }
                if n.generation != self.generation {
                    return vec![E::Dropped(Dropped::StaleGeneration {
                        got: n.generation,
                        current: self.generation,
                    })];
                }
                if !n.authentic(&self.notice_key) {
                    return vec![E::Dropped(Dropped::Unauthenticated(n.producer_rank))];
                }
                let staged = n.staged && n.outcome == Outcome::Done;
                self.rank_ended(
                    n.generation,
                    n.producer_rank,
                    n.outcome,
                    n.reason,
                    n.bytes,
                    staged,
                )
            }
            ConsumerEvent::RankEnded {
                generation,
                rank,
                outcome,
                reason,
            } => self.rank_ended(generation, rank, outcome, Some(reason), 0, false),
            ConsumerEvent::TimedOut => match self.phase {
                P::Waiting => {
                    let mut reason = format!(
                        "timed out waiting for producers: {} of {} reported done",
                        self.done.len(),
                        self.expected.len()
                    );
                    if let Some(first) = &self.reason {
                        reason = format!("{first}; then {reason}");
                    }
                    self.phase = P::Failed;
                    self.reason = Some(reason.clone());
                    // In Waiting some producer has not ended (else the
                    // last notice would have ended the wait).
                    self.held = true;
                    vec![E::Failed { reason, held: true }]
                }
                // A producer that has not ended may still have writes in
                // flight (a cut link holds them in Mooncake's queue, and
                // they land when it heals): the blocks stay held until it
                // ends or the quarantine passes.
                P::Releasing | P::Failed | P::Complete | P::Released => vec![],
            },
            ConsumerEvent::QuarantineOver => {
                self.quarantine_over = true;
                match self.phase {
                    P::Releasing => {
                        self.phase = P::Released;
                        vec![E::Released]
                    }
                    P::Failed if self.held => {
                        self.held = false;
                        vec![E::Quiesced]
                    }
                    P::Waiting | P::Failed | P::Complete | P::Released => vec![],
                }
            }
            ConsumerEvent::Release => match self.phase {
                P::Released | P::Releasing => vec![E::Dropped(Dropped::AfterTerminal)],
                // Complete is only reached once every producer ended, and
                // Failed too unless the deadline made it: then the blocks
                // are freed once the rest ended, or the quarantine passed.
                P::Complete | P::Failed if self.all_ended() || self.quarantine_over => {
                    self.phase = P::Released;
                    vec![E::Released]
                }
                // Producers may still write: the blocks stay held, and each
                // producer not yet ended is asked whether it still can
                // (the cancel is a fence).
                P::Complete | P::Failed | P::Waiting => {
                    self.phase = P::Releasing;
                    vec![E::Fence {
                        ranks: self.pending(),
                    }]
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fsm::test_support::*;

    fn cap() -> crate::ids::Capability {
        crate::ids::Capability::parse(&"c".repeat(32)).unwrap()
    }

    fn unsigned(g: u64, rank: u32, outcome: Outcome) -> Notice {
        Notice {
            version: crate::wire::WIRE_VERSION,
            request_id: rid(),
            generation: Generation(g),
            producer_rank: ProducerRank(rank),
            outcome,
            reason: None,
            bytes: 10,
            staged: false,
            mac: None,
        }
    }

    /// A notice as the request's producer sends it (tagged).
    fn notice(g: u64, rank: u32, outcome: Outcome) -> ConsumerEvent {
        ConsumerEvent::Notice(unsigned(g, rank, outcome).sign(&notice_key()))
    }

    fn consumer(expected: u32) -> ConsumerMachine {
        ConsumerMachine::new(
            rid(),
            Generation(1),
            (0..expected).map(ProducerRank).collect(),
            notice_key(),
        )
    }

    // Rule 2a: a notice without its authorization's tag is dropped whatever
    // it names: no tag, another authorization's key's tag, a tag over other
    // fields, and (issue 44) a tag under the request's capability, which the
    // client that sent the request holds.
    #[test]
    fn rule2a_a_notice_is_believed_only_with_its_tag() {
        let mut c = consumer(1);
        let other = NoticeKey::random();
        let mut tampered = unsigned(1, 0, Outcome::Done).sign(&notice_key());
        tampered.bytes = 11;
        let mut restaged = unsigned(1, 0, Outcome::Done).sign(&notice_key());
        restaged.staged = true;
        for forged in [
            unsigned(1, 0, Outcome::Done),
            unsigned(1, 0, Outcome::Done).sign(&other),
            unsigned(1, 0, Outcome::Done).sign_with_raw_key(cap().as_str().as_bytes()),
            unsigned(1, 0, Outcome::Failed).sign_with_raw_key(cap().as_str().as_bytes()),
            tampered,
            restaged,
            Notice {
                mac: Some("zz".into()),
                ..unsigned(1, 0, Outcome::Done)
            },
        ] {
            assert_eq!(
                c.on_event(ConsumerEvent::Notice(forged)),
                vec![ConsumerEffect::Dropped(Dropped::Unauthenticated(ProducerRank(0)))]
            );
            assert_eq!(c.phase(), ConsumerPhase::Waiting);
        }
        // Another request's notice, even tagged right, is not this one's.
        let mut elsewhere = unsigned(1, 0, Outcome::Done);
        elsewhere.request_id = RequestId::new("r2");
        assert_eq!(
            c.on_event(ConsumerEvent::Notice(elsewhere.sign(&notice_key()))),
            vec![ConsumerEffect::Dropped(Dropped::OtherRequest)]
        );
        // The real one still counts after the forgeries.
        assert_eq!(
            c.on_event(notice(1, 0, Outcome::Done)),
            vec![ConsumerEffect::Completed { bytes: 10 }]
        );
    }

    // Rule 10: vLLM releases a consumer while producers have not ended: it
    // asks those ranks to fence; a rank that answers fenced ends, and the
    // blocks go back once every rank ended, before any deadline.
    #[test]
    fn rule10_a_release_fences_the_pending_ranks_and_a_fenced_rank_ends() {
        let mut c = consumer(3);
        assert!(c.on_event(notice(1, 0, Outcome::Done)).is_empty());
        assert_eq!(
            c.on_event(ConsumerEvent::Release),
            vec![ConsumerEffect::Fence {
                ranks: vec![ProducerRank(1), ProducerRank(2)]
            }]
        );
        let fenced = |rank: u32| ConsumerEvent::RankEnded {
            generation: Generation(1),
            rank: ProducerRank(rank),
            outcome: Outcome::Aborted,
            reason: "fenced".into(),
        };
        assert!(c.on_event(fenced(1)).is_empty());
        assert_eq!(c.phase(), ConsumerPhase::Releasing);
        // A fence of another generation or a repeated one changes nothing.
        assert!(matches!(
            c.on_event(ConsumerEvent::RankEnded {
                generation: Generation(2),
                rank: ProducerRank(2),
                outcome: Outcome::Aborted,
                reason: "x".into()
            })[..],
            [ConsumerEffect::Dropped(Dropped::StaleGeneration { .. })]
        ));
        assert!(matches!(
            c.on_event(fenced(1))[..],
            [ConsumerEffect::Dropped(Dropped::Duplicate(_))]
        ));
        assert_eq!(c.on_event(fenced(2)), vec![ConsumerEffect::Released]);

        // A held failure (the deadline) released by vLLM fences too.
        let mut c = consumer(1);
        c.on_event(ConsumerEvent::TimedOut);
        assert_eq!(
            c.on_event(ConsumerEvent::Release),
            vec![ConsumerEffect::Fence {
                ranks: vec![ProducerRank(0)]
            }]
        );
        assert_eq!(c.on_event(fenced(0)), vec![ConsumerEffect::Released]);

        // A complete consumer frees at once: nothing to fence.
        let mut c = consumer(1);
        c.on_event(notice(1, 0, Outcome::Done));
        assert_eq!(c.on_event(ConsumerEvent::Release), vec![ConsumerEffect::Released]);
    }

    // Only a counted done notice that says `staged` makes its rank's heads
    // be scattered (a duplicate, a forgery or a late one never does).
    #[test]
    fn only_a_counted_staged_done_notice_says_what_to_scatter() {
        let mut c = consumer(2);
        let staged = |rank: u32| {
            let mut n = unsigned(1, rank, Outcome::Done);
            n.staged = true;
            n
        };
        c.on_event(ConsumerEvent::Notice(staged(0)));
        assert!(c.staged_ranks().is_empty(), "an untagged staged notice counted");
        c.on_event(ConsumerEvent::Notice(staged(0).sign(&notice_key())));
        c.on_event(ConsumerEvent::Notice(staged(0).sign(&notice_key())));
        c.on_event(notice(1, 1, Outcome::Done));
        assert_eq!(c.staged_ranks().iter().map(|r| r.0).collect::<Vec<_>>(), vec![0]);
    }

    // Rule 2: notices of another generation are dropped, never delivered.
    #[test]
    fn rule2_stale_generation_is_dropped() {
        let mut c = consumer(1);
        let fx = c.on_event(notice(0, 0, Outcome::Done));
        assert!(matches!(
            fx[..],
            [ConsumerEffect::Dropped(Dropped::StaleGeneration { .. })]
        ));
        // A late notice of another authorization, tagged under that one's
        // own key, is stale (not counted as a forgery).
        let late = unsigned(7, 0, Outcome::Done).sign(&NoticeKey::random());
        assert!(matches!(
            c.on_event(ConsumerEvent::Notice(late))[..],
            [ConsumerEffect::Dropped(Dropped::StaleGeneration { .. })]
        ));
        assert_eq!(c.phase(), ConsumerPhase::Waiting);
    }

    // Rule 3: complete only after every expected producer reported done.
    #[test]
    fn rule3_waits_for_every_producer() {
        let mut c = consumer(2);
        assert!(c.on_event(notice(1, 0, Outcome::Done)).is_empty());
        assert_eq!(c.phase(), ConsumerPhase::Waiting);
        assert!(matches!(
            c.on_event(notice(1, 0, Outcome::Done))[..],
            [ConsumerEffect::Dropped(Dropped::Duplicate(_))]
        ));
        assert!(matches!(
            c.on_event(notice(1, 5, Outcome::Done))[..],
            [ConsumerEffect::Dropped(Dropped::UnexpectedRank(_))]
        ));
        assert_eq!(
            c.on_event(notice(1, 1, Outcome::Done)),
            vec![ConsumerEffect::Completed { bytes: 20 }]
        );
    }

    // Rule 4: failure or abort never publishes the destination as complete.
    #[test]
    fn rule4_failure_never_completes() {
        for bad in [Outcome::Failed, Outcome::Aborted] {
            let mut c = consumer(2);
            c.on_event(notice(1, 0, Outcome::Done));
            assert!(matches!(
                c.on_event(notice(1, 1, bad))[..],
                [ConsumerEffect::Failed { .. }]
            ));
            let mut c2 = consumer(2);
            c2.on_event(notice(1, 0, bad));
            let fx = c2.on_event(notice(1, 1, Outcome::Done));
            assert!(
                !fx.iter().any(|e| matches!(e, ConsumerEffect::Completed { .. })),
                "{fx:?}"
            );
            assert_eq!(c2.phase(), ConsumerPhase::Failed);
        }
    }

    // A failure is published only when no producer can write any more.
    #[test]
    fn failure_waits_for_the_other_producers_to_end() {
        let mut c = consumer(2);
        assert!(c.on_event(notice(1, 0, Outcome::Failed)).is_empty());
        assert_eq!(c.phase(), ConsumerPhase::Waiting);
        assert!(matches!(
            c.on_event(notice(1, 1, Outcome::Done))[..],
            [ConsumerEffect::Failed { .. }]
        ));
        assert_eq!(c.on_event(ConsumerEvent::Release), vec![ConsumerEffect::Released]);
    }

    #[test]
    fn timeout_fails_and_release_frees() {
        // Every producer ended (failed), then the deadline: freed at release.
        let mut c = consumer(1);
        assert!(matches!(
            c.on_event(notice(1, 0, Outcome::Failed))[..],
            [ConsumerEffect::Failed { held: false, .. }]
        ));
        assert_eq!(c.on_event(ConsumerEvent::TimedOut), vec![]);
        assert_eq!(c.on_event(ConsumerEvent::Release), vec![ConsumerEffect::Released]);
    }

    // A deadline fails the request at once, but a producer that never ended
    // may still have writes in flight (a cut link: they land when it heals),
    // so its blocks stay held until it ends or the quarantine passes.
    #[test]
    fn timeout_holds_the_blocks_until_every_producer_ended() {
        let mut c = consumer(2);
        assert!(c.on_event(notice(1, 0, Outcome::Done)).is_empty());
        assert!(matches!(
            c.on_event(ConsumerEvent::TimedOut)[..],
            [ConsumerEffect::Failed { .. }]
        ));
        assert!(matches!(
            c.on_event(ConsumerEvent::Release)[..],
            [ConsumerEffect::Fence { .. }]
        ));
        assert_eq!(c.phase(), ConsumerPhase::Releasing);
        // rank 1's late notice: its writes ended, the blocks are free.
        assert_eq!(
            c.on_event(notice(1, 1, Outcome::Done)),
            vec![ConsumerEffect::Released]
        );

        // A late notice before vLLM's release accounts for the producer too:
        // the blocks may be recomputed (Quiesced), and freed at release.
        let mut c = consumer(1);
        assert!(matches!(
            c.on_event(ConsumerEvent::TimedOut)[..],
            [ConsumerEffect::Failed { held: true, .. }]
        ));
        assert_eq!(
            c.on_event(notice(1, 0, Outcome::Failed)),
            vec![ConsumerEffect::Quiesced]
        );
        assert_eq!(c.phase(), ConsumerPhase::Failed);
        assert_eq!(c.on_event(ConsumerEvent::Release), vec![ConsumerEffect::Released]);

        // A producer that never ends: the quarantine frees the blocks, before
        // or after vLLM's release.
        let mut c = consumer(1);
        c.on_event(ConsumerEvent::TimedOut);
        assert!(matches!(
            c.on_event(ConsumerEvent::Release)[..],
            [ConsumerEffect::Fence { .. }]
        ));
        assert_eq!(
            c.on_event(ConsumerEvent::QuarantineOver),
            vec![ConsumerEffect::Released]
        );
        let mut c = consumer(1);
        c.on_event(ConsumerEvent::TimedOut);
        assert_eq!(
            c.on_event(ConsumerEvent::QuarantineOver),
            vec![ConsumerEffect::Quiesced]
        );
        assert_eq!(c.on_event(ConsumerEvent::Release), vec![ConsumerEffect::Released]);
    }

    // Blocks released by vLLM while producers may still write stay held.
    #[test]
    fn release_while_writes_may_land_waits_for_producers() {
        let mut c = consumer(2);
        assert!(matches!(
            c.on_event(ConsumerEvent::Release)[..],
            [ConsumerEffect::Fence { .. }]
        ));
        assert_eq!(c.phase(), ConsumerPhase::Releasing);
        assert!(c.on_event(notice(1, 0, Outcome::Done)).is_empty());
        assert_eq!(
            c.on_event(notice(1, 1, Outcome::Aborted)),
            vec![ConsumerEffect::Released]
        );
        // The deadline does not end the wait (a write may still land); the
        // quarantine after it does.
        let mut c = consumer(1);
        c.on_event(ConsumerEvent::Release);
        assert_eq!(c.on_event(ConsumerEvent::TimedOut), vec![]);
        assert_eq!(c.phase(), ConsumerPhase::Releasing);
        assert_eq!(
            c.on_event(ConsumerEvent::QuarantineOver),
            vec![ConsumerEffect::Released]
        );
    }

    #[test]
    fn expected_ranks_follow_tp() {
        let r = |v: &[u32]| v.iter().copied().map(ProducerRank).collect::<BTreeSet<_>>();
        // 8 KV heads: TP fan-in and fan-out.
        assert_eq!(ConsumerMachine::expected_ranks(8, 0, 1, 2), r(&[0, 1]));
        assert_eq!(ConsumerMachine::expected_ranks(8, 1, 2, 4), r(&[2, 3]));
        assert_eq!(ConsumerMachine::expected_ranks(8, 3, 4, 2), r(&[1]));
        assert_eq!(ConsumerMachine::expected_ranks(8, 1, 2, 2), r(&[1]));
        // 1 KV head, replicated on every rank: one replica sends.
        assert_eq!(ConsumerMachine::expected_ranks(1, 0, 1, 2), r(&[0]));
        assert_eq!(ConsumerMachine::expected_ranks(1, 1, 2, 1), r(&[0]));
        assert_eq!(ConsumerMachine::expected_ranks(1, 1, 2, 4), r(&[0]));
        // 2 KV heads on TP 4 (each head on 2 ranks) -> TP 1: ranks 0 and 2.
        assert_eq!(ConsumerMachine::expected_ranks(2, 0, 1, 4), r(&[0, 2]));
        // ... and TP 1 -> TP 4: each consumer rank from rank 0.
        assert_eq!(ConsumerMachine::expected_ranks(2, 3, 4, 1), r(&[0]));
    }
}
