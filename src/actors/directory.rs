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

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use actix::prelude::*;
use crossbeam_channel::Sender;

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

/// The open producer groups' members by request ID, published by the
/// directory for the façade to read (see the module's documentation): the
/// directory alone publishes and withdraws a group (these methods are
/// private to this module); the façade reads ([`Self::live_group`]) and, at
/// shutdown, closes it ([`Self::close`]: no group is found after that,
/// whatever the directory still holds).
#[derive(Clone, Default)]
pub struct ProducerIndex(Arc<parking_lot::RwLock<IndexState>>);

#[derive(Default)]
struct IndexState {
    groups: HashMap<RequestId, Arc<[ProducerRef]>>,
    closed: bool,
}

/// Whether a producer group still acts: one of its members' actors runs.
/// The one definition of a live group, for the façade's reads of the index
/// and the directory's own groups.
fn any_running(members: impl IntoIterator<Item = impl std::borrow::Borrow<ProducerRef>>) -> bool {
    members.into_iter().any(|m| m.borrow().connected())
}

impl ProducerIndex {
    /// The open group of `request` while one of its actors still runs (the
    /// directory withdraws a group when its last member released).
    pub fn live_group(&self, request: &RequestId) -> Option<Arc<[ProducerRef]>> {
        let published = self.0.read();
        if published.closed {
            return None;
        }
        let group = published.groups.get(request)?;
        any_running(group.iter()).then(|| group.clone())
    }

    /// No group is found from now on (the runtime is shutting down).
    pub fn close(&self) {
        self.0.write().closed = true;
    }

    fn publish(&self, request: RequestId, members: Arc<[ProducerRef]>) {
        self.0.write().groups.insert(request, members);
    }

    fn withdraw(&self, request: &RequestId) {
        self.0.write().groups.remove(request);
    }
}

/// The producer side of one request on this rank: a `ProducerActor` per
/// consumer (decode) rank it sends to — one when the TP sizes are equal or
/// decode's is smaller, several when decode's is larger (each decode rank
/// holds its own copy of some of this rank's heads) — opened together,
/// driven together, reported released once all are.
struct ProducerGroup {
    /// This group's token: its members' releases name it, so a release of
    /// an earlier group under the same request ID is never counted here.
    token: u64,
    capability: Capability,
    consumer_tp: u32,
    /// The request's source block list, as validated: the one list, which
    /// every member reads and `producer_add_blocks` appends to.
    src_blocks: SourceBlocks,
    /// (consumer rank, its actor)
    members: Vec<(u32, ProducerRef)>,
    /// Members not yet released, and how the released ones ended (the worst
    /// outcome wins: failed, then aborted, then done).
    pending: usize,
    outcome: Option<(Outcome, Option<String>)>,
}

impl ProducerGroup {
    fn live(&self) -> bool {
        self.pending > 0 && any_running(self.members.iter().map(|(_, a)| a))
    }

    fn send<M>(&self, msg: M)
    where
        M: Message + Send + Clone + 'static,
        M::Result: Send,
        ProducerActor: Handler<M>,
    {
        for (_, a) in &self.members {
            a.send(msg.clone());
        }
    }

    fn member(&self, consumer_rank: u32) -> Option<&ProducerRef> {
        self.members
            .iter()
            .find(|(c, _)| *c == consumer_rank)
            .map(|(_, a)| a)
    }

    /// Folds one member's release in; the group's outcome once it was the
    /// last one.
    fn ended(&mut self, outcome: Outcome, reason: Option<String>) -> Option<(Outcome, Option<String>)> {
        let rank = |o: Outcome| match o {
            Outcome::Done => 0,
            Outcome::Aborted => 1,
            Outcome::Failed => 2,
        };
        if self
            .outcome
            .as_ref()
            .map_or(true, |(o, _)| rank(outcome) > rank(*o))
        {
            self.outcome = Some((outcome, reason));
        }
        self.pending = self.pending.saturating_sub(1);
        if self.pending > 0 {
            return None;
        }
        self.outcome.take()
    }
}

