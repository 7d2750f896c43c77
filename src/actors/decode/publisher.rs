//! The decode side's publisher: POSTs a consumer's handshake to every
//! prefill rank that sends to it, and a cancel to every one of them, from a
//! few Rust threads — never from Python, so a worker whose GIL is held
//! elsewhere (vLLM's CPU TP ranks spin in C++ while they wait for each
//! other) still publishes its authorization at once. How a POST reaches a
//! prefill rank is given to the runtime ([`SideChannelPost`]: the side
//! channel's HTTP client, `crate::side_channel_client::HttpPost`, is what
//! `Runtime::start` passes): the actors know no HTTP. What a prefill rank
//! answered goes back to the consumer actor that sent the POST.
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

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::Recipient;
use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use crate::actors::messages::RankEnded;
use crate::actors::stats::Stats;
use crate::ids::{Generation, ProducerRank, RequestId};
use crate::wire::{Fence, Outcome};

/// How the publisher's threads POST to a prefill rank's side channel at
/// `addr`, signed with `key` when given, each try bounded by `timeout`:
/// the answer's status and body, or why it was not delivered
/// (`ConnectionRefused`: nothing listens there).
pub trait SideChannelPost: Send + Sync + 'static {
    /// A handshake, tried again while the rank answers `503` (busy: nothing
    /// was admitted) until `until`; the last answer.
    fn handshake(
        &self,
        addr: &str,
        body: &str,
        key: Option<&[u8]>,
        timeout: Duration,
        until: Instant,
    ) -> std::io::Result<(u16, String)>;
    /// A cancel (or a fence: a cancel naming a generation), once.
    fn cancel(
        &self,
        addr: &str,
        body: &str,
        key: Option<&[u8]>,
        timeout: Duration,
    ) -> std::io::Result<(u16, String)>;
}

/// Where a handshake goes and whom to tell when it is refused.
pub struct HandshakeJob {
    pub addr: String,
    pub body: Arc<str>,
    pub request: RequestId,
    pub generation: Generation,
    pub producer_rank: u32,
    /// The consumer actor (told of a refusal).
    pub consumer: Recipient<RankEnded>,
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
    /// The consumer actor (told what the rank answered).
    pub consumer: Recipient<RankEnded>,
}

enum Job {
    Handshake(HandshakeJob),
    Cancel { addr: String, body: Arc<str> },
    Fence(FenceJob),
}

/// A small pool of sender threads (one per in-flight POST, up to `threads`),
/// shared by the runtime's façade and its consumer actors.
pub struct Publisher {
    tx: Mutex<Option<Sender<Job>>>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Publisher {
    pub fn new(
        threads: usize,
        key: Option<Arc<Vec<u8>>>,
        timeout: Duration,
        stats: Arc<Stats>,
        post: Arc<dyn SideChannelPost>,
    ) -> Self {
        let (tx, rx): (Sender<Job>, Receiver<Job>) = crossbeam_channel::unbounded();
        let threads = (0..threads.max(1))
            .map(|i| {
                let (rx, key, stats, post) = (rx.clone(), key.clone(), stats.clone(), post.clone());
                std::thread::Builder::new()
                    .name(format!("orbitkv-publish-{i}"))
                    .spawn(move || {
                        for job in rx {
                            run(&*post, job, key.as_deref().map(Vec::as_slice), timeout, &stats);
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

fn run(post: &dyn SideChannelPost, job: Job, key: Option<&[u8]>, timeout: Duration, stats: &Stats) {
    match job {
        Job::Cancel { addr, body } => {
            if let Err(e) = post.cancel(&addr, &body, key, timeout) {
                tracing::warn!(%addr, "cancel not delivered: {e}");
            }
        }
        Job::Fence(j) => {
            stats.fences_sent.inc();
            match post.cancel(&j.addr, &j.body, key, timeout) {
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
            let answer = post.handshake(&j.addr, &j.body, key, timeout, j.retry_until);
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
