//! `Runtime` and `RuntimeEvent` for Python: the request runtime of one rank
//! (the core's `orbitkv::Runtime`, actors on their own threads).
//!
//! Every call that can wait releases the GIL (`Python::detach`): the ones
//! that ask the request directory for an answer (`consumer_open`,
//! `producer_open`, `producer_handshake`, the `producer_*` and `layer*`
//! calls that hand a layer or an end to a producer, `staging_in_use`,
//! `live_requests`), `next_event` (up to its timeout) and `shutdown` (the
//! actors' drain). Nothing calls back into Python.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use orbitkv::staging::{source_group, units as staging_units, SourceStaging, StagedOrder};
use orbitkv::{
    Cancel, Capability, KvLayout, Outcome, PagesBack, RequestId, Runtime, RuntimeError, RuntimeEvent,
    RuntimeSettings,
};
use parking_lot::RwLock;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::engine::PyEngine;
use crate::errors::{core_error, invalid_argument, transport_error};

/// Each plane's (offset, unit bytes) in a layer piece.
type PlaneSlots = Vec<(u64, u64)>;

/// `Runtime(...)`'s keyword settings as the core's [`RuntimeSettings`], by
/// name: numbers, pairs of numbers, None (the default), and bytes for
/// `side_channel_key`. A name the core does not know, or a value of the
/// wrong kind, is an `InvalidArgumentError` naming the setting.
fn settings_from(py: Python<'_>, kw: Option<&Bound<'_, PyDict>>) -> PyResult<RuntimeSettings> {
    use serde_json::{Map, Value};
    let mut map = Map::new();
    let mut key = None;
    for (k, v) in kw.into_iter().flat_map(|d| d.iter()) {
        let name: String = k.extract()?;
        if name == "side_channel_key" {
            key = v
                .extract::<Option<Vec<u8>>>()
                .map_err(|_| invalid_argument(py, "side_channel_key must be bytes or None".to_string()))?;
            continue;
        }
        let value = setting_value(&v).ok_or_else(|| {
            invalid_argument(
                py,
                format!("{name}: a number, a pair of numbers or None, not {v}"),
            )
        })?;
        map.insert(name, value);
    }
    let mut s: RuntimeSettings = serde_json::from_value(Value::Object(map.clone())).map_err(|e| {
        // serde names a setting it does not know, not one of the wrong kind
        let culprit = map.iter().find(|(k, v)| {
            let one = Map::from_iter([((*k).clone(), (*v).clone())]);
            serde_json::from_value::<RuntimeSettings>(Value::Object(one)).is_err()
        });
        let msg = match culprit {
            Some((k, v)) => format!("{k} = {v}: {e}"),
            None => e.to_string(),
        };
        invalid_argument(py, msg)
    })?;
    s.side_channel_key = key;
    Ok(s)
}

/// One setting's value as JSON: None, a bool (refused by every setting), an
/// integer, a float (a non-finite one as its text, which no setting takes),
/// or a tuple or list of those; `None` for anything else.
fn setting_value(v: &Bound<'_, PyAny>) -> Option<serde_json::Value> {
    use pyo3::types::{PyBool, PyFloat, PyInt, PyList, PyTuple};
    use serde_json::Value;
    if v.is_none() {
        return Some(Value::Null);
    }
    if v.is_instance_of::<PyBool>() {
        return v.extract::<bool>().ok().map(Value::Bool);
    }
    if v.is_instance_of::<PyInt>() {
        return match v.extract::<i64>() {
            Ok(i) => Some(Value::from(i)),
            Err(_) => v.extract::<u64>().ok().map(Value::from),
        };
    }
    if v.is_instance_of::<PyFloat>() {
        let f: f64 = v.extract().ok()?;
        return Some(
            serde_json::Number::from_f64(f).map_or_else(|| Value::String(f.to_string()), Value::Number),
        );
    }
    if v.is_instance_of::<PyTuple>() || v.is_instance_of::<PyList>() {
        let items: Vec<Bound<'_, PyAny>> = v.try_iter().ok()?.collect::<PyResult<_>>().ok()?;
        return items
            .iter()
            .map(setting_value)
            .collect::<Option<Vec<_>>>()
            .map(Value::Array);
    }
    None
}

/// Request blocks `[start, end)`; a reversed range is an
/// `InvalidArgumentError`.
fn block_range(py: Python<'_>, start: u32, end: u32) -> PyResult<Range<u32>> {
    if end < start {
        return Err(invalid_argument(
            py,
            format!("block range [{start}, {end}) is reversed"),
        ));
    }
    Ok(start..end)
}

/// `(request_id, start, end)` chunks as request IDs and block ranges.
fn block_ranges(py: Python<'_>, chunks: Vec<(String, u32, u32)>) -> PyResult<Vec<(RequestId, Range<u32>)>> {
    chunks
        .into_iter()
        .map(|(request, start, end)| Ok((RequestId::new(&request), block_range(py, start, end)?)))
        .collect()
}

/// Raises a runtime error as its Python class (the core's
/// [`RuntimeError::class_name`] table), with the variant's fields as details.
pub(crate) fn runtime_error(py: Python<'_>, err: RuntimeError) -> PyErr {
    match err {
        RuntimeError::Transport(e) => transport_error(py, e),
        err => core_error(py, &err, err.class_name(), err.kind()),
    }
}

