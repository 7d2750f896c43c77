//! The prefill side's actors: what sends a request's KV.
//!
//! * [`producer`]: `ProducerActor`, one per request and decode rank it
//!   sends to (its machine, [`crate::fsm::producer`]), and the group's
//!   source blocks and layer pieces (`SourceBlocks`).
//! * [`writer`]: `LayerWriter` lanes per peer (Mooncake batch WRITEs and
//!   notices) and the completion poller.
//! * [`gate`]: the layer marks a GPU layer's write waits for.
//! * [`gather`]: a lane's gather of a computed layer's scattered source
//!   bytes into one piece of the source staging region, written from there.
//! * [`preopen`]: handshakes, cancels and discards that arrive before
//!   their request opens here (owned by the request directory).

pub mod gate;
pub mod gather;
pub mod preopen;
pub mod producer;
pub mod writer;
