//! The layer gate: a prefill layer is submitted only once the GPU wrote it,
//! without a thread of its own.
//!
//! On a GPU the vLLM worker hands over a layer when it *launched* the
//! kernels that write it; they may not have run yet. The worker records a
//! mark (a CUDA event) on its stream and hands the mark to [`LayerMarks`],
//! which numbers it ([`MarkSeq`]); the step's calls go to the request
//! directory at once, each layer tagged with that number, and are planned
//! under the authorization there as on CPU. The layer writer that carries
//! a write waits for its mark ([`LayerMarks::wait_for`]) right before it
//! submits the first batch: the wait costs no thread crossing of its own
//! (worker → system thread → writer lane, as on CPU). Nothing here holds
//! Python's lock, and the worker never waits.
//!
//! A writer lane never blocks on a mark: it checks it without blocking
//! ([`LayerMarks::try_reached`]) and, when its front write's layer is not
//! written yet and nothing behind it can go, it *parks*: it asks to be
//! woken once the mark is reached ([`LayerMarks::wake_when_reached`]) and
//! goes back to its inbox, so a write that comes ready meanwhile (another
//! request's layer the GPU wrote long ago) goes out at once instead of
//! waiting behind the GPU. One thread of the runtime (`orbitkv-mark-watch`,
//! started by the first lane that parks, so never on CPU) waits for the
//! marks lanes parked on, in push order, and wakes them.
//!
//! Marks are waited for in the order they were pushed, by one thread at a
//! time; a mark reached stays reached. A mark
//! that cannot be waited for (a CUDA error) fails the writes tagged with
//! it (their requests fail: the consumer is told, nothing unwritten is
//! reported as written); marks before and after it are judged on their
//! own. Marks that no write needs (every request of the step released
//! meanwhile) are dropped once their event is seen complete, when later
//! marks are pushed; none is kept past [`PRUNE_AT`] outstanding unless its
//! GPU work is still running.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::actors::stats::Stats;
use crate::ids::RequestId;

/// Something to wait for before a layer may be sent.
pub trait Mark: Send {
    /// Blocks until the data the mark covers is written.
    fn wait(&mut self) -> Result<(), String>;

    /// Without blocking: `Some` once the mark was reached (or its wait
    /// failed), `None` while the work before it runs. A mark that cannot
    /// tell says `None`.
    fn poll(&mut self) -> Option<Result<(), String>> {
        None
    }
}

impl Mark for crate::transport::cuda::GpuMark {
    fn wait(&mut self) -> Result<(), String> {
        crate::transport::cuda::GpuMark::wait(self).map_err(|e| e.to_string())
    }

    fn poll(&mut self) -> Option<Result<(), String>> {
        crate::transport::cuda::GpuMark::poll(self)
            .map_err(|e| e.to_string())
            .transpose()
    }
}

pub use crate::ids::MarkSeq;

/// What is done for a request once the directory takes a step's calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateCall {
    /// [`crate::Runtime::layer_ready`], the write submitted after the mark.
    Ready {
        request: RequestId,
        layer: u32,
        blocks: Range<u32>,
    },
    /// [`crate::Runtime::producer_finish`] (after every call before it).
    Finish { request: RequestId },
}

/// Marks outstanding beyond which a push drops the ones already reached.
pub const PRUNE_AT: usize = 256;

/// Failed marks remembered (a write tagged with an older failed mark than
/// these is judged reached: by then its request long ended).
const FAILED_KEPT: usize = 1024;

struct Queued {
    seq: MarkSeq,
    mark: Box<dyn Mark>,
    pushed: Instant,
}

struct Pending {
    next: MarkSeq,
    queue: VecDeque<Queued>,
}

/// The marks of one runtime, numbered in push order.
pub struct LayerMarks {
    pending: Mutex<Pending>,
    /// Every mark up to this one was waited for (or judged).
    reached: AtomicU64,
    /// Held by the one thread waiting for the oldest mark.
    waiter: Mutex<()>,
    /// Marks whose wait failed, with the reason (the newest [`FAILED_KEPT`]).
    failed: Mutex<BTreeMap<MarkSeq, String>>,
    /// Who is to be woken when which mark is reached, and the thread that
    /// waits for them.
    watch: Arc<Watch>,
    stats: Arc<Stats>,
}

/// A wake asked for by a parked writer lane.
pub type Wake = Box<dyn FnOnce() + Send>;

