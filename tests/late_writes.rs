//! A write batch that outlives `write_timeout` (a cut link, a stopped peer)
//! is held, not given up: Mooncake cannot cancel it and may still move its
//! bytes, so the producer keeps its source blocks and sends no notice until
//! the transport ends the batch, or the quarantine passes.
//!
//! The transport here is the crate's test double (`FakeTransport`, held):
//! every batch stays in flight until the test lets it end, as Mooncake's
//! queue behind a cut link does. The real-Mooncake version of this scenario is
//! `bindings/python/tests/e2e/test_faults_netns.py` (link cut, then restored).

use std::sync::Arc;
use std::time::{Duration, Instant};

use orbitkv::testing::capability as cap;
use orbitkv::transport::fake::FakeTransport;
use orbitkv::{KvLayout, Outcome, RequestId, Runtime, RuntimeConfig, RuntimeEvent};

/// A consumer and a producer runtime over the crate's transport test double
/// (`FakeTransport`; a model of `layers` layers, one writer lane, one range in flight per
/// peer), the producer holding the consumer's handshake for a request of two
/// blocks, its batches held in flight; `edit` may change the handshake
/// first. Returns (producer, its transport, the request).
fn pair(
    name: &str,
    layers: u32,
    write_timeout: Duration,
    quarantine: Duration,
    edit: impl FnOnce(&mut orbitkv::Handshake),
) -> (Runtime, Arc<FakeTransport>, RequestId) {
    let layout = KvLayout::packed(0x10_0000, layers, 4, 4096, (0, 1), 1);
    let cfg = RuntimeConfig {
        write_timeout,
        quarantine,
        writer_lanes_per_peer: 1,
        max_ranges_in_flight_per_peer: Some(1),
        ..RuntimeConfig::default()
    };
    let (producer, wire, consumer) = orbitkv::testing::held_fake_pair(&layout, cfg);
    let req = RequestId::new(name);
    let mut hs = consumer
        .consumer_open(req.clone(), cap(), 0, vec![2, 3], 1)
        .unwrap();
    assert!(hs.expires_unix_ms > 0, "the consumer gives its deadline");
    edit(&mut hs);
    producer.producer_open(req.clone(), vec![0, 1], cap(), 1).unwrap();
    producer.producer_handshake(hs).unwrap();
    (producer, wire, req)
}

/// A producer with one layer admitted against a consumer's handshake, its
/// batch held by the double; returns (producer runtime, its transport).
fn streaming(name: &str, write_timeout: Duration, quarantine: Duration) -> (Runtime, Arc<FakeTransport>) {
    // One layer: the whole request is that one admitted layer.
    let (producer, wire, req) = pair(name, 1, write_timeout, quarantine, |_| {});
    producer.layer_ready(&req, 0, 0..2).unwrap();
    producer.producer_finish(&req).unwrap();
    (producer, wire)
}

fn released(rt: &Runtime, within: Duration) -> Option<(Outcome, Instant)> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Some(RuntimeEvent::ProducerReleased { outcome, .. }) = rt.next_event(Duration::from_millis(20))
        {
            return Some((outcome, Instant::now()));
        }
    }
    None
}

#[test]
fn a_late_batch_holds_the_producer_until_the_transport_ends_it() {
    let (rt, wire) = streaming("late", Duration::from_millis(200), Duration::from_secs(30));
    // Well past write_timeout: late, counted, and still held.
    assert!(
        released(&rt, Duration::from_millis(900)).is_none(),
        "the producer released its source blocks while its write was still in the transport"
    );
    let s = rt.stats();
    assert_eq!(s.writes_late, 1, "{s:?}");
    assert_eq!(s.writes_abandoned, 0, "{s:?}");
    // The link heals: the write lands; the producer reports done.
    wire.hold(false);
    let (outcome, _) = released(&rt, Duration::from_secs(5)).expect("released once the batch ended");
    assert_eq!(outcome, Outcome::Done);
    assert_eq!(rt.stats().writes_failed, 0);
}

#[test]
fn a_batch_that_never_ends_is_given_up_after_the_quarantine() {
    let (rt, _wire) = streaming("never", Duration::from_millis(200), Duration::from_millis(600));
    let t0 = Instant::now();
    let (outcome, at) = released(&rt, Duration::from_secs(10)).expect("given up after the quarantine");
    let waited = at - t0;
    assert_eq!(outcome, Outcome::Failed);
    assert!(
        waited >= Duration::from_millis(700),
        "given up {waited:?} after submission: before write_timeout + quarantine (800 ms)"
    );
    let s = rt.stats();
    assert_eq!((s.writes_late, s.writes_abandoned), (1, 1), "{s:?}");
}

