//! The notification router: drains `take_notifications` and routes each
//! notice by request ID and generation to the consumer request actor that
//! authorized it. A notice for an unknown request or a stale generation is
//! dropped and counted, never delivered (contract rule 2).
//!
//! Mooncake has no notification callback, so the router polls: every
//! `notify_poll` while a consumer waits for a notice, every [`IDLE_POLL`]
//! while none does (a prefill-only rank, an idle decode), so that a rank
//! that expects no notice does not wake up thousands of times a second. A
//! consumer registers before its handshake leaves, so no notice it waits
//! for is ever polled at the idle pace.
//!
//! The actor's timers tick in whole milliseconds (tokio's), so a waiting
//! pace shorter than [`TIMER_TICK`] (the default, 250 µs: the notice is
//! the last step of every transfer, and a 1 ms pace put half a millisecond
//! on average under each) is kept by a thread of the router's own
//! ([`FastPoller`]) that drains notifications while a consumer waits and
//! parks while none does; the idle pace stays on the actor.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use actix::WeakAddr;

use crate::actors::messages::{NoticeArrived, NotificationsTaken, RegisterConsumer, UnregisterConsumer};
use crate::actors::stats::Stats;
use crate::ids::{Generation, RequestId};
use crate::transport::Transport;
use crate::wire::{Notice, NOTIFY_NAME};

/// Where a notice went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Delivered,
    UnknownRequest,
    StaleGeneration,
    Malformed,
}

/// How often the router drains notifications while no consumer is
/// registered (stray notices are still drained and counted).
pub const IDLE_POLL: Duration = Duration::from_millis(50);

/// The actor's timer resolution: a waiting pace shorter than this is kept by
/// a [`FastPoller`] thread (tokio rounds a timer up to its next millisecond
/// and fires an interval's missed ticks in a burst there).
pub const TIMER_TICK: Duration = Duration::from_millis(1);

/// The shortest waiting pace a [`FastPoller`] keeps (a zero one would spin).
pub const MIN_POLL: Duration = Duration::from_micros(10);

/// What the router and its fast poller share.
#[derive(Debug, Default)]
struct FastShared {
    /// A consumer waits: poll at the fast pace.
    waiting: AtomicBool,
    /// The router is gone: the thread ends.
    stop: AtomicBool,
}

/// The waiting pace on a thread (`orbitkv-notify`), for a `notify_poll`
/// below [`TIMER_TICK`]: while a consumer waits it drains
/// `take_notifications` every `every` and hands what it took to the router;
/// while none does it parks (no wake-ups). Started at the first wait; ends
/// when the router is dropped.
struct FastPoller {
    every: Duration,
    shared: Arc<FastShared>,
    thread: Option<std::thread::Thread>,
}

impl FastPoller {
    fn new(every: Duration) -> Self {
        Self {
            every: every.max(MIN_POLL),
            shared: Arc::default(),
            thread: None,
        }
    }

    /// Polls at the fast pace from now on (the thread started if need be).
    fn wait(&mut self, transport: &Arc<dyn Transport>, router: WeakAddr<NotificationRouter>) {
        self.shared.waiting.store(true, Ordering::SeqCst);
        if let Some(t) = &self.thread {
            t.unpark();
            return;
        }
        let (transport, shared, every) = (transport.clone(), self.shared.clone(), self.every);
        match std::thread::Builder::new()
            .name("orbitkv-notify".into())
            .spawn(move || fast_poll(&*transport, &router, &shared, every))
        {
            Ok(handle) => self.thread = Some(handle.thread().clone()),
            // Without the thread the actor keeps the pace (at its timer's).
            Err(e) => tracing::warn!(error = %e, "the notification poll thread did not start"),
        }
    }

    /// Parks the thread until the next [`FastPoller::wait`].
    fn idle(&self) {
        self.shared.waiting.store(false, Ordering::SeqCst);
    }

    fn running(&self) -> bool {
        self.thread.is_some()
    }
}

impl Drop for FastPoller {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = &self.thread {
            t.unpark();
        }
    }
}

