//! Per-connection bounds that actix-web does not give as such:
//!
//! * [`Gate`]: at most `max_connections` connections are served at once; one
//!   more is answered `503` at once and closed (actix-server's own limit
//!   would stop accepting instead, leaving the client waiting in the
//!   kernel's backlog with no answer).
//! * [`Conn`]: the served connection's socket, holding its [`Slot`]; a write
//!   that makes no progress for the read timeout (a peer that stopped
//!   reading its replies) fails the connection, so no connection can hold
//!   its slot forever.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

/// Counts the connections being served.
#[derive(Debug)]
pub(crate) struct Gate {
    open: AtomicUsize,
    limit: usize,
}

impl Gate {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            open: AtomicUsize::new(0),
            limit,
        }
    }

    /// A slot for one more connection, or `None` at the limit.
    pub(crate) fn enter(self: &Arc<Self>) -> Option<Slot> {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.limit).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(self.clone()))
    }

    /// Connections being served now.
    pub(crate) fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit
    }
}

/// One served connection's place under the limit; freed on drop.
#[derive(Debug)]
pub(crate) struct Slot(Arc<Gate>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
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
    _slot: Slot,
    stall_limit: Duration,
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T: AsyncWrite + Unpin> Conn<T> {
    pub(crate) fn new(io: T, slot: Slot, stall_limit: Duration) -> Self {
        Self {
            io,
            _slot: slot,
            stall_limit,
            stalled: None,
        }
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
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Conn<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write(cx, buf);
        this.bound(cx, r)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.bound(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
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

    #[test]
    fn the_gate_counts_slots_up_to_its_limit() {
        let g = Arc::new(Gate::new(2));
        let a = g.enter().unwrap();
        let b = g.enter().unwrap();
        assert!(g.enter().is_none());
        assert_eq!(g.open(), 2);
        drop(a);
        let c = g.enter().unwrap();
        assert!(g.enter().is_none());
        drop((b, c));
        assert_eq!(g.open(), 0);
    }

    /// A peer that never reads: the write stalls, and fails at the bound
    /// instead of holding the connection (and its slot) forever.
    #[test]
    fn a_write_the_peer_never_reads_fails_at_the_bound() {
        let gate = Arc::new(Gate::new(1));
        actix_web::rt::System::new().block_on(async {
            let (near, _far) = tokio::io::duplex(64); // `_far` is never read
            let mut conn = Conn::new(near, gate.enter().unwrap(), Duration::from_millis(100));
            let start = std::time::Instant::now();
            let err = conn.write_all(&[0u8; 4096]).await.unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::TimedOut);
            assert!(start.elapsed() >= Duration::from_millis(100));
            assert!(start.elapsed() < Duration::from_secs(2));
            drop(conn);

            // Progress resets the bound: a slow reader that keeps reading
            // (64 bytes every 20 ms, 320 ms in all) never trips it.
            let (near, mut far) = tokio::io::duplex(64);
            let mut conn = Conn::new(near, gate.enter().unwrap(), Duration::from_millis(100));
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
}
