//! `SideChannel` for Python: the core's side channel (actix-web on its own
//! threads) serving a `Runtime`'s producer side. While it serves, nothing
//! touches Python: bodies are read, checked and parsed in Rust.

use orbitkv::{MooncakeBootstrap, SideChannel, SideChannelConfig, SideChannelError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::context::ClosesOnExit;
use crate::errors::core_error;
use crate::runtime::{seconds, PyRuntime};

/// Raises a side channel error as its Python class (the core's
/// [`SideChannelError::class_name`] table).
fn side_channel_error(py: Python<'_>, err: SideChannelError) -> PyErr {
    core_error(py, &err, err.class_name(), err.kind())
}

/// The HTTP side channel of a prefill rank (Rust, actix-web): decode ranks
/// POST their handshakes to `/orbitkv/v1/handshake` and cancels to
/// `/orbitkv/v1/cancel`; `GET /orbitkv/v1/health` answers `{"ok": true}`.
///
/// `SideChannel(runtime, host, port, *, key=None, read_timeout_s=10.0,
/// max_connections=64, max_body=16 MiB, mooncake_bootstrap=None)` listens at
/// once (port 0 picks a free one; `address` tells) and serves until
/// `close()`. `mooncake_bootstrap=(engine_id, [rank 0's side channel, ...])`
/// also answers `GET /query` as a Mooncake bootstrap server does (a
/// prefill's rank 0 with the `mooncake` dialect on).
#[pyclass(module = "orbitkv._native", name = "SideChannel", extends = ClosesOnExit, frozen)]
pub struct PySideChannel {
    inner: SideChannel,
    address: String,
}

#[pymethods]
impl PySideChannel {
    #[new]
    #[allow(clippy::too_many_arguments)]
    // mirrors the keyword-only Python signature
    // Every setting left out (None) is `SideChannelConfig::default()`'s
    // (Python reads them as `orbitkv._native.SIDE_CHANNEL_DEFAULTS`).
    #[pyo3(signature = (runtime, host, port, *, key=None, read_timeout_s=None, max_connections=None,
        max_body=None, mooncake_bootstrap=None))]
    fn new(
        py: Python<'_>,
        runtime: &PyRuntime,
        host: &str,
        port: u16,
        key: Option<&[u8]>,
        read_timeout_s: Option<f64>,
        max_connections: Option<usize>,
        max_body: Option<usize>,
        mooncake_bootstrap: Option<(String, Vec<String>)>,
    ) -> PyResult<PyClassInitializer<Self>> {
        let d = SideChannelConfig::default();
        let cfg = SideChannelConfig {
            host: host.to_string(),
            port,
            key: key.map(<[u8]>::to_vec),
            read_timeout: read_timeout_s.map_or(Ok(d.read_timeout), |s| seconds(py, "read_timeout_s", s))?,
            max_connections: max_connections.unwrap_or(d.max_connections),
            max_body: max_body.unwrap_or(d.max_body),
            mooncake_bootstrap: mooncake_bootstrap.map(|(engine_id, worker_addrs)| MooncakeBootstrap {
                engine_id,
                worker_addrs,
            }),
            ..d
        };
        let rt = runtime.rt(py)?;
        let inner = py
            .detach(move || SideChannel::start(cfg, rt))
            .map_err(|e| side_channel_error(py, e))?;
        let this = Self {
            address: inner.address().to_string(),
            inner,
        };
        Ok(PyClassInitializer::from(ClosesOnExit).add_subclass(this))
    }

    /// The bound address, `host:port`.
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    /// What was refused since the start, by cause: `signature` (401),
    /// `forbidden` (403), `malformed` (400), `busy` (503: a runtime budget
    /// full, the runtime stopped, or too many connections), `too_large`
    /// (413), `timed_out` (408), `shed` (closed unanswered: a connection
    /// with no complete request head, to serve a newcomer at
    /// `max_connections`).
    #[getter]
    fn refused<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.inner.refused();
        let d = PyDict::new(py);
        for (k, v) in [
            ("signature", r.signature),
            ("forbidden", r.forbidden),
            ("malformed", r.malformed),
            ("busy", r.busy),
            ("too_large", r.too_large),
            ("timed_out", r.timed_out),
            ("shed", r.shed),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Connections being served now.
    #[getter]
    fn connections(&self) -> usize {
        self.inner.connections()
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        !self.inner.is_running()
    }

    /// Stops listening, lets requests in progress finish (up to 1 s), then
    /// closes every connection; returns within about 3 s (GIL released).
    /// Idempotent.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.stop());
    }

    fn __repr__(&self) -> String {
        format!(
            "SideChannel(address={:?}, closed={})",
            self.address,
            !self.inner.is_running()
        )
    }
}

impl Drop for PySideChannel {
    fn drop(&mut self) {
        // Not closed: stop it here without holding the GIL while it stops.
        if self.inner.is_running() {
            let inner = &self.inner;
            Python::attach(|py| py.detach(|| inner.stop()));
        }
    }
}

/// `side_channel_post(address, path, body, timeout_s, key=None) -> (status,
/// body)`: one POST to a side channel with the core's client (the decode
/// side's publisher uses the same), signed with `key` when given, without
/// the GIL. Raises `OSError` (`ConnectionRefusedError`, `TimeoutError`, ...)
/// when nothing was answered. `orbitkv.vllm.side_channel` wraps it.
#[pyfunction]
#[pyo3(signature = (address, path, body, timeout_s, key=None))]
pub fn side_channel_post(
    py: Python<'_>,
    address: &str,
    path: &str,
    body: &str,
    timeout_s: f64,
    key: Option<&[u8]>,
) -> PyResult<(u16, String)> {
    let timeout = seconds(py, "timeout_s", timeout_s)?;
    py.detach(|| orbitkv::side_channel::client::post(address, path, body, key, timeout))
        .map_err(PyErr::from)
}

/// `side_channel_sign(key, body) -> str`: the signature header's value for
/// `body` under the deployment key (`sha256=<hex HMAC-SHA256>`).
#[pyfunction]
pub fn side_channel_sign(key: &[u8], body: &[u8]) -> String {
    orbitkv::side_channel::sign(key, body)
}
