//! Group commit: a writer lane keeps one batch in flight, and the layer
//! writes handed to it meanwhile go out together in its next batch, so
//! batches per step do not grow with the requests in flight.
//!
//! The transport here is the crate's test double (`FakeTransport`, held):
//! batches stay in flight until the test lets them end. Bytes through the
//! real Mooncake engine with grouped batches: `runtime_loopback.rs`
//! (`many_requests_streamed_at_once_land_byte_for_byte_in_grouped_batches`).

use std::time::{Duration, Instant};

use orbitkv::testing::{capability as cap, wait_released};
use orbitkv::{KvLayout, Outcome, RequestId, RuntimeConfig};

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn writes_queued_behind_a_batch_in_flight_go_out_as_one_batch() {
    let layers = 8;
    let layout = KvLayout::packed(0x10_0000, layers, 8, 4096, (0, 1), 1);
    let cfg = RuntimeConfig {
        writer_lanes_per_peer: 1,
        ..RuntimeConfig::default()
    };
    let (producer, wire, consumer) = orbitkv::testing::held_fake_pair(&layout, cfg);
    let req = RequestId::new("grouped");
    let hs = consumer
        .consumer_open(req.clone(), cap(), 0, vec![2, 3], 1)
        .unwrap();
    producer.producer_open(req.clone(), vec![0, 1], cap(), 1).unwrap();
    producer.producer_handshake(hs).unwrap();

    producer.layer_ready(&req, 0, 0..2).unwrap();
    wire.wait_submits(1);
    for l in 1..layers {
        producer.layer_ready(&req, l, 0..2).unwrap();
    }
    producer.producer_finish(&req).unwrap();
    // The lane holds layer 0's batch: the other seven wait in its queue.
    until("seven writes queued", || producer.writes_queued() == 7);
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
}
