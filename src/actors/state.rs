//! The pure state machines under the request actors: no I/O, no clocks, no
//! actix. Each actor feeds its machine events and carries out the effects it
//! returns, so every rule of the safety contract is a plain unit test here.
//!
//! The contract (numbered as in `docs/architecture.md`):
//! 1. The destination advertises only ranges allocated for the request —
//!    a producer plans writes only from the handshake it captured, and only
//!    into that handshake's authorized blocks.
//! 2. A transfer notification is accepted only for the matching request ID
//!    (and generation): others are dropped and counted, never delivered.
//! 3. The decode side waits for the expected number of producer notifications.
//! 4. Failure/abort notifications never publish the destination as complete.
//! 5. Queued writes carry the generation and the captured authorization;
//!    reusing a request ID cannot redirect an old write into new pages.
//!    Chunks share a generation only while authorization and mapping are
//!    unchanged (a changed handshake under the same generation is refused).
//! 6. Producer release waits for admitted writes to drain, also after
//!    another write reported an error.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::Arc;

use crate::ids::{Generation, ProducerRank, RequestId};
use crate::wire::{Handshake, Outcome};

/// Why an event was dropped instead of acted on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dropped {
    /// Carries another generation than the one authorized.
    StaleGeneration { got: Generation, current: Generation },
    /// A producer rank that does not feed this consumer rank.
    UnexpectedRank(ProducerRank),
    /// The same producer reported twice.
    Duplicate(ProducerRank),
    /// The request already reached a terminal outcome.
    AfterTerminal,
    /// A write completion the producer never admitted.
    UnknownWrite(u64),
    /// A handshake under the current generation that changes the authorization.
    AuthorizationChanged,
    /// A handshake whose generation is older than the captured one.
    OlderHandshake { got: Generation, current: Generation },
}

// ------------------------------------------------------------------------
// Consumer (decode side)
// ------------------------------------------------------------------------

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

// ------------------------------------------------------------------------
// Producer (prefill side)
// ------------------------------------------------------------------------

/// Identity of one admitted write (a layer's chunk under one generation).
pub type WriteId = u64;

/// Events of a producer request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProducerEvent {
    /// A consumer's handshake, already validated against the local layout.
    Handshake(Arc<Handshake>),
    /// Prefill finished `layer` for request blocks `blocks` (indices into
    /// the request's block list).
    LayerReady { layer: u32, blocks: Range<u32> },
    /// An admitted write completed.
    WriteDone {
        write: WriteId,
        generation: Generation,
        bytes: u64,
    },
    /// An admitted write failed.
    WriteFailed {
        write: WriteId,
        generation: Generation,
        reason: String,
    },
    /// vLLM finished the request on the prefill side: no more layers come.
    Finish,
    /// Stop: the request was aborted, or the runtime shuts down.
    Abort { reason: String },
    /// The handshake did not arrive in time.
    TimedOut,
}

/// What the producer actor must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProducerEffect {
    /// Plan and submit this write, into `auth`'s blocks only.
    Submit {
        write: WriteId,
        generation: Generation,
        layer: u32,
        blocks: Range<u32>,
        auth: Arc<Handshake>,
    },
    /// Tell the consumer (the endpoint of `auth`) how it ended.
    Notify {
        auth: Arc<Handshake>,
        outcome: Outcome,
        reason: Option<String>,
        bytes: u64,
    },
    /// Nothing is in flight any more: the source blocks may be freed.
    Release {
        outcome: Outcome,
        reason: Option<String>,
    },
    /// An event was ignored.
    Dropped(Dropped),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProducerPhase {
    /// Taking layers; writing them once a handshake is captured.
    Streaming,
    /// Stopping (finished, failed or aborted); waiting for writes to drain.
    Draining,
    Released,
}

impl ProducerPhase {
    pub fn name(self) -> &'static str {
        match self {
            Self::Streaming => "streaming",
            Self::Draining => "draining",
            Self::Released => "released",
        }
    }
}

