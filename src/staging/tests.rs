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
        version: WIRE_VERSION,
        request_id: crate::ids::RequestId::new("r"),
        capability: crate::ids::Capability::parse(&"7".repeat(32)).unwrap(),
        generation: crate::ids::Generation(1),
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

/// The worker's gather (what `orbitkv.vllm.staging` does with torch): unit
/// `u` of request block `i` of each (layer, plane) into the staged order.
fn gather(
    local: &KvLayout,
    src_blocks: &[u32],
    kv: &mut Mem,
    stage: &mut Mem,
    at: u64,
    cap: u32,
    range: Range<u32>,
) {
    let u = units(local);
    for (li, l) in local.layers.iter().enumerate() {
        for (pi, p) in l.planes.iter().enumerate() {
            let (off, ub) = StagedOrder::new(local, cap).unwrap().slots[li][pi];
            for unit in 0..u {
                for i in range.clone() {
                    let from = p.block_addr(src_blocks[i as usize]) + unit as u64 * ub;
                    let data = kv.at(from, ub).to_vec();
                    let to = at + off + (unit as u64 * cap as u64 + i as u64) * ub;
                    stage.at(to, ub).copy_from_slice(&data);
                }
            }
        }
    }
}

/// The worker's scatter on decode: `units` of each authorized block back
/// from the grant into the pages.
fn scatter(consumer: &KvLayout, h: &Handshake, units_sent: Range<u32>, stage: &mut Mem, kv: &mut Mem) {
    let g = h.staging.unwrap();
    let n = h.block_ids.len() as u32;
    for (li, l) in consumer.layers.iter().enumerate() {
        for (pi, p) in l.planes.iter().enumerate() {
            let (off, ub) = StagedOrder::new(consumer, n).unwrap().slots[li][pi];
            for unit in units_sent.clone() {
                for (i, &b) in h.block_ids.iter().enumerate() {
                    let from = g.base + off + (unit as u64 * n as u64 + i as u64) * ub;
                    let data = stage.at(from, ub).to_vec();
                    kv.at(p.block_addr(b) + unit as u64 * ub, ub)
                        .copy_from_slice(&data);
                }
            }
        }
    }
}

/// The producer's plan under `h`, for one layer write.
fn plan(
    local: &KvLayout,
    src: SourceStaging,
    h: &Handshake,
    layer: u32,
    blocks: Range<u32>,
    out: &mut Vec<WriteRange>,
) -> Result<(), GeometryError> {
    let plan = StagedPlan::new(local, src, h)?.expect("both sides stage");
    plan.plan_layer(layer, blocks, out)
}

fn apply(ranges: &[WriteRange], src: &mut Mem, dst: &mut Mem) {
    for r in ranges {
        let data = src.at(r.src, r.len).to_vec();
        dst.at(r.dst, r.len).copy_from_slice(&data);
    }
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
    let (layers, blocks, hb) = (3u32, 16u32, 8u64);
    let producer = kv(0x10_0000, layers, blocks, hb, (pr, ptp), total, head_major);
    let consumer = kv(0x80_0000, layers, blocks, hb, (cr, ctp), total, head_major);
    let req: u32 = chunks.last().unwrap().end;
    let src_blocks: Vec<u32> = (0..req).map(|i| (i * 7 + 3) % blocks).collect();
    let ids: Vec<u32> = (0..req - first).map(|i| (i * 5 + 1) % blocks).collect();
    let pbytes = 2 * (layers * blocks) as u64 * producer.layers[0].planes[0].block_bytes;
    let cbytes = 2 * (layers * blocks) as u64 * consumer.layers[0].planes[0].block_bytes;
    // direct
    let mut psrc = Mem::new(0x10_0000, pbytes as usize, 1);
    let mut direct = Mem::new(0x80_0000, cbytes as usize, 99);
    let h_direct = handshake(&consumer, first, ids.clone(), None);
    let mut out = Vec::new();
    for c in chunks {
        for l in 0..layers {
            plan_write(&producer, &src_blocks, &h_direct, l, c.clone(), &mut out).unwrap();
            apply(&out, &mut psrc, &mut direct);
        }
    }
    // staged
    let cap = req + 2; // capacity may exceed what is computed
    let sbytes = staged_bytes(&producer, cap).unwrap();
    let gbytes = staged_bytes(&consumer, ids.len() as u32).unwrap();
    let (sat, gat) = (0x400_0000u64, 0x800_0000u64 + 256);
    let mut pstage = Mem::new(sat, sbytes as usize, 3);
    // the grant sits inside a larger region whose other bytes must stay
    let mut cstage = Mem::new(gat - 256, gbytes as usize + 512, 5);
    let guard: Vec<u8> = cstage.bytes.clone();
    let grant = StagingGrant {
        base: gat,
        len: gbytes,
    };
    let h = handshake(&consumer, first, ids.clone(), Some(grant));
    h.validate().unwrap();
    assert!(staging_compatible(&producer, &consumer));
    let mut staged_pages = Mem::new(0x80_0000, cbytes as usize, 99);
    let mut kvsrc = Mem::new(0x10_0000, pbytes as usize, 1);
    let src = SourceStaging {
        base: sat,
        capacity: cap,
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
            c.clone(),
        );
        for l in 0..layers {
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
    };
    let h = handshake(&c, 0, ids, Some(grant));
    let mut out = Vec::new();
    let src = SourceStaging {
        base: 0x500_0000,
        capacity: 20,
    };
    plan(&p, src, &h, 1, 0..20, &mut out).unwrap();
    assert_eq!(out.len(), 2, "{out:?}");
    assert_eq!(out.iter().map(|r| r.len).sum::<u64>(), 2 * 20 * 8 * 64);
    // the same blocks direct: one range per block and plane
    plan_write(&p, &(0..20).collect::<Vec<_>>(), &h, 1, 0..20, &mut out).unwrap();
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
    };
    let h = handshake(&c, 0, vec![1, 2, 3, 4], Some(grant));
    let mut out = Vec::new();
    let src = SourceStaging {
        base: 0x500_0000,
        capacity: 8,
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
    };
    assert!(matches!(
        plan(&p, small, &h, 0, 0..4, &mut out),
        Err(GeometryError::OutsideSource { .. })
    ));
    // a grant too small for its blocks is refused by the handshake check...
    let short = StagingGrant {
        base: 0x900_0000,
        len: gbytes - 1,
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
    };
    let src = SourceStaging {
        base: 0x500_0000,
        capacity: n,
    };
    let h = handshake(&c, 0, (0..n).collect(), Some(grant));
    assert_eq!(StagedPlan::new(&p, src, &h), Ok(None));
    // nor does one whose consumer gave no grant
    let h = handshake(&p, 0, (0..n).collect(), None);
    assert_eq!(StagedPlan::new(&p, src, &h), Ok(None));
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
