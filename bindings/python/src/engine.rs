//! `MooncakeTransferEngine` and `Batch` for Python.
//!
//! GIL policy: every call that can block (engine start-up, registration,
//! submitting, polling, waiting, notifications, close) runs inside
//! `Python::detach`. Arguments are converted to plain Rust values first, so
//! nothing on the data path touches a Python object. While waiting, the GIL is
//! taken back every 50 ms only to check for signals (Ctrl-C).
//!
//! Lock rule: no lock is waited for with the GIL held. The engine's lock
//! (`Shared::engine`) is read by calls that may run for seconds (a write, a
//! wait) and written by `close`, which waits for them; a reader that came
//! after a waiting `close` waits too. So every access to it goes through
//! `Python::detach` (the getters too), and `__repr__`s only try the locks
//! they read (a batch's slot is held by its `wait()` for up to its timeout).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use orbitkv::transport::{BatchEnd, PINNED_MOONCAKE_VERSION};
use orbitkv::{
    BatchHandle, BatchState, EngineConfig, MooncakeTransferEngine, Transport, TransportError, WriteRange,
};
use parking_lot::{Mutex, RwLock};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList, PyMemoryView, PyString, PyTuple};

use crate::context::ClosesOnExit;
use crate::errors::{closed_error, invalid_argument, transport_error, Failure};
use crate::region;

/// How often a waiting call takes the GIL back to check for signals.
const SIGNAL_CHECK_EVERY: Duration = Duration::from_millis(50);

/// State shared by an engine object and the batches it submitted.
///
/// Field order matters: `engine` is dropped (which unregisters every region
/// and frees Mooncake's engine) before `keep_alive` releases the Python
/// objects that own the registered memory.
struct Shared {
    engine: RwLock<Option<MooncakeTransferEngine>>,
    /// Registered start address → the Python object(s) owning that memory.
    keep_alive: Mutex<HashMap<u64, Py<PyAny>>>,
}

impl Shared {
    /// Runs `f` on the engine under a read lock; `Closed` once it is closed.
    fn with<T>(
        &self,
        f: impl FnOnce(&MooncakeTransferEngine) -> Result<T, TransportError>,
    ) -> Result<T, Failure> {
        let guard = self.engine.read();
        let engine = guard.as_ref().ok_or(Failure::Closed)?;
        f(engine).map_err(Failure::Transport)
    }
}

/// How a batch ended.
enum Terminal {
    Completed(u64),
    Failed(String),
}

/// Polls `handle` until it is terminal or `timeout` passes (the crate's
/// [`orbitkv::transport::wait_batch`], checking for Python signals every
/// `SIGNAL_CHECK_EVERY`). The engine lock is taken per poll, so `close()`
/// from another thread is not held up by a wait.
fn wait_terminal(shared: &Shared, handle: &mut BatchHandle, timeout: Duration) -> Result<Terminal, Failure> {
    let start = Instant::now();
    let deadline = start
        .checked_add(timeout)
        .unwrap_or(start + Duration::from_secs(86_400 * 365));
    let mut next_signal_check = start + SIGNAL_CHECK_EVERY;
    let end = orbitkv::transport::wait_batch(
        deadline,
        || shared.with(|e| e.poll(&mut *handle)),
        |now| {
            if now >= next_signal_check {
                Python::attach(|py| py.check_signals()).map_err(Failure::Python)?;
                next_signal_check = now + SIGNAL_CHECK_EVERY;
            }
            Ok(())
        },
    )?;
    match end {
        BatchEnd::Completed(bytes) => Ok(Terminal::Completed(bytes)),
        BatchEnd::Failed(reason) => Ok(Terminal::Failed(reason)),
        BatchEnd::TimedOut => Err(Failure::Transport(TransportError::Timeout {
            peer: handle.peer.clone(),
            millis: timeout.as_millis().min(u64::MAX as u128) as u64,
        })),
    }
}

fn timeout_arg(py: Python<'_>, timeout_s: f64) -> PyResult<Duration> {
    if !timeout_s.is_finite() || timeout_s < 0.0 {
        return Err(invalid_argument(
            py,
            format!("timeout_s must be a finite number >= 0, not {timeout_s}"),
        ));
    }
    Duration::try_from_secs_f64(timeout_s).map_err(|e| invalid_argument(py, format!("timeout_s: {e}")))
}

