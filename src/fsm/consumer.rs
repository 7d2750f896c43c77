//! The decode side's machine: one per request and generation. It waits for
//! every expected producer rank's notice (rules 2, 3, 4) and holds the
//! blocks while a write may still land in them (rule 6, and the quarantine).

use std::collections::BTreeSet;

use super::Dropped;
use crate::ids::{Generation, ProducerRank, RequestId};
use crate::wire::Outcome;

/// Events of a consumer request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConsumerEvent {
    /// A producer's notice, routed here by request ID.
    Notice {
        generation: Generation,
        rank: ProducerRank,
        outcome: Outcome,
        reason: Option<String>,
        bytes: u64,
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
    expected: BTreeSet<ProducerRank>,
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
    /// `expected`: the producer ranks that hold heads of this consumer rank.
    pub fn new(request: RequestId, generation: Generation, expected: BTreeSet<ProducerRank>) -> Self {
        assert!(!expected.is_empty(), "a consumer expects at least one producer");
        Self {
            request,
            generation,
            expected,
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

    /// Whether a notice from `rank` now would be that rank's first terminal
    /// notice of an expected rank while the request still waits (what a
    /// staged-done notice needs to count: a duplicate, a stranger or a late
    /// one changes nothing).
    pub fn would_count(&self, rank: ProducerRank) -> bool {
        self.phase == ConsumerPhase::Waiting && self.expected.contains(&rank) && !self.ended.contains(&rank)
    }

    pub fn expected_count(&self) -> usize {
        self.expected.len()
    }

    fn all_ended(&self) -> bool {
        self.ended.len() == self.expected.len()
    }

    pub fn on_event(&mut self, ev: ConsumerEvent) -> Vec<ConsumerEffect> {
        use ConsumerEffect as E;
        use ConsumerPhase as P;
        match ev {
            ConsumerEvent::Notice {
                generation,
                rank,
                outcome,
                reason,
                bytes,
            } => {
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
                            }
                            Outcome::Failed | Outcome::Aborted => {
                                let why = reason.unwrap_or_else(|| "no reason given".into());
                                let what = if outcome == Outcome::Failed {
                                    "failure"
                                } else {
                                    "abort"
                                };
                                if self.reason.is_none() {
                                    self.reason =
                                        Some(format!("producer rank {} reported {what}: {why}", rank.0));
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
                P::Complete | P::Failed | P::Waiting => {
                    self.phase = P::Releasing;
                    vec![]
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fsm::test_support::*;

    fn notice(g: u64, rank: u32, outcome: Outcome) -> ConsumerEvent {
        ConsumerEvent::Notice {
            generation: Generation(g),
            rank: ProducerRank(rank),
            outcome,
            reason: None,
            bytes: 10,
        }
    }

    fn consumer(expected: u32) -> ConsumerMachine {
        ConsumerMachine::new(rid(), Generation(1), (0..expected).map(ProducerRank).collect())
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
        assert!(c.on_event(ConsumerEvent::Release).is_empty());
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
        assert!(c.on_event(ConsumerEvent::Release).is_empty());
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
        assert!(c.on_event(ConsumerEvent::Release).is_empty());
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
