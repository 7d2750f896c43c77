//! The decode side's half of the side channel: POSTs a consumer's handshake
//! to every prefill rank that sends to it, and a cancel to every one of
//! them, from a few Rust threads — never from Python, so a worker whose GIL
//! is held elsewhere (vLLM's CPU TP ranks spin in C++ while they wait for
//! each other) still publishes its authorization at once.
//!
//! A handshake a prefill rank refused (any HTTP error: nothing was admitted)
//! or that nobody received (connection refused) fails that rank for the
//! consumer now, through the same path as a `failed` notice, instead of at
//! the consumer's deadline. A timeout may have been admitted: the consumer
//! then waits, as for any lost notice.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use actix::Addr;
use crossbeam_channel::{Receiver, Sender};

use super::signature::{sign, SIGNATURE_HEADER};
use crate::actors::consumer::ConsumerActor;
use crate::actors::messages::NoticeArrived;
use crate::ids::{Generation, RequestId};
use crate::wire::Notice;

/// Paths of the prefill side channel.
pub const HANDSHAKE_PATH: &str = "/orbitkv/v1/handshake";
pub const CANCEL_PATH: &str = "/orbitkv/v1/cancel";

/// Longest reply read back (error bodies are small).
const MAX_REPLY: u64 = 64 << 10;

/// Where a handshake goes and whom to tell when it is refused.
pub struct HandshakeJob {
    pub addr: String,
    pub body: Arc<str>,
    pub request: RequestId,
    pub generation: Generation,
    pub producer_rank: u32,
    pub consumer: Addr<ConsumerActor>,
}

enum Job {
    Handshake(HandshakeJob),
    Cancel { addr: String, body: Arc<str> },
}

/// A small pool of sender threads (one per in-flight POST, up to `threads`).
pub struct Publisher {
    tx: Option<Sender<Job>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Publisher {
    pub fn new(threads: usize, key: Option<Arc<Vec<u8>>>, timeout: Duration) -> Self {
        let (tx, rx): (Sender<Job>, Receiver<Job>) = crossbeam_channel::unbounded();
        let threads = (0..threads.max(1))
            .map(|i| {
                let (rx, key) = (rx.clone(), key.clone());
                std::thread::Builder::new()
                    .name(format!("orbitkv-publish-{i}"))
                    .spawn(move || {
                        for job in rx {
                            run(job, key.as_deref().map(Vec::as_slice), timeout);
                        }
                    })
                    .expect("spawn a publisher thread")
            })
            .collect();
        Self {
            tx: Some(tx),
            threads,
        }
    }

    pub fn handshake(&self, job: HandshakeJob) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Job::Handshake(job));
        }
    }

    pub fn cancel(&self, addr: String, body: Arc<str>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Job::Cancel { addr, body });
        }
    }

    /// Stops taking jobs and waits for the threads (each POST is bounded by
    /// the timeout).
    pub fn stop(&mut self) {
        self.tx.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(job: Job, key: Option<&[u8]>, timeout: Duration) {
    match job {
        Job::Cancel { addr, body } => {
            if let Err(e) = post(&addr, CANCEL_PATH, &body, key, timeout) {
                tracing::warn!(%addr, "cancel not delivered: {e}");
            }
        }
        Job::Handshake(j) => {
            let refused = match post(&j.addr, HANDSHAKE_PATH, &j.body, key, timeout) {
                Ok((200, _)) => None,
                Ok((status, reply)) => Some(format!("{} answered {status}: {}", j.addr, reply.trim())),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    Some(format!("nothing listens at {}: {e}", j.addr))
                }
                Err(e) => {
                    // It may have been admitted: the consumer waits.
                    tracing::warn!(addr = %j.addr, request = %j.request, "handshake not confirmed: {e}");
                    None
                }
            };
            if let Some(reason) = refused {
                tracing::warn!(request = %j.request, rank = j.producer_rank, "handshake refused: {reason}");
                j.consumer.do_send(NoticeArrived(Notice::handshake_refused(
                    j.request,
                    j.generation,
                    j.producer_rank,
                    &reason,
                )));
            }
        }
    }
}

/// One HTTP/1.1 POST (`Connection: close`), signed with `key` when given.
/// Returns the status and the reply body.
pub fn post(
    addr: &str,
    path: &str,
    body: &str,
    key: Option<&[u8]>,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    let sock = addr.to_socket_addrs()?.next().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("no address for {addr}"))
    })?;
    let mut s = TcpStream::connect_timeout(&sock, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.set_nodelay(true)?;
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if let Some(k) = key {
        head.push_str(&format!("{SIGNATURE_HEADER}: {}\r\n", sign(k, body.as_bytes())));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    s.write_all(body.as_bytes())?;
    let mut reply = Vec::new();
    s.take(MAX_REPLY).read_to_end(&mut reply)?;
    let text = String::from_utf8_lossy(&reply);
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .or_else(|| text.strip_prefix("HTTP/1.0 "))
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP reply"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}
