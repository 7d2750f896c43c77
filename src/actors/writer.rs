//! Layer writers (one actor per peer, each on its own arbiter thread, so a
//! slow or dead peer holds up nobody else) and the completion poller (one
//! thread per runtime, polling every batch in flight without blocking a
//! thread per batch).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;

use super::messages::{BatchFinished, LayerWriteFailed, LayerWritten, SendNotice, WriteLayer};
use super::stats::Stats;
use crate::transport::{BatchHandle, BatchState, Transport};
use crate::wire::NOTIFY_NAME;

/// A batch handed to the poller.
pub struct PollJob {
    pub handle: BatchHandle,
    pub deadline: Instant,
    pub token: u64,
    pub reply: Recipient<BatchFinished>,
}

/// Polls every batch in flight; reports each once, when it ends or its
/// deadline passes. A batch past its deadline is still polled until Mooncake
/// ends it, so that its id is freed.
pub fn spawn_poller(
    transport: Arc<dyn Transport>,
    jobs: Receiver<PollJob>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("orbitkv-poller".into())
        .spawn(move || {
            let mut live: Vec<PollJob> = Vec::new();
            let mut abandoned: Vec<BatchHandle> = Vec::new();
            let mut idle_since = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // Take new jobs; block only when nothing is in flight.
                if live.is_empty() && abandoned.is_empty() {
                    match jobs.recv_timeout(Duration::from_millis(100)) {
                        Ok(j) => live.push(j),
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                    idle_since = Instant::now();
                }
                while let Ok(j) = jobs.try_recv() {
                    live.push(j);
                }
                let before = live.len();
                let now = Instant::now();
                live.retain_mut(|job| {
                    let result = match transport.poll(&mut job.handle) {
                        Ok(BatchState::InFlight) if now < job.deadline => return true,
                        Ok(BatchState::InFlight) => {
                            let waited = (now - job.handle.submitted).as_millis();
                            abandoned.push(std::mem::replace(&mut job.handle, BatchHandle::new(0, "", 0, 0)));
                            Err(format!("timed out after {waited} ms"))
                        }
                        Ok(BatchState::Completed { bytes }) => Ok(bytes),
                        Ok(BatchState::Failed { reason }) => Err(reason),
                        Err(e) => Err(e.to_string()),
                    };
                    job.reply.do_send(BatchFinished {
                        token: job.token,
                        result,
                    });
                    false
                });
                abandoned
                    .retain_mut(|h| h.id() != 0 && matches!(transport.poll(h), Ok(BatchState::InFlight)));
                if live.len() < before {
                    idle_since = Instant::now();
                }
                // Back off while nothing finishes: yield first, then nap.
                let quiet = idle_since.elapsed();
                if quiet < Duration::from_micros(200) {
                    std::thread::yield_now();
                } else {
                    let nap = if quiet < Duration::from_millis(5) { 20 } else { 200 };
                    std::thread::sleep(Duration::from_micros(nap));
                }
            }
        })
        .expect("spawn the completion poller thread")
}

struct Pending {
    request: crate::ids::RequestId,
    write: u64,
    generation: crate::ids::Generation,
    bytes: u64,
    done_to: Recipient<LayerWritten>,
    failed_to: Recipient<LayerWriteFailed>,
    /// The write in flight, for the trace (closed when the batch ends).
    span: tracing::Span,
}

/// Writes to one peer. Bounds the bytes it has in flight; queues the rest.
pub struct LayerWriter {
    peer: String,
    transport: Arc<dyn Transport>,
    poller: Sender<PollJob>,
    write_timeout: Duration,
    max_in_flight: u64,
    in_flight: u64,
    queue: VecDeque<WriteLayer>,
    pending: HashMap<u64, Pending>,
    next_token: u64,
    stats: Arc<Stats>,
}

impl LayerWriter {
    fn submit(&mut self, msg: WriteLayer, ctx: &mut Context<Self>) {
        let span = tracing::debug_span!("write_layer", request = %msg.request, write = msg.write,
            layer = msg.layer, generation = msg.generation.0, peer = %self.peer,
            ranges = msg.ranges.len(), bytes = msg.bytes);
        let _g = span.enter();
        // Submit to completion; never entered, so an async slice in a trace.
        let in_flight = tracing::debug_span!(parent: None, "write", request = %msg.request,
            write = msg.write, layer = msg.layer, generation = msg.generation.0, peer = %self.peer,
            bytes = msg.bytes, result = tracing::field::Empty);
        match self.transport.submit_write(&self.peer, &msg.ranges) {
            Ok(handle) => {
                let token = self.next_token;
                self.next_token += 1;
                self.in_flight += msg.bytes;
                self.pending.insert(
                    token,
                    Pending {
                        request: msg.request,
                        write: msg.write,
                        generation: msg.generation,
                        bytes: msg.bytes,
                        done_to: msg.done_to,
                        failed_to: msg.failed_to,
                        span: in_flight,
                    },
                );
                let job = PollJob {
                    handle,
                    deadline: Instant::now() + self.write_timeout,
                    token,
                    reply: ctx.address().recipient(),
                };
                if self.poller.send(job).is_err() {
                    let p = self.pending.remove(&token).expect("just inserted");
                    self.in_flight -= p.bytes;
                    p.failed_to.do_send(LayerWriteFailed {
                        request: p.request,
                        write: p.write,
                        generation: p.generation,
                        reason: "the runtime is shutting down".into(),
                    });
                }
            }
            Err(e) => {
                self.stats.writes_failed.inc();
                in_flight.record("result", "submit failed");
                tracing::warn!(peer = %self.peer, error = %e, "submit failed");
                msg.failed_to.do_send(LayerWriteFailed {
                    request: msg.request,
                    write: msg.write,
                    generation: msg.generation,
                    reason: e.to_string(),
                });
            }
        }
    }