#[test]
fn nothing_is_written_under_an_expired_authorization() {
    // The consumer's deadline passed before the (stalled) producer got to it.
    let (rt, wire, req) = pair(
        "expired",
        2,
        Duration::from_secs(5),
        Duration::from_secs(5),
        |hs| {
            hs.expires_unix_ms = orbitkv::wire::unix_ms_now() - 1;
        },
    );
    rt.layer_ready(&req, 0, 0..2).unwrap();
    // The refused write may already have released the request by the time
    // `producer_finish` reaches the request directory: it is then unknown.
    match rt.producer_finish(&req) {
        Ok(()) | Err(orbitkv::RuntimeError::UnknownRequest(_)) => {}
        Err(e) => panic!("producer_finish: {e}"),
    }
    let (outcome, _) = released(&rt, Duration::from_secs(5)).expect("released");
    assert_eq!(outcome, Outcome::Failed);
    assert_eq!(
        wire.submits(),
        0,
        "a write was submitted after the consumer's deadline"
    );
}

#[test]
fn a_write_queued_past_the_deadline_is_not_submitted() {
    // Layer 0 is in flight (held by the double); layer 1 waits for the
    // per-peer range budget; the deadline passes; layer 0 ends.
    let (rt, wire, req) = pair(
        "queued",
        2,
        Duration::from_secs(5),
        Duration::from_secs(5),
        |hs| {
            hs.expires_unix_ms = orbitkv::wire::unix_ms_now() + 400;
        },
    );
    rt.layer_ready(&req, 0, 0..2).unwrap();
    rt.layer_ready(&req, 1, 0..2).unwrap();
    rt.producer_finish(&req).unwrap();
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(wire.submits(), 1, "layer 1 should be queued behind layer 0");
    wire.hold(false);
    let (outcome, _) = released(&rt, Duration::from_secs(5)).expect("released");
    assert_eq!(outcome, Outcome::Failed);
    assert_eq!(
        wire.submits(),
        1,
        "the queued layer was submitted after the deadline"
    );
}

/// `staging_pieces` `write` (the writer's gather, over host memory here):
/// a gathered piece is held while its batch is in the transport and goes
/// back when the batch ends; a piece whose batch was given up at the
/// quarantine while the transport still held it is kept out of the source
/// region for good, since the transport may still read it.
#[test]
fn a_gathered_piece_stays_out_of_the_region_while_the_transport_may_read_it() {
    const BLOCKS: u32 = 24;
    const BLOCK: u64 = 4096;
    // real memory: the lane copies from it (the double moves no byte)
    let kv = vec![7u8; (BLOCKS as u64 * BLOCK) as usize];
    let region = vec![0u8; 1 << 20];
    let layout = KvLayout::packed(kv.as_ptr() as u64, 1, BLOCKS, BLOCK, (0, 1), 1);
    let cfg = RuntimeConfig {
        write_timeout: Duration::from_millis(200),
        quarantine: Duration::from_millis(600),
        writer_lanes_per_peer: 1,
        source_staging_region: Some((region.as_ptr() as u64, region.len() as u64)),
        gather_in_writer: true,
        ..RuntimeConfig::default()
    };
    let (producer, wire, consumer) = orbitkv::testing::held_fake_pair(&layout, cfg);
    assert_eq!(
        producer.set_writer_gather(orbitkv::GatherCopy::Host).unwrap(),
        "memcpy"
    );
    let in_region = |r: &orbitkv::WriteRange| {
        r.src >= region.as_ptr() as u64 && r.src + r.len <= region.as_ptr() as u64 + region.len() as u64
    };
    // eleven blocks apart on prefill into one run on decode: one range
    let src: Vec<u32> = (0..11).map(|i| 2 * i).collect();
    let dst: Vec<u32> = (12..23).collect();
    let piece = 11 * BLOCK;
    for (name, ends) in [("ends", true), ("given-up", false)] {
        let req = RequestId::new(name);
        let hs = orbitkv::testing::open_both(&producer, &consumer, &req, &src, &dst);
        producer.producer_handshake(hs).unwrap();
        let before = wire.submits();
        producer.layer_ready(&req, 0, 0..11).unwrap();
        producer.producer_finish(&req).unwrap();
        wire.wait_submits(before + 1);
        let sent = wire.submitted();
        let last = sent.last().expect("a batch");
        assert!(
            in_region(last) && last.len == piece,
            "not written from one piece: {last:?}"
        );
        assert_eq!(
            producer.source_staging_in_use(),
            (piece, 1),
            "held while in the transport"
        );
        if ends {
            wire.hold(false);
            let (outcome, _) = released(&producer, Duration::from_secs(5)).expect("released");
            assert_eq!(outcome, Outcome::Done);
            assert_eq!(
                producer.source_staging_in_use(),
                (0, 0),
                "back once the batch ended"
            );
            wire.hold(true);
        } else {
            let (outcome, _) = released(&producer, Duration::from_secs(10)).expect("given up");
            assert_eq!(outcome, Outcome::Failed);
            assert_eq!(
                producer.source_staging_in_use(),
                (piece, 1),
                "never handed out again"
            );
        }
    }
    let s = producer.stats();
    assert_eq!((s.writes_gathered, s.gather_ranges_saved), (2, 20), "{s:?}");
    assert_eq!((s.writes_abandoned, s.gather_pieces_leaked), (1, 1), "{s:?}");
    drop((producer, consumer));
}
