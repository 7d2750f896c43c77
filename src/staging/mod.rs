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
use crate::layout::{push_merged, KvLayout, WriteRange};
use crate::wire::Handshake;

/// A consumer's staging grant for one request: `len` bytes at the consumer's
/// virtual address `base`, inside its registered staging region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StagingGrant {
    pub base: u64,
    pub len: u64,
}

/// A producer's source staging for one request: the staged copy of request
/// blocks `0..capacity` at local address `base` (the worker gathers into it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SourceStaging {
    pub base: u64,
    pub capacity: u32,
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

/// A consumer's grant, shared with the arena it came from (the consumer
/// actor returns it when released).
pub type SharedArena = std::sync::Arc<parking_lot::Mutex<arena::StagingArena>>;

/// Units per block of `layout`: its KV heads when head-major, else 1.
pub fn units(layout: &KvLayout) -> u32 {
    if layout.head_major {
        layout.local_heads().max(1)
    } else {
        1
    }
}

/// A rank's staged order for `capacity` blocks: where each (layer, plane)
/// starts and the bytes of one unit there. Built once per request (a
/// producer's per authorization), so no layer write walks the layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagedOrder {
    pub capacity: u32,
    /// `slots[layer][plane]`: (offset, unit bytes).
    pub slots: Vec<Vec<(u64, u64)>>,
    /// Bytes of the whole staged copy.
    pub bytes: u64,
}

impl StagedOrder {
    /// `None` on overflow.
    pub fn new(layout: &KvLayout, capacity: u32) -> Option<Self> {
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
            slots,
            bytes: off,
        })
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

/// How one producer writes into one consumer's staging grant, fixed for an
/// authorization: built when the handshake is known, then used for every
/// layer write under it ([`StagedPlan::plan_layer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagedPlan {
    src: SourceStaging,
    src_order: StagedOrder,
    grant: StagingGrant,
    dst_order: StagedOrder,
    first_block: u32,
    /// The sent units: the first in the producer's and in the consumer's
    /// order, and how many (0: this producer holds none of the consumer's heads).
    src_unit: u32,
    dst_unit: u32,
    count: u32,
}

impl StagedPlan {
    /// The plan for writing from `src` into `auth`'s grant; `Ok(None)` when
    /// `auth` has no grant or the two layouts stage in different orders
    /// (the producer then writes pages directly).
    pub fn new(
        local: &KvLayout,
        src: SourceStaging,
        auth: &Handshake,
    ) -> Result<Option<Self>, GeometryError> {
        let consumer = &auth.layout;
        let Some(grant) = auth.staging else {
            return Ok(None);
        };
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
        let src_order = StagedOrder::new(local, src.capacity).ok_or(overflow.clone())?;
        let dst_order = StagedOrder::new(consumer, auth.block_ids.len() as u32).ok_or(overflow.clone())?;
        src.base.checked_add(src_order.bytes).ok_or(overflow.clone())?;
        grant.base.checked_add(grant.len).ok_or(overflow)?;
        Ok(Some(Self {
            src,
            src_order,
            grant,
            dst_order,
            first_block: auth.first_block,
            src_unit,
            dst_unit,
            count,
        }))
    }

    /// The staged counterpart of [`crate::layout::plan_write`]: the ranges
    /// that write request blocks `blocks` of `layer` from the source staging
    /// into the grant. Request blocks before the handshake's `first_block`
    /// are skipped. One range per (plane, sent unit), merged where
    /// consecutive: a whole request in one chunk is one range per plane.
    /// Every destination lies inside the grant and every source inside the
    /// source staging: anything else is an error, never a range.
    pub fn plan_layer(
        &self,
        layer: u32,
        blocks: Range<u32>,
        out: &mut Vec<WriteRange>,
    ) -> Result<(), GeometryError> {
        out.clear();
        let (Some(sl), Some(dl)) = (
            self.src_order.slots.get(layer as usize),
            self.dst_order.slots.get(layer as usize),
        ) else {
            return Err(GeometryError::LayerOutOfRange {
                layer,
                num_layers: self.src_order.slots.len(),
            });
        };
        let (first, n, cap) = (self.first_block, self.dst_order.capacity, self.src.capacity);
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
        if hi > cap {
            return Err(GeometryError::OutsideSource {
                index: hi - 1,
                available: cap as usize,
            });
        }
        let inside = |at: u64, len: u64, base: u64, size: u64| {
            at >= base && at.checked_add(len).is_some_and(|end| end <= base + size)
        };
        for (&(soff, unit), &(doff, dunit)) in sl.iter().zip(dl) {
            debug_assert_eq!(unit, dunit);
            let first_range = out.len();
            for k in 0..self.count as u64 {
                let at = |base: u64, off: u64, u: u64, cap: u64, i: u64| -> Option<u64> {
                    base.checked_add(off)?
                        .checked_add(u.checked_mul(cap)?.checked_add(i)?.checked_mul(unit)?)
                };
                let r = (|| {
                    Some(WriteRange {
                        src: at(
                            self.src.base,
                            soff,
                            self.src_unit as u64 + k,
                            cap as u64,
                            lo as u64,
                        )?,
                        dst: at(
                            self.grant.base,
                            doff,
                            self.dst_unit as u64 + k,
                            n as u64,
                            (lo - first) as u64,
                        )?,
                        len: ((hi - lo) as u64).checked_mul(unit)?,
                    })
                })()
                .ok_or(GeometryError::StagingOverflow)?;
                if !inside(r.dst, r.len, self.grant.base, self.grant.len) {
                    return Err(GeometryError::OutsideStagingGrant {
                        dst: r.dst,
                        len: r.len,
                        base: self.grant.base,
                        grant: self.grant.len,
                    });
                }
                if !inside(r.src, r.len, self.src.base, self.src_order.bytes) {
                    return Err(GeometryError::OutsideSource {
                        index: hi - 1,
                        available: cap as usize,
                    });
                }
                push_merged(out, first_range, r);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
