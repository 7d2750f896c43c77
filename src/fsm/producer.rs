//! The prefill side's machine: one per request and rank. It writes only
//! under the authorization it captured (rules 1, 5), releases the source
//! blocks only once admitted writes drained (rule 6), says `done` only
//! for KV it was given in full (rule 7), and never lets a write overtake an
//! earlier one into the same bytes (rule 8: chunked prefill sends a
//! chunk's partial last block again with the next chunk, and Mooncake does
//! not order batches, not even a writer lane's).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use super::Dropped;
use crate::ids::{Generation, MarkSeq, RequestId};
use crate::wire::{Fence, Handshake, Outcome};

/// Identity of one admitted write (a layer's chunk under one generation).
pub type WriteId = u64;

/// Events of a producer request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProducerEvent {
    /// A consumer's handshake, already validated against the local layout.
    Handshake(Arc<Handshake>),
    /// Prefill finished `layer` for request blocks `blocks` (indices into
    /// the request's block list); on a GPU, once mark `after` is reached
    /// (0: already written). The writer waits for the mark, not the machine.
    LayerReady {
        layer: u32,
        blocks: Range<u32>,
        after: MarkSeq,
    },
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
    /// Plan and submit this write, into `auth`'s blocks only, once mark
    /// `after` is reached.
    Submit {
        write: WriteId,
        generation: Generation,
        layer: u32,
        blocks: Range<u32>,
        after: MarkSeq,
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
    /// Every (layer, blocks, mark) prefill reported, in order.
    ready: Vec<(u32, Range<u32>, MarkSeq)>,
    /// Admitted writes not yet completed: id -> (generation, layer, blocks).
    in_flight: BTreeMap<WriteId, (Generation, u32, Range<u32>)>,
    /// Writes of the current authorization held back until an earlier
    /// write into the same layer and blocks ended (rule 8), in order.
    deferred: Vec<(u32, Range<u32>, MarkSeq)>,
    next_write: WriteId,
    finished: bool,
    /// Tokens per block on this (producer) side; `None`: the consumer's.
    block_size: Option<u32>,
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
            deferred: Vec::new(),
            next_write: 1,
            finished: false,
            block_size: None,
            stop: None,
            bytes: 0,
        }
    }

    /// The producer's tokens per block, where it may differ from the
    /// consumer's (what rule 7 counts the reported blocks in).
    pub fn with_block_size(mut self, block_size: u32) -> Self {
        self.block_size = Some(block_size);
        self
    }

    pub fn phase(&self) -> ProducerPhase {
        self.phase
    }

    /// Writes held back by rule 8 (waiting for an earlier write into the
    /// same layer and blocks to end).
    pub fn held_back(&self) -> usize {
        self.deferred.len()
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    pub fn generation(&self) -> Option<Generation> {
        self.auth.as_ref().map(|a| a.generation)
    }

    /// The authorization writes go under now (the latest handshake).
    pub fn authorization(&self) -> Option<&Arc<Handshake>> {
        self.auth.as_ref()
    }

    pub fn has_handshake(&self) -> bool {
        self.auth.is_some()
    }

    /// vLLM finished the request here: no more layers are taken.
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// Every (layer, blocks) prefill handed over so far, in order.
    pub fn ready_layers(&self) -> impl Iterator<Item = (u32, Range<u32>)> + '_ {
        self.ready.iter().map(|(l, b, _)| (*l, b.clone()))
    }

    /// Rule 8: whether a write of `layer`, `blocks` under the current
    /// authorization must wait, because an earlier one into some of the same
    /// blocks is in flight or waits itself.
    fn must_wait(&self, layer: u32, blocks: &Range<u32>) -> bool {
        let overlaps = |l: u32, b: &Range<u32>| l == layer && b.start < blocks.end && blocks.start < b.end;
        let generation = self.generation();
        self.in_flight
            .values()
            .any(|(g, l, b)| Some(*g) == generation && overlaps(*l, b))
            || self.deferred.iter().any(|(l, b, _)| overlaps(*l, b))
    }

    fn submit(&mut self, layer: u32, blocks: Range<u32>, after: MarkSeq, out: &mut Vec<ProducerEffect>) {
        if self.auth.is_none() {
            return;
        }
        if self.must_wait(layer, &blocks) {
            self.deferred.push((layer, blocks, after));
            return;
        }
        self.submit_now(layer, blocks, after, out);
    }

    /// After a write ended: the held-back writes that no longer overlap an
    /// earlier one go out, in order (none once the request is stopping on
    /// an error or an abort).
    fn submit_deferred(&mut self, out: &mut Vec<ProducerEffect>) {
        if self.stop.is_some() {
            self.deferred.clear();
            return;
        }
        let held = std::mem::take(&mut self.deferred);
        for (layer, blocks, after) in held {
            self.submit(layer, blocks, after, out);
        }
    }

    fn submit_now(&mut self, layer: u32, blocks: Range<u32>, after: MarkSeq, out: &mut Vec<ProducerEffect>) {
        let Some(auth) = &self.auth else { return };
        let write = self.next_write;
        self.next_write += 1;
        self.in_flight
            .insert(write, (auth.generation, layer, blocks.clone()));
        out.push(ProducerEffect::Submit {
            write,
            generation: auth.generation,
            layer,
            blocks,
            after,
            auth: auth.clone(),
        });
    }

    /// Rule 10, the fence: what may still be written into `generation`'s
    /// blocks by this producer (asked once it was aborted). It holds that
    /// generation: its notice follows once its writes drained (or was
    /// sent). Else a write admitted under that generation (superseded
    /// since) may still be in flight and no notice will name it, or it
    /// still streams and could take that generation's handshake: held.
    /// Else nothing can: fenced.
    pub fn fence(&self, generation: Generation) -> Fence {
        if self.generation() == Some(generation) {
            Fence::NoticeFollows
        } else if self.phase == ProducerPhase::Streaming
            || self.in_flight.values().any(|(g, _, _)| *g == generation)
        {
            Fence::Held
        } else {
            Fence::Fenced
        }
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
    /// covered, said in words; `None` when every layer of the tokens the
    /// consumer loads was reported: request blocks
    /// `first_block..first_block + n` of the consumer (`n`: the blocks of
    /// each group's segment of `block_ids`), up to its `tokens` where it
    /// says them. Counted in
    /// tokens, so a producer of another block size is held to the same rule.
    fn uncovered(&self) -> Option<String> {
        let auth = self.auth.as_ref()?;
        let cb = auth.layout.block_size.max(1) as u64;
        let pb = self.block_size.map_or(cb, |b| b.max(1) as u64);
        let start = auth.first_block as u64 * cb;
        let blocks = auth.layout.request_blocks(auth.block_ids.len()) as u64;
        let mut end = (auth.first_block as u64 + blocks) * cb;
        if auth.tokens != 0 {
            end = end.min(auth.tokens as u64);
        }
        if start >= end {
            return None;
        }
        let mut spans: Vec<Range<u32>> = Vec::new();
        for layer in 0..auth.layout.layers.len() as u32 {
            spans.clear();
            spans.extend(
                self.ready
                    .iter()
                    .filter(|(l, _, _)| *l == layer)
                    .map(|(_, b, _)| b.clone()),
            );
            spans.sort_by_key(|r| r.start);
            let mut reach = start;
            for s in &spans {
                if s.start as u64 * pb > reach {
                    break;
                }
                reach = reach.max(s.end as u64 * pb);
            }
            if reach < end {
                return Some(format!(
                    "prefill finished without saving layer {layer} of request block {} \
                     (tokens {start}..{end} were authorized): the per-layer save hook was skipped",
                    reach / pb
                ));
            }
        }
        None
    }

    fn stop_with(&mut self, outcome: Outcome, reason: String) {
        if self.stop.is_none() {
            self.stop = Some((outcome, reason));
        }
        // Nothing more is submitted (rule 6 waits only for what is in flight).
        self.deferred.clear();
        self.phase = ProducerPhase::Draining;
    }

    pub fn on_event(&mut self, ev: ProducerEvent) -> Vec<ProducerEffect> {
        let mut out = Vec::new();
        self.on_event_into(ev, &mut out);
        out
    }

    /// [`Self::on_event`], appending the effects to `out` (a buffer the
    /// caller reuses: the per-layer path allocates nothing for them).
    pub fn on_event_into(&mut self, ev: ProducerEvent, out: &mut Vec<ProducerEffect>) {
        if self.phase == ProducerPhase::Released {
            out.push(ProducerEffect::Dropped(Dropped::AfterTerminal));
            return;
        }
        match ev {
            ProducerEvent::Handshake(h) => {
                if self.phase != ProducerPhase::Streaming || self.stop.is_some() {
                    out.push(ProducerEffect::Dropped(Dropped::AfterTerminal));
                    return;
                }
                match &self.auth {
                    Some(cur) if cur.generation == h.generation => {
                        if **cur != *h {
                            out.push(ProducerEffect::Dropped(Dropped::AuthorizationChanged));
                        }
                        return;
                    }
                    // Which authorization is newer is said by the sequence,
                    // never by the generation (random): a late handshake of
                    // an earlier authorization is dropped, and so is one
                    // that does not say it is newer (an equal sequence under
                    // another generation: never redirect on a tie).
                    Some(cur) if !h.supersedes(cur) => {
                        out.push(ProducerEffect::Dropped(Dropped::OlderHandshake {
                            got: h.generation,
                            current: cur.generation,
                        }));
                        return;
                    }
                    _ => {}
                }
                // First handshake, or a newer authorization (request ID
                // reused on the consumer): everything ready so far is written
                // under it. Writes of older generations keep their own
                // authorization.
                self.auth = Some(h);
                self.bytes = 0;
                // What waited did so under the old authorization: all of it
                // is in `ready` and goes out again under the new one.
                self.deferred.clear();
                let ready = self.ready.clone();
                for (layer, blocks, after) in ready {
                    self.submit(layer, blocks, after, out);
                }
                if self.finished {
                    self.phase = ProducerPhase::Draining;
                    self.settle(out);
                }
            }
            ProducerEvent::LayerReady { layer, blocks, after } => {
                if self.phase != ProducerPhase::Streaming || self.finished {
                    out.push(ProducerEffect::Dropped(Dropped::AfterTerminal));
                    return;
                }
                self.ready.push((layer, blocks.clone(), after));
                self.submit(layer, blocks, after, out);
            }
            ProducerEvent::WriteDone {
                write,
                generation,
                bytes,
            } => {
                match self.in_flight.remove(&write).map(|(g, _, _)| g) {
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
                self.submit_deferred(out);
                self.settle(out);
            }
            ProducerEvent::WriteFailed {
                write,
                generation,
                reason,
            } => {
                match self.in_flight.remove(&write).map(|(g, _, _)| g) {
                    Some(g) => {
                        if g != generation {
                            // The report names another generation than the
                            // write was admitted under: say so (as for
                            // `WriteDone`); the admitted one decides below.
                            out.push(ProducerEffect::Dropped(Dropped::StaleGeneration {
                                got: generation,
                                current: g,
                            }));
                        }
                        // A write of the current generation failed: so does
                        // the request. One of a superseded generation no
                        // longer decides its outcome.
                        if Some(g) == self.generation() {
                            self.stop_with(Outcome::Failed, reason);
                        }
                    }
                    None => out.push(ProducerEffect::Dropped(Dropped::UnknownWrite(write))),
                }
                self.submit_deferred(out);
                self.settle(out);
            }
            ProducerEvent::Finish => {
                self.finished = true;
                if self.auth.is_some() {
                    self.phase = ProducerPhase::Draining;
                }
                self.settle(out);
            }
            ProducerEvent::Abort { reason } => {
                self.stop_with(Outcome::Aborted, reason);
                self.settle(out);
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
                self.settle(out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fsm::test_support::*;

    // Rule 10: a producer answers a cancel's fence `Fenced` only when
    // nothing can be written into that generation any more.
    #[test]
    fn rule10_the_fence_says_fenced_only_when_nothing_can_land() {
        // Never got the generation, aborted: fenced. Before the abort it
        // could still take the handshake: held.
        let mut p = ProducerMachine::new(rid());
        p.on_event(layer_ready(0, 0..2));
        assert_eq!(p.fence(Generation(1)), Fence::Held);
        p.on_event(ProducerEvent::Abort {
            reason: "cancel".into(),
        });
        assert_eq!(p.fence(Generation(1)), Fence::Fenced);
        // ...and it stays so: a late handshake of it is dropped.
        assert!(matches!(
            p.on_event(ProducerEvent::Handshake(hs(1, vec![4, 5])))[..],
            [ProducerEffect::Dropped(_)]
        ));
        assert_eq!(p.fence(Generation(1)), Fence::Fenced);

        // Holds the generation: its notice follows (after the drain).
        let mut p = ProducerMachine::new(rid());
        p.on_event(ProducerEvent::Handshake(hs(1, vec![4, 5])));
        let w = submits(&p.on_event(layer_ready(0, 0..2)))[0].0;
        p.on_event(ProducerEvent::Abort {
            reason: "cancel".into(),
        });
        assert_eq!(p.fence(Generation(1)), Fence::NoticeFollows);
        let fx = p.on_event(ProducerEvent::WriteDone {
            write: w,
            generation: Generation(1),
            bytes: 1,
        });
        assert!(fx.iter().any(|e| matches!(e, ProducerEffect::Notify { auth, outcome: Outcome::Aborted, .. } if auth.generation == Generation(1))));
        assert_eq!(p.fence(Generation(1)), Fence::NoticeFollows);

        // A write of an older generation still in flight after a newer
        // handshake: the old generation is held until it drained.
        let mut p = ProducerMachine::new(rid());
        p.on_event(ProducerEvent::Handshake(hs(1, vec![4, 5])));
        let old = submits(&p.on_event(layer_ready(0, 0..2)))[0].0;
        p.on_event(ProducerEvent::Handshake(hs(2, vec![6, 7])));
        p.on_event(ProducerEvent::Abort {
            reason: "cancel".into(),
        });
        assert_eq!(p.fence(Generation(1)), Fence::Held);
        p.on_event(ProducerEvent::WriteDone {
            write: old,
            generation: Generation(1),
            bytes: 1,
        });
        assert_eq!(p.fence(Generation(1)), Fence::Fenced);
    }

    /// `LayerReady` of a written layer (no mark to wait for).
    fn layer_ready(layer: u32, blocks: Range<u32>) -> ProducerEvent {
        ProducerEvent::LayerReady {
            layer,
            blocks,
            after: 0,
        }
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
        assert!(p.on_event(layer_ready(0, 0..2)).is_empty());
        assert!(p.on_event(layer_ready(1, 0..2)).is_empty());
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
        let old = submits(&p.on_event(layer_ready(0, 0..2)));
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

    // Generations are random: which handshake is newer is said by its
    // sequence, whatever the generations' values. A newer authorization with
    // a smaller generation value supersedes; a late, older one with a larger
    // value does not; a tie under another generation changes nothing.
    #[test]
    fn the_sequence_not_the_generation_value_decides_which_handshake_is_newer() {
        let with = |generation: u64, sequence: u64, blocks: Vec<u32>| {
            let mut h = (*hs_layers(generation, blocks, 1)).clone();
            h.sequence = crate::ids::Sequence(sequence);
            Arc::new(h)
        };
        let mut p = ProducerMachine::new(rid());
        p.on_event(ProducerEvent::Handshake(with(u64::MAX - 3, 10, vec![4, 5])));
        let old = submits(&p.on_event(layer_ready(0, 0..2)));
        assert_eq!(old[0].1, Generation(u64::MAX - 3));
        // Newer (sequence 11), with a far smaller generation value.
        let fx = p.on_event(ProducerEvent::Handshake(with(5, 11, vec![6, 7])));
        assert_eq!(
            submits(&fx).iter().map(|s| s.1).collect::<Vec<_>>(),
            vec![Generation(5)]
        );
        assert_eq!(p.generation(), Some(Generation(5)));
        // The first authorization's handshake again, late, and an older one
        // with the largest generation value: dropped.
        for late in [with(u64::MAX - 3, 10, vec![4, 5]), with(u64::MAX, 9, vec![0, 1])] {
            assert!(matches!(
                p.on_event(ProducerEvent::Handshake(late))[..],
                [ProducerEffect::Dropped(Dropped::OlderHandshake { .. })]
            ));
        }
        // The same sequence under another generation: not newer, dropped.
        assert!(matches!(
            p.on_event(ProducerEvent::Handshake(with(6, 11, vec![0, 1])))[..],
            [ProducerEffect::Dropped(Dropped::OlderHandshake { .. })]
        ));
        assert_eq!(p.generation(), Some(Generation(5)));
    }

    // Rule 5: a failure of a write admitted under an older generation
    // cannot fail the current one; a failure of a current write fails it,
    // whatever generation its report names.
    #[test]
    fn rule5_a_stale_failure_never_fails_a_new_generation() {
        let mut p = ProducerMachine::new(rid());
        p.on_event(ProducerEvent::Handshake(hs_layers(1, vec![4, 5], 1)));
        let old = submits(&p.on_event(layer_ready(0, 0..2)))[0].0;
        let new = submits(&p.on_event(ProducerEvent::Handshake(hs_layers(2, vec![6, 7], 1))))[0].0;
        // The old write fails: generation 2 goes on.
        let fx = p.on_event(ProducerEvent::WriteFailed {
            write: old,
            generation: Generation(1),
            reason: "old peer died".into(),
        });
        assert!(fx.is_empty(), "{fx:?}");
        assert_eq!(p.phase(), ProducerPhase::Streaming);
        p.on_event(ProducerEvent::Finish);
        // The new write fails under a report that names generation 1: the
        // mismatch is said, and the request still fails (its pages may be
        // unwritten).
        let fx = p.on_event(ProducerEvent::WriteFailed {
            write: new,
            generation: Generation(1),
            reason: "peer died".into(),
        });
        assert!(fx.contains(&ProducerEffect::Dropped(Dropped::StaleGeneration {
            got: Generation(1),
            current: Generation(2)
        })));
        assert!(
            fx.iter()
                .any(|e| matches!(e, ProducerEffect::Notify { outcome: Outcome::Failed, auth, .. } if auth.generation == Generation(2))),
            "{fx:?}"
        );
    }

    // Rule 6: release waits for every admitted write, also after an error.
    #[test]
    fn rule6_release_waits_for_drain_after_error() {
        let mut p = ProducerMachine::new(rid());
        p.on_event(ProducerEvent::Handshake(hs(1, vec![4, 5])));
        let a = submits(&p.on_event(layer_ready(0, 0..2)))[0].0;
        let b = submits(&p.on_event(layer_ready(1, 0..2)))[0].0;
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
        assert!(submits(&p.on_event(layer_ready(0, 2..3))).is_empty());
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
        finish_sized(first, n, None, 0, ready)
    }

    /// [`finish_with`] for a producer whose blocks hold `producer_block`
    /// tokens (the consumer's 16 when `None`) and a consumer that loads
    /// `tokens` (0: not said).
    fn finish_sized(
        first: u32,
        n: u32,
        producer_block: Option<u32>,
        tokens: u32,
        ready: &[(u32, Range<u32>)],
    ) -> (Outcome, Option<String>) {
        let mut p = ProducerMachine::new(rid());
        if let Some(b) = producer_block {
            p = p.with_block_size(b);
        }
        let mut auth = (*hs(1, (10..10 + n).collect())).clone();
        auth.first_block = first;
        auth.tokens = tokens;
        p.on_event(ProducerEvent::Handshake(Arc::new(auth)));
        let mut writes = Vec::new();
        for (layer, blocks) in ready {
            writes.extend(submits(&p.on_event(layer_ready(*layer, blocks.clone()))));
        }
        let mut fx = p.on_event(ProducerEvent::Finish);
        // Writes held back by rule 8 go out as earlier ones end: complete those too.
        while let Some((write, generation, _)) = writes.pop() {
            let more = p.on_event(ProducerEvent::WriteDone {
                write,
                generation,
                bytes: 1,
            });
            writes.extend(submits(&more));
            fx.extend(more);
        }
        assert_eq!(p.phase(), ProducerPhase::Released, "{fx:?}");
        fx.into_iter()
            .find_map(|e| match e {
                ProducerEffect::Notify { outcome, reason, .. } => Some((outcome, reason)),
                _ => None,
            })
            .expect("a notice")
    }

    // Rule 8: a write never overtakes an earlier one into the same bytes.
    // Chunked prefill sends a chunk's partial last block again with the
    // next chunk; were both in flight, Mooncake could land the stale one last.
    #[test]
    fn rule8_an_overlapping_write_waits_for_the_earlier_one() {
        let mut p = ProducerMachine::new(rid());
        p.on_event(ProducerEvent::Handshake(hs_layers(1, vec![4, 5, 6], 2)));
        let first = submits(&p.on_event(layer_ready(0, 0..2)));
        assert_eq!(first.len(), 1);
        // the same layer, overlapping on block 1: held back
        assert!(submits(&p.on_event(layer_ready(0, 1..3))).is_empty());
        // another layer, or blocks apart: not held
        assert_eq!(submits(&p.on_event(layer_ready(1, 0..3))).len(), 1);
        p.on_event(ProducerEvent::Finish);
        assert_eq!(p.in_flight(), 2);
        // the earlier write ends: the held one goes out, and only then can
        // the request be done
        let fx = p.on_event(ProducerEvent::WriteDone {
            write: first[0].0,
            generation: first[0].1,
            bytes: 1,
        });
        let next = submits(&fx);
        assert_eq!(next.iter().map(|s| s.2).collect::<Vec<_>>(), vec![0]);
        assert!(!fx.iter().any(|e| matches!(e, ProducerEffect::Notify { .. })));
        for e in fx {
            if let ProducerEffect::Submit { blocks, .. } = e {
                assert_eq!(blocks, 1..3);
            }
        }
        let ids: Vec<_> = p.in_flight.keys().copied().collect();
        let mut fx = Vec::new();
        for w in ids {
            fx = p.on_event(ProducerEvent::WriteDone {
                write: w,
                generation: Generation(1),
                bytes: 1,
            });
        }
        assert!(
            fx.iter().any(|e| matches!(
                e,
                ProducerEffect::Notify {
                    outcome: Outcome::Done,
                    ..
                }
            )),
            "{fx:?}"
        );
    }

    // Rule 8 with a failure: what was held back is never submitted once the
    // request stops, and the release still waits only for what is in flight.
    /// A write carries the layer mark of its own `LayerReady` through
    /// everything that delays it: a handshake not yet in, a rule-8 hold, and
    /// the replay under a newer generation (the writer waits for it).
    #[test]
    fn a_write_keeps_the_mark_of_its_own_layer_ready() {
        fn marks(fx: &[ProducerEffect]) -> Vec<(u32, Range<u32>, MarkSeq)> {
            fx.iter()
                .filter_map(|e| match e {
                    ProducerEffect::Submit {
                        layer, blocks, after, ..
                    } => Some((*layer, blocks.clone(), *after)),
                    _ => None,
                })
                .collect()
        }
        let mut p = ProducerMachine::new(rid());
        // Before the handshake: taken, submitted with their marks once it comes.
        assert!(marks(&p.on_event(ProducerEvent::LayerReady {
            layer: 0,
            blocks: 0..2,
            after: 7,
        }))
        .is_empty());
        let fx = p.on_event(ProducerEvent::Handshake(hs_layers(1, vec![4, 5, 6], 2)));
        assert_eq!(marks(&fx), vec![(0, 0..2, 7)]);
        let first = submits(&fx);
        // Held behind the earlier write (rule 8), then out with its own mark.
        assert!(marks(&p.on_event(ProducerEvent::LayerReady {
            layer: 0,
            blocks: 1..3,
            after: 9,
        }))
        .is_empty());
        let fx = p.on_event(ProducerEvent::WriteDone {
            write: first[0].0,
            generation: first[0].1,
            bytes: 1,
        });
        assert_eq!(marks(&fx), vec![(0, 1..3, 9)]);
        // A newer generation writes everything again, each with its mark.
        let mut newer = (*hs_layers(1, vec![1, 2, 3], 2)).clone();
        newer.generation = Generation(first[0].1 .0 + 1);
        newer.sequence = crate::ids::Sequence(newer.sequence.0 + 1);
        let fx = p.on_event(ProducerEvent::Handshake(Arc::new(newer)));
        assert_eq!(marks(&fx), vec![(0, 0..2, 7)], "1..3 waits behind 0..2 again");
    }

    #[test]
    fn rule8_held_writes_are_dropped_when_the_request_stops() {
        let mut p = ProducerMachine::new(rid());
        p.on_event(ProducerEvent::Handshake(hs_layers(1, vec![4, 5, 6], 1)));
        let first = submits(&p.on_event(layer_ready(0, 0..2)));
        assert!(submits(&p.on_event(layer_ready(0, 1..3))).is_empty());
        p.on_event(ProducerEvent::Abort {
            reason: "client gone".into(),
        });
        let fx = p.on_event(ProducerEvent::WriteDone {
            write: first[0].0,
            generation: first[0].1,
            bytes: 1,
        });
        assert!(submits(&fx).is_empty(), "{fx:?}");
        assert!(fx.iter().any(|e| matches!(
            e,
            ProducerEffect::Release {
                outcome: Outcome::Aborted,
                ..
            }
        )));
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
        // Blocks of 8 tokens into blocks of 16, 43 tokens loaded (three
        // consumer blocks): prefill blocks 0..6 cover them, 0..5 do not;
        // with decode's first block its own, prefill blocks from 2 on.
        let both = |r: Range<u32>| [(0, r.clone()), (1, r)];
        assert_eq!(
            finish_sized(0, 3, Some(8), 43, &both(0..6)),
            (Outcome::Done, None)
        );
        let (o, why) = finish_sized(0, 3, Some(8), 43, &both(0..5));
        assert_eq!(o, Outcome::Failed);
        assert!(why.unwrap().contains("of request block 5"));
        assert_eq!(
            finish_sized(1, 2, Some(8), 43, &both(2..6)),
            (Outcome::Done, None)
        );
        assert_eq!(finish_sized(1, 2, Some(8), 43, &both(3..6)).0, Outcome::Failed);
        // And the other way: blocks of 32 into blocks of 16.
        assert_eq!(
            finish_sized(0, 3, Some(32), 43, &both(0..2)),
            (Outcome::Done, None)
        );
        assert_eq!(finish_sized(0, 3, Some(32), 43, &both(0..1)).0, Outcome::Failed);
        // the handshake arrives after Finish: the same rule
        let mut p = ProducerMachine::new(rid());
        p.on_event(layer_ready(0, 0..1));
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
        let a = submits(&p.on_event(layer_ready(0, 0..1)))[0].0;
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
        p.on_event(layer_ready(0, 0..1));
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
        p.on_event(layer_ready(0, 0..1));
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
