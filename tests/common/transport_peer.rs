//! Helpers for the host loopback gate (`tests/transport_loopback.rs`):
//!
//! * [`Region`]: page-aligned memory that Mooncake reads or writes behind
//!   Rust's back (a KV tensor stand-in);
//! * [`Plan`]: a deterministic set of WRITE batches of mixed sizes into a
//!   multi-layer, multi-block destination, with the source bytes and the
//!   destination bytes it must produce;
//! * [`check_dump`]: the byte check (ranges equal the source, every other
//!   byte still the guard pattern), with a message naming the first wrong byte;
//! * [`Peer`]: a second process (this test binary re-invoked) that owns an
//!   engine and a destination region and obeys one-line commands on stdin.
//!
//! Data and guard bytes are disjoint by construction: guard bytes have the
//! high bit set, source bytes have it clear, so a range that was not written
//! (even a single byte) never passes for written.

#![allow(dead_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};
use orbitkv::{EngineConfig, MooncakeTransferEngine, TransportError, WriteRange};

/// Set in the environment of a peer process; names its role.
pub const PEER_ENV: &str = "ORBITKV_TEST_PEER";
/// The `#[test]` function that is the peer's entry point.
pub const PEER_TEST_NAME: &str = "peer_process_entry";
/// Prefix of every protocol line a peer prints (libtest prints other lines).
const TAG: &str = "OKVPEER";

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;

// ---------------------------------------------------------------- patterns

/// The tests' seeded generator (`fastrand`): the same seed gives the same
/// stream in every process, so a peer regenerates what the producer wrote.
pub struct Rng(fastrand::Rng);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(fastrand::Rng::with_seed(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.u64(..)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        self.0.u64(lo..=hi)
    }
}

/// Tiles `buf` with a pseudo-random block of `period` bytes (a prime, so a
/// shifted copy does not line up with itself), OR-ing `or` and AND-ing `and`.
fn tile(buf: &mut [u8], seed: u64, period: usize, or: u8, and: u8) {
    let mut rng = Rng::new(seed);
    let block: Vec<u8> = (0..period)
        .map(|_| ((rng.next_u64() >> 32) as u8 | or) & and)
        .collect();
    for chunk in buf.chunks_mut(period) {
        let n = chunk.len();
        chunk.copy_from_slice(&block[..n]);
    }
}

/// Guard pattern of destination region `region`: every byte has its high bit set.
pub fn fill_guard(buf: &mut [u8], seed: u64, region: usize) {
    tile(buf, seed ^ (0xA5A5_0000 + region as u64), 4099, 0x80, 0xFF);
}

/// Source pattern: every byte has its high bit clear.
pub fn fill_source(buf: &mut [u8], seed: u64) {
    tile(buf, seed ^ 0x5EED_0000_0000, 1_048_583, 0x00, 0x7F);
}

// ------------------------------------------------------------------ Region

/// Page-aligned heap memory handed to Mooncake by address. Mooncake's threads
/// write into it (destination) or read it (source) while no Rust reference to
/// it exists; the owner only looks at it between transfers.
pub struct Region {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a Region is a plain owned allocation; cross-thread access to its
// bytes is coordinated by the protocol (no slice is live during a transfer).
unsafe impl Send for Region {}

impl Region {
    pub fn new(len: u64) -> Self {
        assert!(len > 0);
        let layout = Layout::from_size_align(len as usize, 4096).expect("layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "allocation of {len} bytes failed");
        Region {
            ptr,
            len: len as usize,
        }
    }
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }
    pub fn len(&self) -> u64 {
        self.len as u64
    }
    /// The bytes. Call only while no transfer touches the region.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of `len` initialised bytes; the
        // callers keep no transfer in flight while the slice lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    /// The bytes, mutably. Call only while no transfer touches the region.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes the slice unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, 4096).expect("layout");
        // SAFETY: allocated in `new` with this very layout, freed once.
        unsafe { dealloc(self.ptr, layout) };
    }
}

// -------------------------------------------------------------------- Plan

/// One WRITE of the plan, in offsets: `len` bytes from `src_off` of the
/// source to `dst_off` of destination region (layer) `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedRange {
    pub src_off: u64,
    pub region: usize,
    pub dst_off: u64,
    pub len: u64,
}

