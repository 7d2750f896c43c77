//! OrbitKV: the core of a vLLM prefill/decode KV-transfer connector.
//!
//! The prefill worker streams each completed layer into the decode worker's KV
//! pages with Mooncake Transfer Engine batch WRITEs. OrbitKV owns the KV
//! layout and the per-request state machine; Mooncake moves the bytes.
//!
//! * [`transport`]: the native boundary over Mooncake (`MooncakeTransferEngine`).
//! * [`error`]: typed errors.

pub mod error;
pub mod transport;

pub use error::{TransportError, TransportResult};
pub use transport::{
    BatchHandle, BatchState, EngineConfig, MooncakeTransferEngine, Notification, Transport, WriteRange,
};