    fn pump(&mut self, ctx: &mut Context<Self>) {
        while let Some(next) = self.queue.front() {
            if self.in_flight > 0 && self.in_flight + next.bytes > self.max_in_flight {
                break;
            }
            let msg = self.queue.pop_front().expect("front exists");
            self.submit(msg, ctx);
        }
    }
}

impl Actor for LayerWriter {
    type Context = Context<Self>;
}

impl Handler<WriteLayer> for LayerWriter {
    type Result = ();
    fn handle(&mut self, msg: WriteLayer, ctx: &mut Context<Self>) {
        self.queue.push_back(msg);
        self.pump(ctx);
    }
}

impl Handler<BatchFinished> for LayerWriter {
    type Result = ();
    fn handle(&mut self, msg: BatchFinished, ctx: &mut Context<Self>) {
        let Some(p) = self.pending.remove(&msg.token) else {
            return;
        };
        self.in_flight -= p.bytes;
        p.span.record(
            "result",
            match &msg.result {
                Ok(_) => "ok",
                Err(_) => "failed",
            },
        );
        match msg.result {
            Ok(bytes) => {
                self.stats.bytes_written.add(bytes);
                self.stats.layers_written.inc();
                p.done_to.do_send(LayerWritten {
                    request: p.request,
                    write: p.write,
                    generation: p.generation,
                    bytes,
                });
            }
            Err(reason) => {
                self.stats.writes_failed.inc();
                tracing::warn!(peer = %self.peer, request = %p.request, %reason, "write failed");
                p.failed_to.do_send(LayerWriteFailed {
                    request: p.request,
                    write: p.write,
                    generation: p.generation,
                    reason: format!("write to {} failed: {reason}", self.peer),
                });
            }
        }
        self.pump(ctx);
    }
}

impl Handler<SendNotice> for LayerWriter {
    type Result = ();
    fn handle(&mut self, msg: SendNotice, _ctx: &mut Context<Self>) {
        let n = msg.0;
        let _g = tracing::debug_span!("send_notice", request = %n.request_id, generation = n.generation.0,
            outcome = ?n.outcome, peer = %self.peer)
        .entered();
        match self
            .transport
            .send_notification(&self.peer, NOTIFY_NAME, &n.to_json())
        {
            Ok(()) => self.stats.notices_sent.inc(),
            Err(e) => {
                // The consumer will fail the request at its deadline.
                self.stats.notices_failed.inc();
                tracing::warn!(peer = %self.peer, request = %n.request_id, error = %e, "notice not sent");
            }
        }
    }
}

/// One writer per peer endpoint, created on first use, each on its own arbiter.
pub struct WriterPool {
    transport: Arc<dyn Transport>,
    poller: Sender<PollJob>,
    write_timeout: Duration,
    max_in_flight: u64,
    stats: Arc<Stats>,
    writers: Mutex<HashMap<String, (Arbiter, Addr<LayerWriter>)>>,
}

impl WriterPool {
    pub fn new(
        transport: Arc<dyn Transport>,
        poller: Sender<PollJob>,
        write_timeout: Duration,
        max_in_flight: u64,
        stats: Arc<Stats>,
    ) -> Self {
        Self {
            transport,
            poller,
            write_timeout,
            max_in_flight,
            stats,
            writers: Mutex::new(HashMap::new()),
        }
    }

    pub fn get(&self, peer: &str) -> Addr<LayerWriter> {
        let mut writers = self.writers.lock();
        if let Some((_, addr)) = writers.get(peer) {
            return addr.clone();
        }
        let arbiter = Arbiter::new();
        let writer = LayerWriter {
            peer: peer.to_string(),
            transport: self.transport.clone(),
            poller: self.poller.clone(),
            write_timeout: self.write_timeout,
            max_in_flight: self.max_in_flight,
            in_flight: 0,
            queue: VecDeque::new(),
            pending: HashMap::new(),
            next_token: 1,
            stats: self.stats.clone(),
        };
        let addr = LayerWriter::start_in_arbiter(&arbiter.handle(), move |_| writer);
        writers.insert(peer.to_string(), (arbiter, addr.clone()));
        addr
    }

    /// Stops every writer's arbiter.
    pub fn stop(&self) {
        for (_, (arbiter, _)) in self.writers.lock().drain() {
            arbiter.stop();
        }
    }
}
