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

// ---------------------------------------------------------------- sink

/// A lane: a Chrome "thread" (tid) in the viewer.
#[derive(Debug)]
struct Lane {
    tid: u64,
    name: String,
    /// For request lanes: the root's `side` and `request`, inherited by children.
    side: Option<Value>,
    request: Option<Value>,
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    Complete { dur_ns: u64 },
    Async { dur_ns: u64, id: u64 },
    Instant,
}

/// One finished event.
#[derive(Debug)]
struct Rec {
    phase: Phase,
    ts_ns: u64,
    name: String,
    cat: &'static str,
    lane: Arc<Lane>,
    args: Map<String, Value>,
}

/// A root span still open (written, marked `open`, if the trace is flushed
/// before the actor ends).
struct OpenRoot {
    ts_ns: u64,
    lane: Arc<Lane>,
    args: Map<String, Value>,
}

struct Inner {
    events: VecDeque<Rec>,
    dropped: u64,
    threads: HashMap<ThreadId, Arc<Lane>>,
    open_roots: HashMap<u64, OpenRoot>,
}

/// What a layer and its guard share.
struct Sink {
    start: Instant,
    start_unix_us: u64,
    path: Option<PathBuf>,
    max_events: usize,
    next_tid: AtomicU64,
    next_async: AtomicU64,
    dirty: AtomicBool,
    inner: Mutex<Inner>,
}

