//! What the native context managers share. `MooncakeTransferEngine` and
//! `SideChannel` extend `_ClosesOnExit`, a context manager over the object's
//! own `close()`: `with x:` binds `x` itself, and leaving the block closes it
//! and lets any exception raised inside propagate. The rule is written once,
//! here; each subclass only has a `close`.

use pyo3::prelude::*;

/// An argument of `__exit__` (the exception's type, value or traceback, or
/// `None`): accepted and ignored.
type ExcArg = Option<Py<PyAny>>;

/// The base of the native classes that close on leaving a `with` block.
/// It holds nothing; a subclass provides `close()`.
#[pyclass(module = "orbitkv._native", name = "_ClosesOnExit", subclass, frozen)]
pub struct ClosesOnExit;

#[pymethods]
impl ClosesOnExit {
    /// Returns the object itself.
    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// Calls the object's `close()` and returns `False`, so that an exception
    /// raised inside the `with` block propagates. The three arguments do not
    /// change what happens.
    #[pyo3(signature = (exc_type = None, exc_value = None, traceback = None))]
    fn __exit__(
        slf: &Bound<'_, Self>,
        exc_type: ExcArg,
        exc_value: ExcArg,
        traceback: ExcArg,
    ) -> PyResult<bool> {
        let _ = (exc_type, exc_value, traceback);
        slf.call_method0("close")?;
        Ok(false)
    }
}
