//! Staging: one request's KV gathered into a contiguous region, so that a
//! layer of scattered blocks (or of head slices) crosses the link as a few
//! large Mooncake writes instead of one write per block.
//!
//! The producer gathers each computed layer of its request blocks into its
//! *source staging* (a device copy, done by the worker: `orbitkv.vllm.staging`),
//! the runtime writes the part the consumer authorized into the consumer's
//! *staging grant* with [`StagedPlan`], and the consumer scatters the
//! grant into its pages once every producer reported done, before the KV is
//! published complete. Every remote byte is still moved by Mooncake.
//!
//! # Staged order
//!
//! A rank's staged copy of `capacity` request blocks is laid out layer by
//! layer, plane by plane, then *unit* by unit, then block by block: unit `u`
//! of request block `i` of (layer `l`, plane `p`) is at
//! `offset(l, p) + (u * capacity + i) * unit_bytes(l, p)`. A unit is one KV
//! head when the layout is head-major, else the whole block. Unit-major
//! order is what makes a head slice contiguous: the heads a producer sends
//! a consumer of another TP size are consecutive units, each a run of
//! consecutive blocks.
//!
//! # Safety contract
//!
//! A grant is authorized in the consumer's handshake exactly like its block
//! IDs (rules 1, 2): every planned destination lies inside it, checked
//! again range by range. It is given by [`arena::StagingArena`] when the
//! consumer opens the request and returned to the arena only when the
//! consumer actor is released (no producer can write into it any more: the
//! same moment its pages are freed, rule 6 and the quarantine), so it is
//! fenced by the request's generation like the pages: a new generation gets
//! a new grant. A producer writes into a grant only when both sides stage
//! ([`staging_compatible`]); its notice then says so (`staged`), and the
//! consumer scatters only the heads of producers that said so.

pub mod arena;

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::GeometryError;
use crate::layout::{push_merged, KvLayout, Target, WriteRange};

/// A consumer's staging grant for one request: `len` bytes at the consumer's
/// virtual address `base`, inside its registered staging region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StagingGrant {
    pub base: u64,
    pub len: u64,
    /// The grant's staged order: units per group ([`StagedOrder`]); 1
    /// (unit-major, what an older consumer grants) is left out on the wire.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub group: u32,
}

fn one() -> u32 {
    1
}

fn is_one(g: &u32) -> bool {
    *g == 1
}

/// A producer's source staging for one request: the staged copy of request
/// blocks `0..capacity` at local address `base` (the worker gathers into it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SourceStaging {
    pub base: u64,
    pub capacity: u32,
    /// Units per group of its staged order (1: unit-major; [`source_group`]).
    pub group: u32,
}

/// How a producer stages one request on its side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// One staging of every layer of the whole request, given by the
    /// worker at open and held until the request's release.
    Whole(SourceStaging),
    /// A piece per layer and chunk, grouped by `group` units, given by the
    /// runtime from its source region as the worker gathers each layer
    /// (`Runtime::producer_stage_layer`) and taken back as soon as every
    /// write of it ended: a request holds only the layers still in flight.
    ByLayer { group: u32 },
}

impl SourceKind {
    /// Units per group of the staged order.
    pub fn group(&self) -> u32 {
        match self {
            Self::Whole(s) => s.group,
            Self::ByLayer { group } => *group,
        }
    }
}

/// The staged copy of one layer of request blocks `start..start + blocks`
/// at local address `base`: the layer's planes one after the other, each
/// in the staged order of `blocks` blocks ([`layer_slots`]). A producer
/// that stages by layer ([`Self`] given by the runtime per layer and chunk,
/// `Runtime::producer_stage_layer`) has one per layer and chunk; a whole
/// [`SourceStaging`] is one per layer over every request block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayerSource {
    pub base: u64,
    pub start: u32,
    pub blocks: u32,
}