/// The prefill side of one request.
#[derive(Debug, Clone)]
pub struct ProducerMachine {
    pub request: RequestId,
    phase: ProducerPhase,
    auth: Option<Arc<Handshake>>,
    /// Every (layer, blocks) prefill reported, in order.
    ready: Vec<(u32, Range<u32>)>,
    /// Admitted writes not yet completed: id -> generation.
    in_flight: BTreeMap<WriteId, Generation>,
    next_write: WriteId,
    finished: bool,
    /// The first error or abort; it decides the outcome.
    stop: Option<(Outcome, String)>,
    bytes: u64,
}

impl ProducerMachine {
    pub fn new(request: RequestId) -> Self {
        Self {
            request,
            phase: ProducerPhase::Streaming,
            auth: None,
            ready: Vec::new(),
            in_flight: BTreeMap::new(),
            next_write: 1,
            finished: false,
            stop: None,
            bytes: 0,
        }
    }

    pub fn phase(&self) -> ProducerPhase {
        self.phase
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    pub fn generation(&self) -> Option<Generation> {
        self.auth.as_ref().map(|a| a.generation)
    }

    pub fn has_handshake(&self) -> bool {
        self.auth.is_some()
    }

    /// vLLM finished the request here: no more layers are taken.
    pub fn finished(&self) -> bool {
        self.finished
    }

    fn submit(&mut self, layer: u32, blocks: Range<u32>, out: &mut Vec<ProducerEffect>) {
        let Some(auth) = &self.auth else { return };
        let write = self.next_write;
        self.next_write += 1;
        self.in_flight.insert(write, auth.generation);
        out.push(ProducerEffect::Submit {
            write,
            generation: auth.generation,
            layer,
            blocks,
            auth: auth.clone(),
        });
    }

    /// Once stopping and drained: notify (when a consumer is known) and release.
    fn settle(&mut self, out: &mut Vec<ProducerEffect>) {
        if self.phase == ProducerPhase::Released || !self.in_flight.is_empty() {
            return;
        }
        let (outcome, reason) = match &self.stop {
            Some((o, r)) => (*o, Some(r.clone())),
            // Rule 7: done only when every layer of every authorized block
            // was reported; a gap (a model path that skipped the per-layer
            // save) fails the request instead of publishing stale pages.
            None if self.finished && self.auth.is_some() => match self.uncovered() {
                None => (Outcome::Done, None),
                Some(gap) => (Outcome::Failed, Some(gap)),
            },
            None => return,
        };
        self.phase = ProducerPhase::Released;
        if let Some(auth) = &self.auth {
            out.push(ProducerEffect::Notify {
                auth: auth.clone(),
                outcome,
                reason: reason.clone(),
                bytes: self.bytes,
            });
        }
        out.push(ProducerEffect::Release { outcome, reason });
    }

    /// The first (layer, block) of the authorization that no `LayerReady`
    /// covered, said in words; `None` when every layer of request blocks
    /// `first_block..first_block + block_ids.len()` was reported.
    fn uncovered(&self) -> Option<String> {
        let auth = self.auth.as_ref()?;
        let start = auth.first_block;
        let Some(end) = u32::try_from(auth.block_ids.len())
            .ok()
            .and_then(|n| start.checked_add(n))
        else {
            return Some("authorization larger than a request can be".into());
        };
        if start >= end {
            return None;
        }
        let mut spans: Vec<Range<u32>> = Vec::new();
        for layer in 0..auth.layout.layers.len() as u32 {
            spans.clear();
            spans.extend(
                self.ready
                    .iter()
                    .filter(|(l, _)| *l == layer)
                    .map(|(_, b)| b.clone()),
            );
            spans.sort_by_key(|r| r.start);
            let mut reach = start;
            for s in &spans {
                if s.start > reach {
                    break;
                }
                reach = reach.max(s.end);
            }
            if reach < end {
                return Some(format!(
                    "prefill finished without saving layer {layer} of request block {reach} \
                     (blocks {start}..{end} were authorized): the per-layer save hook was skipped"
                ));
            }
        }
        None
    }

    fn stop_with(&mut self, outcome: Outcome, reason: String) {
        if self.stop.is_none() {
            self.stop = Some((outcome, reason));
        }
        self.phase = ProducerPhase::Draining;
    }

    pub fn on_event(&mut self, ev: ProducerEvent) -> Vec<ProducerEffect> {
        let mut out = Vec::new();
        if self.phase == ProducerPhase::Released {
            out.push(ProducerEffect::Dropped(Dropped::AfterTerminal));
            return out;
        }
        match ev {
            ProducerEvent::Handshake(h) => {
                if self.phase != ProducerPhase::Streaming || self.stop.is_some() {
                    out.push(ProducerEffect::Dropped(Dropped::AfterTerminal));
                    return out;
                }
                match &self.auth {
                    Some(cur) if cur.generation == h.generation => {
                        if **cur != *h {
                            out.push(ProducerEffect::Dropped(Dropped::AuthorizationChanged));
                        }
                        return out;
                    }
                    Some(cur) if h.generation < cur.generation => {
                        out.push(ProducerEffect::Dropped(Dropped::OlderHandshake {
                            got: h.generation,
                            current: cur.generation,
                        }));
                        return out;
                    }
                    _ => {}
                }
                // First handshake, or a newer generation (request ID reused on
                // the consumer): everything ready so far is written under it.
                // Writes of older generations keep their own authorization.
                self.auth = Some(h);
                self.bytes = 0;
                let ready = self.ready.clone();
                for (layer, blocks) in ready {
                    self.submit(layer, blocks, &mut out);
                }
                if self.finished {
                    self.phase = ProducerPhase::Draining;
                    self.settle(&mut out);
                }
            }
            ProducerEvent::LayerReady { layer, blocks } => {
                if self.phase != ProducerPhase::Streaming || self.finished {
                    out.push(ProducerEffect::Dropped(Dropped::AfterTerminal));
                    return out;
                }
                self.ready.push((layer, blocks.clone()));
                self.submit(layer, blocks, &mut out);
            }
            ProducerEvent::WriteDone {
                write,
                generation,
                bytes,
            } => {
                match self.in_flight.remove(&write) {
                    Some(g) if g == generation => {
                        if Some(g) == self.generation() {
                            self.bytes += bytes;
                        }
                    }
                    Some(g) => {
                        // Keep the bookkeeping right, but say so.
                        out.push(ProducerEffect::Dropped(Dropped::StaleGeneration {
                            got: generation,
                            current: g,
                        }));
                    }
                    None => out.push(ProducerEffect::Dropped(Dropped::UnknownWrite(write))),
                }
                self.settle(&mut out);
            }
            ProducerEvent::WriteFailed {
                write,
                generation,
                reason,
            } => {
                match self.in_flight.remove(&write) {
                    Some(g) if Some(g) == self.generation() => {
                        self.stop_with(Outcome::Failed, reason);
                    }
                    Some(_) => {
                        // A write for a superseded generation failed: it no
                        // longer decides this request's outcome.
                        let _ = generation;
                    }
                    None => out.push(ProducerEffect::Dropped(Dropped::UnknownWrite(write))),
                }
                self.settle(&mut out);
            }
            ProducerEvent::Finish => {
                self.finished = true;
                if self.auth.is_some() {
                    self.phase = ProducerPhase::Draining;
                }
                self.settle(&mut out);
            }
            ProducerEvent::Abort { reason } => {
                self.stop_with(Outcome::Aborted, reason);
                self.settle(&mut out);
            }
            ProducerEvent::TimedOut => {
                if self.auth.is_none() {
                    self.stop_with(
                        Outcome::Failed,
                        "no handshake from the consumer before the deadline".into(),
                    );
                } else {
                    self.stop_with(Outcome::Failed, "writes did not drain before the deadline".into());
                }
                self.settle(&mut out);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::tests::layout;
    use crate::wire::WIRE_VERSION;

    fn rid() -> RequestId {
        RequestId::new("r1")
    }

    fn hs(generation: u64, blocks: Vec<u32>) -> Arc<Handshake> {
        hs_layers(generation, blocks, 2)
    }

    /// A handshake of a model with `layers` layers.
    fn hs_layers(generation: u64, blocks: Vec<u32>, layers: u32) -> Arc<Handshake> {
        Arc::new(Handshake {
            version: WIRE_VERSION,
            request_id: rid(),
            capability: crate::ids::Capability::parse(&"c".repeat(32)).unwrap(),
            generation: Generation(generation),
            endpoint: "127.0.0.1:1000".into(),
            expected_producers: 1,
            first_block: 0,
            block_ids: blocks,
            layout: layout(0x10_0000, layers, 8, 256, (0, 1), 2),
            expires_unix_ms: 0,
        })
    }

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

    fn submits(fx: &[ProducerEffect]) -> Vec<(WriteId, Generation, u32)> {
        fx.iter()
            .filter_map(|e| match e {
                ProducerEffect::Submit {
                    write,
                    generation,
                    layer,
                    ..
                } => Some((*write, *generation, *layer)),
                _ => None,
            })
            .collect()
    }

    // Rule 1: no write before an authorization; layers ready early are
    // written on its arrival, into its blocks.
    #[test]
    fn rule1_no_write_without_authorization() {
        let mut p = ProducerMachine::new(rid());
        assert!(p
            .on_event(ProducerEvent::LayerReady {
                layer: 0,
                blocks: 0..2
            })
            .is_empty());
        assert!(p
            .on_event(ProducerEvent::LayerReady {
                layer: 1,
                blocks: 0..2
            })
            .is_empty());
        let fx = p.on_event(ProducerEvent::Handshake(hs(1, vec![4, 5])));
        assert_eq!(submits(&fx).iter().map(|s| s.2).collect::<Vec<_>>(), vec![0, 1]);
        for e in &fx {
            if let ProducerEffect::Submit { auth, generation, .. } = e {
                assert_eq!(auth.generation, *generation);
                assert_eq!(auth.block_ids, vec![4, 5]);
            }
        }
    }

    // Rule 5: a new generation never redirects writes already admitted, and a
    // changed authorization under the same generation is refused.
    #[test]
    fn rule5_generation_fences_writes() {
        let mut p = ProducerMachine::new(rid());
        p.on_event(ProducerEvent::Handshake(hs_layers(1, vec![4, 5], 1)));
        let old = submits(&p.on_event(ProducerEvent::LayerReady {
            layer: 0,
            blocks: 0..2,
        }));
        assert_eq!(old[0].1, Generation(1));
        let fx = p.on_event(ProducerEvent::Handshake(hs_layers(1, vec![6, 7], 1)));
        assert_eq!(fx, vec![ProducerEffect::Dropped(Dropped::AuthorizationChanged)]);
        let fx = p.on_event(ProducerEvent::Handshake(hs_layers(2, vec![6, 7], 1)));
        let new = submits(&fx);
        assert_eq!(new.len(), 1);
        assert_eq!(new[0].1, Generation(2));
        assert!(matches!(
            p.on_event(ProducerEvent::Handshake(hs_layers(1, vec![4, 5], 1)))[..],
            [ProducerEffect::Dropped(Dropped::OlderHandshake { .. })]
        ));
        // the old write completing counts for nothing under generation 2
        p.on_event(ProducerEvent::WriteDone {
            write: old[0].0,
            generation: Generation(1),
            bytes: 99,
        });
        p.on_event(ProducerEvent::Finish);
        let fx = p.on_event(ProducerEvent::WriteDone {
            write: new[0].0,
            generation: Generation(2),
            bytes: 7,
        });
        assert!(fx.iter().any(|e| matches!(e, ProducerEffect::Notify { outcome: Outcome::Done, bytes: 7, auth, .. } if auth.generation == Generation(2))));
    }

    // Rule 6: release waits for every admitted write, also after an error.
    #[test]
    fn rule6_release_waits_for_drain_after_error() {
        let mut p = ProducerMachine::new(rid());
        p.on_event(ProducerEvent::Handshake(hs(1, vec![4, 5])));
        let a = submits(&p.on_event(ProducerEvent::LayerReady {
            layer: 0,
            blocks: 0..2,
        }))[0]
            .0;
        let b = submits(&p.on_event(ProducerEvent::LayerReady {
            layer: 1,
            blocks: 0..2,
        }))[0]
            .0;
        let fx = p.on_event(ProducerEvent::WriteFailed {
            write: a,
            generation: Generation(1),
            reason: "peer died".into(),
        });
        assert!(
            fx.is_empty(),
            "must not release while write {b} is in flight: {fx:?}"
        );
        assert_eq!(p.phase(), ProducerPhase::Draining);
        // no new writes after an error
        assert!(submits(&p.on_event(ProducerEvent::LayerReady {
            layer: 0,
            blocks: 2..3
        }))
        .is_empty());
        let fx = p.on_event(ProducerEvent::WriteDone {
            write: b,
            generation: Generation(1),
            bytes: 1,
        });
        assert!(matches!(
            fx[..],
            [
                ProducerEffect::Notify {
                    outcome: Outcome::Failed,
                    ..
                },
                ProducerEffect::Release {
                    outcome: Outcome::Failed,
                    ..
                }
            ]
        ));
    }

    /// Feeds `ready` (layer, blocks) to a producer authorized for request
    /// blocks `first..first + n`, finishes it, completes every write, and
    /// returns the outcome and reason it notified.
    fn finish_with(first: u32, n: u32, ready: &[(u32, Range<u32>)]) -> (Outcome, Option<String>) {
        let mut p = ProducerMachine::new(rid());
        let mut auth = (*hs(1, (10..10 + n).collect())).clone();
        auth.first_block = first;
        p.on_event(ProducerEvent::Handshake(Arc::new(auth)));
        let mut writes = Vec::new();
        for (layer, blocks) in ready {
            writes.extend(submits(&p.on_event(ProducerEvent::LayerReady {
                layer: *layer,
                blocks: blocks.clone(),
            })));
        }
        let mut fx = p.on_event(ProducerEvent::Finish);
        for (write, generation, _) in writes {
            fx.extend(p.on_event(ProducerEvent::WriteDone {
                write,
                generation,
                bytes: 1,
            }));
        }
        assert_eq!(p.phase(), ProducerPhase::Released, "{fx:?}");
        fx.into_iter()
            .find_map(|e| match e {
                ProducerEffect::Notify { outcome, reason, .. } => Some((outcome, reason)),
                _ => None,
            })
            .expect("a notice")
    }

    // Rule 7: done only when every layer of every authorized block was
    // reported; a skipped save hook fails the request, never publishes it.
    #[test]
    fn rule7_done_only_when_every_layer_of_every_block_was_reported() {
        // both layers, in two chunks that overlap on a partial block
        let all = [(0, 0..2), (1, 0..2), (0, 1..3), (1, 1..3)];
        assert_eq!(finish_with(0, 3, &all), (Outcome::Done, None));
        // layer 1 never reported (the hook skipped for it)
        let (o, why) = finish_with(0, 3, &[(0, 0..3)]);
        assert_eq!(o, Outcome::Failed);
        assert!(why.unwrap().contains("layer 1 of request block 0"));
        // a gap in the middle of layer 0
        let (o, why) = finish_with(0, 3, &[(0, 0..1), (0, 2..3), (1, 0..3)]);
        assert_eq!(o, Outcome::Failed);
        assert!(why.unwrap().contains("layer 0 of request block 1"));
        // no layer at all
        assert_eq!(finish_with(0, 2, &[]).0, Outcome::Failed);
        // blocks before first_block are the consumer's own: not needed
        assert_eq!(finish_with(2, 1, &[(0, 2..3), (1, 2..3)]), (Outcome::Done, None));
        // the handshake arrives after Finish: the same rule
        let mut p = ProducerMachine::new(rid());
        p.on_event(ProducerEvent::LayerReady {
            layer: 0,
            blocks: 0..1,
        });
        p.on_event(ProducerEvent::Finish);
        let fx = p.on_event(ProducerEvent::Handshake(hs(1, vec![4])));
        let w = submits(&fx);
        let fx = p.on_event(ProducerEvent::WriteDone {
            write: w[0].0,
            generation: w[0].1,
            bytes: 1,
        });
        assert!(matches!(
            fx[..],
            [
                ProducerEffect::Notify {
                    outcome: Outcome::Failed,
                    ..
                },
                ..
            ]
        ));
    }

    #[test]
    fn abort_drains_then_notifies_aborted() {
        let mut p = ProducerMachine::new(rid());
        p.on_event(ProducerEvent::Handshake(hs(1, vec![4])));
        let a = submits(&p.on_event(ProducerEvent::LayerReady {
            layer: 0,
            blocks: 0..1,
        }))[0]
            .0;
        assert!(p
            .on_event(ProducerEvent::Abort {
                reason: "client went away".into()
            })
            .is_empty());
        let fx = p.on_event(ProducerEvent::WriteDone {
            write: a,
            generation: Generation(1),
            bytes: 1,
        });
        assert!(matches!(
            fx[..],
            [
                ProducerEffect::Notify {
                    outcome: Outcome::Aborted,
                    ..
                },
                ProducerEffect::Release { .. }
            ]
        ));
        assert!(matches!(
            p.on_event(ProducerEvent::Finish)[..],
            [ProducerEffect::Dropped(Dropped::AfterTerminal)]
        ));
    }

    #[test]
    fn finish_before_handshake_waits_then_writes_everything() {
        let mut p = ProducerMachine::new(rid());
        p.on_event(ProducerEvent::LayerReady {
            layer: 0,
            blocks: 0..1,
        });
        assert!(p.on_event(ProducerEvent::Finish).is_empty());
        let w = submits(&p.on_event(ProducerEvent::Handshake(hs_layers(1, vec![4], 1))));
        assert_eq!(w.len(), 1);
        let fx = p.on_event(ProducerEvent::WriteDone {
            write: w[0].0,
            generation: Generation(1),
            bytes: 3,
        });
        assert!(matches!(
            fx[..],
            [
                ProducerEffect::Notify {
                    outcome: Outcome::Done,
                    bytes: 3,
                    ..
                },
                ProducerEffect::Release {
                    outcome: Outcome::Done,
                    ..
                }
            ]
        ));
    }

    #[test]
    fn no_handshake_before_deadline_releases_without_notice() {
        let mut p = ProducerMachine::new(rid());
        p.on_event(ProducerEvent::LayerReady {
            layer: 0,
            blocks: 0..1,
        });
        let fx = p.on_event(ProducerEvent::TimedOut);
        assert!(matches!(
            fx[..],
            [ProducerEffect::Release {
                outcome: Outcome::Failed,
                ..
            }]
        ));
    }

    #[test]
    fn unknown_write_is_dropped() {
        let mut p = ProducerMachine::new(rid());
        let fx = p.on_event(ProducerEvent::WriteDone {
            write: 42,
            generation: Generation(1),
            bytes: 1,
        });
        assert_eq!(fx, vec![ProducerEffect::Dropped(Dropped::UnknownWrite(42))]);
    }
}