fn capability(py: Python<'_>, s: &str) -> PyResult<Capability> {
    Capability::parse(s).map_err(|e| invalid_argument(py, format!("capability: {e}")))
}

/// The prefill ranks (TP size `producer_tp`) that send to decode rank
/// `consumer_rank` of TP size `consumer_tp`, for a model of `total_kv_heads`
/// KV heads: for each head the decode rank holds, the lowest prefill rank
/// holding it (vLLM replicates heads when there are fewer than ranks). The
/// ranks decode sends its handshake to, and the producers it waits for.
#[pyfunction]
pub fn producer_ranks(
    py: Python<'_>,
    total_kv_heads: u32,
    consumer_rank: u32,
    consumer_tp: u32,
    producer_tp: u32,
) -> PyResult<Vec<u32>> {
    let ok = |h: u32, tp: u32| tp > 0 && h > 0 && (h % tp == 0 || tp % h == 0);
    if !ok(total_kv_heads, consumer_tp) || !ok(total_kv_heads, producer_tp) || consumer_rank >= consumer_tp {
        return Err(invalid_argument(
            py,
            format!(
                "{total_kv_heads} KV heads, decode rank {consumer_rank} of TP {consumer_tp}, prefill TP {producer_tp}: \
                 heads must split over or replicate evenly on both"
            ),
        ));
    }
    Ok(
        orbitkv::layout::producer_ranks_for(total_kv_heads, consumer_rank, consumer_tp, producer_tp)
            .into_iter()
            .collect(),
    )
}

/// Installs, once per process, OrbitKV's global subscriber: its warnings on
/// stderr (`ORBITKV_LOG` filters them) and, with `path`, a Chrome trace of
/// the actors written there (`filter`: an `EnvFilter` directive,
/// `max_events`: events kept). Later calls, and runtimes started later,
/// keep the first setting. Returns the trace path in effect, or None.
#[pyfunction]
#[pyo3(signature = (path=None, *, filter=None, max_events=None))]
pub fn install_trace(
    path: Option<String>,
    filter: Option<String>,
    max_events: Option<usize>,
) -> Option<String> {
    orbitkv::trace::install_global(orbitkv::trace::GlobalTrace {
        path: path.filter(|p| !p.is_empty()).map(std::path::PathBuf::from),
        filter,
        max_events,
    })
    .map(|p| p.display().to_string())
}

/// A fresh random capability (256 bits from the OS's cryptographic source)
/// for one request, as a router hands it to both halves.
#[pyfunction]
pub fn new_capability() -> String {
    Capability::random().as_str().to_string()
}

/// The cancel message (wire JSON) a consumer sends to a producer rank's
/// side channel when it gives `request_id` up before authorizing anything,
/// or, with `generation` and `consumer_rank`, the fence of an authorization
/// it released.
#[pyfunction]
#[pyo3(signature = (request_id, capability_hex, reason, generation=None, consumer_rank=None))]
pub fn cancel_message(
    py: Python<'_>,
    request_id: &str,
    capability_hex: &str,
    reason: &str,
    generation: Option<u64>,
    consumer_rank: Option<u32>,
) -> PyResult<String> {
    if request_id.is_empty() {
        return Err(invalid_argument(py, "request_id is empty".to_string()));
    }
    let cancel = Cancel::new(
        RequestId::new(request_id),
        capability(py, capability_hex)?,
        reason,
    );
    Ok(match (generation, consumer_rank) {
        (Some(g), Some(r)) => cancel.fencing(orbitkv::Generation(g), r),
        (None, None) => cancel,
        _ => {
            return Err(invalid_argument(
                py,
                "generation and consumer_rank come together".to_string(),
            ))
        }
    }
    .to_json())
}

pub(crate) fn seconds(py: Python<'_>, name: &str, s: f64) -> PyResult<Duration> {
    if !s.is_finite() || s <= 0.0 {
        return Err(invalid_argument(
            py,
            format!("{name} must be a finite number > 0, not {s}"),
        ));
    }
    Duration::try_from_secs_f64(s).map_err(|e| invalid_argument(py, format!("{name}: {e}")))
}

/// `(grant address, authorized blocks, [(first unit, end unit), ...], group)`.
type StagedTuple = (u64, u32, Vec<(u32, u32)>, u32);

/// Something the runtime reports: a decode request's KV arrived
/// (`"consumer_completed"`) or will not (`"consumer_failed"`), no producer is
/// waited for after a held failure (`"consumer_quiesced"`), its blocks are
/// free of writers (`"consumer_released"`), or a prefill request's writes all
/// drained (`"producer_released"`, with `outcome` `"done"`, `"failed"` or
/// `"aborted"`).
#[pyclass(module = "orbitkv._native", name = "RuntimeEvent", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct PyRuntimeEvent {
    /// `"consumer_completed"`, `"consumer_failed"`, `"consumer_quiesced"`,
    /// `"consumer_released"` or `"producer_released"`.
    kind: &'static str,
    /// The P/D request ID.
    request_id: String,
    /// The consumer generation (consumer events only).
    generation: Option<u64>,
    /// Bytes that arrived (`consumer_completed` only).
    bytes: Option<u64>,
    /// `"done"`, `"failed"` or `"aborted"` (`producer_released` only).
    outcome: Option<&'static str>,
    /// Why (failures, aborts).
    reason: Option<String>,
    /// `consumer_failed` only: at the deadline, with a producer that never
    /// ended; the blocks must not be reused before `consumer_quiesced` or
    /// `consumer_released`.
    held: Option<bool>,
    /// `consumer_completed` only, when producers wrote into the request's
    /// staging grant: `(grant address, authorized blocks, [(first unit, end
    /// unit), ...], group)`. The worker scatters those units of every
    /// authorized block from the grant (staged grouped by `group` units)
    /// into its pages before the KV is used.
    staged: Option<StagedTuple>,
}