impl Sink {
    fn new(path: Option<PathBuf>, max_events: usize) -> Self {
        Self {
            start: Instant::now(),
            start_unix_us: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_micros() as u64)
                .unwrap_or(0),
            path,
            max_events: max_events.max(1),
            next_tid: AtomicU64::new(1),
            next_async: AtomicU64::new(1),
            dirty: AtomicBool::new(false),
            inner: Mutex::new(Inner {
                events: VecDeque::new(),
                dropped: 0,
                threads: HashMap::new(),
                open_roots: HashMap::new(),
            }),
        }
    }

    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn push(&self, rec: Rec) {
        let mut inner = self.inner.lock();
        if inner.events.len() >= self.max_events {
            inner.events.pop_front();
            inner.dropped += 1;
        }
        inner.events.push_back(rec);
        self.dirty.store(true, Ordering::Relaxed);
    }

    fn thread_lane(&self) -> Arc<Lane> {
        let t = std::thread::current();
        let mut inner = self.inner.lock();
        inner
            .threads
            .entry(t.id())
            .or_insert_with(|| {
                Arc::new(Lane {
                    tid: self.next_tid.fetch_add(1, Ordering::Relaxed),
                    // Two runtimes have threads of one name: the id tells them apart.
                    name: {
                        let id: String = format!("{:?}", t.id())
                            .chars()
                            .filter(|c| c.is_ascii_digit())
                            .collect();
                        format!("thread {} #{id}", t.name().unwrap_or("unnamed"))
                    },
                    side: None,
                    request: None,
                })
            })
            .clone()
    }

    /// A fresh lane for a request actor's root span.
    fn request_lane(&self, args: &Map<String, Value>) -> Arc<Lane> {
        let text = |k: &str| match args.get(k) {
            Some(Value::String(s)) => Some(s.clone()),
            Some(v) => Some(v.to_string()),
            None => None,
        };
        let mut name = format!(
            "{} {}",
            text("side").unwrap_or_default(),
            text("request").unwrap_or_default()
        );
        if let Some(g) = text("generation") {
            name.push_str(&format!(" g{g}"));
        }
        if let Some(r) = text("rank") {
            name.push_str(&format!(" r{r}"));
        }
        Arc::new(Lane {
            tid: self.next_tid.fetch_add(1, Ordering::Relaxed),
            name,
            side: args.get("side").cloned(),
            request: args.get("request").cloned(),
        })
    }

    /// The Chrome trace JSON of everything kept so far.
    fn to_json(&self) -> Value {
        let now = self.now_ns();
        let inner = self.inner.lock();
        let pid = std::process::id();
        let us = |ns: u64| json!(ns as f64 / 1000.0);
        // (ts, order, -dur) sorts parents before children and ends after begins.
        let mut body: Vec<(SortKey, Value)> = Vec::new();
        let mut lanes: BTreeMap<u64, Arc<Lane>> = BTreeMap::new();
        let open = inner.open_roots.values().map(|o| {
            let mut args = o.args.clone();
            args.insert("open".into(), Value::Bool(true));
            Rec {
                phase: Phase::Complete {
                    dur_ns: now.saturating_sub(o.ts_ns),
                },
                ts_ns: o.ts_ns,
                name: names::REQUEST.into(),
                cat: names::REQUEST,
                lane: o.lane.clone(),
                args,
            }
        });
        let open: Vec<Rec> = open.collect();
        for r in inner.events.iter().chain(open.iter()) {
            lanes.entry(r.lane.tid).or_insert_with(|| r.lane.clone());
            let base = |ph: &str| {
                json!({
                    "name": r.name, "cat": r.cat, "ph": ph, "ts": us(r.ts_ns),
                    "pid": pid, "tid": r.lane.tid, "args": r.args,
                })
            };
            match r.phase {
                Phase::Complete { dur_ns } => {
                    let mut v = base("X");
                    v["dur"] = us(dur_ns);
                    body.push(((r.ts_ns, 0, std::cmp::Reverse(dur_ns)), v));
                }
                Phase::Async { dur_ns, id } => {
                    let mut b = base("b");
                    b["id"] = json!(format!("0x{id:x}"));
                    let e = json!({
                        "name": r.name, "cat": r.cat, "ph": "e",
                        "ts": us(r.ts_ns + dur_ns), "pid": pid, "tid": r.lane.tid,
                        "id": format!("0x{id:x}"), "args": {},
                    });
                    body.push(((r.ts_ns, 0, std::cmp::Reverse(dur_ns)), b));
                    body.push(((r.ts_ns + dur_ns, 2, std::cmp::Reverse(0)), e));
                }
                Phase::Instant => {
                    let mut v = base("i");
                    v["s"] = json!("t");
                    body.push(((r.ts_ns, 1, std::cmp::Reverse(0)), v));
                }
            }
        }
        body.sort_by_key(|a| a.0);
        let exe = std::env::current_exe()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "orbitkv".into());
        let mut events = vec![json!({
            "name": "process_name", "ph": "M", "pid": pid, "tid": 0,
            "args": {"name": format!("orbitkv ({exe}, pid {pid})")},
        })];
        for lane in lanes.values() {
            events.push(json!({
                "name": "thread_name", "ph": "M", "pid": pid, "tid": lane.tid,
                "args": {"name": lane.name},
            }));
            events.push(json!({
                "name": "thread_sort_index", "ph": "M", "pid": pid, "tid": lane.tid,
                "args": {"sort_index": lane.tid},
            }));
        }
        events.extend(body.into_iter().map(|(_, v)| v));
        json!({
            "traceEvents": events,
            "displayTimeUnit": "ns",
            "otherData": {
                "writer": "orbitkv::trace",
                "version": env!("CARGO_PKG_VERSION"),
                "start_unix_us": self.start_unix_us,
                "max_events": self.max_events,
                "dropped_events": inner.dropped,
                "open_requests": inner.open_roots.len(),
            },
        })
    }

    fn write(&self) -> Result<PathBuf, TraceError> {
        let path = self.path.clone().ok_or(TraceError::NoPath)?;
        self.dirty.store(false, Ordering::Relaxed);
        let text = serde_json::to_vec(&self.to_json()).expect("trace JSON serializes");
        write_atomic(&path, &text)?;
        Ok(path)
    }
}

/// File order: time, then begins (longest first) before instants before ends.
type SortKey = (u64, u8, std::cmp::Reverse<u64>);

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TraceError> {
    let io = |source| TraceError::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

// ---------------------------------------------------------------- fields

struct JsonFields<'a>(&'a mut Map<String, Value>);

impl Visit for JsonFields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        self.0
            .insert(field.name().into(), Value::String(format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), Value::String(value.into()));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), json!(value));
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), json!(value));
    }
}

/// Children of a request span carry its `request` and `side`.
fn inherit(lane: &Lane, args: &mut Map<String, Value>) {
    for (k, v) in [("request", &lane.request), ("side", &lane.side)] {
        if let Some(v) = v {
            args.entry(k).or_insert_with(|| v.clone());
        }
    }
}

/// `msg` spans are shown under their message kind.
fn display_name(span: &str, args: &Map<String, Value>) -> String {
    match (span, args.get("kind")) {
        (names::MSG, Some(Value::String(k))) => k.clone(),
        _ => span.to_string(),
    }
}

