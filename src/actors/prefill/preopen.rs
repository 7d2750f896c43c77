//! The pre-open life of a producer request: handshakes that arrived before
//! vLLM scheduled the request on prefill (parked) and cancels that arrived
//! before it (remembered). Both are client-reachable input, so both are
//! bounded (count and bytes, all together and per source address), keyed
//! by the request's capability (a stranger without it can neither replace
//! nor cancel the real one), and expire at the handshake deadline on a
//! timer. Nothing is ever evicted to make room: a cancel answered `fenced`
//! relies on being remembered until its request would open (rule 10,
//! `docs/architecture.md`), so a full budget refuses the newcomer instead.
//!
//! Per-source budgets: a source (the side channel's peer: an IPv4 address,
//! or an IPv6 address's /64, one host's usual share) holds at most
//! [`PreOpenLimits::max_entries_per_source`] entries and
//! [`PreOpenLimits::max_bytes_per_source`] bytes (a quarter of the table by
//! default), so one address flooding cancels for made-up request IDs is
//! refused `503` at its own share while another address's genuine early
//! cancel is still remembered and answered `fenced`. The trade-off: a
//! source is an address, not a consumer. Decode ranks on one host share
//! that host's share with everything else there — a stranger on decode's
//! own host (or behind the same NAT) can spend it, and then that host's
//! early cancels are refused (decode keeps its deadline and quarantine, as
//! before this budget); and a flood from more addresses than the table has
//! shares can still fill the table as a whole. Handshakes and cancels that
//! the process itself hands over (no source: the Python binding's calls)
//! count against the table only.

use std::collections::HashMap;
use std::net::IpAddr;
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
    /// Approximate bytes of parked handshakes and remembered cancels (their
    /// request ID, capability and reason), all together.
    pub max_bytes: usize,
    /// Entries one source address may hold (see the module's doc).
    pub max_entries_per_source: usize,
    /// Bytes one source address may hold.
    pub max_bytes_per_source: usize,
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
            max_entries_per_source: 4096 / PER_SOURCE_SHARE,
            max_bytes_per_source: (64 << 20) / PER_SOURCE_SHARE,
            max_per_request: 16,
        }
    }
}

/// One source's share of the table when not set: a quarter.
pub const PER_SOURCE_SHARE: usize = 4;

/// Fixed bytes counted for a remembered cancel or discard, beside its
/// request ID, capability and reason.
const NOTE_BYTES: usize = 128;

/// Whom a pre-open entry is charged to: an IPv4 address (an IPv4-mapped
/// IPv6 one as such), or an IPv6 address's /64.
pub fn source_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into()),
        },
    }
}

/// Entries and bytes held.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Usage {
    entries: usize,
    bytes: usize,
}

/// What the table holds, all together and by source.
#[derive(Debug, Default)]
struct Budget {
    total: Usage,
    by_source: HashMap<IpAddr, Usage>,
}

impl Budget {
    /// Refuses one more entry (`new_entry`) or `extra` bytes beyond the
    /// table's or `source`'s budget.
    fn check(
        &self,
        limits: &PreOpenLimits,
        source: Option<IpAddr>,
        new_entry: bool,
        extra: usize,
    ) -> Result<(), RuntimeError> {
        let over = |what: String| Err(RuntimeError::Overloaded(what));
        if new_entry && self.total.entries >= limits.max_entries {
            return over(format!(
                "{} handshakes/cancels already wait to be opened",
                self.total.entries
            ));
        }
        if self.total.bytes + extra > limits.max_bytes {
            return over(format!(
                "handshakes/cancels waiting to be opened hold {} bytes",
                self.total.bytes
            ));
        }
        if let Some(ip) = source {
            let u = self.by_source.get(&ip).copied().unwrap_or_default();
            if new_entry && u.entries >= limits.max_entries_per_source {
                return over(format!(
                    "{ip} already has {} handshakes/cancels waiting to be opened, its share",
                    u.entries
                ));
            }
            if u.bytes + extra > limits.max_bytes_per_source {
                return over(format!(
                    "{ip}'s handshakes/cancels waiting to be opened hold {} bytes, its share",
                    u.bytes
                ));
            }
        }
        Ok(())
    }

