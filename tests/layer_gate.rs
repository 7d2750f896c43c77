//! The layer gate (`orbitkv::actors::prefill::gate`, `Runtime::layers_ready_after`)
//! against the real Mooncake engine on 127.0.0.1: a layer handed over with a
//! mark is not written before the mark is reached (its layer writer waits),
//! the request's finish waits for its layers, a mark that fails fails the
//! request without writing the layer, and a mark nobody needs does not stop
//! later ones.
//!
//! The marks here are a test double (a channel the test opens); on a GPU
//! they are CUDA events (`transport::cuda`), which CI cannot record.

use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};
use orbitkv::actors::prefill::gate::{GateCall, Mark};
use orbitkv::{Outcome, RequestId, Runtime, RuntimeEvent};

use orbitkv::testing::{block, host_rank as rank, HostRank as Rank};

const GUARD: u8 = 0xA5;

fn next(rt: &Runtime, within: Duration) -> Option<RuntimeEvent> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Some(ev) = rt.next_event(Duration::from_millis(50)) {
            return Some(ev);
        }
    }
    None
}

/// A mark the test reaches by hand (a stand-in for a CUDA event).
struct Hand(Receiver<Result<(), String>>);

impl Mark for Hand {
    fn wait(&mut self) -> Result<(), String> {
        self.0
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| Err("never reached".into()))
    }
}

fn hand() -> (Sender<Result<(), String>>, Box<dyn Mark>) {
    let (tx, rx) = bounded(1);
    (tx, Box::new(Hand(rx)))
}

fn ready(req: &RequestId, layer: u32, n: u32) -> GateCall {
    GateCall::Ready {
        request: req.clone(),
        layer,
        blocks: 0..n,
    }
}

/// A producer and a consumer rank (2 layers of 8 blocks of 4 KiB), request
/// `req` opened on both (`src` → `dst`) and the handshake admitted.
fn pair(req: &RequestId, src: &[u32], dst: &[u32]) -> (Rank, Rank, orbitkv::Handshake) {
    let producer = rank(2, 8, 4096, (0, 1), 2, |i| (i % 127) as u8);
    let consumer = rank(2, 8, 4096, (0, 1), 2, |_| GUARD);
    let hs = orbitkv::testing::open_both(&producer.runtime, &consumer.runtime, req, src, dst);
    producer.runtime.producer_handshake_json(&hs.to_json()).unwrap();
    (producer, consumer, hs)
}

#[test]
fn layers_are_written_only_after_their_mark_and_the_finish_waits_for_them() {
    let (layers, blocks, bb) = (2, 8, 4096);
    let req = RequestId::new("gate-1");
    let (src, dst) = (vec![1, 2, 3], vec![6, 4, 0]);
    let (producer, consumer, hs) = pair(&req, &src, &dst);

    let rt = &producer.runtime;
    let (reach0, mark0) = hand();
    let (reach1, mark1) = hand();
    rt.layers_ready_after(Some(mark0), vec![ready(&req, 0, 3)]);
    rt.layers_ready_after(Some(mark1), vec![ready(&req, 1, 3)]);
    rt.layers_ready_after(None, vec![GateCall::Finish { request: req.clone() }]);

    // Nothing is admitted, so nothing is written, before the marks.
    assert_eq!(next(&consumer.runtime, Duration::from_millis(300)), None);
    assert_eq!(producer.runtime.stats().bytes_written, 0);
    for l in 0..layers {
        for &b in &dst {
            assert!(
                block(&consumer, l, b).iter().all(|&x| x == GUARD),
                "layer {l} block {b}"
            );
        }
    }

    // Layer 0 only: written, but the request is not complete (the finish
    // waits behind layer 1's mark).
    reach0.send(Ok(())).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while producer.runtime.stats().bytes_written < 3 * bb && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(producer.runtime.stats().bytes_written, 3 * bb);
    assert_eq!(next(&consumer.runtime, Duration::from_millis(200)), None);

    reach1.send(Ok(())).unwrap();
    let ev = next(&consumer.runtime, Duration::from_secs(20)).expect("an outcome");
    assert_eq!(
        ev,
        RuntimeEvent::ConsumerCompleted {
            request: req.clone(),
            generation: hs.generation,
            bytes: layers as u64 * 3 * bb,
            staged: None,
        }
    );
    for l in 0..layers {
        for (i, &b) in dst.iter().enumerate() {
            assert_eq!(
                block(&consumer, l, b),
                block(&producer, l, src[i]),
                "layer {l} block {b}"
            );
        }
        for b in (0..blocks).filter(|b| !dst.contains(b)) {
            assert!(
                block(&consumer, l, b).iter().all(|&x| x == GUARD),
                "layer {l} block {b} touched"
            );
        }
    }
    let s = producer.runtime.stats();
    assert_eq!(s.ready_items, 2, "two marks reached");
    assert_eq!(producer.runtime.layer_marks().outstanding(), 0);
    assert!(s.ready_lag_micros >= 300_000, "the lag counts the wait: {s:?}");
    assert!(s.write_batches >= 2 && s.layer_write_micros > 0, "{s:?}");
}

