//! What the native context managers share. `MooncakeTransferEngine` and
//! `SideChannel` are their own context managers over `close()`: `with x:`
//! binds `x` itself, and leaving the block closes it and lets any exception
//! raised inside propagate. PyO3 joins no `#[pymethods]` of two classes
//! (short of its `multiple-pymethods` feature), so each class keeps a
//! one-line `__enter__` and `__exit__`, and the rule is written here.

use pyo3::prelude::*;

/// An argument of `__exit__` (the exception's type, value or traceback, or
/// `None`): accepted and ignored.
pub(crate) type ExcArg = Option<Py<PyAny>>;

/// The body of `__exit__`: calls `close` and returns `False`, so that an
/// exception raised inside the `with` block propagates. `_exc` takes the
/// three arguments, which do not change what happens.
pub(crate) fn exit_closing(_exc: [ExcArg; 3], close: impl FnOnce()) -> bool {
    close();
    false
}
