//! The pre-open life of a producer request: handshakes that arrived before
//! vLLM scheduled the request on prefill (parked) and cancels that arrived
//! before it (remembered). Both are client-reachable input, so both are
//! bounded (count and bytes), keyed by the request's capability (a stranger
//! without it can neither replace nor cancel the real one), and expire at
//! the handshake deadline on a timer.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

// The actors' clock (tokio's): paused in the paused-time tests, the
// system clock otherwise.
use actix::clock::Instant;

use crate::error::RuntimeError;
use crate::ids::{Capability, RequestId};
use crate::wire::Handshake;

/// Bounds of what may wait for `producer_open`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreOpenLimits {
    /// How long a parked handshake or an early cancel stays valid.
    pub ttl: Duration,
    /// Parked handshakes and remembered cancels, all requests together.
    pub max_entries: usize,
    /// Approximate bytes of parked handshakes, all together.
    pub max_bytes: usize,
    /// Distinct capabilities waiting under one request ID (the real one
    /// and a few strangers'); more is refused.
    pub max_per_request: usize,
}

impl Default for PreOpenLimits {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(120),
            max_entries: 4096,
            max_bytes: 64 << 20,
            max_per_request: 16,
        }
    }
}

#[derive(Debug)]
struct Entry {
    capability: Capability,
    /// The consumer (decode) rank of a parked handshake; `None` for a
    /// cancel or a discard, which concern the whole request.
    consumer_rank: Option<u32>,
    handshake: Option<Arc<Handshake>>,
    cancel: Option<String>,
    /// Prefill itself gave the request up before opening it: a handshake
    /// under this capability is answered `aborted` at once.
    discarded: Option<String>,
    bytes: usize,
    at: Instant,
}

/// What became of a handshake offered to [`PreOpen::park`].
#[derive(Debug, PartialEq, Eq)]
pub enum Parked {
    /// It waits for `producer_open`.
    Waiting,
    /// An older authorization than the one already parked (its sequence is
    /// not after that one's, [`Handshake::supersedes`]): dropped.
    Stale,
    /// Prefill already gave the request up (the reason): the consumer must
    /// be told `aborted` now.
    Discarded(String),
}

/// What `take` hands the opening producer.
#[derive(Debug, Default)]
pub struct Taken {
    /// The handshakes parked under the producer's capability, one per
    /// consumer rank.
    pub handshakes: Vec<Arc<Handshake>>,
    /// A cancel remembered under the producer's capability.
    pub cancel: Option<String>,
    /// Entries under other capabilities, discarded.
    pub strangers: usize,
}

/// Parked handshakes and early cancels (one instance per runtime).
#[derive(Debug)]
pub struct PreOpen {
    limits: PreOpenLimits,
    by_request: HashMap<RequestId, Vec<Entry>>,
    entries: usize,
    bytes: usize,
}

/// Rough memory of a parked handshake.
fn handshake_bytes(h: &Handshake) -> usize {
    let planes: usize = h.layout.layers.iter().map(|l| l.planes.len()).sum();
    256 + h.request_id.as_str().len() + h.endpoint.len() + h.block_ids.len() * 4 + planes * 24
}

impl PreOpen {
    pub fn new(limits: PreOpenLimits) -> Self {
        Self {
            limits,
            by_request: HashMap::new(),
            entries: 0,
            bytes: 0,
        }
    }

    pub fn limits(&self) -> PreOpenLimits {
        self.limits
    }

    /// Entries and bytes held now.
    pub fn usage(&self) -> (usize, usize) {
        (self.entries, self.bytes)
    }

    fn slot(
        &mut self,
        request: &RequestId,
        capability: &Capability,
        consumer_rank: Option<u32>,
        extra_bytes: usize,
    ) -> Result<&mut Entry, RuntimeError> {
        let overloaded = |what: String| Err(RuntimeError::Overloaded(what));
        let list = self.by_request.get(request);
        let existing = list.and_then(|l| {
            l.iter()
                .position(|e| e.consumer_rank == consumer_rank && e.capability.matches(capability))
        });
        if existing.is_none() {
            if list.is_some_and(|l| l.len() >= self.limits.max_per_request) {
                return overloaded(format!(
                    "{} handshakes or cancels already wait for request {request}",
                    self.limits.max_per_request
                ));
            }
            if self.entries >= self.limits.max_entries {
                return overloaded(format!(
                    "{} handshakes/cancels already wait to be opened",
                    self.entries
                ));
            }
        }
        if self.bytes + extra_bytes > self.limits.max_bytes {
            return overloaded(format!("parked handshakes hold {} bytes", self.bytes));
        }
        let list = self.by_request.entry(request.clone()).or_default();
        let i = match existing {
            Some(i) => i,
            None => {
                self.entries += 1;
                list.push(Entry {
                    capability: capability.clone(),
                    consumer_rank,
                    handshake: None,
                    cancel: None,
                    discarded: None,
                    bytes: 0,
                    at: Instant::now(),
                });
                list.len() - 1
            }
        };
        Ok(&mut list[i])
    }

