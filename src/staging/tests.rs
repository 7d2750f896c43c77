//! The staged plan checked against the direct one: gathering a producer's
//! blocks, writing the staged plan and scattering the grant must leave the
//! consumer's pages exactly as the direct plan does, for every TP pairing,
//! prefix hit and chunking; nothing may land outside the grant.

#![allow(clippy::single_range_in_vec_init)] // one chunk of request blocks is a list of one range

use super::*;
use crate::layout::{plan_write, KvLayout, Plane};
use crate::wire::{Handshake, WIRE_VERSION};

/// A head-major layout of `layers` layers with two planes (K, V) of `blocks`
/// blocks of `heads` local heads of `hb` bytes each, based at `base`.
fn kv(
    base: u64,
    layers: u32,
    blocks: u32,
    hb: u64,
    tp: (u32, u32),
    total: u32,
    head_major: bool,
) -> KvLayout {
    let heads = crate::layout::rank_heads_range(total, tp.1, tp.0).len() as u64;
    let bb = heads * hb;
    let mut l = KvLayout::packed(base, layers, blocks, bb, tp, total);
    l.head_major = head_major;
    // two planes per layer, K's blocks then V's
    let mut at = base;
    for layer in &mut l.layers {
        layer.planes = (0..2)
            .map(|_| {
                let p = Plane {
                    base: at,
                    block_stride: bb,
                    block_bytes: bb,
                };
                at += bb * blocks as u64;
                p
            })
            .collect();
    }
    l.validate().unwrap();
    l
}

fn handshake(consumer: &KvLayout, first: u32, ids: Vec<u32>, grant: Option<StagingGrant>) -> Handshake {
    Handshake {
        tokens: 0,
        version: WIRE_VERSION,
        request_id: crate::ids::RequestId::new("r"),
        capability: crate::ids::Capability::parse(&"7".repeat(32)).unwrap(),
        generation: crate::ids::Generation(1),
        sequence: crate::ids::Sequence(1),
        notice_key: crate::ids::NoticeKey::random(),
        endpoint: "127.0.0.1:1".into(),
        expected_producers: 1,
        first_block: first,
        block_ids: ids,
        layout: consumer.clone(),
        expires_unix_ms: 0,
        staging: grant,
    }
}

/// Memory of one simulated host: a byte per address from `base`.
struct Mem {
    base: u64,
    bytes: Vec<u8>,
}

impl Mem {
    fn new(base: u64, len: usize, seed: u8) -> Self {
        Self {
            base,
            bytes: (0..len)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                .collect(),
        }
    }
    fn at(&mut self, addr: u64, len: u64) -> &mut [u8] {
        let o = (addr - self.base) as usize;
        &mut self.bytes[o..o + len as usize]
    }
}

/// The worker's gather (what `orbitkv.staging` does with torch): unit `u`
/// of request block `i` of each (layer, plane) into the staged order
/// grouped by `group` units.
#[allow(clippy::too_many_arguments)] // the memory and the order, spelled out
fn gather(
    local: &KvLayout,
    src_blocks: &[u32],
    kv: &mut Mem,
    stage: &mut Mem,
    at: u64,
    cap: u32,
    group: u32,
    range: Range<u32>,
) {
    let order: Vec<u32> = range.clone().collect();
    gather_ordered(local, src_blocks, kv, stage, at, cap, group, range, &order);
}

/// [`gather`] of a chunk gathered out of request order: slot
/// `range.start + k` holds request block `order[k]`.
#[allow(clippy::too_many_arguments)] // the memory and the order, spelled out
fn gather_ordered(
    local: &KvLayout,
    src_blocks: &[u32],
    kv: &mut Mem,
    stage: &mut Mem,
    at: u64,
    cap: u32,
    group: u32,
    range: Range<u32>,
    order: &[u32],
) {
    let staged = StagedOrder::grouped(local, cap, group).unwrap();
    for (li, l) in local.layers.iter().enumerate() {
        for (pi, p) in l.planes.iter().enumerate() {
            let ub = staged.slots[li][pi].1;
            for unit in 0..units(local) {
                for (k, &i) in order.iter().enumerate() {
                    let from = p.block_addr(src_blocks[i as usize]) + unit as u64 * ub;
                    let data = kv.at(from, ub).to_vec();
                    let to = at + staged.offset(li, pi, unit, range.start + k as u32).unwrap();
                    stage.at(to, ub).copy_from_slice(&data);
                }
            }
        }
    }
}

/// The worker's scatter on decode: `units` of each authorized block back
/// from the grant (in its staged order) into the pages.
fn scatter(consumer: &KvLayout, h: &Handshake, units_sent: Range<u32>, stage: &mut Mem, kv: &mut Mem) {
    let g = h.staging.unwrap();
    let n = h.block_ids.len() as u32;
    let order = StagedOrder::grouped(consumer, n, g.group).unwrap();
    for (li, l) in consumer.layers.iter().enumerate() {
        for (pi, p) in l.planes.iter().enumerate() {
            let ub = order.slots[li][pi].1;
            for unit in units_sent.clone() {
                for (i, &b) in h.block_ids.iter().enumerate() {
                    let from = g.base + order.offset(li, pi, unit, i as u32).unwrap();
                    let data = stage.at(from, ub).to_vec();
                    kv.at(p.block_addr(b) + unit as u64 * ub, ub)
                        .copy_from_slice(&data);
                }
            }
        }
    }
}

/// `staging_min_ranges`' default.
const MIN_RANGES: usize = 16;

/// The producer's plan under `h`, for one layer write, into the grant
/// whenever one is usable (no minimum of page ranges).
fn plan(
    local: &KvLayout,
    src: SourceStaging,
    h: &Handshake,
    layer: u32,
    blocks: Range<u32>,
    out: &mut Vec<WriteRange>,
) -> Result<(), GeometryError> {
    let plan = plan_for(local, src, h, 0)?.expect("both sides stage");
    assert!(plan.into_grant(), "{plan:?} writes pages");
    plan.plan_layer(layer, blocks, None, out)
}

fn apply(ranges: &[WriteRange], src: &mut Mem, dst: &mut Mem) {
    for r in ranges {
        let data = src.at(r.src, r.len).to_vec();
        dst.at(r.dst, r.len).copy_from_slice(&data);
    }
}

