//! Nothing on the prefill side grows with the number of decode endpoints it
//! has written to: a peer whose writer lanes sat idle for
//! `peer_idle_reclaim`, with no request holding them, has its lanes
//! (threads) stopped and its transport state (a Mooncake segment) dropped
//! (`actors::prefill::writer::WriterPool`).
//!
//! Over the transport test double (`FakeTransport`: counts the peers it is
//! told to forget, holds batches in flight on demand), and over the real
//! Mooncake engine on 127.0.0.1 for the segments.
//!
//! The thread counts are the process's (`/proc/self/task`), so the tests of
//! this file run one at a time (`SERIAL`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use orbitkv::testing::{capability as cap, host_rank_with, wait_for, wait_released, FakeTransport, HostRank};
use orbitkv::{KvLayout, Outcome, RequestId, Runtime, RuntimeConfig, RuntimeEvent};

static SERIAL: Mutex<()> = Mutex::new(());

const LAYERS: u32 = 2;
const LANES: usize = 4;

/// Threads of this process now.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .count()
}

/// The names of this process's threads, counted by name.
fn thread_names() -> std::collections::BTreeMap<String, usize> {
    let mut names = std::collections::BTreeMap::new();
    for task in std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .flatten()
    {
        let name = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        *names.entry(name.trim_end().to_string()).or_insert(0) += 1;
    }
    names
}

/// Waits up to 10 s for `done`; false if it never held.
fn settle(done: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// A prefill runtime over the test double (`idle` its `peer_idle_reclaim`)
/// and a decode runtime over another, whose handshakes the test re-addresses
/// to any number of endpoints.
struct Doubles {
    prefill: Runtime,
    wire: Arc<FakeTransport>,
    decode: Runtime,
}

fn doubles(idle: Duration) -> Doubles {
    let layout = |base| KvLayout::packed(base, LAYERS, 8, 4096, (0, 1), 1);
    let cfg = RuntimeConfig {
        peer_idle_reclaim: idle,
        writer_lanes_per_peer: LANES,
        ..RuntimeConfig::default()
    };
    let wire = Arc::new(FakeTransport::new("127.0.0.1:31001"));
    Doubles {
        prefill: Runtime::start(wire.clone(), layout(0x1000_0000), cfg.clone()).unwrap(),
        wire,
        decode: Runtime::start(
            Arc::new(FakeTransport::new("127.0.0.1:31002")),
            layout(0x2000_0000),
            cfg,
        )
        .unwrap(),
    }
}

impl Doubles {
    /// Opens `req` on both sides, the producer told the consumer is at
    /// `endpoint`, and hands it every layer and its finish.
    fn send(&self, req: &RequestId, endpoint: &str) {
        let mut hs = self
            .decode
            .consumer_open(req.clone(), cap(), 0, vec![4, 5], 1)
            .unwrap();
        hs.endpoint = endpoint.to_string();
        self.prefill
            .producer_open(req.clone(), vec![0, 1], cap(), 1)
            .unwrap();
        self.prefill.producer_handshake(hs).unwrap();
        for layer in 0..LAYERS {
            self.prefill.layer_ready(req, layer, 0..2).unwrap();
        }
        self.prefill.producer_finish(req).unwrap();
    }

    /// `send`, then waits for the producer's release (done).
    fn serve(&self, req: &RequestId, endpoint: &str) {
        self.send(req, endpoint);
        let (outcome, why) = wait_released(&self.prefill, req);
        assert_eq!(outcome, Outcome::Done, "{why:?}");
        // The decode side's authorization is not needed any more.
        self.decode.consumer_release(req).unwrap();
    }
}

fn endpoint(i: usize) -> String {
    format!("127.0.0.1:{}", 40_000 + i)
}

#[test]
fn a_hundred_decode_endpoints_coming_and_going_leave_the_prefill_bounded() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let idle = Duration::from_millis(10);
    let d = doubles(idle);
    let base = threads();
    let (mut most_peers, mut most_threads) = (0, 0);
    for i in 0..100 {
        d.serve(&RequestId::new(format!("r{i}")), &endpoint(i));
        // The endpoint is gone (a decode pod rolled): past the idle bound,
        // and the next endpoint's first write finds its peer reclaimed.
        most_peers = most_peers.max(d.prefill.writer_peers());
        most_threads = most_threads.max(threads());
        std::thread::sleep(idle * 4);
    }
    assert!(
        settle(|| d.prefill.writer_peers() == 0),
        "{} peers kept after every endpoint went idle",
        d.prefill.writer_peers()
    );
    // Arbiters stop asynchronously: their threads end soon after.
    let ended = settle(|| threads() <= base + 2);
    let after = threads();
    eprintln!(
        "threads: {base} before, at most {most_threads} while serving (at most {most_peers} peers \
         with lanes at a time), {after} after 100 endpoints"
    );
    assert!(
        ended,
        "threads: {base} before, {after} after 100 endpoints: {:?}",
        thread_names()
    );
    assert!(
        most_peers <= 2 && most_threads <= base + 2 * LANES + 2,
        "while serving: at most {most_peers} peers, {most_threads} threads (from {base})"
    );
    let forgotten = d.wire.forgotten();
    let s = d.prefill.stats();
    assert_eq!(forgotten.len(), 100, "{forgotten:?}");
    assert_eq!(s.peers_reclaimed, 100, "{s:?}");
    let mut distinct = forgotten.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 100, "each endpoint forgotten once: {forgotten:?}");
    // Every request's notice went out (a reclaim never drops one queued).
    assert_eq!(d.wire.notices_sent(), 100);
    assert_eq!(s.layers_written, 100 * LAYERS as u64, "{s:?}");
    assert_eq!(d.prefill.live_requests(), (0, 0));
}

