//! The P/D side channel: the HTTP server on each prefill rank that decode
//! ranks POST their handshake and cancel to (actix-web over actix-server).
//!
//! | route | answer |
//! |---|---|
//! | `GET /orbitkv/v1/health` | `200 {"ok":true}` |
//! | `POST /orbitkv/v1/handshake` | [`Runtime::producer_handshake_json`]: `200 {"ok":true}`, or the refusal |
//! | `POST /orbitkv/v1/cancel` | [`Runtime::producer_cancel_json`]: the same |
//! | `GET /query` | only when [`SideChannelConfig::mooncake_bootstrap`] is set (a prefill's rank 0 with the `mooncake` dialect on): the instance's engine ID and its ranks' side channels, as a Mooncake bootstrap server answers it ([`MooncakeBootstrap`]); `404` otherwise |
//! | anything else | `404` |
//!
//! A refusal is `{"error": NAME, "message": TEXT}` with `NAME` the Python
//! class the binding raises for that error ([`RuntimeError::class_name`]):
//! `400` malformed, unknown version or geometry (`HandshakeError`,
//! `GeometryError`, …), `403 ForbiddenError` (not the request's
//! capability), `503 OverloadedError` (the parking budget is full) or
//! `RuntimeStoppedError`; and, before the runtime sees anything: `401
//! BadSignature` (with a deployment key, a missing or wrong
//! `X-OrbitKV-Signature: sha256=<hex HMAC-SHA256(key, body)>`, checked in
//! constant time before parsing), `413 BadLength` (a body over `max_body`),
//! `408 Timeout` (the body did not arrive within `read_timeout`), `503 Busy`
//! (more than `max_connections` connections and none of them sheddable).
//! Every refusal closes the connection; a shed connection is closed
//! unanswered. A refusal's message may quote what the client sent (a
//! parser's error naming an unknown field): it is escaped and cut to 256
//! characters, in the reply and in the log; and the log has at most one
//! line a second per kind of refusal (route and error), the next line
//! counting those left out (`suppressed`).
//!
//! Bounds: request heads within `read_timeout` (actix-http's
//! `client_request_timeout`, `408`); bodies within `read_timeout` and
//! `max_body`; one request per connection (no keep-alive: the decode side
//! opens a connection per POST, and an idle connection never holds a slot);
//! a reply that the peer does not read within `read_timeout` ends the
//! connection ([`conn::Conn`]); at most `max_connections` connections served
//! at once ([`conn::Gate`]). One more arriving at the limit sheds the oldest
//! served connection that has been open for [`conn::SHED_GRACE`] (50 ms)
//! without a complete request head (a slowloris: a flood trickling header
//! bytes never sends a body a deployment key could sign, while decode
//! writes its whole request at once), or reading a body that has come
//! slower than [`conn::MIN_BODY_RATE`] (1 MiB/s) on average since it began
//! (counted in [`Refused::shed`] too), and takes its place: a flood of such
//! connections does not keep real handshakes out. Only when none is
//! sheddable (every head and body is in or arriving fast, or every
//! connection is younger than the grace) is it answered `503` at once and
//! closed (actix-server's own limit
//! only stops accepting, which would leave a client hanging in the kernel's
//! backlog); and at most as many
//! again being refused at a time (actix-server's `max_concurrent_connections`;
//! beyond that the kernel's listen backlog of 128 holds them briefly). One
//! worker thread, one accept thread, at most two blocking threads for parsing
//! and HMAC, whatever the clients do.
//!
//! The server runs on its own thread (`orbitkv-side-channel`) in its own
//! actix `System`, apart from the runtime's. It holds the runtime weakly: it
//! never keeps it alive, and once the runtime is gone every POST is answered
//! `503 RuntimeStoppedError`.
//!
//! [`RuntimeError::class_name`]: crate::RuntimeError::class_name

mod conn;
mod routes;

use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::thread::JoinHandle;
use std::time::Duration;

