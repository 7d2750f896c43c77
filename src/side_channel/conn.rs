//! Per-connection bounds that actix-web does not give as such:
//!
//! * [`Gate`]: at most `max_connections` connections are served at once.
//!   One more arriving at the limit sheds (closes) the oldest served
//!   connection that has been open for at least the grace and has still not
//!   delivered a complete request head (a slowloris: a real client writes
//!   its whole request at once, its head is parsed within a millisecond of
//!   its arrival) and takes its place; when no connection is sheddable (every
//!   head is in, or the connections are younger than the grace) it is
//!   answered `503` at once and closed (actix-server's own limit would stop
//!   accepting instead, leaving the client waiting in the kernel's backlog
//!   with no answer). A connection whose head is in but whose body is still
//!   arriving is sheddable the same way once the grace has passed since its
//!   body began, if its body has arrived slower than [`MIN_BODY_RATE`] on
//!   average since then (a slow-body flood: a real client writes its body
//!   with its head, a handshake of even 16 MiB in milliseconds).
//! * [`Conn`]: the served connection's socket, holding its [`Slot`]; a write
//!   that makes no progress for the read timeout (a peer that stopped
//!   reading its replies) fails the connection, so no connection can hold
//!   its slot forever; a shed connection fails its next read or write.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

/// How long a served connection may go without a complete request head
/// before a newcomer at the limit may shed it. A real client's head arrives
/// with its connection; the grace keeps a burst of real clients, whose heads
/// the worker has not parsed yet, from shedding each other.
pub(crate) const SHED_GRACE: Duration = Duration::from_millis(50);

/// The slowest a body may arrive, on average since it began, and not be
/// shed (once past the grace) for a newcomer at the limit: 1 MiB/s. A
/// decode rank writes its handshake or cancel (bytes to a few MiB) in one
/// go over a data-center network, at hundreds of MiB/s; a flood trickling
/// bodies byte by byte is thousands of times slower. Only a connection
/// limit reached makes it matter: a slow link's large body is never cut
/// while a place is free.
pub(crate) const MIN_BODY_RATE: u64 = 1 << 20;

/// The connections being served, in the order they opened.
#[derive(Debug)]
pub(crate) struct Gate {
    limit: usize,
    grace: Duration,
    /// Bytes a second ([`MIN_BODY_RATE`]).
    min_body_rate: u64,
    served: Mutex<Served>,
}

#[derive(Debug, Default)]
struct Served {
    next: u64,
    /// By id, which grows with each connection: the first is the oldest.
    conns: BTreeMap<u64, Arc<ConnState>>,
}

/// What a served connection shares with the gate and with its handlers.
#[derive(Debug)]
pub(crate) struct ConnState {
    id: u64,
    opened: Instant,
    /// Its request head was parsed (set by the app, before routing).
    head: AtomicBool,
    /// Its body while a handler reads it.
    body: Mutex<Body>,
    /// The gate shed it: its next read or write fails.
    shed: AtomicBool,
    /// The task to wake when it is shed.
    waker: Mutex<Option<Waker>>,
}

/// A body being read: since when, and how many bytes came so far.
#[derive(Debug, Default)]
struct Body {
    /// `None`: no body is being read (none begun, or it is complete).
    since: Option<Instant>,
    bytes: u64,
}

impl ConnState {
    /// Its request head is complete: it is no longer sheddable for its head
    /// (only for a slow body, [`Self::body_started`]).
    pub(crate) fn head_complete(&self) {
        self.head.store(true, Ordering::Release);
    }

    /// A handler begins reading its body: from now on it is sheddable if
    /// the body arrives slower than the gate's minimum rate.
    pub(crate) fn body_started(&self) {
        self.body_started_at(Instant::now());
    }

    fn body_started_at(&self, at: Instant) {
        *self.body.lock() = Body {
            since: Some(at),
            bytes: 0,
        };
    }

    /// `n` more bytes of its body arrived.
    pub(crate) fn body_received(&self, n: usize) {
        let mut b = self.body.lock();
        b.bytes = b.bytes.saturating_add(n as u64);
    }

    /// Its body is complete (or refused): it is no longer sheddable.
    pub(crate) fn body_ended(&self) {
        self.body.lock().since = None;
    }

    /// Whether the gate shed it.
    pub(crate) fn was_shed(&self) -> bool {
        self.shed.load(Ordering::Acquire)
    }

