//! What the scenario examples share: ranks whose KV cache is host memory
//! registered with a real Mooncake engine on 127.0.0.1, each with its own
//! [`Runtime`]; byte checks against guard bytes; waiting for runtime events;
//! a step-by-step report with one verdict line; and a Chrome trace of the
//! actors (`target/scenario-traces/<scenario>.json`, opens in Perfetto).
//!
//! Source bytes have the high bit clear and the guard byte has it set, so a
//! block that was not written never passes for written.

#![allow(dead_code)] // each scenario uses part of this

use std::fmt::Display;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use orbitkv::trace::{ChromeTrace, ChromeTraceGuard};
use orbitkv::{
    EngineConfig, Generation, KvLayout, MooncakeTransferEngine, Outcome, RequestId, Runtime, RuntimeConfig,
    RuntimeEvent,
};

/// What unwritten destination memory holds.
pub const GUARD: u8 = 0xA5;
pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;

/// What a rank's memory starts as.
#[derive(Debug, Clone, Copy)]
pub enum Fill {
    /// Every byte [`GUARD`] (a consumer's cache).
    Guard,
    /// A source pattern seeded by the value, high bit clear; every 4 KiB page
    /// differs from its neighbours, so a block copied to the wrong place shows.
    Source(u64),
}

impl Fill {
    fn apply(self, bytes: &mut [u8]) {
        match self {
            Fill::Guard => bytes.fill(GUARD),
            Fill::Source(seed) => {
                const PAGE: usize = 4096;
                let period: Vec<u8> = (0..PAGE + 127)
                    .map(|j| ((j as u64 * 31 + seed * 97) % 127) as u8)
                    .collect();
                for (p, page) in bytes.chunks_mut(PAGE).enumerate() {
                    let phase = (p * 13) % 127;
                    page.copy_from_slice(&period[phase..phase + page.len()]);
                }
            }
        }
    }
}

// ------------------------------------------------------------ memory

/// Page-aligned host memory that Mooncake reads or writes by address, behind
/// Rust's back; read only through [`Self::read`], never through a reference
/// held across a transfer.
pub struct HostMemory {
    buf: Vec<u64>,
}

impl HostMemory {
    pub fn new(bytes: u64, fill: Fill) -> Self {
        let m = Self {
            buf: vec![0u64; (bytes as usize).div_ceil(8) + 512],
        };
        let (base, len) = (m.addr(), bytes as usize);
        // SAFETY: `base..base + len` lies inside `buf` (512 spare words cover
        // the alignment shift), which we own mutably; no transfer uses it yet.
        fill.apply(unsafe { std::slice::from_raw_parts_mut(base as *mut u8, len) });
        m
    }

    /// First address, aligned to 4 KiB.
    pub fn addr(&self) -> u64 {
        (self.buf.as_ptr() as u64).next_multiple_of(4096)
    }

    /// A copy of `len` bytes at `addr` (inside this memory).
    pub fn read(&self, addr: u64, len: u64) -> Vec<u8> {
        let start = self.buf.as_ptr() as u64;
        let end = start + self.buf.len() as u64 * 8;
        assert!(addr >= start && addr + len <= end, "read outside the memory");
        let mut out = vec![0u8; len as usize];
        // SAFETY: the range is inside `buf` (checked above); a plain byte copy
        // from a raw pointer, so no reference aliases memory Mooncake may write.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), len as usize) };
        out
    }
}

// ------------------------------------------------------------ ranks

/// One TP rank: its KV cache (one plane per layer, layer after layer), a
/// Mooncake engine with that memory registered, and a runtime.
pub struct Rank {
    pub name: String,
    // Dropped first: the runtime stops before its memory goes away.
    pub runtime: Runtime,
    pub layout: KvLayout,
    pub mem: HostMemory,
}

pub struct RankSpec {
    pub layers: u32,
    pub blocks: u32,
    pub block_bytes: u64,
    /// (rank, size)
    pub tp: (u32, u32),
    pub kv_heads: u32,
}

impl Rank {
    /// A rank whose memory is filled by `fill` (source pattern or guard).
    pub fn new(name: &str, spec: &RankSpec, fill: Fill, cfg: RuntimeConfig) -> Self {
        let size = spec.layers as u64 * spec.blocks as u64 * spec.block_bytes;
        let mem = HostMemory::new(size, fill);
        let base = mem.addr();
        let layout = KvLayout::packed(
            base,
            spec.layers,
            spec.blocks,
            spec.block_bytes,
            spec.tp,
            spec.kv_heads,
        );
        let engine = MooncakeTransferEngine::new(&EngineConfig::default())
            .unwrap_or_else(|e| fail_setup(&format!("start a Mooncake engine for {name}"), e));
        engine
            .register_memory(base, size, "cpu:0")
            .unwrap_or_else(|e| fail_setup(&format!("register {name}'s KV memory"), e));
        let runtime = Runtime::start(Arc::new(engine), layout.clone(), cfg)
            .unwrap_or_else(|e| fail_setup(&format!("start {name}'s runtime"), e));
        Rank {
            name: name.to_string(),
            runtime,
            layout,
            mem,
        }
    }

