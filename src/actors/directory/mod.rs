//! The request directory: the one actor that knows which requests live on
//! this rank. It owns every per-request map — the consumer actors by
//! request ID, the producer groups, and what arrived before a request
//! opened on prefill ([`PreOpen`]: parked handshakes, early cancels,
//! discards) — and nothing outside it writes them. The façade
//! ([`super::runtime::Runtime`]) validates what needs no state, then hands
//! the rest to this actor as a [`Call`] and, for the calls whose answer the
//! caller needs, waits for it. One thing is published for others to read:
//! the [`ProducerIndex`], request ID → the open producer group's members,
//! which the façade looks layer hand-overs up in (they go to the producer
//! actors themselves, see [`super::prefill::producer`]); the directory alone
//! publishes and withdraws its groups, in step with its own map, before it
//! answers the call that changed it (the façade only reads it, and closes
//! it at shutdown).
//!
//! Because one actor handles every open, handshake, cancel, discard and
//! release of this rank, one after another, no two of them can interleave:
//! a cancel that races an open is seen either before it (remembered in
//! [`PreOpen`], taken up by the open) or after it (the open group is
//! aborted), never in between. The request actors it starts own each
//! request's authorization, generation and expected producers
//! ([`super::decode::consumer`], [`super::prefill::producer`]); a producer group's releases
//! come back here ([`ProducerEnded`]) and leave as one
//! `RuntimeEvent::ProducerReleased` once the last member released.
//!
//! By side: this file holds the actor, its maps and what both sides share;
//! `decode.rs` the consumers' opens, publications and releases; `prefill.rs`
//! the producer groups, the [`ProducerIndex`], opens, handshakes, cancels,
//! discards and releases.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use actix::prelude::*;

use super::config::RuntimeConfig;
use super::decode::consumer::{ConsumerActor, ConsumerStaging, FenceTargets, Published};
use super::decode::publisher::Publisher;
use super::decode::router::NotificationRouter;
use super::messages::*;
use super::prefill::preopen::{Parked, PreOpen, PreOpenLimits};
use super::prefill::producer::{ProducerActor, ProducerRef, ProducerShared, SourceBlocks};
use super::stats::Stats;
use crate::error::{GeometryError, RuntimeError};
use crate::fsm::ConsumerMachine;
use crate::ids::{Capability, Generation, ProducerRank, RequestId, Sequence};
use crate::layout::KvLayout;
use crate::staging::arena::StagingArena;
use crate::staging::{grant_group, page_runs, staged_bytes, SharedArena, SourceKind, StagingGrant};
use crate::wire::{Cancel, Fence, Handshake, Outcome};

/// Work for the directory, run on its thread in arrival order (the façade's
/// calls; see [`super::runtime::Runtime`]). A call that answers carries its
/// own reply channel.
pub struct Call(pub Box<dyn DirectoryWork>);

/// What a [`Call`] runs: one step on the directory's state.
pub trait DirectoryWork: FnOnce(&mut RequestDirectory, &mut Context<RequestDirectory>) + Send {}
impl<F: FnOnce(&mut RequestDirectory, &mut Context<RequestDirectory>) + Send> DirectoryWork for F {}

impl Message for Call {
    type Result = ();
}

mod decode;
mod prefill;

use prefill::ProducerGroup;
pub use prefill::ProducerIndex;

/// The request directory of one rank (see the module's documentation).
pub struct RequestDirectory {
    /// The rank's layout, writers and counters, shared with its producers.
    shared: Arc<ProducerShared>,
    cfg: RuntimeConfig,
    router: Addr<NotificationRouter>,
    events: crate::actors::messages::EventSender,
    /// The sequence of the last authorization given (see
    /// [`Sequence::next_after`]).
    last_sequence: Sequence,
    next_group: u64,
    consumers: HashMap<RequestId, (Generation, Addr<ConsumerActor>)>,
    producers: HashMap<RequestId, ProducerGroup>,
    /// What of `producers` the façade reads (kept in step with it).
    index: ProducerIndex,
    /// Groups replaced under their request ID (a new open after every
    /// member had stopped) whose releases are still on their way, by token.
    ending: HashMap<u64, ProducerGroup>,
    pre_open: PreOpen,
    /// Decode side: where staging grants come from (`cfg.staging_region`).
    staging: Option<SharedArena>,
    /// Decode side: sends a consumer's fences (its actor holds it).
    publisher: Arc<Publisher>,
    /// Prefill side: requests whose producer group ended here lately, with
    /// their capability (at most [`RECENT`], oldest forgotten first): a
    /// cancel for one is answered (fenced, or `403` without its capability)
    /// rather than remembered for an open that will not come.
    recent: HashMap<RequestId, Capability>,
    recent_order: std::collections::VecDeque<RequestId>,
}

