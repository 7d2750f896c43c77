//! The request actors: one per P/D request and side. Each owns its request's
//! authorization, generation and expected producer count, feeds events to
//! its pure state machine ([`super::state`]) and carries out the effects.
//! Handlers stay thin; failures travel as messages.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use crossbeam_channel::Sender;
use tracing::Span;

use super::messages::*;
use super::router::NotificationRouter;
use super::state::*;
use super::stats::Stats;
use super::writer::WriterPool;
use crate::error::GeometryError;
use crate::ids::{Generation, ProducerRank, RequestId};
use crate::layout::KvLayout;
use crate::transport::WriteRange;
use crate::wire::{Handshake, Notice, WIRE_VERSION};

/// Why a write was not submitted once the consumer's deadline passed.
pub const EXPIRED: &str =
    "the consumer's authorization expired (its deadline passed): nothing more is written";

// ------------------------------------------------------------------------
// Consumer
// ------------------------------------------------------------------------

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
}

impl ConsumerActor {
    pub fn new(
        machine: ConsumerMachine,
        timeout: Duration,
        quarantine: Duration,
        router: Addr<NotificationRouter>,
        events: Sender<RuntimeEvent>,
        stats: Arc<Stats>,
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
                if a.machine.phase() == crate::actors::state::ConsumerPhase::Releasing {
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

// ------------------------------------------------------------------------
// Producer
// ------------------------------------------------------------------------

/// The prefill side of one request.
pub struct ProducerActor {
    machine: ProducerMachine,
    rank: ProducerRank,
    src_blocks: Vec<u32>,
    local: Arc<KvLayout>,
    writers: Arc<WriterPool>,
    handshake_timeout: Duration,
    events: Sender<RuntimeEvent>,
    stats: Arc<Stats>,
    span: Span,
    planned: Vec<crate::transport::WriteRange>,
}

impl ProducerActor {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        request: RequestId,
        src_blocks: Vec<u32>,
        local: Arc<KvLayout>,
        writers: Arc<WriterPool>,
        handshake_timeout: Duration,
        events: Sender<RuntimeEvent>,
        stats: Arc<Stats>,
    ) -> Self {
        let span = tracing::info_span!("request", side = "producer", request = %request,
            rank = local.tp_rank, blocks = src_blocks.len());
        Self {
            machine: ProducerMachine::new(request),
            rank: ProducerRank(local.tp_rank),
            src_blocks,
            local,
            writers,
            handshake_timeout,
            events,
            stats,
            span,
            planned: Vec::new(),
        }
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
                let planned = plan_write(
                    &self.local,
                    &self.src_blocks,
                    &auth,
                    layer,
                    blocks.clone(),
                    &mut self.planned,
                );
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
                tracing::debug!(
                    write,
                    layer,
                    ?blocks,
                    ranges = self.planned.len(),
                    bytes,
                    "layer admitted"
                );
                let cap = self.planned.len();
                self.writers.next(&auth.endpoint).do_send(WriteLayer {
                    request,
                    write,
                    generation,
                    layer,
                    // The next layer plans into a buffer of this size (no regrowth).
                    ranges: std::mem::replace(&mut self.planned, Vec::with_capacity(cap)),
                    bytes,
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
                };
                tracing::info!(?outcome, bytes, "notifying the consumer");
                self.writers.get(&auth.endpoint).do_send(SendNotice(notice));
                None
            }
            ProducerEffect::Release { outcome, reason } => {
                self.stats.producers_released.inc();
                tracing::info!(?outcome, ?reason, "released: every admitted write drained");
                let _ = self.events.send(RuntimeEvent::ProducerReleased {
                    request,
                    outcome,
                    reason,
                });
                ctx.stop();
                None
            }
            ProducerEffect::Dropped(why) => {
                self.stats.events_dropped.inc();
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
        ctx.run_later(self.handshake_timeout, |a, ctx| {
            if !a.machine.has_handshake() {
                let span = tracing::info_span!(parent: &a.span, "msg", kind = "TimedOut");
                let _g = span.enter();
                a.feed(ProducerEvent::TimedOut, ctx);
            }
        });
    }
}

/// A handler: a `msg` span (with `kind` and the given span fields) around
/// feeding the event to the machine.
macro_rules! producer_handler {
    ($msg:ty, $kind:literal, |$m:ident| $ev:expr $(, $($field:tt)+)?) => {
        impl Handler<$msg> for ProducerActor {
            type Result = ();
            fn handle(&mut self, $m: $msg, ctx: &mut Context<Self>) {
                let span = tracing::info_span!(parent: &self.span, "msg", kind = $kind $(, $($field)+)?);
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

producer_handler!(
    HandshakeArrived,
    "HandshakeArrived",
    |m| ProducerEvent::Handshake(m.0),
    generation = m.0.generation.0,
    blocks = m.0.block_ids.len()
);
producer_handler!(
    LayerReady,
    "LayerReady",
    |m| ProducerEvent::LayerReady {
        layer: m.layer,
        blocks: m.blocks
    },
    layer = m.layer,
    blocks = ?m.blocks
);
producer_handler!(
    LayerWritten,
    "LayerWritten",
    |m| ProducerEvent::WriteDone {
        write: m.write,
        generation: m.generation,
        bytes: m.bytes
    },
    write = m.write,
    bytes = m.bytes
);
producer_handler!(
    LayerWriteFailed,
    "LayerWriteFailed",
    |m| {
        ProducerEvent::WriteFailed {
            write: m.write,
            generation: m.generation,
            reason: m.reason,
        }
    },
    write = m.write,
    reason = %m.reason
);
producer_handler!(FinishRequest, "FinishRequest", |_m| ProducerEvent::Finish);
producer_handler!(
    AbortRequest,
    "AbortRequest",
    |m| ProducerEvent::Abort { reason: m.reason },
    reason = %m.reason
);

/// Turns an admitted write (a `Submit`) into byte ranges inside `auth`, as
/// the producer actor does before handing them to a layer writer. Pure, so
/// the property test (`tests/contract_props.rs`) plans exactly as the actor
/// does. Request blocks before `auth.first_block` the consumer already holds
/// and are skipped; the rest are shifted into the authorization's indices.
/// `Ok` with `out` empty: nothing to write. An index outside the
/// authorization (or the source blocks) is an error, never a range.
pub fn plan_write(
    local: &KvLayout,
    src_blocks: &[u32],
    auth: &Handshake,
    layer: u32,
    blocks: Range<u32>,
    out: &mut Vec<WriteRange>,
) -> Result<(), GeometryError> {
    out.clear();
    let first = auth.first_block;
    let (lo, hi) = (blocks.start.max(first), blocks.end);
    if lo >= hi {
        return Ok(());
    }
    let src = src_blocks.get(first as usize..).unwrap_or(&[]);
    local.plan_layer(
        &auth.layout,
        layer,
        src,
        &auth.block_ids,
        (lo - first)..(hi - first),
        out,
    )
}

/// A fresh generation seed: clock-based high bits, so a restarted consumer
/// starts above its predecessor, and random low bits.
pub fn generation_seed() -> Generation {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    // High bits from the clock (later runtimes start higher, to within ~4 s),
    // low 32 bits random: a notice's generation cannot be guessed blindly.
    let random = uuid::Uuid::new_v4().as_u64_pair().0 & 0xFFFF_FFFF;
    Generation((nanos & !0xFFFF_FFFF) | random)
}
