//! The decode side's request actor: one per (request ID, generation)
//! authorized on this rank. It owns the authorization's generation and the
//! expected producer ranks through its [`crate::fsm::ConsumerMachine`],
//! takes the notices the router routes to it, and carries out the effects.
//! Handlers stay thin; failures travel as messages.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tracing::Span;

use super::publisher::{FenceJob, Publisher};
use super::router::NotificationRouter;
use crate::actors::messages::*;
use crate::actors::stats::Stats;
use crate::fsm::*;
use crate::ids::{Capability, ProducerRank};
use crate::staging::{staged_units, SharedArena, StagedKv, StagingGrant};
use crate::wire::Cancel;
use std::collections::BTreeSet;

/// The decode side of one request.
pub struct ConsumerActor {
    machine: ConsumerMachine,
    timeout: Duration,
    /// How long after `timeout` blocks no producer accounted for stay held.
    quarantine: Duration,
    opened: Instant,
    router: Addr<NotificationRouter>,
    events: crate::actors::messages::EventSender,
    stats: Arc<Stats>,
    span: Span,
    /// The request's staging grant, if it has one (returned to its arena on
    /// release, never before).
    staging: Option<ConsumerStaging>,
    /// Where a fence goes: the side channels this rank's handshake was
    /// published to (`(host:port, producer rank)`, [`Published`]), and who
    /// sends it.
    fence: FenceTargets,
}

/// What a consumer needs to fence its generation ([`ConsumerEffect::Fence`]).
pub struct FenceTargets {
    pub publisher: Arc<Publisher>,
    pub capability: Capability,
    /// This consumer's TP rank on its instance.
    pub consumer_rank: u32,
    /// Set when the handshake is published.
    pub targets: Vec<(String, u32)>,
}

/// A consumer's staging grant and what it needs to tell the worker what to
/// scatter.
pub struct ConsumerStaging {
    pub grant: StagingGrant,
    pub arena: SharedArena,
    pub blocks: u32,
    pub producer_tp: u32,
    pub layout: Arc<crate::layout::KvLayout>,
}

impl ConsumerStaging {
    /// What the worker scatters: the heads of the producer ranks whose
    /// counted done notice said they staged (`ConsumerMachine::staged_ranks`).
    fn staged_kv(&self, staged: &BTreeSet<ProducerRank>) -> Option<StagedKv> {
        if staged.is_empty() {
            return None;
        }
        let mut units: Vec<std::ops::Range<u32>> = staged
            .iter()
            .map(|&r| staged_units(&self.layout, self.producer_tp, r.0))
            .filter(|u| !u.is_empty())
            .collect();
        units.sort_by_key(|u| u.start);
        let mut merged: Vec<std::ops::Range<u32>> = Vec::with_capacity(units.len());
        for u in units {
            match merged.last_mut() {
                Some(last) if u.start <= last.end => last.end = last.end.max(u.end),
                _ => merged.push(u),
            }
        }
        Some(StagedKv {
            grant: self.grant,
            blocks: self.blocks,
            units: merged,
        })
    }
}

impl ConsumerActor {
    /// `deadlines`: the consumer timeout and the quarantine after it.
    pub fn new(
        machine: ConsumerMachine,
        (timeout, quarantine): (Duration, Duration),
        router: Addr<NotificationRouter>,
        events: crate::actors::messages::EventSender,
        stats: Arc<Stats>,
        staging: Option<ConsumerStaging>,
        fence: FenceTargets,
    ) -> Self {
        let span = tracing::info_span!("request", side = "consumer", request = %machine.request,
            generation = machine.generation.0, expected = machine.expected_count());
        Self {
            machine,
            timeout,
            quarantine,
            opened: Instant::now(),
            router,
            events,
            stats,
            span,
            staging,
            fence,
        }
    }

    /// Starts the actor with its route: the notification router delivers
    /// its request's notices to it from before this returns (so before the
    /// handshake that authorizes its producers can leave the runtime) until
    /// the actor is released ([`ConsumerEffect::Released`] unregisters it).
    /// The route has this one owner.
    pub fn start_routed(self) -> Addr<Self> {
        let router = self.router.clone();
        let (request, generation) = (self.machine.request.clone(), self.machine.generation);
        let addr = self.start();
        router.do_send(RegisterConsumer {
            request,
            generation,
            to: addr.clone().recipient(),
        });
        addr
    }

    /// Asks producer ranks `ranks` to fence this generation (rule 10): a
    /// cancel carrying it to each one's side channel; a rank that answers
    /// `fenced` comes back as [`RankEnded`]. Ranks whose side channel is not
    /// known (the handshake was never published) are waited for as before.
    fn send_fences(&self, ranks: &[ProducerRank], ctx: &mut Context<Self>) {
        let f = &self.fence;
        let body: Arc<str> = Cancel::new(
            self.machine.request.clone(),
            f.capability.clone(),
            "the consumer was released before the transfer ended",
        )
        .fencing(self.machine.generation, f.consumer_rank)
        .to_json()
        .into();
        for rank in ranks {
            for (addr, _) in f.targets.iter().filter(|(_, r)| *r == rank.0) {
                f.publisher.fence(FenceJob {
                    addr: addr.clone(),
                    body: body.clone(),
                    generation: self.machine.generation,
                    producer_rank: rank.0,
                    consumer: ctx.address().recipient(),
                });
            }
        }
    }

