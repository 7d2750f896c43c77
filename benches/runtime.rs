//! Benchmarks of the request runtime itself, over [`support::InstantTransport`]
//! (a transport test double that completes every write at once), so what is
//! measured is the runtime's own cost, not Mooncake's:
//!
//! * `layer_ready_to_submit/forward_cpu`: CPU time per layer of the forward
//!   path alone, `Runtime::layer_ready` → `submit_write` (the façade and
//!   its answered trip to the request directory, the producer actor, the
//!   layer writer), summed over threads, with completions held back outside
//!   the measured windows. Goal: ≤ 5 µs per layer.
//! * `layer_ready_to_submit/gate_forward_cpu`: the same through
//!   `Runtime::layers_ready_after` with a mark already reached, the GPU
//!   worker's path: the caller numbers the mark and hands the layer to the
//!   directory without waiting; the writer checks the mark, then submits.
//! * `layer_ready_to_submit/steady_state_cpu`: process CPU time (all
//!   threads) per layer while a stream of `Runtime::layer_ready` calls is
//!   turned into `submit_write` calls — the façade, the producer actor, the
//!   layer writer, and also the completion path each write takes afterwards
//!   (poller, `BatchFinished`, `LayerWritten`): the whole per-layer cost.
//! * `layer_ready_to_submit/steady_state_wall`: wall time per layer for the
//!   same stream (the pipeline's throughput).
//! * `layer_ready_to_submit/one_at_a_time`: latency of one `layer_ready` to
//!   its `submit_write` with the runtime idle in between (includes waking two
//!   actor threads).
//! * `notification_router/delivered`: notices drained from
//!   `take_notifications`, parsed, routed to their consumer actor and
//!   handled there, per second.
//!
//! Before criterion runs, a breakdown of the CPU per layer by thread is
//! printed. Under `cargo test --all-targets` (no `--bench`) each benchmark
//! runs once as a smoke test and the breakdown is skipped. Run: `scripts/bench_runtime.sh` (or `cargo bench
//! --bench runtime`); memory is `benches/runtime_memory.rs`.

mod support;

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use orbitkv::actors::prefill::gate::{GateCall, Mark};

/// A layer mark already reached (a CUDA event whose kernels ran): the GPU
/// worker's path with the GPU ahead of nothing.
struct Reached;

impl Mark for Reached {
    fn wait(&mut self) -> Result<(), String> {
        Ok(())
    }

    fn poll(&mut self) -> Option<Result<(), String>> {
        Some(Ok(()))
    }
}
use orbitkv::{Handshake, Notice, Notification, Outcome, ProducerRank, RequestId, Runtime};
use support::{cap, scattered_blocks, InstantTransport, REQUEST_BLOCKS};

/// Layer requests stream their layers in; the 32 layers are cycled.
const LAYERS: u64 = 32;

/// The producer side under test, and a handshake to clone per request.
struct Producer {
    runtime: std::sync::Arc<Runtime>,
    transport: std::sync::Arc<InstantTransport>,
    template: Handshake,
    next: u32,
}

impl Producer {
    fn new() -> Self {
        let pair = support::pair();
        // One consumer handshake as a template (request ID and generation are
        // rewritten per request); the consumer runtime is not needed after.
        let template = support::open_consumer(&pair.consumer, "template", 0);
        drop(pair.consumer);
        let runtime = std::sync::Arc::new(pair.producer);
        Self {
            runtime,
            transport: pair.p_transport,
            template,
            next: 0,
        }
    }

    /// A producer request with its handshake in, ready to stream layers.
    fn open(&mut self) -> RequestId {
        self.next += 1;
        let req = RequestId::new(format!("bench-{}", self.next));
        let mut hs = self.template.clone();
        hs.request_id = req.clone();
        hs.generation = orbitkv::Generation::random();
        self.runtime
            .producer_open(req.clone(), scattered_blocks(self.next, 8, 0x85EB_CA6B), cap(), 1)
            .expect("producer_open");
        self.runtime.producer_handshake(hs).expect("handshake");
        req
    }

    /// Finishes `req` and waits until the producer released it.
    fn close(&self, req: &RequestId) {
        self.runtime.producer_finish(req).expect("finish");
        orbitkv::testing::wait_released(&self.runtime, req);
    }