/// The request directory of one rank (see the module's documentation).
pub struct RequestDirectory {
    /// The rank's layout, writers and counters, shared with its producers.
    shared: Arc<ProducerShared>,
    cfg: RuntimeConfig,
    router: Addr<NotificationRouter>,
    events: Sender<RuntimeEvent>,
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
        events: Sender<RuntimeEvent>,
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

    // ---- decode side ----------------------------------------------------

    /// [`super::runtime::Runtime::consumer_open`], after its stateless
    /// checks: `handshake` is built and validated (its notice key drawn)
    /// but for its generation and sequence, which are the directory's to
    /// give; `expected` are the producer ranks it names
    /// (`expected_producers` of them).
    ///
    /// The generation is random ([`Generation::random`]), so it orders
    /// nothing; the sequence does ([`Sequence::next_after`], strictly
    /// increasing over this rank's authorizations), and is used for that
    /// only: a producer takes up a re-authorization of a request ID (a
    /// reused one) in place of the one it holds because its sequence is
    /// greater, whatever order the two handshakes arrive in.
    pub fn consumer_open(
        &mut self,
        mut handshake: Handshake,
        expected: BTreeSet<ProducerRank>,
        producer_tp: u32,
    ) -> Result<Handshake, RuntimeError> {
        let request = handshake.request_id.clone();
        if self.consumers.get(&request).is_some_and(|(_, a)| a.connected()) {
            return Err(RuntimeError::DuplicateRequest(request.0));
        }
        let generation = Generation::random();
        let sequence = Sequence::next_after(self.last_sequence);
        self.last_sequence = sequence;
        (handshake.generation, handshake.sequence) = (generation, sequence);
        let staging = self.grant_staging(&handshake, producer_tp).map(|(grant, arena)| {
            handshake.staging = Some(grant);
            ConsumerStaging {
                grant,
                arena,
                blocks: handshake.block_ids.len() as u32,
                producer_tp,
                layout: self.shared.local.clone(),
            }
        });
        let capability = handshake.capability.clone();
        let machine = ConsumerMachine::new(
            request.clone(),
            generation,
            expected,
            handshake.notice_key.clone(),
        );
        let actor = ConsumerActor::new(
            machine,
            (self.cfg.consumer_timeout, self.cfg.quarantine),
            self.router.clone(),
            self.events.clone(),
            self.shared.stats.clone(),
            staging,
            FenceTargets {
                publisher: self.publisher.clone(),
                capability,
                consumer_rank: self.shared.local.tp_rank,
                targets: Vec::new(),
            },
        );
        // Routed before the handshake leaves the runtime (below), so no
        // notice can arrive before its route exists.
        let addr = actor.start_routed();
        self.consumers.insert(request, (generation, addr));
        Ok(handshake)
    }

    /// A staging grant for `handshake`'s blocks, when this rank stages and
    /// writing its pages directly would take at least `staging_min_ranges`
    /// ranges per layer: one per run of blocks consecutive in memory and
    /// plane ([`page_runs`]: padded blocks are never consecutive), or one
    /// per block and plane when a producer of another TP size writes head
    /// slices, unless each block is a whole group of one producer's source
    /// staging ([`grant_group`]: that producer writes runs of whole blocks
    /// from it). The grant is staged in [`grant_group`]'s order. `None`
    /// when the arena is full (counted; the request is written directly).
    fn grant_staging(&self, handshake: &Handshake, producer_tp: u32) -> Option<(StagingGrant, SharedArena)> {
        let arena = self.staging.as_ref()?;
        let local = &self.shared.local;
        if local.groups() > 1 {
            // Staged orders are by request block of one table: a layout of
            // several groups is written into its pages.
            return None;
        }
        let ids = &handshake.block_ids;
        let planes = local.layers.first().map_or(1, |l| l.planes.len());
        let group = grant_group(local, producer_tp);
        let ranges = if producer_tp != local.tp_size && local.head_major && group == 1 {
            ids.len() * planes
        } else {
            page_runs(local, ids)
        };
        if ranges < self.cfg.staging_min_ranges {
            return None;
        }
        let len = staged_bytes(local, ids.len() as u32)?;
        match arena.lock().alloc(len) {
            Ok(base) => {
                self.shared.stats.staging_granted.inc();
                Some((StagingGrant { base, len, group }, arena.clone()))
            }
            Err(e) => {
                self.shared.stats.staging_exhausted.inc();
                tracing::debug!(error = %e, "no staging grant: writing the pages directly");
                None
            }
        }
    }