/// A layer piece given to the worker: where it is, and each plane's
/// (offset from its start, unit bytes) in it ([`layer_slots`]).
pub type GivenPiece = (LayerSource, Vec<(u64, u64)>);

/// Layer `layer` of `layout` staged for `blocks` blocks: each plane's
/// (offset from the layer's start, unit bytes), and the layer's bytes;
/// `None` past the layers or on overflow. The same offsets as the layer's
/// part of a [`StagedOrder`] of `blocks` blocks, less its first offset.
pub fn layer_slots(layout: &KvLayout, layer: usize, blocks: u32) -> Option<(Vec<(u64, u64)>, u64)> {
    let u = units(layout) as u64;
    let mut off: u64 = 0;
    let mut planes = Vec::new();
    for p in &layout.layers.get(layer)?.planes {
        planes.push((off, p.block_bytes / u));
        off = off.checked_add(p.block_bytes.checked_mul(blocks as u64)?)?;
    }
    Some((planes, off))
}

/// What a consumer scatters once every producer reported done: its grant,
/// the authorized blocks staged there (in request order, from the
/// handshake's `first_block`), and the consumer-local units (heads) that
/// staging producers wrote, merged and sorted. Units not listed were
/// written into the pages directly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagedKv {
    pub grant: StagingGrant,
    pub blocks: u32,
    pub units: Vec<Range<u32>>,
}

/// The group of the source staging a producer of layout `local` gathers
/// for a consumer instance of TP size `consumer_tp`: the heads of one
/// consumer rank when each consumer rank holds a whole, distinct part of
/// this rank's heads (the consumer's TP size this one's or a multiple of
/// it, head counts dividing evenly: under equal TP that is the whole block,
/// so the staging lies in the consumer's page order), else 1 (unit-major).
pub fn source_group(local: &KvLayout, consumer_tp: u32) -> u32 {
    let (tp, total) = (local.tp_size.max(1), local.total_kv_heads);
    if !local.head_major || consumer_tp < tp || consumer_tp % tp != 0 || total % consumer_tp != 0 {
        return 1;
    }
    let per = total / consumer_tp;
    if per >= 1 && units(local) % per == 0 {
        per
    } else {
        1
    }
}

/// The group of the staging grant a consumer of layout `local` gives a
/// producer instance of TP size `producer_tp`: its whole block (every unit)
/// when all its heads come from one producer rank of the same or a smaller TP size
/// (the producer then stages grouped by exactly these heads,
/// [`source_group`]), else 1 (unit-major).
pub fn grant_group(local: &KvLayout, producer_tp: u32) -> u32 {
    let tp = local.tp_size.max(1);
    let u = units(local);
    if local.head_major
        && producer_tp >= 1
        && producer_tp <= tp
        && tp % producer_tp == 0
        && local.total_kv_heads % tp == 0
    {
        u
    } else {
        1
    }
}

/// A consumer's grant, shared with the arena it came from (the consumer
/// actor returns it when released).
pub type SharedArena = std::sync::Arc<parking_lot::Mutex<arena::StagingArena>>;

/// Bytes and pieces handed out of `arena` now ((0, 0) without one).
pub fn in_use(arena: Option<&SharedArena>) -> (u64, usize) {
    arena.map_or((0, 0), |a| {
        let a = a.lock();
        (a.used_bytes(), a.pieces())
    })
}

/// Units per block of `layout`: its KV heads when head-major, else 1.
pub fn units(layout: &KvLayout) -> u32 {
    if layout.head_major {
        layout.local_heads().max(1)
    } else {
        1
    }
}

/// Whether a staged order of `layout` may be grouped by `group` units: it
/// must divide the units of a block (1 always does).
pub fn group_fits(layout: &KvLayout, group: u32) -> bool {
    group != 0 && units(layout) % group == 0
}