/// Batches of WRITEs into `region_lens.len()` destination regions (one per
/// layer), reading from one source buffer of `src_len` bytes.
#[derive(Debug, Clone)]
pub struct Plan {
    pub region_lens: Vec<u64>,
    pub batches: Vec<Vec<PlannedRange>>,
    pub src_len: u64,
    pub seed: u64,
}

/// Which plan (both sides of a test build the same one from its name and seed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanKind {
    /// 2 layers x 72 blocks x 1 MiB; 1-byte ranges, unaligned offsets and
    /// lengths, 4 KiB, 1 MiB, a 64 MiB range over 64 coalesced blocks, ranges
    /// at both edges of a region, ~700 ranges in 2 batches.
    Full,
    /// 3 layers x 8 blocks x 64 KiB, a few dozen ranges: for quick tests.
    Small,
}

impl PlanKind {
    pub fn name(self) -> &'static str {
        match self {
            PlanKind::Full => "full",
            PlanKind::Small => "small",
        }
    }
    pub fn parse(s: &str) -> Self {
        match s {
            "full" => PlanKind::Full,
            "small" => PlanKind::Small,
            other => panic!("unknown plan kind {other:?}"),
        }
    }
}

/// Places ranges one after another in a region, never overlapping and with at
/// least one guard byte between two ranges.
struct Placer {
    ranges: Vec<(u64, u64)>,
}

impl Placer {
    fn new() -> Self {
        Placer { ranges: Vec::new() }
    }
    fn put(&mut self, dst_off: u64, len: u64) {
        assert!(len > 0);
        if let Some(&(o, l)) = self.ranges.last() {
            assert!(
                dst_off > o + l,
                "plan bug: ranges must be ordered with a guard gap"
            );
        }
        self.ranges.push((dst_off, len));
    }
}

impl Plan {
    pub fn build(kind: PlanKind, seed: u64) -> Plan {
        let mut rng = Rng::new(seed);
        let per_region: Vec<Placer> = match kind {
            PlanKind::Full => full_layout(&mut rng),
            PlanKind::Small => small_layout(&mut rng),
        };
        let region_lens = match kind {
            PlanKind::Full => vec![72 * MIB; 2],
            PlanKind::Small => vec![8 * 64 * KIB; 3],
        };
        // One batch per layer; sources packed in order with 0..15-byte gaps,
        // so source offsets are unaligned too.
        let mut src_cursor = 0u64;
        let mut batches = Vec::new();
        for (region, placer) in per_region.into_iter().enumerate() {
            let mut batch = Vec::new();
            for (dst_off, len) in placer.ranges {
                assert!(
                    dst_off + len <= region_lens[region],
                    "plan bug: range past region end"
                );
                src_cursor += rng.range(0, 15);
                batch.push(PlannedRange {
                    src_off: src_cursor,
                    region,
                    dst_off,
                    len,
                });
                src_cursor += len;
            }
            batches.push(batch);
        }
        Plan {
            region_lens,
            batches,
            src_len: src_cursor + 1,
            seed,
        }
    }

    pub fn ranges(&self) -> impl Iterator<Item = &PlannedRange> {
        self.batches.iter().flatten()
    }
    pub fn total_bytes(&self) -> u64 {
        self.ranges().map(|r| r.len).sum()
    }
    pub fn range_count(&self) -> usize {
        self.ranges().count()
    }
    /// Offset of each region inside a dump (regions concatenated).
    pub fn region_starts(&self) -> Vec<u64> {
        let mut out = Vec::new();
        let mut at = 0;
        for l in &self.region_lens {
            out.push(at);
            at += l;
        }
        out
    }
    pub fn dump_len(&self) -> u64 {
        self.region_lens.iter().sum()
    }

    /// The source buffer, filled.
    pub fn source(&self) -> Region {
        let mut src = Region::new(self.src_len);
        fill_source(src.bytes_mut(), self.seed);
        src
    }

    /// The batches as `WriteRange`s between real addresses.
    pub fn write_batches(&self, src_base: u64, region_bases: &[u64]) -> Vec<Vec<WriteRange>> {
        assert_eq!(
            region_bases.len(),
            self.region_lens.len(),
            "peer has another region count"
        );
        self.batches
            .iter()
            .map(|b| {
                b.iter()
                    .map(|r| WriteRange {
                        src: src_base + r.src_off,
                        dst: region_bases[r.region] + r.dst_off,
                        len: r.len,
                    })
                    .collect()
            })
            .collect()
    }

