//! Rule 2a (a notice is believed only with its authorization's tag) and rule
//! 10 (the cancel is a fence) against the real Mooncake engine on 127.0.0.1
//! and the real side channel (HTTP): the attack of issue 31 (a forged `done`
//! with the right request ID and generation), that of issue 44 (a `done`
//! tagged under the request's capability by the client that holds it) and
//! the cancelled streams of issue 32 (decode held its blocks for `timeout +
//! quarantine`).

use std::time::{Duration, Instant};

use orbitkv::side_channel::client::post;
use orbitkv::side_channel::CANCEL_PATH;
use orbitkv::testing::{
    block, capability as cap, host_rank, tagged_under_capability, wait_for, wait_released, HostRank as Rank,
};
use orbitkv::wire::{Fence, WIRE_VERSION};
use orbitkv::{
    Cancel, Capability, EngineConfig, MooncakeTransferEngine, Notice, NoticeKey, Outcome, ProducerRank,
    RequestId, RuntimeEvent, SideChannel, SideChannelConfig,
};

const GUARD: u8 = 0xA5;
const LAYERS: u32 = 3;
const BLOCKS: u32 = 8;
const BLOCK_BYTES: u64 = 2048;

fn rank(fill: impl Fn(usize) -> u8) -> Rank {
    host_rank(LAYERS, BLOCKS, BLOCK_BYTES, (0, 1), 2, fill)
}

fn src_pattern(i: usize) -> u8 {
    (i.wrapping_mul(17) % 253) as u8
}

fn stranger() -> Capability {
    Capability::parse(&"e".repeat(64)).expect("a valid capability")
}

fn serve(r: &Rank) -> SideChannel {
    SideChannel::start(SideChannelConfig::default(), r.runtime.clone()).expect("side channel")
}

/// Authorizes `blocks` of `consumer` for `req` and publishes the handshake to
/// prefill rank 0's side channel `side`.
fn open_and_publish(
    consumer: &Rank,
    side: &SideChannel,
    req: &RequestId,
    blocks: Vec<u32>,
) -> orbitkv::Handshake {
    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, blocks, 1)
        .unwrap();
    consumer
        .runtime
        .consumer_publish(&hs, vec![(side.address().to_string(), 0)])
        .unwrap();
    hs
}

/// The consumer's release of `req` (other events dropped), and when it came.
fn released(r: &Rank, req: &RequestId) -> Instant {
    wait_for(
        &r.runtime,
        "the consumer's release",
        |e| matches!(e, RuntimeEvent::ConsumerReleased { request, .. } if request == req),
    );
    Instant::now()
}

/// Waits (at most 10 s) until `f` holds.
fn eventually(what: &str, f: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "timed out waiting until {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Issue 31's attack: decode has authorized a request and the attacker,
/// who learnt its request ID and generation, sends `done` notices from a
/// Mooncake engine of its own: without a tag, with another key's tag, with
/// the right key's tag over other fields. None is believed (counted), the
/// consumer keeps waiting, and the request completes from the real
/// producer with the real bytes; nothing lands after the consumer's release.
#[test]
fn a_forged_done_notice_is_dropped_and_the_real_producer_completes_the_request() {
    let producer = rank(src_pattern);
    let consumer = rank(|_| GUARD);
    let req = RequestId::new("req-forged");
    let (src, dst) = (vec![0, 1, 2], vec![5, 3, 6]);
    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, dst.clone(), 1)
        .unwrap();

    let attacker = MooncakeTransferEngine::new(&EngineConfig::default()).unwrap();
    let forged = Notice {
        version: WIRE_VERSION,
        request_id: req.clone(),
        generation: hs.generation,
        producer_rank: ProducerRank(0),
        outcome: Outcome::Done,
        reason: None,
        bytes: 0,
        staged: false,
        mac: None,
    };
    let mut retagged = forged.clone().sign(&hs.notice_key);
    retagged.bytes = 1 << 30; // a tag over other fields
    for n in [
        forged.clone(),
        forged.clone().sign(&NoticeKey::random()),
        retagged,
    ] {
        attacker
            .send_notification(consumer.runtime.endpoint(), "orbitkv", &n.to_json())
            .unwrap();
    }
    eventually("the three forged notices were dropped", || {
        consumer.runtime.stats().notices_unauthenticated == 3
    });
    assert!(
        consumer.runtime.poll_events().is_empty(),
        "a forged notice moved the request"
    );
    assert!((0..LAYERS).all(|l| dst
        .iter()
        .all(|&b| block(&consumer, l, b).iter().all(|&x| x == GUARD))));

    // The real producer now writes every layer and notifies.
    producer
        .runtime
        .producer_open(req.clone(), src.clone(), cap(), 1)
        .unwrap();
    producer.runtime.producer_handshake_json(&hs.to_json()).unwrap();
    for l in 0..LAYERS {
        producer.runtime.layer_ready(&req, l, 0..3).unwrap();
    }
    producer.runtime.producer_finish(&req).unwrap();
    assert_eq!(wait_released(&producer.runtime, &req).0, Outcome::Done);
    let ev = wait_for(&consumer.runtime, "the consumer's outcome", |e| {
        matches!(
            e,
            RuntimeEvent::ConsumerCompleted { .. } | RuntimeEvent::ConsumerFailed { .. }
        )
    });
    let expected = LAYERS as u64 * 3 * BLOCK_BYTES;
    assert!(
        matches!(ev, RuntimeEvent::ConsumerCompleted { bytes, .. } if bytes == expected),
        "{ev:?}"
    );
    for l in 0..LAYERS {
        for (i, &d) in dst.iter().enumerate() {
            assert_eq!(
                block(&consumer, l, d),
                block(&producer, l, src[i]),
                "layer {l} block {d}"
            );
        }
    }
    consumer.runtime.consumer_release(&req).unwrap();
    released(&consumer, &req);
    // Nothing lands after the release: the producer released (every write
    // ended) before its notice, and a forged notice sent now changes nothing.
    let snapshot: Vec<u8> = consumer.mem.clone();
    attacker
        .send_notification(consumer.runtime.endpoint(), "orbitkv", &forged.to_json())
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(consumer.mem == snapshot, "bytes changed after the release");
    let s = consumer.runtime.stats();
    assert_eq!((s.notices_unauthenticated, s.consumers_completed), (3, 1));
    assert_eq!(consumer.runtime.live_requests(), (0, 0));
}