    fn add(&mut self, source: Option<IpAddr>, entries: usize, bytes: usize) {
        self.total.entries += entries;
        self.total.bytes += bytes;
        if let Some(ip) = source {
            let u = self.by_source.entry(ip).or_default();
            u.entries += entries;
            u.bytes += bytes;
        }
    }

    fn sub(&mut self, source: Option<IpAddr>, entries: usize, bytes: usize) {
        self.total.entries -= entries;
        self.total.bytes -= bytes;
        if let Some(ip) = source {
            if let Some(u) = self.by_source.get_mut(&ip) {
                u.entries -= entries;
                u.bytes -= bytes;
                if *u == Usage::default() {
                    self.by_source.remove(&ip);
                }
            }
        }
    }

    /// An entry leaves the table.
    fn remove(&mut self, e: &Entry) {
        self.sub(e.source, 1, e.bytes);
    }

    /// `e` now holds `bytes`.
    fn resize(&mut self, e: &mut Entry, bytes: usize) {
        self.sub(e.source, 0, e.bytes);
        self.add(e.source, 0, bytes);
        e.bytes = bytes;
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
    /// Whom it is charged to ([`source_key`]); `None`: the process itself.
    source: Option<IpAddr>,
    bytes: usize,
    at: Instant,
}

/// Bytes of a remembered cancel or discard under `request` and `capability`
/// with these reasons.
fn note_bytes(request: &RequestId, capability: &Capability, cancel: usize, discarded: usize) -> usize {
    NOTE_BYTES + request.as_str().len() + capability.as_str().len() + cancel + discarded
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
    budget: Budget,
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
            budget: Budget::default(),
        }
    }

    pub fn limits(&self) -> PreOpenLimits {
        self.limits
    }

    /// Entries and bytes held now.
    pub fn usage(&self) -> (usize, usize) {
        (self.budget.total.entries, self.budget.total.bytes)
    }

    /// Entries and bytes charged to `ip`'s source now.
    pub fn usage_of(&self, ip: IpAddr) -> (usize, usize) {
        let u = self
            .budget
            .by_source
            .get(&source_key(ip))
            .copied()
            .unwrap_or_default();
        (u.entries, u.bytes)
    }

    /// The entry of `request` under `capability` for `consumer_rank`
    /// (`None`: the request's cancel or discard), made if there is none and
    /// the budgets allow; `size` gives the bytes it will hold (given the
    /// entry as it is, if any), checked against the budgets before anything
    /// changes. Returns it, and the budget to [`Budget::resize`] it with.
    fn slot(
        &mut self,
        request: &RequestId,
        capability: &Capability,
        consumer_rank: Option<u32>,
        source: Option<IpAddr>,
        size: impl FnOnce(Option<&Entry>) -> usize,
    ) -> Result<(&mut Entry, &mut Budget), RuntimeError> {
        let list = self.by_request.get(request);
        let existing = list.and_then(|l| {
            l.iter()
                .position(|e| e.consumer_rank == consumer_rank && e.capability.matches(capability))
        });
        let current = existing.and_then(|i| list.map(|l| &l[i]));
        let bytes = size(current);
        let (charged, extra) = match current {
            Some(e) => (e.source, bytes.saturating_sub(e.bytes)),
            None => {
                if list.is_some_and(|l| l.len() >= self.limits.max_per_request) {
                    return Err(RuntimeError::Overloaded(format!(
                        "{} handshakes or cancels already wait for request {request}",
                        self.limits.max_per_request
                    )));
                }
                (source.map(source_key), bytes)
            }
        };
        self.budget
            .check(&self.limits, charged, existing.is_none(), extra)?;
        let list = self.by_request.entry(request.clone()).or_default();
        let i = match existing {
            Some(i) => i,
            None => {
                self.budget.add(charged, 1, 0);
                list.push(Entry {
                    capability: capability.clone(),
                    consumer_rank,
                    handshake: None,
                    cancel: None,
                    discarded: None,
                    source: charged,
                    bytes: 0,
                    at: Instant::now(),
                });
                list.len() - 1
            }
        };
        Ok((&mut list[i], &mut self.budget))
    }

    /// Parks `h` until its request opens, charged to `source` (the peer it
    /// came from; `None`: the process itself). Per consumer rank and capability
    /// the newest authorization wins — the greatest sequence
    /// ([`Handshake::supersedes`]), whatever the generations' values, which
    /// are random: an older one arriving late is dropped, and so is another
    /// generation under the same sequence. The same handshake again (the
    /// publisher's retry) replaces itself. Handshakes under other
    /// capabilities wait beside it and never replace it.
    pub fn park(&mut self, h: Arc<Handshake>, source: Option<IpAddr>) -> Result<Parked, RuntimeError> {
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
        let (slot, budget) = self.slot(&request, &capability, Some(h.layout.tp_rank), source, |_| bytes)?;
        if slot
            .handshake
            .as_ref()
            .is_some_and(|old| old.generation != h.generation && !h.supersedes(old))
        {
            return Ok(Parked::Stale);
        }
        budget.resize(slot, bytes);
        slot.handshake = Some(h);
        slot.at = Instant::now();
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
        let size = |e: Option<&Entry>| {
            let cancel = e.and_then(|e| e.cancel.as_ref()).map_or(0, String::len);
            note_bytes(request, capability, cancel, reason.len())
        };
        let (slot, budget) = self.slot(request, capability, None, None, size)?;
        let bytes = size(Some(slot));
        budget.resize(slot, bytes);
        slot.discarded = Some(reason);
        slot.at = Instant::now();
        Ok(parked)
    }

    /// Remembers that the holder of `capability` cancelled `request`,
    /// charged to `source` (the peer it came from; `None`: the process
    /// itself); the handshakes parked under it are dropped.
    pub fn cancel(
        &mut self,
        request: &RequestId,
        capability: &Capability,
        reason: String,
        source: Option<IpAddr>,
    ) -> Result<(), RuntimeError> {
        let size = |e: Option<&Entry>| {
            let discarded = e.and_then(|e| e.discarded.as_ref()).map_or(0, String::len);
            note_bytes(request, capability, reason.len(), discarded)
        };
        self.drop_handshakes(request, capability);
        let (slot, budget) = self.slot(request, capability, None, source, size)?;
        let bytes = size(Some(slot));
        budget.resize(slot, bytes);
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
        let budget = &mut self.budget;
        list.retain_mut(|e| {
            let drop = e.consumer_rank.is_some() && e.capability.matches(capability);
            if drop {
                budget.remove(e);
                out.extend(e.handshake.take());
            }
            !drop
        });
        if list.is_empty() {
            self.by_request.remove(request);
        }
        out
    }

    /// Everything waiting for `request`: what its own capability left (a
    /// handshake per consumer rank, a cancel), and a count of strangers'
    /// entries (all removed).
    pub fn take(&mut self, request: &RequestId, capability: &Capability) -> Taken {
        let mut out = Taken::default();
        let ttl = self.limits.ttl;
        for e in self.by_request.remove(request).unwrap_or_default() {
            self.budget.remove(&e);
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
        let budget = &mut self.budget;
        self.by_request.retain(|_, list| {
            list.retain(|e| {
                let keep = now.saturating_duration_since(e.at) < ttl;
                if !keep {
                    dropped += 1;
                    budget.remove(e);
                }
                keep
            });
            !list.is_empty()
        });
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
            tokens: 0,
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
            max_entries_per_source: 8,
            max_bytes_per_source: 64 << 10,
            max_per_request: 2,
        }
    }

    #[test]
    fn a_stranger_neither_replaces_nor_is_taken() {
        let mut p = PreOpen::new(limits());
        p.park(hs("r", 'a', 5, 2), None).unwrap();
        p.park(hs("r", 'b', 9, 2), None).unwrap(); // forged, newer sequence
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
        p.park(hs("r", 'a', 7, 2), None).unwrap();
        assert_eq!(p.park(hs("r", 'a', 3, 2), None).unwrap(), Parked::Stale); // older, late
        let t = p.take(&RequestId::new("r"), &cap('a'));
        assert_eq!(t.handshakes[0].generation, gen(7));
        p.park(hs("r", 'a', 3, 2), None).unwrap();
        assert_eq!(p.park(hs("r", 'a', 8, 2), None).unwrap(), Parked::Waiting);
        assert_eq!(
            p.take(&RequestId::new("r"), &cap('a')).handshakes[0].generation,
            gen(8)
        );
        // The same handshake again (a retry) stays; another generation
        // under the same sequence does not replace it.
        let first = hs("r", 'a', 4, 2);
        p.park(first.clone(), None).unwrap();
        assert_eq!(p.park(first.clone(), None).unwrap(), Parked::Waiting);
        let mut tie = (*first).clone();
        tie.generation = Generation(1);
        assert_eq!(p.park(Arc::new(tie), None).unwrap(), Parked::Stale);
        assert_eq!(
            p.take(&RequestId::new("r"), &cap('a')).handshakes[0].generation,
            gen(4)
        );
    }

    #[test]
    fn a_cancel_counts_only_under_its_capability() {
        let mut p = PreOpen::new(limits());
        p.park(hs("r", 'a', 1, 2), None).unwrap();
        p.cancel(&RequestId::new("r"), &cap('b'), "stranger".into(), None)
            .unwrap();
        let t = p.take(&RequestId::new("r"), &cap('a'));
        assert!(t.handshakes.len() == 1 && t.cancel.is_none());
        p.park(hs("r", 'a', 1, 2), None).unwrap();
        p.cancel(&RequestId::new("r"), &cap('a'), "client left".into(), None)
            .unwrap();
        let t = p.take(&RequestId::new("r"), &cap('a'));
        assert!(t.handshakes.is_empty());
        assert_eq!(t.cancel.as_deref(), Some("client left"));
    }

    #[test]
    fn budgets_refuse_instead_of_growing() {
        let mut p = PreOpen::new(limits());
        p.park(hs("r", 'a', 1, 1), None).unwrap();
        p.park(hs("r", 'b', 1, 1), None).unwrap();
        assert!(matches!(
            p.park(hs("r", 'c', 1, 1), None),
            Err(RuntimeError::Overloaded(_))
        ));
        for i in 0..6 {
            p.park(hs(&format!("x{i}"), 'a', 1, 1), None).unwrap();
        }
        assert!(matches!(
            p.park(hs("y", 'a', 1, 1), None),
            Err(RuntimeError::Overloaded(_))
        ));
        assert!(matches!(
            p.cancel(&RequestId::new("y"), &cap('a'), String::new(), None),
            Err(RuntimeError::Overloaded(_))
        ));
        // bytes: one handshake of 16k blocks is over the 64 KiB budget
        let mut p = PreOpen::new(limits());
        assert!(matches!(
            p.park(hs("big", 'a', 1, 16 << 10), None),
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
        p.park(Arc::new(h1), None).unwrap();
        p.park(Arc::new(h0), None).unwrap();
        let taken = p.take(&RequestId::new("r"), &cap('a'));
        let mut ranks: Vec<u32> = taken.handshakes.iter().map(|h| h.layout.tp_rank).collect();
        ranks.sort();
        assert_eq!(ranks, vec![0, 1]);
    }

    #[test]
    fn a_discarded_request_answers_its_handshake_at_once() {
        let mut p = PreOpen::new(limits());
        p.park(hs("r", 'a', 1, 2), None).unwrap();
        let parked = p
            .discard(&RequestId::new("r"), &cap('a'), "aborted while queued".into())
            .unwrap();
        assert_eq!(parked[0].generation, gen(1));
        assert_eq!(
            p.park(hs("r", 'a', 2, 2), None).unwrap(),
            Parked::Discarded("aborted while queued".into())
        );
        // a stranger's handshake is not answered for it
        assert_eq!(p.park(hs("r", 'b', 2, 2), None).unwrap(), Parked::Waiting);
        assert_eq!(p.usage().0, 2);
    }

    /// Issue 44: one address's flood is refused at its share, another's
    /// cancel is still remembered, nothing is evicted, and every byte
    /// (a cancel's ID, capability and reason) is counted and given back.
    #[test]
    fn each_source_holds_at_most_its_share_and_cancels_count_their_bytes() {
        let (a, b): (IpAddr, IpAddr) = ("127.0.0.2".parse().unwrap(), "127.0.0.1".parse().unwrap());
        let mut p = PreOpen::new(PreOpenLimits {
            max_entries_per_source: 3,
            max_bytes_per_source: 4 << 10,
            ..limits()
        });
        for i in 0..3 {
            p.cancel(
                &RequestId::new(format!("x{i}")),
                &cap('f'),
                "flood".into(),
                Some(a),
            )
            .unwrap();
        }
        let refused = p.cancel(&RequestId::new("x3"), &cap('f'), "flood".into(), Some(a));
        assert!(matches!(refused, Err(RuntimeError::Overloaded(m)) if m.contains("127.0.0.2")));
        p.park(hs("y", 'f', 1, 1), Some(a)).unwrap_err();
        // Another address still has its share; the flood's entries stay.
        p.cancel(&RequestId::new("r"), &cap('a'), "client left".into(), Some(b))
            .unwrap();
        assert_eq!(p.usage().0, 4);
        let each = NOTE_BYTES + "x0".len() + 32 + "flood".len();
        assert_eq!(p.usage_of(a), (3, 3 * each));
        assert_eq!(p.usage_of(b).0, 1);
        assert_eq!(
            p.take(&RequestId::new("r"), &cap('a')).cancel.as_deref(),
            Some("client left")
        );
        assert_eq!(p.usage_of(b), (0, 0));
        // Bytes: a 3 KiB reason fits the 4 KiB share once, not twice.
        let long = "z".repeat(3 << 10);
        p.cancel(&RequestId::new("l1"), &cap('a'), long.clone(), Some(b))
            .unwrap();
        assert!(p.usage_of(b).1 > 3 << 10);
        assert!(p.cancel(&RequestId::new("l2"), &cap('a'), long, Some(b)).is_err());
        // An IPv6 source is its /64; an IPv4-mapped one, its IPv4 address.
        let v6 = |s: &str| source_key(s.parse().unwrap());
        assert_eq!(v6("2001:db8:1:2::1"), v6("2001:db8:1:2:ffff::9"));
        assert_ne!(v6("2001:db8:1:2::1"), v6("2001:db8:1:3::1"));
        assert_eq!(v6("::ffff:127.0.0.2"), a);
        // The process's own entries (no source) count in the table only.
        assert_eq!(p.expire(Instant::now() + Duration::from_secs(61)), 4);
        assert_eq!(
            (p.usage(), p.usage_of(a), p.usage_of(b)),
            ((0, 0), (0, 0), (0, 0))
        );
    }

    #[test]
    fn expiry_frees_everything_past_the_deadline() {
        let mut p = PreOpen::new(limits());
        p.park(hs("r", 'a', 1, 4), None).unwrap();
        p.cancel(&RequestId::new("s"), &cap('a'), String::new(), None)
            .unwrap();
        assert_eq!(p.expire(Instant::now()), 0);
        assert_eq!(p.expire(Instant::now() + Duration::from_secs(61)), 2);
        assert_eq!(p.usage(), (0, 0));
        assert!(p.take(&RequestId::new("r"), &cap('a')).handshakes.is_empty());
    }
}
