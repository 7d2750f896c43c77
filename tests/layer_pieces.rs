//! A request staged by layer (`Runtime::producer_open_by_layer`): each
//! layer of each chunk is gathered into a piece of the source staging
//! region the runtime gives (`producer_stage_layer`), its write reads that
//! piece, and the piece goes back to the region as soon as the write
//! ended, not when the request is released; a layer that finds no room is
//! written from prefill's pages.
//!
//! The transport here is the crate's test double (`FakeTransport`, which
//! logs where each range would go and holds writes in flight on demand):
//! these tests check where the runtime writes and when it gives pieces
//! back. Bytes through the real Mooncake engine and torch's gather:
//! `bindings/python/tests/test_staging.py`; the planning against the
//! direct plan, byte for byte: `src/staging/tests.rs`.

use std::time::{Duration, Instant};

use orbitkv::staging::LayerSource;
use orbitkv::testing::{capability, held_fake_pair, wait_released};
use orbitkv::{KvLayout, Outcome, RequestId, RuntimeConfig, RuntimeError, WriteRange};

const LAYERS: u32 = 2;
const BLOCKS: u32 = 32;
const BB: u64 = 4096;
const KV: u64 = 0x10_0000;
const STAGE: u64 = 0x400_0000;

fn layout() -> KvLayout {
    KvLayout::packed(KV, LAYERS, BLOCKS, BB, (0, 1), 1)
}

fn cfg(region: u64) -> RuntimeConfig {
    RuntimeConfig {
        source_staging_region: Some((STAGE, region)),
        ..RuntimeConfig::default()
    }
}

