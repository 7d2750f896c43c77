//! Group commit: a writer lane keeps one batch in flight, and the layer
//! writes handed to it meanwhile go out together in its next batch, so
//! batches per step do not grow with the requests in flight.
//!
//! The transport here is the crate's test double (`FakeTransport`, held):
//! batches stay in flight until the test lets them end. Bytes through the
//! real Mooncake engine with grouped batches: `runtime_loopback.rs`
//! (`many_requests_streamed_at_once_land_byte_for_byte_in_grouped_batches`).

use std::time::{Duration, Instant};

use orbitkv::testing::wait_released;
use orbitkv::{KvLayout, Outcome, RequestId, RuntimeConfig};

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A held pair with one writer lane per peer (`cfg` otherwise), request
/// `req` opened on both (blocks 0, 1 → 2, 3), layer 0's batch held in
/// flight and layers 1..8 and the finish handed over behind it: seven
/// writes queued in the lane.
fn seven_queued_behind_a_held_batch(
    cfg: RuntimeConfig,
    req: &RequestId,
) -> (
    orbitkv::Runtime,
    std::sync::Arc<orbitkv::transport::fake::FakeTransport>,
    orbitkv::Runtime,
) {
    let layers = 8;
    let layout = KvLayout::packed(0x10_0000, layers, 8, 4096, (0, 1), 1);
    let cfg = RuntimeConfig {
        writer_lanes_per_peer: 1,
        ..cfg
    };
    let (producer, wire, consumer) = orbitkv::testing::held_fake_pair(&layout, cfg);
    opened(&producer, &consumer, req);
    producer.layer_ready(req, 0, 0..2).unwrap();
    wire.wait_submits(1);
    for l in 1..layers {
        producer.layer_ready(req, l, 0..2).unwrap();
    }
    producer.producer_finish(req).unwrap();
    // The lane holds layer 0's batch: the other seven wait in its queue.
    until("seven writes queued", || producer.writes_queued() == 7);
    (producer, wire, consumer)
}

/// The request `req` opened on both runtimes of a held pair (blocks 0, 1 →
/// 2, 3) and the handshake admitted.
fn opened(producer: &orbitkv::Runtime, consumer: &orbitkv::Runtime, req: &RequestId) {
    let hs = orbitkv::testing::open_both(producer, consumer, req, &[0, 1], &[2, 3]);
    producer.producer_handshake(hs).unwrap();
}

#[test]
fn writes_queued_behind_a_batch_in_flight_go_out_as_one_batch() {
    let req = RequestId::new("grouped");
    let (producer, wire, _consumer) = seven_queued_behind_a_held_batch(RuntimeConfig::default(), &req);
    assert_eq!(wire.submits(), 1, "one batch in flight per lane");

    wire.hold(false);
    let (outcome, why) = wait_released(&producer, &req);
    assert_eq!(outcome, Outcome::Done, "{why:?}");
    assert_eq!(wire.submits(), 2, "the seven queued writes went as one batch");
    let s = producer.stats();
    assert_eq!((s.write_batches, s.writes_grouped, s.layers_written), (2, 6, 8));
    assert_eq!(s.write_ranges, 8, "one range per layer, none lost or doubled");
    assert_eq!(s.bytes_written, 8 * 2 * 4096);
    assert_eq!(producer.writes_queued(), 0);
    // Nothing ended the group early: no budget reached, no GPU mark.
    assert_eq!((s.group_stops_budget, s.group_stops_gpu), (0, 0));
}

#[test]
fn a_group_commit_ends_at_the_lanes_range_budget_and_says_so() {
    // One lane, 3 ranges in flight per peer: the seven writes queued behind
    // layer 0's batch go out as 3 + 3 + 1, two batches ended by the budget.
    let req = RequestId::new("budget");
    let cfg = RuntimeConfig {
        max_ranges_in_flight_per_peer: Some(3),
        ..RuntimeConfig::default()
    };
    let (producer, wire, _consumer) = seven_queued_behind_a_held_batch(cfg, &req);
    // Queued at least this long: the queue counter must show it.
    std::thread::sleep(Duration::from_millis(50));
    wire.hold(false);
    let (outcome, why) = wait_released(&producer, &req);
    assert_eq!(outcome, Outcome::Done, "{why:?}");
    let s = producer.stats();
    assert_eq!((s.write_batches, s.writes_grouped, s.layers_written), (4, 4, 8));
    assert_eq!((s.group_stops_budget, s.group_stops_gpu), (2, 0));
    assert!(s.write_queue_micros >= 7 * 50_000, "{s:?}");
    assert!(s.write_queue_micros <= s.layer_write_micros, "{s:?}");
    assert_eq!(s.write_gpu_wait_micros, 0, "no layer marks here");
}

