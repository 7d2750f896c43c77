//! Layer writers (`writer_lanes_per_peer` actors per peer, each on its own arbiter
//! thread, so a slow or dead peer holds up nobody else; [`WriterPool`]) and
//! the completion poller (one thread per runtime, polling every batch in
//! flight without blocking a thread per batch).
//!
//! A writer's state sits in an [`ActorCell`] (the execution model and its
//! locking rules: [`crate::actors::cell`]): a write handed over on the
//! thread that computed the layer (a producer's `LayerReady` run inline,
//! see [`super::producer`]) is submitted right there (an inline run) when
//! the writer is idle — nothing queued or on its way to it, its lock free —
//! the write waits for no layer mark, and it has at most
//! `inline_submit_max_ranges` ranges; every other write goes to the
//! writer's thread as a `WriteLayer` message. Completions always come back
//! through the writer's thread (poller → writer → producer; the writer runs
//! the producer's bookkeeping of the write itself when the producer is
//! idle, see `WriterReports` in [`super::producer`]). On a GPU a writer
//! never waits for a layer mark on its thread (unless told to,
//! `orbitkv.pd.gpu_wait` `block`): with nothing it can send, it parks on
//! the earliest mark of its queued writes and the mark watcher
//! ([`super::gate::LayerMarks::wake_when_reached`]) wakes it with
//! [`MarkReached`]; meanwhile it keeps taking writes and sends those whose
//! layer the GPU already wrote.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;

use super::gate::{LayerMarks, MarkSeq};
use super::gather::WriterGather;
use crate::actors::cell::{ActorCell, Wait};
use crate::actors::messages::{BatchFinished, LayerWriteFailed, LayerWritten, SendNotice, WriteLayer};
use crate::actors::stats::Stats;
use crate::transport::{BatchHandle, BatchState, Transport};
use crate::wire::Notice;
use crate::wire::NOTIFY_NAME;

/// A batch handed to the poller.
pub struct PollJob {
    pub handle: BatchHandle,
    /// `write_timeout` after submission: the batch is late (a warning; it is
    /// still waited for, since Mooncake may still move its bytes).
    pub late_at: Instant,
    /// `write_timeout + quarantine` after submission: the batch is given up.
    pub deadline: Instant,
    pub token: u64,
    pub reply: Addr<LayerWriter>,
    pub peer: Arc<str>,
    pub warned: bool,
}

/// How long the completion poller keeps napping after the last batch in
/// flight ended before it blocks on its queue; a batch handed over
/// meanwhile is taken at the next nap's end, within [`LINGER_NAP`] (the
/// steady state's polling interval).
const LINGER: Duration = Duration::from_millis(20);
const LINGER_NAP: Duration = Duration::from_micros(200);

/// Polls every batch in flight; reports each once, when Mooncake ends it or
/// its deadline passes. A late batch is not reported failed at
/// `write_timeout`: Mooncake cannot cancel a transfer, and one queued behind
/// a cut link lands when the link heals, so the producer must not release
/// its source blocks, nor tell decode it may free the destination, before
/// Mooncake ended it. A batch given up at its deadline is still polled until
/// Mooncake ends it, so that its id is freed.
pub fn spawn_poller(
    transport: Arc<dyn Transport>,
    jobs: Receiver<PollJob>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    stats: Arc<Stats>,
) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("orbitkv-poller".into())
        .spawn(move || {
            let mut live: Vec<PollJob> = Vec::new();
            let mut abandoned: Vec<BatchHandle> = Vec::new();
            // Naps at most 200 µs: a finished batch is reported within that.
            let mut backoff = crate::transport::PollBackoff::new(Duration::from_micros(200));
            let mut last_busy = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // Take new jobs; block only when nothing was in flight for
                // a while (`LINGER`): until then nap, so that whoever hands
                // over the next batch (a caller's thread, inline) does not
                // pay a futex wake of this thread.
                let idle = live.is_empty() && abandoned.is_empty();
                if idle && last_busy.elapsed() < LINGER {
                    match jobs.try_recv() {
                        Ok(j) => live.push(j),
                        Err(crossbeam_channel::TryRecvError::Empty) => {
                            std::thread::sleep(LINGER_NAP);
                            continue;
                        }
                        Err(crossbeam_channel::TryRecvError::Disconnected) => return,
                    }
                    backoff.reset();
                } else if idle {
                    match jobs.recv_timeout(Duration::from_millis(100)) {
                        Ok(j) => live.push(j),
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                    backoff.reset();
                }
                while let Ok(j) = jobs.try_recv() {
                    live.push(j);
                }
                let before = live.len();
                let now = Instant::now();
                live.retain_mut(|job| {
                    let mut gave_up = false;
                    let result = match transport.poll(&mut job.handle) {
                        Ok(BatchState::InFlight) if now < job.deadline => {
                            if now >= job.late_at && !job.warned {
                                job.warned = true;
                                stats.writes_late.inc();
                                tracing::warn!(peer = %job.peer,
                                    waited_ms = (now - job.handle.submitted).as_millis() as u64,
                                    "write batch past the write timeout: held until Mooncake ends it \
                                     (it may still move bytes) or the quarantine passes");
                            }
                            return true;
                        }
                        Ok(BatchState::InFlight) => {
                            let waited = (now - job.handle.submitted).as_millis();
                            stats.writes_abandoned.inc();
                            tracing::error!(peer = %job.peer, waited_ms = waited as u64,
                                "write batch given up while Mooncake still holds it: \
                                 its bytes may yet land after the request's blocks were freed");
                            abandoned.push(std::mem::replace(&mut job.handle, BatchHandle::new(0, "", 0, 0)));
                            gave_up = true;
                            Err(format!(
                                "timed out after {waited} ms (write timeout and quarantine passed; \
                                 Mooncake had not ended the batch)"
                            ))
                        }
                        Ok(BatchState::Completed { bytes }) => Ok(bytes),
                        Ok(BatchState::Failed { reason }) => Err(reason),
                        Err(e) => Err(e.to_string()),
                    };
                    job.reply.do_send(BatchFinished {
                        token: job.token,
                        result,
                        abandoned: gave_up,
                    });
                    false
                });
                abandoned
                    .retain_mut(|h| h.id() != 0 && matches!(transport.poll(h), Ok(BatchState::InFlight)));
                if live.len() < before {
                    backoff.reset();
                }
                last_busy = Instant::now();
                // Back off while nothing finishes: yield first, then nap.
                backoff.pause(None);
            }
        })
        .expect("spawn the completion poller thread")
}

