//! Scenario: request-ID reuse with writes in flight.
//!
//! The consumer authorizes a request (generation g1, "old" blocks), the
//! producer admits six layers under it, then vLLM releases the request on the
//! decode side and authorizes the same request ID again (generation g2, "new"
//! blocks) while g1's writes are still in flight. The producer takes up g2
//! and writes everything again, then two more layers under g2 only.
//!
//! Contract (rule 5): writes admitted under g1 land only in the old blocks
//! (all six layers there, and never the two g2-only layers); g2 completes
//! with the new blocks; every other byte keeps its guard value.
//!
//! Run: `source scripts/env.sh && cargo run --example scenario_id_reuse`

mod common;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use common::*;
use orbitkv::{Outcome, RuntimeConfig, RuntimeEvent};

const NAME: &str = "scenario_id_reuse";

fn main() -> ExitCode {
    let mut report = Report::start(
        NAME,
        "A request ID is authorized (g1), six layers are admitted, then the ID is released\n\
         and authorized again (g2, new blocks) while g1's writes are in flight.\n\
         Old writes must land only in the old blocks; g2 completes with the new ones.",
    );
    run(&mut report);
    report.finish()
}

fn run(r: &mut Report) {
    let spec = RankSpec {
        layers: 8,
        blocks: 16,
        block_bytes: 256 * KIB,
        tp: (0, 1),
        kv_heads: 8,
    };
    // One layer of the request (4 blocks) in flight per peer at a time, so
    // g1's writes queue behind each other and are in flight for longer.
    let producer_cfg = RuntimeConfig {
        max_bytes_in_flight_per_peer: 4 * spec.block_bytes,
        ..config(Duration::from_secs(10))
    };
    let producer = Rank::new("producer", &spec, Fill::Source(1), producer_cfg);
    let consumer = Rank::new("consumer", &spec, Fill::Guard, config(Duration::from_secs(2)));
    let req = request("reuse");
    let src = vec![12, 13, 14, 15];
    let old_blocks = vec![1, 2, 3, 4];
    let new_blocks = vec![10, 11, 12, 13];
    let (early, layers) = (6, spec.layers);
    r.step(format!(
        "producer {} and consumer {} on Mooncake (127.0.0.1); 8 layers, 4 blocks of 256 KiB per layer",
        producer.runtime.endpoint(),
        consumer.runtime.endpoint()
    ));

    let hs1 = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, old_blocks.clone(), 1)
        .unwrap();
    r.step(format!(
        "consumer authorizes {req} {}: old blocks {old_blocks:?}",
        hs1.generation
    ));
    producer
        .runtime
        .producer_open(req.clone(), src.clone(), cap(), 1)
        .unwrap();
    producer.runtime.producer_handshake_json(&hs1.to_json()).unwrap();
    for l in 0..early {
        producer.runtime.layer_ready(&req, l, 0..4).unwrap();
    }
    r.step(format!(
        "producer: layers 0..{early} ready, admitted under {}",
        hs1.generation
    ));

    consumer.runtime.consumer_release(&req).unwrap();
    let hs2 = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, new_blocks.clone(), 1)
        .unwrap();
    r.step(format!(
        "consumer releases {req} {} and authorizes it again: {} with new blocks {new_blocks:?}",
        hs1.generation, hs2.generation
    ));
    r.check(
        hs2.generation != hs1.generation && hs2.supersedes(&hs1),
        "the reused request ID gets another generation, and a handshake that supersedes the first",
    );
    let landed = producer.runtime.stats().layers_written;
    producer.runtime.producer_handshake_json(&hs2.to_json()).unwrap();
    r.step(format!(
        "producer takes up {} while {} of the {early} writes admitted under {} have not landed yet",
        hs2.generation,
        early as u64 - landed.min(early as u64),
        hs1.generation
    ));
    if landed >= early as u64 {
        r.step("(all old writes had landed already: the race was not hit this run; the checks still apply)");
    }
    for l in early..layers {
        producer.runtime.layer_ready(&req, l, 0..4).unwrap();
    }
    producer.runtime.producer_finish(&req).unwrap();
    r.step(format!(
        "producer: layers {early}..{layers} ready (only {} exists now); prefill finished",
        hs2.generation
    ));

    let mut pev = Vec::new();
    let released = wait_for(&producer, Duration::from_secs(20), &mut pev, is_producer_released);
    if let Some(ev) = &released {
        r.step(describe(ev));
    }
    r.check(
        matches!(
            released,
            Some(RuntimeEvent::ProducerReleased {
                outcome: Outcome::Done,
                ..
            })
        ),
        "the producer drains every write (both generations) and releases with outcome done",
    );

    let mut cev = Vec::new();
    let verdict = wait_for(&consumer, Duration::from_secs(20), &mut cev, |e| {
        is_verdict(e, hs2.generation)
    });
    if let Some(ev) = &verdict {
        r.step(describe(ev));
    }
    let g2_bytes = layers as u64 * 4 * spec.block_bytes;
    r.check(
        matches!(verdict, Some(RuntimeEvent::ConsumerCompleted { bytes, .. }) if bytes == g2_bytes),
        format!(
            "{} completes, counting only its own {g2_bytes} bytes",
            hs2.generation
        ),
    );

    // g1 was released by vLLM before its producer ended; the producer moved
    // on to g2 and never reports g1, so g1 keeps its blocks until the
    // quarantine after its deadline (config(): as long as the deadline).
    let t = Instant::now();
    let g1_released = cev.iter().any(|e| is_released_consumer(e, hs1.generation))
        || wait_for(&consumer, Duration::from_secs(5), &mut cev, |e| {
            is_released_consumer(e, hs1.generation)
        })
        .is_some();
    r.step(format!(
        "consumer {} released its old blocks once the quarantine after its deadline passed (waited {:.0} ms more)",
        hs1.generation,
        t.elapsed().as_secs_f64() * 1e3
    ));
    r.check(
        g1_released,
        format!(
            "{} releases its blocks (by its deadline + quarantine)",
            hs1.generation
        ),
    );
    r.check(
        !cev.iter().any(|e| is_verdict(e, hs1.generation)),
        format!(
            "{} never completes nor fails after vLLM released it",
            hs1.generation
        ),
    );

    let both = |i: usize| (new_blocks[i], &producer, src[i], 0..spec.block_bytes as usize);
    let old = |i: usize| (old_blocks[i], &producer, src[i], 0..spec.block_bytes as usize);
    for l in 0..layers {
        let mut written: Vec<_> = (0..4).map(both).collect();
        if l < early {
            written.extend((0..4).map(old));
        }
        let what = if l < early {
            format!("layer {l}: g1's write is in the old blocks, g2's in the new ones, nothing elsewhere")
        } else {
            format!("layer {l} (g2 only): new blocks written, old blocks untouched, nothing elsewhere")
        };
        r.check_result(check_layer(&consumer, l, &Expect { written }), what);
    }
    let s = producer.runtime.stats();
    let g1_bytes = early as u64 * 4 * spec.block_bytes;
    r.check(
        s.bytes_written == g1_bytes + g2_bytes && s.writes_failed == 0,
        format!(
            "producer wrote {} bytes = {g1_bytes} (g1) + {g2_bytes} (g2), no failed write",
            s.bytes_written
        ),
    );

    consumer.runtime.consumer_release(&req).unwrap();
    let rel = wait_for(&consumer, Duration::from_secs(5), &mut cev, |e| {
        is_released_consumer(e, hs2.generation)
    });
    r.check(
        rel.is_some(),
        format!("{} releases its blocks once vLLM is done", hs2.generation),
    );
    cev.extend(collect(&consumer, Duration::from_millis(100)));
    pev.extend(collect(&producer, Duration::from_millis(100)));
    r.check(
        count(&pev, is_producer_released) == 1
            && count(&cev, |e| is_released_consumer(e, hs1.generation)) == 1
            && count(&cev, |e| is_released_consumer(e, hs2.generation)) == 1,
        "every actor released exactly once",
    );
    r.check(
        consumer.runtime.live_requests() == (0, 0) && producer.runtime.live_requests() == (0, 0),
        "no request actor left on either side",
    );
}