/// A held pair of `layers` layers of 8 blocks of 4 KiB with one writer
/// lane per peer.
fn one_lane_pair(
    layers: u32,
) -> (
    KvLayout,
    orbitkv::Runtime,
    std::sync::Arc<orbitkv::transport::fake::FakeTransport>,
    orbitkv::Runtime,
) {
    let layout = KvLayout::packed(0x10_0000, layers, 8, 4096, (0, 1), 1);
    let cfg = RuntimeConfig {
        writer_lanes_per_peer: 1,
        ..RuntimeConfig::default()
    };
    let (producer, wire, consumer) = orbitkv::testing::held_fake_pair(&layout, cfg);
    (layout, producer, wire, consumer)
}

/// A mark the test reaches by hand (a stand-in for a CUDA event: it cannot
/// be polled, so a write behind it never joins a group commit early).
struct Hand(crossbeam_channel::Receiver<()>);

impl orbitkv::actors::prefill::gate::Mark for Hand {
    fn wait(&mut self) -> Result<(), String> {
        self.0
            .recv_timeout(Duration::from_secs(30))
            .map_err(|_| "never reached".to_string())
    }
}

#[test]
fn a_group_commit_ends_at_a_layer_the_gpu_has_not_written_and_says_so() {
    use orbitkv::actors::prefill::gate::GateCall;
    let (_, producer, wire, consumer) = one_lane_pair(3);
    let req = RequestId::new("behind-the-gpu");
    opened(&producer, &consumer, &req);
    producer.layer_ready(&req, 0, 0..2).unwrap();
    wire.wait_submits(1);
    // Layers 1 and 2 queue behind layer 0's batch, each behind its mark.
    let (reach1, mark1) = crossbeam_channel::bounded(1);
    let (reach2, mark2) = crossbeam_channel::bounded(1);
    let ready = |layer| GateCall::Ready {
        request: req.clone(),
        layer,
        blocks: 0..2,
    };
    producer.layers_ready_after(Some(Box::new(Hand(mark1))), vec![ready(1)]);
    producer.layers_ready_after(Some(Box::new(Hand(mark2))), vec![ready(2)]);
    producer.layers_ready_after(None, vec![GateCall::Finish { request: req.clone() }]);
    until("two writes queued", || producer.writes_queued() == 2);
    // Layer 1 written by the GPU, layer 2 not: the next batch is layer 1
    // alone, and it ends at layer 2.
    reach1.send(()).unwrap();
    wire.hold(false);
    until("layer 1 written", || producer.stats().layers_written == 2);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(producer.stats().layers_written, 2, "layer 2 waits for its mark");
    reach2.send(()).unwrap();
    let (outcome, why) = wait_released(&producer, &req);
    assert_eq!(outcome, Outcome::Done, "{why:?}");
    let s = producer.stats();
    assert_eq!((s.write_batches, s.writes_grouped, s.layers_written), (3, 0, 3));
    assert_eq!((s.group_stops_gpu, s.group_stops_budget), (1, 0));
    // The lane then waited for layer 2's mark at the front of its queue.
    assert!(s.write_gpu_wait_micros >= 50_000, "{s:?}");
}

/// A mark the GPU already reached (a stand-in for a CUDA event that
/// polls as done).
struct Reached;

impl orbitkv::actors::prefill::gate::Mark for Reached {
    fn wait(&mut self) -> Result<(), String> {
        Ok(())
    }

    fn poll(&mut self) -> Option<Result<(), String>> {
        Some(Ok(()))
    }
}

