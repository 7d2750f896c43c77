//! Shared by the runtime benchmarks (`benches/runtime.rs`,
//! `benches/runtime_memory.rs`): [`InstantTransport`], the crate's transport
//! **test double** (`orbitkv::transport::fake`), which completes every write
//! at once and moves no bytes, so the
//! benchmarks measure the runtime's own CPU and memory, not Mooncake; and a
//! few helpers (KV geometry, process CPU clock, RSS).

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use orbitkv::{KvLayout, LayerGeometry, Plane, Runtime, RuntimeConfig};

/// The crate's transport test double (`orbitkv::transport::fake`, cargo
/// feature `testing`): `submit_write` records when it was called and returns
/// a batch that `poll` reports complete at once (unless held); notifications
/// are served from a queue the benchmark fills.
pub use orbitkv::transport::fake::FakeTransport as InstantTransport;

/// A Llama-3-8B-like KV cache at fake addresses (the double never touches
/// them): 32 layers, K and V as two planes, 32 KiB per block per plane
/// (16 tokens x 8 KV heads x 128 dims x fp16), `num_blocks` blocks.
pub fn layout(base: u64, num_blocks: u32) -> KvLayout {
    const BLOCK: u64 = 32 << 10;
    let plane_bytes = num_blocks as u64 * BLOCK;
    KvLayout {
        token_order: None,
        num_blocks,
        block_size: 16,
        total_kv_heads: 8,
        tp_rank: 0,
        tp_size: 1,
        head_major: true,
        layers: (0..32u64)
            .map(|l| LayerGeometry {
                planes: (0..2u64)
                    .map(|p| Plane {
                        base: base + (2 * l + p) * plane_bytes,
                        block_stride: BLOCK,
                        block_bytes: BLOCK,
                    })
                    .collect(),
                group: 0,
            })
            .collect(),
    }
}

pub const NUM_BLOCKS: u32 = 8192;
/// Blocks per request: 2,048 tokens.
pub const REQUEST_BLOCKS: u32 = 128;

/// Request `i`'s blocks as a paged allocator leaves them: runs of `run`
/// contiguous blocks at scattered places (`run` a power of two; an odd
/// multiplier permutes the run slots, so a request's runs are distinct).
pub fn scattered_blocks(i: u32, run: u32, mult: u32) -> Vec<u32> {
    let runs = REQUEST_BLOCKS / run;
    let slots = NUM_BLOCKS / run;
    (0..runs)
        .flat_map(|r| {
            let slot = (i.wrapping_mul(runs) + r).wrapping_mul(mult | 1) % slots;
            (0..run).map(move |k| slot * run + k)
        })
        .collect()
}

/// A producer and a consumer runtime over [`InstantTransport`]s.
pub struct Pair {
    pub producer: Runtime,
    pub consumer: Runtime,
    pub p_transport: Arc<InstantTransport>,
    pub c_transport: Arc<InstantTransport>,
}

pub fn pair() -> Pair {
    pair_with(RuntimeConfig::default().notify_poll)
}

/// [`pair`] with the routers draining notifications every `notify_poll`
/// while a consumer waits.
pub fn pair_with(notify_poll: Duration) -> Pair {
    let p_transport = Arc::new(InstantTransport::new("127.0.0.1:10001"));
    let c_transport = Arc::new(InstantTransport::new("127.0.0.1:10002"));
    let cfg = RuntimeConfig {
        consumer_timeout: Duration::from_secs(3600),
        handshake_timeout: Duration::from_secs(3600),
        notify_poll,
        ..RuntimeConfig::default()
    };
    let producer = Runtime::start(
        p_transport.clone(),
        layout(0x1000_0000_0000, NUM_BLOCKS),
        cfg.clone(),
    )
    .expect("producer runtime");
    let consumer = Runtime::start(c_transport.clone(), layout(0x2000_0000_0000, NUM_BLOCKS), cfg)
        .expect("consumer runtime");
    Pair {
        producer,
        consumer,
        p_transport,
        c_transport,
    }
}

/// Whether this is a measuring run (`cargo bench` passes `--bench`); under
/// `cargo test --all-targets` the benchmarks run once, small, as a smoke test.
pub fn measuring() -> bool {
    std::env::args().any(|a| a == "--bench")
}

// ---------------------------------------------------------------- clocks

#[repr(C)]
struct Timespec {
    tv_sec: i64,
    tv_nsec: i64,
}

extern "C" {
    fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
    fn sysconf(name: i32) -> i64;
}

