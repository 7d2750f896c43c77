//! The request actors and the request directory under paused time (tokio's
//! test clock), over the crate's transport test double (`FakeTransport`):
//! the deadlines of the safety contract at their production defaults
//! (consumer 120 s, quarantine 60 s, handshake 120 s) run in milliseconds
//! of wall time, exactly, with no sleep in the test. The same rules are
//! tested against real Mooncake with short timeouts elsewhere
//! (`tests/runtime_loopback.rs`, `tests/parked_handshake.rs`).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use actix::clock::Instant;
use actix::prelude::*;
use crossbeam_channel::Receiver;
use orbitkv::actors::decode::consumer::{ConsumerActor, FenceTargets};
use orbitkv::actors::decode::publisher::Publisher;
use orbitkv::actors::decode::router::NotificationRouter;
use orbitkv::actors::directory::{Call, RequestDirectory};
use orbitkv::actors::messages::{EventSender, ProducerEnded, ReleaseRequest};
use orbitkv::actors::prefill::producer::ProducerShared;
use orbitkv::actors::prefill::writer::{spawn_poller, WriterPool};
use orbitkv::actors::stats::Stats;
use orbitkv::fsm::ConsumerMachine;
use orbitkv::testing::capability as cap;
use orbitkv::transport::fake::FakeTransport;
use orbitkv::{Generation, Handshake, KvLayout, ProducerRank, RequestId, RuntimeConfig, RuntimeEvent};

/// Runs `test` on a fresh actix system whose clock is paused (it jumps to
/// the next timer whenever every task waits).
fn paused(test: impl std::future::Future<Output = ()>) {
    System::new().block_on(async {
        tokio::time::pause();
        test.await
    });
}

