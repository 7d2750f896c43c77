"""Connector statistics through vLLM's stats hooks (and so Prometheus)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from orbitkv._native import STATS_FIELDS, TIMING_NAMES

# Counters the runtime keeps (``Runtime.stats()``) that travel to the
# logger: every one, as Rust names them (the one list).
COUNTERS: tuple[str, ...] = tuple(STATS_FIELDS)

# Request phases the runtime times, one duration per request
# (``Runtime.take_timings()``, Rust's ``Timing``): they travel as lists of
# seconds under ``data["timings"]`` and become Prometheus histograms.
TIMINGS: tuple[str, ...] = tuple(TIMING_NAMES)

# Request phases the vLLM worker times itself (prefill), from its
# producer_finish call: vLLM telling the worker it ended the request (a
# step or more later under async scheduling), and the worker reporting it
# sent (finished_sending: vLLM frees its blocks when it takes that step's
# output). Under the same ``data["timings"]``.
PY_TIMINGS: tuple[str, ...] = ("ended_after_finish", "reported_after_finish")

# The histograms' buckets, seconds: from a step's worth to the consumer's
# default timeout.
TIMING_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                                     0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 120.0)


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass
class PdConnectorStats(KVConnectorStats):
    """Counter deltas since the last report, {name: int}, and the request
    phases timed since then, ``data["timings"]``: {name: [seconds, ...]}."""

    def __post_init__(self) -> None:
        for k in COUNTERS:
            self.data.setdefault(k, 0)
        self.data.setdefault("timings", {})

    def reset(self) -> None:
        self.data = {k: 0 for k in COUNTERS}
        self.data["timings"] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in COUNTERS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        mine, theirs = self.data.get("timings") or {}, other.data.get("timings") or {}
        # new lists: the dicts vLLM hands over may be shared with its other readers
        self.data["timings"] = {k: list(mine.get(k, [])) + list(theirs.get(k, []))
                                for k in set(mine) | set(theirs)}
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in COUNTERS}
        done = self.data.get("consumers_completed", 0)
        out["avg_transfer_ms"] = (self.data.get("transfer_micros", 0) / done / 1000.0) if done else 0.0
        for name, values in sorted((self.data.get("timings") or {}).items()):
            if values:
                out[f"{name}_n"] = len(values)
                out[f"{name}_p50_ms"] = round(1e3 * _quantile(values, 0.5), 2)
                out[f"{name}_p90_ms"] = round(1e3 * _quantile(values, 0.9), 2)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in COUNTERS) and not any(
            (self.data.get("timings") or {}).values())


_PROM = {
    "bytes_written": ("vllm:orbitkv_bytes_written", "KV bytes written to decode instances by OrbitKV."),
    "layers_written": (
        "vllm:orbitkv_layer_writes",
        "Layer writes (one layer of one request to one decode rank) OrbitKV completed.",
    ),
    "writes_failed": ("vllm:orbitkv_write_failures", "Layer write batches that failed."),
    "notices_sent": ("vllm:orbitkv_notices_sent", "Completion notices sent to decode instances."),
    "notices_failed": ("vllm:orbitkv_notice_failures", "Completion notices that could not be sent."),
    "notices_routed": (
        "vllm:orbitkv_notices_routed",
        "Notices routed to the decode request they belong to.",
    ),
    "notices_malformed": (
        "vllm:orbitkv_notices_malformed",
        "Notices dropped because they could not be parsed.",
    ),
    "events_dropped": (
        "vllm:orbitkv_events_dropped",
        "Request events the state machines ignored (stale, duplicate or after the end; see the trace).",
    ),
    "notices_unknown_request": (
        "vllm:orbitkv_notices_unknown_request",
        "Notices dropped because no request of that ID was waiting.",
    ),
    "notices_stale_generation": (
        "vllm:orbitkv_notices_stale_generation",
        "Notices dropped because they carried a stale generation.",
    ),
    "notices_unauthenticated": (
        "vllm:orbitkv_notices_unauthenticated",
        "Notices dropped because they lacked the tag of their request's capability (forged, or a stranger's).",
    ),
    "consumers_completed": ("vllm:orbitkv_transfers_completed", "P/D requests whose KV arrived complete."),
    "consumers_failed": ("vllm:orbitkv_transfers_failed", "P/D requests whose KV did not arrive complete."),
    "producers_released": ("vllm:orbitkv_producers_released", "Prefill requests whose source blocks were released."),
    "side_channel_forbidden": (
        "vllm:orbitkv_side_channel_forbidden",
        "Handshakes and cancels refused because they lacked the request's capability.",
    ),
    "side_channel_overloaded": (
        "vllm:orbitkv_side_channel_overloaded",
        "Handshakes and cancels refused because the parking budget was full.",
    ),
    "parked_expired": (
        "vllm:orbitkv_parked_expired",
        "Handshakes and cancels that waited for their request past the handshake deadline.",
    ),
    "ready_items": (
        "vllm:orbitkv_ready_layers",
        "GPU prefill steps' layers admitted for sending once their kernels ran (0 on CPU).",
    ),
    "write_batches": ("vllm:orbitkv_write_batches", "Write batches submitted to Mooncake."),
    "write_ranges": ("vllm:orbitkv_write_ranges", "Ranges (Mooncake transfer requests) in the write batches."),
    "writes_grouped": (
        "vllm:orbitkv_writes_grouped",
        "Layer writes sent in a batch begun by an earlier write to the same peer (group commit).",
    ),
    "group_stops_budget": (
        "vllm:orbitkv_group_stops_budget",
        "Group commits ended at a queued layer write that did not fit the writer lane's range or byte budget.",
    ),
    "group_stops_gpu": (
        "vllm:orbitkv_group_stops_gpu",
        "Group commits that passed over a queued layer write whose layer the GPU had not written yet.",
    ),
    "writes_ahead_of_gpu": (
        "vllm:orbitkv_writes_ahead_of_gpu",
        "Layer writes sent before an earlier write in the same writer lane whose layer the GPU had not written yet.",
    ),
    "writes_late": (
        "vllm:orbitkv_writes_late",
        "Write batches still in Mooncake at the write timeout (held on: their bytes may still move).",
    ),
    "writes_abandoned": (
        "vllm:orbitkv_writes_abandoned",
        "Write batches given up at write timeout + quarantine while Mooncake had not ended them.",
    ),
    "consumers_quarantine_expired": (
        "vllm:orbitkv_consumers_quarantine_expired",
        "Decode requests whose blocks the quarantine freed while a producer had never ended.",
    ),
    "producers_unclaimed_released": (
        "vllm:orbitkv_producers_unclaimed_released",
        "Prefill requests given up because no decode claimed them (no handshake) by the claim deadline or "
        "within the unclaimed cap (orbitkv.pd.claim_timeout_s, unclaimed_kv_share, unclaimed_max_requests).",
    ),
    "params_refused": (
        "vllm:orbitkv_params_refused",
        "Requests served plainly (no transfer) because their kv_transfer_params were refused: malformed, "
        "undeclared prefill, unsigned, or a P/D dialect OrbitKV does not serve (the log says which).",
    ),
    "ranks_fenced": (
        "vllm:orbitkv_ranks_fenced",
        "Producer ranks a cancel's fence ended: released decode requests whose blocks went back at once.",
    ),
    "fences_sent": (
        "vllm:orbitkv_fences_sent",
        "Cancels sent as fences (vLLM released a decode request before its producers ended), one per rank.",
    ),
    "layers_saved_at_wait": (
        "vllm:orbitkv_layers_saved_at_wait",
        "Layers sent at the end of a step because vLLM skipped the per-layer save hook for them (not overlapped).",
    ),
    "staging_granted": ("vllm:orbitkv_staging_granted", "Decode requests given a staging grant."),
    "staging_exhausted": (
        "vllm:orbitkv_staging_exhausted",
        "Decode requests that found the staging region full and were written into their pages directly.",
    ),
    "layers_staged": (
        "vllm:orbitkv_layers_staged",
        "Layer writes that went from source staging (into a consumer's staging grant, or straight into its pages).",
    ),
    "layers_staged_to_pages": (
        "vllm:orbitkv_layers_staged_to_pages",
        "Of the staged layer writes, those written straight into the consumer's pages (no grant, no scatter).",
    ),
    "chunks_reordered": (
        "vllm:orbitkv_chunks_reordered",
        "Staged chunks prefill gathered in decode's block order (written into decode's pages as one range per run "
        "of decode's IDs).",
    ),
    "source_staging_full": (
        "vllm:orbitkv_source_staging_full",
        "Prefill layers of a chunk given no layer piece (the default), or requests opened without a whole source "
        "staging (a size set by hand), because the source region had no room (written page to page).",
    ),
    "producer_pages_given_back": (
        "vllm:orbitkv_producer_pages_given_back",
        "Prefill requests whose KV pages went back to vLLM before their writes ended: every layer of every chunk "
        "was in a layer piece of the source staging (the default) or already at decode; the remaining writes "
        "then read the pieces.",
    ),
    "source_pieces_given_up": (
        "vllm:orbitkv_source_pieces_given_up",
        "Prefill layer pieces a request gave back before any write read them, because a later layer of it found no "
        "room (orbitkv.pd.staging_pieces 'request': the room goes to requests the region can stage whole).",
    ),
    "writes_gathered": (
        "vllm:orbitkv_writes_gathered",
        "Prefill layer writes a writer lane gathered into one piece of the source staging once the layer was "
        "computed, and wrote from there (orbitkv.pd.staging_pieces 'write').",
    ),
    "gather_ranges_saved": (
        "vllm:orbitkv_gather_ranges_saved",
        "Mooncake ranges those gathered writes saved (their direct ranges less the piece's).",
    ),
    "gather_no_room": (
        "vllm:orbitkv_gather_no_room",
        "Layer writes that would have paid to gather but found no room in the source staging (written from the "
        "pages instead; a rising count says the region is small).",
    ),
    "gather_failed": (
        "vllm:orbitkv_gather_failures",
        "Writer gathers whose copy failed (the write went from the pages).",
    ),
    "gather_pieces_leaked": (
        "vllm:orbitkv_gather_pieces_leaked",
        "Gathered pieces kept out of the source staging for good because a batch reading one was given up while "
        "Mooncake still held it.",
    ),
    "layers_ready_inline": (
        "vllm:orbitkv_layers_ready_inline",
        "Prefill layers handed to their producer on the worker's own thread (no message to the runtime's thread).",
    ),
    "writes_inline": (
        "vllm:orbitkv_writes_inline",
        "Prefill layer writes submitted to Mooncake on the worker's own thread (their writer lane was idle).",
    ),
    "writes_reported_inline": (
        "vllm:orbitkv_writes_reported_inline",
        "Prefill layer writes whose end the writer lane that saw it fed to its producer on the lane's own thread "
        "(the producer was idle; no message to the runtime's thread).",
    ),
    "peers_reclaimed": (
        "vllm:orbitkv_peers_reclaimed",
        "Decode endpoints whose writer lanes (threads) and Mooncake segment the prefill reclaimed after they sat idle.",
    ),
    "timings_dropped": (
        "vllm:orbitkv_timings_dropped",
        "Request phase durations left out of the vllm:orbitkv_*_after_finish / complete_to_taken histograms because "
        "4096 of their kind waited for vLLM's stats report (never expected: the report takes them every step).",
    ),
}

# Time sums the runtime keeps in microseconds, exported as seconds counters.
_SECONDS = {
    "transfer_micros": (
        "vllm:orbitkv_transfer_seconds",
        "Sum over completed P/D requests of authorization-to-complete time.",
    ),
    "ready_lag_micros": (
        "vllm:orbitkv_ready_lag_seconds",
        "Sum over admitted layers of launched-to-admitted time (GPU lag and queueing).",
    ),
    "write_submit_micros": (
        "vllm:orbitkv_write_submit_seconds",
        "Time spent inside Mooncake's submit call.",
    ),
    "write_batch_micros": (
        "vllm:orbitkv_write_batch_seconds",
        "Sum over write batches of submitted-to-ended time.",
    ),
    "layer_write_micros": (
        "vllm:orbitkv_layer_write_seconds",
        "Sum over layer writes of admitted-to-written time (per-peer budget waits included).",
    ),
    "write_queue_micros": (
        "vllm:orbitkv_write_queue_seconds",
        "Sum over layer writes of admitted-to-first-batch-submitted time (the queued part of layer_write_seconds).",
    ),
    "gather_micros": (
        "vllm:orbitkv_gather_seconds",
        "Time writer lanes spent copying layer writes into pieces of the source staging (waited for).",
    ),
    "write_gpu_wait_micros": (
        "vllm:orbitkv_write_gpu_wait_seconds",
        "Time writer lanes were parked waiting for the GPU to write the layer at the front of their queue, with "
        "nothing else ready to send (a parked lane still sends writes that come ready meanwhile).",
    ),
}


# Histograms of the request phases (``TIMINGS``), in seconds.
_HISTOGRAMS = {
    "written_after_finish": (
        "vllm:orbitkv_written_after_finish_seconds",
        "Prefill: from vLLM finishing a request (its prefill answered) to its last layer write ended and its done "
        "notice went to decode: the transfer's tail after the prefill's answer.",
    ),
    "pages_held_after_finish": (
        "vllm:orbitkv_pages_held_after_finish_seconds",
        "Prefill: from vLLM finishing a request to its KV pages going back to vLLM (given back early, or the "
        "request released): how long finished requests hold prefill KV.",
    ),
    "complete_to_taken": (
        "vllm:orbitkv_complete_to_taken_seconds",
        "Decode: from a request's KV complete (every producer done) to the vLLM worker taking the completion.",
    ),
    "handshake_after_finish": (
        "vllm:orbitkv_handshake_after_finish_seconds",
        "Prefill, per request written in full: from vLLM finishing it to decode's handshake (authorization) reaching "
        "the producer; 0 when it came before the finish (the streaming flow's usual order).",
    ),
    "computed_after_finish": (
        "vllm:orbitkv_computed_after_finish_seconds",
        "Prefill, per request written in full: from vLLM finishing it to the writer lane of its last-computed layer "
        "seeing the GPU had computed that layer (or the write reaching the lane, if later); 0 when before the finish. "
        "Under async scheduling the finish comes when the last step was launched: this is the GPU's lag.",
    ),
    "ended_after_finish": (
        "vllm:orbitkv_ended_after_finish_seconds",
        "Prefill, per request finished: from the worker handing vLLM's finish to the runtime (at the forward's launch) "
        "to vLLM's scheduler telling the worker it ended the request (its blocks then wait only for OrbitKV's word).",
    ),
    "reported_after_finish": (
        "vllm:orbitkv_reported_after_finish_seconds",
        "Prefill, per request finished: from the worker handing vLLM's finish to the runtime to the worker reporting "
        "it sent (finished_sending; vLLM frees its blocks with that step's output). Never before ended_after_finish: "
        "the difference is what OrbitKV's writes added to vLLM's own hold.",
    ),
    "sent_after_finish": (
        "vllm:orbitkv_sent_after_finish_seconds",
        "Prefill, per request written in full: from vLLM finishing it to its last layer write's first batch going to "
        "Mooncake (the GPU had run that layer); 0 when every write went before the finish. "
        "written_after_finish less this is the last batch's flight.",
    ),
}


class PdPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters named ``vllm:orbitkv_*`` (and the transfer time)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in _PROM.items():
            c = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[key] = create_metric_per_engine(c, per_engine_labelvalues)
        self._seconds: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in _SECONDS.items():
            c = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._seconds[key] = create_metric_per_engine(c, per_engine_labelvalues)
        self._histograms: dict[str, dict[int, Any]] = {}
        histogram: Any = self._histogram_cls  # vLLM types it as any of its three metric classes
        for key, (name, doc) in _HISTOGRAMS.items():
            h = histogram(name=name, documentation=doc, labelnames=labelnames, buckets=list(TIMING_BUCKETS))
            self._histograms[key] = create_metric_per_engine(h, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            v = transfer_stats_data.get(key, 0)
            if v:
                per_engine[engine_idx].inc(v)
        for key, per_engine in self._seconds.items():
            micros = transfer_stats_data.get(key, 0)
            if micros:
                per_engine[engine_idx].inc(micros / 1e6)
        timings = transfer_stats_data.get("timings") or {}
        for key, per_engine in self._histograms.items():
            for seconds in timings.get(key, ()):
                per_engine[engine_idx].observe(seconds)