    /// The destination as it must be after the plan ran: the guard pattern of
    /// `guard_seed` with every range replaced by its source bytes.
    pub fn expected_dump(&self, src: &[u8], guard_seed: u64) -> Vec<u8> {
        let mut out = vec![0u8; self.dump_len() as usize];
        let starts = self.region_starts();
        for (i, (&start, &len)) in starts.iter().zip(&self.region_lens).enumerate() {
            fill_guard(&mut out[start as usize..(start + len) as usize], guard_seed, i);
        }
        for r in self.ranges() {
            let d = (starts[r.region] + r.dst_off) as usize;
            let s = r.src_off as usize;
            out[d..d + r.len as usize].copy_from_slice(&src[s..s + r.len as usize]);
        }
        out
    }
}

/// Full plan: 2 layers x 72 blocks x 1 MiB.
fn full_layout(rng: &mut Rng) -> Vec<Placer> {
    let blk = MIB;
    let mut l0 = Placer::new();
    // Block 0: 64 single bytes (the first at the region's very first byte),
    // then tiny ranges of 1..64 bytes at random gaps, then 4 KiB-ish ranges
    // at aligned and unaligned offsets.
    for i in 0..64 {
        l0.put(i * 2, 1);
    }
    let mut at = 256;
    while at < 4096 {
        let len = rng.range(1, 64);
        l0.put(at, len);
        at += len + rng.range(1, 32);
    }
    l0.put(8 * KIB, 4 * KIB);
    l0.put(16 * KIB + 1, 4 * KIB);
    l0.put(24 * KIB + 3, 4 * KIB - 1);
    l0.put(32 * KIB + 5, 4 * KIB + 1);
    // Block 1: one whole block. Block 2: 1 MiB - 10 at an odd offset.
    l0.put(blk, MIB);
    l0.put(2 * blk + 5, MIB - 10);
    // Block 3 untouched. Blocks 4..68: 64 MiB, one range over coalesced
    // blocks. Block 68 untouched.
    l0.put(4 * blk, 64 * MIB);
    // Blocks 69..71: mixed, ending with the region's very last byte.
    let mut at = 69 * blk + 7;
    let end = 72 * blk - 16;
    loop {
        let len = match rng.range(0, 5) {
            0 => 1,
            1 => rng.range(2, 300),
            2 => 4 * KIB,
            3 => 4 * KIB + rng.range(1, 9),
            4 => 64 * KIB,
            _ => rng.range(5000, 100_000),
        };
        if at + len >= end {
            break;
        }
        l0.put(at, len);
        at += len + rng.range(1, 700);
    }
    l0.put(72 * blk - 1, 1);

    // Layer 1: a few hundred ranges of mixed sizes over its first 36 MiB,
    // then one range that ends exactly at the region's end.
    let mut l1 = Placer::new();
    let mut at = rng.range(0, 3);
    let mut n = 0;
    while n < 600 {
        let len = match rng.range(0, 15) {
            0 | 1 => 1,
            2 | 3 => rng.range(2, 64),
            4..=6 => 4 * KIB,
            7 => 4 * KIB - 1,
            8 => 4 * KIB + 1,
            9 | 10 => rng.range(100, 20_000),
            11 | 12 => 64 * KIB,
            13 => rng.range(20_000, 200_000),
            14 => MIB,
            _ => MIB + rng.range(1, 4096),
        };
        if at + len > 36 * MIB {
            break;
        }
        l1.put(at, len);
        at += len + rng.range(1, 513);
        n += 1;
    }
    l1.put(40 * MIB + 1, 32 * MIB - 1);
    vec![l0, l1]
}

/// Small plan: 3 layers x 8 blocks x 64 KiB.
fn small_layout(rng: &mut Rng) -> Vec<Placer> {
    let blk = 64 * KIB;
    (0..3)
        .map(|layer| {
            let mut p = Placer::new();
            p.put(layer, 1);
            p.put(100 + layer, 37);
            p.put(blk, 4 * KIB);
            p.put(2 * blk + 3, 4 * KIB + 1);
            p.put(3 * blk, 2 * blk); // two coalesced blocks
            let mut at = 6 * blk + 11;
            while at < 8 * blk - 9000 {
                let len = rng.range(1, 4000);
                p.put(at, len);
                at += len + rng.range(1, 200);
            }
            p.put(8 * blk - 1, 1);
            p
        })
        .collect()
}

