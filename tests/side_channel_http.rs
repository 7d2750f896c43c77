//! The side channel over real HTTP (a plain `TcpStream` as the client) into a
//! real `Runtime` on the real Mooncake engine (127.0.0.1): each answer the
//! vLLM connector's decode side can get, and the bounds.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::{RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use orbitkv::side_channel::{sign, CANCEL_PATH, HANDSHAKE_PATH, HEALTH_PATH, QUERY_PATH, SIGNATURE_HEADER};
use orbitkv::{
    Cancel, Capability, MooncakeBootstrap, RequestId, RuntimeEvent, SideChannel, SideChannelConfig,
    SideChannelError,
};

const GUARD: u8 = 0xA5;
const LAYERS: u32 = 2;
const BLOCKS: u32 = 8;
const BLOCK_BYTES: u64 = 1024;
const KEY: &[u8] = b"deployment-key-0123456789";

use orbitkv::testing::{
    block, capability as cap, host_rank, host_rank_with, wait_for, wait_released, HostRank as Rank,
};
use orbitkv::wire::Fence;
use orbitkv::{Generation, Outcome, RuntimeConfig};

fn rank(fill: impl Fn(usize) -> u8) -> Rank {
    host_rank(LAYERS, BLOCKS, BLOCK_BYTES, (0, 1), 2, fill)
}

fn stranger() -> Capability {
    Capability::parse(&"f".repeat(64)).expect("a valid capability")
}

/// Held shared by every side channel these tests start, and exclusively by
/// the flood test, which counts the side channel's threads by name.
static ONE_SIDE_CHANNEL: RwLock<()> = RwLock::new(());

/// A side channel that holds [`ONE_SIDE_CHANNEL`] shared until it is dropped
/// (stopped first: the fields drop in order).
struct Served {
    sc: SideChannel,
    _shared: RwLockReadGuard<'static, ()>,
}

impl std::ops::Deref for Served {
    type Target = SideChannel;
    fn deref(&self) -> &SideChannel {
        &self.sc
    }
}

fn serve(r: &Rank, cfg: SideChannelConfig) -> Served {
    let shared = ONE_SIDE_CHANNEL.read().unwrap_or_else(|e| e.into_inner());
    Served {
        sc: SideChannel::start(cfg, r.runtime.clone()).expect("side channel"),
        _shared: shared,
    }
}

/// A reply: status and body.
#[derive(Debug)]
struct Reply {
    status: u16,
    body: String,
}

impl Reply {
    fn error(&self) -> String {
        let v: serde_json::Value = serde_json::from_str(&self.body).unwrap_or_default();
        v["error"].as_str().unwrap_or_default().to_string()
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// Reads a reply until the server closes the connection (it answers one
/// request per connection).
fn read_reply(mut s: TcpStream) -> Reply {
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw); // a reset after the reply still leaves the reply
    let text = String::from_utf8_lossy(&raw).to_string();
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|t| t.get(..3))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP reply: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Reply { status, body }
}

/// Sends `raw` and reads the reply.
fn exchange(addr: SocketAddr, raw: &[u8]) -> Reply {
    let mut s = connect(addr);
    let _ = s.write_all(raw); // the server may answer (and close) before it read everything
    read_reply(s)
}

fn post(addr: SocketAddr, path: &str, body: &[u8], headers: &[(&str, String)]) -> Reply {
    let mut raw = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        raw.push_str(&format!("{k}: {v}\r\n"));
    }
    raw.push_str("\r\n");
    let mut raw = raw.into_bytes();
    raw.extend_from_slice(body);
    exchange(addr, &raw)
}

/// [`post`] from `from` (the client's socket bound to it: every address of
/// 127/8 is this host's loopback on Linux), a source of its own to the
/// side channel's per-source budgets.
fn post_from(from: IpAddr, addr: SocketAddr, path: &str, body: &[u8]) -> Reply {
    let s = actix_web::rt::System::new().block_on(async move {
        let sock = tokio::net::TcpSocket::new_v4().expect("socket");
        sock.bind(SocketAddr::new(from, 0))
            .expect("bind the client's address");
        let s = sock.connect(addr).await.expect("connect").into_std().unwrap();
        s.set_nonblocking(false).unwrap();
        s
    });
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut raw = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    raw.extend_from_slice(body);
    let mut s = s;
    let _ = s.write_all(&raw);
    read_reply(s)
}

