//! The decode side's request actor: one per (request ID, generation)
//! authorized on this rank. It owns the authorization's generation and the
//! expected producer ranks through its [`crate::fsm::ConsumerMachine`],
//! takes the notices the router routes to it, and carries out the effects.
//! Handlers stay thin; failures travel as messages.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use crossbeam_channel::Sender;
use tracing::Span;

use super::messages::*;
use super::router::NotificationRouter;
use super::stats::Stats;
use crate::fsm::*;
use crate::staging::{staged_units, SharedArena, StagedKv, StagingGrant};
use std::collections::BTreeSet;

/// The decode side of one request.
pub struct ConsumerActor {
    machine: ConsumerMachine,
    timeout: Duration,
    /// How long after `timeout` blocks no producer accounted for stay held.
    quarantine: Duration,
    opened: Instant,
    router: Addr<NotificationRouter>,
    events: Sender<RuntimeEvent>,
    stats: Arc<Stats>,
    span: Span,
    /// The request's staging grant, if it has one (returned to its arena on
    /// release, never before).
    staging: Option<ConsumerStaging>,
}

/// A consumer's staging grant and what it needs to tell the worker what to
/// scatter.
pub struct ConsumerStaging {
    pub grant: StagingGrant,
    pub arena: SharedArena,
    pub blocks: u32,
    pub producer_tp: u32,
    pub layout: Arc<crate::layout::KvLayout>,
    /// Producer ranks of this generation that said they staged.
    pub staged: BTreeSet<u32>,
}

impl ConsumerStaging {
    fn staged_kv(&self) -> Option<StagedKv> {
        if self.staged.is_empty() {
            return None;
        }
        let mut units: Vec<std::ops::Range<u32>> = self
            .staged
            .iter()
            .map(|&r| staged_units(&self.layout, self.producer_tp, r))
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
    pub fn new(
        machine: ConsumerMachine,
        timeout: Duration,
        quarantine: Duration,
        router: Addr<NotificationRouter>,
        events: Sender<RuntimeEvent>,
        stats: Arc<Stats>,
        staging: Option<ConsumerStaging>,
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
                        staged: self.staging.as_ref().and_then(ConsumerStaging::staged_kv),
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
                    tracing::info!(?why, "event dropped");
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
        if n.request_id != self.machine.request {
            self.stats.events_dropped.inc();
            return;
        }
        if n.staged
            && n.outcome == crate::wire::Outcome::Done
            && n.generation == self.machine.generation
            && self.machine.would_count(n.producer_rank)
        {
            // Only the first done notice of an expected rank of this
            // generation: a duplicate or a stranger's never makes the
            // worker scatter over heads written directly.
            if let Some(s) = self.staging.as_mut() {
                s.staged.insert(n.producer_rank.0);
            }
        }
        self.feed(
            ConsumerEvent::Notice {
                generation: n.generation,
                rank: n.producer_rank,
                outcome: n.outcome,
                reason: n.reason,
                bytes: n.bytes,
            },
            ctx,
        );
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
