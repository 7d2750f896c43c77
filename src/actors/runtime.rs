//! The runtime's façade: a thread-safe, synchronous API over the actor
//! system (which runs on its own thread). This is what the Python binding
//! and the vLLM connector call.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use super::consumer::ConsumerActor;
use super::messages::*;
use super::preopen::{Parked, PreOpen, PreOpenLimits};
use super::producer::ProducerActor;
use super::router::NotificationRouter;
use super::stats::{Stats, StatsSnapshot};
use super::writer::{spawn_poller, PollJob, WriterPool};
use crate::error::{GeometryError, RuntimeError};
use crate::fsm::ConsumerMachine;
use crate::ids::generation_seed;
use crate::ids::{Capability, Generation, RequestId};
use crate::layout::KvLayout;
use crate::side_channel::client::{HandshakeJob, Publisher};
use crate::transport::Transport;
use crate::wire::{Cancel, Handshake, WIRE_VERSION};

/// Runtime settings. Defaults suit a CPU or GPU P/D pair on one network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// How long a consumer waits for all producers before failing the request.
    pub consumer_timeout: Duration,
    /// How long, after `consumer_timeout`, a consumer keeps the blocks of
    /// producers that never ended (their writes may still be queued in
    /// Mooncake, e.g. behind a cut link, and land when it heals); and how
    /// long, after `write_timeout`, a producer waits for Mooncake to end a
    /// late batch before it gives the batch up.
    pub quarantine: Duration,
    /// How long a producer waits for the consumer's handshake.
    pub handshake_timeout: Duration,
    /// How long one write batch may take before it counts as failed.
    pub write_timeout: Duration,
    /// Bytes in flight per peer before further layers queue.
    pub max_bytes_in_flight_per_peer: u64,
    /// Ranges in flight per peer; a layer with more goes out as several
    /// batches. Mooncake's TCP transport queues at most 1024 transfers per
    /// peer by default (`MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`).
    pub max_ranges_in_flight_per_peer: usize,
    /// Writers per peer (threads that submit to Mooncake in turn, sharing
    /// the per-peer budgets).
    pub writer_lanes_per_peer: usize,
    /// How often the router drains Mooncake's notifications.
    pub notify_poll: Duration,
    /// Handshakes parked and cancels remembered before their request opened
    /// on this (prefill) side, all requests together; more are refused.
    pub max_parked: usize,
    /// Approximate bytes of parked handshakes; more are refused.
    pub max_parked_bytes: usize,
    /// The deployment key that signs the handshakes and cancels this
    /// (decode) rank sends (`None`: unsigned).
    pub side_channel_key: Option<Arc<Vec<u8>>>,
    /// How long one handshake or cancel POST may take.
    pub publish_timeout: Duration,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            consumer_timeout: Duration::from_secs(120),
            quarantine: Duration::from_secs(60),
            handshake_timeout: Duration::from_secs(120),
            write_timeout: Duration::from_secs(30),
            max_bytes_in_flight_per_peer: 1 << 30,
            max_ranges_in_flight_per_peer: 768,
            writer_lanes_per_peer: 4,
            notify_poll: Duration::from_millis(1),
            max_parked: 4096,
            max_parked_bytes: 64 << 20,
            side_channel_key: None,
            publish_timeout: Duration::from_secs(10),
        }
    }
}

/// The producer side of one request on this rank: a `ProducerActor` per
/// consumer (decode) rank it sends to — one when the TP sizes are equal or
/// decode's is smaller, several when decode's is larger (each decode rank
/// holds its own copy of some of this rank's heads) — opened together,
/// driven together, reported released once all are.
struct ProducerGroup {
    capability: Capability,
    consumer_tp: u32,
    /// The request's source block list, as validated (each member keeps
    /// its own copy; this one validates what `producer_add_blocks` appends).
    src_blocks: Vec<u32>,
    /// (consumer rank, its actor)
    members: Vec<(u32, Addr<ProducerActor>)>,
    /// Members not yet released, and how the released ones ended (the worst
    /// outcome wins: failed, then aborted, then done).
    pending: usize,
    outcome: Option<(crate::wire::Outcome, Option<String>)>,
}

