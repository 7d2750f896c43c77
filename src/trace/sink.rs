//! Where the trace's events go: the bounded ring of finished events, the
//! lanes, and the file written atomically.

use super::*;

// ---------------------------------------------------------------- sink

/// A lane: a Chrome "thread" (tid) in the viewer.
#[derive(Debug)]
pub(super) struct Lane {
    pub(super) tid: u64,
    pub(super) name: String,
    /// For request lanes: the root's `side` and `request`, inherited by children.
    pub(super) side: Option<Value>,
    pub(super) request: Option<Value>,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Phase {
    Complete { dur_ns: u64 },
    Async { dur_ns: u64, id: u64 },
    Instant,
}

/// One finished event.
#[derive(Debug)]
pub(super) struct Rec {
    pub(super) phase: Phase,
    pub(super) ts_ns: u64,
    pub(super) name: String,
    pub(super) cat: &'static str,
    pub(super) lane: Arc<Lane>,
    pub(super) args: Map<String, Value>,
}

/// A root span still open (written, marked `open`, if the trace is flushed
/// before the actor ends).
pub(super) struct OpenRoot {
    pub(super) ts_ns: u64,
    pub(super) lane: Arc<Lane>,
    pub(super) args: Map<String, Value>,
}

pub(super) struct Inner {
    pub(super) events: VecDeque<Rec>,
    pub(super) dropped: u64,
    pub(super) threads: HashMap<ThreadId, Arc<Lane>>,
    pub(super) open_roots: HashMap<u64, OpenRoot>,
}

/// What a layer and its guard share.
pub(super) struct Sink {
    pub(super) start: Instant,
    pub(super) start_unix_us: u64,
    pub(super) path: Option<PathBuf>,
    pub(super) max_events: usize,
    pub(super) next_tid: AtomicU64,
    pub(super) next_async: AtomicU64,
    pub(super) dirty: AtomicBool,
    pub(super) inner: Mutex<Inner>,
}

impl Sink {
    pub(super) fn new(path: Option<PathBuf>, max_events: usize) -> Self {
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

    pub(super) fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    pub(super) fn push(&self, rec: Rec) {
        let mut inner = self.inner.lock();
        if inner.events.len() >= self.max_events {
            inner.events.pop_front();
            inner.dropped += 1;
        }
        inner.events.push_back(rec);
        self.dirty.store(true, Ordering::Relaxed);
    }

    pub(super) fn thread_lane(&self) -> Arc<Lane> {
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
    pub(super) fn request_lane(&self, args: &Map<String, Value>) -> Arc<Lane> {
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
    pub(super) fn to_json(&self) -> Value {
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

    pub(super) fn write(&self) -> Result<PathBuf, TraceError> {
        let path = self.path.clone().ok_or(TraceError::NoPath)?;
        self.dirty.store(false, Ordering::Relaxed);
        let text = serde_json::to_vec(&self.to_json()).expect("trace JSON serializes");
        write_atomic(&path, &text)?;
        Ok(path)
    }
}

/// File order: time, then begins (longest first) before instants before ends.
type SortKey = (u64, u8, std::cmp::Reverse<u64>);

pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), TraceError> {
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