/// The next runtime event, waiting on the paused clock (each nap lets the
/// actors run and the clock jump); `None` after `within` of virtual time.
async fn next(
    rx: &Receiver<(std::time::Instant, RuntimeEvent)>,
    within: Duration,
) -> Option<(RuntimeEvent, Instant)> {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if let Ok((_, ev)) = rx.try_recv() {
            return Some((ev, Instant::now()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// One rank's directory with its router and writers, on the current system.
struct Rank {
    directory: Addr<RequestDirectory>,
    events: Receiver<(std::time::Instant, RuntimeEvent)>,
    stats: Arc<Stats>,
    poller_stop: Arc<AtomicBool>,
}

impl Drop for Rank {
    fn drop(&mut self) {
        self.poller_stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Rank {
    fn new(endpoint: &str, cfg: RuntimeConfig) -> Self {
        let transport = Arc::new(FakeTransport::new(endpoint));
        let stats = Arc::new(Stats::default());
        let router =
            NotificationRouter::new(transport.clone(), Duration::from_millis(100), stats.clone()).start();
        let (poll_tx, poll_rx) = crossbeam_channel::unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        spawn_poller(transport.clone(), poll_rx, stop.clone(), stats.clone());
        let writers = Arc::new(WriterPool::new(
            transport,
            (
                poll_tx,
                Arc::new(orbitkv::actors::prefill::gate::LayerMarks::new(stats.clone())),
            ),
            (cfg.write_timeout, cfg.quarantine),
            cfg.max_bytes_in_flight_per_peer,
            cfg.max_ranges_in_flight_per_peer
                .unwrap_or(orbitkv::transport::kind::DEFAULT_RANGES_IN_FLIGHT),
            1,
            cfg.inline_submit_max_ranges,
            cfg.peer_idle_reclaim,
            stats.clone(),
        ));
        let (tx, events) = crossbeam_channel::unbounded();
        let shared = Arc::new(ProducerShared {
            local: Arc::new(layout()),
            writers,
            handshake_timeout: cfg.handshake_timeout,
            staging_min_ranges: cfg.staging_min_ranges,
            stats: stats.clone(),
            buffers: Default::default(),
            source_arena: None,
            decode_staged: Default::default(),
            pieces_whole_requests: cfg.pieces_whole_requests,
        });
        let publisher = Arc::new(Publisher::new(
            1,
            None,
            Duration::from_secs(1),
            stats.clone(),
            Arc::new(orbitkv::HttpPost),
        ));
        let directory = RequestDirectory::new(
            shared,
            cfg,
            router,
            EventSender::new(tx),
            Default::default(),
            publisher,
        )
        .start();
        Self {
            directory,
            events,
            stats,
            poller_stop: stop,
        }
    }

    /// Runs `f` on the directory and returns its answer.
    async fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut RequestDirectory, &mut Context<RequestDirectory>) -> R + Send + 'static,
    ) -> R {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.directory
            .send(Call(Box::new(move |d, ctx| {
                let _ = tx.send(f(d, ctx));
            })))
            .await
            .expect("the directory runs");
        rx.try_recv().expect("answered")
    }
}

/// A consumer actor of `request` (generation 7, expecting producer ranks
/// `ranks`, the production deadlines) over the transport double, with
/// `staging`; its counters and its event channel. Inside the actor system.
fn start_consumer(
    request: &str,
    ranks: &[u32],
    staging: Option<orbitkv::actors::decode::consumer::ConsumerStaging>,
) -> (
    Addr<ConsumerActor>,
    Arc<Stats>,
    Receiver<(std::time::Instant, RuntimeEvent)>,
) {
    let cfg = RuntimeConfig::default();
    let transport = Arc::new(FakeTransport::new("127.0.0.1:1"));
    let stats = Arc::new(Stats::default());
    let router = NotificationRouter::new(transport, Duration::from_millis(100), stats.clone()).start();
    let (tx, rx) = crossbeam_channel::unbounded();
    let machine = ConsumerMachine::new(
        RequestId::new(request),
        Generation(7),
        ranks.iter().map(|&r| ProducerRank(r)).collect(),
        notice_key(),
    );
    let fence = FenceTargets {
        publisher: Arc::new(Publisher::new(
            1,
            None,
            Duration::from_secs(1),
            stats.clone(),
            Arc::new(orbitkv::HttpPost),
        )),
        capability: cap(),
        consumer_rank: 0,
        targets: Vec::new(),
    };
    let consumer = ConsumerActor::new(
        machine,
        (cfg.consumer_timeout, cfg.quarantine),
        router,
        EventSender::new(tx),
        stats.clone(),
        staging,
        fence,
    )
    .start();
    (consumer, stats, rx)
}

#[test]
fn a_silent_producer_fails_the_consumer_at_its_deadline_and_holds_the_blocks_for_the_quarantine() {
    paused(async {
        let cfg = RuntimeConfig::default();
        let (timeout, quarantine) = (cfg.consumer_timeout, cfg.quarantine);
        assert_eq!(
            (timeout, quarantine),
            (Duration::from_secs(120), Duration::from_secs(60))
        );
        let t0 = Instant::now();
        let wall = std::time::Instant::now();
        let (consumer, stats, rx) = start_consumer("silent", &[0], None);

        let (ev, at) = next(&rx, Duration::from_secs(600))
            .await
            .expect("failed at the deadline");
        assert!(
            matches!(&ev, RuntimeEvent::ConsumerFailed { held: true, .. }),
            "{ev:?}"
        );
        let failed_after = at - t0;
        assert!(
            failed_after >= timeout && failed_after < timeout + Duration::from_secs(1),
            "failed {failed_after:?} after opening, not at the {timeout:?} deadline"
        );
        // vLLM lets go of the request now; the blocks stay held.
        consumer.do_send(ReleaseRequest);
        let (ev, at) = next(&rx, Duration::from_secs(600))
            .await
            .expect("freed after the quarantine");
        assert!(matches!(ev, RuntimeEvent::ConsumerReleased { .. }), "{ev:?}");
        let released_after = at - t0;
        assert!(
            released_after >= timeout + quarantine && released_after < timeout + quarantine + Duration::from_secs(1),
            "released {released_after:?} after opening: the blocks must stay held until the quarantine is over"
        );
        assert_eq!(stats.consumers_quarantine_expired.get(), 1);
        assert!(
            wall.elapsed() < Duration::from_secs(10),
            "paused time ran slow: {:?}",
            wall.elapsed()
        );
    });
}

/// Every rank's layout: 2 layers of 8 blocks, TP 1.
fn layout() -> KvLayout {
    KvLayout::packed(0x10_0000, 2, 8, 4096, (0, 1), 1)
}

/// A consumer's handshake of `request` for blocks 1 and 2, valid until an
/// hour from now.
fn handshake_for(request: &str) -> Handshake {
    let h = Handshake {
        tokens: 0,
        version: orbitkv::wire::WIRE_VERSION,
        request_id: RequestId::new(request),
        capability: cap(),
        generation: Generation(5),
        sequence: orbitkv::ids::Sequence(5),
        notice_key: orbitkv::ids::NoticeKey::random(),
        endpoint: "127.0.0.1:2".into(),
        expected_producers: 1,
        first_block: 0,
        block_ids: vec![1, 2],
        layout: layout(),
        expires_unix_ms: orbitkv::wire::unix_ms_now() + 3_600_000,
        staging: None,
    };
    h.validate().expect("a valid handshake");
    h
}

#[test]
fn a_parked_handshake_expires_at_the_handshake_deadline_and_is_never_taken_after() {
    paused(async {
        let cfg = RuntimeConfig::default();
        let ttl = cfg.handshake_timeout;
        let producer = Rank::new("127.0.0.1:3", cfg);
        let h = Arc::new(handshake_for("late-open"));
        producer
            .call(move |d, ctx| d.producer_handshake(h, None, ctx))
            .await
            .expect("parked");
        // Just before the deadline it still waits; just after, the timer
        // dropped it.
        tokio::time::sleep(ttl - Duration::from_secs(2)).await;
        assert_eq!(producer.stats.parked_expired.get(), 0);
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(producer.stats.parked_expired.get(), 1);
        // Opening now takes nothing: no handshake, so the producer waits for
        // one and gives up at its own deadline, writing nothing.
        let t0 = Instant::now();
        producer
            .call(|d, ctx| d.producer_open(RequestId::new("late-open"), vec![0, 1], cap(), 1, None, ctx))
            .await
            .expect("producer_open");
        let (ev, at) = next(&producer.events, Duration::from_secs(600))
            .await
            .expect("released at the handshake deadline");
        assert!(
            matches!(
                &ev,
                RuntimeEvent::ProducerReleased {
                    outcome: orbitkv::Outcome::Failed,
                    ..
                }
            ),
            "{ev:?}"
        );
        assert!(
            at - t0 >= ttl && at - t0 < ttl + Duration::from_secs(1),
            "{:?}",
            at - t0
        );
        assert_eq!(producer.stats.bytes_written.get(), 0);
        assert_eq!(producer.call(|d, _| d.live_requests()).await, (0, 0));
    });
}

#[test]
fn a_cancel_before_the_open_releases_the_producer_at_once_and_a_stranger_cannot_cancel() {
    paused(async {
        let producer = Rank::new("127.0.0.1:4", RuntimeConfig::default());
        let stranger = orbitkv::Cancel::new(
            RequestId::new("c"),
            orbitkv::Capability::parse(&"f".repeat(32)).unwrap(),
            "x",
        );
        let cancel = orbitkv::Cancel::new(RequestId::new("c"), cap(), "client left");
        producer
            .call(move |d, _| d.producer_cancel(&stranger, None))
            .await
            .expect("a stranger's cancel waits beside, under its own capability");
        producer
            .call(move |d, _| d.producer_cancel(&cancel, None))
            .await
            .expect("remembered");
        let t0 = Instant::now();
        producer
            .call(|d, ctx| d.producer_open(RequestId::new("c"), vec![0], cap(), 1, None, ctx))
            .await
            .expect("producer_open");
        let (ev, at) = next(&producer.events, Duration::from_secs(600))
            .await
            .expect("released");
        assert!(
            matches!(&ev, RuntimeEvent::ProducerReleased { outcome: orbitkv::Outcome::Aborted, reason: Some(r), .. } if r.contains("client left")),
            "{ev:?}"
        );
        assert!(
            at - t0 < Duration::from_secs(1),
            "held {:?} after a cancel",
            at - t0
        );
        assert_eq!(
            producer.stats.side_channel_forbidden.get(),
            1,
            "the stranger's entry counted"
        );
    });
}

#[test]
fn a_release_naming_an_unknown_group_never_releases_the_live_one() {
    paused(async {
        let producer = Rank::new("127.0.0.1:5", RuntimeConfig::default());
        producer
            .call(|d, ctx| d.producer_open(RequestId::new("g"), vec![0], cap(), 1, None, ctx))
            .await
            .expect("producer_open");
        // A stray release under a group token the directory never gave out.
        producer
            .directory
            .send(ProducerEnded {
                group: 999,
                request: RequestId::new("g"),
                outcome: orbitkv::Outcome::Done,
                reason: None,
            })
            .await
            .expect("the directory runs");
        assert!(
            producer.events.try_recv().is_err(),
            "a stray release reached the worker"
        );
        assert_eq!(producer.stats.events_dropped.get(), 1);
        assert_eq!(producer.call(|d, _| d.live_requests()).await, (0, 1));
        // The live group is released once, by its own member (here: no
        // handshake, so at the handshake deadline).
        let (ev, _) = next(&producer.events, Duration::from_secs(600))
            .await
            .expect("released");
        assert!(
            matches!(&ev, RuntimeEvent::ProducerReleased { request, .. } if request.as_str() == "g"),
            "{ev:?}"
        );
        assert!(
            next(&producer.events, Duration::from_secs(5)).await.is_none(),
            "released twice"
        );
    });
}

/// A done notice of producer `rank` for `generation` of request "staged".
fn done_notice(rank: u32, generation: u64, staged: bool) -> orbitkv::Notice {
    orbitkv::Notice {
        version: orbitkv::wire::WIRE_VERSION,
        request_id: RequestId::new("staged"),
        generation: Generation(generation),
        producer_rank: ProducerRank(rank),
        outcome: orbitkv::Outcome::Done,
        reason: None,
        bytes: 1,
        staged,
        mac: None,
    }
    .sign(&notice_key())
}

/// The notice key of the consumers these tests build by hand.
fn notice_key() -> orbitkv::NoticeKey {
    orbitkv::NoticeKey::parse(&"3c".repeat(32)).expect("64 hex digits")
}

#[test]
fn only_the_first_done_notice_of_an_expected_rank_says_what_to_scatter_and_the_grant_outlives_nothing() {
    use orbitkv::actors::decode::consumer::ConsumerStaging;
    use orbitkv::actors::messages::NoticeArrived;
    use orbitkv::staging::arena::StagingArena;
    use orbitkv::staging::{staged_bytes, StagingGrant};
    paused(async {
        // decode TP 1 with 2 KV heads, prefill TP 2: rank r sends head r
        let local = Arc::new(KvLayout::packed(0x10_0000, 2, 8, 4096, (0, 1), 2));
        let arena = Arc::new(parking_lot::Mutex::new(
            StagingArena::new(0x100_0000, 1 << 20).unwrap(),
        ));
        let len = staged_bytes(&local, 4).unwrap();
        let grant = StagingGrant {
            base: arena.lock().alloc(len).unwrap(),
            len,
            group: 1,
        };
        let staging = ConsumerStaging {
            grant,
            arena: arena.clone(),
            blocks: 4,
            producer_tp: 2,
            layout: local,
        };
        let (consumer, _stats, rx) = start_consumer("staged", &[0, 1], Some(staging));
        // rank 0 wrote pages directly; its duplicate "staged" notice, a
        // stranger's and a stale generation's must change nothing
        for n in [
            done_notice(0, 7, false),
            done_notice(0, 7, true),
            done_notice(5, 7, true),
            done_notice(1, 6, true),
        ] {
            consumer.do_send(NoticeArrived(n));
        }
        assert_eq!(next(&rx, Duration::from_secs(1)).await, None);
        consumer.do_send(NoticeArrived(done_notice(1, 7, true)));
        let (ev, _) = next(&rx, Duration::from_secs(1)).await.expect("completed");
        match ev {
            RuntimeEvent::ConsumerCompleted { staged: Some(s), .. } => {
                // only rank 1's head (unit 1); rank 0 wrote its pages
                assert_eq!((s.grant, s.blocks), (grant, 4));
                assert_eq!(
                    s.units.iter().map(|u| (u.start, u.end)).collect::<Vec<_>>(),
                    [(1, 2)]
                );
            }
            other => panic!("{other:?}"),
        }
        // the grant is held until the consumer is released, then returned
        assert_eq!(arena.lock().pieces(), 1);
        consumer.do_send(ReleaseRequest);
        let (ev, _) = next(&rx, Duration::from_secs(1)).await.expect("released");
        assert!(matches!(ev, RuntimeEvent::ConsumerReleased { .. }), "{ev:?}");
        let a = arena.lock();
        assert_eq!((a.pieces(), a.used_bytes()), (0, 0));
    });
}
