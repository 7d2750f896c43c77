//! The routes (an actix-web `App`) and what each answers.
//!
//! A POST's body is read with the size and time bounds on the worker's event
//! loop; the signature check and the runtime call (parsing and validating
//! with `src/wire.rs`, up to 16 MiB of JSON) run on the worker's small
//! blocking pool, so one large handshake never stalls the other connections.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use actix_http::body::{BodySize, BodyStream, MessageBody};
use parking_lot::Mutex;

use actix_web::dev::Service;
use actix_web::http::header::CONTENT_LENGTH;
use actix_web::http::StatusCode;
use actix_web::web::{self, Bytes};
use actix_web::{App, HttpRequest, HttpResponse};

use super::conn::ConnState;
use super::{Counters, CANCEL_PATH, HANDSHAKE_PATH, HEALTH_PATH, QUERY_PATH};
use crate::actors::Runtime;
use crate::error::{untrusted, ProtocolError, RuntimeError};
use crate::side_channel_client::{verify, SIGNATURE_HEADER};
use crate::wire::Fence;

/// The most characters of a refusal's message (escaped, [`untrusted`]):
/// whatever a client sent, a reply and a log line stay short.
pub(crate) const MAX_MESSAGE: usize = 256;

/// How often one kind of refusal is logged at most ([`LogLimiter`]).
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(1);

/// At most one log line per kind of refusal per [`LOG_EVERY`]; the lines
/// left out are counted and the next line logged says how many. A
/// stranger's flood of bad requests is counted in `Refused`, not written a
/// line at a time into the worker's log.
#[derive(Debug)]
pub(crate) struct LogLimiter {
    every: Duration,
    kinds: Mutex<HashMap<(&'static str, &'static str), Kind>>,
}

#[derive(Debug)]
struct Kind {
    last: Instant,
    suppressed: u64,
}

impl LogLimiter {
    pub(crate) fn new(every: Duration) -> Self {
        Self {
            every,
            kinds: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a refusal of `kind` may be logged now: `Some(n)` with the
    /// `n` left out since the last line, or `None` (counted, not logged).
    pub(crate) fn admit(&self, kind: (&'static str, &'static str)) -> Option<u64> {
        self.admit_at(kind, Instant::now())
    }

    fn admit_at(&self, kind: (&'static str, &'static str), now: Instant) -> Option<u64> {
        let mut kinds = self.kinds.lock();
        match kinds.get_mut(&kind) {
            Some(k) if now.saturating_duration_since(k.last) < self.every => {
                k.suppressed += 1;
                None
            }
            Some(k) => {
                k.last = now;
                Some(std::mem::take(&mut k.suppressed))
            }
            None => {
                kinds.insert(
                    kind,
                    Kind {
                        last: now,
                        suppressed: 0,
                    },
                );
                Some(0)
            }
        }
    }
}

/// What every worker's handlers share.
pub(crate) struct Shared {
    /// Weak: the side channel never keeps a runtime alive; once it is gone
    /// every POST is answered `503 RuntimeStoppedError`.
    pub(crate) runtime: Weak<Runtime>,
    pub(crate) key: Option<Arc<[u8]>>,
    pub(crate) max_body: usize,
    pub(crate) read_timeout: Duration,
    pub(crate) refused: Arc<Counters>,
    /// Paces the refusals' log lines.
    pub(crate) log: LogLimiter,
    /// The bound address, named in the log lines.
    pub(crate) address: std::net::SocketAddr,
    /// What `GET /query` answers (`MooncakeBootstrap::body`); `None`: `404`.
    pub(crate) query: Option<String>,
}

#[derive(Debug, Clone, Copy)]
enum Route {
    Handshake,
    Cancel,
}

impl Route {
    fn what(self) -> &'static str {
        match self {
            Route::Handshake => "handshake",
            Route::Cancel => "cancel",
        }
    }
}

/// A refusal: its status, the `error` name and the message.
#[derive(Debug)]
struct Refusal {
    status: StatusCode,
    error: &'static str,
    message: String,
}

impl Refusal {
    /// The message is escaped and cut ([`untrusted`], [`MAX_MESSAGE`]): it
    /// may quote what the client sent.
    fn new(status: StatusCode, error: &'static str, message: impl AsRef<str>) -> Self {
        Self {
            status,
            error,
            message: untrusted(message.as_ref(), MAX_MESSAGE),
        }
    }

