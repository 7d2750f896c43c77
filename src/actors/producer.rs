//! The prefill side's request actor: one per (request, decode rank it sends
//! to). It owns the captured authorization through its
//! [`crate::fsm::ProducerMachine`], plans each admitted write with
//! [`crate::layout::plan_write`] under that authorization, hands it to a
//! layer writer, and carries out the other effects. Handlers stay thin;
//! failures travel as messages.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tracing::Span;

use super::messages::*;
use super::stats::Stats;
use super::writer::WriterPool;
use crate::fsm::*;
use crate::ids::{Generation, ProducerRank, RequestId};
use crate::layout::{plan_write, KvLayout};
use crate::staging::{SourceStaging, StagedPlan};
use crate::wire::{Handshake, Notice, WIRE_VERSION};

/// Why a write was not submitted once the consumer's deadline passed.
pub const EXPIRED: &str =
    "the consumer's authorization expired (its deadline passed): nothing more is written";

/// What every producer actor of a rank shares (the request directory holds
/// it and hands each actor a reference).
pub struct ProducerShared {
    pub local: Arc<KvLayout>,
    pub writers: Arc<WriterPool>,
    /// How long a producer waits for its consumer's handshake.
    pub handshake_timeout: Duration,
    pub stats: Arc<Stats>,
}

/// The prefill side of one request.
pub struct ProducerActor {
    machine: ProducerMachine,
    rank: ProducerRank,
    src_blocks: Vec<u32>,
    shared: Arc<ProducerShared>,
    /// Where the release goes: the request directory, under this group token.
    released_to: (u64, Recipient<ProducerEnded>),
    span: Span,
    planned: Vec<crate::transport::WriteRange>,
    /// Where the worker gathers this request's blocks (`None`: it does not
    /// stage; every write goes to the pages).
    staging: Option<SourceStaging>,
    /// The staged plan of the authorization of this generation (`None`
    /// inside: that authorization is written into pages), made once.
    staged: Option<(Generation, Option<Arc<StagedPlan>>)>,
}

impl ProducerActor {
    pub fn new(
        request: RequestId,
        src_blocks: Vec<u32>,
        staging: Option<SourceStaging>,
        shared: Arc<ProducerShared>,
        released_to: (u64, Recipient<ProducerEnded>),
    ) -> Self {
        let span = tracing::info_span!("request", side = "producer", request = %request,
            rank = shared.local.tp_rank, blocks = src_blocks.len());
        Self {
            machine: ProducerMachine::new(request),
            rank: ProducerRank(shared.local.tp_rank),
            src_blocks,
            shared,
            released_to,
            span,
            planned: Vec::new(),
            staging,
            staged: None,
        }
    }

    /// Where this producer writes under `auth`: the consumer's staging grant
    /// when both sides stage in the same order (the plan), else the pages
    /// (`None`). Fixed for an authorization, so its notice can say which;
    /// planned once per generation. An authorization whose grant cannot be
    /// planned (its addresses overflow) is written into pages.
    fn staged_into(&mut self, auth: &Handshake) -> Option<Arc<StagedPlan>> {
        if let Some((g, plan)) = &self.staged {
            if *g == auth.generation {
                return plan.clone();
            }
        }
        let plan = self.staging.and_then(|src| {
            StagedPlan::new(&self.shared.local, src, auth)
                .inspect_err(|e| tracing::warn!(error = %e, "staging grant not usable: writing pages"))
                .ok()
                .flatten()
                .map(Arc::new)
        });
        self.staged = Some((auth.generation, plan.clone()));
        plan
    }

    fn feed(&mut self, ev: ProducerEvent, ctx: &mut Context<Self>) {
        // Follow-up events are rare: the queue allocates only when one comes.
        let mut queue = std::collections::VecDeque::new();
        let mut next = Some(ev);
        while let Some(ev) = next.take().or_else(|| queue.pop_front()) {
            for fx in self.machine.on_event(ev) {
                if let Some(follow) = self.apply(fx, ctx) {
                    queue.push_back(follow);
                }
            }
        }
    }

