//! The messages between the actors. Commands are imperative
//! (`WriteLayer`, `SendNotice`), events are facts in the past tense
//! (`LayerWritten`, `NoticeArrived`). Every event carries the request ID and
//! generation, so a stale one is dropped by rule.

use std::ops::Range;
use std::sync::Arc;

use actix::prelude::*;

use crate::ids::{Generation, ProducerRank, RequestId};
use crate::transport::WriteRange;
use crate::wire::{Handshake, Notice, Outcome};

use crate::fsm::WriteId;

// ---- to a producer request actor ----------------------------------------

/// A consumer's handshake for this request, validated against the local layout.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct HandshakeArrived(pub Arc<Handshake>);

/// Prefill finished `layer` for request blocks `blocks` (on a GPU: once
/// layer mark `after` is reached; 0: already written).
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct LayerReady {
    pub layer: u32,
    pub blocks: Range<u32>,
    pub after: crate::ids::MarkSeq,
}

/// A layer writer finished one admitted write.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct LayerWritten {
    pub request: Arc<RequestId>,
    pub write: WriteId,
    pub generation: Generation,
    pub bytes: u64,
    /// The write's range list, emptied, for the producer to plan into
    /// again (the per-layer path then allocates none).
    pub spare: Vec<WriteRange>,
    /// When its lane saw the GPU had computed the layer (`None`: never
    /// judged), for [`crate::Timing::ComputedAfterFinish`].
    pub computed: Option<std::time::Instant>,
    /// When its first batch went to Mooncake (`None`: nothing was sent,
    /// an empty write), for [`crate::Timing::SentAfterFinish`].
    pub first_sent: Option<std::time::Instant>,
}

/// A layer writer could not complete one admitted write.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct LayerWriteFailed {
    pub request: Arc<RequestId>,
    pub write: WriteId,
    pub generation: Generation,
    pub reason: String,
}

/// vLLM finished the request on the prefill side.
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct FinishRequest;

/// Stop the request.
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct AbortRequest {
    pub reason: String,
}

/// Give the request up if no consumer claimed it yet (no handshake came):
/// vLLM finished it on the prefill side and its blocks wait for a decode
/// that has not come, past the claim deadline or beyond the unclaimed cap
/// (the scheduler's `orbitkv.pd.claim_timeout_s`, `unclaimed_kv_share`,
/// `unclaimed_max_requests`). A claimed producer ignores it.
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct ReleaseUnclaimed {
    pub reason: String,
}

// ---- to the request directory -------------------------------------------

/// A producer request actor released `request` (every admitted write
/// drained). The directory folds the members of group `group` into one
/// `RuntimeEvent::ProducerReleased` (0: a producer of no group, passed on).
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct ProducerEnded {
    pub group: u64,
    pub request: RequestId,
    pub outcome: Outcome,
    pub reason: Option<String>,
}

// ---- to a consumer request actor ----------------------------------------

/// A producer's notice for this request (routed by request ID).
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct NoticeArrived(pub Notice);

/// What this (decode) rank learnt over its own side channel: producer rank
/// `rank` writes nothing (more) into `generation`'s blocks — it refused the
/// handshake or could not be reached, or it fenced the generation. Fed to
/// the machine as [`crate::fsm::ConsumerEvent::RankEnded`]; never made from
/// anything that arrives on Mooncake's port.
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct RankEnded {
    pub generation: Generation,
    pub rank: ProducerRank,
    pub outcome: Outcome,
    pub reason: String,
}

impl RankEnded {
    /// Producer rank `rank` refused the handshake of `generation` (or
    /// nobody received it): that rank failed, nothing from it can land.
    pub fn handshake_refused(generation: Generation, rank: u32, reason: &str) -> Self {
        Self {
            generation,
            rank: ProducerRank(rank),
            outcome: Outcome::Failed,
            reason: format!("producer rank {rank} refused the handshake: {reason}"),
        }
    }
}

/// A cancel's fence (rule 10): what may still be written into
/// `generation`'s blocks by this producer (`ProducerMachine::fence`), sent
/// to it after the cancel's `AbortRequest`; the answer goes to `reply`
/// (dropped unanswered when the producer was released already: then
/// nothing of it can land).
#[derive(Message, Debug, Clone)]
#[rtype(result = "()")]
pub struct FenceQuery {
    pub generation: Generation,
    pub reply: crossbeam_channel::Sender<crate::wire::Fence>,
}

/// vLLM is done with the request on the decode side.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct ReleaseRequest;

// ---- to a layer writer ---------------------------------------------------