const CLOCK_PROCESS_CPUTIME_ID: i32 = 2;

fn clock(id: i32) -> Option<Duration> {
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; Linux x86_64/aarch64 layout.
    let rc = unsafe { clock_gettime(id, &mut ts) };
    (rc == 0).then(|| Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

/// The CPU clocks of this process's threads, except those named in
/// `exclude`, read with `clock_gettime` on each thread's CPU clock id (the
/// kernel's `MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)`, what glibc's
/// `pthread_getcpuclockid` returns).
pub struct ThreadClocks {
    pub names: Vec<String>,
    ids: Vec<i32>,
}

impl ThreadClocks {
    /// Every thread but the calling one and those whose name starts with
    /// one of `exclude`.
    pub fn new(exclude: &[&str]) -> Self {
        let me = std::fs::read_link("/proc/thread-self").ok().and_then(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.parse::<i32>().ok())
        });
        let (mut names, mut ids) = (Vec::new(), Vec::new());
        for task in std::fs::read_dir("/proc/self/task")
            .expect("/proc/self/task")
            .flatten()
        {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            let comm = comm.trim().to_string();
            let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<i32>().ok()) else {
                continue;
            };
            if Some(tid) == me || exclude.iter().any(|e| comm.starts_with(e)) {
                continue;
            }
            names.push(comm);
            ids.push((!tid << 3) | 6);
        }
        Self { names, ids }
    }

    /// CPU time of each thread (in the order of [`Self::names`]).
    pub fn each(&self) -> Vec<Duration> {
        self.ids.iter().map(|&id| clock(id).unwrap_or_default()).collect()
    }
}
const SC_PAGESIZE: i32 = 30;

/// CPU time of the calling thread so far.
pub fn thread_cpu_now() -> Duration {
    clock(3).expect("CLOCK_THREAD_CPUTIME_ID")
}

/// CPU time of the whole process (every thread) so far.
pub fn process_cpu() -> Duration {
    let mut ts = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; Linux x86_64/aarch64 layout.
    let rc = unsafe { clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Resident set size from `/proc/self/statm`, in bytes.
pub fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("resident pages");
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { sysconf(SC_PAGESIZE) };
    pages * page.max(4096) as u64
}

/// Per thread name: (CPU ns from `/proc/self/task/*/schedstat`, voluntary
/// and involuntary context switches from `status`).
pub fn thread_cpu() -> std::collections::BTreeMap<String, (u64, u64, u64)> {
    let mut out = std::collections::BTreeMap::new();
    for task in std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .flatten()
    {
        let p = task.path();
        let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        let ns: u64 = std::fs::read_to_string(p.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
            .unwrap_or(0);
        let status = std::fs::read_to_string(p.join("status")).unwrap_or_default();
        let switches = |key: &str| -> u64 {
            status
                .lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
                .unwrap_or(0)
        };
        let e = out.entry(comm.trim().to_string()).or_insert((0, 0, 0));
        e.0 += ns;
        e.1 += switches("voluntary_ctxt_switches:");
        e.2 += switches("nonvoluntary_ctxt_switches:");
    }
    out
}

/// The capability every request shares (the proxy would give each its own).
pub use orbitkv::testing::capability as cap;

/// A consumer request `{prefix}-{i}` authorized on `rt` (four-block runs
/// of scattered blocks, a TP-1 producer), as every benchmark opens them.
pub fn open_consumer(rt: &Runtime, prefix: &str, i: u32) -> orbitkv::Handshake {
    rt.consumer_open(
        orbitkv::RequestId::new(format!("{prefix}-{i}")),
        cap(),
        0,
        scattered_blocks(i, 4, 0x9E37_79B1),
        1,
    )
    .expect("consumer_open")
}

/// The CPU this process's threads (but the calling one and those named
/// with a prefix in `exclude`) spend per millisecond over `window`, as
/// `name X µs/ms` for each that spent any.
pub fn cpu_per_ms(exclude: &[&str], window: Duration) -> String {
    let clocks = ThreadClocks::new(exclude);
    let before = clocks.each();
    std::thread::sleep(window);
    let ms = window.as_secs_f64() * 1e3;
    let spent: Vec<String> = clocks
        .names
        .iter()
        .zip(clocks.each().iter().zip(&before))
        .filter(|(_, (a, b))| a > b)
        .map(|(n, (a, b))| format!("{n} {:.2} µs/ms", (*a - *b).as_nanos() as f64 / ms / 1e3))
        .collect();
    spent.join(", ")
}
