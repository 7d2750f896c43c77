//! Rust errors → the exception classes of `orbitkv.errors`.
//!
//! The hierarchy is defined in Python (`python/orbitkv/errors.py`) because some
//! classes have two bases (`TransferTimeoutError` is also a `TimeoutError`,
//! `InvalidArgumentError` also a `ValueError`). The classes are looked up when
//! an error is raised, never on the data path. Every instance carries `kind`
//! (the Rust variant's name) and `details` (its fields).

use orbitkv::TransportError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyModule};

const ERRORS_MODULE: &str = "orbitkv.errors";

static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// Why a call that ran without the GIL failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The core returned an error.
    Transport(TransportError),
    /// The engine was closed before or during the call.
    Closed,
    /// A Python exception, e.g. `KeyboardInterrupt` seen while waiting.
    Python(PyErr),
}

impl From<TransportError> for Failure {
    fn from(e: TransportError) -> Self {
        Failure::Transport(e)
    }
}

impl Failure {
    /// Turns the failure into the Python exception to raise.
    pub(crate) fn into_pyerr(self, py: Python<'_>) -> PyErr {
        match self {
            Failure::Transport(e) => transport_error(py, e),
            Failure::Closed => closed_error(py),
            Failure::Python(e) => e,
        }
    }
}

/// A detail value attached to an exception (`exc.details[key]`).
pub(crate) enum Detail {
    Str(String),
    Int(u64),
    Float(f64),
}

impl From<&str> for Detail {
    fn from(s: &str) -> Self {
        Detail::Str(s.to_string())
    }
}
impl From<String> for Detail {
    fn from(s: String) -> Self {
        Detail::Str(s)
    }
}
impl From<u64> for Detail {
    fn from(v: u64) -> Self {
        Detail::Int(v)
    }
}
impl From<f64> for Detail {
    fn from(v: f64) -> Self {
        Detail::Float(v)
    }
}

/// Builds `orbitkv.errors.<class>(message, kind=kind, **details)`. Falls back
/// to `RuntimeError` (naming the class) if the module cannot be imported.
pub(crate) fn new_error(
    py: Python<'_>,
    class: &str,
    kind: &str,
    message: String,
    details: Vec<(&'static str, Detail)>,
) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let module = ERRORS.get_or_try_init(py, || py.import(ERRORS_MODULE).map(Bound::unbind))?;
        let cls = module.bind(py).getattr(class)?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("kind", kind)?;
        for (key, value) in details {
            match value {
                Detail::Str(s) => kwargs.set_item(key, s)?,
                Detail::Int(v) => kwargs.set_item(key, v)?,
                Detail::Float(v) => kwargs.set_item(key, v)?,
            }
        }
        let exc = cls.call((message.as_str(),), Some(&kwargs))?;
        Ok(PyErr::from_value(exc))
    };
    match build() {
        Ok(err) => err,
        Err(import_err) => PyRuntimeError::new_err(format!(
            "{class}: {message} (orbitkv.errors unavailable: {import_err})"
        )),
    }
}

/// The exception for a use of a closed engine (or of a batch of one).
pub(crate) fn closed_error(py: Python<'_>) -> PyErr {
    new_error(
        py,
        "EngineClosedError",
        "EngineClosed",
        "this MooncakeTransferEngine was closed; create a new engine".into(),
        Vec::new(),
    )
}

/// `InvalidArgumentError` (also a `ValueError`) with a message.
pub(crate) fn invalid_argument(py: Python<'_>, message: impl Into<String>) -> PyErr {
    transport_error(py, TransportError::InvalidArgument(message.into()))
}

/// Raises a core error as its Python class (the core's
/// [`TransportError::class_name`] table), with the variant's fields as details.
pub(crate) fn transport_error(py: Python<'_>, err: TransportError) -> PyErr {
    let (class, kind, message) = (err.class_name(), err.kind(), err.to_string());
    let details: Vec<(&'static str, Detail)> = match err {
        TransportError::LibraryNotFound { searched, pinned } => {
            vec![("searched", searched.into()), ("pinned", pinned.into())]
        }
        TransportError::LoadFailed { path, reason } => vec![
            ("path", path.display().to_string().into()),
            ("reason", reason.into()),
        ],
        TransportError::LibPythonNotFound { reason } => vec![("reason", reason.into())],
        TransportError::VersionMismatch {
            found,
            pinned,
            dist,
            path,
        } => vec![
            ("found", found.into()),
            ("pinned", pinned.into()),
            ("distribution", dist.into()),
            ("path", path.display().to_string().into()),
        ],
        TransportError::EngineInit { bind_host, reason } => {
            vec![("bind_host", bind_host.into()), ("reason", reason.into())]
        }
        TransportError::BadEndpoint { endpoint, reason } => {
            vec![("endpoint", endpoint.into()), ("reason", reason.into())]
        }
        TransportError::UnregisteredLocal { addr, len } => vec![
            ("side", "local".into()),
            ("addr", addr.into()),
            ("length", len.into()),
        ],
        TransportError::UnregisteredRemote { peer, addr, len } => vec![
            ("side", "remote".into()),
            ("peer", peer.into()),
            ("addr", addr.into()),
            ("length", len.into()),
        ],
        TransportError::Registration { addr, len, reason } => vec![
            ("addr", addr.into()),
            ("length", len.into()),
            ("reason", reason.into()),
        ],
        TransportError::TransferFailed { peer, reason } => {
            vec![("peer", peer.into()), ("reason", reason.into())]
        }
        TransportError::Timeout { peer, millis } => vec![
            ("peer", peer.into()),
            ("timeout_s", (millis as f64 / 1000.0).into()),
        ],
        TransportError::NotifyFailed { peer, reason } => {
            vec![("peer", peer.into()), ("reason", reason.into())]
        }
        TransportError::InvalidArgument(reason) => vec![("reason", reason.into())],
        TransportError::Mooncake(reason) | TransportError::Cuda(reason) => vec![("reason", reason.into())],
    };
    new_error(py, class, kind, message, details)
}
