//! The request directory's prefill side: the producer groups and the index
//! the façade reads them in, opening a group, handshakes, cancels,
//! discards and releases, and what arrived before a request opened.

use super::*;

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
pub(super) struct ProducerGroup {
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
    pub(super) fn live(&self) -> bool {
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

impl RequestDirectory {
    /// [`crate::actors::runtime::Runtime::producer_open`], after its stateless checks.
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
            src_blocks.stage_by_layer(
                arena.clone(),
                members.len() as u32,
                self.shared.pieces_whole_requests,
            );
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

    /// [`crate::actors::runtime::Runtime::producer_cancel`]. With a generation the
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

    /// [`crate::actors::runtime::Runtime::producer_add_blocks`].
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

    /// [`crate::actors::runtime::Runtime::producer_handshake`], after its stateless
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

    /// [`crate::actors::runtime::Runtime::producer_discard`].
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

    /// [`crate::actors::runtime::Runtime::producer_release_unclaimed`]: asks the
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
                            g.src_blocks.close(&self.shared.stats.timings);
                            self.remember_ended(request.clone(), g.capability);
                        }
                        self.index.withdraw(&request);
                    } else if let Some(g) = self.ending.remove(&group) {
                        g.src_blocks.close(&self.shared.stats.timings);
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