// ---------------------------------------------------------------- layer

/// A span's record while it is open (kept in the registry's extensions).
struct SpanRec {
    ts_ns: u64,
    name: String,
    cat: &'static str,
    lane: Arc<Lane>,
    args: Map<String, Value>,
    entered: bool,
    root: bool,
}

/// The `tracing_subscriber` layer that records the Chrome trace. Build it
/// with [`ChromeTrace::layer`] or [`ChromeTrace::builder`].
#[derive(Clone)]
pub struct ChromeTraceLayer {
    sink: Arc<Sink>,
}

impl std::fmt::Debug for ChromeTraceLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChromeTraceLayer")
            .field("path", &self.sink.path)
            .finish()
    }
}

impl<S> Layer<S> for ChromeTraceLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let ts_ns = self.sink.now_ns();
        let meta = attrs.metadata();
        let mut args = Map::new();
        attrs.record(&mut JsonFields(&mut args));
        let root = meta.name() == names::REQUEST && args.contains_key("side") && args.contains_key("request");
        let lane = if root {
            self.sink.request_lane(&args)
        } else {
            let parent = span
                .parent()
                .and_then(|p| p.extensions().get::<SpanRec>().map(|r| r.lane.clone()));
            parent.unwrap_or_else(|| self.sink.thread_lane())
        };
        inherit(&lane, &mut args);
        if root {
            self.sink.inner.lock().open_roots.insert(
                lane.tid,
                OpenRoot {
                    ts_ns,
                    lane: lane.clone(),
                    args: args.clone(),
                },
            );
        }
        span.extensions_mut().insert(SpanRec {
            ts_ns,
            name: display_name(meta.name(), &args),
            cat: meta.name(),
            lane,
            args,
            entered: false,
            root,
        });
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut ext = span.extensions_mut();
        if let Some(rec) = ext.get_mut::<SpanRec>() {
            values.record(&mut JsonFields(&mut rec.args));
            rec.name = display_name(rec.cat, &rec.args);
        }
    }

    fn on_enter(&self, id: &span::Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(rec) = span.extensions_mut().get_mut::<SpanRec>() {
                rec.entered = true;
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let ts_ns = self.sink.now_ns();
        let meta = event.metadata();
        let mut args = Map::new();
        event.record(&mut JsonFields(&mut args));
        let name = match args.remove("message") {
            Some(Value::String(s)) => s,
            Some(v) => v.to_string(),
            None => meta.name().to_string(),
        };
        args.insert("level".into(), json!(meta.level().as_str()));
        args.insert("target".into(), json!(meta.target()));
        let lane = ctx
            .event_span(event)
            .and_then(|s| s.extensions().get::<SpanRec>().map(|r| r.lane.clone()))
            .unwrap_or_else(|| self.sink.thread_lane());
        inherit(&lane, &mut args);
        self.sink.push(Rec {
            phase: Phase::Instant,
            ts_ns,
            name,
            cat: "event",
            lane,
            args,
        });
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        let ts = self.sink.now_ns();
        let Some(span) = ctx.span(&id) else { return };
        let Some(rec) = span.extensions_mut().remove::<SpanRec>() else {
            return;
        };
        let dur_ns = ts.saturating_sub(rec.ts_ns);
        if rec.root {
            self.sink.inner.lock().open_roots.remove(&rec.lane.tid);
        }
        let phase = if rec.root || rec.entered {
            Phase::Complete { dur_ns }
        } else {
            Phase::Async {
                dur_ns,
                id: self.sink.next_async.fetch_add(1, Ordering::Relaxed),
            }
        };
        self.sink.push(Rec {
            phase,
            ts_ns: rec.ts_ns,
            name: rec.name,
            cat: rec.cat,
            lane: rec.lane,
            args: rec.args,
        });
    }
}

// ---------------------------------------------------------------- API

/// Writes the trace on [`Self::flush`] and when dropped (when it has a path).
pub struct ChromeTraceGuard {
    sink: Arc<Sink>,
}

impl std::fmt::Debug for ChromeTraceGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChromeTraceGuard")
            .field("path", &self.sink.path)
            .finish()
    }
}

impl ChromeTraceGuard {
    /// (Re)writes the whole trace file (atomically: a temporary file renamed
    /// over it). Spans still open are not in it, except request roots,
    /// written up to now with `args.open = true`.
    pub fn flush(&self) -> Result<PathBuf, TraceError> {
        self.sink.write()
    }