    /// Bytes and pieces of staging granted now (decode side).
    pub fn staging_in_use(&self) -> (u64, usize) {
        self.staging.as_ref().map_or((0, 0), |a| {
            let a = a.lock();
            (a.used_bytes(), a.pieces())
        })
    }

    /// The consumer actor of `request`'s authorization `generation`.
    pub fn consumer(
        &self,
        request: &RequestId,
        generation: Generation,
    ) -> Result<Addr<ConsumerActor>, RuntimeError> {
        match self.consumers.get(request) {
            Some((g, addr)) if *g == generation => Ok(addr.clone()),
            Some((g, _)) => Err(RuntimeError::StaleGeneration {
                request: request.0.clone(),
                got: generation.0,
                current: g.0,
            }),
            None => Err(RuntimeError::UnknownRequest(request.0.clone())),
        }
    }

    /// The consumer of `request`'s `generation`, told where its handshake
    /// was published (where its fence would go).
    pub fn consumer_published(
        &self,
        request: &RequestId,
        generation: Generation,
        targets: Vec<(String, u32)>,
    ) -> Result<Addr<ConsumerActor>, RuntimeError> {
        let addr = self.consumer(request, generation)?;
        addr.do_send(Published(targets));
        Ok(addr)
    }

    /// [`super::runtime::Runtime::consumer_release`].
    pub fn consumer_release(&mut self, request: &RequestId) -> Result<(), RuntimeError> {
        let (_, addr) = self
            .consumers
            .remove(request)
            .ok_or_else(|| RuntimeError::UnknownRequest(request.0.clone()))?;
        addr.do_send(ReleaseRequest);
        Ok(())
    }

    // ---- prefill side ---------------------------------------------------

    /// [`super::runtime::Runtime::producer_open`], after its stateless checks.
    pub fn producer_open(
        &mut self,
        request: RequestId,
        src_blocks: Vec<u32>,
        capability: Capability,
        consumer_tp: u32,
        staging: Option<SourceKind>,
        ctx: &mut Context<Self>,
    ) -> Result<(), RuntimeError> {
        if self.producers.get(&request).is_some_and(ProducerGroup::live) {
            return Err(RuntimeError::DuplicateRequest(request.0));
        }
        let total = self.shared.local.total_kv_heads;
        let targets: Vec<u32> = (0..consumer_tp)
            .filter(|&c| {
                crate::layout::producer_ranks_for(total, c, consumer_tp, self.shared.local.tp_size)
                    .contains(&self.shared.local.tp_rank)
            })
            .collect();
        let taken = self.pre_open.take(&request, &capability);
        self.shared
            .stats
            .side_channel_forbidden
            .add(taken.strangers as u64);
        if targets.is_empty() {
            let _ = self.events.send(RuntimeEvent::ProducerReleased {
                request,
                outcome: Outcome::Done,
                reason: Some("this rank holds only replicas of heads a lower rank sends".into()),
            });
            return Ok(());
        }
        let token = self.next_group;
        self.next_group += 1;
        let src_blocks = SourceBlocks::new(src_blocks);
        let members: Vec<_> = targets
            .iter()
            .map(|&c| {
                (
                    c,
                    self.start_producer(&request, src_blocks.clone(), staging, token, ctx),
                )
            })
            .collect();
        if let (Some(SourceKind::ByLayer { .. }), Some(arena)) = (staging, &self.shared.source_arena) {
            src_blocks.stage_by_layer(arena.clone(), members.len() as u32);
        }
        let group = ProducerGroup {
            token,
            capability,
            consumer_tp,
            src_blocks,
            pending: members.len(),
            members,
            outcome: None,
        };
        for h in taken.handshakes {
            match group.member(h.layout.tp_rank) {
                Some(a) if h.layout.tp_size == consumer_tp => a.send(HandshakeArrived(h)),
                _ => self.shared.stats.events_dropped.inc(),
            }
        }
        if let Some(reason) = taken.cancel {
            // No consumer will send a handshake: release at once instead of
            // holding the source blocks until the deadline.
            group.send(AbortRequest { reason });
        }
        let members: Arc<[ProducerRef]> = group.members.iter().map(|(_, a)| a.clone()).collect();
        self.index.publish(request.clone(), members);
        if let Some(old) = self.producers.insert(request, group) {
            if old.pending > 0 {
                self.ending.insert(old.token, old);
            }
        }
        Ok(())
    }