use actix_http::error::DispatchError;
use actix_http::{HttpService, KeepAlive, Protocol};
use actix_server::{Server, ServerBuilder, ServerHandle};
use actix_service::{fn_service, map_config, ServiceFactoryExt};
use actix_web::dev::AppConfig;
use crossbeam_channel::Receiver;
use parking_lot::Mutex;
use tokio::net::TcpStream;

/// The sender's side of this protocol (paths, signature, HTTP client),
/// which depends on nothing of the server or the actors.
pub use crate::side_channel_client as client;
pub use crate::side_channel_client::{
    sign, verify, CANCEL_PATH, HANDSHAKE_PATH, HEALTH_PATH, SIGNATURE_HEADER,
};

use crate::actors::stats::Counter;
use crate::actors::Runtime;
pub use crate::error::SideChannelError;
use conn::{Admission, Conn, Gate};
use routes::Shared;

/// Where a Mooncake bootstrap server answers a router's query (vLLM's
/// `MooncakeBootstrapServer`); served only with a [`MooncakeBootstrap`].
pub const QUERY_PATH: &str = "/query";

/// The longest engine ID and side channel address `GET /query` names.
const MAX_BOOTSTRAP_FIELD: usize = 256;
/// The most TP ranks `GET /query` names.
const MAX_BOOTSTRAP_RANKS: usize = 1024;

/// What a prefill's rank 0 answers on `GET /query`, in the shape of vLLM's
/// `MooncakeBootstrapServer` (`mooncake_utils.py`: data-parallel rank →
/// `{"engine_id": E, "worker_addr": {tp_rank: {pp_rank: addr}}}`), so a
/// router in its `mooncake` mode (vllm-router, llm-d) learns the engine ID
/// it puts in the decode half. One data-parallel rank (`"0"`), one pipeline
/// rank (`"0"`); each TP rank's address is its OrbitKV side channel. Read
/// only, and nothing in it is a secret: the engine ID and addresses that
/// `/orbitkv/v1/health` and the instance's configuration already tell.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct MooncakeBootstrap {
    /// The instance's vLLM engine ID (`kv_transfer_config.engine_id`).
    pub engine_id: String,
    /// The side channel `host:port` of each TP rank, in rank order.
    pub worker_addrs: Vec<String>,
}

impl MooncakeBootstrap {
    /// The JSON `GET /query` answers; refuses an engine ID or an address
    /// that is empty, longer than 256 bytes or holds a control character
    /// or a space, and no ranks or more than 1024.
    pub fn body(&self) -> Result<String, SideChannelError> {
        let bad = |s: &str| {
            s.is_empty()
                || s.len() > MAX_BOOTSTRAP_FIELD
                || s.chars().any(|c| c.is_control() || c.is_whitespace())
        };
        if bad(&self.engine_id) {
            return Err(invalid(
                "the Mooncake bootstrap's engine_id must be 1..256 bytes without spaces",
            ));
        }
        if self.worker_addrs.is_empty() || self.worker_addrs.len() > MAX_BOOTSTRAP_RANKS {
            return Err(invalid("the Mooncake bootstrap names 1..1024 TP ranks"));
        }
        if self.worker_addrs.iter().any(|a| bad(a)) {
            return Err(invalid(
                "a Mooncake bootstrap worker address must be 1..256 bytes without spaces",
            ));
        }
        let ranks: serde_json::Map<String, serde_json::Value> = self
            .worker_addrs
            .iter()
            .enumerate()
            .map(|(r, a)| (r.to_string(), serde_json::json!({"0": a})))
            .collect();
        Ok(serde_json::json!({"0": {"engine_id": self.engine_id, "worker_addr": ranks}}).to_string())
    }
}

/// The longest timeout accepted (deadlines are instants: far larger ones
/// would overflow).
const MAX_TIMEOUT: Duration = Duration::from_secs(86_400);

