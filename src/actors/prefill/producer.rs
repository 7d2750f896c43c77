//! The prefill side's request actor: one per (request, decode rank it sends
//! to). It owns the captured authorization through its
//! [`crate::fsm::ProducerMachine`], plans each admitted write with
//! [`crate::layout::plan_write`] under that authorization, hands it to a
//! layer writer, and carries out the other effects. Handlers stay thin;
//! failures travel as messages.
//!
//! **A layer handed over on the caller's thread.** The actor's state sits
//! in an [`ActorCell`] (the execution model and its locking rules:
//! [`crate::actors::cell`]), and the façade reaches it through a
//! [`ProducerRef`], which counts every message it sends the actor until the
//! actor handled it. A `LayerReady` runs the actor's handler on the
//! caller's own thread (an inline run) when nothing sent to the actor
//! before it is still unhandled; otherwise it is queued like any other
//! message. Either way the machine sees every event
//! one at a time and in the order the caller caused them (an
//! `add_blocks` answered before a `layer_ready` is handled before it), so
//! the rules and their proofs are unchanged; what changes is that the
//! common layer costs no thread crossing to reach its layer writer, and,
//! when that writer is idle and the write waits for no mark, none to reach
//! `submit_write` ([`super::writer::LaneRef::write`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use parking_lot::Mutex;
use tracing::Span;

use super::writer::WriterPool;
use crate::actors::cell::{ActorCell, Wait};
use crate::actors::messages::*;
use crate::actors::stats::{Stats, Timing, Timings};
use crate::fsm::*;
use crate::ids::{Generation, ProducerRank, RequestId};
use crate::layout::HOLE;
use crate::layout::{plan_write, KvLayout};
use crate::staging::{GivenPiece, LayerSource, SharedArena, SourceKind, StagedPlan};
use crate::wire::{Handshake, Notice, WIRE_VERSION};

pub use crate::actors::messages::EXPIRED;

/// Why a write was not submitted after the prefill's pages went back to
/// vLLM ([`give_back_pages`]): its layer has no piece, because decode's
/// authorization came after the pages went and cannot be written from the
/// pieces (blocks of another size or other heads).
pub const PAGES_GONE: &str = "prefill gave its KV pages back to vLLM and this layer is in no layer piece: \
     decode recomputes it";

/// What every producer actor of a rank shares (the request directory holds
/// it and hands each actor a reference).
pub struct ProducerShared {
    pub local: Arc<KvLayout>,
    pub writers: Arc<WriterPool>,
    /// How long a producer waits for its consumer's handshake.
    pub handshake_timeout: Duration,
    /// Below this many ranges a layer, a write from source staging goes
    /// straight into pages rather than into a grant (`StagedPlan::new`).
    pub staging_min_ranges: usize,
    pub stats: Arc<Stats>,
    /// Range lists the producers of this runtime plan into (given back with
    /// each `LayerWritten`).
    pub buffers: RangeBuffers,
    /// Where the layer pieces of requests staged by layer come from
    /// (`source_staging_region`; `None`: no such region).
    pub source_arena: Option<SharedArena>,
    /// What the authorizations of requests staged by layer were like
    /// (whether prefill's pages may go back before decode authorized).
    pub decode_staged: DecodeStaged,
    /// A request staged by layer that finds no room for a layer gives back
    /// the pieces no write took and takes no more
    /// (`RuntimeConfig::pieces_whole_requests`).
    pub pieces_whole_requests: bool,
}

/// Whether the decode instances this rank wrote to so far take its layer
/// pieces: every authorization of a request staged by layer written from
/// staging (`Yes`), or one was not (`No`: blocks of another size, other
/// heads; sticky). Prefill's pages go back before decode authorized only
/// under `Yes` ([`give_back_pages`]): a decode that cannot take the pieces
/// would find no pages to be written from.
#[derive(Debug, Default)]
pub struct DecodeStaged(std::sync::atomic::AtomicU8);

impl DecodeStaged {
    const YES: u8 = 1;
    const NO: u8 = 2;

    /// An authorization of a request staged by layer was planned: written
    /// from staging (`staged`) or not.
    pub fn saw(&self, staged: bool) {
        if staged {
            let _ = self
                .0
                .compare_exchange(0, Self::YES, Ordering::AcqRel, Ordering::Acquire);
        } else if self.0.swap(Self::NO, Ordering::AcqRel) != Self::NO {
            tracing::warn!(
                "a decode authorization cannot be written from layer pieces (blocks of another size or \
                 other heads): prefill's pages are no longer given back before decode authorizes"
            );
        }
    }

    /// Whether every authorization so far (one at least) took the pieces.
    pub fn all_staged(&self) -> bool {
        self.0.load(Ordering::Acquire) == Self::YES
    }
}

/// Range lists kept for the next layers' plans, shared by the producers of
/// a runtime: a producer keeps a few of its own, and the rest come back
/// here instead of being freed (on the system thread) and allocated again
/// (on the caller's) while many writes are in flight. Bounded: at most
/// [`Self::KEPT`] lists of at most [`Self::MAX_RANGES`] ranges each.
#[derive(Default)]
pub struct RangeBuffers(Mutex<Vec<Vec<crate::transport::WriteRange>>>);

impl RangeBuffers {
    /// Lists kept at most (about 3 MiB with every list at its largest).
    pub const KEPT: usize = 128;
    /// A list that held more ranges than this is freed, not kept.
    pub const MAX_RANGES: usize = 1024;

    /// A kept list (empty), if any.
    pub fn take(&self) -> Option<Vec<crate::transport::WriteRange>> {
        self.0.lock().pop()
    }

    /// Keeps `list` (emptied) for a later plan, if there is room and it is
    /// not too large.
    pub fn give(&self, mut list: Vec<crate::transport::WriteRange>) {
        if list.capacity() == 0 || list.capacity() > Self::MAX_RANGES {
            return;
        }
        list.clear();
        let mut kept = self.0.lock();
        if kept.len() < Self::KEPT {
            kept.push(list);
        }
    }