    /// `{"error": …, "message": …}`, and the connection is closed after it.
    fn response(&self) -> HttpResponse {
        let body = serde_json::json!({"error": self.error, "message": self.message}).to_string();
        HttpResponse::build(self.status)
            .content_type("application/json")
            .force_close()
            .body(body)
    }
}

/// The status a runtime refusal gets: `403` without the capability, `503`
/// when a budget is full (or the runtime has stopped), `400` for everything
/// else (malformed, unknown version, geometry, …).
pub(crate) fn status_of(err: &RuntimeError) -> StatusCode {
    match err {
        RuntimeError::Forbidden { .. } => StatusCode::FORBIDDEN,
        RuntimeError::Overloaded(_) | RuntimeError::Stopped => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::BAD_REQUEST,
    }
}

impl Shared {
    /// Checks the signature, then hands the body to the runtime, naming
    /// `source` (the peer's address: the runtime's per-source budgets).
    /// Runs on a blocking thread.
    fn admit(
        &self,
        route: Route,
        signature: Option<&[u8]>,
        body: &[u8],
        source: Option<IpAddr>,
    ) -> Result<Option<Fence>, Refusal> {
        if let Some(key) = &self.key {
            if !verify(key, signature, body) {
                self.refused.signature.inc();
                return Err(Refusal::new(
                    StatusCode::UNAUTHORIZED,
                    "BadSignature",
                    format!("missing or wrong {SIGNATURE_HEADER}"),
                ));
            }
        }
        let result = match self.runtime.upgrade() {
            None => Err(RuntimeError::Stopped),
            Some(rt) => match std::str::from_utf8(body) {
                Err(_) => Err(ProtocolError::Malformed {
                    what: route.what(),
                    reason: "not UTF-8".into(),
                }
                .into()),
                Ok(text) => match route {
                    Route::Handshake => rt.producer_handshake_json_from(text, source).map(|()| None),
                    Route::Cancel => rt.producer_cancel_json_from(text, source),
                },
            },
        };
        result.map_err(|e| {
            let status = status_of(&e);
            match status {
                StatusCode::FORBIDDEN => self.refused.forbidden.inc(),
                StatusCode::SERVICE_UNAVAILABLE => self.refused.busy.inc(),
                _ => self.refused.malformed.inc(),
            }
            let refusal = Refusal::new(status, e.class_name(), e.to_string());
            if let Some(suppressed) = self.log.admit((route.what(), e.class_name())) {
                tracing::warn!(
                    side_channel = %self.address,
                    what = route.what(),
                    error = e.class_name(),
                    suppressed,
                    "side channel refused: {}",
                    refusal.message
                );
            }
            refusal
        })
    }
}

fn ok() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/json")
        .body(r#"{"ok":true}"#)
}

/// `{"ok":true,"tp_rank":R,"tp_size":N}`: a router learns the instance's
/// TP size (and checks its own configuration) from the instance itself.
/// Unauthenticated, like any health check: rank and size are not secrets.
async fn health(st: web::Data<Shared>) -> HttpResponse {
    match st.runtime.upgrade() {
        Some(rt) => {
            let l = rt.layout();
            HttpResponse::Ok().content_type("application/json").body(format!(
                r#"{{"ok":true,"tp_rank":{},"tp_size":{}}}"#,
                l.tp_rank, l.tp_size
            ))
        }
        None => Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "RuntimeStoppedError",
            "the runtime stopped",
        )
        .response(),
    }
}