/// The memory sizes of `producer` and `consumer` (K and V planes of
/// `num_blocks` blocks at 0x10_0000 and 0x80_0000), and the consumer's
/// pages as the direct plan of `chunks` leaves them.
fn direct_pages(
    producer: &KvLayout,
    consumer: &KvLayout,
    src_blocks: &[u32],
    first: u32,
    ids: &[u32],
    chunks: &[Range<u32>],
) -> (u64, u64, Mem) {
    let (layers, blocks) = (producer.layers.len() as u64, producer.num_blocks as u64);
    let pbytes = 2 * layers * blocks * producer.layers[0].planes[0].block_bytes;
    let cbytes = 2 * layers * blocks * consumer.layers[0].planes[0].block_bytes;
    let mut psrc = Mem::new(0x10_0000, pbytes as usize, 1);
    let mut direct = Mem::new(0x80_0000, cbytes as usize, 99);
    let h_direct = handshake(consumer, first, ids.to_vec(), None);
    let mut out = Vec::new();
    for c in chunks {
        for l in 0..layers as u32 {
            plan_write(producer, src_blocks, h_direct.target(), l, c.clone(), &mut out).unwrap();
            apply(&out, &mut psrc, &mut direct);
        }
    }
    (pbytes, cbytes, direct)
}

/// A producer's source staging of `cap` blocks at `sat` and a consumer's
/// grant for `n` blocks at `gat`, inside a region with 256 guard bytes on
/// either side whose bytes must stay as they were.
struct Stages {
    sat: u64,
    gat: u64,
    sbytes: u64,
    gbytes: u64,
    pstage: Mem,
    cstage: Mem,
}

impl Stages {
    fn new(producer: &KvLayout, consumer: &KvLayout, cap: u32, n: u32) -> Self {
        let sbytes = staged_bytes(producer, cap).unwrap();
        let gbytes = staged_bytes(consumer, n).unwrap();
        let (sat, gat) = (0x400_0000u64, 0x800_0000u64 + 256);
        Self {
            sat,
            gat,
            sbytes,
            gbytes,
            pstage: Mem::new(sat, sbytes as usize, 3),
            cstage: Mem::new(gat - 256, gbytes as usize + 512, 5),
        }
    }
}

/// A producer of TP rank `p` and a consumer of TP rank `c` (3 layers of
/// `blocks` blocks, 8-byte heads) of a model of `total` KV heads, at the
/// bases [`direct_pages`] and [`Stages`] expect.
fn pair(total: u32, p: (u32, u32), c: (u32, u32), blocks: u32, head_major: bool) -> (KvLayout, KvLayout) {
    (
        kv(0x10_0000, 3, blocks, 8, p, total, head_major),
        kv(0x80_0000, 3, blocks, 8, c, total, head_major),
    )
}

/// One case: producer of TP `ptp` rank `pr`, consumer of TP `ctp` rank
/// `cr`, `total` heads, the request's blocks computed in `chunks`.
fn check(
    total: u32,
    (pr, ptp): (u32, u32),
    (cr, ctp): (u32, u32),
    first: u32,
    chunks: &[Range<u32>],
    head_major: bool,
) {
    let blocks = 16;
    let (producer, consumer) = pair(total, (pr, ptp), (cr, ctp), blocks, head_major);
    let req: u32 = chunks.last().unwrap().end;
    let src_blocks: Vec<u32> = (0..req).map(|i| (i * 7 + 3) % blocks).collect();
    let ids: Vec<u32> = (0..req - first).map(|i| (i * 5 + 1) % blocks).collect();
    let (pbytes, cbytes, direct) = direct_pages(&producer, &consumer, &src_blocks, first, &ids, chunks);
    let mut out = Vec::new();
    // staged
    let cap = req + 2; // capacity may exceed what is computed
    let Stages {
        sat,
        gat,
        sbytes,
        gbytes,
        mut pstage,
        mut cstage,
    } = Stages::new(&producer, &consumer, cap, ids.len() as u32);
    let guard: Vec<u8> = cstage.bytes.clone();
    let grant = StagingGrant {
        base: gat,
        len: gbytes,
        group: 1,
    };
    let h = handshake(&consumer, first, ids.clone(), Some(grant));
    h.validate().unwrap();
    assert!(staging_compatible(&producer, &consumer));
    let mut staged_pages = Mem::new(0x80_0000, cbytes as usize, 99);
    let mut kvsrc = Mem::new(0x10_0000, pbytes as usize, 1);
    let src = SourceStaging {
        base: sat,
        capacity: cap,
        group: 1,
    };
    let mut max_ranges = 0;
    for c in chunks {
        gather(
            &producer,
            &src_blocks,
            &mut kvsrc,
            &mut pstage,
            sat,
            cap,
            1,
            c.clone(),
        );
        for l in 0..producer.layers.len() as u32 {
            plan(&producer, src, &h, l, c.clone(), &mut out).unwrap();
            for r in &out {
                assert!(
                    r.dst >= gat && r.dst + r.len <= gat + gbytes,
                    "{r:?} outside the grant"
                );
                assert!(
                    r.src >= sat && r.src + r.len <= sat + sbytes,
                    "{r:?} outside the source staging"
                );
            }
            max_ranges = max_ranges.max(out.len());
            apply(&out, &mut pstage, &mut cstage);
        }
    }
    let sent = staged_units(&consumer, ptp, pr);
    scatter(&consumer, &h, sent.clone(), &mut cstage, &mut staged_pages);
    let untouched = Mem::new(0x80_0000, cbytes as usize, 99).bytes;
    let changed = direct
        .bytes
        .iter()
        .zip(&untouched)
        .filter(|(a, b)| a != b)
        .count();
    assert!(changed > 0, "the direct plan wrote nothing");
    assert_eq!(
        staged_pages.bytes, direct.bytes,
        "staged != direct: tp {ptp}->{ctp}, first {first}, {chunks:?}"
    );
    assert_eq!(
        &cstage.bytes[..256],
        &guard[..256],
        "bytes before the grant changed"
    );
    assert_eq!(
        &cstage.bytes[256 + gbytes as usize..],
        &guard[256 + gbytes as usize..],
        "bytes after the grant changed"
    );
    // at most one range per (plane, sent unit) per chunk
    let per_unit = if head_major { sent.len() } else { 1 };
    assert!(max_ranges <= 2 * per_unit.max(1), "{max_ranges} ranges");
}

#[test]
fn staged_equals_direct_same_tp() {
    check(4, (0, 1), (0, 1), 0, &[0..10], true);
    check(4, (0, 1), (0, 1), 0, &[0..4, 4..7, 7..10], true);
    check(4, (0, 1), (0, 1), 3, &[0..4, 4..10], true);
    check(4, (1, 2), (1, 2), 0, &[0..6, 6..9], true);
    check(1, (0, 1), (0, 1), 2, &[0..5, 5..9], false);
}