/// The wakes of [`LayerMarks::wake_when_reached`], shared with the watcher
/// thread (which holds the marks themselves only while it waits for one).
struct Watch {
    state: Mutex<WatchState>,
    asked: Condvar,
}

#[derive(Default)]
struct WatchState {
    wakes: Vec<(MarkSeq, Wake)>,
    /// The watcher thread was started.
    started: bool,
    /// The marks were dropped: the watcher ends.
    stop: bool,
}

/// How long the idle watcher sleeps between checks that its marks still
/// exist (it is also woken when they are dropped).
const WATCH_IDLE: Duration = Duration::from_millis(500);

impl std::fmt::Debug for LayerMarks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerMarks")
            .field("reached", &self.reached())
            .field("outstanding", &self.outstanding())
            .finish()
    }
}

impl LayerMarks {
    pub fn new(stats: Arc<Stats>) -> Self {
        Self {
            pending: Mutex::new(Pending {
                next: 1,
                queue: VecDeque::new(),
            }),
            reached: AtomicU64::new(0),
            waiter: Mutex::new(()),
            failed: Mutex::new(BTreeMap::new()),
            watch: Arc::new(Watch {
                state: Mutex::new(WatchState::default()),
                asked: Condvar::new(),
            }),
            stats,
        }
    }

    /// Calls `wake` once mark `seq` (and every mark before it) was judged —
    /// reached, or its wait failed — on the watcher thread, or at once on
    /// this thread when it already was. Never blocks on the GPU: a writer
    /// lane parks with it instead of waiting for its front write's mark, and
    /// keeps sending what comes ready meanwhile. `wake` must not block (it
    /// sends a message).
    pub fn wake_when_reached(self: &Arc<Self>, seq: MarkSeq, wake: Wake) {
        let mut w = self.watch.state.lock();
        // Checked under the watch lock, which the watcher takes after every
        // mark it judged: a wake is either due now or seen by it.
        if self.reached() >= seq {
            drop(w);
            wake();
            return;
        }
        w.wakes.push((seq, wake));
        if !w.started {
            w.started = true;
            let (marks, watch) = (Arc::downgrade(self), self.watch.clone());
            std::thread::Builder::new()
                .name("orbitkv-mark-watch".into())
                .spawn(move || watch_marks(&marks, &watch))
                .expect("spawn the layer mark watcher thread");
        }
        drop(w);
        self.watch.asked.notify_one();
    }

    /// Numbers `mark` (after every mark pushed before). Never blocks on the
    /// GPU; past [`PRUNE_AT`] outstanding it drops the oldest marks that
    /// say they were reached.
    pub fn push(&self, mark: Box<dyn Mark>) -> MarkSeq {
        let (seq, prune) = {
            let mut p = self.pending.lock();
            let seq = p.next;
            p.next += 1;
            p.queue.push_back(Queued {
                seq,
                mark,
                pushed: Instant::now(),
            });
            (seq, p.queue.len() > PRUNE_AT)
        };
        if prune {
            // Only if no writer is waiting (it will drain the queue itself).
            if let Some(_w) = self.waiter.try_lock() {
                while self.take_oldest(|m| m.poll()) == Oldest::Judged {}
            }
        }
        seq
    }

    /// The newest mark every mark up to which was judged.
    pub fn reached(&self) -> MarkSeq {
        self.reached.load(Ordering::Acquire)
    }

    /// Marks pushed and not yet judged.
    pub fn outstanding(&self) -> usize {
        self.pending.lock().queue.len()
    }

    /// Blocks until mark `seq` (and every mark before it) was reached; the
    /// error of mark `seq` itself if its wait failed. `0`: at once.
    pub fn wait_for(&self, seq: MarkSeq) -> Result<(), String> {
        while self.reached() < seq {
            let _w = self.waiter.lock();
            if self.reached() >= seq {
                break;
            }
            if self.take_oldest(|m| Some(m.wait())) == Oldest::None {
                // Not pushed (a number from elsewhere): nothing to wait for.
                break;
            }
        }
        self.failure(seq)
    }

    /// Without blocking: `Some` once mark `seq` (and every mark before it)
    /// was reached — with the error of mark `seq` itself if its wait failed
    /// — judging marks whose GPU work already ran; `None` while any of them
    /// still runs, or while another thread is waiting for a mark.
    pub fn try_reached(&self, seq: MarkSeq) -> Option<Result<(), String>> {
        if self.reached() < seq {
            let _w = self.waiter.try_lock()?;
            while self.reached() < seq {
                match self.take_oldest(|m| m.poll()) {
                    Oldest::Judged => {}
                    Oldest::NotYet => return None,
                    Oldest::None => break,
                }
            }
        }
        Some(self.failure(seq))
    }