    /// Lists kept now.
    pub fn len(&self) -> usize {
        self.0.lock().len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The prefill side of one request: an actor whose state is its
/// [`ProducerCell`].
pub struct ProducerActor {
    cell: Arc<ProducerCell>,
}

/// A producer actor's state, address and inbox count, shared by the actor
/// and the [`ProducerRef`]s that reach it: while a message sent through a
/// [`ProducerRef`] is unhandled, a `LayerReady` is queued behind it, not
/// run inline.
type ProducerCell = ActorCell<ProducerCore, ProducerActor>;

/// A producer group's source block list: one list for the group, which the
/// request directory appends to (after validating the whole,
/// [`Self::try_append`]: chunked prefill grows it) and every member reads
/// when it plans a write. A chunk's blocks are appended before the call
/// that added them answers, so the layers handed over after it find them.
///
/// It also holds the order each staged chunk was gathered in, when not the
/// request's ([`StagedPlan::gather_order`], recorded by [`gather_order`]
/// before the worker gathers the chunk): a write from source staging must
/// know which request block each slot holds.
///
/// And, for a request staged by layer ([`SourceKind::ByLayer`]), the pieces
/// of the source region each layer of each chunk was gathered into
/// ([`Self::stage_layer`]): a write of that layer and chunk reads its piece
/// ([`Self::take_piece`]), and the piece goes back to the region once every
/// member wrote it and no write reads it ([`Self::piece_read`]); a later
/// write of it (a newer authorization) is written from the pages. A layer
/// of a chunk that found no room is written from the pages, and counts as
/// written once every member's write of it ended well
/// ([`Self::pages_read`]).
///
/// Once every layer of every chunk the producers were handed is in a
/// piece or written, the prefill's pages may go back to vLLM before the
/// remaining writes ([`give_back_pages`]): from then on no write reads a
/// page (one that would is failed instead, [`Self::take_pages`]).
#[derive(Clone, Default)]
pub struct SourceBlocks(Arc<SourceState>);

#[derive(Default)]
struct SourceState {
    blocks: parking_lot::RwLock<Vec<u32>>,
    /// Chunks gathered out of request order: start -> (end, order).
    orders: parking_lot::RwLock<GatherOrders>,
    pieces: parking_lot::Mutex<Pieces>,
    /// Producers made with this list so far: each member's index
    /// ([`SourceBlocks::join`]).
    joined: std::sync::atomic::AtomicU32,
    /// When vLLM finished the request (the first member told so), for
    /// [`Timing::PagesHeldAfterFinish`]; taken when the pages go back.
    finished_at: parking_lot::Mutex<Option<Instant>>,
}

impl Drop for SourceState {
    fn drop(&mut self) {
        self.pieces.get_mut().close();
    }
}

/// The layer pieces of a request staged by layer.
#[derive(Default)]
struct Pieces {
    /// The region they come from (`None`: not staged by layer).
    arena: Option<SharedArena>,
    /// Producers of the group: each writes every piece (its own units).
    members: u32,
    /// The latest piece of each (layer, chunk start, chunk end).
    live: std::collections::BTreeMap<(u32, u32, u32), Piece>,
    /// Pieces a later gather of the same layer and chunk replaced while a
    /// write still read them: freed when the last such write ends.
    retired: Vec<Piece>,
    /// (layer, chunk start, chunk end) that every member wrote, from its
    /// piece or from the pages: that layer of that chunk is at decode
    /// already. A later gather of it (the chunk computed again) removes it.
    written: std::collections::BTreeSet<(u32, u32, u32)>,
    /// (layer, chunk start, chunk end) written from the pages by some
    /// members, not all yet: bit `i` for member `i` whose write ended well.
    page_written: std::collections::BTreeMap<(u32, u32, u32), u64>,
    /// Writes in flight that read prefill's pages (a layer without a piece).
    page_reads: u32,
    /// The prefill's pages went back to vLLM ([`give_back_pages`]): no write
    /// may read them.
    pages_gone: bool,
    next_id: u64,
    /// The group ended: every piece is back, none is given any more.
    closed: bool,
    /// `orbitkv.pd.staging_pieces` `request`: a layer that finds no room
    /// makes the request give back its untaken pieces and take no more.
    whole: bool,
    /// Under `whole`: a layer found no room, so no piece is given any more.
    missed: bool,
    /// Pieces given back unread on that miss, not yet counted in the stats.
    given_up: u32,
}

/// What a write in flight of a request staged by layer reads.
#[derive(Debug, Clone, Copy)]
enum Reads {
    /// Layer piece `id` ([`SourceBlocks::take_piece`]).
    Piece(u64),
    /// Prefill's pages, for this (layer, chunk start, chunk end)
    /// ([`SourceBlocks::take_pages`]).
    Pages((u32, u32, u32)),
}

/// A piece a write reads: its ID, where it is, the chunk's gather order.
type TakenPiece = (u64, LayerSource, Option<Arc<[u32]>>);

struct Piece {
    id: u64,
    source: LayerSource,
    /// The order the chunk was gathered in (`None`: the request's).
    order: Option<Arc<[u32]>>,
    /// Writes planned from it that did not end yet.
    readers: u32,
    /// Writes from it that ended well (one per member is all it takes).
    written: u32,
}

impl Pieces {
    fn free(&self, p: &Piece) {
        if let Some(arena) = &self.arena {
            if let Err(e) = arena.lock().free(p.source.base) {
                tracing::error!(error = %e, "a layer piece was not in use");
            }
        }
    }

    /// Under `whole`, a layer found no room: every live piece no write
    /// took and none wrote goes back now (its layer is written from the
    /// pages, which the request keeps until that layer is at decode
    /// anyway), and no piece is given any more. A piece a write reads, or
    /// one a member wrote already, stays to its last reader.
    fn give_up(&mut self) {
        self.missed = true;
        let untaken: Vec<_> = self
            .live
            .iter()
            .filter(|(_, x)| x.readers == 0 && x.written == 0)
            .map(|(&k, _)| k)
            .collect();
        for k in untaken {
            if let Some(x) = self.live.remove(&k) {
                self.free(&x);
                self.given_up += 1;
            }
        }
    }

    fn close(&mut self) {
        self.closed = true;
        for p in std::mem::take(&mut self.live)
            .into_values()
            .chain(std::mem::take(&mut self.retired))
        {
            self.free(&p);
        }
    }
}

/// Chunks gathered out of request order: start -> (end, order).
type GatherOrders = std::collections::BTreeMap<u32, (u32, Arc<[u32]>)>;

/// A write of blocks that overlap a chunk gathered out of request order
/// without being exactly that chunk: its slots cannot be named.
#[derive(Debug)]
struct OrderUnknown;

impl SourceBlocks {
    pub fn new(blocks: Vec<u32>) -> Self {
        Self(Arc::new(SourceState {
            blocks: parking_lot::RwLock::new(blocks),
            orders: Default::default(),
            pieces: Default::default(),
            joined: Default::default(),
            finished_at: Default::default(),
        }))
    }

    /// vLLM finished the request (every layer handed over): the clock of
    /// [`Timing::PagesHeldAfterFinish`] starts, at the first member told.
    fn finished(&self, at: Instant) {
        self.0.finished_at.lock().get_or_insert(at);
    }

    /// The pages go back to vLLM now: how long after vLLM finished the
    /// request, once (`None` if it never finished, or was counted).
    fn pages_back_after_finish(&self) -> Option<Duration> {
        self.0.finished_at.lock().take().map(|t| t.elapsed())
    }

    pub fn len(&self) -> usize {
        self.0.blocks.read().len()
    }

    /// A producer of the group joins: its member index (0, 1, … in the
    /// order they are made), which [`Self::pages_read`] tells apart.
    fn join(&self) -> u32 {
        self.0.joined.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// The order chunk `blocks` was gathered in: `None` the request's. A
    /// chunk recorded with exactly these blocks is that chunk (consecutive
    /// chunks share the block one of them ended inside, so a chunk may
    /// overlap its neighbours); blocks that are no recorded chunk but overlap
    /// a reordered one cannot be named.
    fn order_of(&self, blocks: &std::ops::Range<u32>) -> Result<Option<Arc<[u32]>>, OrderUnknown> {
        let orders = self.0.orders.read();
        if let Some((e, order)) = orders.get(&blocks.start) {
            if *e == blocks.end {
                return Ok(Some(order.clone()));
            }
        }
        if orders
            .range(..blocks.end)
            .any(|(&s, &(e, _))| blocks.start < e && s < blocks.end)
        {
            return Err(OrderUnknown);
        }
        Ok(None)
    }

    /// Records the order chunk `blocks` is gathered in (`None`: the
    /// request's), in place of an earlier record of a chunk starting there
    /// (the same chunk gathered again). Neighbouring chunks keep theirs:
    /// their writes may still be planned.
    fn record_order(&self, blocks: std::ops::Range<u32>, order: Option<Vec<u32>>) {
        let mut orders = self.0.orders.write();
        orders.remove(&blocks.start);
        if let Some(order) = order {
            orders.insert(blocks.start, (blocks.end, order.into()));
        }
    }

    /// Stages request blocks by layer from `arena`, for a group of
    /// `members` producers; `whole`: a request that misses a layer gives
    /// back the pieces no write took and takes no more
    /// ([`Self::stage_layer`]).
    pub(in crate::actors) fn stage_by_layer(&self, arena: SharedArena, members: u32, whole: bool) {
        let mut p = self.0.pieces.lock();
        p.arena = Some(arena);
        p.members = members.max(1);
        p.whole = whole;
    }

    /// A piece of `bytes` for layer `layer` of chunk `blocks`, which the
    /// worker gathers next, in the order recorded for that chunk
    /// ([`gather_order`]); it replaces an earlier piece of the same layer
    /// and chunk (freed now, or when the last write reading it ends).
    /// `None`: no room in the region (that layer is written from the
    /// pages), or the group ended. Staged whole ([`Self::stage_by_layer`]):
    /// the first layer without room also gives back every piece of the
    /// request no write took ([`Pieces::give_up`]), and no layer gets one
    /// after it.
    fn stage_layer(&self, layer: u32, blocks: std::ops::Range<u32>, bytes: u64) -> Option<LayerSource> {
        let order = self
            .0
            .orders
            .read()
            .get(&blocks.start)
            .filter(|(e, _)| *e == blocks.end)
            .map(|(_, o)| o.clone());
        let mut p = self.0.pieces.lock();
        if p.closed {
            return None;
        }
        let key = (layer, blocks.start, blocks.end);
        // Gathered again (computed again): what was written of it is not
        // what the pages hold now.
        p.written.remove(&key);
        p.page_written.remove(&key);
        if let Some(old) = p.live.remove(&key) {
            if old.readers == 0 {
                p.free(&old);
            } else {
                p.retired.push(old);
            }
        }
        if p.missed {
            return None;
        }
        let Ok(base) = p.arena.as_ref()?.lock().alloc(bytes) else {
            if p.whole {
                p.give_up();
            }
            return None;
        };
        let source = LayerSource {
            base,
            start: blocks.start,
            blocks: blocks.len() as u32,
        };
        p.next_id += 1;
        let id = p.next_id;
        p.live.insert(
            key,
            Piece {
                id,
                source,
                order,
                readers: 0,
                written: 0,
            },
        );
        Some(source)
    }

    /// Pieces given back unread since the last call ([`Pieces::give_up`]).
    fn take_given_up(&self) -> u32 {
        std::mem::take(&mut self.0.pieces.lock().given_up)
    }

    /// The piece layer `layer` of chunk `blocks` was gathered into, for a
    /// write that reads it (`None`: none, it is written from the pages):
    /// its ID (for [`Self::piece_read`]), where it is, the chunk's order.
    fn take_piece(&self, layer: u32, blocks: &std::ops::Range<u32>) -> Option<TakenPiece> {
        let mut p = self.0.pieces.lock();
        let piece = p.live.get_mut(&(layer, blocks.start, blocks.end))?;
        piece.readers += 1;
        Some((piece.id, piece.source, piece.order.clone()))
    }

    /// A write that read piece `id` ended (`written`: well). The piece goes
    /// back to the region once no write reads it and every member wrote it,
    /// or, replaced by a later gather, once no write reads it.
    fn piece_read(&self, id: u64, written: bool) {
        let mut p = self.0.pieces.lock();
        let members = p.members;
        if let Some(i) = p.retired.iter().position(|x| x.id == id) {
            let x = &mut p.retired[i];
            x.readers = x.readers.saturating_sub(1);
            if x.readers == 0 {
                let x = p.retired.swap_remove(i);
                p.free(&x);
            }
            return;
        }
        let Some((&key, x)) = p.live.iter_mut().find(|(_, x)| x.id == id) else {
            return;
        };
        x.readers = x.readers.saturating_sub(1);
        x.written += written as u32;
        // Every member wrote it under its authorization; a producer takes
        // no newer one once finished, so with the pages gone too nothing
        // reads this layer of the chunk again.
        if x.readers == 0 && x.written >= members {
            if let Some(x) = p.live.remove(&key) {
                p.free(&x);
                p.written.insert(key);
            }
        }
    }

    /// A write of layer `key.0` of chunk `key.1..key.2` by member `member`
    /// that read prefill's pages ended (`written`: well). Once every member
    /// wrote it, that layer of that chunk counts as written: no write of
    /// the group reads it again (a finished producer takes no newer
    /// authorization), so the pages may go back without it. Groups of more
    /// than 64 members never count page writes (their pages stay until the
    /// release).
    fn pages_read(&self, key: (u32, u32, u32), member: u32, written: bool) {
        let mut p = self.0.pieces.lock();
        p.page_reads = p.page_reads.saturating_sub(1);
        if !written || p.members > 64 || member >= p.members {
            return;
        }
        let all = u64::MAX >> (64 - p.members);
        let by = p.page_written.entry(key).or_default();
        *by |= 1 << member;
        if *by == all {
            p.page_written.remove(&key);
            p.written.insert(key);
        }
    }

    /// A write is about to read prefill's pages (`true`, and counted until
    /// [`Self::pages_read`]), unless they went back to vLLM (`false`: the
    /// write must fail, nothing may read them).
    fn take_pages(&self) -> bool {
        let mut p = self.0.pieces.lock();
        if p.pages_gone {
            return false;
        }
        p.page_reads += 1;
        true
    }

    /// Lets the prefill's pages go if every write there will be, of `ready`
    /// (every layer and chunk handed over, non-empty), reads a live piece or
    /// was written by every member already, no write reads a page now, and
    /// the group did not end. From then on [`Self::take_pages`] refuses.
    /// Says whether this call let them go ([`PagesBack::Now`]), so that
    /// callers at once count them once.
    fn let_pages_go(&self, ready: &[(u32, std::ops::Range<u32>)]) -> PagesBack {
        let mut p = self.0.pieces.lock();
        if p.pages_gone {
            return PagesBack::Before;
        }
        if p.closed || p.arena.is_none() {
            return PagesBack::Never;
        }
        if p.page_reads > 0 {
            return PagesBack::NotYet;
        }
        let covered = ready.iter().all(|(layer, b)| {
            let key = (*layer, b.start, b.end);
            b.is_empty() || p.live.contains_key(&key) || p.written.contains(&key)
        });
        p.pages_gone = covered;
        if covered {
            PagesBack::Now
        } else {
            PagesBack::NotYet
        }
    }

    /// Whether the prefill's pages went back to vLLM.
    fn pages_gone(&self) -> bool {
        self.0.pieces.lock().pages_gone
    }

    /// The group ended: every piece goes back (no write is in flight any
    /// more), and none is given from now on. The prefill's pages go back
    /// to vLLM with it unless they went before: timed
    /// ([`Timing::PagesHeldAfterFinish`]) into `timings`.
    pub(in crate::actors) fn close(&self, timings: &Timings) {
        self.0.pieces.lock().close();
        if let Some(held) = self.pages_back_after_finish() {
            timings.observe(Timing::PagesHeldAfterFinish, held);
        }
    }

    /// Whether any chunk was gathered out of request order.
    fn any_reordered(&self) -> bool {
        !self.0.orders.read().is_empty()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends `more` (a block table of `groups` equal segments, like the
    /// list: each segment goes after the same group's) if the whole list
    /// then passes `check`; unchanged if not.
    pub(in crate::actors) fn try_append<E>(
        &self,
        more: &[u32],
        groups: u32,
        check: impl FnOnce(&[u32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut blocks = self.0.blocks.write();
        let all = append_segments(&blocks, more, groups as usize);
        check(&all)?;
        *blocks = all;
        Ok(())
    }

    fn read(&self) -> parking_lot::RwLockReadGuard<'_, Vec<u32>> {
        self.0.blocks.read()
    }
}

/// `old` with `more` appended group by group: both are `groups` equal
/// segments (group-major); segment `g` of the result is `old`'s then
/// `more`'s. A list that does not split evenly is appended whole (the check
/// that follows refuses it).
///
/// A block id of `more` already in `old` was freed by vLLM and handed out
/// again: a sliding-window group frees the blocks that fall out of its
/// window while the prefill goes on, and the pool may give one back to the
/// same request. Its old place becomes a [`HOLE`] (the rank no longer
/// holds that request block, and nothing is read from it); decode keeps
/// no block there either, its window being the prefill's last one.
fn append_segments(old: &[u32], more: &[u32], groups: usize) -> Vec<u32> {
    let mut all = Vec::with_capacity(old.len() + more.len());
    let g = groups.max(1);
    let again: std::collections::HashSet<u32> = more.iter().copied().filter(|&b| b != HOLE).collect();
    let old: Vec<u32> = old
        .iter()
        .map(|&b| if again.contains(&b) { HOLE } else { b })
        .collect();
    let old = &old[..];
    if g == 1 || old.len() % g != 0 || more.len() % g != 0 {
        all.extend_from_slice(old);
        all.extend_from_slice(more);
        return all;
    }
    let (n, m) = (old.len() / g, more.len() / g);
    for i in 0..g {
        all.extend_from_slice(&old[i * n..(i + 1) * n]);
        all.extend_from_slice(&more[i * m..(i + 1) * m]);
    }
    all
}

/// What the actor owns (see [`ProducerActor`]).
struct ProducerCore {
    machine: ProducerMachine,
    rank: ProducerRank,
    /// The group's (read here, appended by the directory).
    src_blocks: SourceBlocks,
    shared: Arc<ProducerShared>,
    /// Where the release goes: the request directory, under this group token.
    released_to: (u64, Recipient<ProducerEnded>),
    span: Span,
    planned: Vec<crate::transport::WriteRange>,
    /// Where the worker gathers this request's blocks (`None`: it does not
    /// stage; every write goes to the pages).
    staging: Option<SourceKind>,
    /// Writes in flight of a request staged by layer: what each reads.
    reading: Vec<(WriteId, Reads)>,
    /// This producer's index in its group ([`SourceBlocks::join`]).
    member: u32,
    /// The staged plan of the authorization of this generation (`None`
    /// inside: that authorization is written into pages), made once.
    staged: Option<(Generation, Option<Arc<StagedPlan>>)>,
    /// When vLLM finished the request here (`Finish`), for
    /// [`Timing::WrittenAfterFinish`].
    finished_at: Option<Instant>,
    /// When decode's handshake first reached it, for
    /// [`Timing::HandshakeAfterFinish`].
    handshake_at: Option<Instant>,
    /// The latest first batch of its writes, for [`Timing::SentAfterFinish`].
    last_sent: Option<Instant>,
    /// The latest layer its lanes saw computed, for
    /// [`Timing::ComputedAfterFinish`].
    last_computed: Option<Instant>,
    /// This actor (for its own `Stop`).
    me: Addr<ProducerActor>,
    /// Where the writers report (this actor, [`WriterReports`]).
    replies: ReplyTo,
    /// The machine's effects, one event at a time (reused).
    effects: Vec<ProducerEffect>,
    /// Range lists the writers gave back, to plan layers into.
    spare: Vec<Vec<crate::transport::WriteRange>>,
    /// The request ID as the writers carry it.
    request: Arc<RequestId>,
    /// The consumer's writers (its endpoint, the lanes), looked up once.
    lanes: Option<(String, Vec<super::writer::LaneRef>)>,
}

/// Who carries out an effect: the actor on its thread, the caller that
/// runs a `LayerReady` inline on its own, or a writer lane that runs a
/// write's end inline on its own ([`WriterReports`]).
enum Via<'a> {
    Actor(&'a mut Context<ProducerActor>),
    Caller,
    Writer,
}

/// Stops a producer actor whose machine released while a caller held it.
#[derive(Message)]
#[rtype(result = "()")]
struct Stop;

/// How the façade and the request directory reach a producer actor.
#[derive(Clone)]
pub struct ProducerRef(Arc<ProducerCell>);

impl std::fmt::Debug for ProducerRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProducerRef")
            .field("inbox", &self.0.pending())
            .finish()
    }
}

/// The order in which the worker gathers chunk `blocks` of a request into
/// its source staging, recorded for the writes that follow
/// ([`StagedPlan::gather_order`], `pinned` as there; `None`: the request's
/// order). Reordered
/// only when the request has one member (one consumer rank), whose current
/// authorization is written from source staging into pages: decided and
/// recorded under that member's lock, so a plan made for a later
/// authorization sees the record (and then writes no grant).
pub fn gather_order(
    members: &[ProducerRef],
    blocks: std::ops::Range<u32>,
    pinned: (bool, bool),
) -> Option<Vec<u32>> {
    let [member] = members else {
        if let Some(m) = members.first() {
            m.0.lock().src_blocks.record_order(blocks, None);
        }
        return None;
    };
    let mut core = member.0.lock();
    // A chunk staged by layer has pieces of its own: no slot is shared
    // with its neighbours, nothing is pinned.
    let pinned = match core.staging {
        Some(SourceKind::ByLayer { .. }) => (false, false),
        _ => pinned,
    };
    let order = match core.machine.authorization().cloned() {
        Some(auth) if core.machine.phase() != ProducerPhase::Released => core
            .staged_into(&auth)
            .and_then(|plan| plan.gather_order(blocks.clone(), pinned)),
        _ => None,
    };
    core.src_blocks.record_order(blocks, order.clone());
    if order.is_some() {
        core.shared.stats.chunks_reordered.inc();
    }
    order
}

/// Whether every member has taken a handshake: a decode claimed the
/// request on this rank (the directory hands a handshake to the producers'
/// actors after it answered the caller, so one just accepted may not show
/// yet).
pub fn authorized(members: &[ProducerRef]) -> bool {
    !members.is_empty() && members.iter().all(|m| m.0.lock().machine.has_handshake())
}

/// Where a planned layer write reads and writes ([`plan_submit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Planned {
    /// From prefill's pages into decode's pages.
    Pages,
    /// From the source staging into decode's pages.
    PagesFromStaging,
    /// From the source staging into decode's staging grant.
    Grant,
}

/// What a write may read besides prefill's pages: the authorization's
/// staged plan (`None`: written from the pages), the layer piece it took
/// (a request staged by layer; `None` with a plan: the whole staging), and
/// the chunk's gather order.
#[derive(Debug, Clone, Copy, Default)]
pub struct SubmitSource<'a> {
    pub staged: Option<&'a StagedPlan>,
    pub piece: Option<LayerSource>,
    pub order: Option<&'a [u32]>,
}

/// Plans one layer write under `auth` into `out`, the producer actor's rule
/// for a `Submit` (also what `tests/contract_props.rs` plans with): from the
/// source staging (`from.staged`: its piece, or its whole staging) into the
/// grant or decode's pages, else from prefill's pages (`src_blocks`) into
/// decode's pages. Says which; any range outside the authorization or the
/// source is an error, never a range.
pub fn plan_submit(
    local: &KvLayout,
    src_blocks: &[u32],
    auth: &Handshake,
    from: SubmitSource<'_>,
    layer: u32,
    blocks: std::ops::Range<u32>,
    out: &mut Vec<crate::transport::WriteRange>,
) -> Result<Planned, crate::error::GeometryError> {
    let Some(plan) = from.staged else {
        plan_write(local, src_blocks, auth.target(), layer, blocks, out)?;
        return Ok(Planned::Pages);
    };
    match from.piece {
        Some(src) => plan.plan_piece(layer, blocks, src, from.order, out)?,
        None => plan.plan_layer(layer, blocks, from.order, out)?,
    }
    Ok(if plan.into_grant() {
        Planned::Grant
    } else {
        Planned::PagesFromStaging
    })
}

/// What a `Submit` whose plan ([`plan_submit`]) put `ranges` out becomes,
/// the producer actor's rule (also what `tests/contract_props.rs` applies):
/// a write that goes out (`Ok`: where to), or the event it ends with at
/// once: a plan refused (a range outside the authorization or the source)
/// fails the write, an empty plan (none of its blocks authorized) is done
/// with no bytes.
pub fn settle_plan<E: std::fmt::Display>(
    write: WriteId,
    generation: Generation,
    layer: u32,
    planned: Result<Planned, E>,
    ranges: &[crate::transport::WriteRange],
) -> Result<Planned, ProducerEvent> {
    match planned {
        Err(e) => {
            tracing::warn!(layer, error = %e, "layer cannot be written inside the authorization");
            Err(ProducerEvent::WriteFailed {
                write,
                generation,
                reason: e.to_string(),
            })
        }
        Ok(_) if ranges.is_empty() => Err(ProducerEvent::WriteDone {
            write,
            generation,
            bytes: 0,
        }),
        Ok(into) => Ok(into),
    }
}

/// A piece of the source region for layer `layer` of chunk `blocks` of a
/// request staged by layer, which the worker gathers into now
/// ([`SourceBlocks::stage_layer`]): where it is and each plane's (offset,
/// unit bytes) in it. `Ok(None)`: no room (that layer and chunk is written
/// from the pages). An error: the request is not staged by layer here, or
/// `layer` or `blocks` are not the request's.
pub fn stage_layer(
    members: &[ProducerRef],
    layer: u32,
    blocks: std::ops::Range<u32>,
) -> Result<Option<GivenPiece>, crate::error::GeometryError> {
    use crate::error::GeometryError;
    let Some(m) = members.first() else {
        return Ok(None);
    };
    let (src_blocks, local, stats) = {
        let mut core = m.0.lock();
        if !matches!(core.staging, Some(SourceKind::ByLayer { .. })) {
            return Err(GeometryError::GatherOrder {
                start: blocks.start,
                end: blocks.end,
                what: "request staged by layer",
            });
        }
        // Decode's authorization is here already and is not written from
        // staging (blocks of another size, another order): no gather.
        if let ([_], Some(auth)) = (members, core.machine.authorization().cloned()) {
            if core.staged_into(&auth).is_none() {
                return Ok(None);
            }
        }
        (
            core.src_blocks.clone(),
            core.shared.local.clone(),
            core.shared.stats.clone(),
        )
    };
    let have = src_blocks.len();
    if blocks.start >= blocks.end || blocks.end as usize > have {
        return Err(GeometryError::OutsideSource {
            index: blocks.end.saturating_sub(1),
            available: have,
        });
    }
    let (slots, bytes) = crate::staging::layer_slots(&local, layer as usize, blocks.len() as u32).ok_or(
        GeometryError::LayerOutOfRange {
            layer,
            num_layers: local.layers.len(),
        },
    )?;
    let got = src_blocks.stage_layer(layer, blocks, bytes);
    if got.is_none() {
        // no room: this layer of the chunk is written from the pages
        stats.source_staging_full.inc();
        stats
            .source_pieces_given_up
            .add(src_blocks.take_given_up().into());
    }
    Ok(got.map(|src| (src, slots)))
}

/// Whether the prefill's pages of a request staged by layer may go back to
/// vLLM now, before its writes ended; if so they are given up for good. They
/// may when every producer of the group was finished (vLLM handed every
/// layer over), none's current authorization is written from the pages, and
/// each layer of each chunk handed over is in a live piece or was written by
/// every member (from its piece, or from the pages where it found no room):
/// from then on a write with no piece fails
/// ([`SourceBlocks::take_pages`]). A finished producer takes no newer
/// authorization once it has one, so a layer every member wrote is never
/// read again, and an authorization written from the pages stays so
/// ([`PagesBack::Never`]). Counted once, by the call that gave them up.
pub fn give_back_pages(members: &[ProducerRef]) -> PagesBack {
    let Some(first) = members.first() else {
        return PagesBack::Never;
    };
    // one source block list per group: every member holds the same
    let src = first.0.lock().src_blocks.clone();
    if src.pages_gone() {
        return PagesBack::Before;
    }
    let mut ready = Vec::new();
    for m in members {
        let mut core = m.0.lock();
        if !matches!(core.staging, Some(SourceKind::ByLayer { .. }))
            || core.machine.phase() == ProducerPhase::Released
        {
            return PagesBack::Never;
        }
        if !core.machine.finished() {
            return PagesBack::NotYet;
        }
        match core.machine.authorization().cloned() {
            Some(auth) if core.staged_into(&auth).is_none() => return PagesBack::Never,
            Some(_) => {}
            // Decode's authorization comes later: only where every one so
            // far took the pieces (none could be written otherwise).
            None if !core.shared.decode_staged.all_staged() => return PagesBack::NotYet,
            None => {}
        }
        ready.extend(core.machine.ready_layers());
    }
    ready.sort_by_key(|(l, b)| (*l, b.start, b.end));
    ready.dedup();
    let back = src.let_pages_go(&ready);
    if back == PagesBack::Now {
        let core = first.0.lock();
        core.shared.stats.producer_pages_given_back.inc();
        if let Some(held) = src.pages_back_after_finish() {
            core.shared
                .stats
                .timings
                .observe(Timing::PagesHeldAfterFinish, held);
        }
        tracing::info!(parent: &core.span, layers = ready.len(),
            "prefill's pages given back before the writes: every layer is in a layer piece or at decode");
    }
    back
}

impl ProducerRef {
    /// Starts a producer actor on the current arbiter (the system thread).
    pub fn start(
        request: RequestId,
        src_blocks: SourceBlocks,
        staging: Option<SourceKind>,
        shared: Arc<ProducerShared>,
        released_to: (u64, Recipient<ProducerEnded>),
    ) -> Self {
        let mut cell = None;
        ProducerActor::create(|ctx| {
            let c = Arc::new_cyclic(|cell| {
                let replies: ReplyTo = Arc::new(WriterReports {
                    cell: cell.clone(),
                    addr: ctx.address(),
                });
                let me = (ctx.address(), replies);
                ProducerCell::new(ProducerCore::new(
                    request,
                    src_blocks,
                    staging,
                    shared,
                    released_to,
                    me,
                ))
            });
            c.started(ctx.address());
            cell = Some(c.clone());
            ProducerActor { cell: c }
        });
        Self(cell.expect("Actor::create runs its closure at once"))
    }

    /// Sends `msg` to the actor, counted in its inbox until handled.
    pub fn send<M>(&self, msg: M)
    where
        M: Message + Send + 'static,
        M::Result: Send,
        ProducerActor: Handler<M>,
    {
        self.0.send(msg);
    }

    /// Whether the actor still runs.
    pub fn connected(&self) -> bool {
        self.0.addr().connected()
    }

    /// Layer `layer` of request blocks `blocks` was computed (`after`: the
    /// mark its kernels were launched before, 0: none): runs the actor's
    /// `LayerReady` on this thread (an inline run, [`ActorCell::try_inline`];
    /// the caller holds no lock, so it waits for one held now) if nothing
    /// sent to the actor before is unhandled and no write of it is held
    /// back. `false`: not run; the caller sends it instead.
    pub fn try_layer_ready_inline(
        &self,
        layer: u32,
        blocks: &std::ops::Range<u32>,
        after: crate::ids::MarkSeq,
    ) -> bool {
        self.0
            .try_inline(Wait::Yes, |core| {
                // Writes held back by rule 8 end only where write ends are
                // handled (the actor's thread, or a lane's): while any wait,
                // layers take the paced way through the actor, so that a
                // caller rewriting the same blocks faster than they
                // complete cannot grow the held-back list without bound.
                if core.machine.phase() == ProducerPhase::Released || core.machine.held_back() > 0 {
                    return None;
                }
                core.shared.stats.layers_ready_inline.inc();
                let span = tracing::info_span!(parent: &core.span, "msg", kind = "LayerReady",
                    layer, blocks = ?blocks, inline = true);
                let _g = span.enter();
                let ev = ProducerEvent::LayerReady {
                    layer,
                    blocks: blocks.clone(),
                    after,
                };
                core.feed(ev, &mut Via::Caller);
                Some(())
            })
            .is_some()
    }
}

impl Drop for ProducerCore {
    /// The range lists go to the runtime's other producers.
    fn drop(&mut self) {
        for list in self.spare.drain(..) {
            self.shared.buffers.give(list);
        }
        self.shared.buffers.give(std::mem::take(&mut self.planned));
    }
}

impl ProducerCore {
    fn new(
        request: RequestId,
        src_blocks: SourceBlocks,
        staging: Option<SourceKind>,
        shared: Arc<ProducerShared>,
        released_to: (u64, Recipient<ProducerEnded>),
        (me, replies): (Addr<ProducerActor>, ReplyTo),
    ) -> Self {
        let span = tracing::info_span!("request", side = "producer", request = %request,
            rank = shared.local.tp_rank, blocks = src_blocks.len());
        let member = src_blocks.join();
        Self {
            replies,
            me,
            effects: Vec::new(),
            spare: Vec::new(),
            request: Arc::new(request.clone()),
            lanes: None,
            machine: ProducerMachine::new(request).with_block_size(shared.local.block_size),
            rank: ProducerRank(shared.local.tp_rank),
            src_blocks,
            shared,
            released_to,
            span,
            planned: Vec::new(),
            staging,
            reading: Vec::new(),
            member,
            staged: None,
            finished_at: None,
            handshake_at: None,
            last_sent: None,
            last_computed: None,
        }
    }

    /// How this producer writes under `auth`: from its source staging into
    /// the consumer's staging grant or straight into its pages (the plan),
    /// else from its pages (`None`). Fixed for an authorization, so its
    /// notice can say whether it staged into the grant;
    /// planned once per generation. An authorization whose grant cannot be
    /// planned (its addresses overflow) is written into pages.
    fn staged_into(&mut self, auth: &Handshake) -> Option<Arc<StagedPlan>> {
        if let Some((g, plan)) = &self.staged {
            if *g == auth.generation {
                return plan.clone();
            }
        }
        let plan = self.staging.and_then(|src| {
            let (local, min) = (&self.shared.local, self.shared.staging_min_ranges);
            match src {
                SourceKind::Whole(src) => StagedPlan::new(local, src, auth.target(), auth.staging, min),
                SourceKind::ByLayer { group } => StagedPlan::by_layer(local, group, auth.target(), min),
            }
            .inspect_err(|e| tracing::warn!(error = %e, "staging grant not usable: writing pages"))
            .ok()
            .flatten()
            // A grant is staged in request order: a chunk gathered in
            // another (for an earlier authorization's pages) cannot go
            // there, so this authorization is written from the pages.
            .filter(|p| !(p.into_grant() && self.src_blocks.any_reordered()))
            .map(Arc::new)
        });
        if matches!(self.staging, Some(SourceKind::ByLayer { .. })) {
            self.shared.decode_staged.saw(plan.is_some());
        }
        self.staged = Some((auth.generation, plan.clone()));
        plan
    }

    fn feed(&mut self, ev: ProducerEvent, via: &mut Via<'_>) {
        // Follow-up events are rare: the queue allocates only when one comes;
        // the effects go through a buffer kept from one event to the next.
        let mut queue = std::collections::VecDeque::new();
        let mut effects = std::mem::take(&mut self.effects);
        let mut next = Some(ev);
        while let Some(ev) = next.take().or_else(|| queue.pop_front()) {
            match &ev {
                ProducerEvent::WriteDone { write, .. } => self.read_ended(*write, true),
                ProducerEvent::WriteFailed { write, .. } => self.read_ended(*write, false),
                ProducerEvent::Handshake(_) if self.handshake_at.is_none() => {
                    self.handshake_at = Some(Instant::now());
                }
                ProducerEvent::Finish if self.finished_at.is_none() => {
                    let now = Instant::now();
                    self.finished_at = Some(now);
                    self.src_blocks.finished(now);
                }
                _ => {}
            }
            self.machine.on_event_into(ev, &mut effects);
            for fx in effects.drain(..) {
                if let Some(follow) = self.apply(fx, via) {
                    queue.push_back(follow);
                }
            }
        }
        self.effects = effects;
    }

    /// Write `write` ended (`ok`: well): the layer piece it read, if any,
    /// has one reader less; a read of the pages is counted as written.
    fn read_ended(&mut self, write: WriteId, ok: bool) {
        if let Some(i) = self.reading.iter().position(|&(w, _)| w == write) {
            match self.reading.swap_remove(i).1 {
                Reads::Piece(id) => self.src_blocks.piece_read(id, ok),
                Reads::Pages(key) => self.src_blocks.pages_read(key, self.member, ok),
            }
        }
    }

    /// Carries out one effect; may return an event to feed back.
    fn apply(&mut self, fx: ProducerEffect, via: &mut Via<'_>) -> Option<ProducerEvent> {
        match fx {
            ProducerEffect::Submit {
                write,
                generation,
                layer,
                blocks,
                after,
                auth,
            } => {
                if auth.expired() {
                    tracing::warn!(layer, "the consumer's deadline passed: not writing");
                    return Some(ProducerEvent::WriteFailed {
                        write,
                        generation,
                        reason: EXPIRED.into(),
                    });
                }
                let mut staged = self.staged_into(&auth);
                let mut piece = None;
                let order = match &staged {
                    Some(_) if matches!(self.staging, Some(SourceKind::ByLayer { .. })) => {
                        match self.src_blocks.take_piece(layer, &blocks) {
                            Some((id, src, order)) => {
                                self.reading.push((write, Reads::Piece(id)));
                                piece = Some(src);
                                order
                            }
                            // Not gathered (no room in the region), or
                            // written already and given back: from the pages.
                            None => {
                                staged = None;
                                None
                            }
                        }
                    }
                    Some(_) => match self.src_blocks.order_of(&blocks) {
                        Ok(order) => order,
                        Err(OrderUnknown) if staged.as_ref().is_some_and(|p| p.into_grant()) => {
                            // Never: a plan into a grant is not made once a
                            // chunk was reordered, nor a chunk reordered under one.
                            return Some(ProducerEvent::WriteFailed {
                                write,
                                generation,
                                reason: "a staged chunk's order is unknown".into(),
                            });
                        }
                        Err(OrderUnknown) => {
                            // Not a chunk as it was gathered (never from this
                            // worker): from the pages, which prefill still holds.
                            tracing::warn!(
                                layer,
                                ?blocks,
                                "blocks across a reordered chunk: writing from the pages"
                            );
                            staged = None;
                            None
                        }
                    },
                    None => None,
                };
                // Staged by layer, a write from the pages holds them until it
                // ends; once they went back to vLLM it cannot be written.
                if staged.is_none()
                    && !blocks.is_empty()
                    && matches!(self.staging, Some(SourceKind::ByLayer { .. }))
                {
                    if !self.src_blocks.take_pages() {
                        tracing::warn!(
                            layer,
                            ?blocks,
                            "prefill's pages went back to vLLM and this layer has no piece"
                        );
                        return Some(ProducerEvent::WriteFailed {
                            write,
                            generation,
                            reason: PAGES_GONE.into(),
                        });
                    }
                    self.reading
                        .push((write, Reads::Pages((layer, blocks.start, blocks.end))));
                }
                let planned = plan_submit(
                    &self.shared.local,
                    &self.src_blocks.read(),
                    &auth,
                    SubmitSource {
                        staged: staged.as_deref(),
                        piece,
                        order: order.as_deref(),
                    },
                    layer,
                    blocks.clone(),
                    &mut self.planned,
                );
                let into = match settle_plan(write, generation, layer, planned, &self.planned) {
                    Ok(into) => into,
                    Err(ended) => return Some(ended),
                };
                let bytes = self.planned.iter().map(|r| r.len).sum();
                if into != Planned::Pages {
                    self.shared.stats.layers_staged.inc();
                }
                if into == Planned::PagesFromStaging {
                    self.shared.stats.layers_staged_to_pages.inc();
                }
                tracing::debug!(
                    write,
                    layer,
                    ?blocks,
                    ranges = self.planned.len(),
                    bytes,
                    "layer admitted"
                );
                let cap = self.planned.len();
                let next = self
                    .spare
                    .pop()
                    .or_else(|| self.shared.buffers.take())
                    .unwrap_or_else(|| Vec::with_capacity(cap));
                let write = WriteLayer {
                    request: self.request.clone(),
                    write,
                    generation,
                    layer,
                    // The next layer plans into a buffer a writer gave back,
                    // or one of this size (no regrowth).
                    ranges: std::mem::replace(&mut self.planned, next),
                    bytes,
                    after,
                    expires_unix_ms: auth.expires_unix_ms,
                    reply_to: self.replies.clone(),
                };
                // Submitted here only on the caller's thread: the system
                // thread never waits on Mooncake, and a writer lane's thread
                // hands the writes to their lanes as messages.
                let inline = matches!(via, Via::Caller);
                if !self
                    .lanes
                    .as_ref()
                    .is_some_and(|(peer, _)| *peer == auth.endpoint)
                {
                    let lanes = self.shared.writers.lanes(&auth.endpoint);
                    self.lanes = Some((auth.endpoint.clone(), lanes));
                }
                let (_, lanes) = self.lanes.as_ref().expect("set above");
                self.shared.writers.pick(lanes).write(write, inline);
                None
            }
            ProducerEffect::Notify {
                auth,
                outcome,
                reason,
                bytes,
            } => {
                let notice = Notice {
                    version: WIRE_VERSION,
                    request_id: self.machine.request.clone(),
                    generation: auth.generation,
                    producer_rank: self.rank,
                    outcome,
                    reason: Notice::clip_reason(reason),
                    bytes,
                    staged: self.staged_into(&auth).is_some_and(|p| p.into_grant()),
                    mac: None,
                }
                // Under the key of the handshake it wrote under: the
                // consumer believes nothing else (rule 2a).
                .sign(&auth.notice_key);
                tracing::info!(?outcome, bytes, notice.staged, "notifying the consumer");
                // Timed here, before the release that follows: vLLM takes
                // the stats after the release in the same step, so a
                // request's timing is never left for a step that may not come.
                if let (crate::wire::Outcome::Done, Some(at)) = (outcome, self.finished_at) {
                    let timings = &self.shared.stats.timings;
                    timings.observe(Timing::WrittenAfterFinish, at.elapsed());
                    // where the tail went: decode's authorization, the GPU
                    // computing the last layer, then the last write's first
                    // batch (each 0 when before the finish)
                    let after =
                        |t: Option<Instant>| t.map_or(Duration::ZERO, |t| t.saturating_duration_since(at));
                    timings.observe(Timing::HandshakeAfterFinish, after(self.handshake_at));
                    timings.observe(Timing::ComputedAfterFinish, after(self.last_computed));
                    timings.observe(Timing::SentAfterFinish, after(self.last_sent));
                }
                self.shared.writers.get(&auth.endpoint).notice(notice);
                None
            }
            ProducerEffect::Release { outcome, reason } => {
                self.shared.stats.producers_released.inc();
                tracing::info!(?outcome, ?reason, "released: every admitted write drained");
                let (group, to) = &self.released_to;
                to.do_send(ProducerEnded {
                    group: *group,
                    request: self.machine.request.clone(),
                    outcome,
                    reason,
                });
                match via {
                    Via::Actor(ctx) => ctx.stop(),
                    Via::Caller | Via::Writer => self.me.do_send(Stop),
                }
                None
            }
            ProducerEffect::Dropped(why) => {
                self.shared.stats.events_dropped.inc();
                tracing::info!(?why, "event dropped");
                None
            }
        }
    }
}

impl Actor for ProducerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let core = self.cell.lock();
        let _g = core.span.enter();
        tracing::info!("opened");
        ctx.run_later(core.shared.handshake_timeout, |a, ctx| {
            a.cell.clone().handle(false, |core| {
                if !core.machine.has_handshake() {
                    let span = tracing::info_span!(parent: &core.span, "msg", kind = "TimedOut");
                    let _g = span.enter();
                    core.feed(ProducerEvent::TimedOut, &mut Via::Actor(ctx));
                }
            });
        });
    }
}

