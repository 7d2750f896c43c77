//! The P/D request runtime (actix): one request actor per request and side,
//! a layer writer per peer, a notification router, and a completion poller.
//! The rules of the safety contract live in [`crate::fsm`], a pure state
//! machine under each request actor; the actors carry out its effects.
//!
//! * [`runtime::Runtime`]: the thread-safe façade the binding calls; it
//!   keeps no per-request state.
//! * [`directory`]: the `RequestDirectory`, the one actor that owns every
//!   per-request map of a rank (consumer actors, producer groups, what
//!   waits for its request to open).
//! * [`consumer`]: `ConsumerActor` (decode side); [`producer`]: `ProducerActor` (prefill side).
//! * [`writer`]: `LayerWriter` per peer, the completion poller.
//! * [`router`]: the `NotificationRouter`.
//! * [`publisher`]: the decode side's POSTs (handshakes, cancels, fences)
//!   and what their answers end, over the side channel's HTTP client.
//! * [`messages`]: every message, one struct each.
//! * [`gate`]: the layer marks: a GPU layer's write is submitted by its
//!   layer writer once the layer's kernels ran (a CUDA event), off any
//!   Python lock; no thread of its own.
//! * [`config`]: the runtime's settings and their checks.

pub mod config;
pub mod consumer;
pub mod directory;
pub mod gate;
pub mod messages;
pub mod preopen;
pub mod producer;
pub mod publisher;
pub mod router;
pub mod runtime;
pub mod stats;
pub mod writer;

pub use config::RuntimeSettings;
pub use messages::RuntimeEvent;
pub use runtime::{Runtime, RuntimeConfig};
pub use stats::StatsSnapshot;