    /// Streams `n` layers of a fresh request; returns (process CPU, wall)
    /// from the first `layer_ready` to the `n`-th `submit_write`.
    fn stream(&mut self, n: u64) -> (Duration, Duration) {
        let req = self.open();
        // Ranges, not submit calls: with group commit one batch may carry
        // several layers.
        let (base, rpl) = (self.transport.ranges(), ranges_per_layer(self) as u64);
        let (cpu0, t0) = (support::process_cpu(), Instant::now());
        for k in 0..n {
            self.runtime
                .layer_ready(&req, (k % LAYERS) as u32, 0..REQUEST_BLOCKS)
                .expect("layer_ready");
        }
        wait_sleeping(|| self.transport.ranges() >= base + n * rpl);
        let out = (support::process_cpu() - cpu0, t0.elapsed());
        self.close(&req);
        out
    }
}

/// Layers per window of [`Producer::forward`] at most (completions are held
/// that long): 64 layers of 8 MiB stay under the writer's 1 GiB in-flight
/// bound; the per-peer range cap may allow fewer.
const CHUNK: u64 = 64;

impl Producer {
    /// CPU time of the forward path alone, `layer_ready` → `submit_write`,
    /// for `n` layers: the caller's CPU in `layer_ready`, plus every runtime
    /// thread's CPU (the completion poller's excepted) until the last
    /// submit, while the double holds every batch in flight — so no
    /// completion work falls into the window. Between windows of [`CHUNK`]
    /// layers the writes complete, unmeasured.
    fn forward(&mut self, n: u64, via: Via) -> Duration {
        self.forward_by_thread(n, via).values().sum()
    }

    /// Hands layer `layer` of `req` to the runtime the way `via` says.
    fn admit(&self, req: &RequestId, layer: u32, via: Via) {
        match via {
            Via::LayerReady => self
                .runtime
                .layer_ready(req, layer, 0..REQUEST_BLOCKS)
                .expect("layer_ready"),
            Via::Gate => self.runtime.layers_ready_after(
                Some(Box::new(Reached)),
                vec![GateCall::Ready {
                    request: req.clone(),
                    layer,
                    blocks: 0..REQUEST_BLOCKS,
                }],
            ),
        }
    }

    /// [`Self::forward`] by thread name (the caller is `caller`).
    fn forward_by_thread(&mut self, n: u64, via: Via) -> std::collections::BTreeMap<String, Duration> {
        let others = support::ThreadClocks::new(&["orbitkv-poller"]);
        let mut out: std::collections::BTreeMap<String, Duration> = std::collections::BTreeMap::new();
        // A window must fit the per-peer range cap: batches beyond it wait
        // for completions, which are held inside the window.
        let fits = self.runtime.max_ranges_in_flight_per_peer() / ranges_per_layer(self).max(1);
        let window = (fits as u64).clamp(1, CHUNK);
        let req = self.open();
        let mut k = 0u64;
        while k < n {
            let m = (n - k).min(window);
            let (ranges, written) = (self.transport.ranges(), self.runtime.stats().layers_written);
            let rpl = ranges_per_layer(self) as u64;
            self.transport.hold(true);
            let (mine, theirs) = (support::thread_cpu_now(), others.each());
            for _ in 0..m {
                self.admit(&req, (k % LAYERS) as u32, via);
                k += 1;
            }
            *out.entry("caller".into()).or_default() += support::thread_cpu_now() - mine;
            // Every layer of the window submitted, or queued behind its
            // lane's one batch in flight (held here): with group commit the
            // queued ones go out together once the batch ends, outside the
            // window.
            wait_sleeping(|| {
                (self.transport.ranges() - ranges) / rpl + self.runtime.writes_queued() as u64 >= m
            });
            for ((name, after), before) in others.names.iter().zip(others.each()).zip(theirs) {
                *out.entry(name.clone()).or_default() += after.saturating_sub(before);
            }
            self.transport.hold(false);
            wait_sleeping(|| self.runtime.stats().layers_written >= written + m);
            // Let the producer take its `LayerWritten`s outside the window.
            std::thread::sleep(Duration::from_millis(2));
        }
        self.close(&req);
        out
    }
}

/// How the forward path hands a layer over.
#[derive(Debug, Clone, Copy)]
enum Via {
    /// `Runtime::layer_ready`, which answers (a trip to the request
    /// directory and back): the CPU worker's path (batched per layer there).
    LayerReady,
    /// `layers_ready_after` with a reached mark: the GPU worker's path;
    /// the caller does not wait.
    Gate,
}