/// Issue 44's attack: the client sent both halves of the request itself, so
/// it holds the request's capability, and reaches decode's Mooncake port;
/// here it even knows the exact generation. While the real producer is
/// mid-request (layer 0 landed, layers 1 and 2 not yet written) it sends
/// `done`, `failed` and `aborted` tagged under the capability (the key of
/// issue 31's tags). None is believed (counted): the consumer keeps its
/// blocks, the request completes from the real producer with the real
/// bytes, and nothing lands after the consumer's release.
#[test]
fn a_done_tagged_under_the_capability_is_dropped_while_the_real_producer_writes() {
    let producer = rank(src_pattern);
    let consumer = rank(|_| GUARD);
    let req = RequestId::new("req-capability-holder");
    let (src, dst) = (vec![0, 1, 2], vec![6, 2, 4]);
    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, dst.clone(), 1)
        .unwrap();
    producer
        .runtime
        .producer_open(req.clone(), src.clone(), cap(), 1)
        .unwrap();
    producer.runtime.producer_handshake_json(&hs.to_json()).unwrap();
    producer.runtime.layer_ready(&req, 0, 0..3).unwrap();
    let landed = |l: u32| {
        dst.iter()
            .zip(&src)
            .all(|(&d, &s)| block(&consumer, l, d) == block(&producer, l, s))
    };
    eventually("layer 0 landed", || landed(0));

    let attacker = MooncakeTransferEngine::new(&EngineConfig::default()).unwrap();
    let forged = |outcome| {
        let n = Notice {
            version: WIRE_VERSION,
            request_id: req.clone(),
            generation: hs.generation,
            producer_rank: ProducerRank(0),
            outcome,
            reason: None,
            bytes: LAYERS as u64 * 3 * BLOCK_BYTES,
            staged: false,
            mac: None,
        };
        tagged_under_capability(n, &cap())
    };
    for outcome in [Outcome::Done, Outcome::Failed, Outcome::Aborted] {
        attacker
            .send_notification(consumer.runtime.endpoint(), "orbitkv", &forged(outcome).to_json())
            .unwrap();
    }
    eventually(
        "the three notices tagged under the capability were dropped",
        || consumer.runtime.stats().notices_unauthenticated == 3,
    );
    assert!(
        consumer.runtime.poll_events().is_empty(),
        "a notice tagged under the capability moved the request"
    );
    assert_eq!(consumer.runtime.live_requests(), (1, 0));
    assert!((1..LAYERS).all(|l| dst
        .iter()
        .all(|&b| block(&consumer, l, b).iter().all(|&x| x == GUARD))));

    // The real producer writes the other layers and notifies.
    for l in 1..LAYERS {
        producer.runtime.layer_ready(&req, l, 0..3).unwrap();
    }
    producer.runtime.producer_finish(&req).unwrap();
    assert_eq!(wait_released(&producer.runtime, &req).0, Outcome::Done);
    let ev = wait_for(&consumer.runtime, "the consumer's outcome", |e| {
        matches!(
            e,
            RuntimeEvent::ConsumerCompleted { .. } | RuntimeEvent::ConsumerFailed { .. }
        )
    });
    let expected = LAYERS as u64 * 3 * BLOCK_BYTES;
    assert!(
        matches!(ev, RuntimeEvent::ConsumerCompleted { bytes, .. } if bytes == expected),
        "{ev:?}"
    );
    assert!(
        (0..LAYERS).all(landed),
        "the real producer's bytes are not all in place"
    );
    assert_eq!(producer.runtime.stats().bytes_written, expected);
    consumer.runtime.consumer_release(&req).unwrap();
    released(&consumer, &req);
    // Nothing lands after the release: the producer released (every write
    // ended) before its notice, and another forged `done` now changes
    // nothing (no route: dropped as for an unknown request).
    let snapshot: Vec<u8> = consumer.mem.clone();
    attacker
        .send_notification(
            consumer.runtime.endpoint(),
            "orbitkv",
            &forged(Outcome::Done).to_json(),
        )
        .unwrap();
    eventually("the late forgery was dropped", || {
        consumer.runtime.stats().notices_unknown_request == 1
    });
    std::thread::sleep(Duration::from_millis(50));
    assert!(consumer.mem == snapshot, "bytes changed after the release");
    let s = consumer.runtime.stats();
    assert_eq!(
        (s.notices_unauthenticated, s.notices_routed, s.consumers_completed),
        (3, 4, 1)
    );
    assert_eq!(consumer.runtime.live_requests(), (0, 0));
}