/// The GPU's lag after vLLM's finish, as the producer times it: the finish
/// is handed over when the last step was *launched* (the gate's marks not
/// reached), so a request authorized early still holds its pages until the
/// GPU computed its last layer; `computed_after_finish` times that part,
/// `sent_after_finish` and `written_after_finish` follow it.
#[test]
fn the_gpus_lag_after_the_finish_is_timed_as_computed_after_finish() {
    let req = RequestId::new("gate-lag");
    let (producer, consumer, _hs) = pair(&req, &[1, 2], &[3, 4]);
    let rt = &producer.runtime;
    let (reach0, mark0) = hand();
    let (reach1, mark1) = hand();
    rt.layers_ready_after(Some(mark0), vec![ready(&req, 0, 2)]);
    rt.layers_ready_after(Some(mark1), vec![ready(&req, 1, 2)]);
    rt.layers_ready_after(None, vec![GateCall::Finish { request: req.clone() }]);
    // the GPU reaches layer 0 at once, layer 1 about 80 ms after the finish
    reach0.send(Ok(())).unwrap();
    std::thread::sleep(Duration::from_millis(80));
    reach1.send(Ok(())).unwrap();
    let ev = next(&consumer.runtime, Duration::from_secs(20)).expect("an outcome");
    assert!(matches!(ev, RuntimeEvent::ConsumerCompleted { .. }), "{ev:?}");
    let timings = rt.take_timings();
    let of = |w: orbitkv::Timing| {
        let v = &timings
            .iter()
            .find(|(x, _)| *x == w)
            .expect("every timing listed")
            .1;
        assert_eq!(v.len(), 1, "{w:?} once: {timings:?}");
        v[0]
    };
    let (shaken, computed, sent, written) = (
        of(orbitkv::Timing::HandshakeAfterFinish),
        of(orbitkv::Timing::ComputedAfterFinish),
        of(orbitkv::Timing::SentAfterFinish),
        of(orbitkv::Timing::WrittenAfterFinish),
    );
    assert_eq!(shaken, 0, "decode authorized before the finish: {timings:?}");
    // The finish is stamped when the producer actor handles it, a little
    // after the call above returned (79 ms was seen on a busy 2-core
    // machine); a lane's admission time instead would give 0 (the writes
    // were admitted at the launch, before the finish).
    assert!(
        computed >= 50_000 && computed <= sent && sent <= written,
        "{timings:?}"
    );
}