    /// Judges the oldest mark with `judge` (the waiter lock held); `judge`
    /// says `None` when it cannot tell yet (the mark stays).
    fn take_oldest(&self, judge: impl FnOnce(&mut dyn Mark) -> Option<Result<(), String>>) -> Oldest {
        let Some(mut q) = self.pending.lock().queue.pop_front() else {
            return Oldest::None;
        };
        let Some(result) = judge(q.mark.as_mut()) else {
            self.pending.lock().queue.push_front(q);
            return Oldest::NotYet;
        };
        drop(q.mark); // a GPU event goes back to its pool
        self.stats.ready_items.inc();
        self.stats
            .ready_lag_micros
            .add(q.pushed.elapsed().as_micros() as u64);
        if let Err(reason) = result {
            tracing::warn!(mark = q.seq, %reason, "layer gate: GPU wait failed; its writes fail");
            let mut failed = self.failed.lock();
            failed.insert(q.seq, reason);
            while failed.len() > FAILED_KEPT {
                failed.pop_first();
            }
        }
        self.reached.store(q.seq, Ordering::Release);
        Oldest::Judged
    }

    /// Mark `seq`'s own verdict (once reached).
    fn failure(&self, seq: MarkSeq) -> Result<(), String> {
        match self.failed.lock().get(&seq) {
            Some(reason) => Err(reason.clone()),
            None => Ok(()),
        }
    }
}

impl Drop for LayerMarks {
    fn drop(&mut self) {
        self.watch.state.lock().stop = true;
        self.watch.asked.notify_one();
    }
}

/// The watcher thread: while a lane is parked, waits for the oldest mark
/// not yet judged (one at a time, in push order, as [`LayerMarks::wait_for`]
/// does) and wakes every lane parked on a mark judged by then. Holds the
/// marks only during a wait; ends when they are dropped.
fn watch_marks(marks: &Weak<LayerMarks>, watch: &Watch) {
    loop {
        {
            let mut w = watch.state.lock();
            while w.wakes.is_empty() {
                if w.stop || marks.strong_count() == 0 {
                    return;
                }
                watch.asked.wait_for(&mut w, WATCH_IDLE);
            }
        }
        let Some(m) = marks.upgrade() else { return };
        let before = m.reached();
        let _ = m.wait_for(before + 1);
        let reached = m.reached();
        // Nothing pushed was left to wait for (a number from elsewhere):
        // every wake is due, its lane finds its mark judged.
        let all = reached == before && m.outstanding() == 0;
        drop(m);
        let due: Vec<Wake> = {
            let mut w = watch.state.lock();
            let (due, keep) = std::mem::take(&mut w.wakes)
                .into_iter()
                .partition(|(seq, _)| all || *seq <= reached);
            w.wakes = keep;
            due.into_iter().map(|(_, wake)| wake).collect()
        };
        for wake in due {
            wake();
        }
    }
}

/// What [`LayerMarks::take_oldest`] did.
#[derive(Debug, PartialEq, Eq)]
enum Oldest {
    /// Nothing was queued.
    None,
    /// The oldest mark could not be judged yet; it stays first.
    NotYet,
    /// The oldest mark was judged and dropped.
    Judged,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test double of a CUDA event: reached when the test says, through
    /// a shared cell; `wait` takes what was set (failing if nothing was).
    #[derive(Clone, Default)]
    struct Cell(Arc<Mutex<Option<Result<(), String>>>>);

    struct Fake {
        cell: Cell,
        waits: Arc<AtomicU64>,
    }

    impl Mark for Fake {
        fn wait(&mut self) -> Result<(), String> {
            self.waits.fetch_add(1, Ordering::Relaxed);
            self.cell
                .0
                .lock()
                .clone()
                .unwrap_or_else(|| Err("not set".into()))
        }
        fn poll(&mut self) -> Option<Result<(), String>> {
            self.cell.0.lock().clone()
        }
    }

    fn fake(waits: &Arc<AtomicU64>, value: Option<Result<(), String>>) -> (Cell, Box<dyn Mark>) {
        let cell = Cell(Arc::new(Mutex::new(value)));
        (
            cell.clone(),
            Box::new(Fake {
                cell,
                waits: waits.clone(),
            }),
        )
    }