/// Converts `ranges` (an iterable of `(src_addr, dst_addr, length)`).
fn ranges_arg(py: Python<'_>, ranges: &Bound<'_, PyAny>) -> PyResult<Vec<WriteRange>> {
    let iter = ranges.try_iter().map_err(|_| {
        PyTypeError::new_err("ranges must be an iterable of (src_addr, dst_addr, length) tuples")
    })?;
    let mut out = Vec::with_capacity(ranges.len().unwrap_or(0));
    for (i, item) in iter.enumerate() {
        let item = item?;
        let (src, dst, len) = item.extract::<(u64, u64, u64)>().map_err(|_| {
            invalid_argument(
                py,
                format!("ranges[{i}] must be a (src_addr, dst_addr, length) tuple of non-negative ints"),
            )
        })?;
        out.push(WriteRange { src, dst, len });
    }
    Ok(out)
}

/// Converts a notification message: `bytes`, `bytearray`, `memoryview` or `str` (UTF-8).
fn message_arg(message: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(b) = message.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if let Ok(s) = message.cast::<PyString>() {
        return Ok(s.to_str()?.as_bytes().to_vec());
    }
    if let Ok(b) = message.cast::<PyByteArray>() {
        return Ok(b.to_vec());
    }
    if message.is_instance_of::<PyMemoryView>() {
        let b = message.call_method0("tobytes")?.cast_into::<PyBytes>()?;
        return Ok(b.as_bytes().to_vec());
    }
    Err(PyTypeError::new_err(
        "message must be bytes, bytearray, memoryview or str",
    ))
}

/// A Mooncake Transfer Engine (P2P handshake, no metadata service).
///
/// `MooncakeTransferEngine(bind_host="127.0.0.1", nics=None, library=None,
/// allow_version=None)` loads Mooncake's `engine.so` (once per process) and
/// starts an engine that listens on `bind_host`; `endpoint` is what peers
/// address. `nics` restricts RDMA to those devices; empty or None lets Mooncake
/// choose (TCP where there is no RDMA device; `MC_FORCE_TCP=1` forces TCP).
/// `library` is `engine.so` or a folder holding it; None uses
/// `ORBITKV_MOONCAKE_LIB` if set, else the installed `mooncake` package.
/// `allow_version` accepts one Mooncake version besides the pinned one
/// (default: `ORBITKV_MOONCAKE_ALLOW_VERSION`).
///
/// Thread-safe. Blocking calls release the GIL. Use it as a context manager,
/// or call `close()`, to unregister everything and free the engine.
#[pyclass(module = "orbitkv._native", name = "MooncakeTransferEngine", extends = ClosesOnExit, frozen)]
pub struct PyEngine {
    shared: Arc<Shared>,
    endpoint: String,
    version: Option<String>,
    library: PathBuf,
}

/// Set once an engine started, i.e. Mooncake is loaded in this process.
static MOONCAKE_LOADED: AtomicBool = AtomicBool::new(false);

/// The folder of the installed `mooncake` package, found without importing it.
fn mooncake_package(py: Python<'_>) -> Option<PathBuf> {
    let find = || -> PyResult<Option<PathBuf>> {
        let spec = py
            .import("importlib.util")?
            .call_method1("find_spec", ("mooncake",))?;
        if spec.is_none() {
            return Ok(None);
        }
        let locations = spec.getattr("submodule_search_locations")?;
        if locations.is_none() {
            return Ok(None);
        }
        match locations.try_iter()?.next() {
            Some(first) => Ok(Some(first?.extract::<PathBuf>()?)),
            None => Ok(None),
        }
    };
    find().ok().flatten()
}

/// The engine as the request runtime's transport. Every call takes the
/// engine's read lock, so `close()` turns later calls into errors instead of
/// use-after-free.
struct SharedTransport {
    shared: Arc<Shared>,
    endpoint: String,
    /// The transport Mooncake installed (fixed when the engine started).
    kind: orbitkv::transport::TransportKind,
}