    /// The bytes of block `b` of `layer`.
    pub fn block(&self, layer: u32, b: u32) -> Vec<u8> {
        let p = self.layout.layers[layer as usize].planes[0];
        self.mem.read(p.block_addr(b), p.block_bytes)
    }

    pub fn layers(&self) -> u32 {
        self.layout.layers.len() as u32
    }
}

fn fail_setup(what: &str, e: impl Display) -> ! {
    eprintln!("setup failed: cannot {what}: {e}");
    eprintln!("(run `source scripts/env.sh` first so that Mooncake is found)");
    std::process::exit(2)
}

/// Runtime settings for a scenario: short deadlines, so it runs in seconds.
/// The quarantine (how long past its deadline a consumer keeps the blocks of
/// a producer that never ended) is as long as the deadline.
pub fn config(consumer_timeout: Duration) -> RuntimeConfig {
    RuntimeConfig {
        consumer_timeout,
        quarantine: consumer_timeout,
        handshake_timeout: Duration::from_secs(10),
        write_timeout: Duration::from_secs(10),
        ..RuntimeConfig::default()
    }
}

// ------------------------------------------------------------ events

/// Waits up to `within` for an event matching `pred`; other events are
/// returned in `seen` order, so nothing is lost.
pub fn wait_for(
    rank: &Rank,
    within: Duration,
    seen: &mut Vec<RuntimeEvent>,
    pred: impl Fn(&RuntimeEvent) -> bool,
) -> Option<RuntimeEvent> {
    let deadline = Instant::now() + within;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        if let Some(ev) = rank.runtime.next_event(left.min(Duration::from_millis(50))) {
            seen.push(ev.clone());
            if pred(&ev) {
                return Some(ev);
            }
        }
    }
    None
}

/// Every event that arrives within `dur`.
pub fn collect(rank: &Rank, dur: Duration) -> Vec<RuntimeEvent> {
    let deadline = Instant::now() + dur;
    let mut out = Vec::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        if let Some(ev) = rank.runtime.next_event(left.min(Duration::from_millis(50))) {
            out.push(ev);
        }
    }
    out
}

pub fn is_released_consumer(ev: &RuntimeEvent, g: Generation) -> bool {
    matches!(ev, RuntimeEvent::ConsumerReleased { generation, .. } if *generation == g)
}

pub fn is_verdict(ev: &RuntimeEvent, g: Generation) -> bool {
    matches!(ev, RuntimeEvent::ConsumerCompleted { generation, .. }
        | RuntimeEvent::ConsumerFailed { generation, .. } if *generation == g)
}

pub fn is_producer_released(ev: &RuntimeEvent) -> bool {
    matches!(ev, RuntimeEvent::ProducerReleased { .. })
}

pub fn count(events: &[RuntimeEvent], pred: impl Fn(&RuntimeEvent) -> bool) -> usize {
    events.iter().filter(|e| pred(e)).count()
}

/// One line for an event.
pub fn describe(ev: &RuntimeEvent) -> String {
    match ev {
        RuntimeEvent::ConsumerCompleted {
            request,
            generation,
            bytes,
            ..
        } => format!("consumer {request} {generation}: COMPLETED ({bytes} bytes)"),
        RuntimeEvent::ConsumerFailed {
            request,
            generation,
            reason,
            held,
        } => format!(
            "consumer {request} {generation}: FAILED ({reason}){}",
            if *held {
                "; blocks held until every producer ended or the quarantine passed"
            } else {
                ""
            }
        ),
        RuntimeEvent::ConsumerQuiesced { request, generation } => {
            format!("consumer {request} {generation}: quiesced (no producer waited for any more)")
        }
        RuntimeEvent::ConsumerReleased { request, generation } => {
            format!("consumer {request} {generation}: released (blocks may be freed)")
        }
        RuntimeEvent::ProducerReleased {
            request,
            outcome,
            reason,
        } => format!(
            "producer {request}: released, outcome {}{}",
            outcome_name(*outcome),
            reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
        ),
    }
}

pub fn outcome_name(o: Outcome) -> &'static str {
    match o {
        Outcome::Done => "done",
        Outcome::Failed => "failed",
        Outcome::Aborted => "aborted",
    }
}

// ------------------------------------------------------------ bytes