    /// Whether a newcomer at the limit may shed it at `now`: no complete
    /// head after the grace, or a body being read for at least the grace
    /// that has come slower than `min_rate` bytes a second on average.
    fn sheddable(&self, now: Instant, grace: Duration, min_rate: u64) -> bool {
        if !self.head.load(Ordering::Acquire) {
            return now.saturating_duration_since(self.opened) >= grace;
        }
        let b = self.body.lock();
        let Some(since) = b.since else { return false };
        let took = now.saturating_duration_since(since);
        took >= grace && u128::from(b.bytes) * 1_000_000_000 < u128::from(min_rate) * took.as_nanos()
    }

    fn shed(&self) {
        self.shed.store(true, Ordering::Release);
        if let Some(w) = self.waker.lock().take() {
            w.wake();
        }
    }

    /// Whether it was shed; if not, `cx` is woken when it is.
    fn poll_shed(&self, cx: &Context<'_>) -> bool {
        if self.shed.load(Ordering::Acquire) {
            return true;
        }
        {
            let mut w = self.waker.lock();
            match w.as_ref() {
                Some(old) if old.will_wake(cx.waker()) => {}
                _ => *w = Some(cx.waker().clone()),
            }
        }
        // A shed between the first check and the registration took no waker.
        self.shed.load(Ordering::Acquire)
    }
}

/// What [`Gate::enter`] gives a new connection.
#[derive(Debug)]
pub(crate) enum Admission {
    /// A free place.
    Open(Slot),
    /// The place of a connection it shed.
    Shed(Slot),
    /// No place: every served connection has its head (and its body, or
    /// one arriving fast enough), or is within the grace.
    Full,
}

impl Gate {
    pub(crate) fn new(limit: usize, grace: Duration, min_body_rate: u64) -> Self {
        Self {
            limit,
            grace,
            min_body_rate,
            served: Mutex::new(Served::default()),
        }
    }

    /// A place for one more connection: a free one, else that of the oldest
    /// sheddable connection ([`ConnState::sheddable`]: open for at least
    /// the grace without a complete head, or reading a body slower than the
    /// minimum rate for at least the grace; shed now: its place is freed at
    /// once, its socket fails at its next poll), else none.
    pub(crate) fn enter(self: &Arc<Self>) -> Admission {
        self.enter_at(Instant::now())
    }

    fn enter_at(self: &Arc<Self>, now: Instant) -> Admission {
        let mut served = self.served.lock();
        let mut shed = false;
        if served.conns.len() >= self.limit {
            let victim = served
                .conns
                .values()
                .find(|c| c.sheddable(now, self.grace, self.min_body_rate))
                .map(|c| c.id);
            let Some(victim) = victim else {
                return Admission::Full;
            };
            if let Some(c) = served.conns.remove(&victim) {
                c.shed();
            }
            shed = true;
        }
        let id = served.next;
        served.next += 1;
        let state = Arc::new(ConnState {
            id,
            opened: now,
            head: AtomicBool::new(false),
            body: Mutex::new(Body::default()),
            shed: AtomicBool::new(false),
            waker: Mutex::new(None),
        });
        served.conns.insert(id, state.clone());
        let slot = Slot {
            gate: self.clone(),
            state,
        };
        if shed {
            Admission::Shed(slot)
        } else {
            Admission::Open(slot)
        }
    }

    /// Connections being served now (a shed one no longer counts).
    pub(crate) fn open(&self) -> usize {
        self.served.lock().conns.len()
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit
    }
}

/// One served connection's place under the limit; freed on drop (or when
/// the connection is shed).
#[derive(Debug)]
pub(crate) struct Slot {
    gate: Arc<Gate>,
    state: Arc<ConnState>,
}

impl Slot {
    pub(crate) fn state(&self) -> &Arc<ConnState> {
        &self.state
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gate.served.lock().conns.remove(&self.state.id);
    }
}

fn shed_error() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "shed: no complete request head, or a body too slow, while another connection waited",
    )
}

/// How long a refused connection may take to read its `503`.
const REFUSE_WITHIN: Duration = Duration::from_millis(200);

