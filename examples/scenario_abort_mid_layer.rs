//! Scenario: abort in the middle of a layer.
//!
//! Prefill reports the first half of layer 0 (4 blocks of 2 MiB, one 8 MiB
//! write); while that write is in flight the request is aborted on the
//! prefill side; then prefill reports the second half of layer 0 anyway.
//!
//! Contract (rules 4 and 6): the admitted write drains before the producer
//! releases (outcome aborted) and notifies `aborted`; the second half is not
//! written; the consumer fails, never completes; each side releases exactly
//! once, and a second abort or release is refused, not acted on twice.
//!
//! Run: `source scripts/env.sh && cargo run --example scenario_abort_mid_layer`

mod common;

use std::process::ExitCode;
use std::time::Duration;

use common::*;
use orbitkv::{Outcome, RuntimeError, RuntimeEvent};

const NAME: &str = "scenario_abort_mid_layer";

fn main() -> ExitCode {
    let mut report = Report::start(
        NAME,
        "The request is aborted on the prefill side while the first half of layer 0 is being\n\
         written. The write must drain before release, the producer notifies aborted, the\n\
         consumer fails, and both sides release exactly once.",
    );
    run(&mut report);
    report.finish()
}

fn run(r: &mut Report) {
    let spec = RankSpec {
        layers: 2,
        blocks: 12,
        block_bytes: 2 * MIB,
        tp: (0, 1),
        kv_heads: 8,
    };
    let producer = Rank::new(
        "producer",
        &spec,
        Fill::Source(3),
        config(Duration::from_secs(10)),
    );
    let consumer = Rank::new("consumer", &spec, Fill::Guard, config(Duration::from_secs(10)));
    let req = request("abort");
    let src: Vec<u32> = (4..12).collect();
    let dst: Vec<u32> = (0..8).collect();
    r.step(format!(
        "producer {} and consumer {}; 2 layers, a request of 8 blocks of 2 MiB",
        producer.runtime.endpoint(),
        consumer.runtime.endpoint()
    ));

    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, dst.clone(), 1)
        .unwrap();
    r.step(format!(
        "consumer authorizes {req} {}: blocks {dst:?}",
        hs.generation
    ));
    producer
        .runtime
        .producer_open(req.clone(), src.clone(), cap(), 1)
        .unwrap();
    producer.runtime.producer_handshake_json(&hs.to_json()).unwrap();

    producer.runtime.layer_ready(&req, 0, 0..4).unwrap();
    producer
        .runtime
        .producer_abort(&req, "client disconnected")
        .unwrap();
    let landed = producer.runtime.stats().layers_written;
    r.step(format!(
        "layer 0 blocks 0..4 ready (one 8 MiB write); abort sent while it had {}landed",
        if landed == 0 { "not " } else { "already " }
    ));
    let second_half = producer.runtime.layer_ready(&req, 0, 4..8);
    r.step(format!(
        "prefill reports layer 0 blocks 4..8 after the abort: {}",
        match &second_half {
            Ok(()) => "accepted by the facade, the draining actor drops it".to_string(),
            Err(e) => format!("refused ({e})"),
        }
    ));

    let mut pev = Vec::new();
    let released = wait_for(&producer, Duration::from_secs(20), &mut pev, is_producer_released);
    let at_release = producer.runtime.stats();
    if let Some(ev) = &released {
        r.step(describe(ev));
    }
    r.check(
        at_release.layers_written == 1 && at_release.writes_failed == 0,
        format!(
            "the admitted write drained before the release ({} landed, {} failed)",
            at_release.layers_written, at_release.writes_failed
        ),
    );
    r.check(
        matches!(
            &released,
            Some(RuntimeEvent::ProducerReleased {
                outcome: Outcome::Aborted,
                reason: Some(why),
                ..
            }) if why.contains("client disconnected")
        ),
        "the producer releases with outcome aborted and the abort's reason",
    );

    let mut cev = Vec::new();
    let verdict = wait_for(&consumer, Duration::from_secs(20), &mut cev, |e| {
        is_verdict(e, hs.generation)
    });
    if let Some(ev) = &verdict {
        r.step(describe(ev));
    }
    r.check(
        matches!(&verdict, Some(RuntimeEvent::ConsumerFailed { reason, .. }) if reason.contains("abort")),
        "the consumer fails with the producer's abort",
    );

    let half = |i: usize| (dst[i], &producer, src[i], 0..spec.block_bytes as usize);
    r.check_result(
        check_layer(
            &consumer,
            0,
            &Expect {
                written: (0..4).map(half).collect(),
            },
        ),
        "layer 0: the drained first half is in blocks 0..4; the second half was never written",
    );
    r.check_result(
        check_layer(&consumer, 1, &Expect { written: vec![] }),
        "layer 1: never written",
    );

    consumer.runtime.consumer_release(&req).unwrap();
    let rel = wait_for(&consumer, Duration::from_secs(5), &mut cev, |e| {
        is_released_consumer(e, hs.generation)
    });
    r.check(
        rel.is_some(),
        "vLLM releases the request: the consumer frees its blocks",
    );
    let again_abort = producer.runtime.producer_abort(&req, "again");
    let again_release = consumer.runtime.consumer_release(&req);
    r.check(
        matches!(again_abort, Err(RuntimeError::UnknownRequest(_)))
            && matches!(again_release, Err(RuntimeError::UnknownRequest(_))),
        "a second abort and a second release are refused (unknown request), not acted on",
    );
    pev.extend(collect(&producer, Duration::from_millis(200)));
    cev.extend(collect(&consumer, Duration::from_millis(200)));
    r.check(
        count(&pev, is_producer_released) == 1
            && count(&cev, |e| is_released_consumer(e, hs.generation)) == 1,
        format!(
            "blocks released exactly once on each side ({} producer, {} consumer releases)",
            count(&pev, is_producer_released),
            count(&cev, |e| is_released_consumer(e, hs.generation))
        ),
    );
    r.check(
        count(&cev, |e| matches!(e, RuntimeEvent::ConsumerCompleted { .. })) == 0,
        "the consumer never published the blocks as complete",
    );
    r.check(
        consumer.runtime.live_requests() == (0, 0) && producer.runtime.live_requests() == (0, 0),
        "no request actor left on either side",
    );
}