/// Issue 32: the client went away after decode authorized its blocks and
/// before prefill scheduled the request. vLLM releases the consumer; its
/// fence reaches the prefill's side channel, which answers `fenced` (no
/// producer holds the generation, and the cancel is remembered against a
/// later open): the blocks go back at once, not at `timeout + quarantine`
/// (20 + 60 s here). The producer opened later is aborted at once and
/// writes nothing.
#[test]
fn a_consumer_released_before_its_producer_opened_is_fenced_at_once() {
    let producer = rank(src_pattern);
    let consumer = rank(|_| GUARD);
    let side = serve(&producer);
    let req = RequestId::new("req-cancelled-early");
    open_and_publish(&consumer, &side, &req, vec![1, 2]);
    // The handshake is parked on prefill (nothing opened there yet).
    std::thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    consumer.runtime.consumer_release(&req).unwrap();
    let at = released(&consumer, &req);
    assert!(
        at - t0 < Duration::from_secs(5),
        "released {:?} after vLLM's release: waited for the deadline",
        at - t0
    );
    let s = consumer.runtime.stats();
    assert_eq!((s.fences_sent, s.ranks_fenced), (1, 1));

    // Prefill schedules the request only now: aborted at once, nothing written.
    producer
        .runtime
        .producer_open(req.clone(), vec![0, 1], cap(), 1)
        .unwrap();
    let (outcome, why) = wait_released(&producer.runtime, &req);
    assert_eq!(outcome, Outcome::Aborted, "{why:?}");
    producer.runtime.layer_ready(&req, 0, 0..2).unwrap_err();
    assert_eq!(producer.runtime.stats().bytes_written, 0);
    assert!((0..LAYERS).all(|l| (0..BLOCKS).all(|b| block(&consumer, l, b).iter().all(|&x| x == GUARD))));
}

