//! The decode side's half of the side channel: POSTs a consumer's handshake
//! to every prefill rank that sends to it, and a cancel to every one of
//! them, from a few Rust threads — never from Python, so a worker whose GIL
//! is held elsewhere (vLLM's CPU TP ranks spin in C++ while they wait for
//! each other) still publishes its authorization at once.
//!
//! A handshake a prefill rank refused (any HTTP error: nothing was admitted)
//! or that nobody received (connection refused) fails that rank for the
//! consumer now ([`RankEnded`]), instead of at the consumer's deadline. A
//! `503` (the prefill's side channel or parking budget was full: a flood,
//! a burst) is tried again, with a growing pause, until the handshake's own
//! deadline, before it counts as a refusal. A timeout may have been
//! admitted: the consumer then waits, as for any lost notice.
//!
//! A fence ([`FenceJob`]: a cancel carrying the consumer's generation, sent
//! when vLLM released a request whose producers had not all ended) reads the
//! prefill rank's answer ([`Fence`]): `fenced` ends that rank for the
//! consumer at once ([`RankEnded`], `aborted`); any other answer, or none,
//! leaves the consumer waiting for the notice or its quarantine.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::Addr;
use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use super::signature::{sign, SIGNATURE_HEADER};
use crate::actors::consumer::ConsumerActor;
use crate::actors::messages::RankEnded;
use crate::actors::stats::Stats;
use crate::ids::{Generation, ProducerRank, RequestId};
use crate::wire::{Fence, Outcome};

pub use super::{CANCEL_PATH, HANDSHAKE_PATH};

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
    /// Until when a `503` is tried again (the consumer's deadline).
    pub retry_until: Instant,
}

/// A cancel that fences `generation` (its body carries it): the prefill
/// rank `producer_rank` at `addr` answers what may still be written.
pub struct FenceJob {
    pub addr: String,
    pub body: Arc<str>,
    pub generation: Generation,
    pub producer_rank: u32,
    pub consumer: Addr<ConsumerActor>,
}

enum Job {
    Handshake(HandshakeJob),
    Cancel { addr: String, body: Arc<str> },
    Fence(FenceJob),
}

/// The first pause before a `503`-refused handshake is sent again; it
/// doubles up to [`RETRY_MAX_PAUSE`].
const RETRY_FIRST_PAUSE: Duration = Duration::from_millis(20);
const RETRY_MAX_PAUSE: Duration = Duration::from_millis(500);