impl SharedTransport {
    fn with<T>(
        &self,
        f: impl FnOnce(&MooncakeTransferEngine) -> Result<T, TransportError>,
    ) -> Result<T, TransportError> {
        let guard = self.shared.engine.read();
        match guard.as_ref() {
            Some(engine) => f(engine),
            None => Err(TransportError::InvalidArgument(
                "the MooncakeTransferEngine was closed".into(),
            )),
        }
    }
}

impl Transport for SharedTransport {
    fn endpoint(&self) -> &str {
        &self.endpoint
    }
    fn submit_write(&self, peer: &str, ranges: &[WriteRange]) -> Result<BatchHandle, TransportError> {
        self.with(|e| e.submit_write(peer, ranges))
    }
    fn poll(&self, handle: &mut BatchHandle) -> Result<BatchState, TransportError> {
        self.with(|e| e.poll(handle))
    }
    fn send_notification(&self, peer: &str, name: &str, message: &[u8]) -> Result<(), TransportError> {
        self.with(|e| e.send_notification(peer, name, message))
    }
    fn take_notifications(&self) -> Result<Vec<orbitkv::Notification>, TransportError> {
        self.with(|e| e.take_notifications())
    }
    fn kind(&self) -> orbitkv::transport::TransportKind {
        self.kind
    }
    fn forget_peer(&self, peer: &str) {
        // A closed engine kept nothing.
        let _ = self.with(|e| {
            e.forget_peer(peer);
            Ok(())
        });
    }
}

impl PyEngine {
    /// This engine as a transport for `orbitkv.Runtime`.
    pub(crate) fn transport(&self, py: Python<'_>) -> PyResult<Arc<dyn Transport>> {
        Ok(Arc::new(SharedTransport {
            shared: Arc::clone(&self.shared),
            endpoint: self.endpoint.clone(),
            kind: self.kind(py)?,
        }))
    }

