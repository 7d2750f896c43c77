//! The transport: Mooncake Transfer Engine reached through a C++ shim.
//!
//! * `shim.cc` / [`ffi`]: C functions over Mooncake's exported C++ API,
//!   exception-safe, loaded with dlopen at run time.
//! * [`library`]: where `engine.so` (and libpython) is found; the version pin.
//! * [`mooncake`]: [`MooncakeTransferEngine`], the safe wrapper.
//! * [`cuda`]: GPU events from the CUDA driver (through the same shim), so a
//!   layer is written only after the kernel that wrote it ran.

use std::time::Instant;

pub mod cuda;
#[cfg(any(test, feature = "testing"))]
pub mod fake;
pub mod ffi;
pub mod library;
pub mod mooncake;

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

/// What the runtime needs from a transport. [`MooncakeTransferEngine`] is the
/// real one; unit tests of the state machine may use a test double.
pub trait Transport: Send + Sync + 'static {
    /// The local endpoint peers address (`ip:port`).
    fn endpoint(&self) -> &str;
    /// Submits a batch of WRITEs without waiting.
    fn submit_write(&self, peer: &str, ranges: &[WriteRange]) -> crate::TransportResult<BatchHandle>;
    /// Polls a batch; a terminal state releases it.
    fn poll(&self, handle: &mut BatchHandle) -> crate::TransportResult<BatchState>;
    /// Sends a notification to a peer.
    fn send_notification(&self, peer: &str, name: &str, message: &[u8]) -> crate::TransportResult<()>;
    /// Drains the notifications that arrived.
    fn take_notifications(&self) -> crate::TransportResult<Vec<Notification>>;
}

impl Transport for MooncakeTransferEngine {
    fn endpoint(&self) -> &str {
        MooncakeTransferEngine::endpoint(self)
    }
    fn submit_write(&self, peer: &str, ranges: &[WriteRange]) -> crate::TransportResult<BatchHandle> {
        MooncakeTransferEngine::submit_write(self, peer, ranges)
    }
    fn poll(&self, handle: &mut BatchHandle) -> crate::TransportResult<BatchState> {
        MooncakeTransferEngine::poll(self, handle)
    }
    fn send_notification(&self, peer: &str, name: &str, message: &[u8]) -> crate::TransportResult<()> {
        MooncakeTransferEngine::send_notification(self, peer, name, message)
    }
    fn take_notifications(&self) -> crate::TransportResult<Vec<Notification>> {
        MooncakeTransferEngine::take_notifications(self)
    }
}