    /// The trace as it would be written now.
    pub fn to_json(&self) -> Value {
        self.sink.to_json()
    }

    /// Where the trace goes.
    pub fn path(&self) -> Option<&Path> {
        self.sink.path.as_deref()
    }

    /// Finished events kept now.
    pub fn len(&self) -> usize {
        self.sink.inner.lock().events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Events dropped because the bound was reached.
    pub fn dropped_events(&self) -> u64 {
        self.sink.inner.lock().dropped
    }

    /// Forgets the finished events recorded so far.
    pub fn clear(&self) {
        let mut inner = self.sink.inner.lock();
        inner.events.clear();
        inner.dropped = 0;
    }
}

impl Drop for ChromeTraceGuard {
    fn drop(&mut self) {
        if self.sink.path.is_some() {
            if let Err(e) = self.sink.write() {
                eprintln!("orbitkv: {e}");
            }
        }
    }
}

/// Entry points; see the module documentation.
#[derive(Debug)]
pub struct ChromeTrace;

impl ChromeTrace {
    /// Installs a global subscriber that records OrbitKV's spans
    /// ([`DEFAULT_FILTER`]) into `path`.
    pub fn install(path: impl Into<PathBuf>) -> Result<ChromeTraceGuard, TraceError> {
        Self::builder().path(path).install()
    }

    /// A layer writing to `path`, to add to a subscriber of your own.
    pub fn layer(path: impl Into<PathBuf>) -> (ChromeTraceLayer, ChromeTraceGuard) {
        Self::builder().path(path).layer()
    }

    pub fn builder() -> ChromeTraceBuilder {
        ChromeTraceBuilder {
            path: None,
            max_events: DEFAULT_MAX_EVENTS,
            filter: DEFAULT_FILTER.into(),
        }
    }
}

/// Settings of a trace.
#[derive(Debug, Clone)]
pub struct ChromeTraceBuilder {
    path: Option<PathBuf>,
    max_events: usize,
    filter: String,
}

impl ChromeTraceBuilder {
    /// The file the trace is written to (none: keep it in memory only, read
    /// it with [`ChromeTraceGuard::to_json`]).
    pub fn path(mut self, path: impl Into<PathBuf>) -> Self {
        self.path = Some(path.into());
        self
    }

    /// How many finished events to keep (the newest; at least 1).
    pub fn max_events(mut self, n: usize) -> Self {
        self.max_events = n;
        self
    }

    /// `EnvFilter` directive used by [`Self::install`] (the layer from
    /// [`Self::layer`] is unfiltered: filter it as you like).
    pub fn filter(mut self, directive: impl Into<String>) -> Self {
        self.filter = directive.into();
        self
    }

    pub fn layer(self) -> (ChromeTraceLayer, ChromeTraceGuard) {
        let sink = Arc::new(Sink::new(self.path, self.max_events));
        (ChromeTraceLayer { sink: sink.clone() }, ChromeTraceGuard { sink })
    }

    /// Installs the global subscriber (a registry, the filter, this layer).
    /// The file is created (empty trace) at once, so a bad path fails here.
    pub fn install(self) -> Result<ChromeTraceGuard, TraceError> {
        let filter =
            tracing_subscriber::EnvFilter::try_new(&self.filter).map_err(|e| TraceError::Filter {
                directive: self.filter.clone(),
                reason: e.to_string(),
            })?;
        if tracing::dispatcher::has_been_set() {
            return Err(TraceError::AlreadySet);
        }
        let (layer, guard) = self.layer();
        if guard.sink.path.is_some() {
            guard.sink.write()?;
        }
        let subscriber = tracing_subscriber::registry()
            .with(layer.with_filter(filter))
            .with(stderr_log());
        tracing::subscriber::set_global_default(subscriber).map_err(|_| TraceError::AlreadySet)?;
        let _ = GLOBAL.set(guard.sink.clone());
        Ok(guard)
    }
}

/// The sink of the trace installed globally by this module, if any.
static GLOBAL: OnceLock<Arc<Sink>> = OnceLock::new();
/// The outcome of [`install_global`] (tried once per process).
static INSTALLED: OnceLock<Option<PathBuf>> = OnceLock::new();

/// What [`install_global`] sets up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GlobalTrace {
    /// The Chrome trace file; `None`: OrbitKV's stderr warnings only.
    pub path: Option<PathBuf>,
    /// An `EnvFilter` directive for the trace (default [`DEFAULT_FILTER`]).
    pub filter: Option<String>,
    /// Events kept (default [`DEFAULT_MAX_EVENTS`]).
    pub max_events: Option<usize>,
}