    fn feed(&mut self, ev: ConsumerEvent, ctx: &mut Context<Self>) {
        let (request, generation) = (self.machine.request.clone(), self.machine.generation);
        for fx in self.machine.on_event(ev) {
            match fx {
                ConsumerEffect::Completed { bytes } => {
                    self.stats.consumers_completed.inc();
                    self.stats
                        .transfer_micros
                        .add(self.opened.elapsed().as_micros() as u64);
                    tracing::info!(bytes, "all producers done: KV complete");
                    let _ = self.events.send(RuntimeEvent::ConsumerCompleted {
                        request: request.clone(),
                        generation,
                        bytes,
                        staged: self
                            .staging
                            .as_ref()
                            .and_then(|s| s.staged_kv(self.machine.staged_ranks())),
                    });
                }
                ConsumerEffect::Failed { reason, held } => {
                    self.stats.consumers_failed.inc();
                    tracing::warn!(%reason, held, "KV will not be complete");
                    let _ = self.events.send(RuntimeEvent::ConsumerFailed {
                        request: request.clone(),
                        generation,
                        reason,
                        held,
                    });
                }
                ConsumerEffect::Quiesced => {
                    tracing::info!("quiesced: no producer is waited for any more");
                    let _ = self.events.send(RuntimeEvent::ConsumerQuiesced {
                        request: request.clone(),
                        generation,
                    });
                }
                ConsumerEffect::Dropped(why) => {
                    self.stats.events_dropped.inc();
                    if matches!(why, Dropped::Unauthenticated(_)) {
                        self.stats.notices_unauthenticated.inc();
                        tracing::warn!(?why, "notice without the request's tag dropped");
                    } else {
                        tracing::info!(?why, "event dropped");
                    }
                }
                ConsumerEffect::Fence { ranks } => {
                    tracing::info!(?ranks, "released while producers may write: fencing");
                    self.send_fences(&ranks, ctx);
                }
                ConsumerEffect::Released => {
                    tracing::info!("released: no producer can write into the blocks any more");
                    if let Some(s) = self.staging.take() {
                        // Nothing can write into the grant any more either.
                        if let Err(e) = s.arena.lock().free(s.grant.base) {
                            tracing::error!(error = %e, "staging grant not returned");
                        }
                    }
                    self.router.do_send(UnregisterConsumer {
                        request: request.clone(),
                        generation,
                    });
                    let _ = self.events.send(RuntimeEvent::ConsumerReleased {
                        request: request.clone(),
                        generation,
                    });
                    ctx.stop();
                }
            }
        }
    }
}

impl Actor for ConsumerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let _g = self.span.enter();
        tracing::info!("authorized; waiting for producers");
        ctx.run_later(self.timeout, |a, ctx| {
            let span = tracing::info_span!(parent: &a.span, "msg", kind = "TimedOut");
            let _g = span.enter();
            a.feed(ConsumerEvent::TimedOut, ctx);
            // Then the quarantine: blocks a silent producer may still write
            // into are held until it passes.
            ctx.run_later(a.quarantine, |a, ctx| {
                let span = tracing::info_span!(parent: &a.span, "msg", kind = "QuarantineOver");
                let _g = span.enter();
                if a.machine.phase() == crate::fsm::ConsumerPhase::Releasing {
                    a.stats.consumers_quarantine_expired.inc();
                    tracing::warn!("quarantine over: freeing blocks a silent producer may still write into");
                }
                a.feed(ConsumerEvent::QuarantineOver, ctx)
            });
        });
    }
}

impl Handler<NoticeArrived> for ConsumerActor {
    type Result = ();
    fn handle(&mut self, msg: NoticeArrived, ctx: &mut Context<Self>) {
        let n = msg.0;
        let span = tracing::info_span!(parent: &self.span, "msg", kind = "NoticeArrived",
            rank = n.producer_rank.0, outcome = ?n.outcome, generation = n.generation.0);
        let _g = span.enter();
        self.feed(ConsumerEvent::Notice(n), ctx);
    }
}

impl Handler<RankEnded> for ConsumerActor {
    type Result = ();
    fn handle(&mut self, m: RankEnded, ctx: &mut Context<Self>) {
        let span = tracing::info_span!(parent: &self.span, "msg", kind = "RankEnded",
            rank = m.rank.0, outcome = ?m.outcome, generation = m.generation.0);
        let _g = span.enter();
        self.feed(
            ConsumerEvent::RankEnded {
                generation: m.generation,
                rank: m.rank,
                outcome: m.outcome,
                reason: m.reason,
            },
            ctx,
        );
    }
}

/// The handshake of this consumer was published to `targets`
/// (`(host:port, producer rank)`): where its fence goes.
#[derive(Message, Debug)]
#[rtype(result = "()")]
pub struct Published(pub Vec<(String, u32)>);

impl Handler<Published> for ConsumerActor {
    type Result = ();
    fn handle(&mut self, m: Published, _ctx: &mut Context<Self>) {
        self.fence.targets = m.0;
    }
}

impl Handler<ReleaseRequest> for ConsumerActor {
    type Result = ();
    fn handle(&mut self, _msg: ReleaseRequest, ctx: &mut Context<Self>) {
        let span = tracing::info_span!(parent: &self.span, "msg", kind = "ReleaseRequest");
        let _g = span.enter();
        self.feed(ConsumerEvent::Release, ctx);
    }
}