/// The side channel's settings.
#[derive(Clone, PartialEq, Eq)]
pub struct SideChannelConfig {
    /// Host (name or address) to listen on.
    pub host: String,
    /// Port; 0 picks a free one ([`SideChannel::address`] tells which).
    pub port: u16,
    /// The deployment key: when set, every POST must be signed with it.
    pub key: Option<Vec<u8>>,
    /// Largest body accepted (`413` above).
    pub max_body: usize,
    /// How long a request's head, then its body, may take to arrive (`408`
    /// after), and how long a reply may wait for the peer to read it.
    pub read_timeout: Duration,
    /// Connections served at once; one more sheds the oldest connection
    /// without a complete request head after the grace, else is answered
    /// `503` and closed.
    pub max_connections: usize,
    /// How long [`SideChannel::stop`] lets requests in progress finish
    /// (whole seconds, at least 1); it returns within this plus 2 s.
    pub stop_timeout: Duration,
    /// What `GET /query` answers (a prefill's rank 0 with the `mooncake`
    /// dialect on); `None`: `404`.
    pub mooncake_bootstrap: Option<MooncakeBootstrap>,
}

impl Default for SideChannelConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 0,
            key: None,
            max_body: 16 << 20,
            read_timeout: Duration::from_secs(10),
            max_connections: 64,
            stop_timeout: Duration::from_secs(1),
            mooncake_bootstrap: None,
        }
    }
}

impl std::fmt::Debug for SideChannelConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SideChannelConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("key", &self.key.as_ref().map(|_| "<set>"))
            .field("max_body", &self.max_body)
            .field("read_timeout", &self.read_timeout)
            .field("max_connections", &self.max_connections)
            .field("stop_timeout", &self.stop_timeout)
            .field("mooncake_bootstrap", &self.mooncake_bootstrap)
            .finish()
    }
}

/// Counters of what the side channel refused.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    signature: Counter,
    forbidden: Counter,
    malformed: Counter,
    busy: Counter,
    too_large: Counter,
    timed_out: Counter,
    shed: Counter,
}

/// What the side channel refused, by cause, since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Refused {
    /// `401`: missing or wrong signature (with a deployment key).
    pub signature: u64,
    /// `403`: not the request's capability.
    pub forbidden: u64,
    /// `400`: malformed, unknown version, bad geometry, broken body.
    pub malformed: u64,
    /// `503`: a runtime budget full, the runtime stopped, or too many connections.
    pub busy: u64,
    /// `413`: a body over `max_body`.
    pub too_large: u64,
    /// `408`: a body that did not arrive within `read_timeout` (a request
    /// head that did not is answered by actix-http and not counted).
    pub timed_out: u64,
    /// Closed without an answer: a connection that had not sent a complete
    /// request head after the grace, or whose body came slower than 1 MiB/s
    /// on average (after the grace), shed to serve one more connection at
    /// `max_connections`.
    pub shed: u64,
}

impl Counters {
    fn snapshot(&self) -> Refused {
        Refused {
            signature: self.signature.get(),
            forbidden: self.forbidden.get(),
            malformed: self.malformed.get(),
            busy: self.busy.get(),
            too_large: self.too_large.get(),
            timed_out: self.timed_out.get(),
            shed: self.shed.get(),
        }
    }
}

/// A running side channel. Stopped by [`SideChannel::stop`] or on drop.
pub struct SideChannel {
    address: SocketAddr,
    handle: ServerHandle,
    /// The server's thread until a stop took it.
    thread: Mutex<Option<JoinHandle<()>>>,
    running: AtomicBool,
    /// Disconnected when the server's thread ends.
    done: Receiver<()>,
    refused: Arc<Counters>,
    gate: Arc<Gate>,
    stop_within: Duration,
}

impl std::fmt::Debug for SideChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SideChannel")
            .field("address", &self.address)
            .field("running", &self.is_running())
            .finish()
    }
}

fn invalid(what: &str) -> SideChannelError {
    SideChannelError::InvalidArgument(what.into())
}