impl GlobalTrace {
    /// The settings `ORBITKV_TRACE`, `ORBITKV_TRACE_FILTER` and
    /// `ORBITKV_TRACE_MAX_EVENTS` give.
    pub fn from_env() -> Self {
        Self {
            path: std::env::var_os(TRACE_ENV)
                .filter(|p| !p.is_empty())
                .map(PathBuf::from),
            filter: std::env::var(TRACE_FILTER_ENV).ok().filter(|f| !f.is_empty()),
            max_events: std::env::var(TRACE_MAX_EVENTS_ENV)
                .ok()
                .and_then(|n| n.parse().ok()),
        }
    }
}

/// [`install_global`] with [`GlobalTrace::from_env`]: for a binary
/// configured through its environment.
pub fn init_from_env() -> Option<&'static Path> {
    if let Some(done) = INSTALLED.get() {
        return done.as_deref();
    }
    install_global(GlobalTrace::from_env())
}

/// For the embedding process: installs, once per process, the global
/// subscriber with OrbitKV's stderr warnings (filtered by `ORBITKV_LOG`) and,
/// with a path, the Chrome trace. Later calls return the first answer.
/// Returns the path being traced to. Problems (a subscriber already set, a
/// bad path) are printed to stderr once and tracing stays off: a debugging
/// aid never stops the runtime. The library itself never calls it.
pub fn install_global(settings: GlobalTrace) -> Option<&'static Path> {
    INSTALLED
        .get_or_init(|| {
            let Some(path) = settings.path else {
                // No trace: still print OrbitKV's warnings (unless the process
                // set a subscriber of its own).
                if !tracing::dispatcher::has_been_set() {
                    let _ = tracing::subscriber::set_global_default(
                        tracing_subscriber::registry().with(stderr_log()),
                    );
                }
                return None;
            };
            let mut b = ChromeTrace::builder().path(path.clone());
            if let Some(f) = settings.filter {
                b = b.filter(f);
            }
            if let Some(n) = settings.max_events {
                b = b.max_events(n);
            }
            match b.install() {
                Ok(guard) => {
                    // The guard lives as long as the process; the flusher
                    // thread rewrites the file while something new arrives.
                    let sink = guard.sink.clone();
                    std::mem::forget(guard);
                    let _ = std::thread::Builder::new()
                        .name("orbitkv-trace".into())
                        .spawn(move || loop {
                            std::thread::sleep(ENV_FLUSH_EVERY);
                            if sink.dirty.load(Ordering::Relaxed) {
                                if let Err(e) = sink.write() {
                                    eprintln!("orbitkv: {e}");
                                }
                            }
                        });
                    Some(path)
                }
                Err(e) => {
                    eprintln!("orbitkv: trace {path:?} not installed: {e}");
                    None
                }
            }
        })
        .as_deref()
}

/// The stderr log layer: one line per event that [`LOG_ENV`] (default
/// [`DEFAULT_LOG_FILTER`]) lets through, prefixed `orbitkv`, with the
/// event's fields (`request=… peer=…`).
fn stderr_log<S>() -> impl Layer<S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    let directive = std::env::var(LOG_ENV)
        .ok()
        .filter(|f| !f.is_empty())
        .unwrap_or_else(|| DEFAULT_LOG_FILTER.to_string());
    let filter = tracing_subscriber::EnvFilter::try_new(&directive).unwrap_or_else(|e| {
        eprintln!("orbitkv: {LOG_ENV}={directive:?} ignored: {e}");
        tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER)
    });
    tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_thread_names(true)
        .with_filter(filter)
}

/// Writes the globally installed trace (by [`ChromeTrace::install`] or
/// [`install_global`]) now. `Ok(None)` when there is none.
pub fn flush() -> Result<Option<PathBuf>, TraceError> {
    match GLOBAL.get() {
        Some(sink) if sink.path.is_some() => sink.write().map(Some),
        _ => Ok(None),
    }
}

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
