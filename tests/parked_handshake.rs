//! A handshake that arrived before `producer_open` is parked, but only up to
//! the handshake deadline: one parked longer is stale (its consumer may have
//! failed and freed the blocks it names) and must not authorize any write.
//! Real Mooncake on 127.0.0.1, host memory.

#[path = "../examples/common/mod.rs"]
mod common;

use std::time::Duration;

use common::*;
use orbitkv::{Outcome, RuntimeConfig, RuntimeEvent};

fn ranks(handshake_timeout: Duration) -> (Rank, Rank) {
    let spec = RankSpec {
        layers: 1,
        blocks: 8,
        block_bytes: 16 * KIB,
        tp: (0, 1),
        kv_heads: 2,
    };
    let cfg = RuntimeConfig {
        handshake_timeout,
        ..config(Duration::from_secs(10))
    };
    (
        Rank::new("producer", &spec, Fill::Source(9), cfg.clone()),
        Rank::new("consumer", &spec, Fill::Guard, cfg),
    )
}

fn producer_outcome(p: &Rank) -> Option<RuntimeEvent> {
    wait_for(p, Duration::from_secs(10), &mut Vec::new(), is_producer_released)
}

#[test]
fn a_handshake_parked_past_its_deadline_authorizes_nothing() {
    let (producer, consumer) = ranks(Duration::from_millis(300));
    let req = request("parked-stale");
    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, vec![1, 2], 1)
        .unwrap();
    producer.runtime.producer_handshake(hs).unwrap(); // no producer yet: parked
    std::thread::sleep(Duration::from_millis(400));
    producer
        .runtime
        .producer_open(req.clone(), vec![5, 6], cap(), 1)
        .unwrap();
    producer.runtime.layer_ready(&req, 0, 0..2).unwrap();
    producer.runtime.producer_finish(&req).unwrap();
    let ev = producer_outcome(&producer);
    // Released when its own handshake deadline passes, without any write.
    assert!(
        matches!(
            &ev,
            Some(RuntimeEvent::ProducerReleased {
                outcome: Outcome::Failed,
                reason: Some(r),
                ..
            }) if r.contains("no handshake")
        ),
        "{ev:?}"
    );
    assert_eq!(producer.runtime.stats().bytes_written, 0);
    for l in 0..consumer.layers() {
        check_layer(&consumer, l, &Expect { written: vec![] }).unwrap();
    }
}

#[test]
fn a_fresh_parked_handshake_is_taken_up() {
    let (producer, consumer) = ranks(Duration::from_secs(10));
    let req = request("parked-fresh");
    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, vec![1, 2], 1)
        .unwrap();
    producer.runtime.producer_handshake(hs).unwrap();
    producer
        .runtime
        .producer_open(req.clone(), vec![5, 6], cap(), 1)
        .unwrap();
    producer.runtime.layer_ready(&req, 0, 0..2).unwrap();
    producer.runtime.producer_finish(&req).unwrap();
    let ev = producer_outcome(&producer);
    assert!(
        matches!(
            ev,
            Some(RuntimeEvent::ProducerReleased {
                outcome: Outcome::Done,
                ..
            })
        ),
        "{ev:?}"
    );
    let written = (0..2)
        .map(|i| ([1, 2][i], &producer, [5, 6][i], 0..(16 * KIB) as usize))
        .collect();
    check_layer(&consumer, 0, &Expect { written }).unwrap();
}