// ------------------------------------------------------------- byte check

/// Compares a destination dump with what the plan says it must be. `Ok` only
/// when every byte is equal; otherwise names the first wrong bytes (inside
/// which range, or which guard gap) and how many bytes differ.
pub fn check_dump(plan: &Plan, dump: &[u8], expected: &[u8]) -> Result<(), String> {
    if dump.len() != expected.len() {
        return Err(format!(
            "dump has {} bytes, the destination has {}",
            dump.len(),
            expected.len()
        ));
    }
    if dump == expected {
        return Ok(());
    }
    // Sorted (global start, len, batch, index) of every range.
    let starts = plan.region_starts();
    let mut spans: Vec<(u64, u64, usize, usize)> = Vec::new();
    for (b, batch) in plan.batches.iter().enumerate() {
        for (i, r) in batch.iter().enumerate() {
            spans.push((starts[r.region] + r.dst_off, r.len, b, i));
        }
    }
    spans.sort_unstable();
    let region_of = |pos: u64| starts.partition_point(|&s| s <= pos) - 1;

    const CHUNK: usize = 64 * 1024;
    let mut wrong = 0u64;
    let mut first: Vec<String> = Vec::new();
    for (c, (a, e)) in dump.chunks(CHUNK).zip(expected.chunks(CHUNK)).enumerate() {
        if a == e {
            continue;
        }
        for (k, (x, y)) in a.iter().zip(e).enumerate() {
            if x == y {
                continue;
            }
            wrong += 1;
            if first.len() < 5 {
                let pos = (c * CHUNK + k) as u64;
                let region = region_of(pos);
                let at = spans.partition_point(|s| s.0 <= pos);
                let place = match at.checked_sub(1).map(|j| spans[j]) {
                    Some((s, l, b, i)) if pos < s + l => {
                        format!("inside range {i} of batch {b} (byte {} of {l})", pos - s)
                    }
                    prev => {
                        let after = prev.map_or("region start".into(), |(_, _, b, i)| {
                            format!("range {i} of batch {b}")
                        });
                        format!("a guard byte (after {after})")
                    }
                };
                first.push(format!(
                    "layer {region} offset {}: got {x:#04x}, want {y:#04x}, {place}",
                    pos - starts[region]
                ));
            }
        }
    }
    Err(format!("{wrong} byte(s) differ; first: {}", first.join("; ")))
}

/// The notification `i` of a test run: distinct names, varied UTF-8 content
/// (empty, NUL and control bytes, quotes, backslashes, multi-byte characters,
/// up to 64 KiB). Mooncake carries notifications as JSON text, so the
/// transport accepts only UTF-8 messages (see `send_notification`).
pub fn note(seed: u64, i: usize) -> (String, Vec<u8>) {
    const PIECES: [&str; 8] = [
        "\0",
        "\n\t\r",
        "\"q\"",
        "\\",
        "é",
        "日本語",
        "🚀",
        "{\"json\":[1,2]}",
    ];
    let name = format!("req-{seed:x}-{i}");
    let len = match i % 6 {
        0 => 0,
        1 => 1,
        2 => 17 + i,
        3 => 256,
        4 => 65_536,
        _ => 1000 + 13 * i,
    };
    let mut msg = String::new();
    let mut k = i + seed as usize;
    while msg.len() < len {
        msg.push_str(PIECES[k % PIECES.len()]);
        msg.push(char::from(b'a' + (k % 26) as u8));
        k += 1;
    }
    (name, msg.into_bytes())
}

/// `b` as hex for the peer's command line (`-`: empty).
pub fn hex(b: &[u8]) -> String {
    if b.is_empty() {
        return "-".into();
    }
    hex::encode(b)
}

pub fn unhex(s: &str) -> Vec<u8> {
    if s == "-" {
        return Vec::new();
    }
    hex::decode(s).expect("hex")
}