/// Waits for `done` without burning the CPU being measured.
fn wait_sleeping(done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !done() {
        assert!(Instant::now() < deadline, "benchmark stuck");
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Per-thread CPU of a long steady-state stream, printed once.
fn breakdown(p: &mut Producer) {
    let n = 100_000u64;
    p.stream(5_000); // warm up
    let s0 = p.runtime.stats();
    let before = support::thread_cpu();
    let (cpu, wall) = p.stream(n);
    let after = support::thread_cpu();
    let s1 = p.runtime.stats();
    println!(
        "steady state, {n} layers ({} blocks, {} ranges each): process CPU {:.2} µs/layer, wall {:.2} µs/layer; \
         {} handed over inline, {} submitted inline, {} write ends fed to the producer on the lane's thread",
        REQUEST_BLOCKS,
        ranges_per_layer(p),
        cpu.as_nanos() as f64 / n as f64 / 1e3,
        wall.as_nanos() as f64 / n as f64 / 1e3,
        s1.layers_ready_inline - s0.layers_ready_inline,
        s1.writes_inline - s0.writes_inline,
        s1.writes_reported_inline - s0.writes_reported_inline
    );
    // The machine may be shared: repeat, and give the least disturbed run too.
    let m = 10_000u64;
    for via in [Via::LayerReady, Via::Gate] {
        let mut fwd: Vec<f64> = (0..7)
            .map(|_| p.forward(m, via).as_nanos() as f64 / m as f64 / 1e3)
            .collect();
        fwd.sort_by(f64::total_cmp);
        println!(
            "forward path only ({via:?} -> submit_write, completions held), 7 x {m} layers: \
             CPU µs/layer min {:.2}, median {:.2}, max {:.2}",
            fwd[0], fwd[3], fwd[6]
        );
    }
    // The computation alone, on one thread: planning one layer's ranges.
    let (src, mut out) = (scattered_blocks(1, 8, 0x85EB_CA6B), Vec::new());
    let t0 = Instant::now();
    for k in 0..m {
        out.clear();
        p.runtime
            .layout()
            .plan_layer(
                &p.template.layout,
                (k % LAYERS) as u32,
                &src,
                &p.template.block_ids,
                0..REQUEST_BLOCKS,
                &mut out,
            )
            .expect("plan");
    }
    println!(
        "plan_layer alone (the layer's {} ranges): {:.2} µs/layer",
        out.len(),
        t0.elapsed().as_nanos() as f64 / m as f64 / 1e3
    );
    // What the runtime's threads spend while nothing is handed over (their
    // timers: the notification router's poll): the floor under the
    // per-thread figures below, which include it.
    println!(
        "runtime threads idle (200 ms): {}",
        support::cpu_per_ms(&["orbitkv-poller"], Duration::from_millis(200))
    );
    for via in [Via::LayerReady, Via::Gate] {
        let s0 = p.runtime.stats();
        let by_thread = p.forward_by_thread(m, via);
        let s1 = p.runtime.stats();
        println!(
            "forward path ({via:?}) by thread, {m} layers ({} handed over inline, {} submitted inline):",
            s1.layers_ready_inline - s0.layers_ready_inline,
            s1.writes_inline - s0.writes_inline
        );
        for (name, d) in &by_thread {
            if !d.is_zero() {
                println!(
                    "  {name:<18} {:>6.2} µs/layer",
                    d.as_nanos() as f64 / m as f64 / 1e3
                );
            }
        }
    }
    println!("steady state by thread (incl. the completion path):");
    for (name, (ns, vol, invol)) in &after {
        let (ns0, vol0, invol0) = before.get(name).copied().unwrap_or((0, 0, 0));
        if ns > &ns0 {
            println!(
                "  thread {name:<16} {:>6.2} µs/layer; context switches/layer: {:.3} voluntary, {:.3} involuntary",
                (ns - ns0) as f64 / n as f64 / 1e3,
                (vol - vol0) as f64 / n as f64,
                (invol - invol0) as f64 / n as f64
            );
        }
    }
}

/// How many ranges one layer of a request coalesces into (for the printout).
fn ranges_per_layer(p: &Producer) -> usize {
    let src = scattered_blocks(p.next + 1, 8, 0x85EB_CA6B);
    let mut out = Vec::new();
    p.runtime
        .layout()
        .plan_layer(
            &p.template.layout,
            0,
            &src,
            &p.template.block_ids,
            0..REQUEST_BLOCKS,
            &mut out,
        )
        .expect("plan");
    out.len()
}

fn layer_ready_to_submit(c: &mut Criterion) {
    let mut p = Producer::new();
    if support::measuring() {
        breakdown(&mut p);
    }
    let mut g = c.benchmark_group("layer_ready_to_submit");
    g.throughput(Throughput::Elements(1));
    g.bench_function("forward_cpu", |b| {
        b.iter_custom(|iters| p.forward(iters, Via::LayerReady))
    });
    g.bench_function("gate_forward_cpu", |b| {
        b.iter_custom(|iters| p.forward(iters, Via::Gate))
    });
    g.bench_function("steady_state_cpu", |b| b.iter_custom(|iters| p.stream(iters).0));
    g.bench_function("steady_state_wall", |b| b.iter_custom(|iters| p.stream(iters).1));
    g.bench_function("one_at_a_time", |b| {
        b.iter_custom(|iters| {
            let req = p.open();
            let mut total = Duration::ZERO;
            for k in 0..iters {
                let base = p.transport.submits();
                let written = p.runtime.stats().layers_written;
                let t0 = Instant::now();
                p.runtime
                    .layer_ready(&req, (k % LAYERS) as u32, 0..REQUEST_BLOCKS)
                    .expect("layer_ready");
                while p.transport.submits() <= base {
                    std::thread::yield_now();
                }
                total += p.transport.last_submit().saturating_duration_since(t0);
                // Let the completion path settle before the next layer.
                wait_sleeping(|| p.runtime.stats().layers_written > written);
            }
            p.close(&req);
            total
        })
    });
    g.finish();
}

/// Consumers that notices are routed to (round-robin; after its first Done
/// a consumer drops further notices as duplicates, which is still a delivery).
const CONSUMERS: u32 = 10_000;

fn notification_router(c: &mut Criterion) {
    let pair = support::pair();
    let consumers = if support::measuring() { CONSUMERS } else { 100 };
    let notices: Vec<Notification> = (0..consumers)
        .map(|i| {
            let hs = support::open_consumer(&pair.consumer, "route", i);
            let req = hs.request_id.clone();
            let n = Notice {
                version: hs.version,
                request_id: req,
                generation: hs.generation,
                producer_rank: ProducerRank(0),
                outcome: Outcome::Done,
                reason: None,
                bytes: 1 << 20,
                staged: false,
                mac: None,
            }
            .sign(&hs.notice_key);
            Notification {
                name: "orbitkv".into(),
                message: n.to_json(),
            }
        })
        .collect();
    let delivered = |rt: &Runtime| {
        let s = rt.stats();
        (s.notices_routed, s.consumers_completed + s.events_dropped)
    };
    if support::measuring() {
        notice_latency(&pair, &notices, "default");
        // The pace before 2026-12-02, side by side.
        let old = support::pair_with(Duration::from_millis(1));
        let _keep = support::open_consumer(&old.consumer, "waits", 0);
        notice_latency(&old, &notices, "1 ms");
    }
    let mut g = c.benchmark_group("notification_router");
    g.throughput(Throughput::Elements(1));
    g.bench_function("delivered", |b| {
        b.iter_custom(|iters| {
            let batch: Vec<Notification> = (0..iters as usize)
                .map(|k| notices[k % notices.len()].clone())
                .collect();
            let (routed0, handled0) = delivered(&pair.consumer);
            let t0 = Instant::now();
            pair.c_transport.deliver(batch);
            wait_sleeping(|| {
                let (r, h) = delivered(&pair.consumer);
                r >= routed0 + iters && h >= handled0 + iters
            });
            let elapsed = t0.elapsed();
            pair.consumer.poll_events();
            elapsed
        })
    });
    g.finish();
}

/// With consumers waiting: one notice's latency from its arrival in the
/// transport's inbox to the router having routed it (the poll's pace:
/// spin-waited, medians of 300), and the CPU the router's threads spend
/// meanwhile per millisecond. Printed once.
fn notice_latency(pair: &support::Pair, notices: &[Notification], label: &str) {
    let routed = || pair.consumer.stats().notices_routed + pair.consumer.stats().notices_unknown_request;
    let cpu = support::cpu_per_ms(&["orbitkv-poller", "actix-rt"], Duration::from_millis(200));
    let mut lat: Vec<f64> = (0..300)
        .map(|k| {
            let r0 = routed();
            // a pseudo-random phase against the poll's
            std::thread::sleep(Duration::from_micros(50 + (k * 7919 % 1000) as u64));
            let t0 = Instant::now();
            pair.c_transport.deliver([notices[k % notices.len()].clone()]);
            let deadline = t0 + Duration::from_secs(10);
            while routed() <= r0 {
                assert!(Instant::now() < deadline, "notice never routed");
                std::hint::spin_loop();
            }
            t0.elapsed().as_nanos() as f64 / 1e3
        })
        .collect();
    pair.consumer.poll_events();
    lat.sort_by(f64::total_cmp);
    println!(
        "notice routed after (notify_poll {label}, consumers waiting): median {:.0} µs, p90 {:.0} µs, max {:.0} µs; \
         threads while waiting (200 ms): {}",
        lat[150],
        lat[270],
        lat[299],
        cpu
    );
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20)
}

criterion_group! {
    name = runtime;
    config = config();
    targets = layer_ready_to_submit, notification_router
}
criterion_main!(runtime);
