//! A model of a prefill GPU that runs behind its worker, through the real
//! Mooncake engine (TCP on 127.0.0.1, host memory): what a request whose
//! prefill already ran waits for when decode authorizes it late.
//!
//! Under load vLLM's CPU launches a step's layers well before the GPU runs
//! them (run 40: layers admitted 173 ms after launch on one H200); a layer
//! write waits for its layer's mark (a CUDA event). Meanwhile decode,
//! whose queue is full, authorizes requests whose prefill ran long ago:
//! their layers are all written by the GPU, and their writes reach writer
//! lanes that hold writes of requests still computing. This benchmark
//! replays that on CPU with marks that are reached a fixed `lag` after
//! they were pushed (a stand-in for CUDA events: [`Lagged`]):
//!
//! * a worker thread streams *computing* requests, one step every
//!   `STEP`: each step hands over `PER_STEP` requests' `LAYERS` layers, a
//!   layer of all of them behind one mark, the "GPU" reaching the step's
//!   marks one after another over the step, `lag` after their launch; then
//!   their finish;
//! * about every `LATE_EVERY` one request of a step is a *late* one:
//!   prefilled the same way, but decode authorizes it only
//!   `AUTHORIZED_AFTER` after the GPU ran its step's last layer:
//!   the time from that handshake to decode's `ConsumerCompleted` is what
//!   is measured (`late`), with the same for the computing requests from
//!   their last mark reached (`computing`).
//!
//! Every request's bytes are compared on decode after the run. This is a
//! model: Mooncake over TCP on one host, no GPU, the lag a constant; it
//! shows what a writer lane does with a write handed to it while the GPU
//! is behind, not what a GPU run would measure.
//!
//! Run: `cargo bench --bench gpu_lag` (prints one JSON line per lag).
//! Under `cargo test --all-targets` it runs one short round as a smoke test.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use orbitkv::actors::prefill::gate::{GateCall, Mark};
use orbitkv::testing::{block, host_rank_with, open_both, HostRank};
use orbitkv::{RequestId, RuntimeConfig, RuntimeEvent};

const LAYERS: u32 = 8;
const BLOCKS: u32 = 256;
/// Blocks per request (64 KiB a layer at 16 KiB a block).
const PER_REQUEST: u32 = 4;
const BLOCK_BYTES: u64 = 16 * 1024;
/// A prefill step: `PER_STEP` requests' `LAYERS` layers, the GPU taking
/// `STEP / LAYERS` a layer.
const STEP: Duration = Duration::from_millis(40);
const PER_STEP: u32 = 4;
const LATE_EVERY: Duration = Duration::from_millis(23);
/// How long after its layers' mark is reached decode authorizes a late
/// request.
const AUTHORIZED_AFTER: Duration = Duration::from_millis(3);

/// A mark the model's GPU reaches at `at`.
struct Lagged {
    at: Instant,
}

impl Mark for Lagged {
    fn wait(&mut self) -> Result<(), String> {
        let now = Instant::now();
        if self.at > now {
            std::thread::sleep(self.at - now);
        }
        Ok(())
    }

    fn poll(&mut self) -> Option<Result<(), String>> {
        (Instant::now() >= self.at).then_some(Ok(()))
    }
}

fn config() -> RuntimeConfig {
    RuntimeConfig {
        consumer_timeout: Duration::from_secs(20),
        ..RuntimeConfig::default()
    }
}

fn ready(req: &RequestId, layer: u32) -> GateCall {
    GateCall::Ready {
        request: req.clone(),
        layer,
        blocks: 0..PER_REQUEST,
    }
}

/// The blocks of the request in slot `slot` on one side (slots cycle; a
/// slot is reused only long after its request was released).
fn slot_blocks(slot: u32, side: u32) -> Vec<u32> {
    let base = (slot % (BLOCKS / PER_REQUEST / 2)) * PER_REQUEST * 2 + side * PER_REQUEST;
    (base..base + PER_REQUEST).collect()
}

#[derive(Default)]
struct Lat(Vec<f64>);

impl Lat {
    fn pct(&self, p: f64) -> f64 {
        let mut v = self.0.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        if v.is_empty() {
            return f64::NAN;
        }
        v[((v.len() - 1) as f64 * p).round() as usize]
    }
}

