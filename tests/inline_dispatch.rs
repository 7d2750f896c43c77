//! A layer handed over on the caller's thread (`actors::prefill::producer`: the
//! producer actor's `LayerReady` run inline when nothing sent to it before
//! is unhandled; `actors::prefill::writer`: the write submitted inline when its lane
//! is idle, the write waits for no mark and is small enough).
//!
//! Over the transport test double (`FakeTransport`, which counts submits
//! and can hold completions) for what must happen on which path, and over
//! the real Mooncake engine on 127.0.0.1 for the bytes and for the order of
//! a chunk's added blocks and its layers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use orbitkv::actors::prefill::gate::{GateCall, Mark};
use orbitkv::testing::{block, capability as cap, host_rank, wait_for, wait_released, FakeTransport};
use orbitkv::{KvLayout, Outcome, RequestId, Runtime, RuntimeConfig, RuntimeEvent};

const LAYERS: u32 = 2;
const BLOCKS: u32 = 16;
const BLOCK: u64 = 4096;

/// A producer and a consumer runtime over transport doubles (fake
/// addresses: nothing is touched), with `cfg`.
struct Doubles {
    producer: Runtime,
    consumer: Runtime,
    p_transport: Arc<FakeTransport>,
}

fn doubles(cfg: RuntimeConfig) -> Doubles {
    let p_transport = Arc::new(FakeTransport::new("127.0.0.1:20001"));
    let c_transport = Arc::new(FakeTransport::new("127.0.0.1:20002"));
    let layout = |base| KvLayout::packed(base, LAYERS, BLOCKS, BLOCK, (0, 1), 2);
    Doubles {
        producer: Runtime::start(p_transport.clone(), layout(0x1000_0000), cfg.clone()).unwrap(),
        consumer: Runtime::start(c_transport, layout(0x2000_0000), cfg).unwrap(),
        p_transport,
    }
}

impl Doubles {
    /// `req` open on both sides (request blocks `0..n`, scattered so that
    /// a layer is `n` ranges), its handshake admitted.
    fn open(&self, req: &RequestId, n: u32) {
        let dst: Vec<u32> = (0..n).map(|b| (b * 2) % BLOCKS).collect();
        let src: Vec<u32> = (0..n).map(|b| BLOCKS - 1 - b * 2 % BLOCKS).collect();
        let hs = self
            .consumer
            .consumer_open(req.clone(), cap(), 0, dst, 1)
            .unwrap();
        self.producer.producer_open(req.clone(), src, cap(), 1).unwrap();
        self.producer.producer_handshake(hs).unwrap();
    }
}

