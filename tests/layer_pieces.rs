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

use orbitkv::layout::{TokenOrder, TokenPart};
use orbitkv::staging::LayerSource;
use orbitkv::testing::{capability, held_fake_pair, wait_authorized, wait_released};
use orbitkv::transport::fake::FakeTransport;
use orbitkv::{KvLayout, Outcome, PagesBack, RequestId, RuntimeConfig, RuntimeError, WriteRange};

const LAYERS: u32 = 2;
const BLOCKS: u32 = 32;
const BB: u64 = 4096;
const KV: u64 = 0x10_0000;
const STAGE: u64 = 0x400_0000;

fn layout() -> KvLayout {
    with_tokens(KvLayout::packed(KV, LAYERS, BLOCKS, BB, (0, 1), 1))
}

/// `l` saying how its blocks hold their tokens (one row a token), which a
/// decode of another block size needs.
fn with_tokens(mut l: KvLayout) -> KvLayout {
    l.token_order = Some(TokenOrder {
        units: 1,
        parts: vec![TokenPart {
            rows: 1,
            token_bytes: l.layers[0].planes[0].block_bytes / l.block_size as u64,
        }],
    });
    l
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
    // what the tests then read (the gather order) follows the authorization
    wait_authorized(producer, req);
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

/// Waits until the runtime lets `req`'s pages go (the finish reaches the
/// producer on its own thread), or fails after 5 s.
fn wait_given_back(rt: &orbitkv::Runtime, req: &RequestId) {
    let until = Instant::now() + Duration::from_secs(5);
    while !rt.producer_give_back_pages(req).unwrap().gone() {
        assert!(Instant::now() < until, "{req:?}: pages never given back");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits until `rt` sent `n` notices (or fails after 5 s).
fn wait_notices_sent(rt: &orbitkv::Runtime, n: u64) {
    let until = Instant::now() + Duration::from_secs(5);
    while rt.stats().notices_sent < n {
        assert!(
            Instant::now() < until,
            "{} of {n} notices sent",
            rt.stats().notices_sent
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Asks for 200 ms (the finish had time to arrive) that `req`'s pages
/// do not go, the runtime saying `expect` each time.
fn never_given_back(rt: &orbitkv::Runtime, req: &RequestId, expect: PagesBack, why: &str) {
    let until = Instant::now() + Duration::from_millis(200);
    while Instant::now() < until {
        assert_eq!(rt.producer_give_back_pages(req).unwrap(), expect, "{why}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Stages each layer of chunk `c` of `req` (in request order when decode
/// did not authorize yet) and hands them over; the pieces, by layer.
fn stage_all(
    producer: &orbitkv::Runtime,
    req: &RequestId,
    c: std::ops::Range<u32>,
) -> Vec<(u32, std::ops::Range<u32>, LayerSource)> {
    producer
        .producer_gather_order(req, c.clone(), (false, false))
        .unwrap();
    (0..LAYERS)
        .map(|l| {
            let (piece, _) = producer
                .producer_stage_layer(req, l, c.clone())
                .unwrap()
                .expect("room");
            producer.layer_ready(req, l, c.clone()).unwrap();
            (l, c.clone(), piece)
        })
        .collect()
}

/// Chunk `c` of `req` staged with room for its layer 0 only: layer 0 is
/// gathered into a piece, layer 1 finds none (written from the pages);
/// both handed over.
fn stage_first_layer_only(producer: &orbitkv::Runtime, req: &RequestId, c: std::ops::Range<u32>) {
    producer
        .producer_gather_order(req, c.clone(), (false, false))
        .unwrap();
    producer
        .producer_stage_layer(req, 0, c.clone())
        .unwrap()
        .expect("room");
    producer.layer_ready(req, 0, c.clone()).unwrap();
    assert!(producer
        .producer_stage_layer(req, 1, c.clone())
        .unwrap()
        .is_none());
    producer.layer_ready(req, 1, c).unwrap();
}

/// One request written from its pieces end to end (decode authorized
/// first): the runtime has seen a decode that takes layer pieces.
fn one_staged_request(producer: &orbitkv::Runtime, consumer: &orbitkv::Runtime, wire: &FakeTransport) {
    let req = RequestId::new("first");
    open_by_layer(producer, consumer, &req, &[0, 1], &[30, 31]);
    assert_eq!(
        producer.producer_give_back_pages(&req).unwrap(),
        PagesBack::NotYet,
        "not finished"
    );
    stage_all(producer, &req, 0..2);
    producer.producer_finish(&req).unwrap();
    wire.hold(false);
    let (outcome, why) = wait_released(producer, &req);
    assert_eq!(outcome, Outcome::Done, "{why:?}");
    wait_all_back(producer);
    consumer.consumer_release(&req).unwrap();
    wire.hold(true);
}

#[test]
fn pages_go_back_before_decode_authorized_and_every_write_then_reads_its_piece() {
    let (producer, wire, consumer) = held_fake_pair(&layout(), cfg(1 << 20));
    let req = RequestId::new("early");
    let src: Vec<u32> = (0..12).collect();
    let open = |req: &RequestId| {
        producer
            .producer_open_by_layer(req.clone(), src[..6].to_vec(), capability(), 1, 1)
            .unwrap()
    };
    // no decode seen yet: it might not take the pieces, so the pages stay
    let cold = RequestId::new("cold");
    open(&cold);
    stage_all(&producer, &cold, 0..6);
    producer.producer_finish(&cold).unwrap();
    never_given_back(&producer, &cold, PagesBack::NotYet, "no decode seen yet");
    producer.producer_abort(&cold, "done with it").unwrap();
    wait_released(&producer, &cold);
    one_staged_request(&producer, &consumer, &wire);
    // its notice is timed once sent, on the notice lane's thread
    wait_notices_sent(&producer, 1);
    producer.take_timings();

    open(&req);
    let mut pieces = stage_all(&producer, &req, 0..6);
    assert_eq!(
        producer.producer_give_back_pages(&req).unwrap(),
        PagesBack::NotYet,
        "vLLM may still hand layers over: not finished"
    );
    producer.producer_add_blocks(&req, src[6..].to_vec()).unwrap();
    // chunks that share a block (a chunk of less than a block ends inside it)
    pieces.extend(stage_all(&producer, &req, 5..12));
    producer.producer_finish(&req).unwrap();
    wait_given_back(&producer, &req);
    assert_eq!(
        producer.producer_give_back_pages(&req).unwrap(),
        PagesBack::Before,
        "asked again"
    );
    assert_eq!(producer.stats().producer_pages_given_back, 1, "counted once");
    // the pages' time after the finish ends at the give-back, nothing is
    // written yet
    let timed = |t: &[(orbitkv::Timing, Vec<u32>)], w: orbitkv::Timing| {
        t.iter().find(|(x, _)| *x == w).map_or(0, |(_, v)| v.len())
    };
    let t = producer.take_timings();
    assert_eq!(timed(&t, orbitkv::Timing::PagesHeldAfterFinish), 1, "{t:?}");
    assert_eq!(timed(&t, orbitkv::Timing::WrittenAfterFinish), 0, "{t:?}");
    // decode authorizes only now: every write reads its own piece
    let dst: Vec<u32> = (20..32).collect();
    let before = wire.submitted().len();
    let hs = consumer
        .consumer_open(req.clone(), capability(), 0, dst.clone(), 1)
        .unwrap();
    producer.producer_handshake(hs).unwrap();
    wire.hold(false);
    let (outcome, why) = wait_released(&producer, &req);
    assert_eq!(outcome, Outcome::Done, "{why:?}");
    let ranges = &wire.submitted()[before..];
    assert!(!ranges.is_empty());
    let mut seen = std::collections::BTreeSet::new();
    for r in ranges {
        assert!(
            (STAGE..STAGE + (1 << 20)).contains(&r.src),
            "{r:?} read prefill's pages after they went back"
        );
        let (layer, d) = dest_block(r.dst);
        let (_, chunk, piece) = pieces
            .iter()
            .find(|(l, c, p)| *l == layer && (p.base..p.base + c.len() as u64 * BB).contains(&r.src))
            .unwrap_or_else(|| panic!("{r:?} from no piece of its layer"));
        // slot k of a piece in request order holds request block start + k
        let first = chunk.start + ((r.src - piece.base) / BB) as u32;
        assert_eq!(d, 20 + first, "{r:?}");
        for k in 0..(r.len / BB) as u32 {
            seen.insert((layer, first + k));
        }
    }
    assert_eq!(
        seen.len() as u32,
        LAYERS * 12,
        "every layer of every block written"
    );
    // every piece went back at the release
    wait_all_back(&producer);
    // written once decode authorized; the pages were timed at the give-back,
    // not again at the release
    wait_notices_sent(&producer, 2);
    let t = producer.take_timings();
    assert_eq!(timed(&t, orbitkv::Timing::WrittenAfterFinish), 1, "{t:?}");
    assert_eq!(timed(&t, orbitkv::Timing::PagesHeldAfterFinish), 0, "{t:?}");
}

#[test]
fn pages_stay_while_a_layer_has_no_piece_and_a_decode_that_cannot_take_pieces_fails_alone() {
    // room for three pieces of 4 blocks
    let (producer, wire, consumer) = held_fake_pair(&layout(), cfg(3 * 4 * BB + 512));
    one_staged_request(&producer, &consumer, &wire);
    let req = RequestId::new("no-room");
    producer
        .producer_open_by_layer(req.clone(), (0..4).collect(), capability(), 1, 1)
        .unwrap();
    stage_all(&producer, &req, 0..4);
    // the second chunk's layer 1 finds no room: it needs the pages
    producer.producer_add_blocks(&req, (4..8).collect()).unwrap();
    stage_first_layer_only(&producer, &req, 4..8);
    producer.producer_finish(&req).unwrap();
    never_given_back(
        &producer,
        &req,
        PagesBack::NotYet,
        "layer 1 of 4..8 reads the pages",
    );
    assert_eq!(producer.stats().producer_pages_given_back, 0);
    let before = wire.submitted().len();
    let hs = consumer
        .consumer_open(req.clone(), capability(), 0, (20..28).collect(), 1)
        .unwrap();
    producer.producer_handshake(hs).unwrap();
    wire.hold(false);
    let (outcome, why) = wait_released(&producer, &req);
    assert_eq!(outcome, Outcome::Done, "{why:?}");
    let from_pages = wire.submitted()[before..]
        .iter()
        .filter(|r| r.src < STAGE)
        .count();
    assert_eq!(from_pages, 1, "layer 1 of the second chunk, from the pages");
    assert!(matches!(
        producer.producer_give_back_pages(&req),
        Err(RuntimeError::UnknownRequest(_))
    ));
    wait_all_back(&producer);

    // The pages went back, then a decode of another block size authorizes
    // (it cannot take pieces): its writes fail, none reads a page, the
    // request fails alone; from then on the pages stay until decode
    // authorized.
    wire.hold(true);
    let mut other = KvLayout::packed(KV, LAYERS, BLOCKS, 2 * BB, (0, 1), 1);
    other.block_size *= 2;
    let other = with_tokens(other);
    let odd = orbitkv::Runtime::start(
        std::sync::Arc::new(FakeTransport::new("127.0.0.1:3")),
        other,
        RuntimeConfig::default(),
    )
    .unwrap();
    let req = RequestId::new("other-size");
    producer
        .producer_open_by_layer(req.clone(), (0..4).collect(), capability(), 1, 1)
        .unwrap();
    stage_all(&producer, &req, 0..4);
    producer.producer_finish(&req).unwrap();
    wait_given_back(&producer, &req);
    let before = wire.submitted().len();
    let hs = odd
        .consumer_open_tokens(req.clone(), capability(), 0, vec![3, 4], 1, 4 * 16)
        .unwrap();
    producer.producer_handshake(hs).unwrap();
    wire.hold(false);
    let (outcome, why) = wait_released(&producer, &req);
    assert_ne!(outcome, Outcome::Done);
    assert!(
        why.as_deref()
            .is_some_and(|w| w.contains("gave its KV pages back")),
        "{why:?}"
    );
    assert_eq!(wire.submitted().len(), before, "nothing written");
    wait_all_back(&producer);
    let req = RequestId::new("after");
    producer
        .producer_open_by_layer(req.clone(), (0..4).collect(), capability(), 1, 1)
        .unwrap();
    stage_all(&producer, &req, 0..4);
    producer.producer_finish(&req).unwrap();
    never_given_back(
        &producer,
        &req,
        PagesBack::NotYet,
        "a decode that cannot take pieces was seen: the pages wait for the authorization",
    );
    // that authorization cannot take the pieces either: only the release
    // frees the pages, and the worker need not ask again
    wire.hold(true);
    let hs = odd
        .consumer_open_tokens(req.clone(), capability(), 0, vec![5, 6], 1, 4 * 16)
        .unwrap();
    producer.producer_handshake(hs).unwrap();
    // the producer's actor takes the handshake after it was accepted
    wait_authorized(&producer, &req);
    never_given_back(
        &producer,
        &req,
        PagesBack::Never,
        "decode's authorization is written from the pages",
    );
    wire.hold(false);
    let (outcome, why) = wait_released(&producer, &req);
    assert_eq!(outcome, Outcome::Done, "{why:?}");
    assert_eq!(
        producer.stats().producer_pages_given_back,
        1,
        "only the request before the odd decode"
    );
}

#[test]
fn pages_go_back_once_the_layers_without_a_piece_are_at_decode_while_piece_writes_still_queue() {
    // room for one piece of 8 blocks, or two of 4
    let (producer, wire, consumer) = held_fake_pair(&layout(), cfg(8 * BB + 256));
    one_staged_request(&producer, &consumer, &wire);
    let req = RequestId::new("mixed");
    let src: Vec<u32> = (0..12).collect();
    let dst: Vec<u32> = (12..24).collect();
    open_by_layer(&producer, &consumer, &req, &src[..8], &dst);
    // the first chunk: layer 0 in a piece, layer 1 finds no room (pages)
    stage_first_layer_only(&producer, &req, 0..8);
    // both written: the piece back, the page-read layer at decode
    wire.hold(false);
    wait_all_back(&producer);
    let until = Instant::now() + Duration::from_secs(5);
    while producer.writes_queued() > 0 || wire.submitted().len() < 2 {
        assert!(Instant::now() < until, "the first chunk's writes never ended");
        std::thread::sleep(Duration::from_millis(1));
    }
    // the second chunk: both layers in pieces, their writes held
    wire.hold(true);
    producer.producer_add_blocks(&req, src[8..].to_vec()).unwrap();
    let before = wire.submitted().len();
    stage_all(&producer, &req, 8..12);
    producer.producer_finish(&req).unwrap();
    // every layer is in a piece or at decode: the pages go, the writes queue
    wait_given_back(&producer, &req);
    assert_eq!(producer.source_staging_in_use().1, 2, "the second chunk's pieces");
    assert_eq!(producer.stats().producer_pages_given_back, 1);
    wire.hold(false);
    let (outcome, why) = wait_released(&producer, &req);
    assert_eq!(outcome, Outcome::Done, "{why:?}");
    let after = &wire.submitted()[before..];
    assert_eq!(after.len(), 2, "one range a layer of the second chunk: {after:?}");
    for r in after {
        assert!(
            (STAGE..STAGE + 8 * BB + 256).contains(&r.src),
            "{r:?} read prefill's pages after they went back"
        );
        let (_, d) = dest_block(r.dst);
        assert_eq!(d, 20, "{r:?}: blocks 8..12 land in decode's 20..24");
    }
    wait_all_back(&producer);
}

/// `orbitkv.pd.staging_pieces` `request` (`pieces_whole_requests`): two
/// requests computed in one forward (their layers gathered in turn) while
/// decode has not authorized either, in a region with room for two pieces.
/// By layer both get layer 0 and neither layer 1, so both keep their pages
/// until decode authorizes and a write reads them. Staged whole, the first
/// to miss gives back its untaken piece, the other gets every layer and
/// gives its pages back at once; the first's layers are written from its
/// pages once decode authorizes, and every range lands in its own
/// request's authorized blocks.
#[test]
fn staged_whole_the_request_that_misses_gives_its_piece_to_one_it_can_stage_whole() {
    for whole in [false, true] {
        let region = 2 * 8 * BB + 256;
        let (producer, wire, consumer) = held_fake_pair(
            &layout(),
            RuntimeConfig {
                pieces_whole_requests: whole,
                ..cfg(region)
            },
        );
        one_staged_request(&producer, &consumer, &wire);
        let (a, b) = (RequestId::new("a"), RequestId::new("b"));
        let src = |r: &RequestId| -> Vec<u32> {
            if *r == a {
                (0..8).collect()
            } else {
                (8..16).collect()
            }
        };
        let dst = |r: &RequestId| -> Vec<u32> {
            if *r == a {
                (0..8).collect()
            } else {
                (16..24).collect()
            }
        };
        for r in [&a, &b] {
            producer
                .producer_open_by_layer(r.clone(), src(r), capability(), 1, 1)
                .unwrap();
            producer.producer_gather_order(r, 0..8, (false, false)).unwrap();
        }
        let mut pieces: Vec<(RequestId, u32, LayerSource)> = Vec::new();
        for l in 0..LAYERS {
            for r in [&a, &b] {
                if let Some((p, _)) = producer.producer_stage_layer(r, l, 0..8).unwrap() {
                    pieces.push((r.clone(), l, p));
                }
                producer.layer_ready(r, l, 0..8).unwrap();
            }
        }
        let s = producer.stats();
        for r in [&a, &b] {
            producer.producer_finish(r).unwrap();
        }
        if whole {
            // a.l0, b.l0; a.l1 misses and gives a.l0 back; b.l1 takes it
            assert_eq!(pieces.len(), 3, "{pieces:?}");
            // a's piece went back unread: a is written from its pages
            pieces.retain(|(r, _, _)| *r == b);
            assert_eq!((s.source_staging_full, s.source_pieces_given_up), (1, 1));
            assert_eq!(producer.source_staging_in_use().1, 2, "b's two layers");
            wait_given_back(&producer, &b);
            never_given_back(
                &producer,
                &a,
                PagesBack::NotYet,
                "a's layers are on its pages only",
            );
            assert_eq!(producer.stats().producer_pages_given_back, 1);
        } else {
            assert_eq!(pieces.len(), 2, "layer 0 of each: {pieces:?}");
            assert_eq!((s.source_staging_full, s.source_pieces_given_up), (2, 0));
            for r in [&a, &b] {
                never_given_back(&producer, r, PagesBack::NotYet, "layer 1 is on the pages only");
            }
        }
        // decode authorizes both now: every write goes from a live piece of
        // its own layer, or from its own request's pages
        let before = wire.submitted().len();
        for r in [&a, &b] {
            let hs = consumer
                .consumer_open(r.clone(), capability(), 0, dst(r), 1)
                .unwrap();
            producer.producer_handshake(hs).unwrap();
        }
        wire.hold(false);
        // both releases (`wait_released` drops the other request's event)
        let mut released = std::collections::BTreeMap::new();
        while released.len() < 2 {
            if let orbitkv::RuntimeEvent::ProducerReleased {
                request,
                outcome,
                reason,
                ..
            } = orbitkv::testing::wait_for(&producer, "both releases", |e| {
                matches!(e, orbitkv::RuntimeEvent::ProducerReleased { .. })
            }) {
                assert_eq!(outcome, Outcome::Done, "{request:?}: {reason:?}");
                released.insert(request.0.clone(), ());
            }
        }
        let l = layout();
        let mut seen = std::collections::BTreeSet::new();
        for rg in &wire.submitted()[before..] {
            let (layer, d) = dest_block(rg.dst);
            let r = if d < 8 { &a } else { &b };
            let k = dst(r)
                .iter()
                .position(|&x| x == d)
                .unwrap_or_else(|| panic!("{rg:?} outside both authorizations"));
            let from_piece = pieces
                .iter()
                .find(|(pr, pl, _)| pr == r && *pl == layer)
                .map(|(_, _, p)| p.base + k as u64 * BB);
            let want = from_piece.unwrap_or_else(|| l.layers[layer as usize].planes[0].block_addr(src(r)[k]));
            assert_eq!(rg.src, want, "{r:?} layer {layer}: {rg:?}");
            for i in 0..(rg.len / BB) as u32 {
                seen.insert((d + i, layer));
            }
        }
        assert_eq!(
            seen.len() as u32,
            2 * 8 * LAYERS,
            "every block of every layer, once"
        );
        wait_all_back(&producer);
    }
}