/// A rank's staged order for `capacity` blocks: where each (layer, plane)
/// starts and the bytes of one unit there. Built once per request (a
/// producer's per authorization), so no layer write walks the layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagedOrder {
    pub capacity: u32,
    /// Units per group (1: unit-major).
    pub group: u32,
    /// `slots[layer][plane]`: (offset, unit bytes).
    pub slots: Vec<Vec<(u64, u64)>>,
    /// Bytes of the whole staged copy.
    pub bytes: u64,
}

impl StagedOrder {
    /// The unit-major order; `None` on overflow.
    pub fn new(layout: &KvLayout, capacity: u32) -> Option<Self> {
        Self::grouped(layout, capacity, 1)
    }

    /// The order grouped by `group` units (which must divide the units per
    /// block: `None` otherwise, or on overflow). The slots and the size do
    /// not depend on the group, only where a unit lies inside a slot.
    pub fn grouped(layout: &KvLayout, capacity: u32, group: u32) -> Option<Self> {
        if !group_fits(layout, group) {
            return None;
        }
        let u = units(layout) as u64;
        let mut off: u64 = 0;
        let mut slots = Vec::with_capacity(layout.layers.len());
        for l in &layout.layers {
            let mut planes = Vec::with_capacity(l.planes.len());
            for p in &l.planes {
                planes.push((off, p.block_bytes / u));
                off = off.checked_add(p.block_bytes.checked_mul(capacity as u64)?)?;
            }
            slots.push(planes);
        }
        Some(Self {
            capacity,
            group,
            slots,
            bytes: off,
        })
    }

    /// Offset of unit `unit` of block `block` of (`layer`, `plane`) from
    /// the staged copy's base; `None` when any is out of range.
    pub fn offset(&self, layer: usize, plane: usize, unit: u32, block: u32) -> Option<u64> {
        let &(off, ub) = self.slots.get(layer)?.get(plane)?;
        if block >= self.capacity {
            return None;
        }
        let g = self.group as u64;
        let (q, r) = (unit as u64 / g, unit as u64 % g);
        off.checked_add(((q * self.capacity as u64 + block as u64) * g + r).checked_mul(ub)?)
    }
}

/// Bytes of the staged copy of `capacity` blocks of `layout` (every layer
/// and plane); `None` on overflow.
pub fn staged_bytes(layout: &KvLayout, capacity: u32) -> Option<u64> {
    StagedOrder::new(layout, capacity).map(|o| o.bytes)
}

/// Whether a producer of layout `producer` may stage into a consumer of
/// layout `consumer`: both head-major (units are heads), or neither and
/// both hold the same heads (units are whole blocks). Otherwise the staged
/// orders differ and the producer writes pages directly.
pub fn staging_compatible(producer: &KvLayout, consumer: &KvLayout) -> bool {
    // Staged orders are block by block: blocks of another number of tokens
    // are written into the pages, token by token (`KvLayout::plan_tokens`).
    if producer.block_size != consumer.block_size {
        return false;
    }
    let whole_blocks =
        || !producer.head_major && !consumer.head_major && producer.heads_range() == consumer.heads_range();
    let heads = || {
        producer.head_major
            && consumer.head_major
            && producer.layers.iter().zip(&consumer.layers).all(|(pl, cl)| {
                pl.planes.iter().zip(&cl.planes).all(|(pp, cp)| {
                    pp.block_bytes % units(producer) as u64 == 0
                        && cp.block_bytes % units(consumer) as u64 == 0
                        && pp.block_bytes / units(producer) as u64 == cp.block_bytes / units(consumer) as u64
                })
            })
    };
    whole_blocks() || heads()
}