impl SideChannel {
    /// Listens on `cfg.host:cfg.port` and serves `runtime`'s producer side
    /// until stopped. The port is bound before this returns (an address in
    /// use is [`SideChannelError::AddressInUse`]).
    pub fn start(cfg: SideChannelConfig, runtime: Arc<Runtime>) -> Result<Self, SideChannelError> {
        if cfg.max_connections == 0 {
            return Err(invalid("max_connections must be at least 1"));
        }
        if cfg.max_body == 0 {
            return Err(invalid("max_body must be at least 1 byte"));
        }
        if cfg.read_timeout.is_zero() || cfg.read_timeout > MAX_TIMEOUT {
            return Err(invalid("read_timeout must be more than 0 and at most a day"));
        }
        if cfg.stop_timeout > MAX_TIMEOUT {
            return Err(invalid("stop_timeout must be at most a day"));
        }
        if cfg.key.as_ref().is_some_and(|k| k.is_empty()) {
            return Err(invalid("the deployment key is empty"));
        }
        let query = cfg
            .mooncake_bootstrap
            .as_ref()
            .map(MooncakeBootstrap::body)
            .transpose()?;
        let address = format!("{}:{}", cfg.host, cfg.port);
        let listener = TcpListener::bind((cfg.host.as_str(), cfg.port)).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AddrInUse {
                SideChannelError::AddressInUse {
                    address: address.clone(),
                }
            } else {
                SideChannelError::Bind {
                    address: address.clone(),
                    reason: e.to_string(),
                }
            }
        })?;
        let bound = listener.local_addr().map_err(|e| SideChannelError::Bind {
            address,
            reason: e.to_string(),
        })?;
        let refused = Arc::new(Counters::default());
        let gate = Arc::new(Gate::new(
            cfg.max_connections,
            conn::SHED_GRACE,
            conn::MIN_BODY_RATE,
        ));
        let shared = Arc::new(Shared {
            runtime: Arc::downgrade(&runtime),
            key: cfg.key.as_deref().map(Arc::from),
            max_body: cfg.max_body,
            read_timeout: cfg.read_timeout,
            refused: refused.clone(),
            log: routes::LogLimiter::new(routes::LOG_EVERY),
            address: bound,
            query,
        });
        let stop_secs = cfg.stop_timeout.as_secs().max(1);
        let builder = server(listener, shared, gate.clone(), refused.clone(), &cfg, stop_secs)
            .map_err(|e| SideChannelError::Start(e.to_string()))?;

        let (boot_tx, boot_rx) = crossbeam_channel::bounded::<Result<ServerHandle, String>>(1);
        let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(0);
        let thread = std::thread::Builder::new()
            .name("orbitkv-side-channel".into())
            .spawn(move || {
                let _done = done_tx; // disconnects `done` when this thread ends
                let sys = actix_web::rt::System::new();
                sys.block_on(async move {
                    let mut server = builder.run();
                    let handle = server.handle();
                    // The first poll starts the accept thread and the worker
                    // (and reports a worker that failed to start).
                    let first = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut server).poll(cx))).await;
                    match first {
                        Poll::Pending => {
                            let _ = boot_tx.send(Ok(handle));
                            if let Err(e) = server.await {
                                tracing::warn!("side channel stopped with an error: {e}");
                            }
                        }
                        Poll::Ready(r) => {
                            let why = r
                                .err()
                                .map_or_else(|| "it stopped at once".into(), |e| e.to_string());
                            let _ = boot_tx.send(Err(why));
                        }
                    }
                });
            })
            .map_err(|e| SideChannelError::Start(format!("cannot spawn its thread: {e}")))?;
        let handle = match boot_rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(handle)) => handle,
            Ok(Err(why)) => {
                let _ = thread.join();
                return Err(SideChannelError::Start(why));
            }
            Err(_) => {
                return Err(SideChannelError::Start(
                    "its thread did not report within 10 s".into(),
                ))
            }
        };
        tracing::info!(%bound, "side channel listening");
        Ok(Self {
            address: bound,
            handle,
            thread: Mutex::new(Some(thread)),
            running: AtomicBool::new(true),
            done: done_rx,
            refused,
            gate,
            stop_within: Duration::from_secs(stop_secs) + Duration::from_secs(2),
        })
    }

    /// The bound address (`host:port`; the port actually bound when 0 was asked).
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// What was refused so far, by cause.
    pub fn refused(&self) -> Refused {
        self.refused.snapshot()
    }

    /// Connections being served now (not counting ones being refused).
    pub fn connections(&self) -> usize {
        self.gate.open()
    }

    /// Whether the server still runs.
    pub fn is_running(&self) -> bool {
        self.running.load(Ordering::Acquire)
    }

    /// Stops listening, lets requests in progress finish for up to
    /// `stop_timeout`, then closes every connection. Returns within
    /// `stop_timeout` + 2 s; idempotent (a stop while another is under way
    /// waits for it).
    pub fn stop(&self) {
        let mut slot = self.thread.lock();
        let Some(thread) = slot.take() else {
            return;
        };
        self.running.store(false, Ordering::Release);
        // The command is sent when `stop` is called; its completion future
        // is not needed (the thread's end tells).
        drop(self.handle.stop(true));
        match self.done.recv_timeout(self.stop_within) {
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) | Ok(()) => {
                let _ = thread.join();
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                tracing::warn!(
                    address = %self.address,
                    "side channel did not stop within {:?}; its thread is left to end by itself",
                    self.stop_within
                );
            }
        }
    }
}

