//! `orbitkv._native`: the PyO3 module inside the `orbitkv` Python package.
//!
//! * [`engine`]: `MooncakeTransferEngine` and `Batch` over the core's
//!   transport (the seed's native boundary).
//! * [`region`]: what `register_memory` accepts (addresses, torch tensors,
//!   buffers).
//! * [`runtime`]: `Runtime` and `RuntimeEvent`, the request runtime of a
//!   rank (producer and consumer sides of each P/D request).
//! * [`side_channel`]: `SideChannel`, the prefill rank's HTTP side channel
//!   (the core's actix-web server, serving a `Runtime` without Python).
//! * [`staging`]: `StagingArena`, the allocator of a prefill worker's source staging.
//! * [`errors`]: core errors → the classes of `orbitkv.errors`.
//! * [`context`]: the context-manager rule (`with`: close on exit) of the
//!   engine and the side channel.
//!
//! The Python sources (`python/orbitkv`) re-export these; the stubs are in
//! `python/orbitkv/_native.pyi` and are checked against this module by
//! `tests/test_stubs.py`.

use pyo3::prelude::*;

mod context;
mod engine;
mod errors;
mod region;
mod runtime;
mod side_channel;
mod staging;

/// Native core of OrbitKV (Rust). Import from `orbitkv` rather than from here.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "PINNED_MOONCAKE_VERSION",
        orbitkv::transport::PINNED_MOONCAKE_VERSION,
    )?;
    // The runtime's counters, in `Runtime.stats()`'s keys: the one list the
    // Python side reports (orbitkv.vllm.stats).
    let fields: Vec<String> = serde_json::to_value(orbitkv::StatsSnapshot::default())
        .ok()
        .and_then(|v| v.as_object().map(|m| m.keys().cloned().collect()))
        .unwrap_or_default();
    m.add("STATS_FIELDS", pyo3::types::PyTuple::new(m.py(), fields)?)?;
    // The request phases `Runtime.take_timings()` times, by name.
    let timings: Vec<&str> = orbitkv::Timing::ALL.iter().map(|t| t.name()).collect();
    m.add("TIMING_NAMES", pyo3::types::PyTuple::new(m.py(), timings)?)?;
    // The runtime's defaults, in `Runtime(...)`'s keyword names: the core's
    // `RuntimeSettings::defaults()` (from `RuntimeConfig::default()`, the one
    // place they are written), every setting that has one.
    let defaults = pyo3::types::PyDict::new(m.py());
    if let Ok(serde_json::Value::Object(map)) = serde_json::to_value(orbitkv::RuntimeSettings::defaults()) {
        for (k, v) in map {
            if let Some(n) = v.as_u64() {
                defaults.set_item(k, n)?;
            } else if let Some(x) = v.as_f64() {
                defaults.set_item(k, x)?;
            } else if let Some(b) = v.as_bool() {
                defaults.set_item(k, b)?;
            }
        }
    }
    m.add("RUNTIME_DEFAULTS", defaults)?;
    // Every setting `Runtime(...)` takes, by name (the core's
    // `RuntimeSettings`; the deployment key is not serialized).
    let mut names: Vec<String> = match serde_json::to_value(orbitkv::RuntimeSettings::default()) {
        Ok(serde_json::Value::Object(map)) => map.keys().cloned().collect(),
        _ => Vec::new(),
    };
    names.push("side_channel_key".to_string());
    m.add("RUNTIME_SETTINGS", pyo3::types::PyTuple::new(m.py(), names)?)?;
    // The range cap left out, by the transport Mooncake installed (the
    // core's `TransportKind::default_ranges_in_flight`).
    let caps = pyo3::types::PyDict::new(m.py());
    for k in orbitkv::transport::TransportKind::ALL {
        caps.set_item(k.name(), k.default_ranges_in_flight())?;
    }
    m.add("DEFAULT_RANGES_IN_FLIGHT", caps)?;
    // The side channel's protocol constants and defaults: written once, in
    // the core (orbitkv.vllm.side_channel reads them from here).
    m.add(
        "SIDE_CHANNEL_HANDSHAKE_PATH",
        orbitkv::side_channel::HANDSHAKE_PATH,
    )?;
    m.add("SIDE_CHANNEL_CANCEL_PATH", orbitkv::side_channel::CANCEL_PATH)?;
    m.add("SIDE_CHANNEL_HEALTH_PATH", orbitkv::side_channel::HEALTH_PATH)?;
    m.add(
        "SIDE_CHANNEL_SIGNATURE_HEADER",
        orbitkv::side_channel::SIGNATURE_HEADER,
    )?;
    let sc = orbitkv::SideChannelConfig::default();
    let sc_defaults = pyo3::types::PyDict::new(m.py());
    sc_defaults.set_item("max_body", sc.max_body)?;
    sc_defaults.set_item("read_timeout_s", sc.read_timeout.as_secs_f64())?;
    sc_defaults.set_item("max_connections", sc.max_connections)?;
    m.add("SIDE_CHANNEL_DEFAULTS", sc_defaults)?;
    m.add_class::<context::ClosesOnExit>()?;
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<engine::PyBatch>()?;
    m.add_class::<runtime::PyRuntime>()?;
    m.add_class::<runtime::PyRuntimeEvent>()?;
    m.add_class::<side_channel::PySideChannel>()?;
    m.add_class::<staging::PyStagingArena>()?;
    m.add_function(wrap_pyfunction!(runtime::install_trace, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::new_capability, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::cancel_message, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::producer_ranks, m)?)?;
    m.add_function(wrap_pyfunction!(side_channel::side_channel_post, m)?)?;
    m.add_function(wrap_pyfunction!(side_channel::side_channel_sign, m)?)?;
    Ok(())
}