/// Under load, decode authorizes many requests after their prefill ran
/// (decode's queue was full): their layers were written by the GPU long
/// ago, and their writes reach the writer lane behind writes of requests
/// still computing. The lane sends those first instead of waiting for the
/// GPU with them queued behind (before, nothing overtook a write: the lane
/// blocked on the front write's mark, and the finished request — whose
/// prefill had answered — waited a GPU lag for another request's layer).
#[test]
fn writes_the_gpu_already_wrote_go_before_a_write_still_waiting_for_the_gpu() {
    use orbitkv::actors::prefill::gate::GateCall;
    let (layout, producer, wire, consumer) = one_lane_pair(2);
    // `late`: its prefill ran first (both layers handed over behind a mark
    // the GPU reached, and finished), decode had not authorized it yet.
    let late = RequestId::new("authorized-late");
    let late_hs = orbitkv::testing::open_both(&producer, &consumer, &late, &[4, 5], &[6, 7]);
    producer.layers_ready_after(
        Some(Box::new(Reached)),
        (0..2)
            .map(|layer| GateCall::Ready {
                request: late.clone(),
                layer,
                blocks: 0..2,
            })
            .chain([GateCall::Finish {
                request: late.clone(),
            }])
            .collect(),
    );
    // `computing`: layer 0 in flight (held), layer 1 behind a later mark
    // the GPU has not reached.
    let computing = RequestId::new("still-computing");
    opened(&producer, &consumer, &computing);
    producer.layer_ready(&computing, 0, 0..2).unwrap();
    wire.wait_submits(1);
    let (reach, mark) = crossbeam_channel::bounded(1);
    producer.layers_ready_after(
        Some(Box::new(Hand(mark))),
        vec![
            GateCall::Ready {
                request: computing.clone(),
                layer: 1,
                blocks: 0..2,
            },
            GateCall::Finish {
                request: computing.clone(),
            },
        ],
    );
    // decode authorizes `late` now: its two writes reach the lane behind
    // `computing`'s layer 1
    producer.producer_handshake(late_hs).unwrap();
    until("three writes queued", || producer.writes_queued() == 3);

    // Layer 0's batch ends: the lane sends `late`'s two layers, as one
    // batch, while `computing`'s layer 1 still waits for the GPU.
    let before = wire.submitted().len();
    wire.hold(false);
    let (outcome, why) = wait_released(&producer, &late);
    assert_eq!(outcome, Outcome::Done, "{why:?}");
    let sent: Vec<u64> = wire.submitted()[before..].iter().map(|r| r.dst).collect();
    let late_dst: std::collections::BTreeSet<u64> = layout
        .layers
        .iter()
        .flat_map(|g| g.planes.iter())
        .flat_map(|p| [6, 7].map(|b| p.block_addr(b)))
        .collect();
    assert!(
        !sent.is_empty() && sent.iter().all(|d| late_dst.contains(d)),
        "only the late request's blocks were written ahead: {sent:x?}"
    );
    let s = producer.stats();
    assert_eq!(s.writes_ahead_of_gpu, 1, "{s:?}");
    assert_eq!((s.layers_written, s.writes_grouped), (3, 1), "{s:?}");
    assert_eq!(
        s.group_stops_gpu, 1,
        "the batch passed over the waiting write: {s:?}"
    );
    let submits = wire.submits();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        wire.submits(),
        submits,
        "the waiting write is not sent before its mark"
    );
    assert_eq!(producer.stats().layers_written, 3);

    // The GPU reaches the mark: the write that waited goes, and ends well.
    reach.send(()).unwrap();
    let (outcome, why) = wait_released(&producer, &computing);
    assert_eq!(outcome, Outcome::Done, "{why:?}");
    let s = producer.stats();
    assert_eq!((s.layers_written, s.write_batches), (4, 3), "{s:?}");
    assert_eq!(producer.writes_queued(), 0);
}

/// When no writer lane of a peer is free, a write goes to a lane parked on
/// the GPU (nothing in flight: it sends a write whose layer the GPU wrote
/// at once) before one with a batch in Mooncake (which sends it only once
/// that batch ended). Two lanes: lane 0 holds `busy`'s batch in flight,
/// lane 1 parks on `computing`'s unreached mark; `ready`'s layer, written
/// long ago, must be submitted while lane 0's batch is still held (before,
/// the pick went to the next lane in turn: lane 0, behind the held batch).
#[test]
fn with_no_lane_free_a_write_goes_to_a_lane_parked_on_the_gpu_not_one_in_mooncake() {
    use orbitkv::actors::prefill::gate::GateCall;
    let layout = KvLayout::packed(0x10_0000, 2, 16, 4096, (0, 1), 1);
    let cfg = RuntimeConfig {
        writer_lanes_per_peer: 2,
        ..RuntimeConfig::default()
    };
    let (producer, wire, consumer) = orbitkv::testing::held_fake_pair(&layout, cfg);
    let open = |name: &str, src: [u32; 2], dst: [u32; 2]| {
        let req = RequestId::new(name);
        let hs = orbitkv::testing::open_both(&producer, &consumer, &req, &src, &dst);
        producer.producer_handshake(hs).unwrap();
        req
    };
    let busy = open("busy", [0, 1], [0, 1]);
    let computing = open("computing", [2, 3], [2, 3]);
    let ready = open("ready", [4, 5], [4, 5]);
    // lane 0 (the first free in turn): `busy`'s layer 0, held in Mooncake
    producer.layer_ready(&busy, 0, 0..2).unwrap();
    wire.wait_submits(1);
    // lane 1 (free): `computing`'s layer 0 behind a mark not reached: parks
    let (reach, mark) = crossbeam_channel::bounded(1);
    producer.layers_ready_after(
        Some(Box::new(Hand(mark))),
        vec![GateCall::Ready {
            request: computing.clone(),
            layer: 0,
            blocks: 0..2,
        }],
    );
    until("the write behind the mark queued", || {
        producer.writes_queued() == 1
    });
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(wire.submits(), 1);
    // no lane is free: `ready`'s layer goes to the parked lane, at once
    producer.layer_ready(&ready, 0, 0..2).unwrap();
    until("the ready write submitted beside the held batch", || {
        wire.submits() == 2
    });
    let ready_dst: Vec<u64> = layout.layers[0]
        .planes
        .iter()
        .flat_map(|p| [4, 5].map(|b| p.block_addr(b)))
        .collect();
    let sent: Vec<u64> = wire.submitted()[1..].iter().map(|r| r.dst).collect();
    assert!(
        sent.iter().all(|d| ready_dst.contains(d)),
        "the second batch is the ready write: {sent:x?}"
    );
    assert_eq!(producer.stats().writes_ahead_of_gpu, 1);
    // everything ends well
    reach.send(()).unwrap();
    wire.hold(false);
    for req in [&busy, &computing, &ready] {
        producer.layer_ready(req, 1, 0..2).unwrap();
        producer.producer_finish(req).unwrap();
    }
    // (in any order: each release is taken as it comes)
    let mut released = std::collections::BTreeMap::new();
    while released.len() < 3 {
        let ev = orbitkv::testing::wait_for(&producer, "the three releases", |e| {
            matches!(e, orbitkv::RuntimeEvent::ProducerReleased { .. })
        });
        if let orbitkv::RuntimeEvent::ProducerReleased {
            request,
            outcome,
            reason,
            ..
        } = ev
        {
            released.insert(request.to_string(), (outcome, reason));
        }
    }
    for (req, (outcome, why)) in &released {
        assert_eq!(*outcome, Outcome::Done, "{req}: {why:?}");
    }
    assert_eq!(producer.writes_queued(), 0);
}

