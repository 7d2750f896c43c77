//! The runtime's façade: a thread-safe, synchronous API over the actor
//! system (which runs on its own thread). This is what the Python binding
//! and the vLLM connector call.

use std::net::IpAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use crossbeam_channel::{Receiver, Sender};

pub use super::config::RuntimeConfig;
use super::config::{check_staging_regions, invalid_argument, overlaps, resolve_range_cap};
use super::decode::publisher::{HandshakeJob, Publisher};
use super::decode::router::NotificationRouter;
use super::directory::{check_layer, Call, CancelReply, ProducerIndex, RequestDirectory};
use super::messages::*;
use super::prefill::gate::LayerMarks;
use super::prefill::gather::{LocalCopy, WriterGather};
use super::prefill::producer::{ProducerActor, ProducerShared};
use super::prefill::writer::{spawn_poller, PollJob, WriterPool};
use super::stats::{Stats, StatsSnapshot, Timing};
use crate::error::{GeometryError, RuntimeError};
use crate::fsm::ConsumerMachine;
use crate::ids::{Capability, Generation, MarkSeq, NoticeKey, RequestId, Sequence};
use crate::layout::KvLayout;
use crate::staging::{group_fits, staged_bytes, GivenPiece, SourceKind, SourceStaging};
use crate::transport::Transport;
use crate::wire::{Cancel, Fence, Handshake, WIRE_VERSION};

/// How long a fence waits for the producer's answer (it answers once it
/// handled the abort queued before it; past this: `Held`).
const FENCE_WAIT: Duration = Duration::from_secs(2);

/// Threads that send a decode rank's handshakes, cancels and fences (a
/// handshake refused `503` holds its thread while it waits to try again).
const PUBLISH_THREADS: usize = 8;

/// How the writer lanes copy a gathered write ([`Runtime::set_writer_gather`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatherCopy {
    /// Not at all: writes go from the pages.
    Off,
    /// `memcpy`: the KV cache is host memory.
    Host,
    /// On the GPU of the caller's CUDA context: OrbitKV's gather kernel on
    /// the SMs (the copy engines where it does not load).
    Cuda,
    /// On the GPU of the caller's CUDA context, on the copy engines
    /// (`cuMemcpyBatchAsync`): run 46's path, kept to compare against.
    CudaCopyEngines,
}

/// The request runtime of one rank.
pub struct Runtime {
    transport: Arc<dyn Transport>,
    local: Arc<KvLayout>,
    cfg: RuntimeConfig,
    system: System,
    system_thread: Option<std::thread::JoinHandle<()>>,
    /// Owns every per-request map of this rank (the façade keeps none).
    directory: Addr<RequestDirectory>,
    /// The directory's open producer groups, read to hand layers over.
    producers: ProducerIndex,
    writers: Arc<WriterPool>,
    /// The GPU worker's layer marks, waited for by the layer writers.
    marks: Arc<LayerMarks>,
    /// The CUDA driver's events the marks are recorded with, loaded by the
    /// first [`Self::layers_ready_on_stream`] (GPU workers only); declared
    /// after the writers and the marks, so dropped after them.
    cuda_events: parking_lot::Mutex<Option<Arc<crate::transport::cuda::CudaEvents>>>,
    poller_tx: Option<Sender<PollJob>>,
    poller_stop: Arc<AtomicBool>,
    poller_thread: Option<std::thread::JoinHandle<()>>,
    events_rx: Receiver<(Instant, RuntimeEvent)>,
    /// Sends this (decode) rank's handshakes, cancels and fences, off any GIL.
    publisher: Arc<Publisher>,
    stats: Arc<Stats>,
    /// The source staging region's pieces (layer pieces of requests staged
    /// by layer), shared with the producers.
    source_arena: Option<crate::staging::SharedArena>,
    /// The writer lanes' gather (`gather_in_writer` with a source region).
    gather: Option<Arc<WriterGather>>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("endpoint", &self.transport.endpoint())
            .finish()
    }
}

