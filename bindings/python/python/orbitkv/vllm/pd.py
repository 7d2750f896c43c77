"""``PdConnector``: OrbitKV's layer-wise P/D connector for vLLM (0.26).

Use it on a prefill and a decode instance with::

    --kv-transfer-config '{"kv_connector": "PdConnector",
                           "kv_connector_module_path": "orbitkv.vllm.pd",
                           "kv_role": "kv_both", "engine_id": "p0",
                           "kv_connector_extra_config": {
                               "orbitkv.pd.mooncake.bind_host": "10.0.0.2"}}'

and ``python -m orbitkv.proxy`` in front. Each request carries its P/D role
in ``kv_transfer_params`` (see :mod:`orbitkv.vllm.params`); the facade
builds the scheduler-side or the worker-side object by role, as vLLM's own
connectors do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

try:  # vLLM's worker -> scheduler channel (0.26 has it)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - a vLLM without it: the scheduler never hears
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]

from orbitkv.vllm import compat
from orbitkv.vllm.config import PdConfig
from orbitkv.vllm.groups import FAILED_RECVING, TRANSFER_RESULTS, kv_groups_of
from orbitkv.vllm.metadata import PdConnectorMetadata
from orbitkv.vllm.scheduler import PdScheduler
from orbitkv.vllm.stats import PdConnectorStats, PdPromMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["OrbitKVConnector", "PdConnector", "PdConnectorMetadata", "PdWorkerMeta"]


class PdWorkerMeta(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler each step: ``draining``, the
    prefill requests reported sent early (their pages went back to vLLM)
    whose writes still go out of their layer pieces, summed over the ranks;
    ``claimed``, vLLM request id -> how many ranks newly saw its decode's
    handshake (the scheduler's unclaimed caps leave a request out once
    every rank did)."""

    def __init__(self, draining: int = 0, claimed: Iterable[str] = ()) -> None:
        self.draining = draining
        self.claimed: dict[str, int] = dict.fromkeys(claimed, 1)

    def aggregate(self, other: Any) -> PdWorkerMeta:
        self.draining += int(getattr(other, "draining", 0))
        for rid, n in (getattr(other, "claimed", None) or {}).items():
            self.claimed[rid] = self.claimed.get(rid, 0) + int(n)
        return self

    def __repr__(self) -> str:
        return f"PdWorkerMeta(draining={self.draining}, claimed={len(self.claimed)})"

logger = logging.getLogger("orbitkv.vllm.pd")


def _log_through_vllm() -> None:
    """Sends the ``orbitkv.*`` loggers' records through vLLM's handler (its
    format, level and per-process prefix). Without it they reach no handler
    in vLLM's engine and worker processes and the connector's warnings are
    lost."""
    ours = logging.getLogger("orbitkv")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.level)
    ours.propagate = False