/// The fast poller's loop (see [`FastPoller`]).
fn fast_poll(
    transport: &dyn Transport,
    router: &WeakAddr<NotificationRouter>,
    shared: &FastShared,
    every: Duration,
) {
    let mut failing = false;
    while !shared.stop.load(Ordering::SeqCst) {
        if !shared.waiting.load(Ordering::SeqCst) {
            // An unpark between the load and here makes park return at once.
            std::thread::park();
            continue;
        }
        match transport.take_notifications() {
            Ok(list) => {
                failing = false;
                if !list.is_empty() {
                    let Some(to) = router.upgrade() else { return }; // the router stopped
                    to.do_send(NotificationsTaken(list));
                }
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "take_notifications failed");
                }
                failing = true;
            }
        }
        std::thread::sleep(every);
    }
}

pub struct NotificationRouter {
    transport: Arc<dyn Transport>,
    poll_every: Duration,
    routes: HashMap<RequestId, HashMap<Generation, Recipient<NoticeArrived>>>,
    stats: Arc<Stats>,
    /// The actor's polling interval, and whether it is at the waiting pace (`poll_every`).
    next: Option<(SpawnHandle, bool)>,
    /// The waiting pace's thread, for a `poll_every` below [`TIMER_TICK`].
    fast: Option<FastPoller>,
}

impl NotificationRouter {
    pub fn new(transport: Arc<dyn Transport>, poll_every: Duration, stats: Arc<Stats>) -> Self {
        Self {
            transport,
            poll_every,
            routes: HashMap::new(),
            stats,
            next: None,
            fast: (poll_every < TIMER_TICK).then(|| FastPoller::new(poll_every)),
        }
    }

    /// Polls at the pace the routes call for: every `poll_every` while a
    /// consumer waits, else every [`IDLE_POLL`] (never faster than
    /// `poll_every`). Each pace is a fixed-rate interval, not a timer re-armed
    /// after each poll: tokio rounds a timer up to its next millisecond, so a
    /// re-armed 1 ms timer polls every 1-2 ms and delays every transfer's
    /// completion on decode by up to another millisecond.
    /// A waiting pace below [`TIMER_TICK`] is the [`FastPoller`]'s; the
    /// actor's interval then runs only at the idle pace.
    fn schedule(&mut self, ctx: &mut Context<Self>) {
        let waiting = !self.routes.is_empty();
        let mut on_thread = false;
        if let Some(fast) = &mut self.fast {
            if waiting {
                fast.wait(&self.transport, ctx.address().downgrade());
                on_thread = fast.running();
            } else {
                fast.idle();
            }
        }
        if let Some((handle, pace)) = self.next {
            if pace == waiting && !on_thread {
                return;
            }
            ctx.cancel_future(handle);
            self.next = None;
        }
        if on_thread {
            return;
        }
        let every = if waiting {
            self.poll_every
        } else {
            self.poll_every.max(IDLE_POLL)
        };
        let handle = ctx.run_interval(every, |router, ctx| match router.transport.take_notifications() {
            Ok(list) if !list.is_empty() => ctx.notify(NotificationsTaken(list)),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "take_notifications failed"),
        });
        self.next = Some((handle, waiting));
    }

    /// Routes one raw notification; returns where it went.
    pub fn route(&mut self, name: &str, message: &[u8]) -> Route {
        if name != NOTIFY_NAME {
            self.stats.notices_malformed.inc();
            tracing::warn!(name, "notification that is not OrbitKV's dropped");
            return Route::Malformed;
        }
        let notice = match Notice::from_json(message) {
            Ok(n) => n,
            Err(e) => {
                self.stats.notices_malformed.inc();
                tracing::warn!(error = %e, "malformed notice dropped");
                return Route::Malformed;
            }
        };
        let Some(gens) = self.routes.get(&notice.request_id) else {
            self.stats.notices_unknown_request.inc();
            tracing::info!(request = %notice.request_id, "notice for an unknown request dropped");
            return Route::UnknownRequest;
        };
        let Some(to) = gens.get(&notice.generation) else {
            self.stats.notices_stale_generation.inc();
            tracing::info!(request = %notice.request_id, generation = notice.generation.0,
                "notice for a stale generation dropped");
            return Route::StaleGeneration;
        };
        self.stats.notices_routed.inc();
        to.do_send(NoticeArrived(notice));
        Route::Delivered
    }
}