    #[test]
    fn marks_are_waited_in_order_and_each_failure_is_its_own() {
        let stats = Arc::new(Stats::default());
        let marks = LayerMarks::new(stats.clone());
        let waits = Arc::new(AtomicU64::new(0));
        let a = marks.push(fake(&waits, Some(Ok(()))).1);
        let b = marks.push(fake(&waits, Some(Err("CUDA error 700".into()))).1);
        let c = marks.push(fake(&waits, Some(Ok(()))).1);
        assert_eq!((a, b, c), (1, 2, 3));
        assert_eq!(marks.wait_for(0), Ok(()), "no mark: nothing to wait for");
        assert_eq!(waits.load(Ordering::Relaxed), 0);
        // Waiting for the last judges the earlier ones first, once each.
        assert_eq!(marks.wait_for(c), Ok(()), "a failure before it is not its own");
        assert_eq!(waits.load(Ordering::Relaxed), 3);
        assert_eq!(marks.wait_for(a), Ok(()));
        assert_eq!(marks.wait_for(b), Err("CUDA error 700".into()));
        assert_eq!(
            waits.load(Ordering::Relaxed),
            3,
            "a reached mark is not waited again"
        );
        assert_eq!((marks.reached(), marks.outstanding()), (3, 0));
        assert_eq!(stats.snapshot().ready_items, 3);
        // A number never pushed does not block.
        assert_eq!(marks.wait_for(99), Ok(()));
    }

    #[test]
    fn marks_nobody_waits_for_are_dropped_once_reached_and_never_before() {
        let marks = LayerMarks::new(Arc::new(Stats::default()));
        let waits = Arc::new(AtomicU64::new(0));
        let mut cells = Vec::new();
        for _ in 0..PRUNE_AT {
            let (cell, m) = fake(&waits, None);
            cells.push(cell);
            marks.push(m);
        }
        assert_eq!(marks.outstanding(), PRUNE_AT);
        // The GPU reached the first 10: the next push drops those, not more.
        for c in &cells[..10] {
            *c.0.lock() = Some(Ok(()));
        }
        let (_, m) = fake(&waits, None);
        marks.push(m);
        assert_eq!(marks.outstanding(), PRUNE_AT + 1 - 10);
        assert_eq!(marks.reached(), 10);
        assert_eq!(waits.load(Ordering::Relaxed), 0, "pruning never blocks");
    }

    #[test]
    fn try_reached_judges_what_already_ran_and_never_blocks() {
        let marks = LayerMarks::new(Arc::new(Stats::default()));
        let waits = Arc::new(AtomicU64::new(0));
        let (ca, a) = fake(&waits, None);
        let (cb, b) = fake(&waits, None);
        let (a, b) = (marks.push(a), marks.push(b));
        assert_eq!(marks.try_reached(0), Some(Ok(())), "no mark: reached");
        assert_eq!(marks.try_reached(a), None, "its GPU work still runs");
        *cb.0.lock() = Some(Err("CUDA error 700".into()));
        assert_eq!(marks.try_reached(b), None, "a mark before it still runs");
        *ca.0.lock() = Some(Ok(()));
        assert_eq!(marks.try_reached(a), Some(Ok(())));
        assert_eq!(marks.reached(), a, "judged no further than asked");
        assert_eq!(marks.try_reached(b), Some(Err("CUDA error 700".into())));
        assert_eq!((marks.reached(), marks.outstanding()), (b, 0));
        assert_eq!(waits.load(Ordering::Relaxed), 0, "polled, never waited");
        // While another thread waits for a mark, it does not judge.
        let (_cc, c) = fake(&waits, None);
        let c = marks.push(c);
        let _w = marks.waiter.lock();
        assert_eq!(marks.try_reached(c), None);
    }

    /// A wake that says on `tx` which mark it was asked for.
    fn wake_to(tx: &crossbeam_channel::Sender<MarkSeq>, seq: MarkSeq) -> Wake {
        let tx = tx.clone();
        Box::new(move || {
            let _ = tx.send(seq);
        })
    }

