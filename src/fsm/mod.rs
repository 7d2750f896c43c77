//! The pure state machines under the request actors: no I/O, no clocks, no
//! actix. Each actor feeds its machine events and carries out the effects it
//! returns, so every rule of the safety contract is a plain unit test here.
//!
//! The contract (numbered as in `docs/architecture.md`):
//! 1. The destination advertises only ranges allocated for the request —
//!    a producer plans writes only from the handshake it captured, and only
//!    into that handshake's authorized blocks.
//! 2. A transfer notification is accepted only for the matching request ID
//!    (and generation): others are dropped and counted, never delivered.
//!    And (2a) only with its tag under the authorization's notice key
//!    (`Notice::authentic`, `Handshake::notice_key`): a notice anyone else
//!    made — the client that holds the request's capability included — is
//!    dropped and counted, whatever request ID and generation it names.
//! 3. The decode side waits for the expected number of producer notifications.
//! 4. Failure/abort notifications never publish the destination as complete.
//! 5. Queued writes carry the generation and the captured authorization;
//!    reusing a request ID cannot redirect an old write into new pages.
//!    Chunks share a generation only while authorization and mapping are
//!    unchanged (a changed handshake under the same generation is refused).
//! 6. Producer release waits for admitted writes to drain, also after
//!    another write reported an error.
//! 7. A producer says `done` only when every layer of every authorized
//!    request block was reported.
//! 10. The cancel is a fence: a consumer released by vLLM while producers
//!     had not ended asks each one (`ConsumerEffect::Fence`); a producer
//!     answers `Fenced` only when nothing can be written into that
//!     generation's blocks any more (`ProducerMachine::fence`), and only
//!     that answer ends the rank before its notice or the quarantine.
//!
//! [`consumer`] holds the decode side's machine (rules 2, 3, 4 and the
//! release half of 6), [`producer`] the prefill side's (rules 1, 5, 6, 7).

pub mod consumer;
pub mod producer;

pub use consumer::{ConsumerEffect, ConsumerEvent, ConsumerMachine, ConsumerPhase};
pub use producer::{ProducerEffect, ProducerEvent, ProducerMachine, ProducerPhase, WriteId};

use crate::ids::{Generation, ProducerRank};

/// Why an event was dropped instead of acted on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dropped {
    /// Carries another generation than the one authorized.
    StaleGeneration { got: Generation, current: Generation },
    /// A producer rank that does not feed this consumer rank.
    UnexpectedRank(ProducerRank),
    /// The same producer reported twice.
    Duplicate(ProducerRank),
    /// The request already reached a terminal outcome.
    AfterTerminal,
    /// A write completion the producer never admitted.
    UnknownWrite(u64),
    /// A handshake under the current generation that changes the authorization.
    AuthorizationChanged,
    /// A handshake of another generation whose sequence is not after the
    /// captured one's (`Handshake::supersedes`): an older authorization
    /// arriving late.
    OlderHandshake { got: Generation, current: Generation },
    /// A notice without the tag of its authorization's notice key (forged:
    /// made by a peer that was never sent the handshake, such as a client
    /// that holds the request's capability).
    Unauthenticated(ProducerRank),
    /// A notice that names another request.
    OtherRequest,
}

/// What the machines' unit tests share.
#[cfg(test)]
pub(crate) mod test_support {
    use std::sync::Arc;

    use crate::ids::Generation;
    use crate::ids::{NoticeKey, RequestId, Sequence};
    use crate::layout::tests::layout;
    use crate::wire::{Handshake, WIRE_VERSION};

    pub(crate) fn rid() -> RequestId {
        RequestId::new("r1")
    }

    /// The notice key of the tests' handshakes.
    pub(crate) fn notice_key() -> NoticeKey {
        NoticeKey::parse(&"4b".repeat(32)).unwrap()
    }

    pub(crate) fn hs(generation: u64, blocks: Vec<u32>) -> Arc<Handshake> {
        hs_layers(generation, blocks, 2)
    }

    /// A handshake of a model with `layers` layers; its sequence is its
    /// generation's value (a test of order set them apart).
    pub(crate) fn hs_layers(generation: u64, blocks: Vec<u32>, layers: u32) -> Arc<Handshake> {
        Arc::new(Handshake {
            tokens: 0,
            version: WIRE_VERSION,
            request_id: rid(),
            capability: crate::ids::Capability::parse(&"c".repeat(32)).unwrap(),
            generation: Generation(generation),
            sequence: Sequence(generation),
            notice_key: notice_key(),
            endpoint: "127.0.0.1:1000".into(),
            expected_producers: 1,
            first_block: 0,
            block_ids: blocks,
            layout: layout(0x10_0000, layers, 8, 256, (0, 1), 2),
            expires_unix_ms: 0,
            staging: None,
        })
    }
}
