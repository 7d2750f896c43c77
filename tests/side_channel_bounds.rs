//! Issue 44, what a stranger can make the prefill worker hold or write: the
//! side channel over real HTTP (a plain `TcpStream` as the client) into a
//! real `Runtime` on the real Mooncake engine (127.0.0.1). A request ID is
//! bounded where it is read (an 8 MiB one costs no memory and is not
//! remembered), and a refusal neither echoes a client's text unescaped or
//! long nor writes a log line per refusal.
//!
//! A process has one global subscriber (installed by the log test), and the
//! memory test measures the whole process: the tests take turns.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use orbitkv::side_channel::CANCEL_PATH;
use orbitkv::testing::{capability as cap, host_rank_with, HostRank as Rank};
use orbitkv::wire::Fence;
use orbitkv::{Cancel, Generation, RequestId, RuntimeConfig, SideChannel, SideChannelConfig};

/// One test at a time (see the module's doc).
static TURN: Mutex<()> = Mutex::new(());

fn rank(max_parked: usize) -> Rank {
    let cfg = RuntimeConfig {
        max_parked,
        ..RuntimeConfig::default()
    };
    host_rank_with(2, 8, 1024, (0, 1), 2, |_| 1, cfg)
}

/// A reply: status and body.
#[derive(Debug)]
struct Reply {
    status: u16,
    body: String,
}

impl Reply {
    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_default()
    }
}

/// POSTs `body` on a connection of its own and reads the reply to the close.
fn post(addr: SocketAddr, path: &str, body: &[u8]) -> Reply {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut raw = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    raw.extend_from_slice(body);
    let _ = s.write_all(&raw);
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    let text = String::from_utf8_lossy(&got).to_string();
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|t| t.get(..3))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP reply: {:?}", &text[..text.len().min(200)]));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Reply { status, body }
}

/// This process's resident memory (`/proc/self/status`, `VmRSS`).
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb << 10
}

/// The tester's attack: 96 cancels whose request ID is 8 MiB. Each is `400`
/// with a short reply; none is remembered (the pre-open table, of one
/// entry, still takes a genuine early fence after them); and the process
/// holds less than 100 MB more after them (the old code kept every one:
/// +784 MB).
#[test]
fn cancels_with_8_mib_request_ids_are_400_not_remembered_and_cost_no_memory() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let p = rank(1);
    let sc = SideChannel::start(SideChannelConfig::default(), p.runtime.clone()).expect("side channel");
    let addr = sc.address();
    let body = format!(
        r#"{{"version":4,"request_id":"{}","capability":"{}","reason":"x"}}"#,
        "x".repeat(8 << 20),
        "c".repeat(32)
    );
    let check = |r: &Reply| {
        assert_eq!(r.status, 400, "{}", &r.body[..r.body.len().min(300)]);
        assert_eq!(r.json()["error"], "HandshakeError", "{}", r.body);
        assert!(r.body.len() < 1024, "a reply of {} bytes", r.body.len());
    };
    // Warm: the worker's blocking pool and the allocator's arenas.
    check(&post(addr, CANCEL_PATH, body.as_bytes()));
    let before = rss();
    for _ in 0..96 {
        check(&post(addr, CANCEL_PATH, body.as_bytes()));
    }
    let grown = rss().saturating_sub(before);
    println!(
        "96 cancels with 8 MiB request IDs: RSS grew by {} KiB",
        grown >> 10
    );
    assert!(grown < 100 << 20, "RSS grew by {} MiB", grown >> 20);
    assert_eq!(sc.refused().malformed, 97);

    // Not one was remembered: the table's one entry is free for a fence.
    let fence = Cancel::new(RequestId::new("req-after"), cap(), "client left").fencing(Generation(3), 0);
    let r = post(addr, CANCEL_PATH, fence.to_json().as_bytes());
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(Fence::from_reply(&r.body), Some(Fence::Fenced));
}

/// What the subscriber wrote, shared with the test.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).to_string()
    }

    /// The lines that name the side channel at `addr`.
    fn lines_of(&self, addr: SocketAddr) -> Vec<String> {
        let tag = format!("side_channel={addr}");
        self.text()
            .lines()
            .filter(|l| l.contains(&tag))
            .map(str::to_string)
            .collect()
    }
}

/// The `suppressed=N` of a log line.
fn suppressed(line: &str) -> u64 {
    line.split("suppressed=")
        .nth(1)
        .and_then(|t| t.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no suppressed count in {line}"))
}

/// An unknown field whose name holds a newline and a forged log line is
/// answered and logged escaped (no line of the log starts with the forged
/// one); a 4 MiB field name gets a reply under 1 KiB and a log line under
/// 1 KiB; and a burst of 50 refusals of one kind writes a line a second,
/// the next line counting those left out.
#[test]
fn refusals_are_answered_and_logged_escaped_short_and_at_most_once_a_second() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let log = Captured::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
    let p = rank(64);
    let sc = SideChannel::start(SideChannelConfig::default(), p.runtime.clone()).expect("side channel");
    let addr = sc.address();
    let cap = "c".repeat(32);
    let pace = Duration::from_millis(1100);

    const FORGED: &str = "2026-12-03T00:00:00.000000Z  WARN orbitkv: forged";
    let forged = format!(r#"{{"version":4,"request_id":"r","capability":"{cap}","x\n{FORGED}":1}}"#);
    let r = post(addr, CANCEL_PATH, forged.as_bytes());
    assert_eq!(r.status, 400, "{r:?}");
    let message = r.json()["message"].as_str().unwrap_or_default().to_string();
    assert!(
        message.contains(r"x\n2026") && !message.contains('\n'),
        "{message:?}"
    );
    let lines = log.lines_of(addr);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains(r"x\n2026"), "{lines:?}");
    assert!(
        !log.text().lines().any(|l| l.starts_with("2026-12-03T00:00:00")),
        "a forged line in the log:\n{}",
        log.text()
    );

    std::thread::sleep(pace);
    let huge = format!(
        r#"{{"version":4,"request_id":"r","capability":"{cap}","{}":1}}"#,
        "y".repeat(4 << 20)
    );
    let before = log.text().len();
    let r = post(addr, CANCEL_PATH, huge.as_bytes());
    assert_eq!(r.status, 400, "{}", &r.body[..r.body.len().min(300)]);
    assert!(r.body.len() < 1024, "a reply of {} bytes", r.body.len());
    assert_eq!(log.lines_of(addr).len(), 2);
    let grown = log.text().len() - before;
    assert!(grown < 1024, "the log grew by {grown} bytes");

    // A burst of one kind: a line a second at most.
    std::thread::sleep(pace);
    let bad = format!(r#"{{"version":4,"capability":"{cap}"}}"#);
    let start = Instant::now();
    for _ in 0..50 {
        assert_eq!(post(addr, CANCEL_PATH, bad.as_bytes()).status, 400);
    }
    let took = start.elapsed();
    let burst = log.lines_of(addr).len() - 2;
    assert!(
        (1..=2 + took.as_secs() as usize).contains(&burst),
        "{burst} lines for 50 refusals in {took:?}"
    );
    std::thread::sleep(pace);
    assert_eq!(post(addr, CANCEL_PATH, bad.as_bytes()).status, 400);
    let lines = log.lines_of(addr);
    let last = lines.last().unwrap();
    // Every refusal is either a line or counted in the next one.
    let counted: u64 = lines[2..].iter().map(|l| suppressed(l) + 1).sum();
    assert_eq!(counted, 51, "{lines:#?}");
    assert!(suppressed(last) > 0, "{last}");
    assert_eq!(sc.refused().malformed, 53);
}