#[test]
fn staged_equals_direct_across_tp() {
    for pr in 0..2 {
        check(4, (pr, 2), (0, 1), 0, &[0..10], true);
        check(4, (pr, 2), (0, 1), 1, &[0..3, 3..10], true);
    }
    for cr in 0..2 {
        check(4, (0, 1), (cr, 2), 0, &[0..10], true);
        check(4, (0, 1), (cr, 2), 2, &[0..8, 8..11], true);
    }
    // fewer heads than ranks: each consumer rank holds one replicated head
    check(2, (0, 1), (3, 4), 0, &[0..6], true);
    check(2, (1, 2), (2, 4), 1, &[0..6], true);
}

#[test]
fn one_chunk_of_a_whole_request_is_one_range_per_plane() {
    let p = kv(0x10_0000, 2, 32, 64, (0, 1), 8, true);
    let c = kv(0x80_0000, 2, 32, 64, (0, 1), 8, true);
    let ids: Vec<u32> = (0..20).rev().collect();
    let gbytes = staged_bytes(&c, 20).unwrap();
    let grant = StagingGrant {
        base: 0x900_0000,
        len: gbytes,
        group: 1,
    };
    let h = handshake(&c, 0, ids, Some(grant));
    let mut out = Vec::new();
    let src = SourceStaging {
        base: 0x500_0000,
        capacity: 20,
        group: 1,
    };
    plan(&p, src, &h, 1, 0..20, &mut out).unwrap();
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(out.iter().map(|r| r.len).sum::<u64>(), 2 * 20 * 8 * 64);
    // the same blocks direct: one range per block and plane
    plan_write(&p, &(0..20).collect::<Vec<_>>(), h.target(), 1, 0..20, &mut out).unwrap();
    assert_eq!(out.len(), 40);
}

#[test]
fn writes_outside_the_grant_or_the_source_are_errors() {
    let p = kv(0x10_0000, 2, 32, 64, (0, 1), 2, true);
    let c = kv(0x80_0000, 2, 32, 64, (0, 1), 2, true);
    let gbytes = staged_bytes(&c, 4).unwrap();
    let grant = StagingGrant {
        base: 0x900_0000,
        len: gbytes,
        group: 1,
    };
    let h = handshake(&c, 0, vec![1, 2, 3, 4], Some(grant));
    let mut out = Vec::new();
    let src = SourceStaging {
        base: 0x500_0000,
        capacity: 8,
        group: 1,
    };
    // beyond the authorized blocks
    assert!(matches!(
        plan(&p, src, &h, 0, 0..5, &mut out),
        Err(GeometryError::OutsideAuthorization { .. })
    ));
    // beyond the source staging's capacity
    let small = SourceStaging {
        base: 0x500_0000,
        capacity: 3,
        group: 1,
    };
    assert!(matches!(
        plan(&p, small, &h, 0, 0..4, &mut out),
        Err(GeometryError::OutsideSource { .. })
    ));
    // a grant too small for its blocks is refused by the handshake check...
    let short = StagingGrant {
        base: 0x900_0000,
        len: gbytes - 1,
        group: 1,
    };
    let bad = handshake(&c, 0, vec![1, 2, 3, 4], Some(short));
    assert!(bad.validate().is_err());
    // ...and, were it used anyway, no range leaves it
    assert!(matches!(
        plan(&p, src, &bad, 1, 0..4, &mut out),
        Err(GeometryError::OutsideStagingGrant { .. })
    ));
    // an unknown layer
    assert!(matches!(
        plan(&p, src, &h, 9, 0..4, &mut out),
        Err(GeometryError::LayerOutOfRange { .. })
    ));
    assert!(out.is_empty());
}

#[test]
fn layouts_that_stage_in_different_orders_do_not_stage() {
    let p = kv(0x10_0000, 1, 8, 64, (0, 1), 2, true);
    let c = kv(0x80_0000, 1, 8, 64, (0, 1), 2, false);
    assert!(!staging_compatible(&p, &c));
    assert!(staging_compatible(&p, &p));
    assert!(staging_compatible(&c, &c));
    // such a producer plans no staged write: it writes the pages
    let n = 4;
    let grant = StagingGrant {
        base: 0x900_0000,
        len: staged_bytes(&c, n).unwrap(),
        group: 1,
    };
    let src = SourceStaging {
        base: 0x500_0000,
        capacity: n,
        group: 1,
    };
    let h = handshake(&c, 0, (0..n).collect(), Some(grant));
    assert_eq!(plan_for(&p, src, &h, MIN_RANGES), Ok(None));
    // nor does one whose consumer gave no grant
    let h = handshake(&p, 0, (0..n).collect(), None);
    assert_eq!(plan_for(&p, src, &h, MIN_RANGES), Ok(None));
}

#[test]
fn staged_units_name_the_heads_each_producer_sends() {
    let c = kv(0x80_0000, 1, 8, 64, (0, 1), 4, true);
    assert_eq!(staged_units(&c, 2, 0), 0..2);
    assert_eq!(staged_units(&c, 2, 1), 2..4);
    let c1 = kv(0x80_0000, 1, 8, 64, (1, 2), 4, true);
    assert_eq!(staged_units(&c1, 1, 0), 0..2);
    assert_eq!(staged_units(&c1, 4, 1), 0..0);
    assert_eq!(staged_units(&c1, 4, 2), 0..1);
}

