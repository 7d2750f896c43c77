//! Installing the trace: the guard, the builder, the process-wide
//! subscriber (`install_global`, `init_from_env`) and `flush`.

use super::layer::*;
use super::sink::*;
use super::*;

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