    /// A producer actor for `request`, reporting its release to this
    /// directory under group `token` (0: a producer of no group).
    fn start_producer(
        &self,
        request: &RequestId,
        src_blocks: SourceBlocks,
        staging: Option<SourceKind>,
        token: u64,
        ctx: &mut Context<Self>,
    ) -> ProducerRef {
        ProducerRef::start(
            request.clone(),
            src_blocks,
            staging,
            self.shared.clone(),
            (token, ctx.address().recipient()),
        )
    }

    /// [`super::runtime::Runtime::producer_cancel`]. With a generation the
    /// cancel is a fence (rule 10), answered for that generation and the
    /// consumer's rank; without one it answers nothing.
    /// `source`: the peer it came from (its per-source budget,
    /// `super::prefill::preopen`); `None`: the process itself.
    pub fn producer_cancel(
        &mut self,
        cancel: &Cancel,
        source: Option<IpAddr>,
    ) -> Result<CancelReply, RuntimeError> {
        let request = &cancel.request_id;
        let reason = format!("cancelled by the consumer: {}", cancel.reason);
        let fenced = cancel.generation.map(|_| Fence::Fenced);
        match self.producers.get(request) {
            Some(group) if group.live() => {
                check_capability(&self.shared.stats, request, &group.capability, &cancel.capability)?;
                group.send(AbortRequest {
                    reason: reason.clone(),
                });
                // Refuses a later open of the request under this capability
                // (and a handshake parked for it), so that nothing takes up
                // the fenced generation after this answer.
                let remembered = self.pre_open.cancel(request, &cancel.capability, reason, source);
                let (Some(generation), Some(rank)) = (cancel.generation, cancel.consumer_rank) else {
                    return Ok(CancelReply::Now(None));
                };
                if remembered.is_err() {
                    self.shared.stats.side_channel_overloaded.inc();
                    return Ok(CancelReply::Now(Some(Fence::Held)));
                }
                match group.member(rank) {
                    // This rank sends nothing to that consumer rank.
                    None => Ok(CancelReply::Now(fenced)),
                    Some(member) => {
                        let (tx, rx) = crossbeam_channel::bounded(1);
                        member.send(FenceQuery {
                            generation,
                            reply: tx,
                        });
                        Ok(CancelReply::Later(rx))
                    }
                }
            }
            _ => {
                if let Some(own) = self.recent.get(request) {
                    // Ended here: every producer released, every write drained.
                    check_capability(&self.shared.stats, request, own, &cancel.capability)?;
                    return Ok(CancelReply::Now(fenced));
                }
                // Not open yet: remembered, so the open is aborted at once
                // and a handshake parked or arriving under this capability
                // is answered `aborted`.
                self.pre_open
                    .cancel(request, &cancel.capability, reason, source)
                    .inspect_err(|_| self.shared.stats.side_channel_overloaded.inc())?;
                Ok(CancelReply::Now(fenced))
            }
        }
    }