#[pymethods]
impl PyRuntimeEvent {
    fn __repr__(&self) -> String {
        format!(
            "RuntimeEvent(kind={:?}, request_id={:?}, generation={:?}, bytes={:?}, outcome={:?}, reason={:?}, held={:?}, staged={:?})",
            self.kind, self.request_id, self.generation, self.bytes, self.outcome, self.reason, self.held, self.staged
        )
    }
}

fn outcome_name(o: Outcome) -> &'static str {
    match o {
        Outcome::Done => "done",
        Outcome::Failed => "failed",
        Outcome::Aborted => "aborted",
    }
}

impl From<RuntimeEvent> for PyRuntimeEvent {
    fn from(ev: RuntimeEvent) -> Self {
        let base = |kind, request: RequestId| PyRuntimeEvent {
            kind,
            request_id: request.0,
            generation: None,
            bytes: None,
            outcome: None,
            reason: None,
            held: None,
            staged: None,
        };
        match ev {
            RuntimeEvent::ConsumerCompleted {
                request,
                generation,
                bytes,
                staged,
            } => PyRuntimeEvent {
                generation: Some(generation.0),
                bytes: Some(bytes),
                staged: staged.map(|s| {
                    (
                        s.grant.base,
                        s.blocks,
                        s.units.iter().map(|u| (u.start, u.end)).collect(),
                        s.grant.group,
                    )
                }),
                ..base("consumer_completed", request)
            },
            RuntimeEvent::ConsumerFailed {
                request,
                generation,
                reason,
                held,
            } => PyRuntimeEvent {
                generation: Some(generation.0),
                reason: Some(reason),
                held: Some(held),
                ..base("consumer_failed", request)
            },
            RuntimeEvent::ConsumerQuiesced { request, generation } => PyRuntimeEvent {
                generation: Some(generation.0),
                ..base("consumer_quiesced", request)
            },
            RuntimeEvent::ConsumerReleased { request, generation } => PyRuntimeEvent {
                generation: Some(generation.0),
                ..base("consumer_released", request)
            },
            RuntimeEvent::ProducerReleased {
                request,
                outcome,
                reason,
            } => PyRuntimeEvent {
                outcome: Some(outcome_name(outcome)),
                reason,
                ..base("producer_released", request)
            },
        }
    }
}

/// The request runtime of one rank.
///
/// `Runtime(engine, layout_json, *, consumer_timeout_s=None, ..., publish_timeout_s=None)`:
/// each setting left out is the Rust `RuntimeConfig::default()`'s
/// (`orbitkv._native.RUNTIME_DEFAULTS`).
/// `layout_json` is this rank's KV geometry (see `docs/architecture.md`);
/// its memory must be registered with `engine`.
///
/// Decode side: `consumer_open` → publish the returned handshake →
/// `consumer_completed`/`consumer_failed` event → `consumer_release` →
/// `consumer_released`. Prefill side: `producer_open`, `producer_handshake`
/// (any order), `layer_ready` per computed layer, `producer_finish` or
/// `producer_abort` → `producer_released` once every write drained.
#[pyclass(module = "orbitkv._native", name = "Runtime", frozen)]
pub struct PyRuntime {
    inner: RwLock<Option<Arc<Runtime>>>,
    endpoint: String,
}

impl PyRuntime {
    pub(crate) fn rt(&self, py: Python<'_>) -> PyResult<Arc<Runtime>> {
        self.inner
            .read()
            .clone()
            .ok_or_else(|| runtime_error(py, RuntimeError::Stopped))
    }
}

#[pymethods]
impl PyRuntime {
    #[new]
    // Every setting is a keyword (`RuntimeSettings`' field names); one left
    // out (or None) is `RuntimeConfig::default()`'s: the one place the
    // defaults are written (Python reads them as
    // `orbitkv._native.RUNTIME_DEFAULTS`). A setting is added in the core
    // alone: this binding passes them through by name.
    #[pyo3(signature = (engine, layout_json, **settings))]
    fn new(
        py: Python<'_>,
        engine: &PyEngine,
        layout_json: &str,
        settings: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let layout: KvLayout = serde_json::from_str(layout_json).map_err(|e| {
            runtime_error(
                py,
                orbitkv::ProtocolError::Malformed {
                    what: "layout",
                    reason: e.to_string(),
                }
                .into(),
            )
        })?;
        // One settings object; the core checks and bounds it.
        let cfg = settings_from(py, settings)?
            .config()
            .map_err(|e| runtime_error(py, e))?;
        let transport = engine.transport(py)?;
        let endpoint = transport.endpoint().to_string();
        // This binding embeds the library in Python: unless the process
        // installed OrbitKV's subscriber already (`install_trace`), OrbitKV's
        // warnings go to stderr and `ORBITKV_TRACE` names a trace file.
        orbitkv::trace::init_from_env();
        let rt = py
            .detach(|| Runtime::start(transport, layout, cfg))
            .map_err(|e| runtime_error(py, e))?;
        Ok(Self {
            inner: RwLock::new(Some(Arc::new(rt))),
            endpoint,
        })
    }