/// The consumer-local units (heads, or `0..1` for whole blocks) that
/// producer rank `producer_rank` of an instance of TP size `producer_tp`
/// writes into `consumer`'s grant when it stages: what the consumer
/// scatters for it.
pub fn staged_units(consumer: &KvLayout, producer_tp: u32, producer_rank: u32) -> Range<u32> {
    if !consumer.head_major {
        return 0..1;
    }
    let c = consumer.heads_range();
    let p = crate::layout::rank_heads_range(consumer.total_kv_heads, producer_tp, producer_rank);
    let (s, e) = (p.start.max(c.start), p.end.min(c.end));
    if s >= e {
        return 0..0;
    }
    (s - c.start)..(e - c.start)
}

/// Where a [`StagedPlan`] writes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Dest {
    /// The consumer's staging grant, staged in `order`.
    Grant { grant: StagingGrant, order: StagedOrder },
    /// The consumer's pages (its authorized blocks, from the handshake),
    /// each a whole group of the source staging: `planes[layer][plane]`,
    /// and the runs of consecutive block IDs ([`id_runs`], made once per
    /// authorization).
    Pages {
        planes: Vec<Vec<crate::layout::Plane>>,
        block_ids: Vec<u32>,
        runs: Vec<(u32, u32)>,
    },
}

/// How one producer writes a layer from its source staging, fixed for an
/// authorization: built when the handshake is known, then used for every
/// layer write under it ([`StagedPlan::plan_layer`]). Either into the
/// consumer's staging grant (the consumer scatters it: [`Self::into_grant`])
/// or, when the source staging holds the consumer's blocks in its page
/// order, straight into the consumer's pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagedPlan {
    /// The request's whole source staging, when it has one
    /// ([`Self::plan_layer`]); `None`: it stages by layer and chunk
    /// ([`Self::plan_piece`] with each [`LayerSource`]).
    region: Option<SourceStaging>,
    /// Units per group of the source's staged order.
    group: u32,
    /// Units per block of this (the producer's) layout.
    units: u32,
    /// Block bytes of each plane of each layer of this layout.
    src_planes: Vec<Vec<u64>>,
    dest: Dest,
    first_block: u32,
    /// The sent units: the first in the producer's and in the consumer's
    /// order, and how many (0: this producer holds none of the consumer's heads).
    src_unit: u32,
    dst_unit: u32,
    count: u32,
}

impl StagedPlan {
    /// The plan for writing from `src` under `auth`; `Ok(None)` when
    /// neither the grant nor the pages can be written from this source
    /// staging (no grant and another page order, or layouts staged in
    /// different orders): the producer then writes from its pages.
    ///
    /// The pages are chosen when the consumer's block is exactly one group
    /// of the source staging (its page order) and either there is no
    /// usable grant or the pages take fewer than `min_ranges` ranges a
    /// layer (one per run of consecutive blocks and plane): no scatter.
    pub fn new(
        local: &KvLayout,
        src: SourceStaging,
        auth: Target<'_>,
        staging: Option<StagingGrant>,
        min_ranges: usize,
    ) -> Result<Option<Self>, GeometryError> {
        Self::build(local, Some(src), src.group, auth, staging, min_ranges)
    }

    /// The plan of a producer that stages by layer and chunk (grouped by
    /// `group` units): into the consumer's pages when its block is exactly
    /// one group, else `Ok(None)` (from the pages). Never into a grant: a
    /// grant is scattered whole once the request is done, so every layer
    /// must be in it, and a layer that finds no room in the source region
    /// is written from the pages.
    pub fn by_layer(
        local: &KvLayout,
        group: u32,
        auth: Target<'_>,
        min_ranges: usize,
    ) -> Result<Option<Self>, GeometryError> {
        Self::build(local, None, group, auth, None, min_ranges)
    }