/// Runs a plan from `engine` to `peer`: registers a fresh source, submits
/// every batch (all in flight at once), waits for each. Returns bytes moved.
pub fn run_plan(
    engine: &MooncakeTransferEngine,
    peer: &str,
    plan: &Plan,
    src: &Region,
    region_bases: &[u64],
    timeout: Duration,
) -> Result<u64, TransportError> {
    engine.register_memory(src.addr(), src.len(), "cpu:0")?;
    let mut errors = Vec::new();
    let mut handles = Vec::new();
    for b in plan.write_batches(src.addr(), region_bases) {
        match engine.submit_write(peer, &b) {
            Ok(h) => handles.push(h),
            Err(e) => {
                errors.push(e);
                break;
            }
        }
    }
    // Wait for everything submitted, even after an error.
    let mut moved = 0;
    for h in handles {
        match engine.wait(h, timeout) {
            Ok(n) => moved += n,
            Err(e) => errors.push(e),
        }
    }
    // A timeout wins: it tells the caller the source may still be read, so
    // it stays registered (and the caller must keep it alive).
    if let Some(i) = errors
        .iter()
        .position(|e| matches!(e, TransportError::Timeout { .. }))
    {
        return Err(errors.swap_remove(i));
    }
    engine.unregister_memory(src.addr())?;
    errors.into_iter().next().map_or(Ok(moved), Err)
}

// ------------------------------------------------------------ peer process

/// How to start a peer.
#[derive(Debug, Clone)]
pub struct PeerSpec {
    /// Run inside this network namespace (`ip netns exec`).
    pub netns: Option<String>,
    pub bind: String,
    /// Destination regions (one registration each), guard-filled.
    pub regions: Vec<u64>,
    pub guard_seed: u64,
}

impl PeerSpec {
    pub fn loopback(regions: Vec<u64>, guard_seed: u64) -> Self {
        PeerSpec {
            netns: None,
            bind: "127.0.0.1".into(),
            regions,
            guard_seed,
        }
    }
}

/// A peer process: this test binary re-invoked as [`PEER_TEST_NAME`].
/// Dropping it kills the process.
pub struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Arc<Mutex<VecDeque<String>>>,
    pub endpoint: String,
    pub bases: Vec<u64>,
    pub spec: PeerSpec,
}

static DUMP_SEQ: AtomicU64 = AtomicU64::new(0);

impl Peer {
    pub fn spawn(spec: PeerSpec) -> Peer {
        let exe = std::env::current_exe().expect("current_exe");
        let test_args = [
            PEER_TEST_NAME,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ];
        let mut cmd = match &spec.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        let regions: Vec<String> = spec.regions.iter().map(|r| r.to_string()).collect();
        cmd.args(test_args)
            .env(PEER_ENV, "1")
            .env("ORBITKV_PEER_BIND", &spec.bind)
            .env("ORBITKV_PEER_REGIONS", regions.join(","))
            .env("ORBITKV_PEER_GUARD_SEED", spec.guard_seed.to_string())
            .env("GLOG_minloglevel", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn peer process");
        let stdin = child.stdin.take();
        let out = child.stdout.take().expect("stdout");
        let err = child.stderr.take().expect("stderr");
        let (tx, lines) = crossbeam_channel::unbounded();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix(TAG) {
                    if tx.send(rest.trim().to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let keep = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                let mut q = keep.lock().unwrap();
                if q.len() == 40 {
                    q.pop_front();
                }
                q.push_back(line);
            }
        });
        let mut peer = Peer {
            child,
            stdin,
            lines,
            stderr,
            endpoint: String::new(),
            bases: Vec::new(),
            spec,
        };
        let ready = peer.expect_line(Duration::from_secs(60), "READY");
        let mut parts = ready.split_whitespace().skip(1);
        peer.endpoint = parts.next().expect("endpoint").to_string();
        peer.bases = parts
            .next()
            .expect("bases")
            .split(',')
            .map(|s| s.parse().expect("base address"))
            .collect();
        peer
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn stderr_tail(&self) -> String {
        let q = self.stderr.lock().unwrap();
        q.iter().cloned().collect::<Vec<_>>().join("\n")
    }

    fn expect_line(&mut self, timeout: Duration, want: &str) -> String {
        match self.lines.recv_timeout(timeout) {
            Ok(l) if l.starts_with(want) => l,
            Ok(l) => panic!(
                "peer said {l:?}, expected {want}; peer stderr:\n{}",
                self.stderr_tail()
            ),
            Err(RecvTimeoutError::Timeout) => panic!(
                "peer did not say {want} within {timeout:?}; peer stderr:\n{}",
                self.stderr_tail()
            ),
            Err(RecvTimeoutError::Disconnected) => panic!(
                "peer exited ({:?}) before saying {want}; peer stderr:\n{}",
                self.child.try_wait(),
                self.stderr_tail()
            ),
        }
    }

    /// Sends a command; returns the data lines before `OK ...` and the OK
    /// line's rest, or `Err` with the peer's `ERR` text.
    pub fn request(&mut self, cmd: &str, timeout: Duration) -> Result<(Vec<String>, String), String> {
        let stdin = self.stdin.as_mut().expect("peer stdin closed");
        writeln!(stdin, "{cmd}")
            .and_then(|_| stdin.flush())
            .expect("write to peer");
        let deadline = Instant::now() + timeout;
        let mut data = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match self.lines.recv_timeout(left) {
                Ok(l) => l,
                Err(e) => panic!(
                    "peer gave no answer to {cmd:?} ({e:?}); stderr:\n{}",
                    self.stderr_tail()
                ),
            };
            if let Some(rest) = line.strip_prefix("OK") {
                return Ok((data, rest.trim().to_string()));
            }
            if let Some(rest) = line.strip_prefix("ERR") {
                return Err(rest.trim().to_string());
            }
            data.push(line);
        }
    }