/// A fence while the producer holds the generation: the consumer frees its
/// blocks long before the deadline, and nothing after the fence is written.
/// Which answer the producer gives depends on a race over real Mooncake:
/// `notice_follows` when the fence finds it still holding the generation
/// (its layer-0 write not yet reported ended, so the cancel's abort could
/// not release it): the consumer then waits for its `aborted` notice; or
/// `fenced` when the abort already released it (the write had ended): the
/// rank ends at the answer, and the `aborted` notice that follows changes
/// nothing (routed, or dropped once the consumer has ended). Both answers are checked to be consistent;
/// each is pinned deterministically by the machine's tests
/// (`fsm::producer::tests::rule10_*`).
#[test]
fn a_fence_of_a_producer_holding_the_generation_frees_at_its_notice() {
    let producer = rank(src_pattern);
    let consumer = rank(|_| GUARD);
    let side = serve(&producer);
    let req = RequestId::new("req-cancelled-mid-stream");
    producer
        .runtime
        .producer_open(req.clone(), vec![0, 1], cap(), 1)
        .unwrap();
    open_and_publish(&consumer, &side, &req, vec![4, 5]);
    producer.runtime.layer_ready(&req, 0, 0..2).unwrap();
    eventually("layer 0 landed", || {
        block(&consumer, 0, 4) == block(&producer, 0, 0) && block(&consumer, 0, 5) == block(&producer, 0, 1)
    });
    let t0 = Instant::now();
    consumer.runtime.consumer_release(&req).unwrap();
    let at = released(&consumer, &req);
    assert!(at - t0 < Duration::from_secs(5), "released after {:?}", at - t0);
    assert_eq!(wait_released(&producer.runtime, &req).0, Outcome::Aborted);
    let s = consumer.runtime.stats();
    // Asked once; either answered `notice_follows` (the tagged notice ended
    // the rank) or `fenced` (the answer did).
    assert_eq!(s.fences_sent, 1);
    assert!(s.ranks_fenced <= 1, "{s:?}");
    // The `aborted` notice arrives in both. With `notice_follows` it ended
    // the rank, so it was routed. With `fenced` the answer ended the rank and
    // the consumer may be gone before the notice comes (the HTTP answer and
    // Mooncake's notification race): routed, or dropped as for an ended
    // request; either way it changes nothing.
    eventually("the producer's aborted notice arrived", || {
        let s = consumer.runtime.stats();
        s.notices_routed + s.notices_unknown_request == 1
    });
    let s = consumer.runtime.stats();
    if s.ranks_fenced == 0 {
        assert_eq!(s.notices_routed, 1, "{s:?}");
    }
    // Layers 1 and 2 were never written.
    assert!((1..LAYERS).all(|l| [4, 5]
        .iter()
        .all(|&b| block(&consumer, l, b).iter().all(|&x| x == GUARD))));
}

/// The fence's answers over HTTP, and the cancel's `403`: for an ended
/// request the side channel knows the capability, so a stranger's cancel is
/// refused (it was `200` before); the right one is answered `fenced`.
#[test]
fn a_cancel_for_an_ended_request_is_answered_and_a_strangers_is_forbidden() {
    let producer = rank(src_pattern);
    let consumer = rank(|_| GUARD);
    let side = serve(&producer);
    let addr = side.address().to_string();
    let req = RequestId::new("req-ended");
    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, vec![1], 1)
        .unwrap();
    producer
        .runtime
        .producer_open(req.clone(), vec![2], cap(), 1)
        .unwrap();
    producer.runtime.producer_handshake_json(&hs.to_json()).unwrap();
    for l in 0..LAYERS {
        producer.runtime.layer_ready(&req, l, 0..1).unwrap();
    }
    producer.runtime.producer_finish(&req).unwrap();
    assert_eq!(wait_released(&producer.runtime, &req).0, Outcome::Done);

    let timeout = Duration::from_secs(5);
    let fence = |c: &Capability| {
        Cancel::new(req.clone(), c.clone(), "late")
            .fencing(hs.generation, 0)
            .to_json()
    };
    let (status, body) = post(&addr, CANCEL_PATH, &fence(&stranger()), None, timeout).unwrap();
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("ForbiddenError"), "{body}");
    let (status, body) = post(&addr, CANCEL_PATH, &fence(&cap()), None, timeout).unwrap();
    assert_eq!(
        (status, Fence::from_reply(&body)),
        (200, Some(Fence::Fenced)),
        "{body}"
    );
    // A plain cancel (no generation) for it: accepted, no answer to give.
    let plain = Cancel::new(req.clone(), cap(), "late").to_json();
    let (status, body) = post(&addr, CANCEL_PATH, &plain, None, timeout).unwrap();
    assert_eq!((status, Fence::from_reply(&body)), (200, None), "{body}");
    // An unknown request's cancel is remembered under its capability
    // (it may precede its open): answered, nothing to refuse it by.
    let unknown = Cancel::new(RequestId::new("nobody"), stranger(), "x")
        .fencing(hs.generation, 0)
        .to_json();
    let (status, body) = post(&addr, CANCEL_PATH, &unknown, None, timeout).unwrap();
    assert_eq!(
        (status, Fence::from_reply(&body)),
        (200, Some(Fence::Fenced)),
        "{body}"
    );
    assert_eq!(side.refused().forbidden, 1);
}