    fn build(
        local: &KvLayout,
        region: Option<SourceStaging>,
        g: u32,
        auth: Target<'_>,
        staging: Option<StagingGrant>,
        min_ranges: usize,
    ) -> Result<Option<Self>, GeometryError> {
        let consumer = auth.layout;
        if !staging_compatible(local, consumer) {
            return Ok(None);
        }
        let (p, c) = (local.heads_range(), consumer.heads_range());
        let (src_unit, dst_unit, count) = if local.head_major {
            let (s, e) = (p.start.max(c.start), p.end.min(c.end));
            if s >= e {
                (0, 0, 0)
            } else {
                (s - p.start, s - c.start, e - s)
            }
        } else {
            (0, 0, 1)
        };
        let overflow = GeometryError::StagingOverflow;
        if !group_fits(local, g) {
            return Err(overflow);
        }
        if let Some(src) = region {
            let bytes = staged_bytes(local, src.capacity).ok_or(overflow.clone())?;
            src.base.checked_add(bytes).ok_or(overflow.clone())?;
        }
        let u = units(local);
        let src_planes: Vec<Vec<u64>> = local
            .layers
            .iter()
            .map(|l| l.planes.iter().map(|p| p.block_bytes).collect())
            .collect();
        // The sent units are whole in the source order: each unit a run of
        // blocks (unit-major), or exactly one group.
        let whole_group = g == count && src_unit % g == 0;
        let grant = match staging {
            Some(grant)
                if count == 0
                    || (g == 1 && grant.group == 1)
                    || (whole_group && grant.group == g && dst_unit % g == 0) =>
            {
                let order = StagedOrder::grouped(consumer, auth.block_ids.len() as u32, grant.group)
                    .ok_or(overflow.clone())?;
                grant.base.checked_add(grant.len).ok_or(overflow.clone())?;
                Some(Dest::Grant { grant, order })
            }
            _ => None,
        };
        // A consumer block is exactly the sent group, in every layer and plane.
        let same_blocks = || {
            consumer.layers.len() == src_planes.len()
                && consumer.layers.iter().zip(&src_planes).all(|(l, s)| {
                    l.planes.len() == s.len()
                        && l.planes
                            .iter()
                            .zip(s)
                            .all(|(p, &bb)| Some(p.block_bytes) == (bb / u as u64).checked_mul(count as u64))
                })
        };
        let pages = count > 0 && whole_group && dst_unit == 0 && count == units(consumer) && same_blocks();
        let dest = match grant {
            Some(grant) if !pages || page_runs(consumer, auth.block_ids) >= min_ranges => grant,
            _ if pages => Dest::Pages {
                planes: consumer.layers.iter().map(|l| l.planes.clone()).collect(),
                block_ids: auth.block_ids.to_vec(),
                runs: id_runs(auth.block_ids),
            },
            _ => return Ok(None),
        };
        Ok(Some(Self {
            region,
            group: g,
            units: u,
            src_planes,
            dest,
            first_block: auth.first_block,
            src_unit,
            dst_unit,
            count,
        }))
    }

    /// Whether this plan writes into the consumer's staging grant (its
    /// notice then says `staged` and the consumer scatters), not its pages.
    pub fn into_grant(&self) -> bool {
        matches!(self.dest, Dest::Grant { .. })
    }

