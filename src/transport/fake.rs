//! A transport test double (cargo feature `testing`): no network, no
//! memory touched, every batch's fate scripted by the test. For unit tests
//! of the actors and for the runtime benchmarks; the tests that move bytes
//! use the real Mooncake engine.
//!
//! By default a batch completes at its first poll. [`FakeTransport::hold`]
//! keeps every batch in flight (a cut link: Mooncake's queue holds them);
//! [`FakeTransport::end_with`] chooses how held or later batches end;
//! [`FakeTransport::refuse_submits`] makes `submit_write` fail;
//! [`FakeTransport::forgotten`] lists the peers it was told to forget;
//! [`FakeTransport::with_kind`] chooses which transport it says it is.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{BatchHandle, BatchState, Notification, Transport, WriteRange};
use crate::error::{TransportError, TransportResult};

/// How batches end once they are not held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FakeEnd {
    /// Completed, with all their bytes.
    Complete,
    /// Failed, with this reason.
    Fail(String),
}

/// See the module documentation.
pub struct FakeTransport {
    endpoint: String,
    base: Instant,
    hold: AtomicBool,
    end: Mutex<FakeEnd>,
    refuse: Mutex<Option<String>>,
    next_id: AtomicU64,
    submits: AtomicU64,
    ranges: AtomicU64,
    /// Every accepted range, in submit order ([`FakeTransport::submitted`]).
    log: Mutex<Vec<WriteRange>>,
    last_submit_ns: AtomicU64,
    notices_sent: AtomicU64,
    /// `forget_peer` calls, by peer.
    forgotten: Mutex<Vec<String>>,
    /// The transport it says it is ([`FakeTransport::with_kind`]).
    kind: super::TransportKind,
    inbox: Mutex<Vec<Notification>>,
    /// `take_notifications` calls by the calling thread's name.
    polls: Mutex<std::collections::HashMap<String, u64>>,
}

impl FakeTransport {
    /// A double whose endpoint (what peers would address) is `endpoint`.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            base: Instant::now(),
            hold: AtomicBool::new(false),
            end: Mutex::new(FakeEnd::Complete),
            refuse: Mutex::new(None),
            next_id: AtomicU64::new(1),
            submits: AtomicU64::new(0),
            ranges: AtomicU64::new(0),
            log: Mutex::new(Vec::new()),
            last_submit_ns: AtomicU64::new(0),
            notices_sent: AtomicU64::new(0),
            forgotten: Mutex::new(Vec::new()),
            kind: super::TransportKind::Unknown,
            inbox: Mutex::new(Vec::new()),
            polls: Mutex::new(std::collections::HashMap::new()),
        }
    }

    /// The same double, saying it is a `kind` transport (its defaults follow).
    pub fn with_kind(mut self, kind: super::TransportKind) -> Self {
        self.kind = kind;
        self
    }

    /// How many times threads named `thread` called `take_notifications`.
    pub fn polls_by(&self, thread: &str) -> u64 {
        self.polls.lock().get(thread).copied().unwrap_or(0)
    }

    /// While `on`, every batch stays in flight.
    pub fn hold(&self, on: bool) {
        self.hold.store(on, Ordering::Release);
    }

    /// How batches end from now on (when not held).
    pub fn end_with(&self, end: FakeEnd) {
        *self.end.lock() = end;
    }

    /// `Some(reason)`: `submit_write` fails with it; `None`: it succeeds.
    pub fn refuse_submits(&self, reason: Option<String>) {
        *self.refuse.lock() = reason;
    }

    /// `submit_write` calls accepted so far.
    pub fn submits(&self) -> u64 {
        self.submits.load(Ordering::Acquire)
    }

    /// Ranges in them.
    pub fn ranges(&self) -> u64 {
        self.ranges.load(Ordering::Acquire)
    }

    /// Every range of every accepted `submit_write`, in order (where the
    /// writes would have gone: nothing is copied).
    pub fn submitted(&self) -> Vec<WriteRange> {
        self.log.lock().clone()
    }

    /// Notifications sent so far.
    pub fn notices_sent(&self) -> u64 {
        self.notices_sent.load(Ordering::Acquire)
    }

    /// `forget_peer` calls so far.
    pub fn forgets(&self) -> usize {
        self.forgotten.lock().len()
    }

    /// The peers `forget_peer` was called for, in order (once per call).
    pub fn forgotten(&self) -> Vec<String> {
        self.forgotten.lock().clone()
    }

    /// When the latest accepted `submit_write` was called.
    pub fn last_submit(&self) -> Instant {
        self.base + Duration::from_nanos(self.last_submit_ns.load(Ordering::Acquire))
    }

    /// Spins until `submit_write` was accepted `n` times in all (panics
    /// after a minute).
    pub fn wait_submits(&self, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.submits() < n {
            assert!(
                Instant::now() < deadline,
                "stuck at {} of {n} submits",
                self.submits()
            );
            std::hint::spin_loop();
        }
    }

    /// Queues notifications for the next `take_notifications`.
    pub fn deliver(&self, list: impl IntoIterator<Item = Notification>) {
        self.inbox.lock().extend(list);
    }
}