impl ProducerActor {
    /// Runs one message's handler: `f` on the state, under the lock; a
    /// message sent through a [`ProducerRef`] (`counted`) leaves the inbox
    /// count once handled.
    fn handle_with(
        &mut self,
        ctx: &mut Context<Self>,
        counted: bool,
        f: impl FnOnce(&mut ProducerCore, &mut Via<'_>),
    ) {
        self.cell
            .clone()
            .handle(counted, |core| f(core, &mut Via::Actor(ctx)));
    }
}

impl Handler<Stop> for ProducerActor {
    type Result = ();
    fn handle(&mut self, _: Stop, ctx: &mut Context<Self>) {
        ctx.stop();
    }
}

/// A handler: a `msg` span (`kind`: the message's type name, and the given
/// span fields) around feeding the event to the machine. One line each
/// below: whether the message is counted in the inbox (sent through a
/// [`ProducerRef`]) or a writer's report, message, the event it becomes;
/// span fields.
macro_rules! producer_handler {
    ($counted:literal, $msg:ident, |$m:ident| $ev:expr $(; $($field:tt)+)?) => {
        impl Handler<$msg> for ProducerActor {
            type Result = ();
            fn handle(&mut self, $m: $msg, ctx: &mut Context<Self>) {
                self.handle_with(ctx, $counted, |core, via| {
                    let span = tracing::info_span!(parent: &core.span, "msg", kind = stringify!($msg) $(, $($field)+)?);
                    let _g = span.enter();
                    core.feed($ev, via);
                });
            }
        }
    };
}

producer_handler!(true, HandshakeArrived, |m| ProducerEvent::Handshake(m.0);
    generation = m.0.generation.0, blocks = m.0.block_ids.len());
producer_handler!(true, LayerReady, |m| ProducerEvent::LayerReady { layer: m.layer, blocks: m.blocks, after: m.after };
    layer = m.layer, blocks = ?m.blocks);
/// Where the writers report a write's end: the producer that admitted it.
/// The completion path as one walk: the writer lane that saw the write end
/// runs the producer's `LayerWritten` / `LayerWriteFailed` on its own
/// thread when the producer is idle (an inline run,
/// [`ActorCell::try_inline`]: nothing sent to it unhandled, its lock free),
/// so the common write's end crosses no thread to reach the producer's
/// machine; otherwise it is sent to the actor, as every message is. Under
/// the lane's lock: the producer's lock is only tried (rule 3 of
/// [`crate::actors::cell`] holds: no one waits for a lock while holding
/// another).
struct WriterReports {
    cell: std::sync::Weak<ProducerCell>,
    addr: Addr<ProducerActor>,
}

impl WriterReports {
    /// Runs `f` with `m` on this thread if the producer is idle; sends `m`
    /// otherwise (or drops it: the actor ended).
    fn report<M>(&self, m: M, f: impl FnOnce(&mut ProducerCore, M))
    where
        M: Message<Result = ()> + Send + 'static,
        ProducerActor: Handler<M>,
    {
        let mut m = Some(m);
        if let Some(cell) = self.cell.upgrade() {
            // under the lane's lock: only tried (rule 3)
            cell.try_inline(Wait::No, |core| {
                // a released producer's actor takes what comes after
                if core.machine.phase() == ProducerPhase::Released {
                    return None;
                }
                core.shared.stats.writes_reported_inline.inc();
                f(core, m.take()?);
                Some(())
            });
        }
        if let Some(m) = m {
            self.addr.do_send(m);
        }
    }
}

impl WriteEnds for WriterReports {
    fn written(&self, m: LayerWritten) {
        self.report(m, |core, m| core.written(m, &mut Via::Writer));
    }
    fn failed(&self, m: LayerWriteFailed) {
        self.report(m, |core, m| core.write_failed(m, &mut Via::Writer));
    }
}

impl ProducerCore {
    /// A write ended well (`LayerWritten`, from its writer).
    fn written(&mut self, m: LayerWritten, via: &mut Via<'_>) {
        let span = tracing::info_span!(parent: &self.span, "msg", kind = "LayerWritten",
            write = m.write, bytes = m.bytes);
        let _g = span.enter();
        // A few in reserve: as many as writes are usually in flight;
        // beyond that, for any producer of this runtime.
        if m.first_sent > self.last_sent {
            self.last_sent = m.first_sent;
        }
        if m.computed > self.last_computed {
            self.last_computed = m.computed;
        }
        if self.spare.len() < 8 && m.spare.capacity() > 0 {
            self.spare.push(m.spare);
        } else {
            self.shared.buffers.give(m.spare);
        }
        let ev = ProducerEvent::WriteDone {
            write: m.write,
            generation: m.generation,
            bytes: m.bytes,
        };
        self.feed(ev, via);
    }