/// Waits until the runtime gave every piece back (or fails after 5 s).
fn wait_all_back(rt: &orbitkv::Runtime) {
    let until = Instant::now() + Duration::from_secs(5);
    while rt.source_staging_in_use() != (0, 0) {
        assert!(
            Instant::now() < until,
            "pieces still held: {:?}",
            rt.source_staging_in_use()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The layer and decode block a range's block at `d` lands in.
fn dest_block(d: u64) -> (u32, u32) {
    let l = layout();
    (0..LAYERS)
        .find_map(|li| {
            let p = &l.layers[li as usize].planes[0];
            (d >= p.base && d < p.base + BLOCKS as u64 * BB).then(|| (li, ((d - p.base) / BB) as u32))
        })
        .unwrap_or_else(|| panic!("{d:#x} lands outside the KV"))
}

/// `req` opened on both runtimes: decode authorizes `dst` (no grant), the
/// producer holds `src` staged by layer (one unit a group), and decode's
/// handshake is handed over.
fn open_by_layer(
    producer: &orbitkv::Runtime,
    consumer: &orbitkv::Runtime,
    req: &RequestId,
    src: &[u32],
    dst: &[u32],
) {
    let hs = consumer
        .consumer_open(req.clone(), capability(), 0, dst.to_vec(), 1)
        .unwrap();
    producer
        .producer_open_by_layer(req.clone(), src.to_vec(), capability(), 1, 1)
        .unwrap();
    producer.producer_handshake(hs).unwrap();
}

#[test]
fn each_layer_piece_goes_back_when_its_write_ended_and_writes_follow_decode_order() {
    let (producer, wire, consumer) = held_fake_pair(&layout(), cfg(1 << 20));
    let req = RequestId::new("by-layer");
    let src: Vec<u32> = (0..12).collect();
    // decode's blocks descending: one run once sorted, a range per block unsorted
    let dst: Vec<u32> = (20..32).rev().collect();
    open_by_layer(&producer, &consumer, &req, &src, &dst);
    // nothing pinned: a chunk staged by layer shares no slot with another
    let order = producer
        .producer_gather_order(&req, 0..12, (true, true))
        .unwrap()
        .expect("reordered");
    assert_eq!(order, (0..12).rev().collect::<Vec<u32>>());
    let mut pieces: Vec<(u32, LayerSource)> = Vec::new();
    for l in 0..LAYERS {
        let (piece, slots) = producer
            .producer_stage_layer(&req, l, 0..12)
            .unwrap()
            .expect("room");
        assert_eq!((piece.start, piece.blocks), (0, 12));
        assert_eq!(slots, vec![(0, BB)], "one plane, whole blocks");
        pieces.push((l, piece));
        producer.layer_ready(&req, l, 0..12).unwrap();
    }
    // the writes are in flight: both pieces held, disjoint
    assert_eq!(producer.source_staging_in_use(), (2 * 12 * BB, 2));
    assert!(pieces[0].1.base + 12 * BB <= pieces[1].1.base || pieces[1].1.base + 12 * BB <= pieces[0].1.base);
    wire.hold(false);
    // back before the request is released (it is not even finished)
    wait_all_back(&producer);
    let ranges: Vec<WriteRange> = wire.submitted();
    assert_eq!(ranges.len() as u32, LAYERS, "one range a layer: {ranges:?}");
    for r in &ranges {
        let (layer, first_dst) = dest_block(r.dst);
        let piece = pieces.iter().find(|(l, _)| *l == layer).unwrap().1;
        assert_eq!(r.src, piece.base, "{r:?} from the layer's own piece");
        assert_eq!(r.len, 12 * BB);
        // slot k holds request block 11 - k, which goes to decode 20 + k
        assert_eq!(first_dst, 20);
    }
    // a later write of the same layer and chunk (a newer handshake, say)
    // finds no piece: from the pages, which prefill still holds
    assert_eq!(producer.stats().layers_staged_to_pages, LAYERS as u64);
    producer.producer_finish(&req).unwrap();
    let (outcome, why) = wait_released(&producer, &req);
    assert_eq!(outcome, Outcome::Done, "{why:?}");
    assert!(matches!(
        producer.producer_stage_layer(&req, 0, 0..12),
        Err(RuntimeError::UnknownRequest(_))
    ));
}

#[test]
fn a_layer_without_room_is_written_from_the_pages_and_a_release_gives_every_piece_back() {
    // room for one layer of 8 blocks only
    let (producer, wire, consumer) = held_fake_pair(&layout(), cfg(8 * BB + 256));
    let req = RequestId::new("full");
    let src: Vec<u32> = (0..8).collect();
    let dst: Vec<u32> = (10..18).collect();
    open_by_layer(&producer, &consumer, &req, &src, &dst);
    assert_eq!(
        producer
            .producer_gather_order(&req, 0..8, (false, false))
            .unwrap(),
        None
    );
    let (p0, _) = producer
        .producer_stage_layer(&req, 0, 0..8)
        .unwrap()
        .expect("room");
    assert!(
        producer.producer_stage_layer(&req, 1, 0..8).unwrap().is_none(),
        "no room"
    );
    assert_eq!(producer.stats().source_staging_full, 1, "counted");
    // blocks or layers not the request's: refused, nothing given
    assert!(producer.producer_stage_layer(&req, 0, 0..9).is_err());
    assert!(producer.producer_stage_layer(&req, LAYERS, 0..8).is_err());
    assert!(producer.producer_stage_layer(&req, 0, 3..3).is_err());
    assert_eq!(producer.source_staging_in_use().1, 1);
    for l in 0..LAYERS {
        producer.layer_ready(&req, l, 0..8).unwrap();
    }
    producer.producer_finish(&req).unwrap();
    // released while the writes are held? no: a release waits for them
    assert_eq!(producer.source_staging_in_use().1, 1);
    wire.hold(false);
    let (outcome, why) = wait_released(&producer, &req);
    assert_eq!(outcome, Outcome::Done, "{why:?}");
    wait_all_back(&producer);
    let ranges = wire.submitted();
    let l = layout();
    for r in &ranges {
        let (layer, d) = dest_block(r.dst);
        let i = dst.iter().position(|&b| b == d).unwrap() as u64;
        let want = if layer == 0 {
            p0.base + i * BB
        } else {
            l.layers[1].planes[0].block_addr(src[i as usize])
        };
        assert_eq!(r.src, want, "{r:?}");
    }
    assert_eq!(ranges.len(), 2);
    // a producer opened without staging by layer has no pieces to give
    let other = RequestId::new("plain");
    producer
        .producer_open(other.clone(), vec![20, 21], capability(), 1)
        .unwrap();
    assert!(matches!(
        producer.producer_stage_layer(&other, 0, 0..2),
        Err(RuntimeError::Geometry(_))
    ));
    // a group that ends while writes still held its pieces: all back
    let req3 = RequestId::new("aborted");
    open_by_layer(&producer, &consumer, &req3, &[3, 4], &[1, 2]);
    wire.hold(true);
    producer
        .producer_stage_layer(&req3, 0, 0..2)
        .unwrap()
        .expect("room");
    producer.layer_ready(&req3, 0, 0..2).unwrap();
    producer.producer_abort(&req3, "client gone").unwrap();
    assert_eq!(
        producer.source_staging_in_use().1,
        1,
        "held by the write in flight"
    );
    wire.hold(false);
    let (outcome, _) = wait_released(&producer, &req3);
    assert_ne!(outcome, Outcome::Done);
    wait_all_back(&producer);
    assert!(
        producer
            .producer_open_by_layer(RequestId::new("x"), vec![1], capability(), 1, 3)
            .is_err(),
        "a group that does not divide a block's units"
    );
}
