//! `StagingArena`: the core's first-fit allocator over a staging region, for
//! the prefill worker's source staging (the decode side's grants are given
//! by the runtime itself).

use orbitkv::staging::arena::StagingArena;
use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::errors::invalid_argument;

/// Disjoint, 256-byte aligned pieces of `len` bytes at `base`.
#[pyclass(module = "orbitkv._native", name = "StagingArena", frozen)]
pub struct PyStagingArena {
    inner: Mutex<StagingArena>,
}

#[pymethods]
impl PyStagingArena {
    #[new]
    fn new(py: Python<'_>, base: u64, len: u64) -> PyResult<Self> {
        StagingArena::new(base, len)
            .map(|a| Self { inner: Mutex::new(a) })
            .map_err(|e| invalid_argument(py, e.to_string()))
    }

    /// The address of a free piece of at least `len` bytes, or `None` when
    /// no piece is that large.
    fn alloc(&self, len: u64) -> Option<u64> {
        self.inner.lock().alloc(len).ok()
    }

    /// Gives piece `addr` back (`InvalidArgumentError` if it is not one in use).
    fn free(&self, py: Python<'_>, addr: u64) -> PyResult<()> {
        self.inner
            .lock()
            .free(addr)
            .map_err(|e| invalid_argument(py, e.to_string()))
    }

    /// `(bytes, pieces)` in use.
    fn in_use(&self) -> (u64, usize) {
        let a = self.inner.lock();
        (a.used_bytes(), a.pieces())
    }

    /// `(base, len)` of the region.
    #[getter]
    fn region(&self) -> (u64, u64) {
        self.inner.lock().region()
    }
}