/// A producer of TP `ptp` sending to a consumer of the larger TP `ctp`
/// stages grouped by the consumer's heads: from it the layer goes straight
/// into the consumer's pages when its blocks are consecutive (no grant
/// used, no scatter), else into a grant in the same order, scattered as
/// whole blocks. Either way the pages end as the direct plan leaves them.
fn check_grouped(
    total: u32,
    (pr, ptp): (u32, u32),
    (cr, ctp): (u32, u32),
    first: u32,
    chunks: &[Range<u32>],
    consecutive: bool,
) {
    let blocks = 24;
    let (producer, consumer) = pair(total, (pr, ptp), (cr, ctp), blocks, true);
    let group = source_group(&producer, ctp);
    assert_eq!(group, units(&consumer), "the consumer's heads are one group");
    assert!(group > 1 || units(&consumer) == 1);
    assert_eq!(grant_group(&consumer, ptp), group);
    let req: u32 = chunks.last().unwrap().end;
    let src_blocks: Vec<u32> = (0..req).map(|i| (i * 7 + 3) % blocks).collect();
    let ids: Vec<u32> = if consecutive {
        (0..req - first).map(|i| i + 2).collect()
    } else {
        // no two consecutive, in any order (a staging producer sorts them)
        (0..req - first).map(|i| (i * 2 + 1) % blocks).rev().collect()
    };
    let (pbytes, cbytes, direct) = direct_pages(&producer, &consumer, &src_blocks, first, &ids, chunks);
    let mut out = Vec::new();
    let cap = req + 1;
    let Stages {
        sat,
        gat,
        sbytes,
        gbytes,
        mut pstage,
        mut cstage,
    } = Stages::new(&producer, &consumer, cap, ids.len() as u32);
    let untouched_stage = cstage.bytes.clone();
    let grant = StagingGrant {
        base: gat,
        len: gbytes,
        group,
    };
    let h = handshake(&consumer, first, ids.clone(), Some(grant));
    h.validate().unwrap();
    let src = SourceStaging {
        base: sat,
        capacity: cap,
        group,
    };
    let plan = plan_for(&producer, src, &h, MIN_RANGES).unwrap().expect("stages");
    assert_eq!(plan.into_grant(), !consecutive, "{plan:?}");
    let mut pages = Mem::new(0x80_0000, cbytes as usize, 99);
    let mut kvsrc = Mem::new(0x10_0000, pbytes as usize, 1);
    for c in chunks {
        gather(
            &producer,
            &src_blocks,
            &mut kvsrc,
            &mut pstage,
            sat,
            cap,
            group,
            c.clone(),
        );
        for l in 0..producer.layers.len() as u32 {
            plan.plan_layer(l, c.clone(), None, &mut out).unwrap();
            // one range per plane and chunk (the consecutive blocks are one
            // run of pages, the grant one run of whole blocks)
            assert!(out.len() <= 2, "{} ranges: {out:?}", out.len());
            for r in &out {
                assert!(
                    r.src >= sat && r.src + r.len <= sat + sbytes,
                    "{r:?} outside the source"
                );
            }
            if consecutive {
                apply(&out, &mut pstage, &mut pages);
            } else {
                for r in &out {
                    assert!(
                        r.dst >= gat && r.dst + r.len <= gat + gbytes,
                        "{r:?} outside the grant"
                    );
                }
                apply(&out, &mut pstage, &mut cstage);
            }
        }
    }
    if consecutive {
        assert_eq!(
            cstage.bytes, untouched_stage,
            "a write into pages touched the grant"
        );
    } else {
        scatter(
            &consumer,
            &h,
            staged_units(&consumer, ptp, pr),
            &mut cstage,
            &mut pages,
        );
        assert_eq!(
            &cstage.bytes[..256],
            &untouched_stage[..256],
            "bytes before the grant changed"
        );
        let end = 256 + gbytes as usize;
        assert_eq!(
            &cstage.bytes[end..],
            &untouched_stage[end..],
            "bytes after the grant changed"
        );
    }
    assert_ne!(
        direct.bytes,
        Mem::new(0x80_0000, cbytes as usize, 99).bytes,
        "the direct plan wrote nothing"
    );
    assert_eq!(
        pages.bytes, direct.bytes,
        "grouped staging != direct: tp {ptp}->{ctp} rank {pr}->{cr}, first {first}, {chunks:?}, consecutive {consecutive}"
    );
}

#[test]
fn grouped_staging_writes_pages_or_a_whole_block_grant_like_direct() {
    for consecutive in [true, false] {
        for cr in 0..2 {
            check_grouped(8, (0, 1), (cr, 2), 0, &[0..12], consecutive);
            check_grouped(8, (0, 1), (cr, 2), 2, &[0..5, 5..9, 9..12], consecutive);
        }
        for cr in 0..4 {
            check_grouped(8, (0, 1), (cr, 4), 1, &[0..7, 7..12], consecutive);
        }
        // TP 2 -> 4: each producer rank's heads are two consumer ranks' groups
        check_grouped(8, (1, 2), (3, 4), 0, &[0..12], consecutive);
        check_grouped(8, (0, 2), (1, 4), 0, &[0..6, 6..12], consecutive);
    }
}

#[test]
fn groups_are_chosen_only_where_a_consumer_block_is_one_group() {
    let l = |tp: (u32, u32), total, hm| kv(0x10_0000, 1, 8, 8, tp, total, hm);
    // larger consumer TP, heads dividing: the consumer rank's heads
    assert_eq!(source_group(&l((0, 1), 8, true), 2), 4);
    assert_eq!(source_group(&l((0, 2), 8, true), 8), 1);
    assert_eq!(source_group(&l((0, 1), 8, true), 8), 1);
    // the same TP: the whole block (the staging lies in the pages' order)
    assert_eq!(source_group(&l((0, 2), 8, true), 2), 4);
    // a smaller TP, replicated heads, token-major: unit-major
    assert_eq!(source_group(&l((0, 2), 8, true), 1), 1);
    assert_eq!(source_group(&l((0, 1), 2, true), 4), 1);
    assert_eq!(source_group(&l((0, 1), 8, false), 2), 1);
    assert_eq!(source_group(&l((0, 2), 8, true), 3), 1);
    // the consumer's side of the same pairs
    assert_eq!(grant_group(&l((1, 2), 8, true), 1), 4);
    assert_eq!(grant_group(&l((3, 4), 8, true), 2), 2);
    assert_eq!(grant_group(&l((0, 1), 8, true), 2), 1);
    assert_eq!(grant_group(&l((1, 2), 8, true), 2), 4);
    assert_eq!(grant_group(&l((3, 4), 2, true), 1), 1);
    assert_eq!(grant_group(&l((1, 2), 8, false), 1), 1);
    // an order's group must divide the block's units
    assert!(StagedOrder::grouped(&l((0, 1), 8, true), 4, 3).is_none());
    assert!(StagedOrder::grouped(&l((0, 1), 8, true), 4, 0).is_none());
    let o = StagedOrder::grouped(&l((0, 1), 8, true), 4, 4).unwrap();
    // unit 5 of block 2: group 1, fifth block of it, second unit
    assert_eq!(o.offset(0, 0, 5, 2), Some(((4 + 2) * 4 + 1) * 8));
    assert_eq!(o.offset(0, 0, 0, 4), None, "past the capacity");
    assert_eq!(o.bytes, StagedOrder::new(&l((0, 1), 8, true), 4).unwrap().bytes);
}