/// One admitted write (a layer's ranges to this peer). A write with more
/// ranges than the per-peer range budget goes out as several batches; it is
/// reported once, when every batch ended (failed if any failed).
struct Job {
    request: Arc<crate::ids::RequestId>,
    write: u64,
    generation: crate::ids::Generation,
    ranges: Vec<crate::transport::WriteRange>,
    /// The bytes of `ranges` (summed once, at admission).
    bytes: u64,
    /// The layer mark to wait for before the first batch (0: none).
    after: crate::ids::MarkSeq,
    /// Index of the next range to submit.
    next: usize,
    /// Batches submitted and not yet ended.
    outstanding: usize,
    written: u64,
    failed: Option<String>,
    /// The consumer's deadline (0: none): nothing is submitted after it.
    expires_unix_ms: u64,
    reply_to: crate::actors::messages::ReplyTo,
    /// The write in flight, for the trace (closed when the job ends).
    span: tracing::Span,
    /// When the writer took the write.
    admitted: Instant,
    /// When the lane saw the GPU had computed its layer (its mark reached;
    /// at admission when it carried none), for
    /// [`crate::Timing::ComputedAfterFinish`].
    computed: Option<Instant>,
    /// When its first batch went to Mooncake.
    first_sent: Option<Instant>,
    /// The writer's gather was considered (once, before the first batch).
    gather_tried: bool,
    /// The piece of the source region `ranges` read from, once gathered
    /// (freed when the job ends).
    piece: Option<u64>,
    /// A batch of it was given up while Mooncake still held it.
    abandoned: bool,
}

impl Job {
    /// Nothing of it sent, not failed, not past the consumer's deadline:
    /// it may go now, whole, in one batch (its GPU mark aside).
    fn can_go_whole(&self, now_ms: u64) -> bool {
        self.failed.is_none()
            && self.next == 0
            && !self.ranges.is_empty()
            && (self.expires_unix_ms == 0 || now_ms <= self.expires_unix_ms)
    }
}

/// Batches a lane keeps in flight. One: Mooncake's NVLink transport runs a
/// submitting thread's batches on one CUDA stream and ends each only when
/// that stream is idle, so a second batch of the lane adds no parallelism
/// (the lanes give that) and delays the first; writes handed to a busy lane
/// wait in its queue and then go as one batch, so the number of batches
/// (submit calls, CUDA batch copies) per step stops growing with the
/// number of requests in flight. Mooncake's TCP transport spreads one
/// batch's ranges over its own worker threads.
const BATCHES_PER_LANE: usize = 1;

/// A batch in Mooncake: the writes it carries (job, its bytes in it; the
/// first may be a chunk of a larger write, the others are whole) and when it
/// was submitted. A lane's one batch is all it has in flight, so the lane's
/// share of the peer's budgets bounds the batch.
struct Batch {
    parts: Vec<(u64, u64)>,
    submitted: Instant,
}

/// Writes to one peer. Bounds the bytes and the ranges it has in flight
/// (Mooncake's TCP transport refuses more than about a thousand queued
/// transfers per peer); queues the rest, splitting a layer with more ranges
/// than the budget into several batches. Its state is its [`LaneCell`].
pub struct LayerWriter {
    cell: Arc<LaneCell>,
}

/// A writer's settings, and its actor's state and inbox count, shared by
/// the actor and the [`LaneRef`]s that reach it.
pub struct LaneCell {
    peer: Arc<str>,
    lane: LaneSettings,
    /// The state; its inbox counts the `WriteLayer`s sent and not yet
    /// queued: while any is, a write is not submitted inline ahead of it.
    actor: ActorCell<LaneState, LayerWriter>,
    /// `SendNotice`s sent to the actor and not yet sent on: while any is,
    /// the lane is not idle (its peer is not reclaimed).
    notices: AtomicUsize,
}

/// How producers reach a writer.
#[derive(Clone)]
pub struct LaneRef(Arc<LaneCell>);

/// What a writer owns.
struct LaneState {
    jobs: HashMap<u64, Job>,
    queue: VecDeque<u64>,
    /// The mark the front write waits for, with nothing else ready, and
    /// since when the lane has been parked ([`LaneCell::park`]).
    parked: Option<(MarkSeq, Instant)>,
    /// Batch token -> the batch in flight.
    pending: HashMap<u64, Batch>,
    /// The ranges of a batch that carries several writes (reused).
    grouped: Vec<crate::transport::WriteRange>,
    next_token: u64,
    next_job: u64,
}

