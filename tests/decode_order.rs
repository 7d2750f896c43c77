//! A staged chunk gathered in decode's block order
//! (`Runtime::producer_gather_order`): the runtime records the order it
//! names, the chunk's writes follow it from the source staging into decode's
//! pages, and an authorization that would write a grant after a chunk was
//! reordered is written from prefill's pages instead (a grant is staged in
//! request order).
//!
//! The transport here is the crate's test double (`FakeTransport`, which
//! logs where each range would go): these tests check where the runtime
//! writes. Bytes through the real Mooncake engine and torch's gather:
//! `bindings/python/tests/test_staging.py`; the planning itself against the
//! direct plan, byte for byte: `src/staging/tests.rs`.

use orbitkv::staging::{staged_bytes, SourceStaging, StagingGrant};
use orbitkv::testing::{capability, held_fake_pair, wait_authorized, wait_released};
use orbitkv::{Generation, KvLayout, Outcome, RequestId, RuntimeConfig, Sequence, WriteRange};

const LAYERS: u32 = 2;
const BLOCKS: u32 = 32;
const BB: u64 = 4096;
const KV: u64 = 0x10_0000;
const STAGE: u64 = 0x400_0000;

fn layout() -> KvLayout {
    KvLayout::packed(KV, LAYERS, BLOCKS, BB, (0, 1), 1)
}

fn cfg() -> RuntimeConfig {
    RuntimeConfig {
        source_staging_region: Some((STAGE, 1 << 20)),
        ..RuntimeConfig::default()
    }
}

/// Which request block a range's byte at `off` into the source comes from,
/// and which decode block it lands in: every block of every range must
/// pair request block `i` with decode block `dst[i]`.
fn check_ranges(ranges: &[WriteRange], src_of_slot: impl Fn(u64) -> Option<u32>, src: &[u32], dst: &[u32]) {
    let l = layout();
    for r in ranges {
        assert_eq!(r.len % BB, 0, "{r:?}");
        for k in 0..r.len / BB {
            let (s, d) = (r.src + k * BB, r.dst + k * BB);
            // the destination: an authorized block of some layer
            let (layer, dblock) = (0..LAYERS)
                .find_map(|li| {
                    let p = &l.layers[li as usize].planes[0];
                    (d >= p.base && d < p.base + BLOCKS as u64 * BB).then(|| (li, ((d - p.base) / BB) as u32))
                })
                .unwrap_or_else(|| panic!("{r:?} lands outside the KV"));
            let i = dst
                .iter()
                .position(|&b| b == dblock)
                .expect("an authorized block");
            // the source: the staging slot of request block i, or its page
            let want = match src_of_slot(s) {
                Some(req_block) => req_block,
                None => {
                    let p = &l.layers[layer as usize].planes[0];
                    assert_eq!(s, p.block_addr(src[i]), "{r:?}: page of another block");
                    i as u32
                }
            };
            assert_eq!(
                want, i as u32,
                "{r:?}: request block {want} written into block {dblock} of request block {i}"
            );
        }
    }
}

/// `req` opened on both runtimes: decode authorizes `dst` (no grant), the
/// producer holds `src` with a source staging of `src.len()` blocks at
/// `STAGE`; returns decode's handshake, not yet handed over.
fn open_staged(
    producer: &orbitkv::Runtime,
    consumer: &orbitkv::Runtime,
    req: &RequestId,
    src: &[u32],
    dst: &[u32],
) -> orbitkv::Handshake {
    let hs = consumer
        .consumer_open(req.clone(), capability(), 0, dst.to_vec(), 1)
        .unwrap();
    assert!(hs.staging.is_none(), "decode grants nothing here");
    let staging = SourceStaging {
        base: STAGE,
        capacity: src.len() as u32,
        group: 1,
    };
    producer
        .producer_open_staged(req.clone(), src.to_vec(), capability(), 1, Some(staging))
        .unwrap();
    hs
}