fn settle(done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Hands layers of `req` over one at a time, each after a pause (the
/// runtime idle), until one is submitted inside the `layer_ready` call;
/// how many were.
fn until_one_is_submitted_inline(d: &Doubles, req: &RequestId, blocks: std::ops::Range<u32>) -> u32 {
    for attempt in 0..50u32 {
        std::thread::sleep(Duration::from_millis(20));
        let (before, written) = (d.p_transport.submits(), d.producer.stats().layers_written);
        d.producer
            .layer_ready(req, attempt % LAYERS, blocks.clone())
            .unwrap();
        let inline = d.p_transport.submits() > before;
        settle(|| d.producer.stats().layers_written > written);
        if inline {
            return attempt + 1;
        }
    }
    panic!("no layer was submitted inside its layer_ready call in 50 tries");
}

#[test]
fn an_idle_runtime_submits_the_layer_before_layer_ready_returns() {
    let d = doubles(RuntimeConfig::default());
    let req = RequestId::new("inline-1");
    d.open(&req, 4);
    let tries = until_one_is_submitted_inline(&d, &req, 0..4);
    let s = d.producer.stats();
    assert!(s.writes_inline >= 1 && s.layers_ready_inline >= 1, "{s:?}");
    assert_eq!(s.layers_written, u64::from(tries));
    for layer in 0..LAYERS {
        d.producer.layer_ready(&req, layer, 0..4).unwrap();
    }
    d.producer.producer_finish(&req).unwrap();
    let (done, why) = wait_released(&d.producer, &req);
    assert_eq!(done, Outcome::Done, "{why:?}");
    assert_eq!(d.producer.live_requests(), (0, 0));
    // the producer idle when a write ended: the lane that saw the end fed
    // it into the machine itself, no message to the system thread (one walk)
    let s = d.producer.stats();
    assert!(s.writes_reported_inline >= 1, "{s:?}");
    assert!(s.writes_reported_inline <= s.layers_written, "{s:?}");
}

#[test]
fn with_inline_submits_off_every_write_goes_to_its_lane() {
    let d = doubles(RuntimeConfig {
        inline_submit_max_ranges: 0,
        ..RuntimeConfig::default()
    });
    let req = RequestId::new("inline-off");
    d.open(&req, 4);
    for k in 0..10 {
        std::thread::sleep(Duration::from_millis(5));
        d.producer.layer_ready(&req, k % LAYERS, 0..4).unwrap();
    }
    settle(|| d.producer.stats().layers_written == 10);
    assert_eq!(d.producer.stats().writes_inline, 0);
}

#[test]
fn a_write_larger_than_the_inline_limit_goes_to_its_lane() {
    let d = doubles(RuntimeConfig {
        inline_submit_max_ranges: 3,
        ..RuntimeConfig::default()
    });
    let req = RequestId::new("inline-big");
    d.open(&req, 4); // 4 scattered blocks: 4 ranges a layer
    for k in 0..10 {
        std::thread::sleep(Duration::from_millis(5));
        d.producer.layer_ready(&req, k % LAYERS, 0..4).unwrap();
    }
    settle(|| d.producer.stats().layers_written == 10);
    assert_eq!(d.producer.stats().writes_inline, 0, "4 ranges > 3");
    // Three blocks are three ranges: within the limit.
    until_one_is_submitted_inline(&d, &req, 0..3);
}

#[test]
fn a_busy_lane_queues_the_write_and_sends_it_when_the_budget_frees() {
    // One lane, room for one layer's ranges in flight.
    let d = doubles(RuntimeConfig {
        writer_lanes_per_peer: 1,
        max_ranges_in_flight_per_peer: Some(4),
        ..RuntimeConfig::default()
    });
    let req = RequestId::new("inline-busy");
    d.open(&req, 4);
    d.p_transport.hold(true);
    d.producer.layer_ready(&req, 0, 0..4).unwrap();
    settle(|| d.p_transport.submits() == 1);
    d.producer.layer_ready(&req, 1, 0..4).unwrap();
    // The second waits in the lane's queue (taken by the lane, not begun),
    // whichever thread it came on: nothing more was submitted.
    settle(|| d.producer.writes_queued() == 1);
    assert_eq!(d.p_transport.submits(), 1);
    d.p_transport.hold(false);
    settle(|| d.producer.stats().layers_written == 2);
    assert_eq!(d.p_transport.submits(), 2);
}

#[test]
fn a_layer_after_an_answered_finish_is_not_written() {
    let d = doubles(RuntimeConfig::default());
    let req = RequestId::new("inline-finish");
    d.open(&req, 4);
    d.p_transport.hold(true);
    d.producer.layer_ready(&req, 0, 0..4).unwrap();
    d.producer.producer_finish(&req).unwrap();
    // The finish is queued to the actor (counted): this layer goes behind
    // it, never inline ahead of it, and the machine drops it; the request
    // fails for the layer it never saved.
    d.producer.layer_ready(&req, 1, 0..4).unwrap();
    d.p_transport.hold(false);
    let (outcome, why) = wait_released(&d.producer, &req);
    assert_eq!(outcome, Outcome::Failed);
    assert!(
        why.as_deref()
            .is_some_and(|r| r.contains("without saving layer 1")),
        "{why:?}"
    );
    assert_eq!(d.p_transport.submits(), 1, "layer 1 was not written");
}

/// A mark the test reaches by hand (a stand-in for a CUDA event); it says
/// when a lane begins to wait for it.
struct Hand(crossbeam_channel::Receiver<()>, crossbeam_channel::Sender<()>);

impl Mark for Hand {
    fn wait(&mut self) -> Result<(), String> {
        let _ = self.1.send(());
        self.0
            .recv_timeout(Duration::from_secs(30))
            .map_err(|_| "never reached".to_string())
    }
}

#[test]
fn a_layer_behind_a_mark_is_planned_here_but_submitted_only_by_its_lane_after_the_mark() {
    let d = doubles(RuntimeConfig::default());
    let req = RequestId::new("inline-mark");
    d.open(&req, 4);
    let (reach, rx) = crossbeam_channel::bounded(1);
    let (entered_tx, entered) = crossbeam_channel::bounded(1);
    d.producer.layers_ready_after(
        Some(Box::new(Hand(rx, entered_tx))),
        vec![GateCall::Ready {
            request: req.clone(),
            layer: 0,
            blocks: 0..4,
        }],
    );
    // The write reached a lane, which now waits for the mark before it
    // submits anything.
    entered
        .recv_timeout(Duration::from_secs(10))
        .expect("a lane waits for the mark");
    assert_eq!(d.p_transport.submits(), 0, "written before its mark");
    reach.send(()).unwrap();
    settle(|| d.producer.stats().layers_written == 1);
    assert_eq!(d.producer.stats().writes_inline, 0);
}

#[test]
fn a_layer_of_an_unknown_request_is_refused_by_the_directory() {
    let d = doubles(RuntimeConfig::default());
    let err = d
        .producer
        .layer_ready(&RequestId::new("nobody"), 0, 0..1)
        .unwrap_err();
    assert!(matches!(err, orbitkv::RuntimeError::UnknownRequest(_)), "{err:?}");
    let refused = d
        .producer
        .layers_ready(0, vec![(RequestId::new("nobody"), 0..1)])
        .unwrap();
    assert_eq!(refused.len(), 1);
}

/// Real Mooncake: chunked prefill's order, many times over — each chunk's
/// blocks are added (answered) and then its layers handed over at once, so
/// a layer planned before the group's source list grew would fail to plan.
/// Every byte lands, nothing fails, nothing is held after.
#[test]
fn added_blocks_are_always_there_for_the_layers_after_them_and_the_bytes_land() {
    const GUARD: u8 = 0xA5;
    let producer = host_rank(LAYERS, BLOCKS, BLOCK, (0, 1), 2, |i| (i % 251) as u8);
    let consumer = host_rank(LAYERS, BLOCKS, BLOCK, (0, 1), 2, |_| GUARD);
    for round in 0..20u32 {
        let req = RequestId::new(format!("chunks-{round}"));
        let dst: Vec<u32> = (0..8).map(|b| (b * 2 + round) % BLOCKS).collect();
        let src: Vec<u32> = (0..8).map(|b| (BLOCKS - 1 - b + round) % BLOCKS).collect();
        let hs = orbitkv::testing::open_both(&producer.runtime, &consumer.runtime, &req, &src[..2], &dst);
        producer.runtime.producer_handshake(hs).unwrap();
        for chunk in 0..4u32 {
            let blocks = chunk * 2..chunk * 2 + 2;
            if chunk > 0 {
                let new = src[blocks.start as usize..blocks.end as usize].to_vec();
                producer.runtime.producer_add_blocks(&req, new).unwrap();
            }
            for layer in 0..LAYERS {
                producer.runtime.layer_ready(&req, layer, blocks.clone()).unwrap();
            }
        }
        producer.runtime.producer_finish(&req).unwrap();
        let (done, why) = wait_released(&producer.runtime, &req);
        assert_eq!(done, Outcome::Done, "{why:?}");
        wait_for(
            &consumer.runtime,
            "complete",
            |e| matches!(e, RuntimeEvent::ConsumerCompleted { request, .. } if *request == req),
        );
        for layer in 0..LAYERS {
            for (i, (&s, &t)) in src.iter().zip(&dst).enumerate() {
                assert_eq!(
                    block(&producer, layer, s),
                    block(&consumer, layer, t),
                    "round {round} block {i}"
                );
            }
        }
        consumer.runtime.consumer_release(&req).unwrap();
        wait_for(&consumer.runtime, "released", |e| {
            matches!(e, RuntimeEvent::ConsumerReleased { .. })
        });
    }
    let s = producer.runtime.stats();
    assert_eq!(s.writes_failed, 0);
    assert!(s.layers_ready_inline > 0, "the inline path ran: {s:?}");
    assert_eq!(producer.runtime.live_requests(), (0, 0));
    assert_eq!(consumer.runtime.live_requests(), (0, 0));
}