/// A small pool of sender threads (one per in-flight POST, up to `threads`),
/// shared by the runtime's façade and its consumer actors.
pub struct Publisher {
    tx: Mutex<Option<Sender<Job>>>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Publisher {
    pub fn new(threads: usize, key: Option<Arc<Vec<u8>>>, timeout: Duration, stats: Arc<Stats>) -> Self {
        let (tx, rx): (Sender<Job>, Receiver<Job>) = crossbeam_channel::unbounded();
        let threads = (0..threads.max(1))
            .map(|i| {
                let (rx, key, stats) = (rx.clone(), key.clone(), stats.clone());
                std::thread::Builder::new()
                    .name(format!("orbitkv-publish-{i}"))
                    .spawn(move || {
                        for job in rx {
                            run(job, key.as_deref().map(Vec::as_slice), timeout, &stats);
                        }
                    })
                    .expect("spawn a publisher thread")
            })
            .collect();
        Self {
            tx: Mutex::new(Some(tx)),
            threads: Mutex::new(threads),
        }
    }

    fn send(&self, job: Job) {
        if let Some(tx) = &*self.tx.lock() {
            let _ = tx.send(job);
        }
    }

    pub fn handshake(&self, job: HandshakeJob) {
        self.send(Job::Handshake(job));
    }

    pub fn cancel(&self, addr: String, body: Arc<str>) {
        self.send(Job::Cancel { addr, body });
    }

    pub fn fence(&self, job: FenceJob) {
        self.send(Job::Fence(job));
    }

    /// Stops taking jobs and waits for the threads (each POST is bounded by
    /// the timeout; a handshake's retries by its deadline).
    pub fn stop(&self) {
        self.tx.lock().take();
        let threads = std::mem::take(&mut *self.threads.lock());
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(job: Job, key: Option<&[u8]>, timeout: Duration, stats: &Stats) {
    match job {
        Job::Cancel { addr, body } => {
            if let Err(e) = post(&addr, CANCEL_PATH, &body, key, timeout) {
                tracing::warn!(%addr, "cancel not delivered: {e}");
            }
        }
        Job::Fence(j) => {
            stats.fences_sent.inc();
            match post(&j.addr, CANCEL_PATH, &j.body, key, timeout) {
                Ok((200, reply)) => match Fence::from_reply(&reply) {
                    Some(Fence::Fenced) => {
                        stats.ranks_fenced.inc();
                        j.consumer.do_send(RankEnded {
                            generation: j.generation,
                            rank: ProducerRank(j.producer_rank),
                            outcome: Outcome::Aborted,
                            reason: format!(
                                "cancelled; prefill rank {} fenced the generation (nothing more can be written)",
                                j.producer_rank
                            ),
                        });
                    }
                    Some(other) => {
                        tracing::debug!(addr = %j.addr, answer = ?other, "fence: the consumer keeps waiting")
                    }
                    None => {
                        tracing::warn!(addr = %j.addr, "fence answered without a fence: {}", reply.trim())
                    }
                },
                Ok((status, reply)) => {
                    tracing::warn!(addr = %j.addr, status, "fence refused: {}", reply.trim())
                }
                Err(e) => tracing::warn!(addr = %j.addr, "fence not delivered: {e}"),
            }
        }
        Job::Handshake(j) => {
            let answer = post_while_busy(&j.addr, HANDSHAKE_PATH, &j.body, key, timeout, j.retry_until);
            let refused = match answer {
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
                j.consumer.do_send(RankEnded::handshake_refused(
                    j.generation,
                    j.producer_rank,
                    &reason,
                ));
            }
        }
    }
}

/// [`post`], again after a growing pause while the answer is `503` (the
/// side channel's connection gate or parking budget was full: nothing was
/// admitted, so the same body may go again), until `until`. Returns the last
/// answer.
pub fn post_while_busy(
    addr: &str,
    path: &str,
    body: &str,
    key: Option<&[u8]>,
    timeout: Duration,
    until: Instant,
) -> std::io::Result<(u16, String)> {
    let mut pause = RETRY_FIRST_PAUSE;
    loop {
        let answer = post(addr, path, body, key, timeout);
        if !matches!(answer, Ok((503, _))) || Instant::now() + pause >= until {
            return answer;
        }
        tracing::debug!(%addr, path, "answered 503: trying again in {pause:?}");
        std::thread::sleep(pause);
        pause = (pause * 2).min(RETRY_MAX_PAUSE);
    }
}

/// One HTTP/1.1 POST (`Connection: close`), signed with `key` when given.
/// Returns the status and the reply body. The one side-channel client: the
/// publisher's threads use it, and Python's `orbitkv.vllm.side_channel`
/// (through the binding's `side_channel_post`).
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A server that answers each connection with the next status of
    /// `answers` (then closes); returns its address and how many it served.
    fn server(answers: Vec<u16>) -> (String, std::thread::JoinHandle<usize>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || {
            let mut served = 0;
            for status in answers {
                let (mut s, _) = l.accept().unwrap();
                let reply =
                    format!("HTTP/1.1 {status} X\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}");
                s.write_all(reply.as_bytes()).unwrap();
                // As the real server's refusal does: close the write half,
                // then drain what the client sent. Closing with its request
                // unread would reset the connection, and the client could
                // lose the reply (a CI failure of this test).
                s.shutdown(std::net::Shutdown::Write).unwrap();
                let mut sink = [0u8; 4096];
                while s.read(&mut sink).map(|n| n > 0).unwrap_or(false) {}
                served += 1;
            }
            served
        });
        (addr, t)
    }

    #[test]
    fn a_busy_answer_is_tried_again_until_it_is_not_or_the_deadline() {
        let t = Duration::from_secs(2);
        // Busy twice, then admitted: the third answer is the one returned.
        let (addr, srv) = server(vec![503, 503, 200]);
        let until = Instant::now() + Duration::from_secs(10);
        let got = post_while_busy(&addr, HANDSHAKE_PATH, "{}", None, t, until).unwrap();
        assert_eq!(got.0, 200);
        assert_eq!(srv.join().unwrap(), 3);
        // Any other refusal is final at once.
        let (addr, srv) = server(vec![403]);
        let got = post_while_busy(&addr, HANDSHAKE_PATH, "{}", None, t, until).unwrap();
        assert_eq!(got.0, 403);
        assert_eq!(srv.join().unwrap(), 1);
        // Busy past the deadline: the last 503 is returned, no later try.
        let (addr, srv) = server(vec![503]);
        let got = post_while_busy(&addr, HANDSHAKE_PATH, "{}", None, t, Instant::now()).unwrap();
        assert_eq!(got.0, 503);
        assert_eq!(srv.join().unwrap(), 1);
    }
}