#[test]
fn a_chunk_named_in_decode_order_is_written_from_its_slots_into_decode_pages_as_one_range_per_run() {
    let (producer, wire, consumer) = held_fake_pair(&layout(), cfg());
    wire.hold(false);
    let req = RequestId::new("sorted");
    let src: Vec<u32> = (0..12).collect();
    // one descending run of decode blocks and one ascending, interleaved
    let dst: Vec<u32> = vec![30, 29, 28, 27, 26, 25, 10, 11, 24, 12, 13, 23];
    let hs = open_staged(&producer, &consumer, &req, &src, &dst);
    producer.producer_handshake(hs).unwrap();
    // the order is read from the authorization the producer took
    wait_authorized(&producer, &req);
    // two chunks as chunked prefill makes them: the first ended inside
    // block 4, which the second gathers again; the worker pins the shared
    // block in both (the first chunk's last, the second's first)
    let mut orders = Vec::new();
    for (chunk, pinned) in [(0..5, (false, true)), (4..12, (true, false))] {
        let order = producer
            .producer_gather_order(&req, chunk.clone(), pinned)
            .unwrap()
            .expect("reordered");
        assert!(order.contains(&4));
        let at4 = order.iter().position(|&i| i == 4).unwrap() as u32 + chunk.start;
        assert_eq!(at4, 4, "the shared block stays in its slot: {order:?}");
        let free: Vec<u32> = order
            .iter()
            .filter(|&&i| i != 4)
            .map(|&i| dst[i as usize])
            .collect();
        assert!(
            free.windows(2).all(|w| w[0] < w[1]),
            "the others sorted by decode's IDs: {free:?}"
        );
        orders.push((chunk.clone(), order));
        for l in 0..LAYERS {
            producer.layer_ready(&req, l, chunk.clone()).unwrap();
        }
    }
    producer.producer_finish(&req).unwrap();
    let (outcome, why) = wait_released(&producer, &req);
    assert_eq!(outcome, Outcome::Done, "{why:?}");
    let ranges = wire.submitted();
    // staged order: layer by layer, slot by slot (one unit a block)
    let slot_bytes = 12 * BB;
    let slot_of = |s: u64| -> Option<u32> {
        (STAGE..STAGE + LAYERS as u64 * slot_bytes).contains(&s).then(|| {
            let slot = (((s - STAGE) % slot_bytes) / BB) as u32;
            let (chunk, order) = orders.iter().find(|(c, _)| c.contains(&slot)).unwrap();
            order[(slot - chunk.start) as usize]
        })
    };
    assert!(
        ranges.iter().all(|r| slot_of(r.src).is_some()),
        "every range from the staging"
    );
    check_ranges(&ranges, slot_of, &src, &dst);
    // chunk 0..5: decode 27..=30 and the pinned 26; chunk 4..12: the
    // pinned 26, 10..=13 and 23..=25: 2 + 3 ranges a layer (page to page: 12)
    assert_eq!(ranges.len() as u32, LAYERS * (2 + 3), "{ranges:?}");
    assert_eq!(producer.stats().layers_staged_to_pages, 2 * LAYERS as u64);
    assert_eq!(producer.stats().chunks_reordered, 2);
    // a request the runtime does not hold: refused, nothing recorded
    assert!(matches!(
        producer.producer_gather_order(&RequestId::new("nobody"), 0..4, (false, false)),
        Err(orbitkv::RuntimeError::UnknownRequest(_))
    ));
}

#[test]
fn a_later_authorization_with_a_grant_after_a_reordered_chunk_is_written_from_the_pages() {
    let (producer, wire, consumer) = held_fake_pair(&layout(), cfg());
    wire.hold(false);
    let req = RequestId::new("regrant");
    let src: Vec<u32> = (0..16).collect();
    // no two consecutive: a grant would be chosen when there is one
    let dst: Vec<u32> = (0..16).map(|i| 30 - 2 * i).collect();
    let hs1 = open_staged(&producer, &consumer, &req, &src, &dst);
    producer.producer_handshake(hs1.clone()).unwrap();
    wait_authorized(&producer, &req);
    // no grant: pages from the staging, in decode's order
    let order = producer
        .producer_gather_order(&req, 0..16, (false, false))
        .unwrap();
    assert_eq!(order, Some((0..16).rev().collect::<Vec<u32>>()));
    // decode authorizes again (its request ID reused), now with a grant
    let grant = StagingGrant {
        base: 0x900_0000,
        len: staged_bytes(&layout(), 16).unwrap(),
        group: 1,
    };
    let mut hs2 = hs1.clone();
    hs2.generation = Generation(hs1.generation.0 ^ 0x5555);
    hs2.sequence = Sequence(hs1.sequence.0 + 1);
    hs2.staging = Some(grant);
    producer.producer_handshake(hs2).unwrap();
    for l in 0..LAYERS {
        producer.layer_ready(&req, l, 0..16).unwrap();
    }
    producer.producer_finish(&req).unwrap();
    let (outcome, why) = wait_released(&producer, &req);
    assert_eq!(outcome, Outcome::Done, "{why:?}");
    let ranges = wire.submitted();
    assert!(!ranges.is_empty());
    for r in &ranges {
        assert!(
            !(grant.base..grant.base + grant.len).contains(&r.dst),
            "{r:?} into the grant from a reordered chunk"
        );
        assert!(
            r.src < STAGE,
            "{r:?}: from the staging under an authorization that is not written from it"
        );
    }
    check_ranges(&ranges, |_| None, &src, &dst);
    assert_eq!(producer.stats().layers_staged, 0);
}