#[test]
fn a_grouped_source_never_writes_a_grant_of_another_order() {
    // TP 1 -> 2, source grouped by 4 heads; the consumer's grant says
    // unit-major (an older consumer, or a stranger's handshake)
    let p = kv(0x10_0000, 2, 32, 8, (0, 1), 8, true);
    let c = kv(0x80_0000, 2, 32, 8, (1, 2), 8, true);
    let n = 12;
    let grant = StagingGrant {
        base: 0x900_0000,
        len: staged_bytes(&c, n).unwrap(),
        group: 1,
    };
    let src = SourceStaging {
        base: 0x500_0000,
        capacity: n,
        group: 4,
    };
    let scattered: Vec<u32> = (0..n).map(|i| 2 * i).collect();
    let h = handshake(&c, 0, scattered.clone(), Some(grant));
    h.validate().unwrap();
    // its pages then, one range per block and plane (never the grant)
    let plan = plan_for(&p, src, &h, MIN_RANGES).unwrap().unwrap();
    assert!(!plan.into_grant());
    let mut out = Vec::new();
    plan.plan_layer(1, 0..n, None, &mut out).unwrap();
    assert_eq!(out.len(), 2 * n as usize);
    for (r, &b) in out.iter().zip(scattered.iter().chain(&scattered)) {
        let plane = if r.dst >= c.layers[1].planes[1].base { 1 } else { 0 };
        assert_eq!(r.dst, c.layers[1].planes[plane].block_addr(b));
        assert_eq!(r.len, 4 * 8);
    }
    // a source not grouped by the consumer's heads cannot write its pages
    let unit_major = SourceStaging { group: 1, ..src };
    assert_eq!(
        plan_for(&p, unit_major, &handshake(&c, 0, scattered, None), MIN_RANGES),
        Ok(None)
    );
    // and a grouped source planned past its authorization or capacity is refused
    let h = handshake(&c, 0, (0..n).collect(), None);
    let plan = plan_for(&p, src, &h, MIN_RANGES).unwrap().unwrap();
    assert!(matches!(
        plan.plan_layer(0, 0..n + 1, None, &mut out),
        Err(GeometryError::OutsideAuthorization { .. })
    ));
    let small = plan_for(&p, SourceStaging { capacity: 3, ..src }, &h, MIN_RANGES)
        .unwrap()
        .unwrap();
    assert!(matches!(
        small.plan_layer(0, 0..4, None, &mut out),
        Err(GeometryError::OutsideSource { .. })
    ));
}

#[test]
fn page_runs_count_blocks_consecutive_in_memory() {
    // K and V planes apart: consecutive IDs are one run per plane
    let apart = kv(0x10_0000, 1, 16, 8, (0, 1), 2, true);
    assert_eq!(page_runs(&apart, &[3, 4, 5, 6]), 2);
    // in any order: a staging producer sorts a chunk by decode's IDs
    assert_eq!(page_runs(&apart, &[3, 4, 9, 10, 2]), 4);
    assert_eq!(page_runs(&apart, &[6, 5, 4, 3]), 2);
    // padded blocks (a stride past the block's bytes): each block is a run
    // of its own, whatever its ID
    let mut padded = apart.clone();
    let bb = padded.layers[0].planes[0].block_bytes;
    padded.layers[0].planes = (0..2)
        .map(|p| Plane {
            base: 0x10_0000 + p * (bb + 64) * 16,
            block_stride: bb + 64,
            block_bytes: bb,
        })
        .collect();
    padded.validate().unwrap();
    assert_eq!(page_runs(&padded, &[3, 4, 5, 6]), 8);
}

#[test]
fn pages_from_a_grouped_source_follow_the_planes_and_the_block_size() {
    // TP 1 -> rank 1 of TP 2, source grouped by the rank's 4 heads, no grant
    let p = kv(0x10_0000, 2, 32, 8, (0, 1), 8, true);
    let mut c = kv(0x80_0000, 2, 32, 8, (1, 2), 8, true);
    let src = SourceStaging {
        base: 0x500_0000,
        capacity: 12,
        group: 4,
    };
    let ids: Vec<u32> = (4..12).collect();
    // padded blocks (a stride past the block's bytes): consecutive IDs are
    // not consecutive pages, so one range per block and plane, each at its block
    let bb = c.layers[0].planes[0].block_bytes;
    let stride = bb + 64;
    for (li, l) in c.layers.iter_mut().enumerate() {
        l.planes = (0..2u64)
            .map(|k| Plane {
                base: 0x80_0000 + (li as u64 * 2 + k) * stride * 32,
                block_stride: stride,
                block_bytes: bb,
            })
            .collect();
    }
    c.validate().unwrap();
    let h = handshake(&c, 2, ids.clone(), None);
    h.validate().unwrap();
    let plan = plan_for(&p, src, &h, MIN_RANGES).unwrap().expect("pages");
    assert!(!plan.into_grant());
    let mut out = Vec::new();
    plan.plan_layer(1, 0..10, None, &mut out).unwrap();
    assert_eq!(out.len(), 2 * ids.len());
    for (k, plane) in c.layers[1].planes.iter().enumerate() {
        for (j, &b) in ids.iter().enumerate() {
            let r = out[k * ids.len() + j];
            assert_eq!((r.dst, r.len), (plane.block_addr(b), bb));
        }
    }
    // a consumer whose blocks are not the sent group's size gets no page
    // writes from this staging (it would read across groups)
    let mut odd = kv(0x80_0000, 2, 32, 8, (1, 2), 8, true);
    for l in &mut odd.layers {
        for pl in &mut l.planes {
            pl.block_bytes -= 8;
        }
    }
    let h = handshake(&odd, 0, ids, None);
    assert_eq!(plan_for(&p, src, &h, MIN_RANGES), Ok(None));
}

/// `StagedPlan::new` under the authorization `h` (its target and grant).
fn plan_for(
    local: &KvLayout,
    src: SourceStaging,
    h: &Handshake,
    min_ranges: usize,
) -> Result<Option<StagedPlan>, GeometryError> {
    StagedPlan::new(local, src, h.target(), h.staging, min_ranges)
}