/// What every writer lane of a runtime shares: the transport, the poller,
/// the deadlines and one lane's share of the per-peer budgets.
#[derive(Clone)]
struct LaneSettings {
    transport: Arc<dyn Transport>,
    poller: Sender<PollJob>,
    marks: Arc<LayerMarks>,
    write_timeout: Duration,
    quarantine: Duration,
    max_in_flight: u64,
    max_ranges: usize,
    /// A write of at most this many ranges may be submitted on the thread
    /// that handed it over (0: never).
    inline_max_ranges: usize,
    /// A lane with nothing to send parks on the earliest layer mark of its
    /// queued writes (the default); `false`: it waits for its front write's
    /// mark on its thread, as
    /// before 2026-12-05 (`orbitkv.pd.gpu_wait` `block`, for A/B runs).
    park_on_gpu: bool,
    /// `staging_pieces` `write`: writes gathered into a piece of the
    /// source region once their layer is computed ([`super::gather`]).
    gather: Option<Arc<WriterGather>>,
    stats: Arc<Stats>,
}

impl LaneRef {
    /// Hands `msg` to this writer. `inline`: the caller computed the layer
    /// on this thread (not the system thread) and may submit it here.
    pub fn write(&self, msg: WriteLayer, inline: bool) {
        let cell = &self.0;
        let mut msg = Some(msg);
        if inline
            && msg
                .as_ref()
                .is_some_and(|m| m.after == 0 && m.ranges.len() <= cell.lane.inline_max_ranges)
        {
            // under the producer's lock: only tried (rule 3)
            cell.actor.try_inline(Wait::No, |st| {
                if !st.queue.is_empty() {
                    return None;
                }
                cell.lane.stats.writes_inline.inc();
                cell.admit(st, msg.take()?);
                cell.pump(st);
                Some(())
            });
        }
        if let Some(msg) = msg {
            cell.actor.send(msg);
        }
    }

    /// Sends `notice` from this writer's thread.
    pub fn notice(&self, notice: Notice) {
        // Counted before this reference can be dropped: a reclaim that sees
        // no reference but the pool's sees the notice too.
        self.0.notices.fetch_add(1, Ordering::SeqCst);
        self.0.actor.addr().do_send(SendNotice(notice));
    }
}

impl LaneCell {
    /// Nothing on its way to the lane, no batch in flight, and `also` of its
    /// state (its lock taken by someone else counts as not).
    fn quiet_and(&self, also: impl FnOnce(&LaneState) -> bool) -> bool {
        self.actor.pending() == 0
            && self
                .actor
                .try_lock()
                .is_some_and(|st| st.pending.is_empty() && also(&st))
    }

    /// No batch in flight and nothing queued or on its way: a write handed
    /// over now goes out at once.
    fn free(&self) -> bool {
        self.quiet_and(|st| st.queue.is_empty())
    }

    /// Parked on the GPU with no batch in flight and nothing on its way.
    fn parked(&self) -> bool {
        self.quiet_and(|st| st.parked.is_some())
    }

    /// Nothing on its way to this lane, queued, or in flight (its lock
    /// taken by someone else counts as busy).
    fn idle(&self) -> bool {
        if self.actor.pending() != 0 || self.notices.load(Ordering::SeqCst) != 0 {
            return false;
        }
        self.actor
            .try_lock()
            .is_some_and(|st| st.queue.is_empty() && st.jobs.is_empty() && st.pending.is_empty())
    }

    /// Takes a write into the queue.
    fn admit(&self, st: &mut LaneState, msg: WriteLayer) {
        // Submit to completion; never entered, so an async slice in a trace.
        let span = tracing::debug_span!(parent: None, "write", request = %msg.request,
            write = msg.write, layer = msg.layer, generation = msg.generation.0, peer = %self.peer,
            bytes = msg.bytes, result = tracing::field::Empty);
        let id = st.next_job;
        st.next_job += 1;
        let now = Instant::now();
        st.jobs.insert(
            id,
            Job {
                request: msg.request,
                write: msg.write,
                generation: msg.generation,
                bytes: msg.ranges.iter().map(|r| r.len).sum(),
                ranges: msg.ranges,
                after: msg.after,
                next: 0,
                outstanding: 0,
                written: 0,
                failed: None,
                expires_unix_ms: msg.expires_unix_ms,
                reply_to: msg.reply_to,
                span,
                admitted: now,
                computed: (msg.after == 0).then_some(now),
                first_sent: None,
                gather_tried: false,
                piece: None,
                abandoned: false,
            },
        );
        st.queue.push_back(id);
    }