    /// Parks `h` until its request opens. Per consumer rank and capability
    /// the newest authorization wins — the greatest sequence
    /// ([`Handshake::supersedes`]), whatever the generations' values, which
    /// are random: an older one arriving late is dropped, and so is another
    /// generation under the same sequence. The same handshake again (the
    /// publisher's retry) replaces itself. Handshakes under other
    /// capabilities wait beside it and never replace it.
    pub fn park(&mut self, h: Arc<Handshake>) -> Result<Parked, RuntimeError> {
        let bytes = handshake_bytes(&h);
        let (request, capability) = (h.request_id.clone(), h.capability.clone());
        let discarded = self.by_request.get(&request).and_then(|l| {
            l.iter()
                .find(|e| e.consumer_rank.is_none() && e.capability.matches(&capability))
                .and_then(|e| e.discarded.clone())
        });
        if let Some(reason) = discarded {
            return Ok(Parked::Discarded(reason));
        }
        let slot = self.slot(&request, &capability, Some(h.layout.tp_rank), bytes)?;
        if slot
            .handshake
            .as_ref()
            .is_some_and(|old| old.generation != h.generation && !h.supersedes(old))
        {
            return Ok(Parked::Stale);
        }
        let freed = std::mem::replace(&mut slot.bytes, bytes);
        slot.handshake = Some(h);
        slot.at = Instant::now();
        self.bytes = self.bytes + bytes - freed;
        Ok(Parked::Waiting)
    }

    /// Prefill gives `request` up before opening it (vLLM finished it while
    /// queued). Returns the handshakes parked under `capability`, whose
    /// consumers must be told `aborted`; one arriving later (until the
    /// deadline) gets [`Parked::Discarded`].
    pub fn discard(
        &mut self,
        request: &RequestId,
        capability: &Capability,
        reason: String,
    ) -> Result<Vec<Arc<Handshake>>, RuntimeError> {
        let parked = self.drop_handshakes(request, capability);
        let slot = self.slot(request, capability, None, 0)?;
        slot.discarded = Some(reason);
        slot.at = Instant::now();
        Ok(parked)
    }

    /// Remembers that the holder of `capability` cancelled `request`; the
    /// handshakes parked under it are dropped.
    pub fn cancel(
        &mut self,
        request: &RequestId,
        capability: &Capability,
        reason: String,
    ) -> Result<(), RuntimeError> {
        self.drop_handshakes(request, capability);
        let slot = self.slot(request, capability, None, 0)?;
        slot.cancel = Some(reason);
        slot.at = Instant::now();
        Ok(())
    }

    /// Removes and returns the handshakes parked for `request` under
    /// `capability`.
    fn drop_handshakes(&mut self, request: &RequestId, capability: &Capability) -> Vec<Arc<Handshake>> {
        let mut out = Vec::new();
        let Some(list) = self.by_request.get_mut(request) else {
            return out;
        };
        let (mut entries, mut bytes) = (self.entries, self.bytes);
        list.retain_mut(|e| {
            let drop = e.consumer_rank.is_some() && e.capability.matches(capability);
            if drop {
                entries -= 1;
                bytes -= e.bytes;
                out.extend(e.handshake.take());
            }
            !drop
        });
        if list.is_empty() {
            self.by_request.remove(request);
        }
        (self.entries, self.bytes) = (entries, bytes);
        out
    }