#[test]
fn a_mark_that_fails_aborts_its_requests_and_writes_nothing_of_that_layer() {
    let layers = 2;
    let req = RequestId::new("gate-2");
    let dst = vec![3, 5];
    let (producer, consumer, _hs) = pair(&req, &[0, 1], &dst);

    let rt = &producer.runtime;
    let (reach, mark) = hand();
    rt.layers_ready_after(Some(mark), vec![ready(&req, 0, 2)]);
    rt.layers_ready_after(None, vec![GateCall::Finish { request: req.clone() }]);
    reach
        .send(Err("CUDA error 700 (an illegal memory access)".into()))
        .unwrap();

    match next(&consumer.runtime, Duration::from_secs(20)) {
        Some(RuntimeEvent::ConsumerFailed { request, .. }) => assert_eq!(request, req),
        other => panic!("expected the consumer to fail, got {other:?}"),
    }
    match next(&producer.runtime, Duration::from_secs(10)) {
        Some(RuntimeEvent::ProducerReleased { outcome, .. }) => assert_ne!(outcome, Outcome::Done),
        other => panic!("expected the producer released, got {other:?}"),
    }
    assert_eq!(producer.runtime.stats().bytes_written, 0);
    for l in 0..layers {
        for &b in &dst {
            assert!(
                block(&consumer, l, b).iter().all(|&x| x == GUARD),
                "layer {l} block {b}"
            );
        }
    }
    consumer.runtime.consumer_release(&req).unwrap();
}

#[test]
fn a_mark_nobody_needs_is_waited_for_in_turn_and_later_layers_are_written() {
    // The first step's only request was never opened (released meanwhile):
    // nobody waits for its mark, so the next write waits for both, in order.
    let req = RequestId::new("gate-3");
    let dst = vec![7, 2];
    let (producer, consumer, hs) = pair(&req, &[4, 5], &dst);
    let rt = &producer.runtime;
    let gone = RequestId::new("never-opened");
    let (reach0, mark0) = hand();
    let (reach1, mark1) = hand();
    let (reach2, mark2) = hand();
    rt.layers_ready_after(Some(mark0), vec![ready(&gone, 0, 1)]);
    rt.layers_ready_after(Some(mark1), vec![ready(&req, 0, 2)]);
    rt.layers_ready_after(Some(mark2), vec![ready(&req, 1, 2)]);
    rt.layers_ready_after(None, vec![GateCall::Finish { request: req.clone() }]);
    // Layer 0's writer waits for mark 1, and so first for mark 0.
    reach1.send(Ok(())).unwrap();
    assert_eq!(next(&consumer.runtime, Duration::from_millis(300)), None);
    assert_eq!(
        rt.stats().bytes_written,
        0,
        "not written before mark 0 was judged"
    );
    reach0.send(Ok(())).unwrap();
    reach2.send(Ok(())).unwrap();
    match next(&consumer.runtime, Duration::from_secs(20)) {
        Some(RuntimeEvent::ConsumerCompleted {
            request, generation, ..
        }) => {
            assert_eq!((request, generation), (req.clone(), hs.generation))
        }
        other => panic!("expected the request complete, got {other:?}"),
    }
    for l in 0..2 {
        assert_eq!(block(&consumer, l, 7), block(&producer, l, 4), "layer {l}");
        assert_eq!(block(&consumer, l, 2), block(&producer, l, 5), "layer {l}");
    }
    assert_eq!(rt.layer_marks().reached(), 3);
    assert_eq!(rt.stats().ready_items, 3);
    consumer.runtime.consumer_release(&req).unwrap();
}

/// A mark that says when a writer starts waiting for it, then waits for
/// the test to reach it.
struct Announced {
    waiting: Sender<()>,
    reach: Receiver<Result<(), String>>,
}

impl Mark for Announced {
    fn wait(&mut self) -> Result<(), String> {
        let _ = self.waiting.send(());
        self.reach
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| Err("never reached".into()))
    }
}