    /// Submits as many batches as the budgets allow, in arrival order but
    /// for writes whose layer the GPU has not written yet (passed over by
    /// those behind them that can go).
    fn pump(&self, st: &mut LaneState) {
        while let Some(&id) = st.queue.front() {
            let job = st.jobs.get_mut(&id).expect("queued job exists");
            if job.failed.is_none()
                && job.next < job.ranges.len()
                && job.expires_unix_ms != 0
                && crate::wire::unix_ms_now() > job.expires_unix_ms
            {
                // Queued past the consumer's deadline: it failed the request
                // and may reuse the blocks once its quarantine passes.
                job.failed = Some(crate::actors::messages::EXPIRED.into());
            }
            if job.failed.is_none() && job.next < job.ranges.len() && st.pending.len() >= BATCHES_PER_LANE {
                // One batch at a time per lane: what queues meanwhile goes
                // out together in the next (group commit, below).
                break;
            }
            let front_mark = job.after;
            if job.failed.is_none() && job.next == 0 && front_mark != 0 {
                let verdict = match self.lane.marks.try_reached(front_mark) {
                    Some(verdict) => verdict,
                    None => {
                        // On a GPU: not before the kernels that wrote the
                        // layer ran. While they run, a write queued behind
                        // whose layer the GPU already wrote (its decode
                        // authorized late, or no mark) goes first: the lane
                        // sends what it can instead of waiting. Two writes
                        // into the same bytes are never queued together
                        // (rule 8 holds the later one in its producer), so
                        // only their order to decode's pages changes, never
                        // their bytes.
                        if let Some(pos) = self.ready_behind(st, front_mark) {
                            let ahead = st.queue.remove(pos).expect("a queued job");
                            st.queue.push_front(ahead);
                            self.lane.stats.writes_ahead_of_gpu.inc();
                            continue;
                        }
                        if self.lane.park_on_gpu {
                            // Nothing ready: the lane parks (it never waits
                            // for the GPU on its thread, nor under its lock)
                            // and goes back to its inbox; a write that
                            // reaches it meanwhile and can go is sent ahead
                            // at once, and the watcher wakes it when the mark
                            // is reached.
                            let mark = self.first_mark_queued(st, front_mark);
                            self.park(st, mark);
                            break;
                        }
                        // `orbitkv.pd.gpu_wait` `block` (the lanes before
                        // 2026-12-05, kept for A/B runs on a GPU): the lane
                        // waits for the mark here, and what reaches it
                        // meanwhile waits in its inbox.
                        let waiting = Instant::now();
                        let verdict = self.lane.marks.wait_for(front_mark);
                        self.lane
                            .stats
                            .write_gpu_wait_micros
                            .add(waiting.elapsed().as_micros() as u64);
                        verdict
                    }
                };
                // The front write's mark is judged, and so every mark before
                // it: a park on any of them is over.
                self.unpark(st, front_mark);
                let job = st.jobs.get_mut(&id).expect("queued job exists");
                if let Err(reason) = verdict {
                    job.failed = Some(format!("GPU event wait failed: {reason}"));
                }
                job.computed.get_or_insert_with(Instant::now);
                job.after = 0;
            }
            let job = st.jobs.get_mut(&id).expect("queued job exists");
            if job.failed.is_some() || job.next == job.ranges.len() {
                st.queue.pop_front();
                self.maybe_finish(st, id);
                continue;
            }
            // Its layer is computed: gathered now, if that pays.
            self.gather(job);
            let end = (job.next + self.lane.max_ranges).min(job.ranges.len());
            let chunk = &job.ranges[job.next..end];
            let bytes: u64 = chunk.iter().map(|r| r.len).sum();
            let (n, last_chunk) = (chunk.len(), end == job.ranges.len());
            // Group commit: the writes queued behind this one whose layers
            // the GPU already wrote ride in the same batch, whole, while the
            // budgets allow, so batches (Mooncake submits, and on the NVLink
            // transport CUDA batch copies) do not grow with the number of
            // requests in flight. In queue order; a write the GPU has not
            // written yet is passed over (it goes in a later batch), a write
            // that does not fit the budgets ends the batch.
            let mut parts = vec![(id, bytes)];
            let (mut total_n, mut total_bytes) = (n, bytes);
            if last_chunk {
                let now_ms = crate::wire::unix_ms_now();
                let mut passed_over = false;
                for &other in st.queue.iter().skip(1) {
                    let o = st.jobs.get_mut(&other).expect("queued job exists");
                    if !o.can_go_whole(now_ms) {
                        // failed, expired or begun: reported in its turn
                        break;
                    }
                    if !Self::gpu_wrote(&self.lane.marks, o.after) {
                        passed_over = true;
                        continue;
                    }
                    self.gather(o);
                    let (on, ob) = (o.ranges.len(), o.bytes);
                    // The lane's budgets bound its one batch.
                    if total_n + on > self.lane.max_ranges || total_bytes + ob > self.lane.max_in_flight {
                        self.lane.stats.group_stops_budget.inc();
                        break;
                    }
                    parts.push((other, ob));
                    total_n += on;
                    total_bytes += ob;
                }
                // The counters say what bounds batches under load: the
                // lane's budget, or the GPU not having written layers yet.
                if passed_over {
                    self.lane.stats.group_stops_gpu.inc();
                }
            }
            let job = st.jobs.get_mut(&id).expect("queued job exists");
            let _g =
                tracing::debug_span!(parent: None, "write_layer", request = %job.request, write = job.write,
                generation = job.generation.0, peer = %self.peer, ranges = total_n, bytes = total_bytes,
                writes = parts.len())
                .entered();
            let submitting = Instant::now();
            let submitted = if parts.len() == 1 {
                self.lane
                    .transport
                    .submit_write(&self.peer, &job.ranges[job.next..end])
            } else {
                let mut grouped = std::mem::take(&mut st.grouped);
                grouped.clear();
                for &(j, _) in &parts {
                    let o = &st.jobs[&j];
                    let from = if j == id { o.next } else { 0 };
                    grouped.extend_from_slice(&o.ranges[from..]);
                }
                let r = self.lane.transport.submit_write(&self.peer, &grouped);
                st.grouped = grouped;
                r
            };
            // One clock read for the submit's duration and the deadlines.
            let now = Instant::now();
            self.lane
                .stats
                .write_submit_micros
                .add(now.saturating_duration_since(submitting).as_micros() as u64);
            let handle = match submitted {
                Ok(handle) => handle,
                Err(e) => {
                    tracing::warn!(peer = %self.peer, error = %e, "submit failed");
                    for &(j, _) in &parts {
                        let o = st.jobs.get_mut(&j).expect("queued job exists");
                        o.failed = Some(e.to_string());
                    }
                    continue;
                }
            };
            self.lane.stats.write_batches.inc();
            self.lane.stats.write_ranges.add(total_n as u64);
            // Queued time: each write whose first batch this is.
            let queued: u64 = parts
                .iter()
                .map(|(j, _)| &st.jobs[j])
                .filter(|o| o.next == 0)
                .map(|o| now.saturating_duration_since(o.admitted).as_micros() as u64)
                .sum();
            self.lane.stats.write_queue_micros.add(queued);
            self.lane.stats.writes_grouped.add(parts.len() as u64 - 1);
            let token = st.next_token;
            st.next_token += 1;
            let poll = PollJob {
                handle,
                late_at: now + self.lane.write_timeout,
                deadline: now + self.lane.write_timeout + self.lane.quarantine,
                token,
                reply: self.actor.addr().clone(),
                peer: self.peer.clone(),
                warned: false,
            };
            if self.lane.poller.send(poll).is_err() {
                for &(j, _) in &parts {
                    let o = st.jobs.get_mut(&j).expect("queued job exists");
                    o.failed = Some("the runtime is shutting down".into());
                }
                continue;
            }
            for &(j, _) in &parts {
                let o = st.jobs.get_mut(&j).expect("queued job exists");
                o.computed.get_or_insert(now);
                o.first_sent.get_or_insert(now);
                o.next = if j == id { end } else { o.ranges.len() };
                o.after = 0;
                o.outstanding += 1;
            }
            if parts.len() > 1 {
                // The writes that rode along are sent whole: out of the
                // queue now (a write passed over may stand between them and
                // the front; each is reported when its batch ends).
                let rode: std::collections::HashSet<u64> = parts[1..].iter().map(|&(j, _)| j).collect();
                st.queue.retain(|j| !rode.contains(j));
            }
            st.pending.insert(
                token,
                Batch {
                    parts,
                    submitted: submitting,
                },
            );
        }
    }