fn get(addr: SocketAddr, path: &str) -> Reply {
    exchange(addr, format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
}

/// Whether `cond` holds within 2 s (a connection ends just after its reply).
fn soon(cond: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(2);
    while !cond() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

#[test]
fn a_good_handshake_is_admitted_and_the_kv_lands() {
    let p = rank(|i| (i % 251) as u8);
    let c = rank(|_| GUARD);
    let sc = serve(&p, SideChannelConfig::default());
    let addr = sc.address();
    let health = get(addr, HEALTH_PATH);
    // The health check names the rank and TP size (routers learn them).
    assert_eq!(
        (health.status, health.body.as_str()),
        (200, r#"{"ok":true,"tp_rank":0,"tp_size":1}"#)
    );

    let req = RequestId::new("req-http");
    let hs = c
        .runtime
        .consumer_open(req.clone(), cap(), 0, vec![3, 4], 1)
        .unwrap();
    p.runtime
        .producer_open(req.clone(), vec![0, 1], cap(), 1)
        .unwrap();
    let r = post(addr, HANDSHAKE_PATH, hs.to_json().as_bytes(), &[]);
    assert_eq!((r.status, r.body.as_str()), (200, r#"{"ok":true}"#), "{r:?}");
    for layer in 0..LAYERS {
        p.runtime.layer_ready(&req, layer, 0..2).unwrap();
    }
    p.runtime.producer_finish(&req).unwrap();
    let ev = wait_for(&c.runtime, "the consumer's outcome", |e| {
        matches!(
            e,
            RuntimeEvent::ConsumerCompleted { .. } | RuntimeEvent::ConsumerFailed { .. }
        )
    });
    assert!(matches!(ev, RuntimeEvent::ConsumerCompleted { .. }), "{ev:?}");
    assert_eq!(block(&c, 1, 4), block(&p, 1, 1));
    assert!(block(&c, 0, 5).iter().all(|&b| b == GUARD));
    assert_eq!(sc.refused(), orbitkv::Refused::default());
}

#[test]
fn a_forged_capability_is_forbidden_and_a_cancel_with_the_right_one_is_taken() {
    let p = rank(|_| 1);
    let c = rank(|_| GUARD);
    let sc = serve(&p, SideChannelConfig::default());
    let req = RequestId::new("req-forged");
    p.runtime.producer_open(req.clone(), vec![0], cap(), 1).unwrap();
    let forged = c
        .runtime
        .consumer_open(req.clone(), stranger(), 0, vec![2], 1)
        .unwrap();
    let r = post(sc.address(), HANDSHAKE_PATH, forged.to_json().as_bytes(), &[]);
    assert_eq!((r.status, r.error().as_str()), (403, "ForbiddenError"), "{r:?}");
    let theirs = Cancel::new(req.clone(), stranger(), "stranger");
    let r = post(sc.address(), CANCEL_PATH, theirs.to_json().as_bytes(), &[]);
    assert_eq!((r.status, r.error().as_str()), (403, "ForbiddenError"), "{r:?}");
    assert_eq!(sc.refused().forbidden, 2);
    assert_eq!(p.runtime.stats().side_channel_forbidden, 2);

    let ours = Cancel::new(req.clone(), cap(), "client went away");
    let r = post(sc.address(), CANCEL_PATH, ours.to_json().as_bytes(), &[]);
    assert_eq!(r.status, 200, "{r:?}");
    let ev = wait_for(&p.runtime, "the producer's release", |e| {
        matches!(e, RuntimeEvent::ProducerReleased { .. })
    });
    assert!(
        matches!(&ev, RuntimeEvent::ProducerReleased { outcome: orbitkv::Outcome::Aborted, reason: Some(r), .. } if r.contains("cancelled by the consumer")),
        "{ev:?}"
    );
}

#[test]
fn malformed_input_is_400_with_its_error_and_changes_nothing() {
    let p = rank(|_| 1);
    let c = rank(|_| GUARD);
    let sc = serve(&p, SideChannelConfig::default());
    let addr = sc.address();
    let hs = c
        .runtime
        .consumer_open(RequestId::new("req-bad"), cap(), 0, vec![3], 1)
        .unwrap();
    let mut bad_geometry: serde_json::Value = serde_json::from_str(&hs.to_json()).unwrap();
    bad_geometry["layout"]["layers"].as_array_mut().unwrap().pop();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (HANDSHAKE_PATH, br#"{"version": 9}"#.to_vec(), "HandshakeError"),
        (HANDSHAKE_PATH, b"not json".to_vec(), "HandshakeError"),
        (HANDSHAKE_PATH, b"".to_vec(), "HandshakeError"),
        (
            HANDSHAKE_PATH,
            b"{\"version\":2,\"request_id\":\"\xff\xfe\"}".to_vec(),
            "HandshakeError",
        ),
        (
            HANDSHAKE_PATH,
            bad_geometry.to_string().into_bytes(),
            "GeometryError",
        ),
        (
            CANCEL_PATH,
            br#"{"version": 4, "request_id": ""}"#.to_vec(),
            "HandshakeError",
        ),
    ];
    for (path, body, error) in &cases {
        let r = post(addr, path, body, &[]);
        assert_eq!((r.status, r.error().as_str()), (400, *error), "{r:?}");
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert!(!v["message"].as_str().unwrap().is_empty());
    }
    assert_eq!(sc.refused().malformed, cases.len() as u64);
    assert_eq!(p.runtime.live_requests(), (0, 0));
}

/// Issue 44: one address floods cancels for made-up request IDs (each one
/// remembered against an open that will never come) until it is refused
/// `503` at its share of the pre-open table (a quarter of the 64 entries);
/// another address's genuine early fence is still remembered and answered
/// `fenced`, the flood's entries are not evicted for it (the flood is
/// still refused), and when the fenced request opens it is aborted at once.
#[test]
fn a_cancel_flood_from_one_address_leaves_room_for_another_addresss_fence() {
    let cfg = RuntimeConfig {
        max_parked: 64,
        ..RuntimeConfig::default()
    };
    let p = host_rank_with(LAYERS, BLOCKS, BLOCK_BYTES, (0, 1), 2, |_| 1, cfg);
    let sc = serve(&p, SideChannelConfig::default());
    let addr = sc.address();
    let flooder: IpAddr = "127.0.0.2".parse().unwrap();
    let decode: IpAddr = "127.0.0.1".parse().unwrap();
    let flood_once = || {
        let id = RequestId::new(format!("rand-{:016x}", fastrand::u64(..)));
        let c = Cancel::new(id, stranger(), "flood").fencing(Generation(1), 0);
        post_from(flooder, addr, CANCEL_PATH, c.to_json().as_bytes())
    };
    let mut remembered = 0;
    let refused = loop {
        let r = flood_once();
        if r.status != 200 {
            break r;
        }
        assert_eq!(Fence::from_reply(&r.body), Some(Fence::Fenced), "{r:?}");
        remembered += 1;
        assert!(remembered <= 64, "the flood was never refused");
    };
    assert_eq!(
        (refused.status, refused.error().as_str()),
        (503, "OverloadedError"),
        "{refused:?}"
    );
    assert_eq!(remembered, 16, "one address holds a quarter of the table");

    let req = RequestId::new("req-fenced-early");
    let fence = Cancel::new(req.clone(), cap(), "client went away").fencing(Generation(7), 0);
    let r = post_from(decode, addr, CANCEL_PATH, fence.to_json().as_bytes());
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(Fence::from_reply(&r.body), Some(Fence::Fenced), "{r:?}");
    // Nothing of the flood's was evicted, nor did its share grow.
    assert_eq!(flood_once().status, 503);
    assert_eq!(sc.refused().busy, 2);
    assert_eq!(p.runtime.stats().side_channel_overloaded, 2);

    // The fence was remembered: the request is aborted as it opens.
    p.runtime
        .producer_open(req.clone(), vec![0, 1], cap(), 1)
        .unwrap();
    let (outcome, reason) = wait_released(&p.runtime, &req);
    assert_eq!(outcome, Outcome::Aborted);
    assert!(
        reason
            .as_deref()
            .is_some_and(|r| r.contains("cancelled by the consumer: client went away")),
        "{reason:?}"
    );
}

#[test]
fn a_body_over_max_body_is_413_before_it_is_read() {
    let p = rank(|_| 1);
    let cfg = SideChannelConfig {
        max_body: 4096,
        ..SideChannelConfig::default()
    };
    let sc = serve(&p, cfg);
    let addr = sc.address();
    // Declared too large, nothing sent: answered at once.
    let start = Instant::now();
    let r = exchange(
        addr,
        b"POST /orbitkv/v1/handshake HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n",
    );
    assert_eq!((r.status, r.error().as_str()), (413, "BadLength"), "{r:?}");
    assert!(start.elapsed() < Duration::from_secs(2));
    // Chunked, no length declared: cut when it passes the limit.
    let chunk = "x".repeat(3000);
    let raw = format!(
        "POST /orbitkv/v1/cancel HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n\
         bb8\r\n{chunk}\r\nbb8\r\n{chunk}\r\n0\r\n\r\n"
    );
    let r = exchange(addr, raw.as_bytes());
    assert_eq!((r.status, r.error().as_str()), (413, "BadLength"), "{r:?}");
    // Exactly at the limit is read (and then refused as malformed JSON).
    let r = post(addr, HANDSHAKE_PATH, &[b' '; 4096], &[]);
    assert_eq!((r.status, r.error().as_str()), (400, "HandshakeError"), "{r:?}");
    assert_eq!(sc.refused().too_large, 2);
}

#[test]
fn with_a_deployment_key_an_unsigned_or_wrongly_signed_post_is_401() {
    let p = rank(|_| 1);
    let cfg = SideChannelConfig {
        key: Some(KEY.to_vec()),
        ..SideChannelConfig::default()
    };
    let sc = serve(&p, cfg);
    let addr = sc.address();
    let req = RequestId::new("req-key");
    p.runtime.producer_open(req.clone(), vec![0], cap(), 1).unwrap();
    let body = Cancel::new(req, cap(), "x").to_json();
    let unsigned = post(addr, CANCEL_PATH, body.as_bytes(), &[]);
    let wrong = post(
        addr,
        CANCEL_PATH,
        body.as_bytes(),
        &[(SIGNATURE_HEADER, sign(b"another-key-0123456789", body.as_bytes()))],
    );
    let other_body = post(
        addr,
        CANCEL_PATH,
        body.as_bytes(),
        &[(SIGNATURE_HEADER, sign(KEY, b"{}"))],
    );
    for r in [&unsigned, &wrong, &other_body] {
        assert_eq!((r.status, r.error().as_str()), (401, "BadSignature"), "{r:?}");
    }
    // Refused before parsing: the request is still open.
    assert_eq!(p.runtime.live_requests(), (0, 1));
    assert_eq!(sc.refused().signature, 3);
    let signed = post(
        addr,
        CANCEL_PATH,
        body.as_bytes(),
        &[(SIGNATURE_HEADER, sign(KEY, body.as_bytes()))],
    );
    assert_eq!(signed.status, 200, "{signed:?}");
}

#[test]
fn a_body_that_does_not_arrive_in_time_is_408_and_so_is_a_head() {
    let p = rank(|_| 1);
    let cfg = SideChannelConfig {
        read_timeout: Duration::from_millis(300),
        ..SideChannelConfig::default()
    };
    let sc = serve(&p, cfg);
    let addr = sc.address();
    let start = Instant::now();
    let mut s = connect(addr);
    s.write_all(b"POST /orbitkv/v1/handshake HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"ver")
        .unwrap();
    let r = read_reply(s);
    let took = start.elapsed();
    assert_eq!((r.status, r.error().as_str()), (408, "Timeout"), "{r:?}");
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(sc.refused().timed_out, 1);
    // A head that never ends: actix-http answers 408 at the same timeout.
    let start = Instant::now();
    let mut s = connect(addr);
    s.write_all(b"POST /orbitkv/v1/handshake HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let r = read_reply(s);
    assert_eq!(r.status, 408, "{r:?}");
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(
        soon(|| sc.connections() == 0),
        "{} connections left",
        sc.connections()
    );
}

#[test]
fn an_unknown_path_or_method_is_404() {
    let p = rank(|_| 1);
    let sc = serve(&p, SideChannelConfig::default());
    let addr = sc.address();
    for r in [
        get(addr, "/"),
        get(addr, "/orbitkv/v1/nope"),
        get(addr, HANDSHAKE_PATH),
        post(addr, HEALTH_PATH, b"{}", &[]),
        post(addr, "/orbitkv/v2/handshake", b"{}", &[]),
    ] {
        assert_eq!((r.status, r.error().as_str()), (404, "NotFound"), "{r:?}");
    }
}

#[test]
fn get_query_answers_as_a_mooncake_bootstrap_server_only_when_configured() {
    let p = rank(|_| 1);
    // Without a bootstrap (the dialect off, or a rank other than 0): 404.
    let plain = serve(&p, SideChannelConfig::default());
    let r = get(plain.address(), QUERY_PATH);
    assert_eq!((r.status, r.error().as_str()), (404, "NotFound"), "{r:?}");
    drop(plain);
    // With one, and a deployment key: answered unsigned (routers do not
    // sign), in the shape of vLLM's MooncakeBootstrapServer.
    let cfg = SideChannelConfig {
        key: Some(KEY.to_vec()),
        mooncake_bootstrap: Some(MooncakeBootstrap {
            engine_id: "prefill".into(),
            worker_addrs: vec!["127.0.0.1:17500".into(), "127.0.0.1:17501".into()],
        }),
        ..SideChannelConfig::default()
    };
    let sc = serve(&p, cfg);
    let addr = sc.address();
    let r = get(addr, QUERY_PATH);
    assert_eq!(r.status, 200, "{r:?}");
    let v: serde_json::Value = serde_json::from_str(&r.body).expect("JSON");
    assert_eq!(
        v,
        serde_json::json!({"0": {"engine_id": "prefill", "worker_addr": {
            "0": {"0": "127.0.0.1:17500"}, "1": {"0": "127.0.0.1:17501"}}}})
    );
    // Read only: vLLM's POST /register and any other method are 404.
    for r in [
        post(addr, QUERY_PATH, b"{}", &[]),
        post(addr, "/register", b"{}", &[]),
    ] {
        assert_eq!((r.status, r.error().as_str()), (404, "NotFound"), "{r:?}");
    }
    assert_eq!(sc.refused(), orbitkv::Refused::default());
    drop(sc);
    // A bootstrap that names nothing, or what a JSON answer must not hold.
    for (engine_id, addrs) in [
        ("", vec!["h:1"]),
        ("a b", vec!["h:1"]),
        ("e", vec![]),
        ("e", vec!["h\n1"]),
    ] {
        let cfg = SideChannelConfig {
            mooncake_bootstrap: Some(MooncakeBootstrap {
                engine_id: engine_id.into(),
                worker_addrs: addrs.into_iter().map(String::from).collect(),
            }),
            ..SideChannelConfig::default()
        };
        let err = SideChannel::start(cfg, p.runtime.clone()).expect_err("refused");
        assert!(matches!(err, SideChannelError::InvalidArgument(_)), "{err:?}");
    }
}

#[test]
fn excess_connections_are_answered_503_at_once_and_service_resumes() {
    let p = rank(|_| 1);
    let cfg = SideChannelConfig {
        read_timeout: Duration::from_millis(500),
        max_connections: 2,
        ..SideChannelConfig::default()
    };
    let sc = serve(&p, cfg);
    let addr = sc.address();
    let slow: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = connect(addr);
            s.write_all(
                b"POST /orbitkv/v1/handshake HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n",
            )
            .unwrap();
            // 2 MiB of the body at once: above 1 MiB/s for the next 2 s.
            s.write_all(&vec![b' '; 2 << 20]).unwrap();
            s
        })
        .collect();
    assert!(soon(|| sc.connections() == 2));
    // Past the shedding grace: connections whose heads are in and whose
    // bodies came faster than the minimum rate are not shed for a newcomer.
    std::thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    let extra = connect(addr); // sends nothing: the answer comes anyway
    let r = read_reply(extra);
    assert_eq!((r.status, r.error().as_str()), (503, "Busy"), "{r:?}");
    assert!(
        start.elapsed() < Duration::from_millis(400),
        "{:?}",
        start.elapsed()
    );
    assert_eq!((sc.refused().busy, sc.refused().shed), (1, 0));
    for s in slow {
        assert_eq!(read_reply(s).status, 408);
    }
    let r = post(addr, HANDSHAKE_PATH, br#"{"version": 9}"#, &[]);
    assert_eq!(r.status, 400, "service is back: {r:?}");
}

#[test]
fn garbage_never_stops_the_server() {
    let p = rank(|_| 1);
    let cfg = SideChannelConfig {
        read_timeout: Duration::from_secs(1),
        ..SideChannelConfig::default()
    };
    let sc = serve(&p, cfg);
    let addr = sc.address();
    let long_header = format!("GET / HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(100_000));
    let inputs: Vec<Vec<u8>> = vec![
        (0u8..=255).cycle().take(10_000).collect(),
        b"\r\n\r\n\r\n".to_vec(),
        b"POST /orbitkv/v1/handshake HTTP/1.1\r\nContent-Length: abc\r\n\r\n".to_vec(),
        b"POST /orbitkv/v1/handshake HTTP/1.1\r\nContent-Length: -5\r\n\r\n".to_vec(),
        b"POST /orbitkv/v1/handshake HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nabcdef"
            .to_vec(),
        b"POST /orbitkv/v1/handshake HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n".to_vec(),
        b"GET /\xff\xfe HTTP/1.1\r\n\r\n".to_vec(),
        b"GET / HTTP/9.9\r\n\r\n".to_vec(),
        long_header.into_bytes(),
    ];
    for raw in inputs {
        let mut s = connect(addr);
        let _ = s.write_all(&raw);
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink); // answered (4xx) or closed, within the read timeout
        if !sink.is_empty() {
            assert!(
                sink.starts_with(b"HTTP/1.1 4"),
                "{:?}",
                String::from_utf8_lossy(&sink)
            );
        }
    }
    assert_eq!(get(addr, HEALTH_PATH).status, 200);
    assert!(
        soon(|| sc.connections() == 0),
        "{} connections left",
        sc.connections()
    );
}

#[test]
fn a_second_side_channel_on_the_same_port_is_a_typed_error() {
    let p = rank(|_| 1);
    let sc = serve(&p, SideChannelConfig::default());
    let again = SideChannel::start(
        SideChannelConfig {
            port: sc.address().port(),
            ..SideChannelConfig::default()
        },
        p.runtime.clone(),
    );
    assert!(
        matches!(again, Err(SideChannelError::AddressInUse { .. })),
        "{again:?}"
    );
    let bad = SideChannel::start(
        SideChannelConfig {
            max_connections: 0,
            ..SideChannelConfig::default()
        },
        p.runtime.clone(),
    );
    assert!(
        matches!(bad, Err(SideChannelError::InvalidArgument(_))),
        "{bad:?}"
    );
    for read_timeout in [Duration::ZERO, Duration::MAX] {
        let bad = SideChannel::start(
            SideChannelConfig {
                read_timeout,
                ..SideChannelConfig::default()
            },
            p.runtime.clone(),
        );
        assert!(
            matches!(bad, Err(SideChannelError::InvalidArgument(_))),
            "{bad:?}"
        );
    }
}

#[test]
fn stop_is_bounded_and_a_gone_runtime_is_503() {
    let p = rank(|_| 1);
    let sc = serve(&p, SideChannelConfig::default());
    let addr = sc.address();
    // The side channel never keeps the runtime alive: the last `Arc` gone,
    // the runtime shuts down and the side channel answers 503.
    let Rank {
        mem: _mem, runtime, ..
    } = p;
    drop(runtime);
    let r = post(addr, HANDSHAKE_PATH, b"{}", &[]);
    assert_eq!(
        (r.status, r.error().as_str()),
        (503, "RuntimeStoppedError"),
        "{r:?}"
    );
    // A connection in the middle of a body does not hold the stop past its bound.
    let mut s = connect(addr);
    s.write_all(b"POST /orbitkv/v1/cancel HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let start = Instant::now();
    sc.stop();
    assert!(start.elapsed() < Duration::from_secs(4), "{:?}", start.elapsed());
    assert!(!sc.is_running());
    assert!(TcpStream::connect(addr).is_err(), "still listening after stop");
    sc.stop(); // idempotent
}

/// The process's threads: id and name (`/proc/self/task/*/comm`, names
/// cut at 15 bytes).
fn threads() -> Vec<(u64, String)> {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| {
            let t = t.ok()?;
            let tid = t.file_name().to_str()?.parse().ok()?;
            let name = std::fs::read_to_string(t.path().join("comm")).ok()?;
            Some((tid, name.trim().to_string()))
        })
        .collect()
}

/// Threads of the names the side channel's are: its own
/// (`orbitkv-side-channel`), actix-server's acceptor (`actix-server
/// acceptor`), its worker (`actix-rt|system:…`, a name the runtime's actix
/// arbiters share) and the worker's blocking pool (`tokio-rt-worker`, at
/// most 2, started when first needed).
fn side_channel_like() -> std::collections::BTreeMap<u64, String> {
    threads()
        .into_iter()
        .filter(|(_, n)| {
            ["orbitkv-side", "actix-", "tokio-"]
                .iter()
                .any(|p| n.starts_with(p))
        })
        .collect()
}

/// What the flood saw.
#[derive(Debug, Default)]
struct Flood {
    /// Connections opened.
    opened: usize,
    /// Closed by the server with no answer (shed).
    closed_silently: usize,
    /// Answered (`503` at once, or `408` at the head deadline) and closed.
    answered: Vec<u16>,
}

/// What a flood's connections trickle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trickle {
    /// The request head, never finished (a slowloris).
    Head,
    /// A body: the whole head at once (`Content-Length` 100000), then the
    /// body a byte at a time.
    Body,
}

/// Holds up to `at_once` connections to `addr` until `until`, opening one
/// every 10 ms while fewer are open, each sending its request head (or, for
/// [`Trickle::Body`], its body) one byte every 150 ms and never finishing
/// it; a connection the server closes is replaced. One thread, non-blocking
/// sockets.
fn flood(addr: SocketAddr, at_once: usize, until: Instant, trickle: Trickle) -> Flood {
    const HEAD: &[u8] = b"POST /orbitkv/v1/handshake HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    const BODY_HEAD: &[u8] =
        b"POST /orbitkv/v1/cancel HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{\"version\":3,";
    struct Slow {
        s: TcpStream,
        sent: usize,
        next: Instant,
        got: Vec<u8>,
    }
    let mut seen = Flood::default();
    let mut open: Vec<Slow> = Vec::new();
    let mut next_open = Instant::now();
    while Instant::now() < until {
        let now = Instant::now();
        if open.len() < at_once && now >= next_open {
            next_open = now + Duration::from_millis(10);
            if let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                if trickle == Trickle::Body {
                    let _ = s.write_all(BODY_HEAD);
                }
                s.set_nonblocking(true).unwrap();
                seen.opened += 1;
                open.push(Slow {
                    s,
                    sent: 0,
                    next: now,
                    got: Vec::new(),
                });
            }
        }
        open.retain_mut(|c| {
            let mut buf = [0u8; 512];
            loop {
                match c.s.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => c.got.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        if now >= c.next {
                            let byte = match trickle {
                                Trickle::Head => HEAD.get(c.sent).copied().unwrap_or(b'a'),
                                Trickle::Body => b' ',
                            };
                            if c.s.write(&[byte]).is_ok() {
                                c.sent += 1;
                            }
                            c.next = now + Duration::from_millis(150);
                        }
                        return true;
                    }
                    Err(_) => break, // reset
                }
            }
            // Closed by the server.
            let text = String::from_utf8_lossy(&c.got);
            match text.strip_prefix("HTTP/1.1 ").and_then(|t| t.get(..3)) {
                Some(code) => seen.answered.push(code.parse().unwrap_or(0)),
                None => seen.closed_silently += 1,
            }
            false
        });
        std::thread::sleep(Duration::from_millis(2));
    }
    seen
}

/// Issue 31: slowloris connections hold every place in the gate, yet a real
/// P/D request made during the flood is served: the newcomer sheds the
/// oldest connection that has sent no complete head, and the flood's
/// connections are closed. No thread is added.
#[test]
fn a_slow_header_flood_is_shed_and_real_requests_keep_getting_through() {
    real_requests_get_through_a_flood(Trickle::Head);
}

/// Issue 44: connections whose head is complete but whose body trickles (a
/// byte every 150 ms, far below 1 MiB/s) hold every place in the gate, yet
/// real handshakes made during the flood get `200` and their KV lands: a
/// newcomer sheds the oldest connection whose body is too slow.
#[test]
fn a_slow_body_flood_is_shed_and_real_requests_keep_getting_through() {
    real_requests_get_through_a_flood(Trickle::Body);
}

/// A flood of `trickle` connections at the side channel's limit, 5 s long,
/// and a real P/D request after another through it (see the two tests).
fn real_requests_get_through_a_flood(trickle: Trickle) {
    let _alone = ONE_SIDE_CHANNEL.write().unwrap_or_else(|e| e.into_inner());
    let p = rank(|i| (i % 251) as u8);
    let c = rank(|_| GUARD);
    let max = 16;
    let sc = SideChannel::start(
        SideChannelConfig {
            max_connections: max,
            ..SideChannelConfig::default() // the head deadline: 10 s
        },
        p.runtime.clone(),
    )
    .expect("side channel");
    let addr = sc.address();
    // Warm: one request through the blocking pool first.
    assert_eq!(get(addr, HEALTH_PATH).status, 200);
    assert_eq!(post(addr, HANDSHAKE_PATH, br#"{"version": 9}"#, &[]).status, 400);
    // Before any transfer the runtimes have no actix thread yet: these are
    // the side channel's (its thread, acceptor, worker, a blocking thread).
    let before = side_channel_like();
    assert!((4..=5).contains(&before.len()), "{before:?}");
    // During the flood: the same threads, and at most a second blocking one.
    // A blocking-pool thread (`tokio-`) may end once idle for tokio's 10 s
    // keep-alive (a slow, loaded machine): the side channel's own threads
    // must all stay.
    let own = |t: &u64| !before[t].starts_with("tokio-");
    let side_channel_threads = || {
        let now = side_channel_like();
        let kept = before.keys().filter(|t| own(t) && now.contains_key(t)).count();
        let pool = now
            .iter()
            .filter(|(t, n)| !before.contains_key(t) && n.starts_with("tokio-"))
            .count();
        (kept, pool)
    };

    let flood_ends = Instant::now() + Duration::from_secs(5);
    let flooder = std::thread::spawn(move || flood(addr, 300, flood_ends, trickle));
    // Every place is held by the flood before the first request.
    assert!(
        soon(|| sc.connections() == max),
        "{} connections",
        sc.connections()
    );
    std::thread::sleep(Duration::from_millis(500));

    let mut served = 0;
    let mut most_blocking = 0;
    let mut slowest = Duration::ZERO;
    while Instant::now() + Duration::from_millis(800) < flood_ends {
        let req = RequestId::new(format!("req-flood-{served}"));
        let hs = c
            .runtime
            .consumer_open(req.clone(), cap(), 0, vec![3, 4], 1)
            .unwrap();
        p.runtime
            .producer_open(req.clone(), vec![0, 1], cap(), 1)
            .unwrap();
        let start = Instant::now();
        let r = post(addr, HANDSHAKE_PATH, hs.to_json().as_bytes(), &[]);
        assert_eq!(
            (r.status, r.body.as_str()),
            (200, r#"{"ok":true}"#),
            "request {served} during the flood, after {:?}: {r:?} (refused {:?})",
            start.elapsed(),
            sc.refused()
        );
        for layer in 0..LAYERS {
            p.runtime.layer_ready(&req, layer, 0..2).unwrap();
        }
        p.runtime.producer_finish(&req).unwrap();
        let ev = wait_for(&c.runtime, "the consumer's outcome", |e| {
            matches!(
                e,
                RuntimeEvent::ConsumerCompleted { .. } | RuntimeEvent::ConsumerFailed { .. }
            )
        });
        assert!(matches!(ev, RuntimeEvent::ConsumerCompleted { .. }), "{ev:?}");
        slowest = slowest.max(start.elapsed());
        assert_eq!(block(&c, 1, 4), block(&p, 1, 1));
        assert_eq!(get(addr, HEALTH_PATH).status, 200);
        served += 1;
        assert!(sc.connections() <= max);
        let (kept, added) = side_channel_threads();
        assert_eq!(
            kept,
            before.keys().filter(|t| own(t)).count(),
            "{before:?} {:?}",
            threads()
        );
        most_blocking = most_blocking.max(added);
        std::thread::sleep(Duration::from_millis(100));
    }
    let seen = flooder.join().unwrap();
    assert!(served >= 10, "{served} requests in the flood");
    // docs/security.md records these (`--nocapture`).
    println!("{trickle:?} flood: {served} real requests, the slowest handshake-to-KV-landed {slowest:?}");
    assert!(slowest < Duration::from_secs(10), "{slowest:?}");
    let refused = sc.refused();
    // The flood's connections were shed (the flood saw them closed without
    // an answer); at most a few came while every place was within the grace
    // and were answered 503.
    assert!(refused.shed > 100, "{refused:?} {seen:?}");
    assert!(seen.closed_silently > 100, "{seen:?}");
    assert!(seen.opened >= 300, "{seen:?}");
    assert!(seen.answered.iter().all(|&s| s == 503), "{seen:?}");
    assert_eq!(refused.busy as usize, seen.answered.len(), "{refused:?} {seen:?}");
    // No thread added but (perhaps) the blocking pool's second.
    let blocking_before = before.values().filter(|n| n.starts_with("tokio-")).count();
    assert!(blocking_before + most_blocking <= 2, "{before:?} {:?}", threads());
    drop(sc);
}