    /// The transport Mooncake installed (the engine closed: an error).
    fn kind(&self, py: Python<'_>) -> PyResult<orbitkv::transport::TransportKind> {
        let shared = &self.shared;
        py.detach(|| shared.engine.read().as_ref().map(|e| e.kind()))
            .ok_or_else(|| closed_error(py))
    }
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (bind_host = "127.0.0.1", nics = None, library = None, allow_version = None))]
    fn new(
        py: Python<'_>,
        bind_host: &str,
        nics: Option<Vec<String>>,
        library: Option<PathBuf>,
        allow_version: Option<String>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let library = match library {
            Some(path) => Some(path),
            // Mooncake is loaded once per process; the core reuses it.
            None if MOONCAKE_LOADED.load(Ordering::Acquire) => None,
            None if std::env::var_os("ORBITKV_MOONCAKE_LIB").is_some() => None,
            // Not in this interpreter: say so, rather than let the core ask
            // another `python3`, whose Mooncake may be built for another Python.
            None => Some(mooncake_package(py).ok_or_else(|| {
                transport_error(
                    py,
                    TransportError::LibraryNotFound {
                        searched: format!(
                            "the `mooncake` package of this Python ({})",
                            py.import("sys")
                                .and_then(|sys| sys.getattr("executable"))
                                .and_then(|exe| exe.extract::<String>())
                                .unwrap_or_else(|_| "sys.executable unknown".into())
                        ),
                        pinned: PINNED_MOONCAKE_VERSION,
                    },
                )
            })?),
        };
        let defaults = EngineConfig::default();
        let config = EngineConfig {
            bind_host: bind_host.to_string(),
            nics: nics.unwrap_or_default(),
            library,
            allow_version: allow_version.or(defaults.allow_version),
        };
        let engine = py
            .detach(|| MooncakeTransferEngine::new(&config))
            .map_err(|e| Failure::Transport(e).into_pyerr(py))?;
        MOONCAKE_LOADED.store(true, Ordering::Release);
        let this = Self {
            endpoint: engine.endpoint().to_string(),
            version: engine.library().version.clone(),
            library: engine.library().engine.clone(),
            shared: Arc::new(Shared {
                engine: RwLock::new(Some(engine)),
                keep_alive: Mutex::new(HashMap::new()),
            }),
        };
        Ok(PyClassInitializer::from(ClosesOnExit).add_subclass(this))
    }

    /// The endpoint (`ip:port`) peers pass to `write` and `send_notification`.
    #[getter]
    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The version of the loaded Mooncake wheel, or None if its metadata was not found.
    #[getter]
    fn mooncake_version(&self) -> Option<&str> {
        self.version.as_deref()
    }

    /// The transport Mooncake installed, by its own rule (`tcp`, `rdma`,
    /// `nvlink_intra` or `unknown`): it sets the default range cap.
    #[getter(transport)]
    fn transport_name(&self, py: Python<'_>) -> PyResult<&'static str> {
        Ok(self.kind(py)?.name())
    }

    /// The path of the loaded Mooncake `engine.so`.
    #[getter]
    fn mooncake_library(&self) -> String {
        self.library.display().to_string()
    }

    /// Takes Mooncake's submit-time wait on the caller's default stream off
    /// the writer threads (`orbitkv.pd.mooncake_submit_wait = "layer"`): its
    /// NVLink transport records an event on `cudaStreamPerThread` and waits
    /// for it before each batch, which under load waits for the forward
    /// queued ahead of it. Only safe when every write is ordered after its
    /// source by the caller, as the connector's per-layer events do.
    /// Process-wide and idempotent. Returns the number of `engine.so` import
    /// slots redirected (0: this Mooncake has no CUDA, nothing to do).
    fn redirect_submit_wait(&self, py: Python<'_>) -> PyResult<u32> {
        let lib = self.library.clone();
        py.detach(|| orbitkv::transport::mooncake::redirect_submit_wait(Some(&lib)))
            .map_err(|e| Failure::Transport(e).into_pyerr(py))
    }

    /// `(redirected, passed)`: events Mooncake recorded since
    /// `redirect_submit_wait`, on the writer's idle stream and unchanged.
    #[staticmethod]
    fn submit_wait_counts() -> (u64, u64) {
        orbitkv::transport::mooncake::submit_wait_counts()
    }

    /// True once `close()` ran.
    #[getter]
    fn closed(&self, py: Python<'_>) -> bool {
        let shared = &self.shared;
        py.detach(|| shared.engine.read().is_none())
    }

    /// Registers memory so it can be a WRITE source here and a WRITE target
    /// for peers. Returns `(addr, length)` as registered.
    ///
    /// `region` is an int address (then `length` is required), a contiguous
    /// torch tensor (`data_ptr()`, `numel() * element_size()` bytes, location
    /// `cpu:0`/`cuda:N` from its device), or a writable C-contiguous buffer
    /// such as a numpy array. `length` registers only the first `length`
    /// bytes. `location` overrides the Mooncake location (`cpu:0`, `cuda:1`);
    /// empty lets it be derived or detected. Tensors and buffers are kept
    /// alive until `unregister_memory` or `close`; for an address the caller
    /// keeps the memory alive. Regions must not overlap.
    #[pyo3(signature = (region, length = None, location = ""))]
    fn register_memory(
        &self,
        py: Python<'_>,
        region: &Bound<'_, PyAny>,
        length: Option<u64>,
        location: &str,
    ) -> PyResult<(u64, u64)> {
        let r = region::resolve(py, region, length, location)?;
        let (addr, len) = (r.addr, r.len);
        let location = r.location;
        let shared = &self.shared;
        py.detach(|| shared.with(|e| e.register_memory(addr, len, &location)))
            .map_err(|f| f.into_pyerr(py))?;
        if let Some(obj) = r.keep_alive {
            self.shared.keep_alive.lock().insert(addr, obj);
        }
        Ok((addr, len))
    }

    /// Unregisters the region that starts at `region`'s address (an int
    /// address, or the tensor/buffer that was registered) and releases the
    /// object kept alive for it. Raises `RegistrationError` if nothing is
    /// registered there.
    fn unregister_memory(&self, py: Python<'_>, region: &Bound<'_, PyAny>) -> PyResult<()> {
        let addr = region::start_address(py, region)?;
        let shared = &self.shared;
        py.detach(|| shared.with(|e| e.unregister_memory(addr)))
            .map_err(|f| f.into_pyerr(py))?;
        let released = self.shared.keep_alive.lock().remove(&addr);
        drop(released);
        Ok(())
    }

    /// True when `[addr, addr + length)` lies inside one registered region.
    fn is_registered(&self, py: Python<'_>, addr: u64, length: u64) -> PyResult<bool> {
        let shared = &self.shared;
        py.detach(|| shared.with(|e| Ok(e.is_registered(addr, length))))
            .map_err(|f| f.into_pyerr(py))
    }

    /// Writes `ranges` (`(src_addr, dst_addr, length)` tuples: local source,
    /// peer's virtual address) to `peer` and waits for the whole batch.
    /// Returns the bytes written. Every source must be registered here and
    /// every destination registered by the peer. Raises `TransferError` if the
    /// batch fails and `TransferTimeoutError` after `timeout_s` seconds (the
    /// batch is then left to Mooncake: keep its memory registered). The GIL is
    /// released while submitting and waiting.
    #[pyo3(signature = (peer, ranges, timeout_s = 30.0))]
    fn write(&self, py: Python<'_>, peer: &str, ranges: &Bound<'_, PyAny>, timeout_s: f64) -> PyResult<u64> {
        let ranges = ranges_arg(py, ranges)?;
        let timeout = timeout_arg(py, timeout_s)?;
        let shared = &self.shared;
        py.detach(|| {
            let mut handle = shared.with(|e| e.submit_write(peer, &ranges))?;
            match wait_terminal(shared, &mut handle, timeout)? {
                Terminal::Completed(bytes) => Ok(bytes),
                Terminal::Failed(reason) => Err(Failure::Transport(TransportError::TransferFailed {
                    peer: peer.to_string(),
                    reason,
                })),
            }
        })
        .map_err(|f| f.into_pyerr(py))
    }

    /// Submits `ranges` to `peer` without waiting; returns a `Batch` to poll
    /// or wait on. Same rules as `write`.
    fn submit_write(&self, py: Python<'_>, peer: &str, ranges: &Bound<'_, PyAny>) -> PyResult<PyBatch> {
        let ranges = ranges_arg(py, ranges)?;
        let shared = &self.shared;
        let handle = py
            .detach(|| shared.with(|e| e.submit_write(peer, &ranges)))
            .map_err(|f| f.into_pyerr(py))?;
        Ok(PyBatch {
            shared: Arc::clone(&self.shared),
            peer: handle.peer.clone(),
            tasks: handle.tasks,
            nbytes: handle.bytes,
            slot: Mutex::new(Slot::Pending(handle)),
        })
    }

    /// Sends a notification `(name, message)` to `peer`'s endpoint; the peer
    /// receives it from `take_notifications`. The message must be UTF-8 text
    /// (a `str` is encoded; bytes that are not UTF-8 raise `InvalidArgumentError`,
    /// since Mooncake would alter them in transit: encode binary payloads).
    fn send_notification(
        &self,
        py: Python<'_>,
        peer: &str,
        name: &str,
        message: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let message = message_arg(message)?;
        let shared = &self.shared;
        py.detach(|| shared.with(|e| e.send_notification(peer, name, &message)))
            .map_err(|f| f.into_pyerr(py))
    }

    /// Drains the notifications received since the last call, oldest first,
    /// as `(name, message)` pairs. Each notification is returned once.
    fn take_notifications<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let shared = &self.shared;
        let notes = py
            .detach(|| shared.with(|e| e.take_notifications()))
            .map_err(|f| f.into_pyerr(py))?;
        let items = notes
            .into_iter()
            .map(|n| {
                PyTuple::new(
                    py,
                    [
                        PyString::new(py, &n.name).into_any(),
                        PyBytes::new(py, &n.message).into_any(),
                    ],
                )
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// Unregisters every region, frees the engine and releases the objects
    /// kept alive for registered regions. Waits for calls running in other
    /// threads to let go of the engine. Idempotent; any later call (also on
    /// its batches) raises `EngineClosedError`.
    fn close(&self, py: Python<'_>) {
        let shared = &self.shared;
        py.detach(|| {
            let engine = shared.engine.write().take();
            drop(engine);
        });
        let released: Vec<Py<PyAny>> = self.shared.keep_alive.lock().drain().map(|(_, v)| v).collect();
        drop(released);
    }

    fn __repr__(&self) -> String {
        // Never waits: `close` may be waiting for a long write to end.
        let state = match self.shared.engine.try_read() {
            Some(engine) if engine.is_none() => " closed",
            Some(_) => "",
            None => " closing",
        };
        format!(
            "<MooncakeTransferEngine endpoint={:?} mooncake={}{state}>",
            self.endpoint,
            self.version.as_deref().unwrap_or("unknown")
        )
    }
}

/// Where a batch stands, as seen from Python.
enum Slot {
    Pending(BatchHandle),
    Completed(u64),
    Failed(TransportError),
}

/// A submitted batch of WRITEs (from `MooncakeTransferEngine.submit_write`).
///
/// `poll()` and `wait()` release the GIL. Once the batch is terminal its
/// outcome is remembered: `poll()` keeps returning `"completed"` (or raising
/// the same `TransferError`).
#[pyclass(module = "orbitkv._native", name = "Batch", frozen)]
pub struct PyBatch {
    shared: Arc<Shared>,
    peer: String,
    tasks: usize,
    nbytes: u64,
    slot: Mutex<Slot>,
}

impl PyBatch {
    fn settle(&self, slot: &mut Slot, terminal: Terminal) -> Result<u64, Failure> {
        match terminal {
            Terminal::Completed(bytes) => {
                *slot = Slot::Completed(bytes);
                Ok(bytes)
            }
            Terminal::Failed(reason) => {
                let err = TransportError::TransferFailed {
                    peer: self.peer.clone(),
                    reason,
                };
                *slot = Slot::Failed(err.clone());
                Err(Failure::Transport(err))
            }
        }
    }
}

#[pymethods]
impl PyBatch {
    /// The peer endpoint the batch writes to.
    #[getter]
    fn peer(&self) -> &str {
        &self.peer
    }

    /// Number of ranges in the batch.
    #[getter]
    fn tasks(&self) -> usize {
        self.tasks
    }

    /// Total bytes the batch writes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.nbytes
    }

    /// Checks the batch once without waiting: `"in_flight"` or `"completed"`;
    /// raises `TransferError` if it failed.
    fn poll(&self, py: Python<'_>) -> PyResult<&'static str> {
        py.detach(|| {
            let mut slot = self.slot.lock();
            match &mut *slot {
                Slot::Completed(_) => Ok("completed"),
                Slot::Failed(e) => Err(Failure::Transport(e.clone())),
                Slot::Pending(handle) => match self.shared.with(|e| e.poll(handle))? {
                    BatchState::InFlight => Ok("in_flight"),
                    BatchState::Completed { bytes } => self
                        .settle(&mut slot, Terminal::Completed(bytes))
                        .map(|_| "completed"),
                    BatchState::Failed { reason } => self
                        .settle(&mut slot, Terminal::Failed(reason))
                        .map(|_| "completed"),
                },
            }
        })
        .map_err(|f| f.into_pyerr(py))
    }

    /// Waits until the batch is terminal; returns the bytes written. Raises
    /// `TransferError` if it failed and `TransferTimeoutError` after
    /// `timeout_s` seconds (the batch stays pending: wait or poll again).
    #[pyo3(signature = (timeout_s = 30.0))]
    fn wait(&self, py: Python<'_>, timeout_s: f64) -> PyResult<u64> {
        let timeout = timeout_arg(py, timeout_s)?;
        py.detach(|| {
            let mut slot = self.slot.lock();
            match &mut *slot {
                Slot::Completed(bytes) => Ok(*bytes),
                Slot::Failed(e) => Err(Failure::Transport(e.clone())),
                Slot::Pending(handle) => {
                    let terminal = wait_terminal(&self.shared, handle, timeout)?;
                    self.settle(&mut slot, terminal)
                }
            }
        })
        .map_err(|f| f.into_pyerr(py))
    }

    fn __repr__(&self) -> String {
        // Never waits: a `wait()` holds the slot for up to its timeout.
        let state = match self.slot.try_lock().as_deref() {
            Some(Slot::Pending(_)) => "pending",
            Some(Slot::Completed(_)) => "completed",
            Some(Slot::Failed(_)) => "failed",
            None => "being waited for",
        };
        format!(
            "<Batch peer={:?} tasks={} nbytes={} {state}>",
            self.peer, self.tasks, self.nbytes
        )
    }
}