    /// The earliest layer mark of the writes queued that could go whole
    /// (`front`, the front write's, at most): the first the GPU reaches, so
    /// the one to park on. A write queued behind the front one may carry an
    /// earlier mark (its decode authorized it after the GPU was handed later
    /// layers); woken at it, the lane sends that write ahead.
    fn first_mark_queued(&self, st: &LaneState, front: MarkSeq) -> MarkSeq {
        let now_ms = crate::wire::unix_ms_now();
        st.queue
            .iter()
            .skip(1)
            .map(|j| &st.jobs[j])
            .filter(|o| o.after != 0 && o.can_go_whole(now_ms))
            .map(|o| o.after)
            .fold(front, MarkSeq::min)
    }

    /// Parks the lane on `mark` (from [`Self::first_mark_queued`], not reached): the mark
    /// watcher sends it [`MarkReached`] once the GPU wrote that layer. Asked
    /// once per mark; a stale wake only runs the pump again.
    fn park(&self, st: &mut LaneState, mark: MarkSeq) {
        if st.parked.is_some_and(|(m, _)| m == mark) {
            return;
        }
        let since = st.parked.map_or_else(Instant::now, |(_, since)| since);
        st.parked = Some((mark, since));
        let addr = self.actor.addr().clone();
        self.lane
            .marks
            .wake_when_reached(mark, Box::new(move || addr.do_send(MarkReached(mark))));
    }

    /// Mark `reached` was judged: a park on it or an earlier mark ends,
    /// counted in `write_gpu_wait_micros`.
    fn unpark(&self, st: &mut LaneState, reached: MarkSeq) {
        if let Some((_, since)) = st.parked.take_if(|(mark, _)| *mark <= reached) {
            self.lane
                .stats
                .write_gpu_wait_micros
                .add(since.elapsed().as_micros() as u64);
        }
    }

    /// Whether the GPU wrote the layer of a write marked `after` (`0`: no
    /// mark), without blocking.
    fn gpu_wrote(marks: &LayerMarks, after: MarkSeq) -> bool {
        after == 0 || matches!(marks.try_reached(after), Some(Ok(())))
    }

    /// The queue position of the first write behind the front one that can
    /// go now: whole (nothing of it sent, not failed) and its layer written
    /// by the GPU. `waiting`: the front write's mark, not reached (marks
    /// are reached in order: none after it is asked about).
    fn ready_behind(&self, st: &LaneState, waiting: MarkSeq) -> Option<usize> {
        let now_ms = crate::wire::unix_ms_now();
        let mut unreached = waiting;
        st.queue
            .iter()
            .skip(1)
            .position(|j| {
                let o = &st.jobs[j];
                if !o.can_go_whole(now_ms) || o.after >= unreached {
                    return false;
                }
                let ready = Self::gpu_wrote(&self.lane.marks, o.after);
                if !ready {
                    unreached = o.after;
                }
                ready
            })
            .map(|p| p + 1)
    }