/// Equal TP, from a source staging gathered in decode's block order
/// ([`StagedPlan::gather_order`]) into decode's pages: the pages end exactly
/// as the direct plan leaves them (so nothing outside the authorized
/// blocks changes), and a layer of a chunk takes one range per plane and
/// run of consecutive decode IDs in slot order, at most the sorted runs and
/// two per pinned block more (itself, and the run it split). Chunks are as vLLM's chunked prefill makes
/// them: a chunk that ended inside a block shares it with the next one
/// (`chunks` may overlap by one block, even the first two when the first
/// was shorter than a block), the worker pins every chunk's first block but
/// the first chunk's and its last but the last chunk's, and each
/// chunk's layer writes run only after the next chunk was gathered (a write
/// that is late while the forward goes on).
fn check_sorted(head_major: bool, src_blocks: &[u32], ids: &[u32], first: u32, chunks: &[Range<u32>]) {
    let (producer, consumer) = pair(4, (0, 1), (0, 1), 64, head_major);
    let (pbytes, cbytes, direct) = direct_pages(&producer, &consumer, src_blocks, first, ids, chunks);
    let req = chunks.last().unwrap().end;
    let group = source_group(&producer, 1);
    assert_eq!(group, units(&producer), "equal TP stages whole blocks");
    let (sat, cap) = (0x500_0000, req + 1);
    let src = SourceStaging {
        base: sat,
        capacity: cap,
        group,
    };
    let sbytes = StagedOrder::grouped(&producer, cap, group).unwrap().bytes;
    let mut pstage = Mem::new(sat, sbytes as usize, 7);
    let mut kvsrc = Mem::new(0x10_0000, pbytes as usize, 1);
    let mut pages = Mem::new(0x80_0000, cbytes as usize, 99);
    let h = handshake(&consumer, first, ids.to_vec(), None);
    h.validate().unwrap();
    let plan = plan_for(&producer, src, &h, MIN_RANGES)
        .unwrap()
        .expect("pages from staging");
    assert!(!plan.into_grant());
    let mut out = Vec::new();
    let mut late: Option<(Range<u32>, Option<Vec<u32>>, usize)> = None;
    let mut write =
        |c: &Range<u32>, order: &Option<Vec<u32>>, pins: usize, pstage: &mut Mem, pages: &mut Mem| {
            let slots: Vec<u32> = order.clone().unwrap_or_else(|| c.clone().collect());
            // decode's IDs of the sent blocks, in slot order and sorted: runs
            let in_slots: Vec<u32> = slots
                .iter()
                .filter(|&&i| i >= first)
                .map(|&i| ids[(i - first) as usize])
                .collect();
            let runs =
                |v: &[u32]| (!v.is_empty()) as usize + v.windows(2).filter(|w| w[1] != w[0] + 1).count();
            let mut sorted = in_slots.clone();
            sorted.sort_unstable();
            // a pinned block is a run of its own and may split the run it sat in
            assert!(runs(&in_slots) <= runs(&sorted) + 2 * pins, "{c:?}: {slots:?}");
            for l in 0..producer.layers.len() as u32 {
                plan.plan_layer(l, c.clone(), order.as_deref(), &mut out).unwrap();
                assert_eq!(out.len(), 2 * runs(&in_slots), "layer {l} of {c:?}: {out:?}");
                apply(&out, pstage, pages);
            }
        };
    for (k, c) in chunks.iter().enumerate() {
        // what the worker pins: every chunk's first block but the request's
        // first chunk's, every chunk's last block but its last chunk's
        let pinned = (k > 0, k + 1 < chunks.len());
        let order = plan.gather_order(c.clone(), pinned);
        let slots: Vec<u32> = order.clone().unwrap_or_else(|| c.clone().collect());
        gather_ordered(
            &producer,
            src_blocks,
            &mut kvsrc,
            &mut pstage,
            sat,
            cap,
            group,
            c.clone(),
            &slots,
        );
        if let Some((lc, lo, lp)) = late.take() {
            write(&lc, &lo, lp, &mut pstage, &mut pages);
        }
        late = Some((c.clone(), order, pinned.0 as usize + pinned.1 as usize));
    }
    if let Some((lc, lo, lp)) = late.take() {
        write(&lc, &lo, lp, &mut pstage, &mut pages);
    }
    assert_eq!(
        pages.bytes, direct.bytes,
        "sorted staging != direct: first {first}, {chunks:?}"
    );
}

/// The worker's gather of layer `layer` of one chunk into its own piece at
/// `at` (staged by layer): slot `k` holds request block `order[k]`.
#[allow(clippy::too_many_arguments)] // the memory and the order, spelled out
fn gather_piece(
    local: &KvLayout,
    src_blocks: &[u32],
    kv: &mut Mem,
    stage: &mut Mem,
    at: u64,
    layer: usize,
    group: u32,
    order: &[u32],
) {
    let n = order.len() as u64;
    let (slots, _) = layer_slots(local, layer, n as u32).unwrap();
    let g = group as u64;
    for (pi, p) in local.layers[layer].planes.iter().enumerate() {
        let (off, ub) = slots[pi];
        for unit in 0..units(local) as u64 {
            for (k, &i) in order.iter().enumerate() {
                let from = p.block_addr(src_blocks[i as usize]) + unit * ub;
                let data = kv.at(from, ub).to_vec();
                let to = at + off + ((unit / g * n + k as u64) * g + unit % g) * ub;
                stage.at(to, ub).copy_from_slice(&data);
            }
        }
    }
}