    /// This rank's Mooncake endpoint (`ip:port`).
    #[getter]
    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The transport Mooncake installed, as its rule gives it (`tcp`,
    /// `rdma`, `nvlink_intra` or `unknown`).
    #[getter]
    fn transport(&self, py: Python<'_>) -> PyResult<&'static str> {
        Ok(self.rt(py)?.transport_kind().name())
    }

    /// Ranges in flight per peer: the setting, else the transport's default
    /// (8192 on `nvlink_intra`, 768 otherwise).
    #[getter]
    fn max_ranges_in_flight_per_peer(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.rt(py)?.max_ranges_in_flight_per_peer())
    }

    /// Decode side: authorizes `block_ids` for request blocks `first_block..`
    /// of `request_id`, expecting the producers of a prefill instance of TP
    /// size `producer_tp`. Returns the handshake (JSON); it carries
    /// `capability` (hex), the request's secret, and `notice_key` (hex),
    /// this authorization's: only holders of the key can make a notice the
    /// consumer believes, so the handshake goes only to the allowed prefill
    /// side channels and is never logged. With `publish_to`
    /// (`[(host:port, producer rank)]`) the runtime also sends it there
    /// from its own threads (signed with the runtime's `side_channel_key`),
    /// and fails a rank that refuses it at once. `tokens`: the request's
    /// tokens decode loads, counted from its start (its prompt length),
    /// which a prefill of another block size needs (0: not said; only an
    /// equal block size is served then).
    #[pyo3(signature = (request_id, capability_hex, first_block, block_ids, producer_tp, publish_to=None, tokens=0))]
    #[allow(clippy::too_many_arguments)] // mirrors the Python signature
    fn consumer_open(
        &self,
        py: Python<'_>,
        request_id: &str,
        capability_hex: &str,
        first_block: u32,
        block_ids: Vec<u32>,
        producer_tp: u32,
        publish_to: Option<Vec<(String, u32)>>,
        tokens: u32,
    ) -> PyResult<String> {
        let cap = capability(py, capability_hex)?;
        let rt = self.rt(py)?;
        let request = RequestId::new(request_id);
        py.detach(move || {
            let h = rt.consumer_open_tokens(request, cap, first_block, block_ids, producer_tp, tokens)?;
            if let Some(targets) = publish_to {
                rt.consumer_publish(&h, targets)?;
            }
            Ok(h.to_json())
        })
        .map_err(|e| runtime_error(py, e))
    }

    /// Decode side: sends the cancel of `request_id` (it gave the request up
    /// before authorizing anything) to the prefill side channels `addrs`,
    /// from the runtime's own threads.
    fn consumer_send_cancel(
        &self,
        py: Python<'_>,
        request_id: &str,
        capability_hex: &str,
        reason: &str,
        addrs: Vec<String>,
    ) -> PyResult<()> {
        let cancel = Cancel::new(
            RequestId::new(request_id),
            capability(py, capability_hex)?,
            reason,
        );
        self.rt(py)?.consumer_send_cancel(&cancel, addrs);
        Ok(())
    }

    /// Decode side: producer rank `producer_rank` refused the handshake of
    /// `generation` (or could not be reached), so nothing from it can land;
    /// the consumer counts that rank as failed now rather than at its
    /// deadline. `StaleGenerationError`/`UnknownRequestError` otherwise.
    fn consumer_handshake_refused(
        &self,
        py: Python<'_>,
        request_id: &str,
        generation: u64,
        producer_rank: u32,
        reason: &str,
    ) -> PyResult<()> {
        let rt = self.rt(py)?;
        let (request, reason) = (RequestId::new(request_id), reason.to_owned());
        py.detach(move || {
            rt.consumer_handshake_refused(&request, orbitkv::Generation(generation), producer_rank, &reason)
        })
        .map_err(|e| runtime_error(py, e))
    }

    /// Decode side: vLLM is done with the request; a `consumer_released`
    /// event follows once no producer can write into its blocks.
    fn consumer_release(&self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        let rt = self.rt(py)?;
        let request = RequestId::new(request_id);
        py.detach(move || rt.consumer_release(&request))
            .map_err(|e| runtime_error(py, e))
    }

    /// Prefill side: opens the request with its source blocks (request
    /// order) for a decode instance of TP size `consumer_tp`; only
    /// handshakes and cancels carrying `capability` (hex) are accepted for it.
    ///
    /// With `staging_base` (an address inside the runtime's
    /// `source_staging_region`) the caller gathers each computed layer of
    /// request blocks `0..staging_blocks` there in the staged order
    /// (`staged_layout`) before it reports the layer ready, and keeps that
    /// memory for the request until its `producer_released` event; the
    /// runtime then writes from it into consumers' staging grants or
    /// pages. `staging_group`: the units per group of its staged order
    /// (default: `staging_group(consumer_tp)`, the one that lets it write
    /// a consumer of a larger TP size straight into its pages).
    ///
    /// With `stage_by_layer` (and no `staging_base`) the request is staged
    /// by layer and chunk: before gathering a layer of a chunk the caller
    /// asks `producer_stage_layer` for a piece of the source staging region
    /// (the runtime gives it and takes it back as soon as its writes ended),
    /// and a layer given no piece is written from the pages. Grouped by
    /// `staging_group` as above; never into a staging grant.
    #[pyo3(signature = (request_id, block_ids, capability_hex, consumer_tp=1, *, staging_base=None, staging_blocks=0, staging_group=None, stage_by_layer=false))]
    #[allow(clippy::too_many_arguments)] // mirrors the Python signature
    fn producer_open(
        &self,
        py: Python<'_>,
        request_id: &str,
        block_ids: Vec<u32>,
        capability_hex: &str,
        consumer_tp: u32,
        staging_base: Option<u64>,
        staging_blocks: u32,
        staging_group: Option<u32>,
        stage_by_layer: bool,
    ) -> PyResult<()> {
        let cap = capability(py, capability_hex)?;
        let rt = self.rt(py)?;
        let group = staging_group.unwrap_or_else(|| source_group(rt.layout(), consumer_tp));
        let request = RequestId::new(request_id);
        if stage_by_layer {
            if staging_base.is_some() {
                return Err(invalid_argument(
                    py,
                    "stage_by_layer takes its pieces from the runtime: no staging_base",
                ));
            }
            return py
                .detach(move || rt.producer_open_by_layer(request, block_ids, cap, consumer_tp, group))
                .map_err(|e| runtime_error(py, e));
        }
        let staging = staging_base.map(|base| SourceStaging {
            base,
            capacity: staging_blocks,
            group,
        });
        py.detach(move || rt.producer_open_staged(request, block_ids, cap, consumer_tp, staging))
            .map_err(|e| runtime_error(py, e))
    }

    /// Prefill side: a piece of the source staging region for layer
    /// `layer` of request blocks `start_block..end_block` (this step's
    /// chunk) of a request opened with `stage_by_layer`, to gather that
    /// layer of the chunk into now, in the order `producer_gather_order`
    /// gave: `(address, planes)`, each plane's `(offset, unit bytes)` in
    /// the piece (`StagingCopier.gather_piece`'s `slots`). `None`: no room
    /// now (the layer is written from the pages). The runtime takes the
    /// piece back itself (when its writes ended, or at the release).
    fn producer_stage_layer(
        &self,
        py: Python<'_>,
        request_id: &str,
        layer: u32,
        start_block: u32,
        end_block: u32,
    ) -> PyResult<Option<(u64, PlaneSlots)>> {
        let rt = self.rt(py)?;
        let request = RequestId::new(request_id);
        py.detach(move || rt.producer_stage_layer(&request, layer, start_block..end_block))
            .map(|got| got.map(|(piece, slots)| (piece.base, slots)))
            .map_err(|e| runtime_error(py, e))
    }

    /// Prefill, on a runtime started with `source_staging_later=True`:
    /// adds `segments` (`(address, bytes)` each: registered memory nothing
    /// else writes, such as the KV blocks the scheduler took out of vLLM's
    /// pool) to the source staging the layer pieces come from; a piece lies
    /// inside one segment. All or nothing (`InvalidArgumentError` for a
    /// segment empty, at 0, overflowing or overlapping). Returns the
    /// region's `(segments, bytes)`.
    fn add_source_staging(&self, py: Python<'_>, segments: Vec<(u64, u64)>) -> PyResult<(usize, u64)> {
        self.rt(py)?
            .add_source_staging(&segments)
            .map_err(|e| runtime_error(py, e))
    }

    /// Prefill side, a runtime made with `gather_in_writer` and a source
    /// staging region: from now on the writer lanes gather scattered layer
    /// writes into pieces of the region (`orbitkv.pd.staging_pieces`
    /// `write`), copying with `copy`: `"cuda"` on the GPU whose CUDA context
    /// is current on the calling thread (call it on the worker's thread),
    /// with OrbitKV's gather kernel (the copy engines where it does not
    /// load); `"cuda-copy-engines"` there on the copy engines only;
    /// `"host"` with memcpy (a KV cache in host memory); `"off"` stops it
    /// (a region given back, no write in flight). Returns how it copies
    /// (`gather kernel`, `cuMemcpyBatchAsync`, `cuMemcpyAsync per range`,
    /// `memcpy`, `off`; with why, where the kernel did not load).
    /// `InvalidArgumentError` without the setting or for another word; `CudaError` without a
    /// CUDA driver or context.
    fn set_writer_gather(&self, py: Python<'_>, copy: &str) -> PyResult<String> {
        let copy = match copy {
            "cuda" => orbitkv::GatherCopy::Cuda,
            "cuda-copy-engines" => orbitkv::GatherCopy::CudaCopyEngines,
            "host" => orbitkv::GatherCopy::Host,
            "off" => orbitkv::GatherCopy::Off,
            other => {
                return Err(runtime_error(
                    py,
                    orbitkv::RuntimeError::InvalidArgument(format!(
                        "the writer's gather copies with 'cuda', 'cuda-copy-engines', 'host' or 'off', not {other:?}"
                    )),
                ))
            }
        };
        self.rt(py)?
            .set_writer_gather(copy)
            .map_err(|e| runtime_error(py, e))
    }

    /// Whether the writer lanes gather (`set_writer_gather` ran).
    fn writer_gathers(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.rt(py)?.writer_gathers())
    }