    /// The writer's gather of `job` (once, before anything of it is sent;
    /// its layer computed): its ranges become the piece's when that pays
    /// and the region has room.
    fn gather(&self, job: &mut Job) {
        if job.gather_tried || job.next != 0 || job.failed.is_some() {
            return;
        }
        job.gather_tried = true;
        if let Some((piece, ranges)) = self.lane.gather.as_ref().and_then(|g| g.gather(&job.ranges)) {
            job.piece = Some(piece);
            job.ranges = ranges;
        }
    }

    /// Reports a job once nothing of it is in flight and nothing is left to submit.
    fn maybe_finish(&self, st: &mut LaneState, id: u64) {
        let Some(job) = st.jobs.get(&id) else { return };
        let submitted_all = job.next == job.ranges.len();
        if job.outstanding > 0 || !(submitted_all || job.failed.is_some()) {
            return;
        }
        let mut job = st.jobs.remove(&id).expect("checked above");
        if let (Some(piece), Some(g)) = (job.piece.take(), &self.lane.gather) {
            // Nothing of it in flight: Mooncake read the piece (or never
            // will, unless a batch was given up while it still held it).
            g.free(piece, job.abandoned);
        }
        self.lane
            .stats
            .layer_write_micros
            .add(job.admitted.elapsed().as_micros() as u64);
        match job.failed {
            None => {
                job.span.record("result", "ok");
                self.lane.stats.bytes_written.add(job.written);
                self.lane.stats.layers_written.inc();
                let mut spare = job.ranges;
                spare.clear();
                job.reply_to.written(LayerWritten {
                    request: job.request,
                    write: job.write,
                    generation: job.generation,
                    bytes: job.written,
                    spare,
                    computed: job.computed,
                    first_sent: job.first_sent,
                });
            }
            Some(reason) => {
                job.span.record("result", "failed");
                self.lane.stats.writes_failed.inc();
                tracing::warn!(peer = %self.peer, request = %job.request, %reason, "write failed");
                job.reply_to.failed(LayerWriteFailed {
                    request: job.request,
                    write: job.write,
                    generation: job.generation,
                    reason: format!("write to {} failed: {reason}", self.peer),
                });
            }
        }
    }
}

impl Actor for LayerWriter {
    type Context = Context<Self>;
}

impl Handler<WriteLayer> for LayerWriter {
    type Result = ();
    fn handle(&mut self, msg: WriteLayer, _ctx: &mut Context<Self>) {
        let cell = &self.cell;
        // Queued under the lock: an inline write that looks sees it.
        cell.actor.handle(true, |st| {
            cell.admit(st, msg);
            cell.pump(st);
        });
    }
}

/// The mark a parked lane waits for was judged (from the mark watcher).
#[derive(Message)]
#[rtype(result = "()")]
pub struct MarkReached(pub MarkSeq);

impl Handler<MarkReached> for LayerWriter {
    type Result = ();
    fn handle(&mut self, msg: MarkReached, _ctx: &mut Context<Self>) {
        let cell = &self.cell;
        let mut st = cell.actor.lock();
        // A wake for the mark parked on (or a later one) ends the park; the
        // pump then finds the front write's mark judged. A stale wake (the
        // lane parked on a later mark since) only runs the pump.
        cell.unpark(&mut st, msg.0);
        cell.pump(&mut st);
    }
}

impl Handler<BatchFinished> for LayerWriter {
    type Result = ();
    fn handle(&mut self, msg: BatchFinished, _ctx: &mut Context<Self>) {
        let cell = &self.cell;
        let mut st = cell.actor.lock();
        let Some(batch) = st.pending.remove(&msg.token) else {
            return;
        };
        cell.lane
            .stats
            .write_batch_micros
            .add(batch.submitted.elapsed().as_micros() as u64);
        let alone = batch.parts.len() == 1;
        for (id, bytes) in batch.parts {
            if let Some(job) = st.jobs.get_mut(&id) {
                job.outstanding -= 1;
                job.abandoned |= msg.abandoned;
                match &msg.result {
                    // Mooncake reports a batch's bytes; a write that shared
                    // it is credited with its own ranges' bytes.
                    Ok(written) => job.written += if alone { *written } else { bytes },
                    Err(reason) => {
                        job.failed.get_or_insert_with(|| reason.clone());
                    }
                }
            }
            cell.maybe_finish(&mut st, id);
        }
        cell.pump(&mut st);
    }
}

