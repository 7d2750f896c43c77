//! Actor-trace debugging: the runtime's spans exported in the Chrome trace
//! format, so that a request's life opens as a timeline in Perfetto
//! (<https://ui.perfetto.dev>) or `chrome://tracing`. `docs/tracing.md` says
//! how to read one.
//!
//! [`ChromeTraceLayer`] is a `tracing_subscriber` layer. It turns
//!
//! * every root [`names::REQUEST`] span (one per request actor: side, request
//!   ID, generation or rank) into a **lane** of its own (a Chrome `tid`, named
//!   with a `thread_name` metadata event, e.g. `consumer req-1 g1733…` or
//!   `producer req-1 r0`), holding one complete (`ph:"X"`) event for the
//!   actor's whole life;
//! * every span under it ([`names::MSG`], one per handled message, named by
//!   its `kind`) into a complete event on the same lane, nested in time inside
//!   the root; children inherit the root's `request` and `side` fields;
//! * every event (`tracing::info!` …) into an instant event (`ph:"i"`) on the
//!   lane of the span it happened in;
//! * a span that is never entered (an operation in flight, such as a layer
//!   write between submit and completion, [`names::WRITE`]) into an async
//!   slice (`ph:"b"`/`"e"`), since such operations overlap each other;
//! * anything outside a request (the notification router, the layer writers'
//!   submit calls) onto a lane per OS thread, named after the thread.
//!
//! Timestamps are µs since the trace started (`otherData.start_unix_us` holds
//! the wall clock of that instant), with ns precision.
//!
//! **Memory is bounded**: the newest [`DEFAULT_MAX_EVENTS`] finished events
//! are kept (a ring; [`ChromeTraceBuilder::max_events`] changes it), older
//! ones are dropped and counted in `otherData.dropped_events`. Each event
//! costs a few hundred bytes, so the default bound is some tens of MB.
//!
//! The library installs nothing by itself (`Runtime::start` sets no
//! subscriber): the embedding process owns its global subscriber. Ways to
//! turn the trace on:
//!
//! * [`install_global`] with [`GlobalTrace`] settings (the Python binding
//!   calls it with the connector's configuration), or [`init_from_env`]
//!   for a binary configured by `ORBITKV_TRACE=/tmp/orbitkv.json`
//!   (`ORBITKV_TRACE_FILTER`: an `EnvFilter` directive, default
//!   [`DEFAULT_FILTER`]; `ORBITKV_TRACE_MAX_EVENTS`): once per process, a
//!   global subscriber with this layer and OrbitKV's stderr warnings; the
//!   file is rewritten every 5 s while something new was recorded, when a
//!   `Runtime` shuts down, and on [`flush`].
//! * [`ChromeTrace::install`]: the same from code; the returned guard writes
//!   the file on [`ChromeTraceGuard::flush`] and on drop.
//! * [`ChromeTrace::layer`]: a layer to compose into a subscriber of your
//!   own (next to an `fmt` layer, say), plus its guard.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde_json::{json, Map, Value};
use tracing::field::{Field, Visit};
use tracing::{span, Event, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// The span names the runtime uses (the actors spell them as literals).
pub mod names {
    /// Root span of a request actor: fields `side`, `request`, and
    /// `generation` (consumer) or `rank` (producer).
    pub const REQUEST: &str = "request";
    /// One handled message, child of [`REQUEST`]; field `kind` names the message.
    pub const MSG: &str = "msg";
    /// A layer writer submitting one write to the transport.
    pub const WRITE_LAYER: &str = "write_layer";
    /// A layer writer sending a notice.
    pub const SEND_NOTICE: &str = "send_notice";
    /// One write in flight, from submit to completion (never entered: async).
    pub const WRITE: &str = "write";
}

/// Environment variable naming the trace file; see [`init_from_env`].
pub const TRACE_ENV: &str = "ORBITKV_TRACE";
/// Environment variable with an `EnvFilter` directive for the trace.
pub const TRACE_FILTER_ENV: &str = "ORBITKV_TRACE_FILTER";
/// Environment variable overriding [`DEFAULT_MAX_EVENTS`].
pub const TRACE_MAX_EVENTS_ENV: &str = "ORBITKV_TRACE_MAX_EVENTS";
/// Environment variable with an `EnvFilter` directive for what OrbitKV
/// prints to stderr (default [`DEFAULT_LOG_FILTER`]; `off` prints nothing).
pub const LOG_ENV: &str = "ORBITKV_LOG";
/// What OrbitKV prints to stderr by default: its warnings and errors (a
/// refused handshake, a failed write, a notice not sent), so that they reach
/// the vLLM server's log without a trace.
pub const DEFAULT_LOG_FILTER: &str = "off,orbitkv=warn";
/// Events kept by default (the newest ones).
pub const DEFAULT_MAX_EVENTS: usize = 100_000;
/// What an installed trace records by default: OrbitKV down to `debug`
/// (the layer writers' spans are `debug`), everything else from `warn`.
pub const DEFAULT_FILTER: &str = "warn,orbitkv=debug";
/// How often the trace installed by [`install_global`] is rewritten (when
/// something new was recorded).
pub const ENV_FLUSH_EVERY: Duration = Duration::from_secs(5);

/// Why a trace could not be set up or written.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// A process has one global subscriber, and it is taken.
    #[error(
        "a global tracing subscriber is already set. Fix: add the layer of \
         orbitkv::trace::ChromeTrace::layer(..) to that subscriber instead"
    )]
    AlreadySet,
    /// The filter directive does not parse.
    #[error("invalid trace filter {directive:?}: {reason}")]
    Filter { directive: String, reason: String },
    /// The trace has no file to go to (built with no path).
    #[error("this trace has no file: build it with a path")]
    NoPath,
    /// The trace file cannot be written.
    #[error("cannot write the trace to {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

