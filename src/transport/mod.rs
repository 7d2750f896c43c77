//! The transport: Mooncake Transfer Engine reached through a C++ shim.
//!
//! * `shim/` / [`ffi`]: C functions over Mooncake's exported C++ API
//!   (`mooncake.cc`), the CUDA driver's events (`cuda.cc`) and the
//!   submit-wait redirect (`submit_wait.cc`), exception-safe (`common.h`),
//!   loaded with dlopen at run time.
//! * [`library`]: where `engine.so` (and libpython) is found; the version pin.
//! * [`loader`]: loading it into the process once; the submit-wait patch.
//! * [`mooncake`]: [`MooncakeTransferEngine`], the safe wrapper.
//! * [`status`]: Mooncake's status codes (a batch's state, a refused submit).
//! * [`kind`]: which transport Mooncake installs (TCP, RDMA, NVLink), and
//!   the range cap that follows from it.
//! * [`cuda`]: GPU events from the CUDA driver (through the same shim), so a
//!   layer is written only after the kernel that wrote it ran.

use std::time::{Duration, Instant};

pub mod cuda;
#[cfg(any(test, feature = "testing"))]
pub mod fake;
pub mod ffi;
pub mod kind;
pub mod library;
pub mod loader;
pub mod mooncake;
pub mod status;

pub use kind::TransportKind;
pub use library::{MooncakeLibrary, PINNED_MOONCAKE_VERSION};
pub use mooncake::{parse_endpoint, EngineConfig, MooncakeTransferEngine};

/// One WRITE (defined with the layout that plans it).
pub use crate::layout::WriteRange;

/// A submitted batch. Poll it until it is terminal.
#[derive(Debug)]
pub struct BatchHandle {
    /// Mooncake batch id; 0 once freed.
    pub(crate) id: u64,
    pub peer: String,
    pub tasks: usize,
    pub bytes: u64,
    pub submitted: Instant,
}

/// Where a batch stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchState {
    InFlight,
    Completed { bytes: u64 },
    Failed { reason: String },
}

/// A notification as Mooncake delivers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    pub name: String,
    pub message: Vec<u8>,
}

impl BatchHandle {
    /// A handle for batch `id` (used by transport implementations).
    pub fn new(id: u64, peer: impl Into<String>, tasks: usize, bytes: u64) -> Self {
        Self {
            id,
            peer: peer.into(),
            tasks,
            bytes,
            submitted: Instant::now(),
        }
    }

    /// The transport's batch id; 0 once the batch reached a terminal state.
    pub fn id(&self) -> u64 {
        self.id
    }
}

/// How a thread that waits on Mooncake spends the time between two polls
/// (Mooncake has no completion callback): it yields for the first
/// [`PollBackoff::SPIN`] after the last progress, so a short batch is seen
/// at once, then naps, doubling from 5 µs up to its `max_nap`, so a long
/// one costs no core. One schedule for every waiter: the runtime's
/// completion poller and [`wait_batch`] (behind
/// [`MooncakeTransferEngine::wait`] and the Python binding's blocking
/// `write`).
#[derive(Debug, Clone)]
pub struct PollBackoff {
    since: Instant,
    nap: Duration,
    max_nap: Duration,
}

impl PollBackoff {
    /// How long a waiter yields before it starts to nap.
    pub const SPIN: Duration = Duration::from_micros(200);
    const FIRST_NAP: Duration = Duration::from_micros(5);

    /// A backoff whose naps grow to at most `max_nap`, starting now.
    pub fn new(max_nap: Duration) -> Self {
        Self {
            since: Instant::now(),
            nap: Self::FIRST_NAP,
            max_nap: max_nap.max(Self::FIRST_NAP),
        }
    }

    /// Something progressed: yield again before napping.
    pub fn reset(&mut self) {
        self.since = Instant::now();
        self.nap = Self::FIRST_NAP;
    }

    /// Waits before the next poll: a yield, or a nap that never passes
    /// `deadline`.
    pub fn pause(&mut self, deadline: Option<Instant>) {
        let now = Instant::now();
        if now - self.since < Self::SPIN {
            std::thread::yield_now();
            return;
        }
        let nap = match deadline {
            Some(d) => self.nap.min(d.saturating_duration_since(now)),
            None => self.nap,
        };
        std::thread::sleep(nap);
        self.nap = (self.nap * 2).min(self.max_nap);
    }
}

/// How a waited-for batch ended ([`wait_batch`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchEnd {
    /// Every range written: Mooncake's byte count.
    Completed(u64),
    /// Mooncake failed it (its reason).
    Failed(String),
    /// Still in flight at the deadline (left to Mooncake: its memory must
    /// stay registered).
    TimedOut,
}

/// The one blocking wait for a batch: `poll` reads its state until it ends
/// or `deadline` passes, pausing by [`PollBackoff`] between polls; `between`
/// runs after each poll that found it in flight (the Python binding checks
/// for signals there) and its error ends the wait. Used by
/// [`MooncakeTransferEngine::wait`] and the binding's blocking writes; the
/// runtime's writers do not block (their completion poller polls).
pub fn wait_batch<E>(
    deadline: Instant,
    mut poll: impl FnMut() -> Result<BatchState, E>,
    mut between: impl FnMut(Instant) -> Result<(), E>,
) -> Result<BatchEnd, E> {
    let mut backoff = PollBackoff::new(Duration::from_micros(500));
    loop {
        match poll()? {
            BatchState::Completed { bytes } => return Ok(BatchEnd::Completed(bytes)),
            BatchState::Failed { reason } => return Ok(BatchEnd::Failed(reason)),
            BatchState::InFlight => {}
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(BatchEnd::TimedOut);
        }
        between(now)?;
        backoff.pause(Some(deadline));
    }
}