/// How many ended requests the directory remembers (see `recent`).
pub const RECENT: usize = 4096;

/// What a cancel gets from the directory: the answer, or the producer that
/// will give it once it handled the abort.
pub enum CancelReply {
    Now(Option<Fence>),
    /// The producer of the consumer's rank answers (dropped unanswered: it
    /// was released, so nothing of it can land any more).
    Later(crossbeam_channel::Receiver<Fence>),
}

impl RequestDirectory {
    /// The directory of a rank whose producers share `shared`, sending its
    /// events to `events`.
    pub fn new(
        shared: Arc<ProducerShared>,
        cfg: RuntimeConfig,
        router: Addr<NotificationRouter>,
        events: crate::actors::messages::EventSender,
        index: ProducerIndex,
        publisher: Arc<Publisher>,
    ) -> Self {
        let pre_open = PreOpen::new(PreOpenLimits {
            ttl: cfg.handshake_timeout,
            max_entries: cfg.max_parked,
            max_bytes: cfg.max_parked_bytes,
            max_entries_per_source: cfg.parked_per_source(),
            max_bytes_per_source: cfg.parked_bytes_per_source(),
            ..PreOpenLimits::default()
        });
        // `Runtime::start` refused a region the arena cannot take.
        let staging = cfg.staging_region.and_then(|(base, len)| {
            StagingArena::new(base, len)
                .map(|a| Arc::new(parking_lot::Mutex::new(a)))
                .ok()
        });
        Self {
            staging,
            shared,
            cfg,
            router,
            events,
            last_sequence: Sequence(0),
            next_group: 1,
            consumers: HashMap::new(),
            producers: HashMap::new(),
            index,
            ending: HashMap::new(),
            pre_open,
            publisher,
            recent: HashMap::new(),
            recent_order: Default::default(),
        }
    }

    /// Requests with a live actor on either side (for leak checks).
    pub fn live_requests(&self) -> (usize, usize) {
        let c = self.consumers.values().filter(|(_, a)| a.connected()).count();
        let p = self.producers.values().filter(|g| g.live()).count();
        (c, p)
    }
}
/// A request's layer index must exist in this rank's layout.
pub fn check_layer(local: &KvLayout, layer: u32) -> Result<(), RuntimeError> {
    if layer as usize >= local.layers.len() {
        return Err(GeometryError::LayerOutOfRange {
            layer,
            num_layers: local.layers.len(),
        }
        .into());
    }
    Ok(())
}
impl Actor for RequestDirectory {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // Parked handshakes expire on a timer, not only when the next one
        // comes: an idle prefill must not keep a flood's memory.
        let every = (self.cfg.handshake_timeout / 4).clamp(
            std::time::Duration::from_millis(10),
            std::time::Duration::from_secs(1),
        );
        ctx.run_interval(every, |d, _| {
            let n = d.pre_open.expire(actix::clock::Instant::now());
            d.shared.stats.parked_expired.add(n as u64);
        });
        // Idle peers' writer lanes and segments are reclaimed on a timer
        // too: a prefill no decode endpoint writes to any more keeps none.
        let every = (self.cfg.peer_idle_reclaim / 4).clamp(
            std::time::Duration::from_millis(10),
            std::time::Duration::from_secs(1),
        );
        ctx.run_interval(every, |d, _| {
            d.shared.writers.reclaim_idle(std::time::Instant::now());
        });
    }
}

impl Handler<Call> for RequestDirectory {
    type Result = ();
    fn handle(&mut self, msg: Call, ctx: &mut Context<Self>) {
        (msg.0)(self, ctx)
    }
}