    /// The order in which the worker should gather request blocks `blocks`
    /// (one chunk) into source staging slots `blocks` so that this plan
    /// writes them into the consumer's pages in the fewest ranges: the
    /// chunk's blocks sorted by the consumer's block ID (those before the
    /// handshake's `first_block`, never sent, first and in place). `order[k]`
    /// is the request block slot `blocks.start + k` holds. vLLM hands a
    /// cycled pool's blocks out in runs whose direction flips with every
    /// reuse, so prefill's and decode's blocks of a request run in opposite
    /// directions about half the time (`benches/fragmentation.py`): page to
    /// page that is a range per block, sorted it is one per set of
    /// consecutive decode IDs. `None`: request order (a plan into a grant,
    /// whose staged order is the request's; a chunk outside the
    /// authorization; or one already in order).
    ///
    /// `pinned` (first, last): that block of the chunk stays in its own
    /// slot. A chunk that ends inside a block shares that block, and its
    /// slot, with the next chunk, which gathers it again (with more tokens)
    /// while a write of the earlier chunk may still read the slot: the slot
    /// must hold the same request block in both chunks, as it does in
    /// request order. The worker pins the first block of every chunk but a
    /// request's first and the last block of every chunk but its last.
    pub fn gather_order(&self, blocks: Range<u32>, pinned: (bool, bool)) -> Option<Vec<u32>> {
        let Dest::Pages { block_ids, .. } = &self.dest else {
            return None;
        };
        let first = self.first_block;
        if blocks.end <= blocks.start || self.region.is_some_and(|r| blocks.end > r.capacity) {
            return None;
        }
        if blocks
            .end
            .checked_sub(first)
            .map_or(true, |n| n as usize > block_ids.len())
        {
            return None;
        }
        let mut order: Vec<u32> = blocks.clone().collect();
        let from = ((blocks.start.max(first) - blocks.start) as usize).max(pinned.0 as usize);
        let to = order.len() - pinned.1 as usize;
        if from < to {
            order[from..to].sort_by_key(|&i| block_ids[(i - first) as usize]);
        }
        if order.iter().copied().eq(blocks) {
            None
        } else {
            Some(order)
        }
    }

    /// The staged counterpart of [`crate::layout::plan_write`]: the ranges
    /// that write request blocks `blocks` of `layer` from the source staging
    /// into the grant or the pages. Request blocks before the handshake's
    /// `first_block` are skipped. Into a grant: one range per (plane, sent
    /// unit) per chunk (one per plane when the units are one group), merged
    /// where consecutive; into pages: one per run of consecutive blocks and
    /// plane. Every destination lies inside the grant or the authorized
    /// blocks and every source inside the source staging: anything else is
    /// an error, never a range.
    pub fn plan_layer(
        &self,
        layer: u32,
        blocks: Range<u32>,
        order: Option<&[u32]>,
        out: &mut Vec<WriteRange>,
    ) -> Result<(), GeometryError> {
        out.clear();
        let li = layer as usize;
        let Some(src) = self.region else {
            return Err(GeometryError::OutsideSource {
                index: blocks.end.saturating_sub(1),
                available: 0,
            });
        };
        if li >= self.src_planes.len() {
            return Err(GeometryError::LayerOutOfRange {
                layer,
                num_layers: self.src_planes.len(),
            });
        }
        // Layer `li` of the whole staging: after every earlier layer's.
        let before = self.src_planes[..li]
            .iter()
            .flatten()
            .try_fold(0u64, |acc, &bb| {
                acc.checked_add(bb.checked_mul(src.capacity as u64)?)
            })
            .ok_or(GeometryError::StagingOverflow)?;
        let piece = LayerSource {
            base: src
                .base
                .checked_add(before)
                .ok_or(GeometryError::StagingOverflow)?,
            start: 0,
            blocks: src.capacity,
        };
        self.plan_piece(layer, blocks, piece, order, out)
    }