    /// The peer's destination regions, concatenated.
    pub fn dump(&mut self) -> Vec<u8> {
        let path = std::env::temp_dir().join(format!(
            "orbitkv-dump-{}-{}",
            std::process::id(),
            DUMP_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let r = self.request(&format!("DUMP {}", path.display()), Duration::from_secs(60));
        let bytes = std::fs::read(&path);
        let _ = std::fs::remove_file(&path);
        r.expect("peer DUMP");
        bytes.expect("read dump")
    }

    /// Flips (xor 0xFF) one byte of the peer's region `region` at `off`.
    pub fn flip(&mut self, region: usize, off: u64) {
        self.request(&format!("FLIP {region} {off}"), Duration::from_secs(10))
            .expect("FLIP");
    }

    /// Drains notifications in the peer until `n` arrived (or `timeout`),
    /// then keeps draining for `linger` to catch duplicates.
    pub fn received_notes(
        &mut self,
        n: usize,
        timeout: Duration,
        linger: Duration,
    ) -> Vec<(String, Vec<u8>)> {
        let (lines, _) = self
            .request(
                &format!("NOTIFS {n} {} {}", timeout.as_millis(), linger.as_millis()),
                timeout + linger + Duration::from_secs(30),
            )
            .expect("NOTIFS");
        lines
            .iter()
            .map(|l| {
                let mut p = l.split_whitespace().skip(1);
                let name = String::from_utf8(unhex(p.next().unwrap())).unwrap();
                (name, unhex(p.next().unwrap()))
            })
            .collect()
    }

    /// Makes the peer send `n` notifications [`note`]`(seed, i)` to `to`.
    pub fn send_notes(&mut self, to: &str, n: usize, seed: u64) -> Result<(), String> {
        self.request(&format!("SENDNOTIFS {to} {n} {seed}"), Duration::from_secs(60))
            .map(|_| ())
    }

    /// Makes the peer run `plan` (source from the plan's seed) to `to`,
    /// whose regions start at `bases`. Returns bytes moved.
    pub fn write_plan(&mut self, to: &str, kind: PlanKind, seed: u64, bases: &[u64]) -> Result<u64, String> {
        let b: Vec<String> = bases.iter().map(|x| x.to_string()).collect();
        let (_, rest) = self.request(
            &format!("WRITEPLAN {to} {} {seed} {}", kind.name(), b.join(",")),
            Duration::from_secs(120),
        )?;
        Ok(rest.parse().expect("bytes"))
    }

    /// Sends SIGSTOP (the process freezes; its sockets stay open).
    pub fn stop(&self) {
        let st = Command::new("kill")
            .args(["-STOP", &self.pid().to_string()])
            .status()
            .expect("kill -STOP");
        assert!(st.success(), "kill -STOP failed");
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ----------------------------------------------------------- peer program

fn env_or(k: &str, d: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| d.to_string())
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{TAG} {line}");
    let _ = out.flush();
}

/// The peer process: one engine, guard-filled destination regions, commands
/// on stdin (one per line), answers on stdout. Exits on EOF or `EXIT`.
pub fn peer_main() -> ! {
    let bind = env_or("ORBITKV_PEER_BIND", "127.0.0.1");
    let guard_seed: u64 = env_or("ORBITKV_PEER_GUARD_SEED", "1").parse().expect("seed");
    let lens: Vec<u64> = env_or("ORBITKV_PEER_REGIONS", "")
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().expect("region length"))
        .collect();
    let engine = match MooncakeTransferEngine::new(&EngineConfig {
        bind_host: bind,
        ..EngineConfig::default()
    }) {
        Ok(e) => e,
        Err(e) => {
            say(&format!("FATAL {e}"));
            std::process::exit(2);
        }
    };
    let mut regions: Vec<Region> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            let mut r = Region::new(l);
            fill_guard(r.bytes_mut(), guard_seed, i);
            engine
                .register_memory(r.addr(), r.len(), "cpu:0")
                .expect("register destination");
            r
        })
        .collect();
    let bases: Vec<String> = regions.iter().map(|r| r.addr().to_string()).collect();
    say(&format!("READY {} {}", engine.endpoint(), bases.join(",")));

    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["DUMP", path] => {
                let r = std::fs::File::create(path).and_then(|mut f| {
                    for reg in &regions {
                        f.write_all(reg.bytes())?;
                    }
                    f.flush()
                });
                match r {
                    Ok(()) => say("OK"),
                    Err(e) => say(&format!("ERR dump: {e}")),
                }
            }
            ["FLIP", region, off] => {
                let (i, o): (usize, usize) = (region.parse().unwrap(), off.parse().unwrap());
                regions[i].bytes_mut()[o] ^= 0xFF;
                say("OK");
            }
            ["NOTIFS", n, timeout_ms, linger_ms] => {
                let n: usize = n.parse().unwrap();
                let deadline = Instant::now() + Duration::from_millis(timeout_ms.parse().unwrap());
                let linger = Duration::from_millis(linger_ms.parse().unwrap());
                let mut got = Vec::new();
                let mut stop_at = deadline;
                let mut err = None;
                while Instant::now() < stop_at {
                    match engine.take_notifications() {
                        Ok(v) => got.extend(v),
                        Err(e) => {
                            err = Some(e);
                            break;
                        }
                    }
                    if got.len() >= n && stop_at == deadline {
                        stop_at = Instant::now() + linger;
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                for g in &got {
                    say(&format!("NOTE {} {}", hex(g.name.as_bytes()), hex(&g.message)));
                }
                match err {
                    Some(e) => say(&format!("ERR take_notifications: {e}")),
                    None => say(&format!("OK {}", got.len())),
                }
            }
            ["SENDNOTIFS", to, n, seed] => {
                let (n, seed): (usize, u64) = (n.parse().unwrap(), seed.parse().unwrap());
                let r = (0..n).try_for_each(|i| {
                    let (name, msg) = note(seed, i);
                    engine.send_notification(to, &name, &msg)
                });
                match r {
                    Ok(()) => say("OK"),
                    Err(e) => say(&format!("ERR {e}")),
                }
            }
            ["WRITEPLAN", to, kind, seed, bases] => {
                let plan = Plan::build(PlanKind::parse(kind), seed.parse().unwrap());
                let bases: Vec<u64> = bases.split(',').map(|s| s.parse().unwrap()).collect();
                let src = plan.source();
                match run_plan(&engine, to, &plan, &src, &bases, Duration::from_secs(60)) {
                    Ok(n) => say(&format!("OK {n}")),
                    Err(e) => {
                        say(&format!("ERR {e}"));
                        if matches!(e, TransportError::Timeout { .. }) {
                            // A timed-out batch may still read `src`: keep it.
                            std::mem::forget(src);
                        }
                    }
                }
            }
            ["EXIT"] => {
                say("OK");
                break;
            }
            _ => say(&format!("ERR unknown command {line:?}")),
        }
    }
    drop(engine);
    drop(regions);
    std::process::exit(0);
}