impl Drop for SideChannel {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The actix-server with one worker serving the routes behind the gate.
///
/// One worker: the side channel carries a few small POSTs per request, which
/// one event loop multiplexes; actix-server's connection limit is per worker,
/// so one worker makes `max_connections` exact; and the CPU work (HMAC and
/// parsing up to `max_body` of JSON) runs on that worker's blocking pool of
/// two threads, not on the loop.
fn server(
    listener: TcpListener,
    shared: Arc<Shared>,
    gate: Arc<Gate>,
    refused: Arc<Counters>,
    cfg: &SideChannelConfig,
    stop_secs: u64,
) -> std::io::Result<ServerBuilder> {
    let addr = listener.local_addr()?;
    let read_timeout = cfg.read_timeout;
    // Served connections plus as many being refused at once.
    let backstop = cfg.max_connections.saturating_mul(2);
    Server::build()
        .workers(1)
        .worker_max_blocking_threads(2)
        .max_concurrent_connections(backstop)
        .disable_signals()
        .shutdown_timeout(stop_secs)
        .listen("orbitkv-side-channel", listener, move || {
            let http = HttpService::build()
                .keep_alive(KeepAlive::Disabled)
                .client_request_timeout(read_timeout)
                .client_disconnect_timeout(Duration::ZERO)
                .local_addr(addr)
                // The handlers' way to the connection's state (`routes::app`
                // marks its head complete).
                .on_connect_ext(|io: &Conn, ext: &mut actix_http::Extensions| {
                    ext.insert(io.state().clone());
                })
                .finish(map_config(routes::app(shared.clone()), |_| AppConfig::default()));
            let (gate, refused) = (gate.clone(), refused.clone());
            fn_service(move |io: TcpStream| {
                let (gate, refused) = (gate.clone(), refused.clone());
                async move {
                    let slot = match gate.enter() {
                        Admission::Open(slot) => slot,
                        Admission::Shed(slot) => {
                            refused.shed.inc();
                            slot
                        }
                        Admission::Full => {
                            refused.busy.inc();
                            conn::refuse(io, gate.limit()).await;
                            return Err(DispatchError::Io(std::io::Error::other(
                                "over the connection limit",
                            )));
                        }
                    };
                    let _ = io.set_nodelay(true);
                    let peer = io.peer_addr().ok();
                    Ok((Conn::new(io, slot, read_timeout), Protocol::Http1, peer))
                }
            })
            .and_then(http)
        })
}