/// Checks the consumer's blocks of `layers`: each block in `expect` must
/// equal the given producer block (its whole bytes, or `part` of them), and
/// every other byte of every block must still be the guard.
pub struct Expect<'a> {
    /// (consumer block, producer, producer block, byte range of the consumer block)
    pub written: Vec<(u32, &'a Rank, u32, std::ops::Range<usize>)>,
}

/// Compares the consumer's `layer` against `expect`; returns the first
/// difference.
pub fn check_layer(consumer: &Rank, layer: u32, expect: &Expect<'_>) -> Result<(), String> {
    for b in 0..consumer.layout.num_blocks {
        let got = consumer.block(layer, b);
        let mut want = vec![GUARD; got.len()];
        let mut from = vec![None; got.len().div_ceil(4096)];
        for (cb, prod, pb, range) in &expect.written {
            if *cb == b {
                let src = prod.block(layer, *pb);
                want[range.clone()].copy_from_slice(&src[..range.len()]);
                from[range.start / 4096..range.end.div_ceil(4096)].fill(Some((&prod.name, *pb)));
            }
        }
        if got != want {
            let i = (0..got.len()).find(|&i| got[i] != want[i]).expect("they differ");
            return Err(match from[i / 4096] {
                Some((name, pb)) => format!(
                    "layer {layer} block {b} byte {i} is {:#04x}, not {name} block {pb}'s {:#04x}",
                    got[i], want[i]
                ),
                None => format!(
                    "layer {layer} block {b} byte {i} was written ({:#04x}) but nothing may write there",
                    got[i]
                ),
            });
        }
    }
    Ok(())
}

// ------------------------------------------------------------ report

/// Prints the scenario step by step and decides the verdict.
pub struct Report {
    name: &'static str,
    started: Instant,
    checks: usize,
    broken: Vec<String>,
    trace: Option<(PathBuf, ChromeTraceGuard)>,
}

impl Report {
    /// Prints the scenario's title and story; installs the Chrome trace.
    pub fn start(name: &'static str, story: &str) -> Self {
        println!("== {name}");
        for line in story.lines() {
            println!("   {line}");
        }
        println!();
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/scenario-traces");
        let path = dir.join(format!("{name}.json"));
        let trace = match std::fs::create_dir_all(&dir)
            .map_err(|e| e.to_string())
            .and_then(|_| ChromeTrace::install(path.clone()).map_err(|e| e.to_string()))
        {
            Ok(guard) => Some((path, guard)),
            Err(e) => {
                println!("(no trace: {e})");
                None
            }
        };
        Report {
            name,
            started: Instant::now(),
            checks: 0,
            broken: Vec::new(),
            trace,
        }
    }

    fn stamp(&self) -> String {
        format!("[{:>6.1} ms]", self.started.elapsed().as_secs_f64() * 1e3)
    }

    /// Something the scenario did or saw.
    pub fn step(&self, what: impl Display) {
        println!("{} {what}", self.stamp());
    }

    /// A rule of the contract, checked: prints `ok` or `BROKEN`.
    pub fn check(&mut self, ok: bool, what: impl Display) -> bool {
        self.checks += 1;
        if ok {
            println!("{}   ok      {what}", self.stamp());
        } else {
            println!("{}   BROKEN  {what}", self.stamp());
            self.broken.push(what.to_string());
        }
        ok
    }

    /// A check whose detail is a `Result`.
    pub fn check_result(&mut self, r: Result<(), String>, what: impl Display) -> bool {
        match r {
            Ok(()) => self.check(true, what),
            Err(e) => self.check(false, format!("{what}: {e}")),
        }
    }

    /// Writes the trace and prints the verdict line; non-zero if anything broke.
    /// Call after the ranks are dropped (their runtimes stopped).
    pub fn finish(self) -> ExitCode {
        println!();
        if let Some((path, guard)) = &self.trace {
            match guard.flush() {
                Ok(_) => println!(
                    "trace: {} ({} events; open it in https://ui.perfetto.dev)",
                    path.display(),
                    guard.len()
                ),
                Err(e) => println!("trace not written: {e}"),
            }
        }
        if self.broken.is_empty() {
            println!("VERDICT {}: contract held ({} checks)", self.name, self.checks);
            ExitCode::SUCCESS
        } else {
            println!(
                "VERDICT {}: CONTRACT BROKEN ({} of {} checks failed)",
                self.name,
                self.broken.len(),
                self.checks
            );
            for b in &self.broken {
                println!("  - {b}");
            }
            ExitCode::FAILURE
        }
    }
}

/// A request ID unique to this run.
pub fn request(name: &str) -> RequestId {
    RequestId::new(format!("{name}-{}", std::process::id()))
}

/// The capability every request shares (the proxy would give each its own).
pub use orbitkv::testing::capability as cap;