    /// Everything waiting for `request`: what its own capability left (a
    /// handshake per consumer rank, a cancel), and a count of strangers'
    /// entries (all removed).
    pub fn take(&mut self, request: &RequestId, capability: &Capability) -> Taken {
        let mut out = Taken::default();
        let ttl = self.limits.ttl;
        for e in self.by_request.remove(request).unwrap_or_default() {
            self.entries -= 1;
            self.bytes -= e.bytes;
            if !e.capability.matches(capability) {
                out.strangers += 1;
            } else if e.at.elapsed() < ttl {
                // One parked past the deadline is stale: its consumer may
                // have failed and freed the blocks it names.
                out.handshakes.extend(e.handshake);
                if e.cancel.is_some() {
                    out.cancel = e.cancel;
                }
            }
        }
        out
    }

    /// Drops what waited past the deadline; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let ttl = self.limits.ttl;
        let mut dropped = 0;
        let (mut entries, mut bytes) = (self.entries, self.bytes);
        self.by_request.retain(|_, list| {
            list.retain(|e| {
                let keep = now.saturating_duration_since(e.at) < ttl;
                if !keep {
                    dropped += 1;
                    entries -= 1;
                    bytes -= e.bytes;
                }
                keep
            });
            !list.is_empty()
        });
        (self.entries, self.bytes) = (entries, bytes);
        dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Generation, NoticeKey, Sequence};
    use crate::layout::KvLayout;
    use crate::wire::WIRE_VERSION;

    fn cap(c: char) -> Capability {
        Capability::parse(&c.to_string().repeat(32)).unwrap()
    }

    /// A handshake whose sequence is `sequence` and whose generation value
    /// runs the other way (so that nothing here passes by ordering
    /// generations).
    fn hs(request: &str, c: char, sequence: u64, blocks: u32) -> Arc<Handshake> {
        Arc::new(Handshake {
            version: WIRE_VERSION,
            request_id: RequestId::new(request),
            capability: cap(c),
            generation: gen(sequence),
            sequence: Sequence(sequence),
            notice_key: NoticeKey::random(),
            endpoint: "127.0.0.1:1".into(),
            expected_producers: 1,
            first_block: 0,
            block_ids: (0..blocks).collect(),
            layout: KvLayout::packed(0x1000, 1, 1024, 64, (0, 1), 1),
            expires_unix_ms: 0,
            staging: None,
        })
    }

    fn gen(sequence: u64) -> Generation {
        Generation(u64::MAX - sequence)
    }

    fn limits() -> PreOpenLimits {
        PreOpenLimits {
            ttl: Duration::from_secs(60),
            max_entries: 8,
            max_bytes: 64 << 10,
            max_per_request: 2,
        }
    }

    #[test]
    fn a_stranger_neither_replaces_nor_is_taken() {
        let mut p = PreOpen::new(limits());
        p.park(hs("r", 'a', 5, 2)).unwrap();
        p.park(hs("r", 'b', 9, 2)).unwrap(); // forged, newer sequence
        let t = p.take(&RequestId::new("r"), &cap('a'));
        assert_eq!(t.handshakes.len(), 1);
        assert_eq!(t.handshakes[0].generation, gen(5));
        assert_eq!(t.strangers, 1);
        assert_eq!(p.usage(), (0, 0));
    }

    // The newest authorization is the greatest sequence; `hs` gives the
    // newer one the smaller generation value.
    #[test]
    fn under_one_capability_the_newest_authorization_wins() {
        let mut p = PreOpen::new(limits());
        p.park(hs("r", 'a', 7, 2)).unwrap();
        assert_eq!(p.park(hs("r", 'a', 3, 2)).unwrap(), Parked::Stale); // older, late
        let t = p.take(&RequestId::new("r"), &cap('a'));
        assert_eq!(t.handshakes[0].generation, gen(7));
        p.park(hs("r", 'a', 3, 2)).unwrap();
        assert_eq!(p.park(hs("r", 'a', 8, 2)).unwrap(), Parked::Waiting);
        assert_eq!(
            p.take(&RequestId::new("r"), &cap('a')).handshakes[0].generation,
            gen(8)
        );
        // The same handshake again (a retry) stays; another generation
        // under the same sequence does not replace it.
        let first = hs("r", 'a', 4, 2);
        p.park(first.clone()).unwrap();
        assert_eq!(p.park(first.clone()).unwrap(), Parked::Waiting);
        let mut tie = (*first).clone();
        tie.generation = Generation(1);
        assert_eq!(p.park(Arc::new(tie)).unwrap(), Parked::Stale);
        assert_eq!(
            p.take(&RequestId::new("r"), &cap('a')).handshakes[0].generation,
            gen(4)
        );
    }

    #[test]
    fn a_cancel_counts_only_under_its_capability() {
        let mut p = PreOpen::new(limits());
        p.park(hs("r", 'a', 1, 2)).unwrap();
        p.cancel(&RequestId::new("r"), &cap('b'), "stranger".into())
            .unwrap();
        let t = p.take(&RequestId::new("r"), &cap('a'));
        assert!(t.handshakes.len() == 1 && t.cancel.is_none());
        p.park(hs("r", 'a', 1, 2)).unwrap();
        p.cancel(&RequestId::new("r"), &cap('a'), "client left".into())
            .unwrap();
        let t = p.take(&RequestId::new("r"), &cap('a'));
        assert!(t.handshakes.is_empty());
        assert_eq!(t.cancel.as_deref(), Some("client left"));
    }

    #[test]
    fn budgets_refuse_instead_of_growing() {
        let mut p = PreOpen::new(limits());
        p.park(hs("r", 'a', 1, 1)).unwrap();
        p.park(hs("r", 'b', 1, 1)).unwrap();
        assert!(matches!(
            p.park(hs("r", 'c', 1, 1)),
            Err(RuntimeError::Overloaded(_))
        ));
        for i in 0..6 {
            p.park(hs(&format!("x{i}"), 'a', 1, 1)).unwrap();
        }
        assert!(matches!(
            p.park(hs("y", 'a', 1, 1)),
            Err(RuntimeError::Overloaded(_))
        ));
        assert!(matches!(
            p.cancel(&RequestId::new("y"), &cap('a'), String::new()),
            Err(RuntimeError::Overloaded(_))
        ));
        // bytes: one handshake of 16k blocks is over the 64 KiB budget
        let mut p = PreOpen::new(limits());
        assert!(matches!(
            p.park(hs("big", 'a', 1, 16 << 10)),
            Err(RuntimeError::Overloaded(_))
        ));
        assert_eq!(p.usage(), (0, 0));
    }

    #[test]
    fn each_consumer_rank_parks_its_own_handshake() {
        // Prefill TP 1 -> decode TP 2: both decode ranks' handshakes (same
        // request, same capability, own generations) wait side by side.
        let mut p = PreOpen::new(limits());
        let mut h1 = (*hs("r", 'a', 9, 2)).clone();
        (h1.layout.tp_rank, h1.layout.tp_size) = (1, 2);
        let mut h0 = h1.clone();
        (h0.layout.tp_rank, h0.generation, h0.sequence) = (0, gen(3), Sequence(3));
        p.park(Arc::new(h1)).unwrap();
        p.park(Arc::new(h0)).unwrap();
        let taken = p.take(&RequestId::new("r"), &cap('a'));
        let mut ranks: Vec<u32> = taken.handshakes.iter().map(|h| h.layout.tp_rank).collect();
        ranks.sort();
        assert_eq!(ranks, vec![0, 1]);
    }

    #[test]
    fn a_discarded_request_answers_its_handshake_at_once() {
        let mut p = PreOpen::new(limits());
        p.park(hs("r", 'a', 1, 2)).unwrap();
        let parked = p
            .discard(&RequestId::new("r"), &cap('a'), "aborted while queued".into())
            .unwrap();
        assert_eq!(parked[0].generation, gen(1));
        assert_eq!(
            p.park(hs("r", 'a', 2, 2)).unwrap(),
            Parked::Discarded("aborted while queued".into())
        );
        // a stranger's handshake is not answered for it
        assert_eq!(p.park(hs("r", 'b', 2, 2)).unwrap(), Parked::Waiting);
        assert_eq!(p.usage().0, 2);
    }

    #[test]
    fn expiry_frees_everything_past_the_deadline() {
        let mut p = PreOpen::new(limits());
        p.park(hs("r", 'a', 1, 4)).unwrap();
        p.cancel(&RequestId::new("s"), &cap('a'), String::new()).unwrap();
        assert_eq!(p.expire(Instant::now()), 0);
        assert_eq!(p.expire(Instant::now() + Duration::from_secs(61)), 2);
        assert_eq!(p.usage(), (0, 0));
        assert!(p.take(&RequestId::new("r"), &cap('a')).handshakes.is_empty());
    }
}