    /// Remembers that `request`'s producer group (under `capability`) ended.
    fn remember_ended(&mut self, request: RequestId, capability: Capability) {
        if self.recent.insert(request.clone(), capability).is_none() {
            self.recent_order.push_back(request);
            while self.recent_order.len() > RECENT {
                if let Some(old) = self.recent_order.pop_front() {
                    self.recent.remove(&old);
                }
            }
        }
    }

    /// [`super::runtime::Runtime::producer_add_blocks`].
    pub fn producer_add_blocks(&mut self, request: &RequestId, blocks: Vec<u32>) -> Result<(), RuntimeError> {
        let Some(group) = self.producers.get_mut(request).filter(|g| g.live()) else {
            return Err(RuntimeError::UnknownRequest(request.0.clone()));
        };
        // Before this answers: the layers handed over after it plan with them.
        let local = &self.shared.local;
        group
            .src_blocks
            .try_append(&blocks, local.groups(), |all| local.validate_blocks(all))?;
        Ok(())
    }

    /// [`super::runtime::Runtime::producer_handshake`], after its stateless
    /// checks (format, geometry, the expected producer count); `source`: the
    /// peer it came from (its per-source budget if it is parked), `None`:
    /// the process itself.
    pub fn producer_handshake(
        &mut self,
        h: Arc<Handshake>,
        source: Option<IpAddr>,
        ctx: &mut Context<Self>,
    ) -> Result<(), RuntimeError> {
        match self.producers.get(&h.request_id) {
            Some(group) if group.live() => {
                check_capability(
                    &self.shared.stats,
                    &h.request_id,
                    &group.capability,
                    &h.capability,
                )?;
                if h.layout.tp_size != group.consumer_tp {
                    return Err(GeometryError::TensorParallel(format!(
                        "the consumer has TP size {}, but the request's orbitkv_decode_tp says {}",
                        h.layout.tp_size, group.consumer_tp
                    ))
                    .into());
                }
                let Some(addr) = group.member(h.layout.tp_rank) else {
                    return Err(GeometryError::TensorParallel(format!(
                        "this rank does not send to consumer rank {}",
                        h.layout.tp_rank
                    ))
                    .into());
                };
                addr.send(HandshakeArrived(h));
                Ok(())
            }
            _ => {
                let parked = self.pre_open.park(h.clone(), source);
                match parked.inspect_err(|_| self.shared.stats.side_channel_overloaded.inc())? {
                    Parked::Waiting | Parked::Stale => {}
                    Parked::Discarded(reason) => self.answer_aborted(h, reason, ctx),
                }
                Ok(())
            }
        }
    }

    /// [`super::runtime::Runtime::producer_discard`].
    pub fn producer_discard(
        &mut self,
        request: &RequestId,
        capability: &Capability,
        reason: &str,
        ctx: &mut Context<Self>,
    ) -> Result<(), RuntimeError> {
        if self.producers.get(request).is_some_and(ProducerGroup::live) {
            return Err(RuntimeError::DuplicateRequest(request.0.clone()));
        }
        let reason = format!("prefill gave the request up: {reason}");
        for h in self.pre_open.discard(request, capability, reason.clone())? {
            self.answer_aborted(h, reason.clone(), ctx);
        }
        Ok(())
    }