impl Runtime {
    /// Starts the actor system for a rank whose KV cache is `local`
    /// (registered with `transport` by the caller). It sets no global
    /// subscriber: the embedding process may install OrbitKV's
    /// ([`crate::trace::install_global`]: stderr warnings, a Chrome trace of
    /// the actors); every runtime's shutdown then rewrites the trace file.
    /// `post`: how the decode side's publisher reaches a prefill rank's
    /// side channel (`Runtime::start` passes the HTTP client,
    /// `crate::HttpPost`; the actors know no HTTP).
    pub fn start_with(
        transport: Arc<dyn Transport>,
        local: KvLayout,
        cfg: RuntimeConfig,
        post: Arc<dyn super::decode::publisher::SideChannelPost>,
    ) -> Result<Self, RuntimeError> {
        local.validate()?;
        check_staging_regions(&cfg)?;
        let mut cfg = cfg;
        let kind = transport.kind();
        let range_cap = resolve_range_cap(&cfg, kind);
        cfg.max_ranges_in_flight_per_peer = Some(range_cap);
        tracing::info!(transport = %kind, max_ranges_in_flight_per_peer = range_cap, "runtime starting");
        let stats = Arc::new(Stats::default());
        let (boot_tx, boot_rx) = crossbeam_channel::bounded(1);
        let router_transport = transport.clone();
        let (poll_every, router_stats) = (cfg.notify_poll, stats.clone());
        let system_thread = std::thread::Builder::new()
            .name("orbitkv-runtime".into())
            .spawn(move || {
                let sys = System::new();
                sys.block_on(async move {
                    let router = NotificationRouter::new(router_transport, poll_every, router_stats).start();
                    let _ = boot_tx.send((router, System::current(), Arbiter::current()));
                });
                let _ = sys.run();
            })
            .map_err(|_| RuntimeError::Stopped)?;
        let (router, system, arbiter) = boot_rx
            .recv_timeout(Duration::from_secs(10))
            .map_err(|_| RuntimeError::Stopped)?;
        let (poller_tx, poller_rx) = crossbeam_channel::unbounded();
        let poller_stop = Arc::new(AtomicBool::new(false));
        let poller_thread = spawn_poller(transport.clone(), poller_rx, poller_stop.clone(), stats.clone());
        let marks = Arc::new(LayerMarks::new(stats.clone()));
        // `validate` refused a region the arena cannot take.
        let source_arena = match cfg.source_staging_region {
            Some((base, len)) => crate::staging::arena::StagingArena::new(base, len)
                .map(|a| Arc::new(parking_lot::Mutex::new(a)))
                .ok(),
            // segments come later (`add_source_staging`)
            None if cfg.source_staging_later => Some(Arc::new(parking_lot::Mutex::new(
                crate::staging::arena::StagingArena::empty(),
            ))),
            None => None,
        };
        let gather = source_arena
            .as_ref()
            .filter(|_| cfg.gather_in_writer)
            .map(|a| Arc::new(WriterGather::new(a.clone(), stats.clone())));
        let writers = Arc::new(
            WriterPool::new(
                transport.clone(),
                (poller_tx.clone(), marks.clone()),
                (cfg.write_timeout, cfg.quarantine),
                cfg.max_bytes_in_flight_per_peer,
                range_cap,
                cfg.writer_lanes_per_peer,
                cfg.inline_submit_max_ranges,
                cfg.peer_idle_reclaim,
                stats.clone(),
            )
            .park_on_gpu(cfg.lanes_park_on_gpu)
            .gather(gather.clone())
            .in_system(system.clone()),
        );
        let (events_tx, events_rx) = crossbeam_channel::unbounded();
        let publisher = Arc::new(Publisher::new(
            PUBLISH_THREADS,
            cfg.side_channel_key.clone(),
            cfg.publish_timeout,
            stats.clone(),
            post,
        ));
        let local = Arc::new(local);
        let shared = Arc::new(ProducerShared {
            local: local.clone(),
            writers: writers.clone(),
            handshake_timeout: cfg.handshake_timeout,
            staging_min_ranges: cfg.staging_min_ranges,
            stats: stats.clone(),
            buffers: Default::default(),
            source_arena,
            decode_staged: Default::default(),
            pieces_whole_requests: cfg.pieces_whole_requests,
        });
        let source_arena = shared.source_arena.clone();
        let producers = ProducerIndex::default();
        let directory = RequestDirectory::new(
            shared,
            cfg.clone(),
            router,
            crate::actors::messages::EventSender::new(events_tx),
            producers.clone(),
            publisher.clone(),
        );
        let directory = RequestDirectory::start_in_arbiter(&arbiter, move |_| directory);
        Ok(Self {
            transport,
            local,
            cfg,
            system,
            system_thread: Some(system_thread),
            directory,
            producers,
            writers,
            marks,
            cuda_events: parking_lot::Mutex::new(None),
            poller_tx: Some(poller_tx),
            poller_stop,
            poller_thread: Some(poller_thread),
            events_rx,
            publisher,
            stats,
            source_arena,
            gather,
        })
    }

    /// Prefill side, a runtime started with `gather_in_writer` and a source
    /// staging region: from now on the writer lanes gather scattered layer
    /// writes into pieces of the region ([`super::prefill::gather`]),
    /// copying with `copy`: [`GatherCopy::Cuda`], the GPU whose CUDA
    /// context is current on this thread (the worker's, where its KV cache
    /// lives), or [`GatherCopy::Host`], `memcpy` (a KV cache in host
    /// memory). The local layout's and the region's addresses must be this
    /// process's memory of that kind (what the rank registered).
    /// [`GatherCopy::Off`] stops it, for a region given back; only while no
    /// write is in flight (a gathered write still reads its piece). Returns
    /// how it copies (`gather kernel`, `cuMemcpyBatchAsync`, `cuMemcpyAsync
    /// per range`, `memcpy`, `off`; where the kernel was asked for and did
    /// not load, the copy engines' words and why). Without the setting:
    /// `InvalidArgument`; without a CUDA driver or context: `Transport`.
    pub fn set_writer_gather(&self, copy: GatherCopy) -> Result<String, RuntimeError> {
        let Some(g) = &self.gather else {
            return Err(invalid_argument(
                "the writer's gather needs a runtime started with gather_in_writer and a source staging region"
                    .into(),
            ));
        };
        let (copy, how) = match copy {
            GatherCopy::Cuda | GatherCopy::CudaCopyEngines => {
                let c = crate::transport::cuda::CudaCopier::for_current_context(copy == GatherCopy::Cuda)?;
                let how = match c.kernel_error() {
                    None => c.path().describe().to_owned(),
                    Some(why) => format!("{} (the gather kernel did not load: {why})", c.path().describe()),
                };
                (LocalCopy::Cuda(c), how)
            }
            GatherCopy::Host => (LocalCopy::Host, "memcpy".to_owned()),
            GatherCopy::Off => (LocalCopy::Off, "off".to_owned()),
        };
        g.set_copy(copy);
        Ok(how)
    }

    /// Whether the writer lanes gather ([`Self::set_writer_gather`] ran).
    pub fn writer_gathers(&self) -> bool {
        self.gather.as_ref().is_some_and(|g| g.on())
    }

    /// Runs `f` on the request directory and waits for its answer
    /// ([`RuntimeError::Stopped`] once the actor system is gone).
    fn ask<R, F>(&self, f: F) -> Result<R, RuntimeError>
    where
        R: Send + 'static,
        F: FnOnce(&mut RequestDirectory, &mut Context<RequestDirectory>) -> Result<R, RuntimeError>
            + Send
            + 'static,
    {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.tell(move |d, ctx| {
            let _ = tx.send(f(d, ctx));
        });
        // A call dropped unrun (the system stopped) drops `tx` with it.
        rx.recv().unwrap_or(Err(RuntimeError::Stopped))
    }

    /// Runs `f` on the request directory, after everything handed to it
    /// before, without waiting.
    fn tell<F>(&self, f: F)
    where
        F: FnOnce(&mut RequestDirectory, &mut Context<RequestDirectory>) + Send + 'static,
    {
        self.directory.do_send(Call(Box::new(f)));
    }