    #[test]
    fn a_parked_lane_is_woken_once_its_mark_is_judged_and_never_before() {
        let marks = Arc::new(LayerMarks::new(Arc::new(Stats::default())));
        let waits = Arc::new(AtomicU64::new(0));
        let (tx, woken) = crossbeam_channel::unbounded();
        // Reached already: woken at once, on the caller's thread, no thread.
        let (_c0, m0) = fake(&waits, Some(Ok(())));
        let a = marks.push(m0);
        assert_eq!(marks.try_reached(a), Some(Ok(())));
        marks.wake_when_reached(a, wake_to(&tx, a));
        assert_eq!(woken.try_recv(), Ok(a));
        assert!(
            !marks.watch.state.lock().started,
            "no watcher for a mark already reached"
        );

        // Three marks the GPU has not reached; wakes asked out of order.
        let gates: Vec<_> = (0..3)
            .map(|_| crossbeam_channel::bounded::<Result<(), String>>(1))
            .collect();
        struct Gate(crossbeam_channel::Receiver<Result<(), String>>);
        impl Mark for Gate {
            fn wait(&mut self) -> Result<(), String> {
                self.0.recv().map_err(|e| e.to_string())?
            }
        }
        let seqs: Vec<MarkSeq> = gates
            .iter()
            .map(|(_, rx)| marks.push(Box::new(Gate(rx.clone()))))
            .collect();
        marks.wake_when_reached(seqs[2], wake_to(&tx, seqs[2]));
        marks.wake_when_reached(seqs[0], wake_to(&tx, seqs[0]));
        let quiet = std::time::Duration::from_millis(50);
        assert!(
            woken.recv_timeout(quiet).is_err(),
            "nothing is woken before its mark"
        );
        // The first mark reached wakes its lane only.
        gates[0].0.send(Ok(())).unwrap();
        assert_eq!(woken.recv_timeout(std::time::Duration::from_secs(5)), Ok(seqs[0]));
        assert!(
            woken.recv_timeout(quiet).is_err(),
            "the later mark is not reached"
        );
        // A failed wait wakes too (the lane then finds the failure), and
        // the marks after it are judged on their own.
        gates[1].0.send(Err("CUDA error 700".into())).unwrap();
        gates[2].0.send(Ok(())).unwrap();
        assert_eq!(woken.recv_timeout(std::time::Duration::from_secs(5)), Ok(seqs[2]));
        assert_eq!(marks.try_reached(seqs[1]), Some(Err("CUDA error 700".into())));
        assert_eq!(marks.try_reached(seqs[2]), Some(Ok(())));
        // A number never pushed wakes at once (nothing to wait for).
        marks.wake_when_reached(99, wake_to(&tx, 99));
        assert_eq!(woken.recv_timeout(std::time::Duration::from_secs(5)), Ok(99));
        assert_eq!(marks.outstanding(), 0);
    }

    #[test]
    fn the_watcher_ends_when_its_marks_are_dropped() {
        let marks = Arc::new(LayerMarks::new(Arc::new(Stats::default())));
        let (tx, woken) = crossbeam_channel::unbounded();
        let waits = Arc::new(AtomicU64::new(0));
        let (cell, m) = fake(&waits, None);
        let seq = marks.push(m);
        *cell.0.lock() = Some(Ok(()));
        marks.wake_when_reached(seq, wake_to(&tx, seq));
        // `fake` waits return at once: the watcher judged it (or the caller
        // did, if it was reached when asked).
        assert_eq!(woken.recv_timeout(std::time::Duration::from_secs(5)), Ok(seq));
        let watch = marks.watch.clone();
        assert!(watch.state.lock().started);
        drop(marks);
        assert!(watch.state.lock().stop);
        // The thread let go of its share of the watch state.
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        while Arc::strong_count(&watch) > 1 {
            assert!(Instant::now() < deadline, "the watcher thread did not end");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    #[test]
    fn a_writer_blocks_until_its_mark_and_others_share_the_wait() {
        let marks = Arc::new(LayerMarks::new(Arc::new(Stats::default())));
        let (tx, rx) = crossbeam_channel::bounded::<()>(1);
        struct Gate(crossbeam_channel::Receiver<()>);
        impl Mark for Gate {
            fn wait(&mut self) -> Result<(), String> {
                self.0.recv().map_err(|e| e.to_string())
            }
        }
        let seq = marks.push(Box::new(Gate(rx)));
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let m = marks.clone();
                std::thread::spawn(move || m.wait_for(seq))
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            waiters.iter().all(|w| !w.is_finished()),
            "nobody passes an unreached mark"
        );
        tx.send(()).unwrap();
        for w in waiters {
            assert_eq!(w.join().unwrap(), Ok(()));
        }
    }
}