/// Answers a connection over the limit `503` and closes it: the reply is
/// written at once (a fresh socket's send buffer takes it), then the write
/// side is shut and what the client sent is drained for at most
/// [`REFUSE_WITHIN`] so the close does not reset the reply away.
pub(crate) async fn refuse(mut io: TcpStream, limit: usize) {
    let body = format!(r#"{{"error":"Busy","message":"more than {limit} connections at once"}}"#);
    let reply = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(REFUSE_WITHIN, async {
        io.write_all(reply.as_bytes()).await?;
        io.shutdown().await?;
        let mut sink = [0u8; 1024];
        while io.read(&mut sink).await? > 0 {}
        Ok::<_, io::Error>(())
    })
    .await;
}

/// A served connection: the socket, its slot, and the write-stall bound.
pub(crate) struct Conn<T = TcpStream> {
    io: T,
    slot: Slot,
    stall_limit: Duration,
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T: AsyncWrite + Unpin> Conn<T> {
    pub(crate) fn new(io: T, slot: Slot, stall_limit: Duration) -> Self {
        Self {
            io,
            slot,
            stall_limit,
            stalled: None,
        }
    }

    /// What it shares with the gate and its handlers.
    pub(crate) fn state(&self) -> &Arc<ConnState> {
        self.slot.state()
    }

    /// A write-side poll: progress clears the stall timer; `Pending` arms it,
    /// and once it fires the connection fails with `TimedOut`.
    fn bound<R>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        match r {
            Poll::Ready(v) => {
                self.stalled = None;
                Poll::Ready(v)
            }
            Poll::Pending => {
                let limit = self.stall_limit;
                let timer = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the peer did not read its reply in time",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for Conn<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.slot.state.poll_shed(cx) {
            return Poll::Ready(Err(shed_error()));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Conn<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.slot.state.poll_shed(cx) {
            return Poll::Ready(Err(shed_error()));
        }
        let r = Pin::new(&mut this.io).poll_write(cx, buf);
        this.bound(cx, r)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.slot.state.poll_shed(cx) {
            return Poll::Ready(Err(shed_error()));
        }
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.bound(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.slot.state.poll_shed(cx) {
            return Poll::Ready(Err(shed_error()));
        }
        let r = Pin::new(&mut this.io).poll_flush(cx);
        this.bound(cx, r)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_shutdown(cx);
        this.bound(cx, r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Admission {
        fn slot(self) -> Slot {
            match self {
                Admission::Open(s) => s,
                other => panic!("not a free place: {other:?}"),
            }
        }

        fn shed(self) -> Slot {
            match self {
                Admission::Shed(s) => s,
                other => panic!("not a shedding: {other:?}"),
            }
        }

        fn is_full(&self) -> bool {
            matches!(self, Admission::Full)
        }
    }

    const GRACE: Duration = Duration::from_millis(50);
    const RATE: u64 = MIN_BODY_RATE;

    #[test]
    fn the_gate_counts_slots_up_to_its_limit() {
        let g = Arc::new(Gate::new(2, GRACE, RATE));
        let now = Instant::now();
        let a = g.enter_at(now).slot();
        let b = g.enter_at(now).slot();
        assert!(g.enter_at(now).is_full());
        assert_eq!(g.open(), 2);
        drop(a);
        let c = g.enter_at(now).slot();
        assert!(g.enter_at(now).is_full());
        drop((b, c));
        assert_eq!(g.open(), 0);
    }

    /// At the limit a newcomer sheds the oldest connection without a
    /// complete head once it is past the grace; never one whose head is in,
    /// never one within the grace; with none sheddable it is refused.
    #[test]
    fn the_gate_sheds_the_oldest_headless_connection_past_the_grace() {
        let g = Arc::new(Gate::new(3, GRACE, RATE));
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let done = g.enter_at(ms(0)).slot(); // the oldest, but its head is in
        done.state().head_complete();
        let old = g.enter_at(ms(10)).slot();
        let young = g.enter_at(ms(40)).slot();
        // Within the grace of both headless ones: refused.
        assert!(g.enter_at(ms(55)).is_full());
        // Past `old`'s grace only: `old` goes (not `done`, older but headed).
        let first = g.enter_at(ms(60)).shed();
        assert!(old.state().shed.load(Ordering::Acquire));
        assert!(!done.state().shed.load(Ordering::Acquire));
        assert!(!young.state().shed.load(Ordering::Acquire));
        assert_eq!(g.open(), 3, "the shed one's place went to the newcomer");
        // `young` (40) is now past its grace, `first` (60) is not.
        let second = g.enter_at(ms(95)).shed();
        assert!(young.state().shed.load(Ordering::Acquire));
        assert!(!first.state().shed.load(Ordering::Acquire));
        // Only headed or young connections left: refused.
        first.state().head_complete();
        assert!(g.enter_at(ms(100)).is_full());
        second.state().head_complete();
        assert!(g.enter_at(ms(10_000)).is_full(), "every head is in");
        // A shed connection's slot, dropped later, frees nothing twice.
        drop((old, young));
        assert_eq!(g.open(), 3);
        drop((done, first, second));
        assert_eq!(g.open(), 0);
    }

    /// Issue 44: a connection whose head is in but whose body trickles is
    /// shed like a slowloris once past the grace since its body began; one
    /// whose body keeps the minimum rate, or whose body is complete, is
    /// never shed.
    #[test]
    fn the_gate_sheds_a_slow_body_but_not_a_fast_or_complete_one() {
        let g = Arc::new(Gate::new(3, GRACE, RATE));
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let slow = g.enter_at(ms(0)).slot();
        slow.state().head_complete();
        slow.state().body_started_at(ms(0));
        slow.state().body_received(1); // a byte now and then
        let fast = g.enter_at(ms(0)).slot();
        fast.state().head_complete();
        fast.state().body_started_at(ms(0));
        let done = g.enter_at(ms(0)).slot();
        done.state().head_complete();
        done.state().body_started_at(ms(0));
        done.state().body_ended();
        // Within the grace nobody goes.
        assert!(g.enter_at(ms(40)).is_full());
        // `fast` keeps 1 MiB/s over 100 ms (105 KB), `slow` does not.
        fast.state().body_received((RATE / 10) as usize);
        let newcomer = g.enter_at(ms(100)).shed();
        assert!(slow.state().was_shed());
        assert!(!fast.state().was_shed() && !done.state().was_shed());
        // Later `fast` falls behind the rate (still 105 KB at 200 ms) and goes.
        newcomer.state().head_complete();
        let second = g.enter_at(ms(200)).shed();
        assert!(fast.state().was_shed());
        assert!(!done.state().was_shed() && !newcomer.state().was_shed());
        // A body that ended is never shed, however slow it was.
        second.state().head_complete();
        assert!(g.enter_at(ms(60_000)).is_full());
        drop((slow, fast, done, newcomer, second));
        assert_eq!(g.open(), 0);
    }

    /// A peer that never reads: the write stalls, and fails at the bound
    /// instead of holding the connection (and its slot) forever.
    #[test]
    fn a_write_the_peer_never_reads_fails_at_the_bound() {
        let gate = Arc::new(Gate::new(1, GRACE, RATE));
        actix_web::rt::System::new().block_on(async {
            let (near, _far) = tokio::io::duplex(64); // `_far` is never read
            let mut conn = Conn::new(near, gate.enter().slot(), Duration::from_millis(100));
            let start = std::time::Instant::now();
            let err = conn.write_all(&[0u8; 4096]).await.unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::TimedOut);
            assert!(start.elapsed() >= Duration::from_millis(100));
            assert!(start.elapsed() < Duration::from_secs(2));
            drop(conn);

            // Progress resets the bound: a slow reader that keeps reading
            // (64 bytes every 20 ms, 320 ms in all) never trips it.
            let (near, mut far) = tokio::io::duplex(64);
            let mut conn = Conn::new(near, gate.enter().slot(), Duration::from_millis(100));
            let reader = actix_web::rt::spawn(async move {
                let mut buf = [0u8; 64];
                let mut got = 0;
                while got < 1024 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    got += far.read(&mut buf).await.unwrap();
                }
            });
            conn.write_all(&[0u8; 1024]).await.unwrap();
            reader.await.unwrap();
        });
        assert_eq!(gate.open(), 0, "the slot is freed with the connection");
    }

    /// A shed connection's pending read fails at once (its task is woken),
    /// and so does its next write.
    #[test]
    fn a_shed_connection_fails_its_read() {
        let gate = Arc::new(Gate::new(1, Duration::ZERO, RATE));
        actix_web::rt::System::new().block_on(async {
            let (near, _far) = tokio::io::duplex(64); // `_far` never sends
            let mut conn = Conn::new(near, gate.enter().slot(), Duration::from_secs(10));
            let reader = actix_web::rt::spawn(async move {
                let mut buf = [0u8; 16];
                let err = conn.read(&mut buf).await.unwrap_err();
                let again = conn.write(b"x").await.unwrap_err();
                (err.kind(), again.kind())
            });
            tokio::time::sleep(Duration::from_millis(50)).await;
            let start = std::time::Instant::now();
            let newcomer = gate.enter().shed();
            let kinds = tokio::time::timeout(Duration::from_secs(2), reader)
                .await
                .expect("the read ends once shed")
                .unwrap();
            assert_eq!(
                kinds,
                (io::ErrorKind::ConnectionAborted, io::ErrorKind::ConnectionAborted)
            );
            assert!(start.elapsed() < Duration::from_secs(1));
            assert_eq!(gate.open(), 1);
            drop(newcomer);
        });
        assert_eq!(gate.open(), 0);
    }
}