    /// This rank's Mooncake endpoint.
    pub fn endpoint(&self) -> &str {
        self.transport.endpoint()
    }

    /// This rank's KV geometry.
    pub fn layout(&self) -> &KvLayout {
        &self.local
    }

    /// The settings it runs with; the range cap resolved (always `Some`).
    pub fn config(&self) -> &RuntimeConfig {
        &self.cfg
    }

    /// The transport its writes go through (it chose the range cap's default).
    pub fn transport_kind(&self) -> crate::transport::TransportKind {
        self.transport.kind()
    }

    /// Ranges in flight per peer this runtime allows (the setting, else the
    /// transport's default).
    pub fn max_ranges_in_flight_per_peer(&self) -> usize {
        self.cfg
            .max_ranges_in_flight_per_peer
            .expect("the range cap is resolved when the runtime starts")
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Decode side: staging bytes and grants given out now (every grant is
    /// returned when its consumer is released).
    pub fn staging_in_use(&self) -> Result<(u64, usize), RuntimeError> {
        self.ask(|d, _| Ok(d.staging_in_use()))
    }

    /// Counts `layers` request-layers the embedding worker admitted at the
    /// end of a step because its host never reported them one by one
    /// (`layers_saved_at_wait`).
    pub fn note_layers_saved_at_wait(&self, layers: u64) {
        self.stats.layers_saved_at_wait.add(layers);
    }

    /// Counts `requests` the embedding worker opened without a whole
    /// source staging because its region had no room
    /// (`source_staging_full`; a request staged by layer is counted here
    /// per layer and chunk, by [`Self::producer_stage_layer`]).
    pub fn note_source_staging_full(&self, requests: u64) {
        self.stats.source_staging_full.add(requests);
    }

    /// Counts `requests` the embedding connector served plainly because
    /// their P/D parameters were refused (`params_refused`).
    pub fn note_params_refused(&self, requests: u64) {
        self.stats.params_refused.add(requests);
    }

    // ---- decode side ----------------------------------------------------

    /// Authorizes `block_ids` of this rank for request blocks
    /// `first_block..` of `request` (blocks before `first_block` the
    /// consumer already holds), expecting the producer ranks of an instance
    /// of TP size `producer_tp`, and returns the handshake to publish
    /// (carrying the request's `capability`, which the producers check). A
    /// request ID still authorized is refused: release it first (reuse then
    /// gets a new generation).
    pub fn consumer_open(
        &self,
        request: RequestId,
        capability: Capability,
        first_block: u32,
        block_ids: Vec<u32>,
        producer_tp: u32,
    ) -> Result<Handshake, RuntimeError> {
        self.consumer_open_tokens(request, capability, first_block, block_ids, producer_tp, 0)
    }

    /// [`Self::consumer_open`] saying how many of the request's tokens
    /// (counted from its start) the consumer loads, which a producer of
    /// another block size needs (`Handshake::tokens`; 0: not said).
    pub fn consumer_open_tokens(
        &self,
        request: RequestId,
        capability: Capability,
        first_block: u32,
        block_ids: Vec<u32>,
        producer_tp: u32,
        tokens: u32,
    ) -> Result<Handshake, RuntimeError> {
        if producer_tp == 0 {
            return Err(GeometryError::TensorParallel("producer TP size 0".into()).into());
        }
        self.local.validate_blocks(&block_ids)?;
        let expected = ConsumerMachine::expected_ranks(
            self.local.total_kv_heads,
            self.local.tp_rank,
            self.local.tp_size,
            producer_tp,
        );
        let handshake = Handshake {
            version: WIRE_VERSION,
            request_id: request,
            capability,
            // The request directory gives both (see
            // `RequestDirectory::consumer_open`).
            generation: Generation(0),
            sequence: Sequence(0),
            // Fresh for this authorization (this request, its generation and
            // this rank): the directory keeps it with the consumer, which
            // believes only notices tagged with it. It leaves the runtime
            // only in the handshake's JSON.
            notice_key: NoticeKey::random(),
            endpoint: self.transport.endpoint().to_string(),
            expected_producers: expected.len() as u32,
            first_block,
            block_ids,
            layout: (*self.local).clone(),
            // The consumer fails the request at its deadline: no producer
            // may start a write after it (see `Handshake::expires_unix_ms`).
            expires_unix_ms: crate::wire::unix_ms_now()
                .saturating_add(self.cfg.consumer_timeout.as_millis() as u64),
            tokens,
            // The request directory grants it when staging pays (see
            // `RequestDirectory::consumer_open`).
            staging: None,
        };
        handshake.validate()?;
        self.ask(move |d, _| d.consumer_open(handshake, expected, producer_tp))
    }

    /// Sends `handshake` (from [`Self::consumer_open`]) to the prefill side
    /// channels `targets` (`(host:port, producer rank)`), from the
    /// runtime's own threads. A rank that refuses it, or where nothing
    /// listens, is failed for the consumer at once.
    pub fn consumer_publish(
        &self,
        handshake: &Handshake,
        targets: Vec<(String, u32)>,
    ) -> Result<(), RuntimeError> {
        let (request, generation) = (handshake.request_id.clone(), handshake.generation);
        let published = targets.clone();
        let consumer = self
            .ask(move |d, _| d.consumer_published(&request, generation, published))?
            .recipient();
        let body: Arc<str> = handshake.to_json().into();
        // A busy prefill (503) is tried again until the consumer's deadline.
        let retry_until = std::time::Instant::now() + self.cfg.consumer_timeout;
        for (addr, producer_rank) in targets {
            self.publisher.handshake(HandshakeJob {
                addr,
                body: body.clone(),
                request: handshake.request_id.clone(),
                generation: handshake.generation,
                producer_rank,
                consumer: consumer.clone(),
                retry_until,
            });
        }
        Ok(())
    }

    /// Sends `cancel` to the prefill side channels `addrs` (fire and forget).
    pub fn consumer_send_cancel(&self, cancel: &Cancel, addrs: Vec<String>) {
        let body: Arc<str> = cancel.to_json().into();
        for addr in addrs {
            self.publisher.cancel(addr, body.clone());
        }
    }

    /// A producer rank refused `request`'s handshake of `generation` (or
    /// could not be reached at all), so nothing from it can land: the
    /// consumer counts that rank as failed now instead of waiting for its
    /// deadline. A stale generation or an unknown request changes nothing.
    pub fn consumer_handshake_refused(
        &self,
        request: &RequestId,
        generation: Generation,
        producer_rank: u32,
        reason: &str,
    ) -> Result<(), RuntimeError> {
        let ended = RankEnded::handshake_refused(generation, producer_rank, reason);
        let request = request.clone();
        self.ask(move |d, _| {
            d.consumer(&request, generation)?.do_send(ended);
            Ok(())
        })
    }

    /// vLLM is done with `request` on the decode side. The blocks are
    /// released (a `ConsumerReleased` event) once no producer can write into
    /// them any more.
    pub fn consumer_release(&self, request: &RequestId) -> Result<(), RuntimeError> {
        let request = request.clone();
        self.ask(move |d, _| d.consumer_release(&request))
    }

    // ---- prefill side ---------------------------------------------------

    /// Opens the producer side of `request`, whose blocks (in request order)
    /// are `src_blocks` of this rank, for a decode instance of TP size
    /// `consumer_tp`; only handshakes and cancels carrying `capability` will
    /// be accepted for it. One producer actor starts per decode rank this
    /// rank sends to; handshakes that arrived earlier under that capability
    /// are taken up now, and so is an early cancel; anything parked under
    /// another capability is dropped. A rank that sends to no decode rank
    /// (it holds only replicas of heads a lower rank sends) is released at
    /// once.
    pub fn producer_open(
        &self,
        request: RequestId,
        src_blocks: Vec<u32>,
        capability: Capability,
        consumer_tp: u32,
    ) -> Result<(), RuntimeError> {
        self.producer_open_staged(request, src_blocks, capability, consumer_tp, None)
    }

    /// [`Self::producer_open`] with the request's source staging: the
    /// worker gathers each computed layer of request blocks
    /// `0..staging.capacity` there in the order grouped by `staging.group`
    /// units (`crate::staging`; [`crate::staging::source_group`] of
    /// `consumer_tp` is the one that lets it write pages), and the
    /// producers write from it into consumers' grants or pages. It must lie
    /// inside `source_staging_region` and stay untouched by anything else
    /// until the request's `ProducerReleased`.
    pub fn producer_open_staged(
        &self,
        request: RequestId,
        src_blocks: Vec<u32>,
        capability: Capability,
        consumer_tp: u32,
        staging: Option<SourceStaging>,
    ) -> Result<(), RuntimeError> {
        if let Some(s) = staging {
            if !group_fits(&self.local, s.group) {
                return Err(invalid_argument(format!(
                    "a source staging grouped by {} units: the group must divide the {} units of a block",
                    s.group,
                    crate::staging::units(&self.local)
                )));
            }
            let len = staged_bytes(&self.local, s.capacity).ok_or(GeometryError::StagingOverflow)?;
            let inside = self.cfg.source_staging_region.is_some_and(|(base, rlen)| {
                s.base >= base && s.base.checked_add(len).is_some_and(|end| end <= base + rlen)
            });
            if !inside || s.capacity == 0 {
                return Err(invalid_argument(format!(
                    "source staging of {} blocks ({len} bytes at {:#x}) is not inside the source staging region",
                    s.capacity, s.base
                )));
            }
        }
        self.open_producer(
            request,
            src_blocks,
            capability,
            consumer_tp,
            staging.map(SourceKind::Whole),
        )
    }

    /// [`Self::producer_open`] of a request staged by layer and chunk: the
    /// worker asks for a piece of `source_staging_region` for each layer of
    /// each chunk as it gathers it ([`Self::producer_stage_layer`]), in the
    /// order grouped by `group` units ([`crate::staging::source_group`] of
    /// `consumer_tp`: writes go into decode's pages only when each decode
    /// block is one group; else from the pages), and each piece goes back
    /// as soon as every write of it ended. A request then holds only its
    /// layers in flight; a layer that finds no room is written from the
    /// pages. Never into a staging grant.
    pub fn producer_open_by_layer(
        &self,
        request: RequestId,
        src_blocks: Vec<u32>,
        capability: Capability,
        consumer_tp: u32,
        group: u32,
    ) -> Result<(), RuntimeError> {
        if self.source_arena.is_none() {
            return Err(invalid_argument(
                "staging by layer needs a source staging region: open the producer without it".into(),
            ));
        }
        if !group_fits(&self.local, group) {
            return Err(invalid_argument(format!(
                "a source staging grouped by {group} units: the group must divide the {} units of a block",
                crate::staging::units(&self.local)
            )));
        }
        self.open_producer(
            request,
            src_blocks,
            capability,
            consumer_tp,
            Some(SourceKind::ByLayer { group }),
        )
    }

    fn open_producer(
        &self,
        request: RequestId,
        src_blocks: Vec<u32>,
        capability: Capability,
        consumer_tp: u32,
        staging: Option<SourceKind>,
    ) -> Result<(), RuntimeError> {
        self.local.validate_blocks(&src_blocks)?;
        if staging.is_some() && self.local.groups() > 1 {
            return Err(invalid_argument(
                "source staging for a layout of several KV cache groups: open the producer without it".into(),
            ));
        }
        let total = self.local.total_kv_heads;
        if consumer_tp == 0 || (total % consumer_tp != 0 && consumer_tp % total != 0) {
            return Err(GeometryError::TensorParallel(format!(
                "{total} KV heads neither split over nor replicate on a decode TP of {consumer_tp}"
            ))
            .into());
        }
        self.ask(move |d, ctx| d.producer_open(request, src_blocks, capability, consumer_tp, staging, ctx))
    }

    /// Prefill side, on a runtime started with `source_staging_later`:
    /// adds `segments` (`(address, bytes)`, registered memory nothing else
    /// writes: the blocks the scheduler took out of vLLM's KV cache) to the
    /// source staging region the layer pieces come from; a piece lies
    /// inside one segment. All or nothing: a segment that is empty, at 0,
    /// overflows, overlaps another or the grants' `staging_region` refuses
    /// the call and adds none. Returns the region's `(segments, bytes)`
    /// after the call.
    pub fn add_source_staging(&self, segments: &[(u64, u64)]) -> Result<(usize, u64), RuntimeError> {
        let arena = match &self.source_arena {
            Some(a) if self.cfg.source_staging_later => a,
            _ => {
                return Err(invalid_argument(
                    "source staging segments need a runtime started with source_staging_later".into(),
                ))
            }
        };
        if let Some(grants) = self.cfg.staging_region {
            if let Some(&(b, l)) = segments.iter().find(|&&seg| overlaps(seg, grants)) {
                return Err(invalid_argument(format!(
                    "a source staging segment of {l} bytes at {b:#x} overlaps staging_region"
                )));
            }
        }
        let mut a = arena.lock();
        let mut with = a.clone();
        for &(base, len) in segments {
            with.add_segment(base, len)
                .map_err(|e| invalid_argument(e.to_string()))?;
        }
        *a = with;
        Ok(a.segments())
    }

    /// `(bytes, pieces)` of the source staging region given out as layer
    /// pieces now (0 when every piece is back; a request staged by layer
    /// holds only the layers whose writes did not end).
    pub fn source_staging_in_use(&self) -> (u64, usize) {
        crate::staging::in_use(self.source_arena.as_ref())
    }

    /// A piece of the source staging region for layer `layer` of request
    /// blocks `blocks` (one chunk) of a request opened with
    /// [`Self::producer_open_by_layer`], which the worker gathers that
    /// layer of the chunk into now, in the order
    /// [`Self::producer_gather_order`] gave for the chunk: where it is, and
    /// each plane's (offset, unit bytes) in it (the staged order of
    /// `blocks.len()` blocks). Nothing else may touch it until the
    /// request's `ProducerReleased`; the runtime takes it back itself.
    /// `Ok(None)`: no room now (that layer of the chunk is written from the
    /// pages). A request not open here: `UnknownRequest`; one not staged by
    /// layer, or a layer or blocks not its own: `Geometry`.
    pub fn producer_stage_layer(
        &self,
        request: &RequestId,
        layer: u32,
        blocks: std::ops::Range<u32>,
    ) -> Result<Option<GivenPiece>, RuntimeError> {
        let group = self
            .producers
            .live_group(request)
            .ok_or_else(|| RuntimeError::UnknownRequest(request.0.clone()))?;
        Ok(super::prefill::producer::stage_layer(&group, layer, blocks)?)
    }

    /// Prefill side: whether vLLM may free `request`'s pages now, before its
    /// writes ended (a request opened with [`Self::producer_open_by_layer`]
    /// that vLLM finished). `true` once every layer of every chunk is in a
    /// layer piece (or at decode already), no write reads the pages and
    /// every producer of the group was finished: from then on nothing reads
    /// them (a write that would, under an authorization not written from
    /// staging, fails, and decode recomputes); each piece still goes back
    /// once its writes ended. Given back only while every decode
    /// authorization this runtime has seen took the pieces (one at least):
    /// before decode authorized, that is the evidence it can.
    /// [`PagesBack::Now`] the first time, [`PagesBack::Before`] when asked
    /// again; [`PagesBack::NotYet`]: ask again later; [`PagesBack::Never`]:
    /// only the release frees them (not staged by layer, or decode's
    /// authorization is written from the pages). A request not open here:
    /// `UnknownRequest`.
    pub fn producer_give_back_pages(&self, request: &RequestId) -> Result<PagesBack, RuntimeError> {
        let group = self
            .producers
            .live_group(request)
            .ok_or_else(|| RuntimeError::UnknownRequest(request.0.clone()))?;
        Ok(super::prefill::producer::give_back_pages(&group))
    }

    /// The consumer gave up `request` (e.g. the client went away) before it
    /// could authorize anything: no handshake will come. Accepted only with
    /// the request's capability ([`RuntimeError::Forbidden`] otherwise, and
    /// nothing changes). A producer already open is aborted (its writes, if
    /// any, still drain); one not yet open is aborted as soon as it opens
    /// (remembered up to the handshake timeout), and a handshake parked for it
    /// under that capability is dropped.
    ///
    /// A cancel that carries the consumer's generation is a fence (rule 10,
    /// `docs/architecture.md`): the answer says what may still be written
    /// into that generation's blocks from this rank — [`Fence::Fenced`]
    /// (nothing: no producer holds it, none has a write of it in flight,
    /// none will take it up), [`Fence::NoticeFollows`] (the producer that
    /// holds it is aborting; its notice follows its drain) or
    /// [`Fence::Held`]. A cancel for a request that ended here is answered
    /// `Fenced` (or `Forbidden` without its capability). Without a
    /// generation the answer is `None`.
    pub fn producer_cancel(&self, cancel: &Cancel) -> Result<Option<Fence>, RuntimeError> {
        self.producer_cancel_from(cancel, None)
    }

    /// [`Self::producer_cancel`] of a cancel that came from `source` (the
    /// side channel's peer): a cancel remembered before its request opens
    /// is charged to that address's share of the pre-open table
    /// ([`crate::actors::prefill::preopen`]), `Overloaded` beyond it. `None`: the
    /// process itself (the table's budget only).
    pub fn producer_cancel_from(
        &self,
        cancel: &Cancel,
        source: Option<IpAddr>,
    ) -> Result<Option<Fence>, RuntimeError> {
        let c = cancel.clone();
        match self.ask(move |d, _| d.producer_cancel(&c, source))? {
            CancelReply::Now(answer) => Ok(answer),
            CancelReply::Later(rx) => match rx.recv_timeout(FENCE_WAIT) {
                Ok(answer) => Ok(Some(answer)),
                // The producer stopped before it answered: it was released,
                // so every write it admitted ended (unless the system stopped).
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                    self.ask(|_, _| Ok(()))?;
                    Ok(Some(Fence::Fenced))
                }
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => Ok(Some(Fence::Held)),
            },
        }
    }

    /// [`Self::producer_cancel`] from the JSON the consumer sent.
    pub fn producer_cancel_json(&self, json: &str) -> Result<Option<Fence>, RuntimeError> {
        self.producer_cancel_json_from(json, None)
    }

    /// [`Self::producer_cancel_from`] from the JSON `source` sent.
    pub fn producer_cancel_json_from(
        &self,
        json: &str,
        source: Option<IpAddr>,
    ) -> Result<Option<Fence>, RuntimeError> {
        self.producer_cancel_from(&Cancel::from_json(json)?, source)
    }

    /// Appends source blocks to `request`'s block list (chunked prefill
    /// allocates blocks chunk by chunk). The whole list stays validated:
    /// in range and without duplicates.
    pub fn producer_add_blocks(&self, request: &RequestId, blocks: Vec<u32>) -> Result<(), RuntimeError> {
        let request = request.clone();
        self.ask(move |d, _| d.producer_add_blocks(&request, blocks))
    }

    /// Prefill side: the order in which the worker gathers request blocks
    /// `blocks` (one chunk of this step) into the request's source staging,
    /// before it gathers any layer of them: `order[k]` is the request block
    /// for staging slot `blocks.start + k`; `None`: the request's order.
    /// The chunk's blocks sorted by the consumer's block IDs when its
    /// authorization is written from staging into its pages
    /// ([`crate::staging::StagedPlan::gather_order`]); the writes of the
    /// chunk's layers then follow the recorded order. `pinned` (first,
    /// last): those blocks of the chunk stay in their slots (a block a chunk
    /// may share with its neighbour: every chunk's first but a request's
    /// first, every chunk's last but a request's last). A request not open
    /// here: `UnknownRequest`.
    pub fn producer_gather_order(
        &self,
        request: &RequestId,
        blocks: std::ops::Range<u32>,
        pinned: (bool, bool),
    ) -> Result<Option<Vec<u32>>, RuntimeError> {
        let group = self
            .producers
            .live_group(request)
            .ok_or_else(|| RuntimeError::UnknownRequest(request.0.clone()))?;
        Ok(super::prefill::producer::gather_order(&group, blocks, pinned))
    }

    /// Admits a consumer's handshake: validated strictly, checked against
    /// this rank's layout and against the request's capability. On any
    /// error nothing changes. It may arrive before `producer_open` (it is
    /// then parked, bounded, until then, up to the handshake timeout) or
    /// after layers are ready (they are written on arrival).
    pub fn producer_handshake(&self, handshake: Handshake) -> Result<(), RuntimeError> {
        self.producer_handshake_from(handshake, None)
    }

    /// [`Self::producer_handshake`] of a handshake that came from `source`
    /// (the side channel's peer): parked before its request opens, it is
    /// charged to that address's share of the pre-open table
    /// ([`crate::actors::prefill::preopen`]), `Overloaded` beyond it. `None`: the
    /// process itself (the table's budget only).
    pub fn producer_handshake_from(
        &self,
        handshake: Handshake,
        source: Option<IpAddr>,
    ) -> Result<(), RuntimeError> {
        handshake.validate()?;
        self.local.check_compatible(&handshake.layout)?;
        let senders = handshake.layout.expected_producers(self.local.tp_size);
        if handshake.expected_producers != senders {
            // The consumer was told another prefill TP size than this
            // instance has: it would wait for ranks that never send.
            return Err(GeometryError::TensorParallel(format!(
                "the consumer waits for {} producer rank(s), but this prefill instance (TP {}) has {} for it: \
                 the request's orbitkv_prefill_tp does not match the prefill instance",
                handshake.expected_producers, self.local.tp_size, senders
            ))
            .into());
        }
        let h = Arc::new(handshake);
        self.ask(move |d, ctx| d.producer_handshake(h, source, ctx))
    }

    /// vLLM finished `request` on this (prefill) side before it was ever
    /// scheduled (aborted while queued): its consumer, which may already
    /// have authorized blocks, is told `aborted` now — for a handshake
    /// parked under `capability`, or one arriving later — instead of
    /// holding those blocks until its deadline.
    pub fn producer_discard(
        &self,
        request: &RequestId,
        capability: &Capability,
        reason: &str,
    ) -> Result<(), RuntimeError> {
        let (request, capability, reason) = (request.clone(), capability.clone(), reason.to_string());
        self.ask(move |d, ctx| d.producer_discard(&request, &capability, &reason, ctx))
    }

    /// [`Self::producer_handshake`] from the JSON the consumer published.
    pub fn producer_handshake_json(&self, json: &str) -> Result<(), RuntimeError> {
        self.producer_handshake_json_from(json, None)
    }

    /// [`Self::producer_handshake_from`] from the JSON `source` published.
    pub fn producer_handshake_json_from(
        &self,
        json: &str,
        source: Option<IpAddr>,
    ) -> Result<(), RuntimeError> {
        self.producer_handshake_from(Handshake::from_json(json)?, source)
    }

    /// Sends `msg` to every actor of `request`'s producer group.
    fn to_producer<M>(&self, request: &RequestId, msg: M) -> Result<(), RuntimeError>
    where
        M: Message + Send + Clone + 'static,
        M::Result: Send,
        ProducerActor: Handler<M>,
    {
        let request = request.clone();
        self.ask(move |d, _| d.to_producer(&request, msg))
    }

    /// The one hand-over of a layer to the producers: layer `layer` of each
    /// `(request, blocks)`, whose kernels were launched before mark `after`
    /// (0: written already). Each member of the request's open group that
    /// is idle runs it on this thread
    /// ([`ProducerRef::try_layer_ready_inline`], see [`super::prefill::producer`]);
    /// a busy one is sent it as a message, as `busy` says. Returns the
    /// requests it could not hand the layer to, each with its error.
    fn hand_over(
        &self,
        layer: u32,
        chunks: impl IntoIterator<Item = (RequestId, Range<u32>)>,
        after: MarkSeq,
        busy: Busy,
    ) -> Result<Vec<(RequestId, RuntimeError)>, RuntimeError> {
        let (mut unknown, mut sends) = (Vec::new(), Vec::new());
        for (request, blocks) in chunks {
            let msg = LayerReady { layer, blocks, after };
            let Some(group) = self.producers.live_group(&request) else {
                unknown.push((request, msg));
                continue;
            };
            for member in group.iter() {
                if !member.try_layer_ready_inline(layer, &msg.blocks, after) {
                    match busy {
                        Busy::Direct => member.send(msg.clone()),
                        Busy::Paced => sends.push((member.clone(), msg.clone())),
                    }
                }
            }
        }
        match busy {
            // Released meanwhile (decode gone, cancelled, past its
            // deadline): nothing more to send for it.
            Busy::Direct => Ok(unknown
                .into_iter()
                .map(|(request, _)| {
                    let e = RuntimeError::UnknownRequest(request.0.clone());
                    (request, e)
                })
                .collect()),
            Busy::Paced if sends.is_empty() && unknown.is_empty() => Ok(Vec::new()),
            // One trip to the directory: the busy members' layers are sent
            // from its thread, and it says why a request is not open here.
            Busy::Paced => self.ask(move |d, _| {
                for (member, msg) in sends {
                    member.send(msg);
                }
                Ok(unknown
                    .into_iter()
                    .filter_map(|(request, msg)| d.to_producer(&request, msg).err().map(|e| (request, e)))
                    .collect())
            }),
        }
    }

    /// Prefill finished `layer` for request blocks `blocks` (indices into
    /// the request's block list). Never blocks on the transfer; with the
    /// request's producer and writer idle, the write is submitted before
    /// this returns.
    pub fn layer_ready(
        &self,
        request: &RequestId,
        layer: u32,
        blocks: Range<u32>,
    ) -> Result<(), RuntimeError> {
        check_layer(&self.local, layer)?;
        let refused = self.hand_over(layer, [(request.clone(), blocks)], 0, Busy::Paced)?;
        refused.into_iter().next().map_or(Ok(()), |(_, e)| Err(e))
    }

    /// [`Self::layer_ready`] for several requests at once: layer `layer`
    /// of each `(request, blocks)`, with at most one trip to the request
    /// directory. Returns the requests it could not admit, each with its
    /// error (a request released meanwhile:
    /// [`RuntimeError::UnknownRequest`]); the others are admitted.
    pub fn layers_ready(
        &self,
        layer: u32,
        chunks: Vec<(RequestId, Range<u32>)>,
    ) -> Result<Vec<(RequestId, RuntimeError)>, RuntimeError> {
        check_layer(&self.local, layer)?;
        self.hand_over(layer, chunks, 0, Busy::Paced)
    }

    /// Prefill side, on a GPU: the calls of one step, whose layers were
    /// launched before `mark` (`None`: written already, as for a request's
    /// finish). Numbers the mark and hands the calls to the producers, in
    /// order after every call before, without waiting; each write is
    /// submitted by its layer writer once the mark was reached
    /// (`super::prefill::gate`). A request released meanwhile is skipped; a mark
    /// whose wait fails fails the writes that wait for it.
    pub fn layers_ready_after(
        &self,
        mark: Option<Box<dyn super::prefill::gate::Mark>>,
        calls: Vec<super::prefill::gate::GateCall>,
    ) {
        use super::prefill::gate::GateCall;
        let after = mark.map_or(0, |m| self.marks.push(m));
        for call in calls {
            let known = match call {
                GateCall::Ready {
                    request,
                    layer,
                    blocks,
                } => {
                    if let Err(e) = check_layer(&self.local, layer) {
                        tracing::warn!(request = %request, error = %e, "layer gate call failed");
                        continue;
                    }
                    // Nobody waits for a step's calls: busy producers are
                    // sent the layer from here.
                    match self.hand_over(layer, [(request, blocks)], after, Busy::Direct) {
                        Ok(refused) => refused.into_iter().next().map(|(r, _)| r),
                        Err(e) => {
                            tracing::warn!(error = %e, "layer gate call failed");
                            None
                        }
                    }
                }
                GateCall::Finish { request } => match self.producers.live_group(&request) {
                    Some(g) => {
                        for member in g.iter() {
                            member.send(FinishRequest);
                        }
                        None
                    }
                    None => Some(request),
                },
            };
            if let Some(request) = known {
                tracing::debug!(request = %request, "layer gate: request already released");
            }
        }
    }

    /// Prefill side, on a GPU: layer `layer` of each `(request, blocks)`
    /// was *launched* on CUDA stream `stream` (a `cudaStream_t`) by the
    /// calling thread. Records an event there (the CUDA driver is loaded by
    /// the first call; its failure is this call's error, and nothing was
    /// handed over) and hands the calls over with it
    /// ([`Self::layers_ready_after`]), without waiting.
    pub fn layers_ready_on_stream(
        &self,
        stream: u64,
        layer: u32,
        chunks: Vec<(RequestId, Range<u32>)>,
    ) -> Result<(), RuntimeError> {
        check_layer(&self.local, layer)?;
        let events = {
            let mut events = self.cuda_events.lock();
            match events.as_ref() {
                Some(e) => e.clone(),
                None => events
                    .insert(Arc::new(crate::transport::cuda::CudaEvents::load()?))
                    .clone(),
            }
        };
        let mark = events.record(stream)?;
        let calls = chunks
            .into_iter()
            .map(|(request, blocks)| super::prefill::gate::GateCall::Ready {
                request,
                layer,
                blocks,
            })
            .collect();
        self.layers_ready_after(Some(Box::new(mark) as Box<dyn super::prefill::gate::Mark>), calls);
        Ok(())
    }

    /// Prefill side, on a GPU: [`Self::producer_finish`], taken after every
    /// layer handed to [`Self::layers_ready_on_stream`] before (the notice
    /// still goes only once their writes ended). Before any layer was
    /// handed over that way it is `producer_finish` now.
    pub fn producer_finish_after(&self, request: &RequestId) -> Result<(), RuntimeError> {
        if self.cuda_events.lock().is_none() {
            return self.producer_finish(request);
        }
        self.layers_ready_after(
            None,
            vec![super::prefill::gate::GateCall::Finish {
                request: request.clone(),
            }],
        );
        Ok(())
    }

    /// The layer marks (for tests and benchmarks: what was reached).
    pub fn layer_marks(&self) -> &super::prefill::gate::LayerMarks {
        &self.marks
    }

    /// vLLM finished `request` on the prefill side: once its writes drain,
    /// the consumer is told and the source blocks are released.
    pub fn producer_finish(&self, request: &RequestId) -> Result<(), RuntimeError> {
        self.to_producer(request, FinishRequest)
    }

    /// Aborts the producer side of `request` (writes in flight still drain).
    pub fn producer_abort(&self, request: &RequestId, reason: &str) -> Result<(), RuntimeError> {
        self.to_producer(
            request,
            AbortRequest {
                reason: reason.to_string(),
            },
        )
    }

    /// Gives producer `request` up if no consumer claimed it yet (no
    /// handshake came): vLLM finished it on the prefill side, and its blocks
    /// wait for a decode past the claim deadline or beyond the unclaimed
    /// cap. A claimed producer ignores it; either way its release is
    /// reported as usual (`RuntimeEvent::ProducerReleased`). Counted in
    /// `producers_unclaimed_released` when it ends one. A handshake for the
    /// request that arrives once its group ended (its decode claims it
    /// late) is answered `aborted` at once, so that decode fails (and
    /// recomputes) now rather than at its deadline.
    pub fn producer_release_unclaimed(&self, request: &RequestId, reason: &str) -> Result<(), RuntimeError> {
        let (request, reason) = (request.clone(), reason.to_string());
        self.ask(move |d, _| d.producer_release_unclaimed(&request, reason))
    }

    // ---- events ---------------------------------------------------------

    /// Everything that happened since the last call.
    pub fn poll_events(&self) -> Vec<RuntimeEvent> {
        self.events_rx.try_iter().map(|e| self.taken(e)).collect()
    }

    /// Waits up to `timeout` for the next event.
    pub fn next_event(&self, timeout: Duration) -> Option<RuntimeEvent> {
        self.events_rx.recv_timeout(timeout).ok().map(|e| self.taken(e))
    }

    /// An event taken from the actors: a completion's wait to be taken is
    /// timed ([`Timing::CompleteToTaken`]).
    fn taken(&self, (sent, ev): (Instant, RuntimeEvent)) -> RuntimeEvent {
        if matches!(ev, RuntimeEvent::ConsumerCompleted { .. }) {
            self.stats
                .timings
                .observe(Timing::CompleteToTaken, sent.elapsed());
        }
        ev
    }

    /// Takes the durations of request phases kept since the last take
    /// ([`crate::actors::stats::Timings`]), in µs, by timing. vLLM's stats
    /// report takes them (one reader: a second one would split them).
    pub fn take_timings(&self) -> Vec<(Timing, Vec<u32>)> {
        self.stats.timings.take()
    }

    /// Peers (decode endpoints) this rank has writer lanes for now,
    /// `writer_lanes_per_peer` threads each and one for notices (for leak checks; idle ones are
    /// reclaimed after `peer_idle_reclaim`).
    pub fn writer_peers(&self) -> usize {
        self.writers.peers()
    }

    /// Layer writes this rank's writer lanes took and have not begun to
    /// submit to Mooncake, over every peer: the prefill's write backlog
    /// (`WriterPool::queued`; a lane busy at this moment is not counted).
    pub fn writes_queued(&self) -> usize {
        self.writers.queued()
    }

    /// Requests with a live actor on either side (for leak checks).
    pub fn live_requests(&self) -> (usize, usize) {
        self.ask(|d, _| Ok(d.live_requests())).unwrap_or((0, 0))
    }

    /// Whether every producer of `request` on this rank has taken a
    /// handshake, i.e. a decode claimed it here (its actor handled it:
    /// `producer_handshake` answers once the directory accepted it, before
    /// the producer's actor took it). No live producer: `false`. The
    /// connector's workers tell their scheduler which finished requests are
    /// claimed, so its unclaimed caps count only the others.
    pub fn producer_authorized(&self, request: &RequestId) -> bool {
        self.producers
            .live_group(request)
            .is_some_and(|g| super::prefill::producer::authorized(&g))
    }

    /// For tests of the callers (feature `testing`, never in a release
    /// wheel): keeps the request directory busy for `d` (a sleep on its
    /// thread), from now, without waiting. Every call that needs the
    /// directory waits behind it, as behind a long queue.
    #[cfg(feature = "testing")]
    pub fn stall_directory(&self, d: Duration) {
        self.tell(move |_, _| std::thread::sleep(d));
    }

    /// Stops the actors and threads. Writes in flight are abandoned.
    pub fn shutdown(&mut self) {
        let was_running = self.system_thread.is_some();
        // Layers handed over from now on find no group: the directory,
        // stopped, answers `Stopped`.
        self.producers.close();
        self.publisher.stop();
        self.writers.stop();
        self.system.stop();
        if let Some(t) = self.system_thread.take() {
            let _ = t.join();
        }
        self.poller_tx.take();
        self.poller_stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.poller_thread.take() {
            let _ = t.join();
        }
        if was_running {
            // A trace installed by `ORBITKV_TRACE` or `trace::ChromeTrace::install`.
            if let Err(e) = crate::trace::flush() {
                eprintln!("orbitkv: {e}");
            }
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// How a layer reaches a producer that is busy (its inbox not empty, or a
/// write of it held back), for [`Runtime::hand_over`]: the one busy policy,
/// chosen by the caller's platform.
#[derive(Clone, Copy)]
enum Busy {
    /// Sent from the system thread, and the caller waits until it was (the
    /// CPU paths: a busy producer's layers queue at the pace the system
    /// thread takes them, as every message does).
    Paced,
    /// Sent from the caller's thread without waiting (the GPU path: nobody
    /// waits for a step's calls; each write waits for its layer's mark).
    Direct,
}
