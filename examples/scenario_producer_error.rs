//! Scenario: a producer error while other writes are still admitted.
//!
//! The authorization the producer receives points layer 0 at memory the
//! consumer never registered with Mooncake (a decoy buffer), so Mooncake
//! refuses that one write, while the writes of the other layers (2 MiB each,
//! admitted right after it) are in flight.
//!
//! Contract (rules 4 and 6): the producer does not release before every
//! other admitted write drained, then notifies `failed`; the consumer fails
//! and never completes; the refused write touched nothing (the decoy and the
//! real layer 0 keep their guard bytes) while the drained writes did land, and
//! nothing lands after the release.
//!
//! Run: `source scripts/env.sh && cargo run --example scenario_producer_error`

mod common;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use common::*;
use orbitkv::{Outcome, RuntimeEvent};

const NAME: &str = "scenario_producer_error";

fn main() -> ExitCode {
    let mut report = Report::start(
        NAME,
        "One layer's write fails (its destination is memory the consumer never registered)\n\
         while the other layers' writes are admitted. The producer must drain them before it\n\
         releases, then notify failed; the consumer must fail and never complete.",
    );
    run(&mut report);
    report.finish()
}

fn run(r: &mut Report) {
    let spec = RankSpec {
        layers: 6,
        blocks: 8,
        block_bytes: 512 * KIB,
        tp: (0, 1),
        kv_heads: 8,
    };
    let producer = Rank::new(
        "producer",
        &spec,
        Fill::Source(2),
        config(Duration::from_secs(10)),
    );
    let consumer = Rank::new("consumer", &spec, Fill::Guard, config(Duration::from_secs(10)));
    let bad_layer = 0;
    let layer_bytes = spec.blocks as u64 * spec.block_bytes;
    // Never registered with any engine: a write that reached it would show.
    let decoy = HostMemory::new(layer_bytes, Fill::Guard);
    let req = request("error");
    let (src, dst) = (vec![4, 5, 6, 7], vec![0, 1, 2, 3]);
    r.step(format!(
        "producer {} and consumer {}; {} layers, 4 blocks of 512 KiB per layer",
        producer.runtime.endpoint(),
        consumer.runtime.endpoint(),
        spec.layers
    ));

    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, dst.clone(), 1)
        .unwrap();
    let mut bad = hs.clone();
    bad.layout.layers[bad_layer as usize].planes[0].base = decoy.addr();
    r.step(format!(
        "consumer authorizes {req} {} (blocks {dst:?}); the copy the producer gets points layer \
         {bad_layer} at {:#x}, which the consumer never registered",
        hs.generation,
        decoy.addr()
    ));
    producer
        .runtime
        .producer_open(req.clone(), src.clone(), cap(), 1)
        .unwrap();
    producer.runtime.producer_handshake_json(&bad.to_json()).unwrap();
    for l in 0..spec.layers {
        producer.runtime.layer_ready(&req, l, 0..4).unwrap();
    }
    producer.runtime.producer_finish(&req).unwrap();
    r.step(format!(
        "producer: layers 0..{} ready, layer 0 (the bad one) first; prefill finished",
        spec.layers
    ));

    // Watch the counters: when the failure is counted, how many of the other
    // admitted writes have landed?
    let t = Instant::now();
    let mut landed_at_failure = None;
    while t.elapsed() < Duration::from_secs(10) {
        let s = producer.runtime.stats();
        if s.writes_failed > 0 {
            landed_at_failure = Some(s.layers_written);
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    r.check(
        landed_at_failure.is_some(),
        "Mooncake refuses the write into unregistered memory",
    );

    let mut pev = Vec::new();
    let released = wait_for(&producer, Duration::from_secs(20), &mut pev, is_producer_released);
    let at_release = producer.runtime.stats();
    if let Some(ev) = &released {
        r.step(describe(ev));
    }
    // Layers ready after the producer saw the error are not admitted any
    // more; every admitted one must have ended before the release.
    r.check(
        at_release.writes_failed == 1,
        format!(
            "when the producer released, its admitted writes had drained: {} landed, {} failed",
            at_release.layers_written, at_release.writes_failed
        ),
    );
    std::thread::sleep(Duration::from_millis(300));
    let later = producer.runtime.stats();
    r.check(
        later.layers_written == at_release.layers_written && later.writes_failed == at_release.writes_failed,
        "no write ended after the release (nothing was still in flight)",
    );
    let good = at_release.layers_written;
    let in_flight = good - landed_at_failure.unwrap_or(good).min(good);
    r.step(format!(
        "the failure of layer {bad_layer} was counted while {in_flight} of the {good} other admitted writes \
         were still in flight; the producer waited for them"
    ));
    if in_flight == 0 {
        r.step("(no other write was in flight at the failure this run: the race was not hit; the checks still apply)");
    }
    r.check(
        matches!(
            released,
            Some(RuntimeEvent::ProducerReleased {
                outcome: Outcome::Failed,
                ..
            })
        ),
        "the producer releases with outcome failed (the error decides, not the later successes)",
    );

    let mut cev = Vec::new();
    let verdict = wait_for(&consumer, Duration::from_secs(20), &mut cev, |e| {
        is_verdict(e, hs.generation)
    });
    if let Some(ev) = &verdict {
        r.step(describe(ev));
    }
    r.check(
        matches!(&verdict, Some(RuntimeEvent::ConsumerFailed { reason, .. }) if reason.contains("failure")),
        "the consumer fails, naming the producer's failure",
    );
    cev.extend(collect(&consumer, Duration::from_millis(200)));
    r.check(
        count(&cev, |e| matches!(e, RuntimeEvent::ConsumerCompleted { .. })) == 0,
        "the consumer never publishes the blocks as complete",
    );

    for l in 0..spec.layers {
        // Admitted layers are written in order, so the first `good` good ones landed.
        let written = if l == bad_layer || l as u64 > good {
            vec![]
        } else {
            (0..4)
                .map(|i| (dst[i], &producer, src[i], 0..spec.block_bytes as usize))
                .collect()
        };
        let what = if l == bad_layer {
            format!("layer {l}: nothing written (its write was refused)")
        } else if l as u64 > good {
            format!("layer {l}: not admitted after the error, nothing written")
        } else {
            format!("layer {l}: the drained write is in the authorized blocks, nothing elsewhere")
        };
        r.check_result(check_layer(&consumer, l, &Expect { written }), what);
    }
    r.check(
        decoy.read(decoy.addr(), layer_bytes).iter().all(|&b| b == GUARD),
        "the unregistered decoy memory is untouched",
    );

    consumer.runtime.consumer_release(&req).unwrap();
    let rel = wait_for(&consumer, Duration::from_secs(5), &mut cev, |e| {
        is_released_consumer(e, hs.generation)
    });
    r.check(
        rel.is_some(),
        "vLLM releases the failed request: blocks freed at once (every producer ended)",
    );
    pev.extend(collect(&producer, Duration::from_millis(100)));
    r.check(
        count(&pev, is_producer_released) == 1
            && count(&cev, |e| is_released_consumer(e, hs.generation)) == 1,
        "each side released exactly once",
    );
    r.check(
        consumer.runtime.live_requests() == (0, 0) && producer.runtime.live_requests() == (0, 0),
        "no request actor left on either side",
    );
}
