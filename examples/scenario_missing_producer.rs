//! Scenario: a missing producer.
//!
//! The consumer (TP 1, 4 KV heads) expects two producer ranks (TP 2, two
//! heads each). Rank 0 writes its heads and reports done; rank 1 never comes.
//!
//! Contract (rule 3): one done of two expected is not completion; the
//! consumer fails at its (short) deadline, naming how many reported. Rank 1
//! never ended, so its writes could still land: the failure is *held*, and
//! vLLM's release frees the blocks only when the quarantine after the
//! deadline passed. Rank 0's head halves are in place, rank 1's halves and
//! every other byte keep their guard value.
//!
//! Run: `source scripts/env.sh && cargo run --example scenario_missing_producer`

mod common;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use common::*;
use orbitkv::{Outcome, RuntimeEvent};

const NAME: &str = "scenario_missing_producer";

fn main() -> ExitCode {
    let mut report = Report::start(
        NAME,
        "The consumer expects 2 producer ranks; only rank 0 writes and reports done.\n\
         The consumer must not complete, must fail at its deadline (held: rank 1 never ended),\n\
         and release must free its blocks once the quarantine after the deadline passed.",
    );
    run(&mut report);
    report.finish()
}

fn run(r: &mut Report) {
    let timeout = Duration::from_millis(1500);
    let head = 32 * KIB;
    let consumer = Rank::new(
        "consumer",
        &RankSpec {
            layers: 3,
            blocks: 8,
            block_bytes: 4 * head,
            tp: (0, 1),
            kv_heads: 4,
        },
        Fill::Guard,
        config(timeout),
    );
    let p0 = Rank::new(
        "producer rank 0",
        &RankSpec {
            layers: 3,
            blocks: 8,
            block_bytes: 2 * head,
            tp: (0, 2),
            kv_heads: 4,
        },
        Fill::Source(5),
        config(Duration::from_secs(10)),
    );
    let req = request("missing");
    let (src, dst) = (vec![1, 2, 3], vec![5, 6, 0]);
    r.step(format!(
        "consumer {} (TP 1, 4 KV heads, deadline {} ms); producer rank 0 {} (TP 2); rank 1 never starts",
        consumer.runtime.endpoint(),
        timeout.as_millis(),
        p0.runtime.endpoint()
    ));

    let opened = Instant::now();
    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, dst.clone(), 2)
        .unwrap();
    r.step(format!(
        "consumer authorizes {req} {}: blocks {dst:?}, expecting {} producers",
        hs.generation, hs.expected_producers
    ));
    r.check(hs.expected_producers == 2, "two producer ranks are expected");

    p0.runtime
        .producer_open(req.clone(), src.clone(), cap(), 1)
        .unwrap();
    p0.runtime.producer_handshake(hs.clone()).unwrap();
    for l in 0..3 {
        p0.runtime.layer_ready(&req, l, 0..3).unwrap();
    }
    p0.runtime.producer_finish(&req).unwrap();
    let mut pev = Vec::new();
    let released = wait_for(&p0, Duration::from_secs(10), &mut pev, is_producer_released);
    if let Some(ev) = &released {
        r.step(format!("rank 0: {}", describe(ev)));
    }
    r.check(
        matches!(
            released,
            Some(RuntimeEvent::ProducerReleased {
                outcome: Outcome::Done,
                ..
            })
        ),
        "rank 0 writes its heads and reports done",
    );

    let mut cev = Vec::new();
    let verdict = wait_for(&consumer, timeout * 4, &mut cev, |e| is_verdict(e, hs.generation));
    let waited = opened.elapsed();
    if let Some(ev) = &verdict {
        r.step(describe(ev));
    }
    r.check(
        matches!(&verdict, Some(RuntimeEvent::ConsumerFailed { reason, held: true, .. })
            if reason.contains("timed out") && reason.contains("1 of 2")),
        "the consumer fails: timed out with 1 of 2 producers done, blocks held",
    );
    r.check(
        waited >= timeout && waited < timeout + Duration::from_secs(2),
        format!(
            "it failed at its deadline: {} ms after opening (deadline {} ms)",
            waited.as_millis(),
            timeout.as_millis()
        ),
    );
    r.check(
        consumer.runtime.stats().notices_routed == 1,
        "rank 0's notice was routed to the consumer (1 routed)",
    );

    let half = (2 * head) as usize;
    for l in 0..3 {
        let written = (0..3).map(|i| (dst[i], &p0, src[i], 0..half)).collect();
        r.check_result(
            check_layer(&consumer, l, &Expect { written }),
            format!("layer {l}: rank 0's heads 0-1 in place, heads 2-3 and all else untouched"),
        );
    }

    consumer.runtime.consumer_release(&req).unwrap();
    let t = Instant::now();
    let rel = wait_for(&consumer, Duration::from_secs(5), &mut cev, |e| {
        is_released_consumer(e, hs.generation)
    });
    if let Some(ev) = &rel {
        r.step(format!(
            "{} ({} ms after release)",
            describe(ev),
            t.elapsed().as_millis()
        ));
    }
    // config(): the quarantine is as long as the deadline.
    let freed = opened.elapsed();
    r.check(
        rel.is_some() && freed >= 2 * timeout && freed < 2 * timeout + Duration::from_secs(1),
        format!(
            "release frees the blocks once the quarantine passed: {} ms after opening (deadline + quarantine {} ms)",
            freed.as_millis(),
            (2 * timeout).as_millis()
        ),
    );
    cev.extend(collect(&consumer, Duration::from_millis(200)));
    r.check(
        count(&cev, |e| matches!(e, RuntimeEvent::ConsumerCompleted { .. })) == 0
            && count(&cev, |e| is_released_consumer(e, hs.generation)) == 1,
        "never completed; released exactly once",
    );
    r.check(
        consumer.runtime.live_requests() == (0, 0) && p0.runtime.live_requests() == (0, 0),
        "no request actor left on either side",
    );
}