/// A Mooncake bootstrap server's answer (`MooncakeBootstrap`), for a router
/// in its `mooncake` mode; `404` on a side channel that has none (the
/// dialect off, or not rank 0). Unauthenticated, like the health check:
/// nothing in it is a secret.
async fn query(req: HttpRequest, st: web::Data<Shared>) -> HttpResponse {
    match (&st.query, st.runtime.upgrade()) {
        (None, _) => not_found(req).await,
        (Some(body), Some(_)) => HttpResponse::Ok()
            .content_type("application/json")
            .body(body.clone()),
        (Some(_), None) => Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "RuntimeStoppedError",
            "the runtime stopped",
        )
        .response(),
    }
}

async fn not_found(req: HttpRequest) -> HttpResponse {
    Refusal::new(StatusCode::NOT_FOUND, "NotFound", req.path()).response()
}

async fn handshake(req: HttpRequest, body: web::Payload, st: web::Data<Shared>) -> HttpResponse {
    serve(Route::Handshake, req, body, st).await
}

async fn cancel(req: HttpRequest, body: web::Payload, st: web::Data<Shared>) -> HttpResponse {
    serve(Route::Cancel, req, body, st).await
}

/// Reads the body within the bounds, then admits it off the event loop.
async fn serve(route: Route, req: HttpRequest, payload: web::Payload, st: web::Data<Shared>) -> HttpResponse {
    let conn = req.conn_data::<Arc<ConnState>>().cloned();
    let response = read_and_admit(route, &req, payload, &st, conn.as_ref()).await;
    if let Some(c) = &conn {
        c.body_ended();
    }
    response
}

/// [`serve`]'s body: the bounds on the body, then the runtime.
async fn read_and_admit(
    route: Route,
    req: &HttpRequest,
    payload: web::Payload,
    st: &web::Data<Shared>,
    conn: Option<&Arc<ConnState>>,
) -> HttpResponse {
    let max = st.max_body;
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(n) = declared.filter(|&n| n > max as u64) {
        st.refused.too_large.inc();
        let msg = format!("Content-Length {n} (at most {max})");
        return Refusal::new(StatusCode::PAYLOAD_TOO_LARGE, "BadLength", msg).response();
    }
    if let Some(c) = conn {
        c.body_started();
    }
    let counted = Counted {
        body: BodyStream::new(payload),
        conn: conn.cloned(),
    };
    let read = actix_http::body::to_bytes_limited(counted, max);
    let body: Bytes = match tokio::time::timeout(st.read_timeout, read).await {
        Err(_) => {
            st.refused.timed_out.inc();
            let msg = format!("body not received in {:.3}s", st.read_timeout.as_secs_f64());
            return Refusal::new(StatusCode::REQUEST_TIMEOUT, "Timeout", msg).response();
        }
        Ok(Err(_)) => {
            st.refused.too_large.inc();
            let msg = format!("body over {max} bytes");
            return Refusal::new(StatusCode::PAYLOAD_TOO_LARGE, "BadLength", msg).response();
        }
        Ok(Ok(Err(_))) if conn.is_some_and(|c| c.was_shed()) => {
            // Shed for a slow body (counted as such): nobody reads this.
            return Refusal::new(StatusCode::REQUEST_TIMEOUT, "Shed", "body too slow").response();
        }
        Ok(Ok(Err(e))) => {
            // The client broke off or sent a broken chunked body.
            st.refused.malformed.inc();
            return Refusal::new(StatusCode::BAD_REQUEST, "BadBody", e.to_string()).response();
        }
        Ok(Ok(Ok(body))) => body,
    };
    if let Some(c) = conn {
        c.body_ended();
    }
    let signature = req.headers().get(SIGNATURE_HEADER).map(|v| v.as_bytes().to_vec());
    let source = req.peer_addr().map(|a| a.ip());
    let shared = st.clone().into_inner();
    match web::block(move || shared.admit(route, signature.as_deref(), &body, source)).await {
        Ok(Ok(None)) => ok(),
        Ok(Ok(Some(fence))) => HttpResponse::Ok()
            .content_type("application/json")
            .body(fence.reply()),
        Ok(Err(refusal)) => refusal.response(),
        // The worker's blocking pool is gone: the server is stopping.
        Err(_) => Refusal::new(
            StatusCode::SERVICE_UNAVAILABLE,
            RuntimeError::Stopped.class_name(),
            "the side channel is stopping",
        )
        .response(),
    }
}