/// What the runtime needs from a transport. [`MooncakeTransferEngine`] is the
/// real one; unit tests of the state machine may use a test double.
pub trait Transport: Send + Sync + 'static {
    /// The local endpoint peers address (`ip:port`).
    fn endpoint(&self) -> &str;
    /// Submits a batch of WRITEs without waiting.
    fn submit_write(&self, peer: &str, ranges: &[WriteRange]) -> crate::error::TransportResult<BatchHandle>;
    /// Polls a batch; a terminal state releases it.
    fn poll(&self, handle: &mut BatchHandle) -> crate::error::TransportResult<BatchState>;
    /// Sends a notification to a peer.
    fn send_notification(&self, peer: &str, name: &str, message: &[u8]) -> crate::error::TransportResult<()>;
    /// Drains the notifications that arrived.
    fn take_notifications(&self) -> crate::error::TransportResult<Vec<Notification>>;
    /// Drops what the transport keeps for `peer` (an open segment): the
    /// writers of this process no longer write to it. The next write to it
    /// opens it again. Default: nothing is kept.
    fn forget_peer(&self, _peer: &str) {}
    /// The transport the writes go through (it sets defaults such as the
    /// range cap, never a target). Default: not known.
    fn kind(&self) -> TransportKind {
        TransportKind::Unknown
    }
}

impl Transport for MooncakeTransferEngine {
    fn endpoint(&self) -> &str {
        MooncakeTransferEngine::endpoint(self)
    }
    fn submit_write(&self, peer: &str, ranges: &[WriteRange]) -> crate::error::TransportResult<BatchHandle> {
        MooncakeTransferEngine::submit_write(self, peer, ranges)
    }
    fn poll(&self, handle: &mut BatchHandle) -> crate::error::TransportResult<BatchState> {
        MooncakeTransferEngine::poll(self, handle)
    }
    fn send_notification(&self, peer: &str, name: &str, message: &[u8]) -> crate::error::TransportResult<()> {
        MooncakeTransferEngine::send_notification(self, peer, name, message)
    }
    fn take_notifications(&self) -> crate::error::TransportResult<Vec<Notification>> {
        MooncakeTransferEngine::take_notifications(self)
    }
    fn forget_peer(&self, peer: &str) {
        MooncakeTransferEngine::forget_peer(self, peer)
    }
    fn kind(&self) -> TransportKind {
        MooncakeTransferEngine::kind(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_wait_ends_with_the_batch_the_deadline_or_the_check_between_polls() {
        let far = Instant::now() + Duration::from_secs(60);
        // In flight twice, then done: its bytes, after two checks.
        let (mut polls, mut checks) = (0, 0);
        let end = wait_batch::<()>(
            far,
            || {
                polls += 1;
                Ok(if polls < 3 {
                    BatchState::InFlight
                } else {
                    BatchState::Completed { bytes: 7 }
                })
            },
            |_| {
                checks += 1;
                Ok(())
            },
        );
        assert_eq!((end, polls, checks), (Ok(BatchEnd::Completed(7)), 3, 2));
        // A failure is an end, not an error of the wait.
        let end = wait_batch::<()>(far, || Ok(BatchState::Failed { reason: "x".into() }), |_| Ok(()));
        assert_eq!(end, Ok(BatchEnd::Failed("x".into())));
        // Past the deadline: timed out, polled once, no check.
        let end = wait_batch::<()>(Instant::now(), || Ok(BatchState::InFlight), |_| Err(()));
        assert_eq!(end, Ok(BatchEnd::TimedOut));
        // The check's error ends the wait (a signal in the binding).
        let end = wait_batch(far, || Ok(BatchState::InFlight), |_| Err("signal"));
        assert_eq!(end, Err("signal"));
    }

    #[test]
    fn the_backoff_yields_first_then_naps_up_to_its_cap_and_never_past_the_deadline() {
        let mut b = PollBackoff::new(Duration::from_millis(40));
        // Within SPIN of the start: yields only, no nap grows.
        b.pause(None);
        assert_eq!(b.nap, PollBackoff::FIRST_NAP);
        std::thread::sleep(PollBackoff::SPIN);
        for _ in 0..20 {
            b.pause(Some(Instant::now()));
        }
        assert_eq!(b.nap, Duration::from_millis(40), "naps double up to the cap");
        // A nap at the cap is cut at the deadline.
        let t = Instant::now();
        b.pause(Some(t + Duration::from_millis(2)));
        assert!(t.elapsed() < Duration::from_millis(30), "slept {:?}", t.elapsed());
        b.reset();
        assert_eq!(b.nap, PollBackoff::FIRST_NAP);
        let t = Instant::now();
        b.pause(None);
        assert!(
            t.elapsed() < Duration::from_millis(30),
            "after progress it yields"
        );
    }
}