/// Write these ranges to the writer's peer and report to `reply_to`.
#[derive(Message)]
#[rtype(result = "()")]
pub struct WriteLayer {
    pub request: Arc<RequestId>,
    pub write: WriteId,
    pub generation: Generation,
    pub layer: u32,
    pub ranges: Vec<WriteRange>,
    pub bytes: u64,
    /// The layer mark to wait for before the first batch is submitted
    /// (0: none).
    pub after: crate::ids::MarkSeq,
    /// The consumer's deadline (`Handshake::expires_unix_ms`, 0: none): a
    /// batch not yet submitted by then is not submitted.
    pub expires_unix_ms: u64,
    /// The producer actor that admitted it (`LayerWritten` or
    /// `LayerWriteFailed` go there).
    pub reply_to: ReplyTo,
}

/// Why a write was not submitted once the consumer's deadline passed.
pub const EXPIRED: &str =
    "the consumer's authorization expired (its deadline passed): nothing more is written";

/// Where a layer writer reports how a write ended: the producer actor that
/// admitted it. A shared handle made once per producer (cloning it
/// allocates nothing on the per-layer path), so that neither these
/// messages nor the writer depend on the producer's actor type.
pub trait WriteEnds: Send + Sync + 'static {
    fn written(&self, m: LayerWritten);
    fn failed(&self, m: LayerWriteFailed);
}

/// A producer's [`WriteEnds`], as each `WriteLayer` carries it.
pub type ReplyTo = Arc<dyn WriteEnds>;

/// Send a notice to the writer's peer (after the request's writes drained).
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct SendNotice(pub Notice);

/// The completion poller's verdict on one batch.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct BatchFinished {
    pub token: u64,
    pub result: Result<u64, String>,
    /// Given up at its deadline while Mooncake still held it (it may still
    /// read its sources).
    pub abandoned: bool,
}

// ---- to the notification router -----------------------------------------

/// Route notices for (`request`, `generation`) to `to`.
#[derive(Message)]
#[rtype(result = "()")]
pub struct RegisterConsumer {
    pub request: RequestId,
    pub generation: Generation,
    pub to: Recipient<NoticeArrived>,
}

/// Stop routing for (`request`, `generation`).
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct UnregisterConsumer {
    pub request: RequestId,
    pub generation: Generation,
}

/// Notifications drained from the transport.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct NotificationsTaken(pub Vec<crate::transport::Notification>);

// ---- from the actors to the façade --------------------------------------

/// How the actors hand [`RuntimeEvent`]s to the façade: each with when it
/// was sent, so the façade can time how long a completion waited to be
/// taken ([`crate::actors::stats::Timing::CompleteToTaken`]).
#[derive(Debug, Clone)]
pub struct EventSender(crossbeam_channel::Sender<(std::time::Instant, RuntimeEvent)>);

impl EventSender {
    pub fn new(tx: crossbeam_channel::Sender<(std::time::Instant, RuntimeEvent)>) -> Self {
        Self(tx)
    }

    /// Sends `ev`, stamped now; `false` once the façade is gone.
    pub fn send(&self, ev: RuntimeEvent) -> bool {
        self.0.send((std::time::Instant::now(), ev)).is_ok()
    }
}

/// What the runtime tells its user (the vLLM connector) happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuntimeEvent {
    /// Decode side: every producer reported done; the KV is in place.
    ConsumerCompleted {
        request: RequestId,
        generation: Generation,
        bytes: u64,
        /// Producers that wrote into the request's staging grant: the
        /// consumer must scatter it into the pages before the KV is used.
        staged: Option<crate::staging::StagedKv>,
    },
    /// Decode side: the KV will not be complete (failure, abort, timeout).
    /// `held`: at the deadline, with a producer that never ended: its writes
    /// may still land, so the blocks must not be reused (recomputed or
    /// freed) before `ConsumerQuiesced` or `ConsumerReleased`.
    ConsumerFailed {
        request: RequestId,
        generation: Generation,
        reason: String,
        held: bool,
    },
    /// Decode side, after a `held` failure: every producer ended, or the
    /// quarantine passed; the blocks may be recomputed.
    ConsumerQuiesced {
        request: RequestId,
        generation: Generation,
    },
    /// Decode side: no producer can write into the blocks any more.
    ConsumerReleased {
        request: RequestId,
        generation: Generation,
    },
    /// Prefill side: every admitted write drained; source blocks may be freed.
    ProducerReleased {
        request: RequestId,
        outcome: Outcome,
        reason: Option<String>,
    },
}

/// Whether a request's prefill pages may go back to vLLM before its writes
/// ended (`Runtime::producer_give_back_pages`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PagesBack {
    /// Given up by this call: nothing reads them from now on.
    Now,
    /// Given up by an earlier call.
    Before,
    /// Still read or may be (a member not finished, a layer without a piece
    /// not written yet, a write reading them now, decode's authorization not
    /// known and not every one so far took the pieces): ask again later.
    NotYet,
    /// Never before the release: the request is not staged by layer, was
    /// released, its group ended, or a member's authorization (final once
    /// it finished) is written from the pages. Asking again is pointless.
    Never,
}

impl PagesBack {
    /// Whether the pages are given up (now or before).
    pub fn gone(self) -> bool {
        matches!(self, Self::Now | Self::Before)
    }
}