/// A parked lane waits for the first mark the GPU reaches among its queued
/// writes, not only the front one's: a request decode authorized after
/// the GPU was handed later layers queues behind a write of those later
/// layers with an earlier mark, and goes as soon as its own layer is
/// written (before, the lane woke only at the front write's mark).
#[test]
fn a_parked_lane_wakes_at_the_earliest_mark_of_its_queue() {
    use orbitkv::actors::prefill::gate::GateCall;
    let (layout, producer, wire, consumer) = one_lane_pair(1);
    wire.hold(false);
    let ready = |req: &RequestId| GateCall::Ready {
        request: req.clone(),
        layer: 0,
        blocks: 0..2,
    };
    // `early`: its layer handed over behind mark 1, its decode not yet
    // authorized (the write waits in its producer).
    let early = RequestId::new("early-mark");
    let early_hs = orbitkv::testing::open_both(&producer, &consumer, &early, &[4, 5], &[4, 5]);
    let (reach1, mark1) = crossbeam_channel::bounded(1);
    producer.layers_ready_after(Some(Box::new(Hand(mark1))), vec![ready(&early)]);
    // `later`: authorized, its layer behind mark 2: the lane's front, parked.
    let later = RequestId::new("later-mark");
    opened(&producer, &consumer, &later);
    let (reach2, mark2) = crossbeam_channel::bounded(1);
    producer.layers_ready_after(Some(Box::new(Hand(mark2))), vec![ready(&later)]);
    until("the later write queued", || producer.writes_queued() == 1);
    // decode authorizes `early`: its write queues behind `later`'s
    producer.producer_handshake(early_hs).unwrap();
    until("both writes queued", || producer.writes_queued() == 2);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(wire.submits(), 0);
    // the GPU reaches mark 1 only: `early`'s write goes, `later`'s waits
    reach1.send(()).unwrap();
    until("the early write submitted", || wire.submits() == 1);
    let early_dst: Vec<u64> = layout.layers[0]
        .planes
        .iter()
        .flat_map(|p| [4, 5].map(|b| p.block_addr(b)))
        .collect();
    assert!(wire.submitted().iter().all(|r| early_dst.contains(&r.dst)));
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(wire.submits(), 1, "the later write waits for its own mark");
    reach2.send(()).unwrap();
    until("the later write submitted", || wire.submits() == 2);
    for req in [&early, &later] {
        producer.producer_finish(req).unwrap();
    }
    let mut released = std::collections::BTreeMap::new();
    while released.len() < 2 {
        if let orbitkv::RuntimeEvent::ProducerReleased { request, outcome, .. } =
            orbitkv::testing::wait_for(&producer, "the releases", |e| {
                matches!(e, orbitkv::RuntimeEvent::ProducerReleased { .. })
            })
        {
            released.insert(request.to_string(), outcome);
        }
    }
    assert!(released.values().all(|o| *o == Outcome::Done), "{released:?}");
}
