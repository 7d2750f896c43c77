//! What `register_memory` accepts: an address, a torch tensor, or a writable
//! C-contiguous buffer (numpy arrays, `bytearray`, `mmap`, ...).
//!
//! Tensors are recognised by duck typing (`data_ptr`, `numel`, `element_size`,
//! `is_contiguous`, `device`), so torch is never imported here. Buffers are
//! resolved through `memoryview` and `ctypes` rather than the C buffer API,
//! which the stable ABI of Python 3.10 lacks; the `ctypes` view is kept while
//! the region is registered, which also keeps the exporter from resizing or
//! freeing the memory.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt};

use crate::errors::invalid_argument;

/// A region resolved to plain numbers, plus the Python objects that keep its
/// memory alive while it is registered.
pub(crate) struct Region {
    pub addr: u64,
    pub len: u64,
    /// Mooncake location (`cpu:0`, `cuda:1`); empty: let Mooncake detect it.
    pub location: String,
    pub keep_alive: Option<Py<PyAny>>,
}

fn is_tensor(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(obj.hasattr("data_ptr")? && obj.hasattr("element_size")? && obj.hasattr("numel")?)
}

fn address(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    obj.extract::<u64>()
        .map_err(|_| invalid_argument(py, format!("{what} must be a non-negative integer address")))
}

fn tensor_location(tensor: &Bound<'_, PyAny>) -> PyResult<String> {
    let device = tensor.getattr("device")?;
    let kind: String = device.getattr("type")?.extract()?;
    let index: Option<i64> = device.getattr("index")?.extract()?;
    Ok(format!("{kind}:{}", index.unwrap_or(0)))
}

/// Resolves a buffer object to (address, size in bytes, keep-alive object).
fn resolve_buffer<'py>(py: Python<'py>, obj: &Bound<'py, PyAny>) -> PyResult<(u64, u64, Bound<'py, PyAny>)> {
    let view = py
        .import("builtins")?
        .getattr("memoryview")?
        .call1((obj,))
        .map_err(|_| {
            PyTypeError::new_err(format!(
                "region must be an int address, a torch tensor, or an object supporting the \
                 buffer protocol, not {}",
                obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
            ))
        })?;
    if view.getattr("readonly")?.extract::<bool>()? {
        return Err(invalid_argument(
            py,
            "region buffer is read-only; a registered region must be writable",
        ));
    }
    if !view.getattr("c_contiguous")?.extract::<bool>()? {
        return Err(invalid_argument(py, "region buffer is not C-contiguous"));
    }
    let nbytes: u64 = view.getattr("nbytes")?.extract()?;
    if nbytes == 0 {
        return Err(invalid_argument(py, "region buffer is empty"));
    }
    let ctypes = py.import("ctypes")?;
    let c_view = ctypes.getattr("c_char")?.call_method1("from_buffer", (&view,))?;
    let addr: u64 = ctypes.call_method1("addressof", (&c_view,))?.extract()?;
    Ok((addr, nbytes, c_view))
}

fn checked_length(py: Python<'_>, length: Option<u64>, available: u64, what: &str) -> PyResult<u64> {
    match length {
        None => Ok(available),
        Some(0) => Err(invalid_argument(py, "length must be positive")),
        Some(l) if l > available => Err(invalid_argument(
            py,
            format!("length {l} exceeds the {available} bytes of the {what}"),
        )),
        Some(l) => Ok(l),
    }
}

/// Resolves the `region` argument of `register_memory`.
pub(crate) fn resolve(
    py: Python<'_>,
    region: &Bound<'_, PyAny>,
    length: Option<u64>,
    location: &str,
) -> PyResult<Region> {
    if region.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err("region must not be a bool"));
    }
    if region.is_instance_of::<PyInt>() {
        let addr = address(py, region, "region")?;
        let len =
            length.ok_or_else(|| invalid_argument(py, "length is required when region is an address"))?;
        return Ok(Region {
            addr,
            len,
            location: location.to_string(),
            keep_alive: None,
        });
    }
    if is_tensor(region)? {
        if !region.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(invalid_argument(
                py,
                "tensor is not contiguous; register a contiguous tensor",
            ));
        }
        let addr: u64 = region.call_method0("data_ptr")?.extract()?;
        let numel: u64 = region.call_method0("numel")?.extract()?;
        let elem: u64 = region.call_method0("element_size")?.extract()?;
        let available = numel
            .checked_mul(elem)
            .ok_or_else(|| invalid_argument(py, "tensor size overflows"))?;
        if available == 0 {
            return Err(invalid_argument(py, "tensor is empty"));
        }
        let len = checked_length(py, length, available, "tensor")?;
        let location = if location.is_empty() {
            tensor_location(region)?
        } else {
            location.to_string()
        };
        return Ok(Region {
            addr,
            len,
            location,
            keep_alive: Some(region.clone().unbind()),
        });
    }
    let (addr, available, c_view) = resolve_buffer(py, region)?;
    let len = checked_length(py, length, available, "buffer")?;
    Ok(Region {
        addr,
        len,
        location: location.to_string(),
        keep_alive: Some((region.clone(), c_view).into_pyobject(py)?.into_any().unbind()),
    })
}

/// The start address of a region argument (for `unregister_memory`).
pub(crate) fn start_address(py: Python<'_>, region: &Bound<'_, PyAny>) -> PyResult<u64> {
    if region.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err("region must not be a bool"));
    }
    if region.is_instance_of::<PyInt>() {
        return address(py, region, "region");
    }
    if is_tensor(region)? {
        return region.call_method0("data_ptr")?.extract();
    }
    let (addr, _, c_view) = resolve_buffer(py, region)?;
    drop(c_view);
    Ok(addr)
}
