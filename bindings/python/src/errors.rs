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
use pyo3::types::{PyDict, PyList, PyModule};
use serde::Serialize;
use serde_json::Value;

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

/// The details of an error (`exc.details`): the fields of its variant, as its
/// derived `Serialize` writes them (`{variant: {field: value, ...}}`, or the
/// variant's name alone); the core's `error.rs` names and converts them.
fn details_of(err: &impl Serialize) -> serde_json::Map<String, Value> {
    match serde_json::to_value(err) {
        Ok(Value::Object(variant)) => match variant.into_iter().next() {
            Some((_, Value::Object(fields))) => fields,
            _ => serde_json::Map::new(),
        },
        _ => serde_json::Map::new(),
    }
}

/// A JSON value as the Python object it stands for.
fn to_py<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any(),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_pyobject(py)?.into_any(),
            (None, Some(i)) => i.into_pyobject(py)?.into_any(),
            _ => n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any(),
        },
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(items) => {
            let items = items.iter().map(|i| to_py(py, i)).collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any()
        }
        Value::Object(map) => {
            let d = PyDict::new(py);
            for (k, v) in map {
                d.set_item(k, to_py(py, v)?)?;
            }
            d.into_any()
        }
    })
}

/// Builds `orbitkv.errors.<class>(message, kind=kind, **details)`. Falls back
/// to `RuntimeError` (naming the class) if the module cannot be imported.
fn new_error(
    py: Python<'_>,
    class: &str,
    kind: &str,
    message: String,
    details: serde_json::Map<String, Value>,
) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let module = ERRORS.get_or_try_init(py, || py.import(ERRORS_MODULE).map(Bound::unbind))?;
        let cls = module.bind(py).getattr(class)?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("kind", kind)?;
        for (key, value) in &details {
            kwargs.set_item(key, to_py(py, value)?)?;
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

/// Raises a core error as its Python class (the core's `class_name` table),
/// with the variant's fields as details.
pub(crate) fn core_error<E: Serialize + std::fmt::Display>(
    py: Python<'_>,
    err: &E,
    class: &str,
    kind: &str,
) -> PyErr {
    new_error(py, class, kind, err.to_string(), details_of(err))
}

/// The exception for a use of a closed engine (or of a batch of one).
pub(crate) fn closed_error(py: Python<'_>) -> PyErr {
    new_error(
        py,
        "EngineClosedError",
        "EngineClosed",
        "this MooncakeTransferEngine was closed; create a new engine".into(),
        serde_json::Map::new(),
    )
}

/// `InvalidArgumentError` (also a `ValueError`) with a message.
pub(crate) fn invalid_argument(py: Python<'_>, message: impl Into<String>) -> PyErr {
    transport_error(py, TransportError::InvalidArgument(message.into()))
}

/// Raises a transport error as its Python class.
pub(crate) fn transport_error(py: Python<'_>, err: TransportError) -> PyErr {
    core_error(py, &err, err.class_name(), err.kind())
}