/// Under load a writer lane waits for the GPU to write the next step's
/// layer (its mark) before it submits it, blocked, for as long as the GPU
/// lags behind the worker. A request whose writes all ended sends its
/// notice meanwhile: the notice must not queue behind that wait (before,
/// notices went to lane 0, the lane this test blocks, and decode learnt the
/// KV was in place only once the other request's mark was reached).
#[test]
fn a_finished_requests_notice_does_not_wait_behind_a_lane_blocked_on_the_gpu() {
    let blocked = RequestId::new("gate-blocked");
    let done = RequestId::new("gate-done");
    let (producer, consumer, _) = pair(&blocked, &[1, 2], &[3, 4]);
    let rt = &producer.runtime;
    let hs = orbitkv::testing::open_both(rt, &consumer.runtime, &done, &[5, 6], &[0, 7]);
    rt.producer_handshake(hs.clone()).unwrap();
    // the pool's first write (lane 0): its writer blocks on the mark
    let (waiting_tx, waiting) = bounded(1);
    let (reach, reach_rx) = bounded(1);
    rt.layers_ready_after(
        Some(Box::new(Announced {
            waiting: waiting_tx,
            reach: reach_rx,
        })),
        vec![ready(&blocked, 0, 2)],
    );
    waiting
        .recv_timeout(Duration::from_secs(10))
        .expect("a writer waits for the mark");
    // the other request's layers go to free lanes, one at a time, and end
    for l in 0..2 {
        let before = rt.stats().bytes_written;
        rt.layer_ready(&done, l, 0..2).unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        while rt.stats().bytes_written == before {
            assert!(
                Instant::now() < until,
                "layer {l} of the free request not written"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    rt.producer_finish(&done).unwrap();
    match next(&consumer.runtime, Duration::from_secs(5)) {
        Some(RuntimeEvent::ConsumerCompleted {
            request, generation, ..
        }) => assert_eq!((request, generation), (done.clone(), hs.generation)),
        other => panic!("the finished request's notice waited behind the blocked lane: {other:?}"),
    }
    for l in 0..2 {
        assert_eq!(block(&consumer, l, 0), block(&producer, l, 5), "layer {l}");
        assert_eq!(block(&consumer, l, 7), block(&producer, l, 6), "layer {l}");
    }
    // the blocked request goes on once its mark is reached
    reach.send(Ok(())).unwrap();
    rt.layers_ready_after(
        None,
        vec![
            ready(&blocked, 1, 2),
            GateCall::Finish {
                request: blocked.clone(),
            },
        ],
    );
    match next(&consumer.runtime, Duration::from_secs(20)) {
        Some(RuntimeEvent::ConsumerCompleted { request, .. }) => assert_eq!(request, blocked),
        other => panic!("expected the blocked request complete, got {other:?}"),
    }
    consumer.runtime.consumer_release(&done).unwrap();
    consumer.runtime.consumer_release(&blocked).unwrap();
}

/// A writer lane whose front write waits for the GPU does not wait with it:
/// it parks and keeps taking writes. Under load the GPU runs a step or more
/// behind the worker, and a request whose prefill already ran (decode
/// authorized it late) hands its layers to a lane that may be waiting for
/// another request's next layer. Before, the lane blocked on that mark on
/// its own thread, and the late request's writes, arriving meanwhile, sat
/// in its inbox until the GPU reached the mark; now they are written while
/// the mark is still not reached. One lane, so both requests share it.
#[test]
fn a_write_that_reaches_a_lane_waiting_for_the_gpu_is_written_at_once() {
    late_write_behind_a_lane_waiting_for_the_gpu(true);
}

/// `lanes_park_on_gpu: false` (`orbitkv.pd.gpu_wait` `block`, kept for A/B
/// runs) is the lane before: the late request waits for the other's mark,
/// and both end well once it is reached.
#[test]
fn a_lane_told_to_block_on_the_gpu_holds_a_late_write_until_the_mark() {
    late_write_behind_a_lane_waiting_for_the_gpu(false);
}

fn late_write_behind_a_lane_waiting_for_the_gpu(park: bool) {
    let cfg = orbitkv::RuntimeConfig {
        writer_lanes_per_peer: 1,
        consumer_timeout: Duration::from_secs(20),
        lanes_park_on_gpu: park,
        ..orbitkv::RuntimeConfig::default()
    };
    let producer = orbitkv::testing::host_rank_with(2, 8, 4096, (0, 1), 2, |i| (i % 127) as u8, cfg);
    let consumer = rank(2, 8, 4096, (0, 1), 2, |_| GUARD);
    let (p, c) = (&producer.runtime, &consumer.runtime);
    let computing = RequestId::new("gate-computing");
    let late = RequestId::new("gate-late");
    let hs = orbitkv::testing::open_both(p, c, &computing, &[1, 2], &[3, 4]);
    p.producer_handshake(hs).unwrap();
    // `late`'s prefill ran (its layers behind a mark the GPU reached, and
    // finished); decode has not authorized it yet.
    let late_hs = orbitkv::testing::open_both(p, c, &late, &[5, 6], &[0, 7]);
    let (reach_late, late_mark) = hand();
    reach_late.send(Ok(())).unwrap();
    p.layers_ready_after(
        Some(late_mark),
        vec![
            ready(&late, 0, 2),
            ready(&late, 1, 2),
            GateCall::Finish {
                request: late.clone(),
            },
        ],
    );
    // `computing`'s layer 0, behind a mark the GPU has not reached: the
    // lane's only write, at its front.
    let (reach, mark) = hand();
    p.layers_ready_after(Some(mark), vec![ready(&computing, 0, 2)]);
    // Give the lane time to take it and park (or block) on its mark.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(p.stats().bytes_written, 0);

    // decode authorizes `late` now: both its layers reach the lane behind
    // the write that waits for the GPU.
    p.producer_handshake(late_hs.clone()).unwrap();
    if park {
        // they go at once
        match next(c, Duration::from_secs(5)) {
            Some(RuntimeEvent::ConsumerCompleted {
                request, generation, ..
            }) => assert_eq!((request, generation), (late.clone(), late_hs.generation)),
            other => panic!("the late request waited behind the lane's GPU wait: {other:?}"),
        }
        let s = p.stats();
        assert!(
            s.writes_ahead_of_gpu >= 1,
            "sent ahead of the parked write: {s:?}"
        );
        assert_eq!(s.layers_written, 2, "{s:?}");
    } else {
        // they wait in the blocked lane's inbox until the mark
        assert_eq!(next(c, Duration::from_millis(300)), None);
        assert_eq!(p.stats().bytes_written, 0);
    }
    for l in 0..2 {
        for b in [3, 4] {
            assert!(
                block(&consumer, l, b).iter().all(|&x| x == GUARD),
                "layer {l} block {b} written before its mark"
            );
        }
    }

    // The GPU reaches the mark: the waiting write goes, both requests end.
    reach.send(Ok(())).unwrap();
    p.layers_ready_after(
        None,
        vec![
            ready(&computing, 1, 2),
            GateCall::Finish {
                request: computing.clone(),
            },
        ],
    );
    let mut completed = Vec::new();
    while completed.len() < if park { 1 } else { 2 } {
        match next(c, Duration::from_secs(20)) {
            Some(RuntimeEvent::ConsumerCompleted { request, .. }) => completed.push(request),
            other => panic!("expected the requests complete, got {other:?}"),
        }
    }
    assert!(completed.contains(&computing), "{completed:?}");
    for l in 0..2 {
        assert_eq!(block(&consumer, l, 0), block(&producer, l, 5), "layer {l}");
        assert_eq!(block(&consumer, l, 7), block(&producer, l, 6), "layer {l}");
        assert_eq!(block(&consumer, l, 3), block(&producer, l, 1), "layer {l}");
        assert_eq!(block(&consumer, l, 4), block(&producer, l, 2), "layer {l}");
    }
    let s = p.stats();
    assert!(s.write_gpu_wait_micros >= 100_000, "the wait counts: {s:?}");
    assert_eq!(p.writes_queued(), 0);
    c.consumer_release(&late).unwrap();
    c.consumer_release(&computing).unwrap();
}
