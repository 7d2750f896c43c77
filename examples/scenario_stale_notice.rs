//! Scenario: a notice of a stale generation arrives.
//!
//! The consumer authorizes a request (g1); the producer writes every layer
//! but prefill has not finished yet. vLLM gives up on the request on the
//! decode side: the release of g1 waits for its producer, then ends at g1's
//! deadline and the router forgets g1. The request ID is authorized again
//! (g2). Only now does the first producer finish, so its `done` notice
//! carries g1.
//!
//! Contract (rule 2): the router drops the g1 notice and counts it as a
//! stale generation; it is not delivered, so g2 does not complete from it.
//! A producer for g2 then completes g2 normally.
//!
//! Run: `source scripts/env.sh && cargo run --example scenario_stale_notice`

mod common;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use common::*;
use orbitkv::RuntimeEvent;

const NAME: &str = "scenario_stale_notice";

fn main() -> ExitCode {
    let mut report = Report::start(
        NAME,
        "A producer's done notice for generation g1 arrives after the consumer moved on to g2\n\
         (same request ID). It must be dropped and counted as stale, never delivered; g2 then\n\
         completes only from its own producer.",
    );
    run(&mut report);
    report.finish()
}

fn wait_until(within: Duration, pred: impl Fn() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < within {
        if pred() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    pred()
}

fn run(r: &mut Report) {
    let spec = RankSpec {
        layers: 4,
        blocks: 12,
        block_bytes: 64 * KIB,
        tp: (0, 1),
        kv_heads: 8,
    };
    let timeout = Duration::from_secs(2);
    let producer = Rank::new(
        "producer",
        &spec,
        Fill::Source(4),
        config(Duration::from_secs(10)),
    );
    let consumer = Rank::new("consumer", &spec, Fill::Guard, config(timeout));
    let req = request("stale");
    let src = vec![8, 9, 10, 11];
    let (g1_blocks, g2_blocks) = (vec![0, 1, 2, 3], vec![4, 5, 6, 7]);
    r.step(format!(
        "producer {} and consumer {} (consumer deadline {} ms)",
        producer.runtime.endpoint(),
        consumer.runtime.endpoint(),
        timeout.as_millis()
    ));

    let hs1 = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, g1_blocks.clone(), 1)
        .unwrap();
    r.step(format!(
        "consumer authorizes {req} g1 = {}: blocks {g1_blocks:?}",
        hs1.generation
    ));
    producer
        .runtime
        .producer_open(req.clone(), src.clone(), cap(), 1)
        .unwrap();
    producer.runtime.producer_handshake_json(&hs1.to_json()).unwrap();
    for l in 0..spec.layers {
        producer.runtime.layer_ready(&req, l, 0..4).unwrap();
    }
    let all_landed = wait_until(Duration::from_secs(10), || {
        producer.runtime.stats().layers_written == spec.layers as u64
    });
    r.step(format!(
        "producer writes all {} layers under g1; prefill has not finished",
        spec.layers
    ));
    r.check(all_landed, "g1's writes landed");

    consumer.runtime.consumer_release(&req).unwrap();
    r.step("vLLM releases g1 on the decode side; the producer has not reported, so g1 holds its blocks");
    let mut cev = Vec::new();
    let rel1 = wait_for(&consumer, Duration::from_secs(5), &mut cev, |e| {
        is_released_consumer(e, hs1.generation)
    });
    if let Some(ev) = &rel1 {
        r.step(format!(
            "{} (at its deadline; the router forgets g1)",
            describe(ev)
        ));
    }
    r.check(rel1.is_some(), "g1 ends at its deadline and releases its blocks");

    let hs2 = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, g2_blocks.clone(), 1)
        .unwrap();
    r.step(format!(
        "consumer authorizes the same request ID again: g2 = {}, blocks {g2_blocks:?}",
        hs2.generation
    ));

    producer.runtime.producer_finish(&req).unwrap();
    r.step("the g1 producer finishes only now: it notifies done for g1");
    let mut pev = Vec::new();
    let p1 = wait_for(&producer, Duration::from_secs(10), &mut pev, is_producer_released);
    if let Some(ev) = &p1 {
        r.step(describe(ev));
    }
    let dropped = wait_until(Duration::from_secs(10), || {
        consumer.runtime.stats().notices_stale_generation == 1
    });
    let s = consumer.runtime.stats();
    r.step(format!(
        "router: {} stale-generation notice(s) dropped, {} routed, {} for unknown requests",
        s.notices_stale_generation, s.notices_routed, s.notices_unknown_request
    ));
    r.check(
        dropped && s.notices_routed == 0,
        "the g1 notice is dropped and counted as stale, not delivered",
    );
    cev.extend(collect(&consumer, Duration::from_millis(200)));
    r.check(
        !cev.iter().any(|e| is_verdict(e, hs2.generation)),
        "g2 neither completes nor fails from g1's notice",
    );

    // A producer for g2 (prefill ran again for the re-authorized request).
    let opened_again = wait_until(Duration::from_secs(5), || {
        producer
            .runtime
            .producer_open(req.clone(), src.clone(), cap(), 1)
            .is_ok()
    });
    r.check(opened_again, "the producer side opens the request ID again");
    producer.runtime.producer_handshake_json(&hs2.to_json()).unwrap();
    for l in 0..spec.layers {
        producer.runtime.layer_ready(&req, l, 0..4).unwrap();
    }
    producer.runtime.producer_finish(&req).unwrap();
    r.step("a producer for g2 writes every layer and finishes");
    let verdict = wait_for(&consumer, Duration::from_secs(10), &mut cev, |e| {
        is_verdict(e, hs2.generation)
    });
    if let Some(ev) = &verdict {
        r.step(describe(ev));
    }
    r.check(
        matches!(verdict, Some(RuntimeEvent::ConsumerCompleted { .. })),
        "g2 completes from its own producer's notice",
    );
    let s = consumer.runtime.stats();
    r.check(
        s.notices_routed == 1 && s.notices_stale_generation == 1,
        format!(
            "router totals: {} routed (g2's), {} stale (g1's)",
            s.notices_routed, s.notices_stale_generation
        ),
    );
    let map = |blocks: &[u32]| -> Vec<_> {
        (0..4)
            .map(|i| (blocks[i], &producer, src[i], 0..spec.block_bytes as usize))
            .collect()
    };
    for l in 0..spec.layers {
        let mut written = map(&g1_blocks);
        written.extend(map(&g2_blocks));
        r.check_result(
            check_layer(&consumer, l, &Expect { written }),
            format!("layer {l}: g1's and g2's blocks hold their own writes, nothing elsewhere"),
        );
    }

    consumer.runtime.consumer_release(&req).unwrap();
    let rel2 = wait_for(&consumer, Duration::from_secs(5), &mut cev, |e| {
        is_released_consumer(e, hs2.generation)
    });
    r.check(rel2.is_some(), "g2 releases its blocks when vLLM is done");
    pev.extend(collect(&producer, Duration::from_millis(300)));
    r.check(
        count(&pev, is_producer_released) == 2,
        "each of the two producer requests released once",
    );
    r.check(
        consumer.runtime.live_requests() == (0, 0) && producer.runtime.live_requests() == (0, 0),
        "no request actor left on either side",
    );
}
