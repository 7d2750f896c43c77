//! The decode side's actors: what receives a request's KV.
//!
//! * [`consumer`]: `ConsumerActor`, one per request (its machine,
//!   [`crate::fsm::consumer`]).
//! * [`router`]: the `NotificationRouter`, which drains Mooncake's
//!   notifications and routes each notice to its consumer.
//! * [`publisher`]: the POSTs of handshakes, cancels and fences to the
//!   prefill ranks, and what their answers end.

pub mod consumer;
pub mod publisher;
pub mod router;