    /// Tells the consumer of `h` that this rank sends nothing: a producer
    /// with no source blocks, aborted at once, notifies `aborted` and ends.
    fn answer_aborted(&self, h: Arc<Handshake>, reason: String, ctx: &mut Context<Self>) {
        let addr = self.start_producer(&h.request_id, SourceBlocks::default(), None, 0, ctx);
        addr.send(HandshakeArrived(h));
        addr.send(AbortRequest { reason });
    }

    /// Sends `msg` to every actor of `request`'s producer group.
    pub fn to_producer<M>(&self, request: &RequestId, msg: M) -> Result<(), RuntimeError>
    where
        M: Message + Send + Clone + 'static,
        M::Result: Send,
        ProducerActor: Handler<M>,
    {
        match self.producers.get(request) {
            Some(group) if group.live() => {
                group.send(msg);
                Ok(())
            }
            _ => Err(RuntimeError::UnknownRequest(request.0.clone())),
        }
    }

    /// [`super::runtime::Runtime::producer_release_unclaimed`]: asks the
    /// group to give up if no consumer claimed it, and remembers that vLLM
    /// is done with the request: a handshake that arrives once the group
    /// ended is answered `aborted` at once (its consumer fails now, not at
    /// its deadline), as for a request given up before it opened.
    pub fn producer_release_unclaimed(
        &mut self,
        request: &RequestId,
        reason: String,
    ) -> Result<(), RuntimeError> {
        let Some(group) = self.producers.get(request).filter(|g| g.live()) else {
            return Err(RuntimeError::UnknownRequest(request.0.clone()));
        };
        let capability = group.capability.clone();
        group.send(ReleaseUnclaimed {
            reason: reason.clone(),
        });
        let why = format!("prefill gave the request up: {reason}");
        if let Err(e) = self.pre_open.discard(request, &capability, why) {
            // no room to remember it: a late handshake waits for its deadline
            tracing::debug!(request = %request, error = %e, "an unclaimed request's end not remembered");
        }
        Ok(())
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

/// Rule 1 at the door: a handshake or cancel for an open request must carry
/// its capability (counted as forbidden otherwise; nothing changes).
fn check_capability(
    stats: &Stats,
    request: &RequestId,
    own: &Capability,
    got: &Capability,
) -> Result<(), RuntimeError> {
    if own.matches(got) {
        return Ok(());
    }
    stats.side_channel_forbidden.inc();
    Err(RuntimeError::Forbidden {
        request: request.0.clone(),
        reason: "the capability does not match the request's".into(),
    })
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

impl Handler<ProducerEnded> for RequestDirectory {
    type Result = ();
    fn handle(&mut self, msg: ProducerEnded, _ctx: &mut Context<Self>) {
        let ProducerEnded {
            group,
            request,
            outcome,
            reason,
        } = msg;
        let current = self.producers.get(&request).is_some_and(|g| g.token == group);
        let folded = if current {
            self.producers.get_mut(&request)
        } else {
            self.ending.get_mut(&group)
        };
        let ended = match folded {
            Some(g) if group != 0 => match g.ended(outcome, reason) {
                None => return,
                Some(last) => {
                    // Every write of the group ended: its layer pieces go back.
                    if current {
                        if let Some(g) = self.producers.remove(&request) {
                            g.src_blocks.close();
                            self.remember_ended(request.clone(), g.capability);
                        }
                        self.index.withdraw(&request);
                    } else if let Some(g) = self.ending.remove(&group) {
                        g.src_blocks.close();
                    }
                    last
                }
            },
            // A producer of no group (one answering a discarded request).
            _ if group == 0 => (outcome, reason),
            // A group this directory does not know (its members were all
            // counted already): never a release of whatever group holds the
            // request ID now, whose writes may still be in flight.
            _ => {
                self.shared.stats.events_dropped.inc();
                tracing::warn!(request = %request, group, "release of an unknown producer group dropped");
                return;
            }
        };
        let _ = self.events.send(RuntimeEvent::ProducerReleased {
            request,
            outcome: ended.0,
            reason: ended.1,
        });
    }
}
