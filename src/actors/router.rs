//! The notification router: drains `take_notifications` and routes each
//! notice by request ID and generation to the consumer request actor that
//! authorized it. A notice for an unknown request or a stale generation is
//! dropped and counted, never delivered (contract rule 2).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;

use super::messages::{NoticeArrived, NotificationsTaken, RegisterConsumer, UnregisterConsumer};
use super::stats::Stats;
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

pub struct NotificationRouter {
    transport: Arc<dyn Transport>,
    poll_every: Duration,
    routes: HashMap<RequestId, BTreeMap<Generation, Recipient<NoticeArrived>>>,
    stats: Arc<Stats>,
}

impl NotificationRouter {
    pub fn new(transport: Arc<dyn Transport>, poll_every: Duration, stats: Arc<Stats>) -> Self {
        Self {
            transport,
            poll_every,
            routes: HashMap::new(),
            stats,
        }
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
        ctx.run_interval(self.poll_every, |router, ctx| {
            match router.transport.take_notifications() {
                Ok(list) if !list.is_empty() => ctx.notify(NotificationsTaken(list)),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "take_notifications failed"),
            }
        });
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
    fn handle(&mut self, msg: RegisterConsumer, _ctx: &mut Context<Self>) {
        self.routes
            .entry(msg.request)
            .or_default()
            .insert(msg.generation, msg.to);
    }
}

impl Handler<UnregisterConsumer> for NotificationRouter {
    type Result = ();
    fn handle(&mut self, msg: UnregisterConsumer, _ctx: &mut Context<Self>) {
        if let Some(gens) = self.routes.get_mut(&msg.request) {
            gens.remove(&msg.generation);
            if gens.is_empty() {
                self.routes.remove(&msg.request);
            }
        }
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

    fn notice(request: &str, generation: u64) -> Vec<u8> {
        Notice::handshake_refused(RequestId::new(request), Generation(generation), 0, "x").to_json()
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