/// A body read through, its bytes counted on its connection as they come
/// (the gate sheds a body that comes too slowly, `conn::MIN_BODY_RATE`).
struct Counted<B> {
    body: B,
    conn: Option<Arc<ConnState>>,
}

impl<B: MessageBody + Unpin> MessageBody for Counted<B> {
    type Error = B::Error;

    fn size(&self) -> BodySize {
        self.body.size()
    }

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, Self::Error>>> {
        let this = self.get_mut();
        let next = Pin::new(&mut this.body).poll_next(cx);
        if let (Poll::Ready(Some(Ok(chunk))), Some(c)) = (&next, &this.conn) {
            c.body_received(chunk.len());
        }
        next
    }
}

/// The side channel's routes; any other path or method is `404`.
pub(crate) fn app(
    shared: Arc<Shared>,
) -> App<
    impl actix_web::dev::ServiceFactory<
        actix_web::dev::ServiceRequest,
        Config = (),
        Response = actix_web::dev::ServiceResponse,
        Error = actix_web::Error,
        InitError = (),
    >,
> {
    App::new()
        .app_data(web::Data::from(shared))
        // Called as soon as actix-http has parsed a request head, before
        // routing: the connection is no longer one the gate may shed.
        .wrap_fn(|req, srv| {
            if let Some(conn) = req.conn_data::<Arc<ConnState>>() {
                conn.head_complete();
            }
            srv.call(req)
        })
        .service(
            web::resource(HEALTH_PATH)
                .route(web::get().to(health))
                .default_service(web::to(not_found)),
        )
        .service(
            web::resource(QUERY_PATH)
                .route(web::get().to(query))
                .default_service(web::to(not_found)),
        )
        .service(
            web::resource(HANDSHAKE_PATH)
                .route(web::post().to(handshake))
                .default_service(web::to(not_found)),
        )
        .service(
            web::resource(CANCEL_PATH)
                .route(web::post().to(cancel))
                .default_service(web::to(not_found)),
        )
        .default_service(web::to(not_found))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One line per kind a second; the next line counts those left out; kinds
    /// are paced apart.
    #[test]
    fn refusal_lines_are_paced_per_kind_and_count_what_they_left_out() {
        let log = LogLimiter::new(LOG_EVERY);
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let bad = ("cancel", "HandshakeError");
        assert_eq!(log.admit_at(bad, at(0)), Some(0));
        for ms in 1..50 {
            assert_eq!(log.admit_at(bad, at(ms)), None);
        }
        // Another kind is not held back by the first.
        assert_eq!(log.admit_at(("handshake", "HandshakeError"), at(10)), Some(0));
        assert_eq!(log.admit_at(bad, at(999)), None);
        assert_eq!(log.admit_at(bad, at(1000)), Some(50));
        assert_eq!(log.admit_at(bad, at(2500)), Some(0));
    }

    #[test]
    fn a_refusal_message_is_escaped_and_short() {
        let r = Refusal::new(StatusCode::BAD_REQUEST, "HandshakeError", "x\n".repeat(1 << 20));
        assert!(!r.message.contains('\n'));
        assert!(
            r.message.chars().count() <= MAX_MESSAGE + 1,
            "{}",
            r.message.len()
        );
    }
}