impl Actor for NotificationRouter {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.schedule(ctx);
    }
}

impl Handler<NotificationsTaken> for NotificationRouter {
    type Result = ();
    fn handle(&mut self, msg: NotificationsTaken, _ctx: &mut Context<Self>) {
        for n in msg.0 {
            self.route(&n.name, &n.message);
        }
    }
}

impl Handler<RegisterConsumer> for NotificationRouter {
    type Result = ();
    fn handle(&mut self, msg: RegisterConsumer, ctx: &mut Context<Self>) {
        self.routes
            .entry(msg.request)
            .or_default()
            .insert(msg.generation, msg.to);
        // From the idle pace to the waiting one now, not at the idle poll.
        self.schedule(ctx);
    }
}

impl Handler<UnregisterConsumer> for NotificationRouter {
    type Result = ();
    fn handle(&mut self, msg: UnregisterConsumer, ctx: &mut Context<Self>) {
        if let Some(gens) = self.routes.get_mut(&msg.request) {
            gens.remove(&msg.generation);
            if gens.is_empty() {
                self.routes.remove(&msg.request);
            }
        }
        self.schedule(ctx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::fake::FakeTransport;

    /// Records the notices routed to it (a stand-in consumer actor).
    struct Recorder(Arc<parking_lot::Mutex<Vec<Notice>>>);
    impl Actor for Recorder {
        type Context = Context<Self>;
    }
    impl Handler<NoticeArrived> for Recorder {
        type Result = ();
        fn handle(&mut self, msg: NoticeArrived, _ctx: &mut Context<Self>) {
            self.0.lock().push(msg.0);
        }
    }

    fn raw(request: &str, generation: u64) -> crate::transport::Notification {
        crate::transport::Notification {
            name: NOTIFY_NAME.into(),
            message: notice(request, generation),
        }
    }

    /// Virtual time (paused clock) until `done`, in steps of 1 ms; at most `limit`.
    async fn until(done: impl Fn() -> bool, limit: Duration) -> Duration {
        let t0 = actix::clock::Instant::now();
        while !done() && t0.elapsed() < limit {
            actix::clock::sleep(Duration::from_millis(1)).await;
        }
        t0.elapsed()
    }

    /// Delivers a notice for no registered consumer and asserts it is drained
    /// (the `count`-th unknown one) at the idle pace, not the 1 ms one.
    async fn drained_at_the_idle_pace(
        transport: &FakeTransport,
        stats: &Arc<Stats>,
        request: &str,
        count: u64,
    ) {
        actix::clock::sleep(Duration::from_millis(1)).await;
        transport.deliver([raw(request, 7)]);
        let s = stats.clone();
        let took = until(
            move || s.notices_unknown_request.get() == count,
            Duration::from_secs(1),
        )
        .await;
        assert_eq!(
            stats.notices_unknown_request.get(),
            count,
            "a notice for {request} was never drained"
        );
        assert!(
            took > Duration::from_millis(10) && took <= IDLE_POLL + Duration::from_millis(2),
            "idle: drained after {took:?}, not at the idle pace ({IDLE_POLL:?})"
        );
    }

    // The poll's pace: idle while no consumer waits (a stray notice is still
    // drained and counted, at the idle pace), at `poll_every` from the moment
    // one registers (not at the next idle poll), idle again once the last
    // one is gone.
    #[test]
    fn polls_at_the_idle_pace_until_a_consumer_registers() {
        System::new().block_on(async {
            tokio::time::pause();
            let stats = Arc::new(Stats::default());
            let transport = Arc::new(FakeTransport::new("127.0.0.1:1"));
            let router =
                NotificationRouter::new(transport.clone(), Duration::from_millis(1), stats.clone()).start();
            actix::clock::sleep(Duration::from_millis(2)).await;
            drained_at_the_idle_pace(&transport, &stats, "stray", 1).await;
            let got = Arc::new(parking_lot::Mutex::new(Vec::new()));
            router.do_send(RegisterConsumer {
                request: RequestId::new("r"),
                generation: Generation(7),
                to: Recorder(got.clone()).start().recipient(),
            });
            actix::clock::sleep(Duration::from_millis(1)).await;
            transport.deliver([raw("r", 7)]);
            let g = got.clone();
            let took = until(move || g.lock().len() == 1, Duration::from_secs(1)).await;
            assert_eq!(
                got.lock().len(),
                1,
                "the registered consumer's notice was not delivered"
            );
            assert!(
                took <= Duration::from_millis(3),
                "waiting: delivered after {took:?}, not within the 1 ms poll"
            );
            router.do_send(UnregisterConsumer {
                request: RequestId::new("r"),
                generation: Generation(7),
            });
            drained_at_the_idle_pace(&transport, &stats, "r", 2).await;
        });
    }

    /// Issue 44: a notice longer than `Notice::MAX_BYTES` is dropped as
    /// malformed before it is parsed (the same notice within the bound is
    /// parsed and routed).
    #[test]
    fn a_notice_over_its_bound_is_dropped_unparsed() {
        System::new().block_on(async {
            let stats = Arc::new(Stats::default());
            let transport = Arc::new(FakeTransport::new("127.0.0.1:1"));
            let mut router = NotificationRouter::new(transport, Duration::from_millis(1), stats.clone());
            let mut padded = notice("r", 7);
            padded.resize(Notice::MAX_BYTES, b' ');
            assert_eq!(router.route(NOTIFY_NAME, &padded), Route::UnknownRequest);
            padded.push(b' ');
            assert_eq!(router.route(NOTIFY_NAME, &padded), Route::Malformed);
            assert_eq!(stats.notices_malformed.get(), 1);
            assert_eq!(stats.notices_unknown_request.get(), 1);
        });
    }

    /// Real time until `done`, polled every 100 µs; at most `limit`.
    async fn until_real(done: impl Fn() -> bool, limit: Duration) -> Duration {
        let t0 = std::time::Instant::now();
        while !done() && t0.elapsed() < limit {
            std::thread::sleep(Duration::from_micros(100));
            actix::clock::sleep(Duration::ZERO).await;
        }
        t0.elapsed()
    }

    // A waiting pace below the timer's tick (here 100 µs) is kept by
    // the `orbitkv-notify` thread: while a consumer waits every poll comes
    // from it (none from the actor's thread), it delivers, it parks (no
    // polls) once no consumer waits while the actor keeps the idle pace, it
    // wakes for the next registration, and it ends with the router (its
    // hold on the transport goes).
    #[test]
    fn a_pace_below_the_timer_tick_polls_on_its_own_thread_and_parks_when_idle() {
        const FAST: &str = "orbitkv-notify";
        let transport = Arc::new(FakeTransport::new("127.0.0.1:1"));
        let stats = Arc::new(Stats::default());
        let t = transport.clone();
        std::thread::Builder::new()
            .name("router-test".into())
            .spawn(move || {
                System::new().block_on(async move {
                    let router =
                        NotificationRouter::new(t.clone(), Duration::from_micros(100), stats.clone()).start();
                    actix::clock::sleep(Duration::from_millis(5)).await;
                    assert_eq!(t.polls_by(FAST), 0, "no thread polls while no consumer waits");
                    for round in 0..2u64 {
                        let got = Arc::new(parking_lot::Mutex::new(Vec::new()));
                        router.do_send(RegisterConsumer {
                            request: RequestId::new("r"),
                            generation: Generation(7),
                            to: Recorder(got.clone()).start().recipient(),
                        });
                        let (tt, before) = (t.clone(), t.polls_by(FAST));
                        until_real(move || tt.polls_by(FAST) > before + 20, Duration::from_secs(10)).await;
                        let actor_polls = t.polls_by("router-test");
                        t.deliver([raw("r", 7)]);
                        let g = got.clone();
                        until_real(move || g.lock().len() == 1, Duration::from_secs(10)).await;
                        assert_eq!(got.lock().len(), 1, "round {round}: the notice was not delivered");
                        assert_eq!(
                            t.polls_by("router-test"),
                            actor_polls,
                            "round {round}: the actor polled while the thread keeps the waiting pace"
                        );
                        router.do_send(UnregisterConsumer {
                            request: RequestId::new("r"),
                            generation: Generation(7),
                        });
                        actix::clock::sleep(Duration::from_millis(5)).await;
                        let parked = t.polls_by(FAST);
                        std::thread::sleep(Duration::from_millis(30));
                        actix::clock::sleep(Duration::ZERO).await;
                        assert!(
                            t.polls_by(FAST) <= parked + 1,
                            "round {round}: the thread kept polling with no consumer waiting"
                        );
                    }
                    // A stray notice is still drained, at the idle pace, by the actor.
                    t.deliver([raw("stray", 1)]);
                    let s = stats.clone();
                    until_real(
                        move || s.notices_unknown_request.get() == 1,
                        Duration::from_secs(10),
                    )
                    .await;
                    assert_eq!(stats.notices_unknown_request.get(), 1, "the idle pace stopped");
                    System::current().stop();
                });
            })
            .expect("spawn")
            .join()
            .expect("the router test thread panicked");
        let t0 = std::time::Instant::now();
        while Arc::strong_count(&transport) > 1 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            Arc::strong_count(&transport),
            1,
            "the poll thread outlived its router"
        );
    }

    fn notice(request: &str, generation: u64) -> Vec<u8> {
        Notice {
            version: crate::wire::WIRE_VERSION,
            request_id: RequestId::new(request),
            generation: Generation(generation),
            producer_rank: crate::ids::ProducerRank(0),
            outcome: crate::wire::Outcome::Failed,
            reason: Some("x".into()),
            bytes: 0,
            staged: false,
            mac: None,
        }
        .to_json()
    }

    #[test]
    fn rule2_route_delivers_only_to_the_matching_request_and_generation() {
        System::new().block_on(async {
            let stats = Arc::new(Stats::default());
            let transport = Arc::new(FakeTransport::new("127.0.0.1:1"));
            let mut router = NotificationRouter::new(transport, Duration::from_secs(1), stats.clone());
            let got = Arc::new(parking_lot::Mutex::new(Vec::new()));
            let to = Recorder(got.clone()).start().recipient();
            router.handle(
                RegisterConsumer {
                    request: RequestId::new("r"),
                    generation: Generation(7),
                    to,
                },
                &mut Context::new(),
            );
            assert_eq!(router.route("someone-else", &notice("r", 7)), Route::Malformed);
            assert_eq!(router.route(NOTIFY_NAME, b"{not json"), Route::Malformed);
            assert_eq!(
                router.route(NOTIFY_NAME, &notice("other", 7)),
                Route::UnknownRequest
            );
            assert_eq!(router.route(NOTIFY_NAME, &notice("r", 6)), Route::StaleGeneration);
            assert_eq!(router.route(NOTIFY_NAME, &notice("r", 7)), Route::Delivered);
            router.handle(
                UnregisterConsumer {
                    request: RequestId::new("r"),
                    generation: Generation(7),
                },
                &mut Context::new(),
            );
            assert_eq!(router.route(NOTIFY_NAME, &notice("r", 7)), Route::UnknownRequest);
            actix::clock::sleep(Duration::from_millis(10)).await;
            let got = got.lock();
            assert_eq!(got.len(), 1, "only the matching notice was delivered");
            assert_eq!(
                (got[0].request_id.as_str(), got[0].generation),
                ("r", Generation(7))
            );
            assert_eq!(
                (
                    stats.notices_malformed.get(),
                    stats.notices_unknown_request.get(),
                    stats.notices_stale_generation.get(),
                    stats.notices_routed.get()
                ),
                (2, 2, 1, 1)
            );
        });
    }
}
