//! Memory of concurrent request actors: the resident set size (RSS, from
//! `/proc/self/statm`) grown by opening 10,000 consumer request actors (128
//! authorized blocks each, waiting for their producer) and then 10,000
//! producer request actors (128 source blocks each, handshake captured), all
//! alive at once, over [`support::InstantTransport`] (a transport test
//! double). Goal: ≤ 100 MB for 10,000 request actors.
//!
//! Criterion measures time, so this is a plain program (`harness = false`)
//! that prints its numbers: `cargo bench --bench runtime_memory`.

mod support;

use std::time::{Duration, Instant};

use orbitkv::RequestId;
use support::{cap, open_consumer, rss_bytes, scattered_blocks};

/// Waits until RSS stops growing (the actors are started on their thread).
fn settled_rss() -> u64 {
    let mut last = rss_bytes();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = rss_bytes();
        if now == last || Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

fn mb(b: u64) -> f64 {
    b as f64 / 1e6
}

fn main() {
    // Under `cargo test --all-targets` (no `--bench`): a small smoke run.
    let n: u32 = if support::measuring() { 10_000 } else { 500 };
    let pair = support::pair();

    // Warm up: threads, arenas, the writer for the peer, the maps' first growth.
    for i in 0..200 {
        let hs = open_consumer(&pair.consumer, "warm", i);
        let req = hs.request_id.clone();
        pair.producer
            .producer_open(req.clone(), scattered_blocks(i, 8, 0x85EB_CA6B), cap(), 1)
            .unwrap();
        pair.producer.producer_handshake(hs).unwrap();
        pair.producer.producer_abort(&req, "warm-up").unwrap();
        pair.consumer.consumer_release(&req).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    pair.consumer.poll_events();
    pair.producer.poll_events();

    // The consumers' handshakes are not kept (a real one travels to another
    // process); the producers get copies of one, with their own request ID.
    let template = open_consumer(&pair.consumer, "template", n);
    let rss0 = settled_rss();
    for i in 0..n {
        open_consumer(&pair.consumer, "mem", i);
    }
    let rss_c = settled_rss();
    for i in 0..n {
        let mut hs = template.clone();
        hs.request_id = RequestId::new(format!("mem-{i}"));
        pair.producer
            .producer_open(
                hs.request_id.clone(),
                scattered_blocks(i, 8, 0x85EB_CA6B),
                cap(),
                1,
            )
            .expect("producer_open");
        pair.producer.producer_handshake(hs).expect("handshake");
    }
    let rss_p = settled_rss();
    let (c_live, _) = pair.consumer.live_requests();
    let (_, p_live) = pair.producer.live_requests();
    assert_eq!((c_live, p_live), (n as usize + 1, n as usize), "all actors alive");
    if !support::measuring() {
        println!("runtime memory: smoke run, {n} actors per side (not a measurement)");
        return;
    }

    let consumers = rss_c.saturating_sub(rss0);
    let producers = rss_p.saturating_sub(rss_c);
    let (per_c, per_p) = (consumers as f64 / n as f64, producers as f64 / n as f64);
    let per_10k = (per_c + per_p) / 2.0 * 10_000.0;
    println!(
        "runtime memory, RSS growth from /proc/self/statm (baseline {:.1} MB)",
        mb(rss0)
    );
    let rows = [
        (
            format!("{n} consumer actors (128 blocks authorized)"),
            consumers as f64,
            Some(per_c),
        ),
        (
            format!("{n} producer actors (128 blocks, handshake in)"),
            producers as f64,
            Some(per_p),
        ),
        (
            format!("all {} actors alive at once", 2 * n),
            (consumers + producers) as f64,
            None,
        ),
        ("10,000 request actors, half each side".to_string(), per_10k, None),
    ];
    for (what, bytes, per) in rows {
        let per = per.map(|b| format!("  ({b:.0} B/actor)")).unwrap_or_default();
        println!("  {what:<48} {:>7.1} MB{per}", bytes / 1e6);
    }
    println!(
        "  goal: <= 100 MB for 10,000 request actors: {}",
        if per_10k <= 100e6 { "met" } else { "MISSED" }
    );
}