/// One round: `lag` behind, for `run`; returns the JSON line.
fn round(lag: Duration, run: Duration) -> String {
    let fill = |i: usize| (i.wrapping_mul(2_654_435_761) >> 7) as u8;
    let producer: HostRank = host_rank_with(LAYERS, BLOCKS, BLOCK_BYTES, (0, 1), 1, fill, config());
    let consumer: HostRank = host_rank_with(LAYERS, BLOCKS, BLOCK_BYTES, (0, 1), 1, |_| 0, config());
    let (p, c) = (producer.runtime.clone(), consumer.runtime.clone());

    // Decode's events: completion times by request; released at once.
    let done: Arc<parking_lot::Mutex<HashMap<RequestId, Instant>>> = Default::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (c, done, stop) = (c.clone(), done.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut failed = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match c.next_event(Duration::from_millis(20)) {
                    Some(RuntimeEvent::ConsumerCompleted { request, .. }) => {
                        done.lock().insert(request, Instant::now());
                    }
                    Some(RuntimeEvent::ConsumerFailed { request, reason, .. }) => {
                        failed += 1;
                        eprintln!("{request}: failed: {reason}");
                    }
                    _ => {}
                }
            }
            failed
        })
    };
    let drain = {
        let (p, stop) = (p.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = p.next_event(Duration::from_millis(20));
            }
        })
    };

    // (request, its slot, when measured from: a late request's handshake,
    // a computing request's last mark)
    let mut late: Vec<(RequestId, u32, Instant)> = Vec::new();
    let mut computing: Vec<(RequestId, u32, Instant)> = Vec::new();
    let mut pending: std::collections::VecDeque<(Instant, RequestId, u32, orbitkv::Handshake)> =
        Default::default();
    let (start, mut slot) = (Instant::now(), 0u32);
    let (mut next_step, mut next_late) = (start, start + LATE_EVERY);
    while start.elapsed() < run {
        let now = Instant::now();
        while pending.front().is_some_and(|(at, ..)| *at <= now) {
            let (_, req, slot, hs) = pending.pop_front().expect("checked");
            let t = Instant::now();
            p.producer_handshake(hs).expect("late handshake");
            late.push((req, slot, t));
        }
        if now >= next_step {
            next_step += STEP;
            // One request of the step is a late one when its turn came:
            // decode authorizes it only after the GPU ran the step.
            let with_late = now >= next_late;
            if with_late {
                next_late += LATE_EVERY;
            }
            let reqs: Vec<(RequestId, u32, Option<orbitkv::Handshake>)> = (0..PER_STEP)
                .map(|k| {
                    slot += 1;
                    let is_late = with_late && k == 0;
                    let name = if is_late { "late" } else { "computing" };
                    let req = RequestId::new(format!("{name}-{slot}"));
                    let hs = open_both(&p, &c, &req, &slot_blocks(slot, 0), &slot_blocks(slot, 1));
                    if is_late {
                        return (req, slot, Some(hs));
                    }
                    p.producer_handshake(hs).expect("computing handshake");
                    (req, slot, None)
                })
                .collect();
            let at = now + lag;
            for l in 0..LAYERS {
                // The step's layers are launched together, one mark a layer
                // for every request of the step; the GPU writes them one
                // after another over the step, `lag` behind.
                let at = at + STEP * (l + 1) / LAYERS;
                let calls = reqs.iter().map(|(r, ..)| ready(r, l)).collect();
                p.layers_ready_after(Some(Box::new(Lagged { at })), calls);
            }
            for (req, s, hs) in reqs {
                p.producer_finish_after(&req).expect("finish");
                match hs {
                    Some(hs) => pending.push_back((at + STEP + AUTHORIZED_AFTER, req, s, hs)),
                    None => computing.push((req, s, at + STEP)),
                }
            }
        }
        let wake = next_step
            .min(next_late)
            .min(pending.front().map_or(next_step, |(at, ..)| *at));
        let now = Instant::now();
        if wake > now {
            std::thread::sleep(wake - now);
        }
    }
    // Every request completes.
    let all = late.len() + computing.len();
    let deadline = Instant::now() + Duration::from_secs(30);
    while done.lock().len() < all {
        assert!(
            Instant::now() < deadline,
            "{} of {all} requests completed",
            done.lock().len()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let failed = reader.join().expect("reader");
    drain.join().expect("drain");
    assert_eq!(failed, 0, "no request may fail");

    let done = done.lock();
    let lat = |set: &[(RequestId, u32, Instant)]| {
        Lat(set
            .iter()
            .map(|(r, _, t)| done[r].saturating_duration_since(*t).as_secs_f64() * 1e3)
            .collect())
    };
    let (l, k) = (lat(&late), lat(&computing));
    // Only the last request of each slot is still in the pages (slots cycle):
    // check those bytes, every layer.
    let mut last: HashMap<u32, u32> = HashMap::new();
    for (_, s, _) in late.iter().chain(computing.iter()) {
        last.insert(s % (BLOCKS / PER_REQUEST / 2), *s);
    }
    for s in last.values() {
        for layer in 0..LAYERS {
            for (src, dst) in slot_blocks(*s, 0).into_iter().zip(slot_blocks(*s, 1)) {
                assert_eq!(
                    block(&consumer, layer, dst),
                    block(&producer, layer, src),
                    "slot {s} layer {layer}"
                );
            }
        }
    }
    for (r, _, _) in late.iter().chain(computing.iter()) {
        let _ = c.consumer_release(r);
    }
    let st = p.stats();
    format!(
        "{{\"lag_ms\": {}, \"late\": {}, \"late_p50_ms\": {:.2}, \"late_p90_ms\": {:.2}, \"late_max_ms\": {:.2}, \
         \"computing\": {}, \"computing_p50_ms\": {:.2}, \"computing_p90_ms\": {:.2}, \"writes_ahead_of_gpu\": {}, \
         \"write_batches\": {}, \"layers_written\": {}, \"write_gpu_wait_ms\": {:.1}}}",
        lag.as_millis(),
        l.0.len(),
        l.pct(0.5),
        l.pct(0.9),
        l.pct(1.0),
        k.0.len(),
        k.pct(0.5),
        k.pct(0.9),
        st.writes_ahead_of_gpu,
        st.write_batches,
        st.layers_written,
        st.write_gpu_wait_micros as f64 / 1e3,
    )
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    if !bench {
        // `cargo test --all-targets`: one short round.
        println!("{}", round(Duration::from_millis(10), Duration::from_millis(400)));
        return;
    }
    for lag in [20, 40, 80] {
        println!("{}", round(Duration::from_millis(lag), Duration::from_secs(4)));
    }
}