#[test]
fn without_reclaim_every_endpoint_keeps_its_lanes() {
    // The control: the thread count does see the lanes of peers kept.
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = doubles(Duration::from_secs(3600));
    let base = threads();
    for i in 0..10 {
        d.serve(&RequestId::new(format!("k{i}")), &endpoint(i));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(d.prefill.writer_peers(), 10);
    let grown = threads() - base;
    assert!(
        grown >= 10 * LANES,
        "{grown} threads for 10 peers of {LANES} lanes"
    );
    assert_eq!((d.wire.forgets(), d.prefill.stats().peers_reclaimed), (0, 0));
}

#[test]
fn a_peer_with_a_write_in_flight_is_kept_until_it_drains() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let idle = Duration::from_millis(10);
    let d = doubles(idle);
    let stuck = endpoint(999);
    let held = RequestId::new("held");
    // Its batches stay in the transport (a cut link).
    d.wire.hold(true);
    d.send(&held, &stuck);
    d.wire.wait_submits(1);
    // Twenty idle bounds, as many sweeps of the directory's timer.
    std::thread::sleep(idle * 20);
    assert_eq!(
        d.prefill.writer_peers(),
        1,
        "the peer with a write in flight was reclaimed"
    );
    assert!(d.wire.forgotten().is_empty(), "{:?}", d.wire.forgotten());
    assert!(
        d.prefill.poll_events().iter().all(|e| !matches!(
            e,
            RuntimeEvent::ProducerReleased { request, .. } if *request == held
        )),
        "released while its write was held"
    );
    // The link heals: the write ends, the request is released, and then
    // the peer is reclaimed.
    d.wire.hold(false);
    let (outcome, why) = wait_released(&d.prefill, &held);
    assert_eq!(outcome, Outcome::Done, "{why:?}");
    assert!(settle(|| d.prefill.writer_peers() == 0));
    assert_eq!(d.wire.forgotten(), vec![stuck]);
    assert_eq!(d.prefill.stats().peers_reclaimed, 1);
}

/// A rank of `layers` × `blocks` host blocks of `bb` bytes over its own
/// real Mooncake engine (a new endpoint each: a new port), with `cfg`.
fn host(layers: u32, blocks: u32, bb: u64, fill: impl Fn(usize) -> u8, cfg: RuntimeConfig) -> HostRank {
    host_rank_with(layers, blocks, bb, (0, 1), 1, fill, cfg)
}

#[test]
fn decode_engines_coming_and_going_leave_the_prefill_no_segments() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (layers, blocks, bb) = (2, 4, 4096);
    let idle = Duration::from_millis(20);
    let prefill = host(
        layers,
        blocks,
        bb,
        |i| (i % 251) as u8,
        RuntimeConfig {
            peer_idle_reclaim: idle,
            ..RuntimeConfig::default()
        },
    );
    // The thread count to come back to: taken after a first decode engine
    // came and went (Mooncake starts some of the prefill engine's threads
    // at its first transfer: not per peer).
    let mut base = 0;
    let (mut most_segments, mut most_peers) = (0, 0);
    let mut endpoints = Vec::new();
    for i in 0..25 {
        if i == 1 {
            assert!(settle(|| prefill.runtime.writer_peers() == 0));
            base = threads();
        }
        let decode = host(layers, blocks, bb, |_| 0, RuntimeConfig::default());
        endpoints.push(decode.runtime.endpoint().to_string());
        let req = RequestId::new(format!("m{i}"));
        let hs = decode
            .runtime
            .consumer_open(req.clone(), cap(), 0, vec![2, 3], 1)
            .unwrap();
        prefill
            .runtime
            .producer_open(req.clone(), vec![0, 1], cap(), 1)
            .unwrap();
        prefill.runtime.producer_handshake(hs).unwrap();
        for layer in 0..layers {
            prefill.runtime.layer_ready(&req, layer, 0..2).unwrap();
        }
        prefill.runtime.producer_finish(&req).unwrap();
        let (outcome, why) = wait_released(&prefill.runtime, &req);
        assert_eq!(outcome, Outcome::Done, "{why:?}");
        wait_for(&decode.runtime, "the consumer's completion", |e| {
            matches!(e, RuntimeEvent::ConsumerCompleted { .. })
        });
        most_segments = most_segments.max(prefill.engine.open_segments());
        most_peers = most_peers.max(prefill.runtime.writer_peers());
        // The decode pod goes away (its engine and port with it).
        drop(decode);
        std::thread::sleep(idle * 4);
    }
    let names = thread_names();
    assert!(
        settle(|| prefill.engine.open_segments() == 0 && prefill.runtime.writer_peers() == 0),
        "{} segments, {} peers kept after every decode engine went",
        prefill.engine.open_segments(),
        prefill.runtime.writer_peers()
    );
    let mut distinct = endpoints.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        25,
        "each decode engine a new endpoint: {endpoints:?}"
    );
    let ended = settle(|| threads() <= base + 2);
    let after = threads();
    eprintln!(
        "mooncake: threads {base} after the first decode engine, {after} after 24 more; at most \
         {most_segments} segments and {most_peers} peers open at a time"
    );
    assert!(
        ended,
        "threads: {base} after the first decode engine, {after} after 24 more: {:?} (at the last one's end: {names:?})",
        thread_names()
    );
    assert!(
        most_segments <= 2 && most_peers <= 2,
        "{most_segments} segments, {most_peers} peers"
    );
    assert_eq!(prefill.runtime.stats().peers_reclaimed, 25);
}