    /// `(bytes, pieces)` of the source staging region given out as layer
    /// pieces now (`(0, 0)` once every write from them ended).
    fn source_staging_in_use(&self, py: Python<'_>) -> PyResult<(u64, usize)> {
        Ok(self.rt(py)?.source_staging_in_use())
    }

    /// The units per group of the source staging a request for a decode of
    /// TP size `consumer_tp` gathers (`orbitkv.staging`'s `group`): the
    /// heads of one decode rank when that rank's blocks are whole groups of
    /// this rank's heads (written straight into its pages), else 1.
    fn staging_group(&self, py: Python<'_>, consumer_tp: u32) -> PyResult<u32> {
        Ok(source_group(self.rt(py)?.layout(), consumer_tp))
    }

    /// Where each (layer, plane) of `capacity` request blocks lies in this
    /// rank's staged order: `{"units": units per block, "bytes": total,
    /// "slots": [[(offset, unit bytes) per plane] per layer]}`. Unit `u` of
    /// request block `i` of (layer, plane) is at `offset + ((u / G *
    /// capacity + i) * G + u % G) * unit_bytes`, `G` the order's group (1:
    /// `offset + (u * capacity + i) * unit_bytes`); the slots do not depend
    /// on `G` (`orbitkv.staging` gathers and scatters so).
    fn staged_layout<'py>(&self, py: Python<'py>, capacity: u32) -> PyResult<Bound<'py, PyDict>> {
        let rt = self.rt(py)?;
        let layout = rt.layout();
        let order = StagedOrder::new(layout, capacity)
            .ok_or_else(|| invalid_argument(py, format!("{capacity} blocks overflow the staged size")))?;
        let d = PyDict::new(py);
        d.set_item("units", staging_units(layout))?;
        d.set_item("bytes", order.bytes)?;
        d.set_item("slots", order.slots)?;
        Ok(d)
    }

    /// Decode side: `(bytes, grants)` of staging given out now (each grant
    /// goes back when its request's `consumer_released` comes).
    fn staging_in_use(&self, py: Python<'_>) -> PyResult<(u64, usize)> {
        let rt = self.rt(py)?;
        py.detach(move || rt.staging_in_use())
            .map_err(|e| runtime_error(py, e))
    }

    /// Prefill side: appends source blocks (chunked prefill).
    fn producer_add_blocks(&self, py: Python<'_>, request_id: &str, block_ids: Vec<u32>) -> PyResult<()> {
        let rt = self.rt(py)?;
        let request = RequestId::new(request_id);
        py.detach(move || rt.producer_add_blocks(&request, block_ids))
            .map_err(|e| runtime_error(py, e))
    }

    /// Prefill side: the order in which to gather request blocks
    /// `start_block..end_block` (this step's chunk) into the request's
    /// source staging, asked once before its first layer is gathered:
    /// `order[k]` is the request block for slot `start_block + k`; `None`:
    /// the request's order. The writes of the chunk follow it. `pin_first`,
    /// `pin_last`: those blocks stay in their slots (a block the chunk may
    /// share with the one before or after it: set both unless the chunk is
    /// the request's first, resp. last); a request staged by layer pins
    /// nothing (each chunk has pieces of its own).
    #[pyo3(signature = (request_id, start_block, end_block, *, pin_first=true, pin_last=true))]
    fn producer_gather_order(
        &self,
        py: Python<'_>,
        request_id: &str,
        start_block: u32,
        end_block: u32,
        pin_first: bool,
        pin_last: bool,
    ) -> PyResult<Option<Vec<u32>>> {
        let rt = self.rt(py)?;
        let request = RequestId::new(request_id);
        py.detach(move || rt.producer_gather_order(&request, start_block..end_block, (pin_first, pin_last)))
            .map_err(|e| runtime_error(py, e))
    }

    /// Prefill side: admits a consumer's handshake (JSON). Strict: a bad one
    /// raises `HandshakeError`/`GeometryError`, one without the request's
    /// capability `ForbiddenError`, one over the parking budget
    /// `OverloadedError`; none changes anything.
    /// Parsing and checking run with the GIL released (a large handshake
    /// must not stall the worker's forward pass).
    fn producer_handshake(&self, py: Python<'_>, handshake_json: &str) -> PyResult<()> {
        let rt = self.rt(py)?;
        let json = handshake_json.to_owned();
        py.detach(move || rt.producer_handshake_json(&json))
            .map_err(|e| runtime_error(py, e))
    }

    /// Prefill side: `layer` is computed for request blocks `[start, end)`.
    /// Never waits for the transfer.
    fn layer_ready(
        &self,
        py: Python<'_>,
        request_id: &str,
        layer: u32,
        start: u32,
        end: u32,
    ) -> PyResult<()> {
        let blocks = block_range(py, start, end)?;
        let rt = self.rt(py)?;
        let request = RequestId::new(request_id);
        py.detach(move || rt.layer_ready(&request, layer, blocks))
            .map_err(|e| runtime_error(py, e))
    }

    /// Prefill side: `layer` is computed for each request in `chunks`
    /// (`(request_id, start, end)`, request blocks `[start, end)`), in one
    /// call into the runtime. Returns `(request_id, error)` for each request
    /// it could not admit (`UnknownRequestError`: released meanwhile); the
    /// others are admitted. Never waits for the transfer.
    fn layers_ready(
        &self,
        py: Python<'_>,
        layer: u32,
        chunks: Vec<(String, u32, u32)>,
    ) -> PyResult<Vec<(String, Py<PyAny>)>> {
        let rt = self.rt(py)?;
        let chunks = block_ranges(py, chunks)?;
        let refused = py
            .detach(move || rt.layers_ready(layer, chunks))
            .map_err(|e| runtime_error(py, e))?;
        Ok(refused
            .into_iter()
            .map(|(request, e)| (request.0, runtime_error(py, e).into_value(py).into_any()))
            .collect())
    }

    /// Prefill side, on a GPU: `layer` of each request in `chunks`
    /// (`(request_id, start, end)`, request blocks `[start, end)`) was
    /// *launched* on CUDA stream `stream` (a `cudaStream_t` as an int) by
    /// the calling thread. Records an event there, hands the layer to the
    /// runtime and returns at once; each request's write is planned at once
    /// and submitted by its layer writer once the event was reached (the
    /// writer waits, no GIL), in call order. A request released meanwhile is
    /// skipped; a failed wait fails the requests whose writes waited for it.
    fn layers_ready_after(
        &self,
        py: Python<'_>,
        stream: u64,
        layer: u32,
        chunks: Vec<(String, u32, u32)>,
    ) -> PyResult<()> {
        let rt = self.rt(py)?;
        let chunks = block_ranges(py, chunks)?;
        py.detach(move || rt.layers_ready_on_stream(stream, layer, chunks))
            .map_err(|e| runtime_error(py, e))
    }

    /// Prefill side, on a GPU: `producer_finish`, taken after every layer
    /// handed to `layers_ready_after` before (the notice still goes only
    /// once their writes ended). Before any layer went that way it is
    /// `producer_finish` now.
    fn producer_finish_after(&self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        let rt = self.rt(py)?;
        let request = RequestId::new(request_id);
        py.detach(move || rt.producer_finish_after(&request))
            .map_err(|e| runtime_error(py, e))
    }

    /// Prefill side: no more layers come; notify the consumer once drained.
    fn producer_finish(&self, py: Python<'_>, request_id: &str) -> PyResult<()> {
        let rt = self.rt(py)?;
        let request = RequestId::new(request_id);
        py.detach(move || rt.producer_finish(&request))
            .map_err(|e| runtime_error(py, e))
    }

    /// Prefill side: whether vLLM may free the pages of `request_id` (opened
    /// with `stage_by_layer`, finished) now, before its writes ended: every
    /// layer of every chunk is in a layer piece or at decode already, and
    /// no write reads the pages. `"now"`: given up for good by this call
    /// (nothing reads them any more; each piece goes back once its writes
    /// ended); `"before"`: by an earlier call; `"not_yet"`: ask again later;
    /// `"never"`: only the release frees them (do not ask again).
    fn producer_give_back_pages(&self, py: Python<'_>, request_id: &str) -> PyResult<&'static str> {
        let rt = self.rt(py)?;
        let request = RequestId::new(request_id);
        let back = py
            .detach(move || rt.producer_give_back_pages(&request))
            .map_err(|e| runtime_error(py, e))?;
        Ok(match back {
            PagesBack::Now => "now",
            PagesBack::Before => "before",
            PagesBack::NotYet => "not_yet",
            PagesBack::Never => "never",
        })
    }

    /// Prefill side: stop; writes in flight still drain, then the consumer is
    /// told the request was aborted.
    fn producer_abort(&self, py: Python<'_>, request_id: &str, reason: &str) -> PyResult<()> {
        let rt = self.rt(py)?;
        let (request, reason) = (RequestId::new(request_id), reason.to_owned());
        py.detach(move || rt.producer_abort(&request, &reason))
            .map_err(|e| runtime_error(py, e))
    }

    /// Prefill side: give the request up if no consumer claimed it yet (no
    /// handshake came); a claimed one writes on. Its release is reported as
    /// usual (`producer_released`); counted in `producers_unclaimed_released`
    /// when it ends one.
    fn producer_release_unclaimed(&self, py: Python<'_>, request_id: &str, reason: &str) -> PyResult<()> {
        let rt = self.rt(py)?;
        let (request, reason) = (RequestId::new(request_id), reason.to_owned());
        py.detach(move || rt.producer_release_unclaimed(&request, &reason))
            .map_err(|e| runtime_error(py, e))
    }

    /// Prefill side: whether a decode claimed the request on this rank
    /// (every producer of it here took a handshake). `false` once it
    /// released, or when it is unknown.
    fn producer_claimed(&self, py: Python<'_>, request_id: &str) -> PyResult<bool> {
        let rt = self.rt(py)?;
        let request = RequestId::new(request_id);
        // Without the GIL: it takes each producer's lock, which a writer
        // lane may hold for a moment.
        Ok(py.detach(move || rt.producer_authorized(&request)))
    }

    /// Prefill side: the consumer gave the request up (no handshake will
    /// come, or it released an authorization); `cancel_json` is the wire
    /// message (`cancel_message`). An open producer is aborted; one not yet
    /// open is aborted as soon as it opens. Without the request's
    /// capability: `ForbiddenError`, and nothing changes. A cancel carrying
    /// a generation is a fence: returns what may still be written into it
    /// from this rank, `"fenced"`, `"notice_follows"` or `"held"`; else
    /// `None`.
    fn producer_cancel(&self, py: Python<'_>, cancel_json: &str) -> PyResult<Option<String>> {
        let rt = self.rt(py)?;
        let json = cancel_json.to_owned();
        // A fence waits for the producer's answer (up to 2 s).
        let answer = py
            .detach(move || rt.producer_cancel_json(&json))
            .map_err(|e| runtime_error(py, e))?;
        Ok(answer.map(|f| {
            serde_json::to_value(f)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default()
        }))
    }

    /// Prefill side: vLLM finished the request before it was ever scheduled
    /// here (aborted while queued). Its consumer is told `aborted` at once —
    /// for a handshake parked under `capability` or one arriving later — so
    /// decode frees its blocks now instead of at its deadline.
    fn producer_discard(
        &self,
        py: Python<'_>,
        request_id: &str,
        capability_hex: &str,
        reason: &str,
    ) -> PyResult<()> {
        let cap = capability(py, capability_hex)?;
        let rt = self.rt(py)?;
        let (request, reason) = (RequestId::new(request_id), reason.to_owned());
        py.detach(move || rt.producer_discard(&request, &cap, &reason))
            .map_err(|e| runtime_error(py, e))
    }

    /// Every event since the last call.
    fn poll_events(&self, py: Python<'_>) -> PyResult<Vec<PyRuntimeEvent>> {
        Ok(self.rt(py)?.poll_events().into_iter().map(Into::into).collect())
    }

    /// Waits up to `timeout_s` for the next event (GIL released).
    fn next_event(&self, py: Python<'_>, timeout_s: f64) -> PyResult<Option<PyRuntimeEvent>> {
        let rt = self.rt(py)?;
        let t = seconds(py, "timeout_s", timeout_s)?;
        Ok(py.detach(|| rt.next_event(t)).map(Into::into))
    }

    /// `(consumers, producers)` with a live request actor (leak checks).
    fn live_requests(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        let rt = self.rt(py)?;
        Ok(py.detach(move || rt.live_requests()))
    }

    /// For tests, in a development build only (feature `testing`, which
    /// `scripts/setup.sh` turns on for the editable install; the wheel has
    /// no such method): occupies the runtime's request directory (the actor
    /// every open, release, cancel and finish goes through) for `seconds`,
    /// from now, without waiting; calls made meanwhile wait for it, the GIL
    /// released.
    #[cfg(feature = "testing")]
    fn _stall_directory(&self, py: Python<'_>, for_s: f64) -> PyResult<()> {
        let d = seconds(py, "for_s", for_s)?;
        self.rt(py)?.stall_directory(d);
        Ok(())
    }

    /// Counts `requests` opened without a source staging because the
    /// staging region had no room for them (`source_staging_full`).
    fn note_source_staging_full(&self, py: Python<'_>, requests: u64) -> PyResult<()> {
        self.rt(py)?.note_source_staging_full(requests);
        Ok(())
    }

    /// Counts `layers` request-layers admitted at `wait_for_save` because
    /// vLLM skipped `save_kv_layer` for them (`layers_saved_at_wait`).
    fn note_layers_saved_at_wait(&self, py: Python<'_>, layers: u64) -> PyResult<()> {
        self.rt(py)?.note_layers_saved_at_wait(layers);
        Ok(())
    }

    /// Counts `requests` served plainly because their P/D parameters were
    /// refused (`params_refused`).
    fn note_params_refused(&self, py: Python<'_>, requests: u64) -> PyResult<()> {
        self.rt(py)?.note_params_refused(requests);
        Ok(())
    }

    /// The runtime's counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.rt(py)?.stats();
        let d = PyDict::new(py);
        let v = serde_json::to_value(&s).map_err(|e| invalid_argument(py, e.to_string()))?;
        if let Some(map) = v.as_object() {
            for (k, v) in map {
                d.set_item(k, v.as_u64().unwrap_or(0))?;
            }
        }
        Ok(d)
    }

    /// The durations of request phases kept since the last call, in
    /// seconds, by name (`TIMING_NAMES`): taken, so the connector's stats
    /// report is their one reader.
    fn take_timings<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let taken = self.rt(py)?.take_timings();
        let d = PyDict::new(py);
        for (what, micros) in taken {
            let secs: Vec<f64> = micros.iter().map(|&m| f64::from(m) / 1e6).collect();
            d.set_item(what.name(), secs)?;
        }
        Ok(d)
    }

    /// Stops the actors (writes in flight are abandoned). Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        let rt = self.inner.write().take();
        if let Some(rt) = rt {
            py.detach(move || drop(rt));
        }
    }
}