impl Handler<SendNotice> for LayerWriter {
    type Result = ();
    fn handle(&mut self, msg: SendNotice, _ctx: &mut Context<Self>) {
        let (n, cell) = (msg.0, &self.cell);
        let _g = tracing::debug_span!("send_notice", request = %n.request_id, generation = n.generation.0,
            outcome = ?n.outcome, peer = %cell.peer)
        .entered();
        match cell
            .lane
            .transport
            .send_notification(&cell.peer, NOTIFY_NAME, &n.to_json())
        {
            Ok(()) => cell.lane.stats.notices_sent.inc(),
            Err(e) => {
                // The consumer will fail the request at its deadline.
                cell.lane.stats.notices_failed.inc();
                tracing::warn!(peer = %cell.peer, request = %n.request_id, error = %e, "notice not sent");
            }
        }
        cell.notices.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The writers of each peer endpoint, created on first use: `lanes` writers
/// per peer, each on its own arbiter (thread), sharing the peer's budgets
/// equally. Writes go to the lanes in turn, so that Mooncake's submit calls
/// to one peer (CPU work per range inside Mooncake and the CUDA driver) run
/// on several threads, and, with the NVLink transport, on as many CUDA
/// streams (Mooncake keeps one per submitting thread and reports a batch
/// done only when its stream is idle). Notices go to a lane of their own
/// (one more writer per peer that takes no write): a writer lane's thread
/// may be in a Mooncake submit, and a finished request's notice must not
/// wait behind another request's writes (before lanes parked on the GPU,
/// it also waited behind a lane blocked on a layer mark, for as long as
/// the GPU lagged behind the worker). A producer sends its
/// notice only after every write it admitted ended, whatever lane carried
/// them, so it needs no order with the writes.
///
/// A peer idle for `idle_reclaim` is reclaimed ([`Self::reclaim_idle`]):
/// its arbiters stop, its entry goes, and the transport forgets it (closes
/// its segment), so that decode endpoints coming and going (rollouts,
/// autoscaling, restarts on new ports) leave no threads or segments behind.
/// The rule, checked under the pool's lock (the only place a [`LaneRef`] is
/// handed out): a peer is reclaimed only when
/// * no [`LaneRef`] of it is alive but the pool's own (each lane's
///   [`LaneCell`] is then held by the pool and by its actor only): no
///   producer keeps its lanes, and none can get them without this lock;
/// * every lane is idle: nothing queued, admitted, in flight or pending,
///   and no `WriteLayer` or `SendNotice` sent to it and not yet handled
///   ([`LaneCell`]'s counters, raised before the sender's reference can
///   go); and
/// * it was last looked up, or last found held or busy by a sweep, at least
///   `idle_reclaim` ago.
///
/// A write to a reclaimed peer later starts its lanes (and opens its
/// segment) again, as the first one did.
pub struct WriterPool {
    lane: LaneSettings,
    lanes: usize,
    next_lane: std::sync::atomic::AtomicUsize,
    writers: Mutex<HashMap<String, Peer>>,
    /// How long a peer stays idle before it is reclaimed.
    idle_reclaim: Duration,
    /// The actor system the lanes' arbiters belong to, for a lane first
    /// needed on a thread outside it (a write handed over inline).
    system: Option<System>,
}

/// One writer of a peer and the arbiter (thread) it runs on.
type Lane = (Arbiter, LaneRef);

/// A peer's writers and when it was last seen in use.
struct Peer {
    lanes: Vec<Lane>,
    /// The last lookup, or the last sweep that found it held or busy.
    used: Instant,
}

/// References to a lane's cell while no producer holds it: the pool's
/// [`LaneRef`] and its [`LayerWriter`] actor (or the closure that starts it).
const LANE_OWN_REFS: usize = 2;

impl Peer {
    /// No producer holds its lanes and none has anything on them.
    fn reclaimable(&self) -> bool {
        let held = self
            .lanes
            .iter()
            .any(|(_, l)| Arc::strong_count(&l.0) > LANE_OWN_REFS);
        // Pairs with the release of the last producer reference: whatever
        // that holder sent before it let go (counted in `inbox` or
        // `notices`) is seen below.
        std::sync::atomic::fence(Ordering::Acquire);
        !held && self.lanes.iter().all(|(_, l)| l.0.idle())
    }
}

impl WriterPool {
    /// `max_in_flight` and `max_ranges` bound each peer, all its lanes
    /// together; `marks` are the layer marks writes wait for; a write of at
    /// most `inline_max_ranges` ranges may be submitted on the thread that
    /// computed its layer; a peer idle for `idle_reclaim` is reclaimed.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        transport: Arc<dyn Transport>,
        (poller, marks): (Sender<PollJob>, Arc<LayerMarks>),
        (write_timeout, quarantine): (Duration, Duration),
        max_in_flight: u64,
        max_ranges: usize,
        lanes: usize,
        inline_max_ranges: usize,
        idle_reclaim: Duration,
        stats: Arc<Stats>,
    ) -> Self {
        let lanes = lanes.clamp(1, max_ranges.max(1));
        Self {
            lane: LaneSettings {
                transport,
                poller,
                marks,
                write_timeout,
                quarantine,
                max_in_flight: (max_in_flight / lanes as u64).max(1),
                max_ranges: (max_ranges / lanes).max(1),
                inline_max_ranges,
                park_on_gpu: true,
                gather: None,
                stats,
            },
            lanes,
            next_lane: std::sync::atomic::AtomicUsize::new(0),
            writers: Mutex::new(HashMap::new()),
            idle_reclaim,
            system: System::try_current(),
        }
    }

    /// Whether a lane with nothing to send parks on the earliest layer mark
    /// of its queued writes (`true`, the default) or waits for its front
    /// write's mark on its thread (`false`).
    pub fn park_on_gpu(mut self, park: bool) -> Self {
        self.lane.park_on_gpu = park;
        self
    }

    /// Writes are gathered into pieces before they go
    /// (`staging_pieces` `write`, [`super::gather`]).
    pub fn gather(mut self, gather: Option<Arc<WriterGather>>) -> Self {
        self.lane.gather = gather;
        self
    }

    /// The pool's lanes belong to `system` (for a pool made outside it).
    pub fn in_system(mut self, system: System) -> Self {
        self.system = Some(system);
        self
    }

    /// `f` over `peer`'s writers (started on first use), under the pool's lock.
    fn with_lanes<R>(&self, peer: &str, f: impl FnOnce(&[Lane]) -> R) -> R {
        let mut writers = self.writers.lock();
        let now = Instant::now();
        if let Some(p) = writers.get_mut(peer) {
            p.used = now;
            return f(&p.lanes);
        }
        // A new peer: reclaim the idle ones first, so that peers seen once
        // do not pile up between two ticks of the directory's sweep.
        self.reclaim_locked(&mut writers, now);
        if System::try_current().is_none() {
            // A thread outside the actor system (the caller of an inline
            // hand-over): its arbiters still belong to it.
            if let Some(sys) = &self.system {
                System::set_current(sys.clone());
            }
        }
        // the writer lanes, then the notice lane
        let lanes = (0..=self.lanes)
            .map(|_| {
                let arbiter = Arbiter::new();
                let cell = Arc::new(LaneCell {
                    peer: peer.into(),
                    lane: self.lane.clone(),
                    actor: ActorCell::new(LaneState {
                        jobs: HashMap::new(),
                        queue: VecDeque::new(),
                        parked: None,
                        pending: HashMap::new(),
                        grouped: Vec::new(),
                        next_token: 1,
                        next_job: 1,
                    }),
                    notices: AtomicUsize::new(0),
                });
                let writer = LayerWriter { cell: cell.clone() };
                let addr = LayerWriter::start_in_arbiter(&arbiter.handle(), move |_| writer);
                cell.actor.started(addr);
                (arbiter, LaneRef(cell))
            })
            .collect();
        let p = writers
            .entry(peer.to_string())
            .or_insert(Peer { lanes, used: now });
        f(&p.lanes)
    }

    /// The writer that sends `peer` its notices: a lane of its own, which
    /// is never handed a write (so never waits for the GPU or a batch).
    pub fn get(&self, peer: &str) -> LaneRef {
        self.with_lanes(peer, |lanes| lanes[self.lanes].1.clone())
    }

    /// Every writer lane of `peer` (not its notice lane), for a producer to
    /// keep ([`Self::pick`]).
    pub fn lanes(&self, peer: &str) -> Vec<LaneRef> {
        self.with_lanes(peer, |lanes| {
            lanes[..self.lanes].iter().map(|(_, l)| l.clone()).collect()
        })
    }

    /// The writer for the next write among `lanes` (one peer's, from
    /// [`Self::lanes`]): the first free one (no batch in flight, nothing
    /// queued or on its way) from the lanes in turn, counted over every
    /// producer of the pool; when none is free, the first parked one (no
    /// batch in flight: its queue waits for the GPU, and a write whose
    /// layer the GPU wrote goes out at once there, where a lane with a batch
    /// in Mooncake sends it only once that batch ended); else the next in
    /// turn.
    pub fn pick<'a>(&self, lanes: &'a [LaneRef]) -> &'a LaneRef {
        let start = self.next_lane.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let n = lanes.len();
        let in_turn = || (0..n).map(|k| &lanes[(start + k) % n]);
        in_turn()
            .find(|l| l.0.free())
            .or_else(|| in_turn().find(|l| l.0.parked()))
            .unwrap_or(&lanes[start % n])
    }

    /// Reclaims every peer idle since `now - idle_reclaim` (the rule is the
    /// type's); returns how many. The request directory calls it on a timer.
    pub fn reclaim_idle(&self, now: Instant) -> usize {
        self.reclaim_locked(&mut self.writers.lock(), now)
    }

    fn reclaim_locked(&self, writers: &mut HashMap<String, Peer>, now: Instant) -> usize {
        let mut gone = 0;
        writers.retain(|peer, p| {
            if !p.reclaimable() {
                p.used = now;
                return true;
            }
            if now.saturating_duration_since(p.used) < self.idle_reclaim {
                return true;
            }
            for (arbiter, _) in &p.lanes {
                arbiter.stop();
            }
            // Under the pool's lock: the peer's next lanes (and so its next
            // write, which opens the segment again) come after this.
            self.lane.transport.forget_peer(peer);
            self.lane.stats.peers_reclaimed.inc();
            tracing::debug!(%peer, "idle peer reclaimed: its writer lanes stopped, its segment closed");
            gone += 1;
            false
        });
        gone
    }

    /// Writes a lane took and has not begun to submit (waiting for its
    /// batch in flight, its budgets or, at the front, a layer mark). Never
    /// blocks: a lane whose state is held at this moment (submitting, or
    /// waiting for a GPU mark) is not counted.
    pub fn queued(&self) -> usize {
        let writers = self.writers.lock();
        writers
            .values()
            .flat_map(|p| &p.lanes)
            .filter_map(|(_, l)| {
                let st = l.0.actor.try_lock()?;
                Some(st.queue.iter().filter(|id| st.jobs[id].next == 0).count())
            })
            .sum()
    }

    /// Peers with writers now.
    pub fn peers(&self) -> usize {
        self.writers.lock().len()
    }

    /// Stops every writer's arbiter.
    pub fn stop(&self) {
        for (_, p) in self.writers.lock().drain() {
            for (arbiter, _) in p.lanes {
                arbiter.stop();
            }
        }
    }
}