impl Transport for FakeTransport {
    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn submit_write(&self, peer: &str, ranges: &[WriteRange]) -> TransportResult<BatchHandle> {
        if let Some(reason) = self.refuse.lock().clone() {
            return Err(TransportError::InvalidArgument(reason));
        }
        let ns = self.base.elapsed().as_nanos() as u64;
        self.last_submit_ns.store(ns, Ordering::Release);
        let bytes = ranges.iter().map(|r| r.len).sum();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.log.lock().extend_from_slice(ranges);
        self.ranges.fetch_add(ranges.len() as u64, Ordering::Release);
        self.submits.fetch_add(1, Ordering::Release);
        Ok(BatchHandle::new(id, peer, ranges.len(), bytes))
    }

    fn poll(&self, handle: &mut BatchHandle) -> TransportResult<BatchState> {
        if self.hold.load(Ordering::Acquire) {
            return Ok(BatchState::InFlight);
        }
        Ok(match &*self.end.lock() {
            FakeEnd::Complete => BatchState::Completed { bytes: handle.bytes },
            FakeEnd::Fail(reason) => BatchState::Failed {
                reason: reason.clone(),
            },
        })
    }

    fn send_notification(&self, _peer: &str, _name: &str, _message: &[u8]) -> TransportResult<()> {
        self.notices_sent.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn forget_peer(&self, peer: &str) {
        self.forgotten.lock().push(peer.to_string());
    }

    fn kind(&self) -> super::TransportKind {
        self.kind
    }

    fn take_notifications(&self) -> TransportResult<Vec<Notification>> {
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("");
        let mut polls = self.polls.lock();
        match polls.get_mut(name) {
            Some(n) => *n += 1,
            None => {
                polls.insert(name.to_string(), 1);
            }
        }
        drop(polls);
        Ok(std::mem::take(&mut *self.inbox.lock()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripted_batches() {
        let t = FakeTransport::new("127.0.0.1:1");
        let r = [WriteRange {
            src: 0,
            dst: 0,
            len: 8,
        }];
        let mut h = t.submit_write("p", &r).unwrap();
        assert_eq!(t.poll(&mut h).unwrap(), BatchState::Completed { bytes: 8 });
        t.hold(true);
        let mut h = t.submit_write("p", &r).unwrap();
        assert_eq!(t.poll(&mut h).unwrap(), BatchState::InFlight);
        t.end_with(FakeEnd::Fail("cut".into()));
        t.hold(false);
        assert!(matches!(t.poll(&mut h).unwrap(), BatchState::Failed { .. }));
        t.refuse_submits(Some("no".into()));
        assert!(t.submit_write("p", &r).is_err());
        assert_eq!((t.submits(), t.ranges()), (2, 2));
    }
}