class PdConnector(KVConnectorBase_V1):
    """Serves vLLM's hybrid KV cache manager (``SupportsHMA``, vLLM >= 0.32):
    a model of several KV cache groups (sliding-window and full attention)
    keeps it on, each layer written from and into its own group's blocks
    (groups.py)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        # vLLM's own connectors take the KV cache config as optional too
        # (older releases construct connectors without it).
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        _log_through_vllm()
        # Refuses a vLLM outside the supported range before anything starts.
        untested = compat.check_vllm_version(compat.installed_vllm_version())
        if untested:
            logger.warning("%s", untested)
        compat.check_no_sleep_mode(vllm_config)
        self.config = PdConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        # The model's KV cache groups; refuses ones OrbitKV cannot serve
        # (recurrent state, mixed block sizes) before anything starts.
        groups = kv_groups_of(kv_cache_config, vllm_config.cache_config.block_size)
        if groups.count > 1:
            logger.info("OrbitKV: %d KV cache groups (hybrid KV cache manager), block size %d, %d of recurrent state",
                        groups.count, groups.block_size, len(groups.state_groups))
        self.scheduler: PdScheduler | None = None
        self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = PdScheduler(vllm_config, self.config, groups)
        else:
            from orbitkv.vllm.worker import PdWorker

            self.worker = PdWorker(vllm_config, self.config, groups)

    # ---- scheduler side ----------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """What vLLM calls in place of ``request_finished`` for a connector
        with ``SupportsHMA`` (every model, one group or several)."""
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM's block pool, once, before any request: with
        ``orbitkv.pd.staging_memory`` ``kv_cache`` the source staging is
        taken out of it (kv_staging.py)."""
        if self.scheduler is not None:
            role = getattr(self._kv_transfer_config, "kv_role", None) or "kv_both"
            self.scheduler.bind_block_pool(gpu_block_pool, self._kv_cache_config, str(role))

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdConnectorStats:
        return PdConnectorStats(data=dict(data)) if data is not None else PdConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PdPromMetrics:
        return PdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 asks before it starts an engine with sleep mode: no
        (:func:`orbitkv.vllm.compat.check_no_sleep_mode` says why; it also
        refuses on releases that do not ask)."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The KV cache layout this connector asks vLLM for, as NixlConnector
        does: ``"HND"`` (heads outermost in each block), so that each KV head
        is one contiguous slice of a block and a prefill and a decode of
        different TP sizes can exchange head slices; ``None`` (vLLM's default,
        NHD on GPU) for MLA models, whose one latent KV head is the same in
        every layout, and when the config has no model.

        vLLM applies it when no attention backend requires a layout (FlashInfer
        on Blackwell and the CPU backend require HND) and
        ``VLLM_KV_CACHE_LAYOUT`` is unset. Any layout with dense blocks works
        for equal TP sizes (see :mod:`orbitkv.vllm.layout`).
        """
        mc = vllm_config.model_config
        if mc is None or mc.use_mla:
            return None
        return "HND"

    # ---- worker side -------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, PdConnectorMetadata):
            # The step's connector work (consumers to open, producer chunks,
            # ends) runs here, before the forward, in every vLLM: 0.26 calls
            # start_load_kv before the forward, but 0.32 calls it after the
            # forward unless a load is synchronous (ours never are), and the
            # forward's save_kv_layer calls must already know the step's
            # producer chunks. vLLM binds the metadata before the forward in
            # both.
            self.worker.start_load_kv(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Done when the metadata was bound (bind_connector_metadata).
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Decode starts only after every producer reported (get_finished);
        # there is nothing to wait for per layer.
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        assert self.worker is not None
        self.worker.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        # Never blocks prefill on a transfer: writes drain in the background.
        assert self.worker is not None
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return self.worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.get_block_ids_with_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM >= 0.32: :meth:`get_finished`, and for a model of several KV
        cache groups the requests whose load failed (``failed_recving``:
        vLLM recomputes or fails them; they are in ``finished_recving`` too)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self.worker.take_failed_loads() if self.worker is not None else set()
        return TRANSFER_RESULTS(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )

    def get_kv_connector_stats(self) -> PdConnectorStats | None:
        return self.worker.get_kv_connector_stats() if self.worker is not None else None

    def build_connector_worker_meta(self) -> PdWorkerMeta | None:
        """Each step: on a rank that stages by layer, how many requests it
        reported sent early still drain; the finished requests a decode
        newly claimed here (:class:`PdWorkerMeta`)."""
        if self.worker is None:
            return None
        n = self.worker.draining()
        claimed = self.worker.claimed()
        return None if n is None and not claimed else PdWorkerMeta(n or 0, claimed)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


# vLLM's hybrid KV cache manager is served where vLLM can take a failed load
# of a request of several groups (groups.py: vLLM >= 0.32); on older releases
# vLLM turns the manager off for this connector. SupportsHMA is an ABC: the
# registration is what vLLM's issubclass check sees.
if FAILED_RECVING:
    SupportsHMA.register(PdConnector)


class OrbitKVConnector(PdConnector):
    """The same connector under a name no other project uses: select it with
    ``"kv_connector": "OrbitKVConnector", "kv_connector_module_path":
    "orbitkv.vllm.pd"``. NVIDIA Dynamo treats a connector named
    ``PdConnector`` as its own KVBM wrapper (docs/routers.md); everything
    else accepts either name."""