    /// Carries out one effect; may return an event to feed back.
    fn apply(&mut self, fx: ProducerEffect, ctx: &mut Context<Self>) -> Option<ProducerEvent> {
        let request = self.machine.request.clone();
        match fx {
            ProducerEffect::Submit {
                write,
                generation,
                layer,
                blocks,
                after,
                auth,
            } => {
                if auth.expired() {
                    tracing::warn!(layer, "the consumer's deadline passed: not writing");
                    return Some(ProducerEvent::WriteFailed {
                        write,
                        generation,
                        reason: EXPIRED.into(),
                    });
                }
                let staged = self.staged_into(&auth);
                let planned = match &staged {
                    Some(plan) => plan.plan_layer(layer, blocks.clone(), &mut self.planned),
                    None => plan_write(
                        &self.shared.local,
                        &self.src_blocks,
                        &auth,
                        layer,
                        blocks.clone(),
                        &mut self.planned,
                    ),
                };
                if let Err(e) = planned {
                    tracing::warn!(layer, error = %e, "layer cannot be written inside the authorization");
                    return Some(ProducerEvent::WriteFailed {
                        write,
                        generation,
                        reason: e.to_string(),
                    });
                }
                if self.planned.is_empty() {
                    return Some(ProducerEvent::WriteDone {
                        write,
                        generation,
                        bytes: 0,
                    });
                }
                let bytes = self.planned.iter().map(|r| r.len).sum();
                if staged.is_some() {
                    self.shared.stats.layers_staged.inc();
                }
                tracing::debug!(
                    write,
                    layer,
                    ?blocks,
                    ranges = self.planned.len(),
                    bytes,
                    "layer admitted"
                );
                let cap = self.planned.len();
                self.shared.writers.next(&auth.endpoint).do_send(WriteLayer {
                    request,
                    write,
                    generation,
                    layer,
                    // The next layer plans into a buffer of this size (no regrowth).
                    ranges: std::mem::replace(&mut self.planned, Vec::with_capacity(cap)),
                    bytes,
                    after,
                    expires_unix_ms: auth.expires_unix_ms,
                    done_to: ctx.address().recipient(),
                    failed_to: ctx.address().recipient(),
                });
                None
            }
            ProducerEffect::Notify {
                auth,
                outcome,
                reason,
                bytes,
            } => {
                let notice = Notice {
                    version: WIRE_VERSION,
                    request_id: request,
                    generation: auth.generation,
                    producer_rank: self.rank,
                    outcome,
                    reason,
                    bytes,
                    staged: self.staged_into(&auth).is_some(),
                };
                tracing::info!(?outcome, bytes, notice.staged, "notifying the consumer");
                self.shared
                    .writers
                    .get(&auth.endpoint)
                    .do_send(SendNotice(notice));
                None
            }
            ProducerEffect::Release { outcome, reason } => {
                self.shared.stats.producers_released.inc();
                tracing::info!(?outcome, ?reason, "released: every admitted write drained");
                let (group, to) = &self.released_to;
                to.do_send(ProducerEnded {
                    group: *group,
                    request,
                    outcome,
                    reason,
                });
                ctx.stop();
                None
            }
            ProducerEffect::Dropped(why) => {
                self.shared.stats.events_dropped.inc();
                tracing::info!(?why, "event dropped");
                None
            }
        }
    }
}

impl Actor for ProducerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        let _g = self.span.enter();
        tracing::info!("opened");
        ctx.run_later(self.shared.handshake_timeout, |a, ctx| {
            if !a.machine.has_handshake() {
                let span = tracing::info_span!(parent: &a.span, "msg", kind = "TimedOut");
                let _g = span.enter();
                a.feed(ProducerEvent::TimedOut, ctx);
            }
        });
    }
}

/// A handler: a `msg` span (`kind`: the message's type name, and the given
/// span fields) around feeding the event to the machine. One line each
/// below: message, the event it becomes; span fields.
macro_rules! producer_handler {
    ($msg:ident, |$m:ident| $ev:expr $(; $($field:tt)+)?) => {
        impl Handler<$msg> for ProducerActor {
            type Result = ();
            fn handle(&mut self, $m: $msg, ctx: &mut Context<Self>) {
                let span = tracing::info_span!(parent: &self.span, "msg", kind = stringify!($msg) $(, $($field)+)?);
                let _g = span.enter();
                self.feed($ev, ctx);
            }
        }
    };
}

impl Handler<SourceBlocksAdded> for ProducerActor {
    type Result = ();
    fn handle(&mut self, msg: SourceBlocksAdded, _ctx: &mut Context<Self>) {
        let span =
            tracing::info_span!(parent: &self.span, "msg", kind = "SourceBlocksAdded", added = msg.0.len());
        let _g = span.enter();
        self.src_blocks.extend(msg.0);
    }
}

producer_handler!(HandshakeArrived, |m| ProducerEvent::Handshake(m.0);
    generation = m.0.generation.0, blocks = m.0.block_ids.len());
producer_handler!(LayerReady, |m| ProducerEvent::LayerReady { layer: m.layer, blocks: m.blocks, after: m.after };
    layer = m.layer, blocks = ?m.blocks);
producer_handler!(LayerWritten, |m| ProducerEvent::WriteDone { write: m.write, generation: m.generation, bytes: m.bytes };
    write = m.write, bytes = m.bytes);
producer_handler!(LayerWriteFailed,
    |m| ProducerEvent::WriteFailed { write: m.write, generation: m.generation, reason: m.reason };
    write = m.write, reason = %m.reason);
producer_handler!(FinishRequest, |_m| ProducerEvent::Finish);
producer_handler!(AbortRequest, |m| ProducerEvent::Abort { reason: m.reason }; reason = %m.reason);