    /// A write failed (`LayerWriteFailed`, from its writer).
    fn write_failed(&mut self, m: LayerWriteFailed, via: &mut Via<'_>) {
        let span = tracing::info_span!(parent: &self.span, "msg", kind = "LayerWriteFailed",
            write = m.write, reason = %m.reason);
        let _g = span.enter();
        let ev = ProducerEvent::WriteFailed {
            write: m.write,
            generation: m.generation,
            reason: m.reason,
        };
        self.feed(ev, via);
    }
}

impl Handler<LayerWritten> for ProducerActor {
    type Result = ();
    fn handle(&mut self, m: LayerWritten, ctx: &mut Context<Self>) {
        self.handle_with(ctx, false, |core, via| core.written(m, via));
    }
}

impl Handler<LayerWriteFailed> for ProducerActor {
    type Result = ();
    fn handle(&mut self, m: LayerWriteFailed, ctx: &mut Context<Self>) {
        self.handle_with(ctx, false, |core, via| core.write_failed(m, via));
    }
}
producer_handler!(true, FinishRequest, |_m| ProducerEvent::Finish);
producer_handler!(true, AbortRequest, |m| ProducerEvent::Abort { reason: m.reason }; reason = %m.reason);
impl Handler<ReleaseUnclaimed> for ProducerActor {
    type Result = ();
    fn handle(&mut self, m: ReleaseUnclaimed, ctx: &mut Context<Self>) {
        self.handle_with(ctx, true, |core, via| {
            let claimed = core.machine.has_handshake();
            let span = tracing::info_span!(parent: &core.span, "msg", kind = "ReleaseUnclaimed",
                claimed, reason = %m.reason);
            let _g = span.enter();
            // A claimed producer writes on (its blocks come back once the
            // writes drained); an unclaimed one has written nothing and no
            // consumer to tell: it ends at once, and a handshake that comes
            // later finds the request ended.
            if !claimed {
                core.shared.stats.producers_unclaimed_released.inc();
                core.feed(ProducerEvent::Abort { reason: m.reason }, via);
            }
        });
    }
}
impl Handler<FenceQuery> for ProducerActor {
    type Result = ();
    fn handle(&mut self, m: FenceQuery, ctx: &mut Context<Self>) {
        self.handle_with(ctx, true, |core, _| {
            let answer = core.machine.fence(m.generation);
            let span = tracing::info_span!(parent: &core.span, "msg", kind = "FenceQuery",
                generation = m.generation.0, answer = ?answer);
            let _g = span.enter();
            let _ = m.reply.send(answer);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::{append_segments, PagesBack, RangeBuffers, SourceBlocks};
    use crate::staging::arena::StagingArena;
    use crate::transport::WriteRange;

    #[test]
    fn a_layer_piece_goes_back_once_written_by_every_member_and_read_by_none() {
        let arena = std::sync::Arc::new(parking_lot::Mutex::new(
            StagingArena::new(0x10_0000, 1 << 16).unwrap(),
        ));
        let used = || arena.lock().pieces();
        let src = SourceBlocks::new((0..8).collect());
        // two members: each writes its own units of every piece
        src.stage_by_layer(arena.clone(), 2, false);
        let a = src.stage_layer(0, 0..4, 4096).unwrap();
        assert_eq!((a.start, a.blocks, used()), (0, 4, 1));
        let (id, got, order) = src.take_piece(0, &(0..4)).unwrap();
        assert_eq!((got, order), (a, None));
        assert!(src.take_piece(0, &(0..5)).is_none(), "another chunk");
        assert!(src.take_piece(1, &(0..4)).is_none(), "another layer");
        src.piece_read(id, true);
        assert_eq!(used(), 1, "one member of two wrote it");
        let (id2, _, _) = src.take_piece(0, &(0..4)).unwrap();
        src.piece_read(id2, false);
        assert_eq!(used(), 1, "a failed write is no write");
        let (id3, _, _) = src.take_piece(0, &(0..4)).unwrap();
        src.piece_read(id3, true);
        assert_eq!(used(), 0, "both members wrote it: back");
        assert!(
            src.take_piece(0, &(0..4)).is_none(),
            "later writes read the pages"
        );
        // gathered again (the same chunk sent again) while a write reads the
        // first: the write keeps its piece, the next write reads the new one
        let b = src.stage_layer(1, 4..8, 4096).unwrap();
        let (rb, _, _) = src.take_piece(1, &(4..8)).unwrap();
        let c = src.stage_layer(1, 4..8, 4096).unwrap();
        assert_ne!(b.base, c.base, "the first is still read");
        assert_eq!(used(), 2);
        let (rc, got, _) = src.take_piece(1, &(4..8)).unwrap();
        assert_eq!(got, c);
        src.piece_read(rb, true);
        assert_eq!(used(), 1, "the replaced piece back when its reader ended");
        // the group ends: every piece back, none given any more
        src.close(&crate::actors::stats::Timings::default());
        assert_eq!(used(), 0);
        src.piece_read(rc, true); // late: nothing to free twice
        assert!(src.stage_layer(2, 0..1, 256).is_none());
        assert_eq!(used(), 0);
        // a region without room gives none
        let small = SourceBlocks::new((0..8).collect());
        small.stage_by_layer(arena.clone(), 1, false);
        assert!(small.stage_layer(0, 0..8, 1 << 20).is_none());
        assert!(small.stage_layer(0, 0..1, 256).is_some());
        assert_eq!(used(), 1);
        drop(small);
        assert_eq!(used(), 0, "dropped with its last owner: back");
    }

    #[test]
    fn pages_go_only_when_every_layer_handed_over_is_in_a_piece_or_written_and_none_reads_them() {
        let arena = std::sync::Arc::new(parking_lot::Mutex::new(
            StagingArena::new(0x10_0000, 1 << 16).unwrap(),
        ));
        let src = SourceBlocks::new((0..8).collect());
        let ready = [(0, 0..4), (1, 0..4), (0, 4..4)];
        assert_eq!(src.let_pages_go(&ready), PagesBack::Never, "not staged by layer");
        src.stage_by_layer(arena.clone(), 1, false);
        src.stage_layer(0, 0..4, 4096).unwrap();
        assert_eq!(
            src.let_pages_go(&ready),
            PagesBack::NotYet,
            "layer 1 has no piece"
        );
        src.stage_layer(1, 0..4, 4096).unwrap();
        // layer 0 written and back: at decode, so it counts
        let (id, _, _) = src.take_piece(0, &(0..4)).unwrap();
        src.piece_read(id, true);
        assert_eq!(arena.lock().pieces(), 1);
        // a write reading the pages holds them
        assert!(src.take_pages());
        assert_eq!(
            src.let_pages_go(&ready),
            PagesBack::NotYet,
            "a write reads the pages"
        );
        src.pages_read((1, 0, 4), 0, true);
        assert!(!src.pages_gone());
        assert_eq!(
            src.let_pages_go(&ready),
            PagesBack::Now,
            "an empty chunk needs no piece"
        );
        assert!(src.pages_gone());
        assert_eq!(src.let_pages_go(&ready), PagesBack::Before, "given up once");
        assert!(!src.take_pages(), "no write reads them any more");
        // a group that ended has no pieces to write from
        let ended = SourceBlocks::new((0..4).collect());
        ended.stage_by_layer(arena.clone(), 1, false);
        ended.stage_layer(0, 0..4, 4096).unwrap();
        ended.close(&crate::actors::stats::Timings::default());
        assert_eq!(ended.let_pages_go(&[(0, 0..4)]), PagesBack::Never);
        assert!(ended.take_pages());
    }

    #[test]
    fn a_layer_written_from_the_pages_counts_once_every_member_wrote_it() {
        let arena = std::sync::Arc::new(parking_lot::Mutex::new(
            StagingArena::new(0x10_0000, 1 << 16).unwrap(),
        ));
        let src = SourceBlocks::new((0..8).collect());
        assert_eq!(
            (src.join(), src.join()),
            (0, 1),
            "members in the order they are made"
        );
        src.stage_by_layer(arena.clone(), 2, false);
        src.stage_layer(0, 0..4, 4096).unwrap();
        // layer 1 found no room: both members write it from the pages
        let ready = [(0, 0..4), (1, 0..4)];
        let key = (1, 0, 4);
        assert_eq!(
            src.let_pages_go(&ready),
            PagesBack::NotYet,
            "layer 1 is on the pages only"
        );
        // a write of layer 1 by `member` from the pages ends (`ok`: well)
        let from_pages = |src: &SourceBlocks, member: u32, ok: bool| {
            assert!(src.take_pages());
            src.pages_read(key, member, ok);
        };
        for (member, ok, why) in [
            (0, true, "member 0 alone"),
            (0, true, "member 0 twice is not every member"),
            (1, false, "member 1's write failed"),
            (7, true, "no member 7 in a group of 2"),
        ] {
            from_pages(&src, member, ok);
            assert_eq!(src.let_pages_go(&ready), PagesBack::NotYet, "{why}");
        }
        // computed again before member 1 wrote it: member 0's old write is
        // not of what the pages hold now (and no room this time)
        let full = SourceBlocks::new((0..8).collect());
        full.stage_by_layer(
            std::sync::Arc::new(parking_lot::Mutex::new(
                StagingArena::new(0x10_0000, 256).unwrap(),
            )),
            2,
            false,
        );
        from_pages(&full, 0, true);
        assert!(full.stage_layer(1, 0..4, 4096).is_none(), "no room");
        from_pages(&full, 1, true);
        let only_layer_1 = [(1, 0..4)];
        assert_eq!(
            full.let_pages_go(&only_layer_1),
            PagesBack::NotYet,
            "member 0 wrote the old pages"
        );
        from_pages(&full, 0, true);
        assert_eq!(full.let_pages_go(&only_layer_1), PagesBack::Now);
        // back in the first group: member 1 writes it too
        from_pages(&src, 1, true);
        assert_eq!(
            src.let_pages_go(&ready),
            PagesBack::Now,
            "layer 0 in its piece, layer 1 written by both"
        );
        assert!(!src.take_pages(), "no write reads them any more");
        assert_eq!(arena.lock().pieces(), 1, "layer 0's piece stays for its writes");
    }

    /// Two requests gathered layer by layer in one forward (vLLM computes
    /// a step's requests together), in a region with room for one
    /// request's layers: taking pieces layer by layer stages both in part,
    /// so neither can give its pages back early; staged whole
    /// (`orbitkv.pd.staging_pieces` `request`), the first to miss gives
    /// back the pieces no write took and the other is staged whole.
    #[test]
    fn a_request_staged_whole_gives_back_its_untaken_pieces_on_a_miss_so_another_is_staged_whole() {
        const LAYERS: u32 = 4;
        const PIECE: u64 = 4096;
        let ready: Vec<(u32, std::ops::Range<u32>)> = (0..LAYERS).map(|l| (l, 0..4)).collect();
        // (requests staged: layers with a piece each, pieces given up,
        // what each request's pages may do once finished)
        let run = |whole: bool| {
            let arena = std::sync::Arc::new(parking_lot::Mutex::new(
                StagingArena::new(0x10_0000, LAYERS as u64 * PIECE).unwrap(),
            ));
            let (a, b) = (
                SourceBlocks::new((0..4).collect()),
                SourceBlocks::new((4..8).collect()),
            );
            a.stage_by_layer(arena.clone(), 1, whole);
            b.stage_by_layer(arena.clone(), 1, whole);
            // layer 0 of both was written already (decode authorized early):
            // it is at decode, and its piece back
            for r in [&a, &b] {
                r.stage_layer(0, 0..4, PIECE).unwrap();
                let (id, _, _) = r.take_piece(0, &(0..4)).unwrap();
                r.piece_read(id, true);
            }
            // layer 1 of `a` is being written (a write reads its piece)
            a.stage_layer(1, 0..4, PIECE).unwrap();
            let (reading, _, _) = a.take_piece(1, &(0..4)).unwrap();
            let mut got = [0u32; 2];
            for l in 1..LAYERS {
                for (i, r) in [&a, &b].into_iter().enumerate() {
                    if l == 1 && i == 0 {
                        got[0] += 1;
                        continue;
                    }
                    got[i] += u32::from(r.stage_layer(l, 0..4, PIECE).is_some());
                }
            }
            let given_up = a.take_given_up() + b.take_given_up();
            let back = [a.let_pages_go(&ready), b.let_pages_go(&ready)];
            let used = arena.lock().pieces();
            a.piece_read(reading, true);
            (got, given_up, back, used)
        };
        // by layer: layers 1 and 2 of both fill the region of 4; both miss
        // layer 3
        let (got, given_up, back, used) = run(false);
        assert_eq!(got, [2, 2], "layers 1 and 2 each, layer 3 of neither");
        assert_eq!(given_up, 0);
        assert_eq!(back, [PagesBack::NotYet; 2], "each has a layer on its pages only");
        assert_eq!(used, 4);
        // whole: `a` misses layer 3 first and gives back layer 2's piece (no
        // write took it), not layer 1's (read now); b takes the room
        let (got, given_up, back, used) = run(true);
        assert_eq!(got, [2, 3], "b got every layer");
        assert_eq!(given_up, 1, "a's layer 2");
        assert_eq!(back, [PagesBack::NotYet, PagesBack::Now], "b's pages may go back");
        assert_eq!(used, 4, "a's layer 1 and b's layers 1 to 3");
    }

    #[test]
    fn a_request_that_missed_a_layer_gives_back_only_pieces_no_write_took_and_takes_no_more() {
        let arena = std::sync::Arc::new(parking_lot::Mutex::new(
            StagingArena::new(0x10_0000, 3 * 4096).unwrap(),
        ));
        let used = || arena.lock().pieces();
        let src = SourceBlocks::new((0..8).collect());
        src.stage_by_layer(arena.clone(), 2, true);
        // layer 0: read by a write now; layer 1: written by one member of
        // two; layer 2: gathered, no write yet
        src.stage_layer(0, 0..4, 4096).unwrap();
        let (reading, _, _) = src.take_piece(0, &(0..4)).unwrap();
        src.stage_layer(1, 0..4, 4096).unwrap();
        let (once, _, _) = src.take_piece(1, &(0..4)).unwrap();
        src.piece_read(once, true);
        let untaken = src.stage_layer(2, 0..4, 4096).unwrap();
        assert_eq!(used(), 3);
        // layer 3 finds no room
        assert!(src.stage_layer(3, 0..4, 4096).is_none());
        assert_eq!(src.take_given_up(), 1, "only layer 2's piece");
        assert_eq!(src.take_given_up(), 0, "counted once");
        assert_eq!(used(), 2);
        assert!(
            src.take_piece(2, &(0..4)).is_none(),
            "layer 2 is written from the pages"
        );
        assert!(
            src.take_piece(1, &(0..4)).is_some(),
            "layer 1's second member still reads its piece"
        );
        // room again, but the request takes none any more, not even for a
        // chunk gathered again
        src.piece_read(reading, true);
        let other = SourceBlocks::new((0..8).collect());
        other.stage_by_layer(arena.clone(), 1, true);
        let reused = other.stage_layer(0, 0..4, 4096).unwrap();
        assert_eq!(reused.base, untaken.base, "the room went to another request");
        assert!(src.stage_layer(4, 0..4, 4096).is_none());
        assert!(src.stage_layer(0, 4..8, 4096).is_none(), "nor a later chunk");
        assert_eq!(src.take_given_up(), 0);
        // by layer (the default) a miss gives nothing back
        let roomy = std::sync::Arc::new(parking_lot::Mutex::new(
            StagingArena::new(0x10_0000, 2 * 4096).unwrap(),
        ));
        let by_layer = SourceBlocks::new((0..8).collect());
        by_layer.stage_by_layer(roomy.clone(), 1, false);
        by_layer.stage_layer(0, 0..4, 4096).unwrap();
        assert!(by_layer.stage_layer(1, 0..8, 1 << 20).is_none());
        assert!(
            by_layer.stage_layer(2, 0..4, 4096).is_some(),
            "a later layer may still find room"
        );
        assert_eq!((by_layer.take_given_up(), roomy.lock().pieces()), (0, 2));
    }

    #[test]
    fn a_chunks_blocks_go_after_each_groups_own() {
        assert_eq!(append_segments(&[1, 2], &[3], 1), vec![1, 2, 3]);
        assert_eq!(append_segments(&[1, 2, 5, 6], &[3, 7], 2), vec![1, 2, 3, 5, 6, 7]);
        assert_eq!(append_segments(&[], &[3, 7], 2), vec![3, 7]);
        // Uneven: appended whole, for the check after it to refuse.
        assert_eq!(append_segments(&[1, 2], &[3], 2), vec![1, 2, 3]);
        // A block freed (out of a window) and given back: its old place is a hole.
        let h = super::HOLE;
        assert_eq!(append_segments(&[1, 2, 5, 6], &[3, 5], 2), vec![1, 2, 3, h, 6, 5]);
    }

    fn list(capacity: usize, filled: usize) -> Vec<WriteRange> {
        let mut v = Vec::with_capacity(capacity);
        v.extend((0..filled as u64).map(|i| WriteRange {
            src: i,
            dst: i,
            len: 1,
        }));
        v
    }

    #[test]
    fn kept_lists_come_back_empty_and_bounded() {
        let b = RangeBuffers::default();
        assert!(b.take().is_none());
        for _ in 0..RangeBuffers::KEPT + 10 {
            b.give(list(64, 5));
        }
        assert_eq!(b.len(), RangeBuffers::KEPT, "more lists kept than the bound");
        let got = b.take().expect("a kept list");
        assert!(got.is_empty(), "a kept list must come back empty");
        assert!(got.capacity() >= 64);
    }

    #[test]
    fn large_and_unallocated_lists_are_not_kept() {
        let b = RangeBuffers::default();
        b.give(Vec::new());
        b.give(list(RangeBuffers::MAX_RANGES + 1, 1));
        assert!(b.is_empty());
        b.give(list(RangeBuffers::MAX_RANGES, 0));
        assert_eq!(b.len(), 1);
    }
}