/// [`check_sorted`] for a producer that stages by layer and chunk: each
/// layer of each chunk is gathered, sorted by decode's block IDs with
/// nothing pinned, into a piece of its own, and that piece's memory is
/// given to the next gather as soon as its write ran (written late, after
/// the next chunk's gather, as under load). The pages end exactly as the
/// direct plan leaves them, and each layer write takes exactly one range
/// per plane and run of the chunk's sorted decode IDs.
fn check_by_layer(head_major: bool, src_blocks: &[u32], ids: &[u32], first: u32, chunks: &[Range<u32>]) {
    let (producer, consumer) = pair(4, (0, 1), (0, 1), 64, head_major);
    let (pbytes, cbytes, direct) = direct_pages(&producer, &consumer, src_blocks, first, ids, chunks);
    let group = source_group(&producer, 1);
    let h = handshake(&consumer, first, ids.to_vec(), None);
    h.validate().unwrap();
    let plan = StagedPlan::by_layer(&producer, group, h.target(), MIN_RANGES)
        .unwrap()
        .expect("pages from staging");
    assert!(!plan.into_grant());
    // two piece-sized places, used in turn: a piece is reused once written
    let (_, piece_max) = layer_slots(&producer, 0, 64).unwrap();
    let bases = [0x500_0000u64, 0x500_0000 + piece_max];
    let mut pstage = Mem::new(bases[0], 2 * piece_max as usize, 7);
    let mut kvsrc = Mem::new(0x10_0000, pbytes as usize, 1);
    let mut pages = Mem::new(0x80_0000, cbytes as usize, 99);
    let mut out = Vec::new();
    let runs = |v: &[u32]| (!v.is_empty()) as usize + v.windows(2).filter(|w| w[1] != w[0] + 1).count();
    let layers = producer.layers.len();
    let mut late: Option<(Range<u32>, Option<Vec<u32>>, u64)> = None;
    let mut turn = 0;
    for c in chunks {
        let order = plan.gather_order(c.clone(), (false, false));
        let slots: Vec<u32> = order.clone().unwrap_or_else(|| c.clone().collect());
        let mut sent: Vec<u32> = slots
            .iter()
            .filter(|&&i| i >= first)
            .map(|&i| ids[(i - first) as usize])
            .collect();
        let in_slots = runs(&sent);
        sent.sort_unstable();
        assert_eq!(in_slots, runs(&sent), "{c:?}: {slots:?}");
        for l in 0..layers {
            let at = bases[turn % 2];
            turn += 1;
            gather_piece(
                &producer,
                src_blocks,
                &mut kvsrc,
                &mut pstage,
                at,
                l,
                group,
                &slots,
            );
            // the write of the layer before: its piece is then free again
            if let Some((lc, lo, lat)) = late.take() {
                let li = (l + layers - 1) % layers;
                let src = LayerSource {
                    base: lat,
                    start: lc.start,
                    blocks: lc.len() as u32,
                };
                plan.plan_piece(li as u32, lc.clone(), src, lo.as_deref(), &mut out)
                    .unwrap();
                apply(&out, &mut pstage, &mut pages);
            }
            late = Some((c.clone(), order.clone(), at));
            let src = LayerSource {
                base: at,
                start: c.start,
                blocks: c.len() as u32,
            };
            plan.plan_piece(l as u32, c.clone(), src, order.as_deref(), &mut out)
                .unwrap();
            assert_eq!(out.len(), 2 * in_slots, "layer {l} of {c:?}: {out:?}");
            // a piece holds only its chunk: another chunk's blocks are refused
            if c.start > 0 && c.end > first {
                assert!(matches!(
                    plan.plan_piece(l as u32, c.start - 1..c.end, src, None, &mut out),
                    Err(GeometryError::OutsideSource { .. })
                ));
            }
        }
    }
    if let Some((lc, lo, lat)) = late.take() {
        let src = LayerSource {
            base: lat,
            start: lc.start,
            blocks: lc.len() as u32,
        };
        plan.plan_piece(layers as u32 - 1, lc.clone(), src, lo.as_deref(), &mut out)
            .unwrap();
        apply(&out, &mut pstage, &mut pages);
    }
    assert_eq!(
        pages.bytes, direct.bytes,
        "by-layer staging != direct: first {first}, {chunks:?}"
    );
}

#[test]
fn layers_staged_by_chunk_in_decode_order_equal_the_direct_write() {
    let src: Vec<u32> = (10..22).collect();
    let ids: Vec<u32> = (30..42).rev().collect();
    for hm in [true, false] {
        check_by_layer(hm, &src, &ids, 0, &[0..12]);
        // chunks that ended inside a block share it with the next
        check_by_layer(hm, &src, &ids, 0, &[0..5, 4..9, 8..12]);
        check_by_layer(hm, &src, &ids[3..], 3, &[0..4, 3..12]);
        // a chunk of less than a block, then the same block again
        check_by_layer(hm, &src, &ids, 0, &[0..1, 0..1, 0..12]);
        let ids: Vec<u32> = [45, 44, 43, 42, 7, 20, 19, 18, 17, 16, 15, 50].to_vec();
        check_by_layer(hm, &src, &ids, 0, &[0..3, 2..8, 7..12]);
    }
}

#[test]
fn a_whole_staging_plans_each_layer_as_its_piece() {
    // plan_layer over a whole staging is plan_piece over that layer's part
    let (producer, consumer) = pair(4, (0, 1), (0, 1), 64, true);
    let ids: Vec<u32> = (30..42).rev().collect();
    let src = SourceStaging {
        base: 0x500_0000,
        capacity: 12,
        group: 4,
    };
    let h = handshake(&consumer, 2, ids[2..].to_vec(), None);
    let plan = plan_for(&producer, src, &h, MIN_RANGES).unwrap().unwrap();
    let order = StagedOrder::grouped(&producer, 12, 4).unwrap();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for l in 0..producer.layers.len() as u32 {
        plan.plan_layer(l, 3..9, None, &mut a).unwrap();
        let piece = LayerSource {
            base: src.base + order.slots[l as usize][0].0,
            start: 0,
            blocks: 12,
        };
        plan.plan_piece(l, 3..9, piece, None, &mut b).unwrap();
        assert_eq!(a, b);
        assert!(!a.is_empty());
        let (slots, bytes) = layer_slots(&producer, l as usize, 12).unwrap();
        assert_eq!(
            slots[1].0,
            order.slots[l as usize][1].0 - order.slots[l as usize][0].0
        );
        assert_eq!(bytes, 2 * 12 * producer.layers[0].planes[0].block_bytes);
    }
    // a plan made by layer has no whole staging
    let by_layer = StagedPlan::by_layer(&producer, 4, h.target(), MIN_RANGES)
        .unwrap()
        .unwrap();
    assert!(matches!(
        by_layer.plan_layer(0, 3..9, None, &mut a),
        Err(GeometryError::OutsideSource { .. })
    ));
    // and never writes a grant
    let grant = StagingGrant {
        base: 0x900_0000,
        len: staged_bytes(&consumer, 10).unwrap(),
        group: 4,
    };
    let hg = handshake(&consumer, 2, ids[2..].to_vec(), Some(grant));
    assert!(!StagedPlan::by_layer(&producer, 4, hg.target(), 0)
        .unwrap()
        .unwrap()
        .into_grant());
}