mod install;
mod layer;
mod sink;

pub use install::*;
pub use layer::ChromeTraceLayer;

#[cfg(test)]
mod tests {
    use super::*;

    fn traced(max_events: usize, f: impl FnOnce()) -> Value {
        let (layer, guard) = ChromeTrace::builder().max_events(max_events).layer();
        let sub = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(sub, f);
        guard.to_json()
    }

    fn events(v: &Value) -> &Vec<Value> {
        v["traceEvents"].as_array().unwrap()
    }

    fn lane_names(v: &Value) -> HashMap<u64, String> {
        events(v)
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
            .map(|e| {
                (
                    e["tid"].as_u64().unwrap(),
                    e["args"]["name"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    }

    #[test]
    fn a_request_span_is_a_lane_and_its_children_nest_in_it() {
        let v = traced(100, || {
            let root = tracing::info_span!("request", side = "producer", request = %"req-1", rank = 0u32);
            {
                let _g =
                    tracing::info_span!(parent: &root, "msg", kind = "LayerReady", layer = 3u32).entered();
                tracing::info!(bytes = 7u64, "layer admitted");
            }
            let write =
                tracing::info_span!(parent: None, "write", layer = 3u32, result = tracing::field::Empty);
            write.record("result", "ok");
            drop(write);
            tracing::info!("outside any request");
            drop(root);
        });
        let lanes = lane_names(&v);
        let tid = *lanes
            .iter()
            .find(|(_, n)| n.as_str() == "producer req-1 r0")
            .expect("request lane")
            .0;
        let ev = events(&v);
        let find = |name: &str| ev.iter().find(|e| e["name"] == name && e["ph"] != "M").unwrap();
        let root = find("request");
        let msg = find("LayerReady");
        let instant = find("layer admitted");
        assert_eq!(
            (root["ph"].as_str(), root["tid"].as_u64()),
            (Some("X"), Some(tid))
        );
        assert_eq!((msg["ph"].as_str(), msg["tid"].as_u64()), (Some("X"), Some(tid)));
        assert_eq!(msg["cat"], "msg");
        assert_eq!(msg["args"]["request"], "req-1", "inherited");
        assert_eq!(msg["args"]["side"], "producer", "inherited");
        assert_eq!(msg["args"]["layer"], 3);
        assert_eq!(
            (instant["ph"].as_str(), instant["tid"].as_u64()),
            (Some("i"), Some(tid))
        );
        assert_eq!(instant["args"]["bytes"], 7);
        assert_eq!(instant["args"]["request"], "req-1");
        let (rt, rd) = (root["ts"].as_f64().unwrap(), root["dur"].as_f64().unwrap());
        let (mt, md) = (msg["ts"].as_f64().unwrap(), msg["dur"].as_f64().unwrap());
        assert!(rt <= mt && mt + md <= rt + rd, "child inside root");
        // A span never entered is async; events outside requests go to a thread lane.
        let b = ev.iter().find(|e| e["ph"] == "b").unwrap();
        let e = ev.iter().find(|e| e["ph"] == "e").unwrap();
        assert_eq!(
            (b["name"].as_str(), b["id"].as_str()),
            (Some("write"), e["id"].as_str())
        );
        assert_eq!(b["args"]["result"], "ok");
        let outside = find("outside any request");
        assert!(lanes[&outside["tid"].as_u64().unwrap()].starts_with("thread "));
        // The file order is time order.
        let ts: Vec<f64> = ev.iter().filter_map(|e| e["ts"].as_f64()).collect();
        assert!(ts.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn each_root_gets_its_own_lane_and_open_roots_are_written_as_open() {
        let v = traced(100, || {
            let a = tracing::info_span!("request", side = "consumer", request = %"r", generation = 5u64);
            let b = tracing::info_span!("request", side = "consumer", request = %"r", generation = 6u64);
            drop(a);
            std::mem::forget(b); // still open at flush time
        });
        let mut names: Vec<String> = lane_names(&v).into_values().collect();
        names.sort();
        assert_eq!(names, ["consumer r g5", "consumer r g6"]);
        let open: Vec<&Value> = events(&v).iter().filter(|e| e["args"]["open"] == true).collect();
        assert_eq!(open.len(), 1);
        assert_eq!(open[0]["args"]["generation"], 6);
    }

    #[test]
    fn memory_is_bounded_and_drops_are_counted() {
        let v = traced(5, || {
            for i in 0..12u64 {
                tracing::info!(i, "tick");
            }
        });
        let ticks: Vec<u64> = events(&v)
            .iter()
            .filter(|e| e["name"] == "tick")
            .map(|e| e["args"]["i"].as_u64().unwrap())
            .collect();
        assert_eq!(ticks, [7, 8, 9, 10, 11], "the newest are kept");
        assert_eq!(v["otherData"]["dropped_events"], 7);
    }

    #[test]
    fn flush_writes_a_file_that_parses() {
        let dir = std::env::temp_dir().join(format!("orbitkv-trace-unit-{}", std::process::id()));
        let path = dir.join("t.json");
        let (layer, guard) = ChromeTrace::layer(&path);
        let sub = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(sub, || tracing::info!("hello"));
        assert_eq!(guard.flush().unwrap(), path);
        let v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert!(events(&v).iter().any(|e| e["name"] == "hello"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
