//! The P/D request runtime (actix): one request actor per request and side,
//! a layer writer per peer, a notification router, and a completion poller.
//! The rules of the safety contract live in [`crate::fsm`], a pure state
//! machine under each request actor; the actors carry out its effects.
//!
//! By role:
//!
//! * [`prefill`]: what sends. [`prefill::producer`]: `ProducerActor` (and
//!   the layer pieces of its source staging); [`prefill::writer`]: the
//!   `LayerWriter` lanes per peer and the completion poller;
//!   [`prefill::gate`]: the layer marks (a GPU layer's write is submitted
//!   once its kernels ran, a CUDA event; no thread of its own);
//!   [`prefill::preopen`]: what waits for its request to open (handshakes,
//!   cancels, discards), owned by the directory.
//! * [`decode`]: what receives. [`decode::consumer`]: `ConsumerActor`;
//!   [`decode::router`]: the `NotificationRouter`; [`decode::publisher`]:
//!   the POSTs of handshakes, cancels and fences (through a
//!   `SideChannelPost` the runtime is given: no HTTP here) and what their
//!   answers end.
//! * Shared: [`runtime::Runtime`], the thread-safe façade the binding calls
//!   (no per-request state); [`directory`], the `RequestDirectory`, the one
//!   actor that owns every per-request map of a rank, both sides (its
//!   calls split by side: `directory/decode.rs`, `directory/prefill.rs`);
//!   [`messages`]: every message, one struct each (and the handles the
//!   sides report through); [`config`]: the runtime's settings and their
//!   checks; [`stats`]: the counters; [`cell`]: `ActorCell`, the one
//!   execution model of the producer and the writer (an actor whose
//!   message may run on its sender's thread) and its lock rules.

pub mod cell;
pub mod config;
pub mod decode;
pub mod directory;
pub mod messages;
pub mod prefill;
pub mod runtime;
pub mod stats;

pub use config::RuntimeSettings;
pub use messages::{PagesBack, RuntimeEvent};
pub use runtime::{GatherCopy, Runtime, RuntimeConfig};
pub use stats::StatsSnapshot;