    /// [`Self::plan_layer`] from `src`, the staged copy of `layer` that
    /// holds `blocks` (one chunk: a producer that stages by layer and chunk
    /// has one per layer and chunk). With `order`, slot
    /// `blocks.start - src.start + k` holds request block `order[k]`.
    pub fn plan_piece(
        &self,
        layer: u32,
        blocks: Range<u32>,
        src: LayerSource,
        order: Option<&[u32]>,
        out: &mut Vec<WriteRange>,
    ) -> Result<(), GeometryError> {
        out.clear();
        // A chunk gathered in another order than the request's
        // ([`Self::gather_order`]): slot `blocks.start + k` holds request
        // block `order[k]`, a permutation of the chunk's blocks.
        if let Some(order) = order {
            let permutation = order.len() == blocks.len() && {
                let mut seen = vec![false; order.len()];
                order.iter().all(|&i| {
                    blocks.contains(&i) && !std::mem::replace(&mut seen[(i - blocks.start) as usize], true)
                })
            };
            if !permutation || self.into_grant() {
                return Err(GeometryError::GatherOrder {
                    start: blocks.start,
                    end: blocks.end,
                    what: if permutation {
                        "staging grant"
                    } else {
                        "permutation"
                    },
                });
            }
        }
        let li = layer as usize;
        let layers = self.src_planes.len();
        let dest_layers = match &self.dest {
            Dest::Grant { order, .. } => order.slots.len(),
            Dest::Pages { planes, .. } => planes.len(),
        };
        if li >= layers || li >= dest_layers {
            return Err(GeometryError::LayerOutOfRange {
                layer,
                num_layers: layers,
            });
        }
        let first = self.first_block;
        let n = match &self.dest {
            Dest::Grant { order, .. } => order.capacity,
            Dest::Pages { block_ids, .. } => block_ids.len() as u32,
        };
        let (lo, hi) = (blocks.start.max(first), blocks.end);
        if lo >= hi {
            return Ok(());
        }
        if hi - first > n {
            return Err(GeometryError::OutsideAuthorization {
                index: hi - 1 - first,
                authorized: n as usize,
            });
        }
        let held = src.start as u64 + src.blocks as u64;
        if blocks.start < src.start || hi as u64 > held {
            return Err(GeometryError::OutsideSource {
                index: hi - 1,
                available: held.min(usize::MAX as u64) as usize,
            });
        }
        if self.count == 0 {
            return Ok(());
        }
        let inside = |at: u64, len: u64, base: u64, size: u64| {
            at >= base && at.checked_add(len).is_some_and(|end| end <= base + size)
        };
        // The piece's layout: each plane's staged blocks after the one before.
        let planes = &self.src_planes[li];
        let n = src.blocks as u64;
        let piece_bytes = planes
            .iter()
            .try_fold(0u64, |acc, &bb| acc.checked_add(bb.checked_mul(n)?))
            .ok_or(GeometryError::StagingOverflow)?;
        let (g, u) = (self.group as u64, self.units as u64);
        // Unit `unit` of request block `block` (in the piece's slot `block - src.start`).
        let src_at = |plane: usize, unit: u32, block: u32| {
            let slot = block
                .checked_sub(src.start)
                .ok_or(GeometryError::StagingOverflow)? as u64;
            let before: u64 = planes[..plane].iter().map(|&bb| bb * n).sum();
            let (q, r) = (unit as u64 / g, unit as u64 % g);
            (q * n + slot)
                .checked_mul(g)
                .and_then(|x| x.checked_add(r))
                .and_then(|x| x.checked_mul(planes[plane] / u))
                .and_then(|x| x.checked_add(before))
                .and_then(|o| src.base.checked_add(o))
                .ok_or(GeometryError::StagingOverflow)
        };
        let src_inside = |r: &WriteRange| {
            if inside(r.src, r.len, src.base, piece_bytes) {
                Ok(())
            } else {
                Err(GeometryError::OutsideSource {
                    index: hi - 1,
                    available: held.min(usize::MAX as u64) as usize,
                })
            }
        };
        // Units per range: each sent unit alone (unit-major), or the group.
        let (reps, per) = if self.group == 1 {
            (self.count, 1)
        } else {
            (1, self.count)
        };
        match &self.dest {
            Dest::Grant { grant, order } => {
                for (plane, &bb) in planes.iter().enumerate() {
                    let unit = bb / u;
                    let first_range = out.len();
                    for k in 0..reps {
                        let dst = order
                            .offset(li, plane, self.dst_unit + k, lo - first)
                            .and_then(|o| grant.base.checked_add(o))
                            .ok_or(GeometryError::StagingOverflow)?;
                        let len = ((hi - lo) as u64 * per as u64)
                            .checked_mul(unit)
                            .ok_or(GeometryError::StagingOverflow)?;
                        let r = WriteRange {
                            src: src_at(plane, self.src_unit + k, lo)?,
                            dst,
                            len,
                        };
                        if !inside(r.dst, r.len, grant.base, grant.len) {
                            return Err(GeometryError::OutsideStagingGrant {
                                dst: r.dst,
                                len: r.len,
                                base: grant.base,
                                grant: grant.len,
                            });
                        }
                        src_inside(&r)?;
                        push_merged(out, first_range, r);
                    }
                }
            }
            Dest::Pages {
                planes, block_ids, ..
            } if order.is_some() => {
                // Slot by slot: a run of slots holding consecutive decode
                // blocks (in either direction of the request's order) is
                // contiguous on both sides and merges into one range.
                let order = order.unwrap_or_default();
                for (plane, dp) in planes[li].iter().enumerate() {
                    let first_range = out.len();
                    for (k, &i) in order.iter().enumerate() {
                        if i < lo {
                            continue;
                        }
                        let r = WriteRange {
                            src: src_at(plane, self.src_unit, blocks.start + k as u32)?,
                            dst: dp.block_addr(block_ids[(i - first) as usize]),
                            len: dp.block_bytes,
                        };
                        src_inside(&r)?;
                        push_merged(out, first_range, r);
                    }
                }
            }
            Dest::Pages {
                planes,
                block_ids,
                runs,
            } => {
                // The sent group of consecutive request blocks is contiguous
                // in the source staging, as their pages are when the IDs are
                // consecutive and the plane's blocks packed: one range per
                // run then, else one per block.
                let (a, z) = (lo - first, hi - first);
                let from = runs.partition_point(|&(s, n)| s + n <= a);
                for (plane, dp) in planes[li].iter().enumerate() {
                    let first_range = out.len();
                    let packed = dp.block_stride == dp.block_bytes;
                    for &(s, n) in runs[from..].iter().take_while(|&&(s, _)| s < z) {
                        let (mut i, e) = (s.max(a), (s + n).min(z));
                        while i < e {
                            let blocks = if packed { e - i } else { 1 };
                            let r = WriteRange {
                                src: src_at(plane, self.src_unit, i + first)?,
                                dst: dp.block_addr(block_ids[i as usize]),
                                len: (blocks as u64)
                                    .checked_mul(dp.block_bytes)
                                    .ok_or(GeometryError::StagingOverflow)?,
                            };
                            src_inside(&r)?;
                            push_merged(out, first_range, r);
                            i += blocks;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// Ranges a layer of `block_ids` takes in `layout`'s pages when a producer
/// writes them from its source staging: one per run of blocks consecutive
/// in memory (in any order of the request), summed over the planes (of the
/// first layer). Padded blocks (a stride past the block's bytes) are each a run
/// of their own.
pub fn page_runs(layout: &KvLayout, block_ids: &[u32]) -> usize {
    let Some(l) = layout.layers.first() else {
        return 0;
    };
    // A producer that stages gathers each chunk in the order of these IDs
    // ([`StagedPlan::gather_order`]): the runs of the sorted IDs.
    let mut sorted = block_ids.to_vec();
    sorted.sort_unstable();
    let runs = id_runs(&sorted).len();
    l.planes
        .iter()
        .map(|p| {
            if p.block_stride == p.block_bytes {
                runs
            } else {
                block_ids.len()
            }
        })
        .sum()
}

/// The runs of consecutive IDs in `block_ids`: (first index, length).
fn id_runs(block_ids: &[u32]) -> Vec<(u32, u32)> {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for (i, &b) in block_ids.iter().enumerate() {
        match runs.last_mut() {
            Some((s, n)) if block_ids[(*s + *n - 1) as usize].checked_add(1) == Some(b) => *n += 1,
            _ => runs.push((i as u32, 1)),
        }
    }
    runs
}

#[cfg(test)]
mod tests;