impl ProducerGroup {
    fn live(&self) -> bool {
        self.pending > 0 && self.members.iter().any(|(_, a)| a.connected())
    }

    fn send<M>(&self, msg: M)
    where
        M: Message + Send + Clone + 'static,
        M::Result: Send,
        ProducerActor: Handler<M>,
    {
        for (_, a) in &self.members {
            a.do_send(msg.clone());
        }
    }

    fn member(&self, consumer_rank: u32) -> Option<&Addr<ProducerActor>> {
        self.members
            .iter()
            .find(|(c, _)| *c == consumer_rank)
            .map(|(_, a)| a)
    }
}

/// The request runtime of one rank.
pub struct Runtime {
    transport: Arc<dyn Transport>,
    local: Arc<KvLayout>,
    cfg: RuntimeConfig,
    arbiter: ArbiterHandle,
    system: System,
    system_thread: Option<std::thread::JoinHandle<()>>,
    router: Addr<NotificationRouter>,
    writers: Arc<WriterPool>,
    poller_tx: Option<Sender<PollJob>>,
    poller_stop: Arc<AtomicBool>,
    poller_thread: Option<std::thread::JoinHandle<()>>,
    events_tx: Sender<RuntimeEvent>,
    events_rx: Receiver<RuntimeEvent>,
    consumers: Mutex<HashMap<RequestId, (Generation, Addr<ConsumerActor>)>>,
    /// Live producer requests: per request, one actor per consumer rank it
    /// sends to, and the capability it was opened with.
    producers: Mutex<HashMap<RequestId, ProducerGroup>>,
    /// Handshakes and cancels that arrived before their request opened here
    /// (bounded, keyed by capability, expired on a timer).
    pre_open: Arc<Mutex<PreOpen>>,
    /// Sends this (decode) rank's handshakes and cancels, off any GIL.
    publisher: Mutex<Publisher>,
    next_generation: AtomicU64,
    stats: Arc<Stats>,
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
    pub fn start(
        transport: Arc<dyn Transport>,
        local: KvLayout,
        cfg: RuntimeConfig,
    ) -> Result<Self, RuntimeError> {
        local.validate()?;
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
        let writers = Arc::new(WriterPool::new(
            transport.clone(),
            poller_tx.clone(),
            (cfg.write_timeout, cfg.quarantine),
            cfg.max_bytes_in_flight_per_peer,
            cfg.max_ranges_in_flight_per_peer,
            cfg.writer_lanes_per_peer,
            stats.clone(),
        ));
        let (events_tx, events_rx) = crossbeam_channel::unbounded();
        let publisher = Publisher::new(4, cfg.side_channel_key.clone(), cfg.publish_timeout);
        let pre_open = Arc::new(Mutex::new(PreOpen::new(PreOpenLimits {
            ttl: cfg.handshake_timeout,
            max_entries: cfg.max_parked,
            max_bytes: cfg.max_parked_bytes,
            ..PreOpenLimits::default()
        })));
        // Parked handshakes expire on a timer, not only when the next one
        // comes: an idle prefill must not keep a flood's memory.
        let (sweep, sweep_stats) = (Arc::downgrade(&pre_open), stats.clone());
        let every = (cfg.handshake_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        arbiter.spawn(async move {
            let mut tick = actix::clock::interval(every);
            loop {
                tick.tick().await;
                let Some(p) = sweep.upgrade() else { break };
                let n = p.lock().expire(Instant::now());
                sweep_stats.parked_expired.add(n as u64);
            }
        });
        Ok(Self {
            transport,
            local: Arc::new(local),
            cfg,
            arbiter,
            system,
            system_thread: Some(system_thread),
            router,
            writers,
            poller_tx: Some(poller_tx),
            poller_stop,
            poller_thread: Some(poller_thread),
            events_tx,
            events_rx,
            consumers: Mutex::new(HashMap::new()),
            producers: Mutex::new(HashMap::new()),
            pre_open,
            publisher: Mutex::new(publisher),
            next_generation: AtomicU64::new(generation_seed().0),
            stats,
        })
    }

    /// This rank's Mooncake endpoint.
    pub fn endpoint(&self) -> &str {
        self.transport.endpoint()
    }

    /// This rank's KV geometry.
    pub fn layout(&self) -> &KvLayout {
        &self.local
    }

    pub fn config(&self) -> &RuntimeConfig {
        &self.cfg
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Counts `layers` request-layers the embedding worker admitted at the
    /// end of a step because its host never reported them one by one
    /// (`layers_saved_at_wait`).
    pub fn note_layers_saved_at_wait(&self, layers: u64) {
        self.stats.layers_saved_at_wait.add(layers);
    }

    /// Counts one step's layer admitted through a layer gate after `lag`
    /// (handed over → admitted); `layers` request-layers were in it.
    pub fn note_layer_gate(&self, lag: Duration, layers: usize) {
        if layers > 0 {
            self.stats.ready_items.inc();
            self.stats.ready_lag_micros.add(lag.as_micros() as u64);
        }
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
        if producer_tp == 0 {
            return Err(GeometryError::TensorParallel("producer TP size 0".into()).into());
        }
        self.local.validate_blocks(&block_ids)?;
        let mut consumers = self.consumers.lock();
        if consumers.get(&request).is_some_and(|(_, a)| a.connected()) {
            return Err(RuntimeError::DuplicateRequest(request.0));
        }
        let generation = Generation(self.next_generation.fetch_add(1, Ordering::Relaxed));
        let expected = ConsumerMachine::expected_ranks(
            self.local.total_kv_heads,
            self.local.tp_rank,
            self.local.tp_size,
            producer_tp,
        );
        let handshake = Handshake {
            version: WIRE_VERSION,
            request_id: request.clone(),
            capability,
            generation,
            endpoint: self.transport.endpoint().to_string(),
            expected_producers: expected.len() as u32,
            first_block,
            block_ids,
            layout: (*self.local).clone(),
            // The consumer fails the request at its deadline: no producer
            // may start a write after it (see `Handshake::expires_unix_ms`).
            expires_unix_ms: crate::wire::unix_ms_now()
                .saturating_add(self.cfg.consumer_timeout.as_millis() as u64),
        };
        handshake.validate()?;
        let machine = ConsumerMachine::new(request.clone(), generation, expected);
        let actor = ConsumerActor::new(
            machine,
            self.cfg.consumer_timeout,
            self.cfg.quarantine,
            self.router.clone(),
            self.events_tx.clone(),
            self.stats.clone(),
        );
        let addr = ConsumerActor::start_in_arbiter(&self.arbiter, move |_| actor);
        // Registered before the handshake leaves this function, so no notice
        // can arrive before its route exists.
        self.router.do_send(RegisterConsumer {
            request: request.clone(),
            generation,
            to: addr.clone().recipient(),
        });
        consumers.insert(request, (generation, addr));
        Ok(handshake)
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
        let consumer = match self.consumers.lock().get(&handshake.request_id) {
            Some((g, addr)) if *g == handshake.generation => addr.clone(),
            Some((g, _)) => {
                return Err(RuntimeError::StaleGeneration {
                    request: handshake.request_id.0.clone(),
                    got: handshake.generation.0,
                    current: g.0,
                })
            }
            None => return Err(RuntimeError::UnknownRequest(handshake.request_id.0.clone())),
        };
        let body: Arc<str> = handshake.to_json().into();
        let publisher = self.publisher.lock();
        for (addr, producer_rank) in targets {
            publisher.handshake(HandshakeJob {
                addr,
                body: body.clone(),
                request: handshake.request_id.clone(),
                generation: handshake.generation,
                producer_rank,
                consumer: consumer.clone(),
            });
        }
        Ok(())
    }

    /// Sends `cancel` to the prefill side channels `addrs` (fire and forget).
    pub fn consumer_send_cancel(&self, cancel: &Cancel, addrs: Vec<String>) {
        let body: Arc<str> = cancel.to_json().into();
        let publisher = self.publisher.lock();
        for addr in addrs {
            publisher.cancel(addr, body.clone());
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
        let consumers = self.consumers.lock();
        let Some((g, addr)) = consumers.get(request) else {
            return Err(RuntimeError::UnknownRequest(request.0.clone()));
        };
        if *g != generation {
            return Err(RuntimeError::StaleGeneration {
                request: request.0.clone(),
                got: generation.0,
                current: g.0,
            });
        }
        addr.do_send(NoticeArrived(crate::wire::Notice::handshake_refused(
            request.clone(),
            generation,
            producer_rank,
            reason,
        )));
        Ok(())
    }

    /// vLLM is done with `request` on the decode side. The blocks are
    /// released (a `ConsumerReleased` event) once no producer can write into
    /// them any more.
    pub fn consumer_release(&self, request: &RequestId) -> Result<(), RuntimeError> {
        let (_, addr) = self
            .consumers
            .lock()
            .remove(request)
            .ok_or_else(|| RuntimeError::UnknownRequest(request.0.clone()))?;
        addr.do_send(ReleaseRequest);
        Ok(())
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
        self.local.validate_blocks(&src_blocks)?;
        let total = self.local.total_kv_heads;
        if consumer_tp == 0 || (total % consumer_tp != 0 && consumer_tp % total != 0) {
            return Err(GeometryError::TensorParallel(format!(
                "{total} KV heads neither split over nor replicate on a decode TP of {consumer_tp}"
            ))
            .into());
        }
        let mut producers = self.producers.lock();
        if producers.get(&request).is_some_and(ProducerGroup::live) {
            return Err(RuntimeError::DuplicateRequest(request.0));
        }
        let targets: Vec<u32> = (0..consumer_tp)
            .filter(|&c| {
                crate::layout::producer_ranks_for(total, c, consumer_tp, self.local.tp_size)
                    .contains(&self.local.tp_rank)
            })
            .collect();
        let taken = self.pre_open.lock().take(&request, &capability);
        self.stats.side_channel_forbidden.add(taken.strangers as u64);
        if targets.is_empty() {
            let _ = self.events_tx.send(RuntimeEvent::ProducerReleased {
                request,
                outcome: crate::wire::Outcome::Done,
                reason: Some("this rank holds only replicas of heads a lower rank sends".into()),
            });
            return Ok(());
        }
        let mut members = Vec::with_capacity(targets.len());
        for &c in &targets {
            let actor = ProducerActor::new(
                request.clone(),
                src_blocks.clone(),
                self.local.clone(),
                self.writers.clone(),
                self.cfg.handshake_timeout,
                self.events_tx.clone(),
                self.stats.clone(),
            );
            members.push((c, ProducerActor::start_in_arbiter(&self.arbiter, move |_| actor)));
        }
        let group = ProducerGroup {
            capability,
            consumer_tp,
            src_blocks,
            pending: members.len(),
            members,
            outcome: None,
        };
        for h in taken.handshakes {
            match group.member(h.layout.tp_rank) {
                Some(a) if h.layout.tp_size == consumer_tp => a.do_send(HandshakeArrived(h)),
                _ => self.stats.events_dropped.inc(),
            }
        }
        if let Some(reason) = taken.cancel {
            // No consumer will send a handshake: release at once instead of
            // holding the source blocks until the deadline.
            group.send(AbortRequest { reason });
        }
        producers.insert(request, group);
        Ok(())
    }

    /// The consumer gave up `request` (e.g. the client went away) before it
    /// could authorize anything: no handshake will come. Accepted only with
    /// the request's capability ([`RuntimeError::Forbidden`] otherwise, and
    /// nothing changes). A producer already open is aborted (its writes, if
    /// any, still drain); one not yet open is aborted as soon as it opens
    /// (remembered up to the handshake timeout), and a handshake parked for it
    /// under that capability is dropped.
    pub fn producer_cancel(&self, cancel: &Cancel) -> Result<(), RuntimeError> {
        let request = &cancel.request_id;
        let reason = format!("cancelled by the consumer: {}", cancel.reason);
        let producers = self.producers.lock();
        match producers.get(request) {
            Some(group) if group.live() => {
                self.check_capability(request, &group.capability, &cancel.capability)?;
                group.send(AbortRequest { reason });
                Ok(())
            }
            _ => self
                .pre_open
                .lock()
                .cancel(request, &cancel.capability, reason)
                .inspect_err(|_| self.stats.side_channel_overloaded.inc()),
        }
    }

    /// [`Self::producer_cancel`] from the JSON the consumer sent.
    pub fn producer_cancel_json(&self, json: &str) -> Result<(), RuntimeError> {
        self.producer_cancel(&Cancel::from_json(json)?)
    }

    fn check_capability(
        &self,
        request: &RequestId,
        own: &Capability,
        got: &Capability,
    ) -> Result<(), RuntimeError> {
        if own.matches(got) {
            return Ok(());
        }
        self.stats.side_channel_forbidden.inc();
        Err(RuntimeError::Forbidden {
            request: request.0.clone(),
            reason: "the capability does not match the request's".into(),
        })
    }

    /// Appends source blocks to `request`'s block list (chunked prefill
    /// allocates blocks chunk by chunk). The whole list stays validated:
    /// in range and without duplicates.
    pub fn producer_add_blocks(&self, request: &RequestId, blocks: Vec<u32>) -> Result<(), RuntimeError> {
        let mut producers = self.producers.lock();
        let Some(group) = producers.get_mut(request).filter(|g| g.live()) else {
            return Err(RuntimeError::UnknownRequest(request.0.clone()));
        };
        let mut all = group.src_blocks.clone();
        all.extend_from_slice(&blocks);
        self.local.validate_blocks(&all)?;
        group.src_blocks = all;
        group.send(SourceBlocksAdded(blocks));
        Ok(())
    }

    /// Admits a consumer's handshake: validated strictly, checked against
    /// this rank's layout and against the request's capability. On any
    /// error nothing changes. It may arrive before `producer_open` (it is
    /// then parked, bounded, until then, up to the handshake timeout) or
    /// after layers are ready (they are written on arrival).
    pub fn producer_handshake(&self, handshake: Handshake) -> Result<(), RuntimeError> {
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
        let producers = self.producers.lock();
        match producers.get(&h.request_id) {
            Some(group) if group.live() => {
                self.check_capability(&h.request_id, &group.capability, &h.capability)?;
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
                addr.do_send(HandshakeArrived(h));
                Ok(())
            }
            _ => {
                let parked = self.pre_open.lock().park(h.clone());
                match parked.inspect_err(|_| self.stats.side_channel_overloaded.inc())? {
                    Parked::Waiting | Parked::Stale => {}
                    Parked::Discarded(reason) => self.answer_aborted(h, reason),
                }
                Ok(())
            }
        }
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
        let producers = self.producers.lock();
        if producers.get(request).is_some_and(ProducerGroup::live) {
            return Err(RuntimeError::DuplicateRequest(request.0.clone()));
        }
        let reason = format!("prefill gave the request up: {reason}");
        let parked = self
            .pre_open
            .lock()
            .discard(request, capability, reason.clone())?;
        for h in parked {
            self.answer_aborted(h, reason.clone());
        }
        Ok(())
    }

    /// Tells the consumer of `h` that this rank sends nothing: a producer
    /// with no source blocks, aborted at once, notifies `aborted` and ends.
    fn answer_aborted(&self, h: Arc<Handshake>, reason: String) {
        let actor = ProducerActor::new(
            h.request_id.clone(),
            Vec::new(),
            self.local.clone(),
            self.writers.clone(),
            self.cfg.handshake_timeout,
            self.events_tx.clone(),
            self.stats.clone(),
        );
        let addr = ProducerActor::start_in_arbiter(&self.arbiter, move |_| actor);
        addr.do_send(HandshakeArrived(h));
        addr.do_send(AbortRequest { reason });
    }

    /// [`Self::producer_handshake`] from the JSON the consumer published.
    pub fn producer_handshake_json(&self, json: &str) -> Result<(), RuntimeError> {
        self.producer_handshake(Handshake::from_json(json)?)
    }

    /// Sends `msg` to every actor of `request`'s producer group.
    fn to_producer<M>(&self, request: &RequestId, msg: M) -> Result<(), RuntimeError>
    where
        M: Message + Send + Clone + 'static,
        M::Result: Send,
        ProducerActor: Handler<M>,
    {
        match self.producers.lock().get(request) {
            Some(group) if group.live() => {
                group.send(msg);
                Ok(())
            }
            _ => Err(RuntimeError::UnknownRequest(request.0.clone())),
        }
    }

    /// Prefill finished `layer` for request blocks `blocks` (indices into
    /// the request's block list). Never blocks on the transfer.
    pub fn layer_ready(
        &self,
        request: &RequestId,
        layer: u32,
        blocks: Range<u32>,
    ) -> Result<(), RuntimeError> {
        if layer as usize >= self.local.layers.len() {
            return Err(GeometryError::LayerOutOfRange {
                layer,
                num_layers: self.local.layers.len(),
            }
            .into());
        }
        self.to_producer(request, LayerReady { layer, blocks })
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

    // ---- events ---------------------------------------------------------

    /// Folds the releases of a producer group's actors into one event,
    /// emitted when the last one released (the worst outcome wins); other
    /// events pass unchanged.
    fn note(&self, ev: RuntimeEvent) -> Option<RuntimeEvent> {
        let RuntimeEvent::ProducerReleased {
            request,
            outcome,
            reason,
        } = ev
        else {
            return Some(ev);
        };
        let mut producers = self.producers.lock();
        let Some(group) = producers.get_mut(&request) else {
            return Some(RuntimeEvent::ProducerReleased {
                request,
                outcome,
                reason,
            });
        };
        use crate::wire::Outcome::*;
        let rank = |o: crate::wire::Outcome| match o {
            Done => 0,
            Aborted => 1,
            Failed => 2,
        };
        if group
            .outcome
            .as_ref()
            .map_or(true, |(o, _)| rank(outcome) > rank(*o))
        {
            group.outcome = Some((outcome, reason));
        }
        group.pending = group.pending.saturating_sub(1);
        if group.pending > 0 {
            return None;
        }
        let (outcome, reason) = group.outcome.take().expect("set above");
        producers.remove(&request);
        Some(RuntimeEvent::ProducerReleased {
            request,
            outcome,
            reason,
        })
    }

    /// Everything that happened since the last call.
    pub fn poll_events(&self) -> Vec<RuntimeEvent> {
        let raw: Vec<RuntimeEvent> = self.events_rx.try_iter().collect();
        raw.into_iter().filter_map(|e| self.note(e)).collect()
    }

    /// Waits up to `timeout` for the next event.
    pub fn next_event(&self, timeout: Duration) -> Option<RuntimeEvent> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ev = self.events_rx.recv_timeout(left).ok()?;
            if let Some(ev) = self.note(ev) {
                return Some(ev);
            }
        }
    }

    /// Requests with a live actor on either side (for leak checks).
    pub fn live_requests(&self) -> (usize, usize) {
        let c = self
            .consumers
            .lock()
            .values()
            .filter(|(_, a)| a.connected())
            .count();
        let p = self.producers.lock().values().filter(|g| g.live()).count();
        (c, p)
    }

    /// Stops the actors and threads. Writes in flight are abandoned.
    pub fn shutdown(&mut self) {
        let was_running = self.system_thread.is_some();
        self.publisher.lock().stop();
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