#[test]
fn a_chunk_gathered_in_decode_order_is_one_range_per_run_of_decode_ids() {
    // prefill's blocks ascending, decode's descending (a pool cycled once
    // more on one side): page to page that is a range per block
    let src: Vec<u32> = (10..22).collect();
    let ids: Vec<u32> = (30..42).rev().collect();
    for hm in [true, false] {
        check_sorted(hm, &src, &ids, 0, &[0..12]);
        check_sorted(hm, &src, &ids, 0, &[0..5, 5..12]);
        // chunks that ended inside a block share it with the next
        check_sorted(hm, &src, &ids, 0, &[0..5, 4..9, 8..12]);
        check_sorted(hm, &src, &ids[3..], 3, &[0..7, 7..12]);
        check_sorted(hm, &src, &ids[3..], 3, &[0..4, 3..12]);
        // two descending runs and a stray block
        let ids: Vec<u32> = [45, 44, 43, 42, 7, 20, 19, 18, 17, 16, 15, 50].to_vec();
        check_sorted(hm, &src, &ids, 0, &[0..12]);
        check_sorted(hm, &src, &ids, 0, &[0..3, 3..8, 8..12]);
        check_sorted(hm, &src, &ids, 0, &[0..3, 2..8, 7..12]);
    }
    let (producer, consumer) = pair(4, (0, 1), (0, 1), 64, true);
    let h = handshake(&consumer, 0, ids, None);
    let src = SourceStaging {
        base: 0x500_0000,
        capacity: 12,
        group: 4,
    };
    let plan = plan_for(&producer, src, &h, MIN_RANGES).unwrap().unwrap();
    assert_eq!(plan.gather_order(0..4, (false, false)), Some(vec![3, 2, 1, 0]));
    // a block shared with a neighbouring chunk stays in its slot
    assert_eq!(plan.gather_order(0..4, (true, false)), Some(vec![0, 3, 2, 1]));
    assert_eq!(plan.gather_order(0..4, (false, true)), Some(vec![2, 1, 0, 3]));
    assert_eq!(plan.gather_order(0..4, (true, true)), Some(vec![0, 2, 1, 3]));
    assert_eq!(plan.gather_order(0..2, (true, true)), None);
    // already in decode's order, past the capacity or the authorization: none
    let h2 = handshake(&consumer, 0, (30..42).collect(), None);
    let plan2 = plan_for(&producer, src, &h2, MIN_RANGES).unwrap().unwrap();
    assert_eq!(plan2.gather_order(0..12, (false, false)), None);
    assert_eq!(plan.gather_order(0..13, (false, false)), None);
    assert_eq!(plan.gather_order(4..4, (false, false)), None);
}

#[test]
fn a_reordered_chunk_is_refused_where_its_order_cannot_be_written() {
    let (producer, consumer) = pair(4, (0, 1), (0, 1), 64, true);
    let ids: Vec<u32> = (30..42).rev().collect();
    let src = SourceStaging {
        base: 0x500_0000,
        capacity: 12,
        group: 4,
    };
    let plan = plan_for(
        &producer,
        src,
        &handshake(&consumer, 0, ids.clone(), None),
        MIN_RANGES,
    )
    .unwrap()
    .unwrap();
    let mut out = Vec::new();
    for bad in [vec![0, 1, 2], vec![0, 1, 1, 3], vec![0, 1, 2, 4]] {
        assert!(
            matches!(
                plan.plan_layer(0, 0..4, Some(&bad), &mut out),
                Err(GeometryError::GatherOrder {
                    what: "permutation",
                    ..
                })
            ),
            "{bad:?}"
        );
    }
    // a grant is staged in request order: a reordered chunk never goes there
    let grant = StagingGrant {
        base: 0x900_0000,
        len: staged_bytes(&consumer, 12).unwrap(),
        group: 4,
    };
    let into_grant = plan_for(&producer, src, &handshake(&consumer, 0, ids, Some(grant)), 0)
        .unwrap()
        .unwrap();
    assert!(into_grant.into_grant());
    assert_eq!(into_grant.gather_order(0..4, (false, false)), None);
    assert!(matches!(
        into_grant.plan_layer(0, 0..4, Some(&[3, 2, 1, 0]), &mut out),
        Err(GeometryError::GatherOrder {
            what: "staging grant",
            ..
        })
    ));
}

mod sorted_props {
    use super::*;
    use proptest::prelude::*;

    /// A request's block IDs as vLLM hands them out of a cycled pool:
    /// runs of consecutive IDs, each ascending or descending, from a pool
    /// of 64 (no ID twice).
    fn blocks(n: usize) -> impl Strategy<Value = Vec<u32>> {
        (
            Just(n),
            proptest::collection::vec((1u32..6, any::<bool>()), n),
            Just(()),
        )
            .prop_perturb(|(n, runs, ()), mut rng| {
                let mut free: Vec<u32> = (0..64).collect();
                // shuffled pool, then runs carved from it where they fit
                for i in (1..free.len()).rev() {
                    free.swap(i, rng.random_range(0..=i));
                }
                let mut out: Vec<u32> = Vec::new();
                let mut used = [false; 64];
                let mut runs = runs.into_iter();
                while out.len() < n {
                    let (len, down) = runs.next().unwrap_or((1, false));
                    let start = free.iter().copied().find(|&b| !used[b as usize]).unwrap();
                    let mut b = start;
                    for _ in 0..len {
                        if out.len() == n || used[b as usize] {
                            break;
                        }
                        used[b as usize] = true;
                        out.push(b);
                        b = if down { b.wrapping_sub(1) } else { b + 1 };
                        if b >= 64 {
                            break;
                        }
                    }
                }
                out
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        #[test]
        fn sorted_staging_into_pages_equals_direct(
            (src, ids, first, cuts, hm) in (2usize..24).prop_flat_map(|n| (
                blocks(n), blocks(n), 0..n as u32,
                proptest::collection::vec((1..n as u32, any::<bool>()), 0..4), any::<bool>(),
            ))
        ) {
            // chunk ends; one that ended inside a block (`partial`) shares
            // it with the next chunk, as vLLM's chunked prefill does
            let n = src.len() as u32;
            let mut cuts: Vec<(u32, bool)> = cuts;
            cuts.sort_unstable();
            cuts.dedup_by_key(|c| c.0);
            let mut chunks: Vec<Range<u32>> = Vec::new();
            let mut start = 0;
            for (end, partial) in cuts.into_iter().chain([(n, false)]) {
                if end > start {
                    chunks.push(start..end);
                    start = if partial && end < n { end - 1 } else { end };
                }
            }
            check_sorted(hm, &src, &ids[first as usize..], first, &chunks);
            check_by_layer(hm, &src, &ids[first as usize..], first, &chunks);
        }
    }
}
