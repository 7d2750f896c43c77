"""The PdConnector's worker side: owns the rank's Mooncake engine, the
request runtime and the side channel, and turns vLLM's per-layer hooks into
runtime calls. Nothing here waits on a transfer: ``save_kv_layer`` only
enqueues, ``get_finished`` only drains events.

No ``torch.cuda``/``torch.accelerator`` call runs on a CPU machine: the
device is taken from vLLM's platform and from the KV tensors themselves.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from orbitkv import (
    MooncakeTransferEngine,
    OrbitKVError,
    Runtime,
    SideChannel,
    StagingArena,
    UnknownRequestError,
    install_trace,
    producer_ranks,
)
from orbitkv.staging import BlockIndex, StagingCopier
from orbitkv.vllm.config import PdConfig, staging_parts
from orbitkv.vllm.faults import faults_from_env
from orbitkv.vllm.groups import KvGroups, blocks_of
from orbitkv.vllm.kv_staging import segments as kv_segments
from orbitkv.vllm.layout import cpu_kernel_parts, kv_layout_of
from orbitkv.vllm.ledger import Ledger
from orbitkv.vllm.metadata import PdConnectorMetadata, ProducerChunk
from orbitkv.vllm.params import MOONCAKE
from orbitkv.vllm.stats import COUNTERS, PY_TIMINGS, PdConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("orbitkv.vllm.worker")



@contextlib.contextmanager
def _any_core(enabled: bool) -> Iterator[None]:
    """Lets the calling thread (and so every thread it starts meanwhile) run
    on any CPU of this machine, then restores its affinity."""
    if not enabled or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:  # a cpuset that forbids it: keep what we have
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _current_stream_fn() -> Any:
    """vLLM's cheap ``current_stream()`` (torch's builds a new object per
    call), or torch's on another vLLM layout. Resolved once, not per layer."""
    try:
        from vllm.utils.torch_utils import current_stream
    except ImportError:
        return torch.cuda.current_stream
    return current_stream


_current_stream: Any = None


def _stream_handle() -> int:
    """The current CUDA stream of this thread, as a ``cudaStream_t`` int
    (vLLM runs its forward on a stream of its own)."""
    global _current_stream
    if _current_stream is None:
        _current_stream = _current_stream_fn()
    return int(_current_stream().cuda_stream)


class PdWorker:
    def __init__(self, vllm_config: VllmConfig, config: PdConfig, groups: KvGroups | None = None):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.platforms import current_platform

        self.vllm_config = vllm_config
        self.config = config
        # The model's KV cache groups (groups.py); None: one group, of
        # vLLM's block size (a dense model).
        self._groups = groups
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        # vLLM's policy for a failed KV load: "recompute" (its default) runs
        # the request on, recomputing into the same blocks; "fail" ends it.
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        self.recompute_failed_loads = getattr(ktc, "kv_load_failure_policy", "recompute") != "fail"
        self.tp_rank = get_tensor_model_parallel_rank() if self.tp_size > 1 else 0
        self.is_cuda = bool(current_platform.is_cuda_alike())
        self.engine: MooncakeTransferEngine | None = None
        self.runtime: Runtime | None = None
        self.side_channel: SideChannel | None = None
        self._layer_index: dict[str, int] = {}
        self._layer_names: list[str] = []
        # Test-only fault hooks (faults.py; _testing.py is imported only when
        # their environment variables are set).
        self._faults = faults_from_env()
        # One layer dispatch per platform (_save_layer): on GPU the runtime's
        # layer gate (a CUDA event waited for in Rust, no GIL); on CPU one
        # call for the step's requests. A GPU whose CUDA driver cannot be
        # used from Rust waits for each layer's kernels here instead, then
        # goes the CPU way (_gate_failed).
        self._rust_gate = self.is_cuda
        self._gate_used = False
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._num_blocks = 0
        self._step_chunks: list[ProducerChunk] = []
        # Layers vLLM called save_kv_layer for in this step (the others are
        # sent at wait_for_save).
        self._step_layers: set[int] = set()
        self._warned_saved_at_wait = False
        # One record per request and side (ledger.py).
        self.ledger = Ledger()
        self._load_errors: set[int] = set()
        # vLLM request ids whose load failed, for a model of several KV
        # cache groups (reported as failed_recving, not as block ids).
        self._failed_loads: set[str] = set()
        # vLLM request ids of consumers whose authorization the runtime
        # refused: reported once, their blocks as load errors (vLLM
        # recomputes them).
        self._refused_consumers: set[str] = set()
        self._last_stats = {k: 0 for k in COUNTERS}
        # The phases this worker times itself (stats.PY_TIMINGS), seconds,
        # until the next get_kv_connector_stats takes them.
        self._py_timings: dict[str, list[float]] = {k: [] for k in PY_TIMINGS}
        # Staging (orbitkv.pd.staging_mb): the memory, the copies, and the
        # allocator of this rank's source staging.
        self._staging_tensors: list[torch.Tensor] = []
        self._copier: StagingCopier | None = None
        self._source_arena: StagingArena | None = None
        # Staged by layer (staging_mb "auto"): the runtime gives the pieces.
        self._by_layer = False
        # orbitkv.pd.staging_memory "kv_cache": the runtime takes its source
        # staging later, from the blocks the scheduler took out of vLLM's KV
        # cache (kv_staging.py); until then every layer goes from the pages.
        self._staging_later = False
        self._layout: dict[str, Any] = {}  # the OrbitKV layout of this rank's KV cache
        self._kv_storages: dict[int, int] = {}  # its distinct storages: address -> bytes
        # This step's block indices of staging chunks, by P/D id.
        self._step_index: dict[str, BlockIndex] = {}
        self._heads: tuple[bool, int] = (False, 0)

    @property
    def groups(self) -> KvGroups:
        if self._groups is None:
            self._groups = KvGroups(1, self.vllm_config.cache_config.block_size)
        return self._groups

    @property
    def _hybrid(self) -> bool:
        """Several KV cache groups (vLLM's hybrid KV cache manager)."""
        return self._groups is not None and self._groups.count > 1

    # ---- registration ----------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        mc = self.vllm_config.model_config
        pc = self.vllm_config.parallel_config
        first = next(iter(kv_caches.values()))
        num_blocks = first.shape[1] if first.shape[0] == 2 else first.shape[0]
        # The CPU kernels keep a block's tokens in their own order, checked
        # once here (what serves a prefill or decode of another block size).
        cpu_parts = (
            None if self.is_cuda else cpu_kernel_parts(first.dtype, self.groups.block_size, mc.get_head_size())
        )
        layout, names = kv_layout_of(
            kv_caches,
            num_blocks=num_blocks,
            local_heads=mc.get_num_kv_heads(pc),
            total_heads=mc.get_total_num_kv_heads(),
            block_size=self.groups.block_size,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            layer_group=self.groups.layer_group,
            cpu=not self.is_cuda,
            cpu_parts=cpu_parts,
            state_layers=self.groups.state_layers,
        )
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._layer_names = list(names)
        self._kv_caches = dict(kv_caches)
        self._num_blocks = num_blocks
        # Every thread started from here on (Mooncake's, the runtime's, the
        # side channel's) inherits this thread's CPU affinity. On the CPU
        # backend vLLM pins it to its rank's one OMP core, where vLLM's
        # threads spin while a TP step waits on the other ranks: ours then
        # got no CPU for tens of seconds (a handshake unanswered past its
        # deadline). Start them free to run on any core.
        with _any_core(not self.is_cuda):
            self._start_transport(kv_caches, layout)
        logger.info(
            "OrbitKV rank %d/%d: mooncake %s, side channel %s, %d layers, %d blocks of %d tokens, head_major=%s, "
            "token order %s",
            self.tp_rank,
            self.tp_size,
            self.engine.endpoint if self.engine else "?",
            self.side_channel.address if self.side_channel else "?",
            len(names),
            num_blocks,
            self.groups.block_size,
            layout["head_major"],
            layout.get("token_order", "unknown (a prefill or decode of another block size is refused)"),
        )

    def _start_transport(self, kv_caches: dict[str, torch.Tensor], layout: dict[str, Any]) -> None:
        if self.config.trace and not os.environ.get("ORBITKV_TRACE"):
            # orbitkv.pd.trace: a Chrome trace of this worker's actors, one
            # file per worker process (the process's ORBITKV_TRACE, which the
            # runtime reads when it starts, takes precedence).
            install_trace(f"{self.config.trace}.worker.{os.getpid()}.json")
        self.engine = MooncakeTransferEngine(
            bind_host=self.config.bind_host,
            nics=self.config.nics_for(self.tp_rank) or None,
            library=self.config.library,
        )
        if self.is_cuda and self.config.mooncake_submit_wait == "layer":
            # Mooncake's NVLink transport waits, before each batch, for an
            # event on the writer's cudaStreamPerThread, i.e. for everything
            # on the legacy default stream and the forward ahead of it. A layer
            # is admitted only after its own event completed, so that wait is
            # redundant here (docs/configuration.md, mooncake_submit_wait).
            n = self.engine.redirect_submit_wait()
            logger.info("OrbitKV rank %d: Mooncake's submit-time stream wait redirected (%d import slots)",
                        self.tp_rank, n)
        # Register each distinct storage once (layers may share one).
        self._kv_storages = {}
        for t in kv_caches.values():
            st = t.untyped_storage()
            if st.data_ptr() in self._kv_storages:
                continue
            self._kv_storages[st.data_ptr()] = st.nbytes()
            loc = f"cuda:{t.device.index}" if t.device.type == "cuda" else "cpu:0"
            self.engine.register_memory(st.data_ptr(), st.nbytes(), location=loc)
        grants, sources = self._make_staging(kv_caches)
        self.runtime = Runtime(
            self.engine,
            json.dumps(layout),
            **self.config.runtime_settings(),
            staging_region=grants,
            source_staging_region=sources,
            source_staging_later=self._staging_later,
        )
        self._layout = layout
        logger.info("OrbitKV rank %d: Mooncake transport %s, %d ranges in flight per peer%s", self.tp_rank,
                    self.runtime.transport, self.runtime.max_ranges_in_flight_per_peer,
                    "" if self.config.max_inflight_ranges else " (the transport's default)")
        # Heads per decode rank of each TP size staged chunks can go into
        # pages for (a source group that is a decode rank's whole block).
        self._heads = (bool(layout["head_major"]), int(layout["total_kv_heads"]))
        if grants or sources or self._staging_later:
            units = self.runtime.staged_layout(1)["units"]
            self._copier = StagingCopier(layout, units, [*kv_caches.values(), *self._staging_tensors])
            if sources and self.config.staging_mb != "auto":
                # A size set by hand: a staging of the whole request each
                # (what decode's grants need). By default the runtime gives
                # pieces per layer and chunk from the region itself.
                self._source_arena = StagingArena(*sources)
            self._by_layer = bool(sources) and self.config.staging_mb == "auto"
            if self._by_layer:
                self._start_writer_gather()
            if self._staging_later:
                logger.info("OrbitKV rank %d: source staging in KV blocks the scheduler takes out of vLLM's cache "
                            "(orbitkv.pd.staging_memory kv_cache), from the first step on", self.tp_rank)
            else:
                logger.info("OrbitKV rank %d: staging %d MiB for grants, %d MiB for sources",
                            self.tp_rank, (grants or (0, 0))[1] >> 20, (sources or (0, 0))[1] >> 20)
        # The side channel (Rust, actix-web) serves this rank's producer side
        # on its own threads: handshakes never take the GIL.
        port = self.config.side_channel_port_for(self.tp_rank)
        self.side_channel = SideChannel(
            self.runtime,
            self.config.side_channel_host,
            port,
            key=self.config.side_channel_key,
            mooncake_bootstrap=self._mooncake_bootstrap(),
        )
        # The worker's own calls (a test hook may put a slow link in front).
        self.runtime = self._faults.wrap_runtime(self.runtime)

    def _mooncake_bootstrap(self) -> tuple[str, list[str]] | None:
        """With the ``mooncake`` dialect on, rank 0's side channel also
        answers ``GET /query`` as vLLM's Mooncake bootstrap server would: this
        instance's engine ID and every rank's side channel, so a router in
        its mooncake mode, pointed at the side channel port as the prefill's
        bootstrap port, learns the engine ID it sends decode."""
        if MOONCAKE not in self.config.dialects or self.tp_rank != 0:
            return None
        ktc = getattr(self.vllm_config, "kv_transfer_config", None)
        engine_id = str(getattr(ktc, "engine_id", None) or "orbitkv")
        return engine_id, [self.config.advertised_side_channel(r) for r in range(self.tp_size)]

    def _make_staging(self, kv_caches: dict[str, torch.Tensor]) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """Staging memory (orbitkv.pd.staging_mb) on the KV device, registered:
        the grants decode gives producers, the sources prefill gathers into
        (half each for kv_both; ``auto``, the default: sources only, on a
        rank that may prefill, ``config.staging_parts``); under ``auto``
        memory the device does not have means no staging, not a failed
        start. Returns the two regions (None: none)."""
        mb = self.config.staging_mb
        role = getattr(getattr(self.vllm_config, "kv_transfer_config", None), "kv_role", "kv_both")
        auto = mb == "auto"
        parts = staging_parts(mb, role, sum(self._kv_storages.values()), self.config.staging_kv_share)
        if max(parts) <= 0:
            return None, None
        if self._hybrid:
            # Staged orders follow one block table: a model of several KV
            # cache groups is written straight into its pages.
            logger.info("OrbitKV: no staging for a model of %d KV cache groups", self.groups.count)
            return None, None
        if self.config.staging_memory == "kv_cache":
            # The source staging comes out of vLLM's KV cache: blocks the
            # scheduler names in its metadata (_take_kv_staging), no memory
            # of its own. Grants (a size set by hand) are refused with it.
            self._staging_later = parts[1] > 0
            return None, None
        dev = next(iter(kv_caches.values())).device
        regions: list[tuple[int, int] | None] = []
        for part in parts:
            if part <= 0:
                regions.append(None)
                continue
            try:
                t = torch.empty(part << 20, dtype=torch.uint8, device=dev)
            except (torch.OutOfMemoryError, RuntimeError) as e:
                if not auto:
                    raise
                logger.warning("OrbitKV rank %d: no %d MiB for staging (%s): every layer is written from "
                               "the pages", self.tp_rank, part, e)
                regions.append(None)
                continue
            assert self.engine is not None
            loc = f"cuda:{dev.index}" if dev.type == "cuda" else "cpu:0"
            self.engine.register_memory(t.data_ptr(), t.numel(), location=loc)
            self._staging_tensors.append(t)
            regions.append((t.data_ptr(), t.numel()))
        return regions[0], regions[1]

    # ---- per step ----------------------------------------------------------

    def _take_kv_staging(self, block_runs: list[tuple[int, int]]) -> None:
        """Hands the runtime the bytes of the KV blocks the scheduler took
        for the source staging (``staging_memory`` ``kv_cache``), once; from
        then on requests are staged by layer there. A failure leaves this
        rank writing every layer from the pages (logged, never retried)."""
        self._staging_later = False
        assert self.runtime is not None
        try:
            # vLLM's pool hands out its lowest IDs first: before any request
            # that is one run from block 1 (0 is its null block), and the
            # copier's KV views then start past it (StagingCopier.keep_out).
            assert self._copier is not None  # made at registration for a later staging
            if len(block_runs) != 1 or block_runs[0][0] != 1:
                raise ValueError(f"blocks {block_runs} are not one run from block 1")
            segs = kv_segments(self._layout, block_runs, self._kv_storages.items())
            self._copier.keep_out(block_runs[0][1])
            count, nbytes = self.runtime.add_source_staging(segs)
        except Exception as e:  # noqa: BLE001 - nothing may escape vLLM's hook
            logger.warning("OrbitKV rank %d: the KV blocks taken for staging cannot be used (%s): every layer is "
                           "written from the pages", self.tp_rank, e)
            return
        self._by_layer = True
        logger.info("OrbitKV rank %d: source staging of %d MiB in %d KV blocks of vLLM's cache (%d segments)",
                    self.tp_rank, nbytes >> 20, sum(z - a for a, z in block_runs), count)
        self._start_writer_gather()

    def _start_writer_gather(self) -> None:
        """``staging_pieces`` ``write``: the writer lanes gather a computed
        layer's scattered pages into a piece of the region for its write
        alone (on the GPU of this thread's CUDA context, or with memcpy).
        A failure leaves every layer written from the pages (logged)."""
        if self.config.staging_pieces != "write" or self.runtime is None:
            return
        try:
            how = self.runtime.set_writer_gather("cuda" if self.is_cuda else "host")
        except OrbitKVError as e:
            logger.warning("OrbitKV rank %d: the writer's gather cannot start (%s): every layer is written from "
                           "the pages", self.tp_rank, e)
            return
        logger.info("OrbitKV rank %d: writer lanes gather scattered layer writes into pieces of the source staging "
                    "(orbitkv.pd.staging_pieces write; copies: %s)", self.tp_rank, how)

    def start_load_kv(self, meta: PdConnectorMetadata) -> None:
        rt = self.runtime
        assert rt is not None, "register_kv_caches was not called"
        if self._staging_later and meta.staging_blocks:
            self._take_kv_staging(meta.staging_blocks)
        if meta.staging_released and (self._by_layer or self._staging_later):
            # the scheduler gave the staging's blocks back to vLLM (this
            # instance only decoded): nothing was gathered into them, and
            # from this step on nothing is; requests open from the pages
            self._by_layer = self._staging_later = False
            if self.config.staging_pieces == "write":
                # no prefill ran here, so no gathered write reads the region
                rt.set_writer_gather("off")
            logger.info("OrbitKV rank %d: the source staging's KV blocks went back to vLLM: every layer a prefill "
                        "here writes goes from the pages", self.tp_rank)
        led = self.ledger
        if meta.refused and self.tp_rank == 0:
            rt.note_params_refused(meta.refused)
        for end in meta.producers_end:
            prod = led.producers.get(end.pd_id)
            prod.vllm_done = True
            if end.report:
                # vLLM finished the request and waits for our word to free
                # its blocks; an abort of a request vLLM still runs (it was
                # preempted) must not free anything.
                prod.ended = True
                self._time_after_finish("ended_after_finish", prod)
            if end.aborted:
                self._producer_call(rt.producer_abort, end.pd_id, end.reason or "aborted")
                led.producers.tidy(end.pd_id)
            elif not prod.finished:
                prod.finished, prod.finished_at = True, time.monotonic()
                self._producer_call(rt.producer_finish, end.pd_id)
        for end in meta.consumers_end:
            if end.after_load:
                # vLLM holds the blocks of a failed load after our report
                # (it recomputed them, or ended the request before it saw
                # the report): report it again once the runtime frees them.
                if end.pd_id in led.consumers:
                    led.consumers.get(end.pd_id).reported = False
                rid = led.released_after_report.pop(end.pd_id, None)
                if rid is not None:
                    # Released already: nothing can write into them now.
                    cons = led.consumers.get(end.pd_id)
                    cons.req_id, cons.release_now = rid, True
                    continue
                if led.consumers.peek(end.pd_id).end:
                    continue  # its release is under way: reported when done
            cons = led.consumers.get(end.pd_id)
            cons.end = end.report
            try:
                self._release_consumer(end.pd_id)
            except Exception as e:  # noqa: BLE001 - nothing may escape vLLM's hook
                # The runtime no longer knows it (released already, or never
                # opened): nothing can write into its blocks. vLLM waits for
                # this report (its blocks are held until it comes), so make
                # it now, also when the ledger forgot the request: a release
                # reported in the same step as the failed load it followed
                # is withheld by the scheduler and asked again here
                # (after_load), after the ledger tidied the record.
                logger.warning("consumer release %s: %s", end.pd_id, e)
                if end.report:
                    cons.req_id = cons.req_id or end.req_id
                    cons.release_now = True
        for c in meta.consumers_open:
            self._open_consumer(c)
        for x in meta.consumers_cancel:
            # Sent by the runtime's own threads (a failure is logged there;
            # the producers then free their blocks at their deadline).
            host, port = x.prefill_kv.rsplit(":", 1)
            try:
                addrs = [f"{host}:{int(port) + r}" for r in self._senders(x.prefill_tp)]
                rt.consumer_send_cancel(x.pd_id, x.capability, x.reason, addrs)
            except OrbitKVError as e:
                logger.warning("cancellation of %s not sent: %s", x.pd_id, e)
        for d in meta.producers_discard:
            self._producer_call(rt.producer_discard, d.pd_id, d.capability, d.reason or "finished before scheduled")
        for u in meta.producers_unclaimed:
            if u.pd_id in led.producers:
                self._producer_call(rt.producer_release_unclaimed, u.pd_id, u.reason)
        self._step_chunks = []
        self._step_layers = set()
        self._step_index = {}
        for ch in meta.producer_chunks:
            self._faults.producer_chunk(ch.pd_id, ch.new_block_ids)
            if ch.opens:
                prod = led.producers.get(ch.pd_id)
                prod.req_id = ch.req_id
                ok = self._open_producer(ch)
                if ok and (prod.staging is not None or prod.layer_group is not None):
                    prod.blocks = list(ch.new_block_ids)
                if not ok:
                    # Never opened, so no release event will come: vLLM gets
                    # its blocks back as soon as it finishes the request.
                    led.producers.get(ch.pd_id).released = True
            elif ch.new_block_ids:
                ok = self._producer_call(rt.producer_add_blocks, ch.pd_id, ch.new_block_ids)
                peek = led.producers.peek(ch.pd_id)
                if ok and (peek.staging is not None or peek.layer_group is not None):
                    led.producers.get(ch.pd_id).blocks.extend(ch.new_block_ids)
            else:
                ok = True
            if ok and (ch.end_block > ch.start_block or ch.last):
                self._step_chunks.append(ch)
                self._index_staged_chunk(ch)

    def _open_producer(self, ch: Any) -> bool:
        """``producer_open``: by default staged by layer (the runtime gives a
        piece per layer and chunk as it is gathered, ``_gather``) where that
        can go into decode's pages; with a staging size set by hand, a
        source staging for the whole prompt when the region has room (else
        the request writes pages directly; decided once, before anything
        is written)."""
        rt = self.runtime
        assert rt is not None
        if self._by_layer and self.config.staging_pieces != "write":
            group = rt.staging_group(ch.consumer_tp)
            # By default decode gives no grant, so a staging only pays where
            # it can go into decode's pages (each decode block one group of
            # it: equal TP, decode's TP larger; not a larger prefill TP).
            if self._stages_into_pages(group, ch.consumer_tp) and (ch.end_block > 0 or ch.prompt_blocks > 0):
                ok = self._producer_call(rt.producer_open, ch.pd_id, ch.new_block_ids, ch.capability,
                                         ch.consumer_tp, staging_group=group, stage_by_layer=True)
                if ok:
                    self.ledger.producers.get(ch.pd_id).layer_group = group
                return ok
            return self._producer_call(rt.producer_open, ch.pd_id, ch.new_block_ids, ch.capability, ch.consumer_tp)
        arena, cap = self._source_arena, max(ch.prompt_blocks, ch.end_block)
        base = None
        group = rt.staging_group(ch.consumer_tp) if arena is not None else 1
        if arena is not None and cap > 0:
            sl = rt.staged_layout(cap)
            base = arena.alloc(sl["bytes"])
            if base is not None:
                # grouped by a decode rank's heads: written straight into its
                # pages (in its block order), or into a whole-block grant
                ok = self._producer_call(
                    rt.producer_open, ch.pd_id, ch.new_block_ids, ch.capability, ch.consumer_tp,
                    staging_base=base, staging_blocks=cap, staging_group=group,
                )
                if ok:
                    self.ledger.producers.get(ch.pd_id).staging = (base, cap, sl["slots"], group)
                else:
                    arena.free(base)
                return ok
            # no room: page to page (counted: a rising count says the region is small)
            rt.note_source_staging_full(1)
        return self._producer_call(rt.producer_open, ch.pd_id, ch.new_block_ids, ch.capability, ch.consumer_tp)

    def _stages_into_pages(self, group: int, consumer_tp: int) -> bool:
        """Whether a source staging grouped by ``group`` units holds each of
        a decode rank's blocks whole (decode of TP ``consumer_tp``), so that
        it can be written into decode's pages (``StagedPlan``)."""
        head_major, total = self._heads
        if not head_major:
            return True
        tp = max(1, consumer_tp)
        return total % tp == 0 and group == total // tp

    def _index_staged_chunk(self, ch: ProducerChunk) -> None:
        """The block IDs this step gathers for a staging request, as an index
        on the KV device: made once per step, used by every layer."""
        prod = self.ledger.producers.peek(ch.pd_id)
        staged = prod.staging is not None or prod.layer_group is not None
        if self._copier is not None and staged and ch.end_block > ch.start_block:
            blocks = prod.blocks[ch.start_block : ch.end_block]
            # In decode's block order when its authorization is written from
            # staging into its pages (the runtime records the order for the
            # chunk's writes); a request the runtime released gathers as is.
            rt = self.runtime
            assert rt is not None
            try:
                # a block shared with the chunk before or after stays in its slot
                order = rt.producer_gather_order(ch.pd_id, ch.start_block, ch.end_block,
                                                 pin_first=not ch.opens, pin_last=not ch.last)
            except OrbitKVError:
                order = None
            if order is not None:
                blocks = [prod.blocks[i] for i in order]
            self._step_index[ch.pd_id] = self._copier.index(blocks)

    def _gather(self, idx: int) -> None:
        """Copies layer ``idx`` of this step's staging chunks into their
        source staging (on CUDA: kernels on the current stream, so the layer's
        event covers them)."""
        copier = self._copier
        if copier is None:
            return
        for ch in self._step_chunks:
            blocks = self._step_index.get(ch.pd_id)
            prod = self.ledger.producers.peek(ch.pd_id)
            if blocks is None or (prod.staging is None and prod.layer_group is None):
                continue
            try:
                if prod.layer_group is not None:
                    # A piece of its own for this layer of this chunk; none
                    # (no room, counted by the runtime; or decode's blocks
                    # are not written from staging): from the pages.
                    assert self.runtime is not None
                    try:
                        piece = self.runtime.producer_stage_layer(ch.pd_id, idx, ch.start_block, ch.end_block)
                    except UnknownRequestError:
                        # released under us (aborted, expired): nothing more to send
                        del self._step_index[ch.pd_id]
                        continue
                    if piece is None:
                        continue
                    copier.gather_piece(idx, blocks, piece[0], piece[1], prod.layer_group)
                    continue
                assert prod.staging is not None
                base, cap, slots, group = prod.staging
                copier.gather(idx, blocks, ch.start_block, base, cap, slots, group)
            except Exception as e:  # noqa: BLE001 - nothing may escape vLLM's hook
                # This request's staged copy is incomplete: fail it alone
                # (decode recomputes), gather nothing more for it.
                logger.warning("staging gather for %s failed (%s): aborting the request", ch.pd_id, e)
                del self._step_index[ch.pd_id]
                assert self.runtime is not None
                self._producer_call(self.runtime.producer_abort, ch.pd_id, f"staging gather failed: {e}")

    def _scatter(self, pd: str, staged: tuple[int, int, list[tuple[int, int]], int], blocks: list[int]) -> None:
        """Copies a completed request's staging grant into its pages (before
        vLLM is told the KV arrived; on CUDA ordered before the next forward
        on the same stream)."""
        copier, rt = self._copier, self.runtime
        assert copier is not None and rt is not None
        base, n, units, group = staged
        if n != len(blocks):
            raise ValueError(f"staging of {pd}: {n} blocks staged, {len(blocks)} authorized")
        copier.scatter(copier.index(blocks), base, units, rt.staged_layout(n)["slots"], group)
        if self.is_cuda:
            ev = torch.cuda.Event()
            ev.record()
            self.ledger.consumers.get(pd).scatter_done = ev

    def _release_consumer(self, pd: str) -> None:
        """``consumer_release``, once the scatter out of its grant (if any) ran."""
        rt = self.runtime
        assert rt is not None
        if pd in self.ledger.consumers:
            rec = self.ledger.consumers.get(pd)
            if rec.scatter_done is not None:
                rec.scatter_done.synchronize()
                rec.scatter_done = None
        rt.consumer_release(pd)

    def _free_source_staging(self) -> None:
        """Gives back the source staging of requests the runtime released and
        vLLM no longer schedules (staged by layer: the runtime took its
        pieces back itself; only the record goes)."""
        for pd, prod in self.ledger.producers.where(lambda r: r.layer_group is not None and r.released and r.vllm_done):
            prod.layer_group = None
            self.ledger.producers.tidy(pd)
        if self._source_arena is None:
            return
        for pd, prod in self.ledger.producers.where(lambda r: r.staging is not None and r.released and r.vllm_done):
            assert prod.staging is not None
            self._source_arena.free(prod.staging[0])
            prod.staging = None
            self.ledger.producers.tidy(pd)

    def _senders(self, prefill_tp: int) -> list[int]:
        """The prefill ranks that send to this decode rank (the core's rule)."""
        total = self.vllm_config.model_config.get_total_num_kv_heads()
        return producer_ranks(total, self.tp_rank, self.tp_size, prefill_tp)

    def _producer_call(self, fn: Any, pd_id: str, *args: Any, **kwargs: Any) -> bool:
        """Calls the runtime for producer ``pd_id`` inside vLLM's hooks, where
        no exception may escape: a producer already released (the decode
        died, cancelled, a deadline passed) means nothing more to send for
        that request; any other error fails that request alone."""
        try:
            fn(pd_id, *args, **kwargs)
            return True
        except UnknownRequestError:
            logger.debug("%s for %s: already released, nothing more to send", fn.__name__, pd_id)
        except OrbitKVError as e:
            logger.warning("%s for %s failed: %s", fn.__name__, pd_id, e)
        return False

    def _open_consumer(self, c: Any) -> None:
        rt = self.runtime
        assert rt is not None
        try:
            # The prefill ranks first: a prefill TP size the model's heads
            # cannot split over refuses the request before anything is
            # authorized.
            host, port = c.prefill_kv.rsplit(":", 1)
            targets = [(f"{host}:{int(port) + r}", r) for r in self._senders(c.prefill_tp)]
            # The runtime sends the handshake from its own threads (never
            # waiting for this process's GIL) and fails at once a rank that
            # refuses it or where nothing listens.
            rt.consumer_open(
                c.pd_id, c.capability, c.first_block, c.block_ids, c.prefill_tp, targets, tokens=c.tokens
            )
        except OrbitKVError as e:
            # Nothing was authorized: vLLM recomputes the prompt here.
            logger.warning("request %s: KV cannot be received (%s); decode recomputes it", c.req_id, e)
            self._fail_load(c.req_id, c.block_ids)
            self._refused_consumers.add(c.req_id)
            return
        cons = self.ledger.consumers.get(c.pd_id)
        cons.req_id, cons.blocks = c.req_id, list(c.block_ids)
        self._faults.consumer_opened(c.pd_id, c.first_block, c.block_ids, c.tokens)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        if not self._step_chunks:
            return
        idx = self._layer_index.get(layer_name)
        if idx is None:
            return  # not a KV layer we registered (e.g. a cross-attention cache)
        self._step_layers.add(idx)
        self._save_layer(idx)
        if len(self._step_layers) == len(self._layer_index):
            # Every layer of a request's last chunk is admitted: finish it now
            # rather than after the rest of the forward (the last MLP, the
            # logits), so decode learns that its KV is complete sooner.
            self._finish_last_chunks()

    def _save_layer(self, idx: int) -> None:
        """Admits layer ``idx`` of this step's chunks (their writes start once
        the layer's kernels are done on GPU): one path per platform."""
        rt = self.runtime
        assert rt is not None
        self._gather(idx)
        chunks = [(ch.pd_id, ch.start_block, ch.end_block) for ch in self._step_chunks]
        if self._rust_gate:
            # CUDA: the attention kernel may still be writing this layer. The
            # runtime records an event on this stream and admits the layer
            # once the GPU passed it, on its own thread.
            try:
                rt.layers_ready_after(_stream_handle(), idx, chunks)
                self._gate_used = True
            except OrbitKVError as e:
                if self._gate_failed(e):
                    self._save_layer(idx)
            return
        if self.is_cuda:
            # Without the runtime's gate: the layer's kernels are done first.
            torch.cuda.current_stream().synchronize()
        if not chunks:
            return
        # One call into the runtime for every request of this step.
        try:
            refused = rt.layers_ready(idx, chunks)
        except OrbitKVError as e:
            logger.warning("layers_ready for layer %d failed: %s", idx, e)
            refused = [(pd_id, e) for pd_id, _, _ in chunks]
        gone = set()
        for pd_id, err in refused:
            if isinstance(err, UnknownRequestError):
                logger.debug("layer_ready for %s: already released, nothing more to send", pd_id)
            else:
                logger.warning("layer_ready for %s failed: %s", pd_id, err)
            gone.add(pd_id)
        if gone:  # released under us: nothing more to send for it
            self._step_chunks = [ch for ch in self._step_chunks if ch.pd_id not in gone]

    def _gate_failed(self, e: Exception) -> bool:
        """The runtime's layer gate cannot be used (no usable CUDA driver from
        Rust): from now on this worker waits for each layer's kernels itself
        and hands it over the CPU way. Returns whether this layer may go that
        way. Once the gate has taken layers, a layer handed over without a
        mark could be written before ones the gate still holds (a request
        finished before its last layers were admitted), so the requests of
        this step are aborted instead (decode recomputes them)."""
        logger.warning("OrbitKV layer gate unavailable (%s): waiting for each layer's kernels on this thread", e)
        self._rust_gate = False
        if not self._gate_used:
            return True
        rt = self.runtime
        assert rt is not None
        for ch in self._step_chunks:
            self.ledger.producers.get(ch.pd_id).finished = True
            self._producer_call(rt.producer_abort, ch.pd_id, f"layer gate failed: {e}")
        self._step_chunks = []
        return False

    def wait_for_save(self) -> None:
        rt = self.runtime
        if rt is None:
            return
        missing = [i for i in range(len(self._layer_index)) if i not in self._step_layers]
        # Recurrent-state layers (Mamba, linear attention) have no per-layer
        # save in vLLM: their state of this step is sent here, once the
        # forward wrote it (a block's state is final once the prefill is
        # past its tokens; the last one goes with the last step).
        names = self._groups.state_layers if self._groups is not None else frozenset()
        state = [i for i in missing if self._layer_names[i] in names] if names else []
        if self._step_chunks and state:
            for idx in state:
                self._save_layer(idx)
            missing = [i for i in missing if i not in state]
        if self._step_chunks and missing:
            # vLLM skipped save_kv_layer for these layers (some model paths
            # do: vllm-project/vllm#56762). The forward is over, so they are
            # sent now, not overlapped; never silently not at all (the
            # producer would fail the request: rule 7).
            if not self._warned_saved_at_wait:
                self._warned_saved_at_wait = True
                logger.warning(
                    "vLLM did not call save_kv_layer for %d of %d KV layers (e.g. %s): OrbitKV sends them "
                    "at wait_for_save instead, after the forward, so their transfer does not overlap "
                    "compute (counted in vllm:orbitkv_layers_saved_at_wait; said once)",
                    len(missing),
                    len(self._layer_index),
                    self._layer_names[missing[0]],
                )
            for idx in missing:
                self._save_layer(idx)
            rt.note_layers_saved_at_wait(len(missing) * len(self._step_chunks))
        self._finish_last_chunks()  # if the last layer's save was not seen
        self._step_chunks = []
        self._step_layers = set()
        self._step_index = {}

    def _finish_last_chunks(self) -> None:
        rt = self.runtime
        assert rt is not None
        for ch in self._step_chunks:
            prod = self.ledger.producers.get(ch.pd_id) if ch.last else None
            if prod is not None and not prod.finished:
                prod.finished, prod.finished_at = True, time.monotonic()
                # After the layers handed over before it, by the same path.
                finish = rt.producer_finish_after if self._rust_gate else rt.producer_finish
                self._producer_call(finish, ch.pd_id)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        rt = self.runtime
        if rt is None:
            return None, None
        led = self.ledger
        sending: set[str] = set()
        recving: set[str] = set(self._refused_consumers)
        self._refused_consumers.clear()
        for pd in led.release_now():
            rec = led.consumers.pop(pd)
            if rec is not None and rec.req_id is not None:
                recving.add(rec.req_id)
        for ev in rt.poll_events():
            pd = ev.request_id
            if ev.kind in ("consumer_completed", "consumer_failed"):
                cons = led.consumers.peek(pd)
                if ev.kind == "consumer_failed":
                    logger.warning("KV for %s did not arrive complete: %s", pd, ev.reason)
                    self._fail_load(cons.req_id, cons.blocks or ())
                    if getattr(ev, "held", False) and not self.recompute_failed_loads and not self._hybrid:
                        # A producer never ended: its writes may still land
                        # (queued behind a cut link). vLLM fails the request
                        # on the failed blocks now, and frees them only on
                        # this request's report: that waits until nothing
                        # can write into them (released).
                        logger.warning(
                            "blocks of %s held until every producer ended or the quarantine (%.0fs) passed",
                            pd, self.config.quarantine_s,
                        )
                        continue
                    # Recompute policy (held or not): vLLM recomputes into the
                    # same blocks at once; a late write of this request's own
                    # producer carries the same prompt's KV. The scheduler
                    # holds the blocks when the request ends, until the
                    # runtime releases them (RequestEnd.after_load).
                if cons.end is None and not cons.reported and cons.req_id is not None:
                    staged = getattr(ev, "staged", None) if ev.kind == "consumer_completed" else None
                    if staged is not None:
                        try:
                            self._scatter(pd, staged, cons.blocks or [])
                        except Exception as e:  # noqa: BLE001 - nothing may escape vLLM's hook
                            # The pages are incomplete: vLLM recomputes them.
                            logger.warning("staging of %s could not be scattered (%s): recomputed", pd, e)
                            self._fail_load(cons.req_id, cons.blocks or ())
                    if ev.kind == "consumer_completed":  # test hook (after any scatter)
                        self._faults.after_load(self._kv_caches, self._num_blocks, blocks_of(cons.blocks or ()), pd)
                    led.consumers.get(pd).reported = True
                    recving.add(cons.req_id)
            elif ev.kind == "consumer_quiesced":
                # vLLM still runs it (recompute policy: it waits for this
                # report to recompute into the blocks); if vLLM already ended
                # it, the release reports it.
                cons = led.consumers.peek(pd)
                if cons.req_id is not None and cons.end is None and not cons.reported:
                    led.consumers.get(pd).reported = True
                    recving.add(cons.req_id)
            elif ev.kind == "consumer_released":
                cons = led.consumers.peek(pd)
                if cons.end and not cons.reported and cons.req_id is not None:
                    recving.add(cons.req_id)
                elif cons.end and cons.req_id is not None:
                    # Reported before vLLM's end reached us; if vLLM withheld
                    # that report (the scheduler's RequestEnd.after_load
                    # follows), report it then.
                    led.remember_released_after_report(pd, cons.req_id)
                if pd in led.consumers:
                    # The runtime is done with it; only a pending
                    # report-now survives (handled at the next call).
                    cons.req_id = cons.blocks = cons.end = None
                    cons.reported = False
                    led.consumers.tidy(pd)
            elif ev.kind == "producer_released":
                if ev.outcome != "done":
                    logger.warning("prefill %s ended %s: %s", pd, ev.outcome, ev.reason)
                if led.producers.peek(pd).req_id is not None:  # not a discarded request's answer
                    led.producers.get(pd).released = True
        self._free_source_staging()
        self._give_back_pages(sending)
        for pd, prod in led.ended_and_released():
            if prod.req_id is not None and not prod.pages_back:
                self._faults.before_send_done(self._kv_caches, self._num_blocks, pd)
                sending.add(prod.req_id)
                self._time_after_finish("reported_after_finish", prod)
            led.producers.pop(pd)
        return (sending or None), (recving or None)

    def _time_after_finish(self, phase: str, prod: Any) -> None:
        """Times ``phase`` (a ``PY_TIMINGS`` name) of a producer request
        from its ``producer_finish`` call, if it had one (not an abort)."""
        if prod.finished_at is not None:
            self._py_timings[phase].append(time.monotonic() - prod.finished_at)

    def _give_back_pages(self, sending: set[str]) -> None:
        """Reports as sent the requests staged by layer that vLLM finished
        and whose every layer is in a layer piece or at decode already (the
        runtime says so and stops reading their pages): vLLM frees their
        blocks now, while the remaining writes go out of the pieces, instead
        of at the release. A request the runtime says never can (its
        decode's authorization is written from the pages) is not asked
        again."""
        rt = self.runtime
        assert rt is not None
        for pd, prod in self.ledger.producers.where(
            lambda r: r.ended and r.finished and not r.released and not r.pages_back
            and not r.pages_never and r.layer_group is not None and r.req_id is not None
        ):
            try:
                back = rt.producer_give_back_pages(pd)
            except OrbitKVError:
                continue  # released under us: the release reports it
            if back == "never":
                prod.pages_never = True
            elif back in ("now", "before"):
                assert prod.req_id is not None
                prod.pages_back, prod.back_at = True, time.monotonic()
                self._faults.before_send_done(self._kv_caches, self._num_blocks, pd)
                sending.add(prod.req_id)
                self._time_after_finish("reported_after_finish", prod)
        # vLLM no longer counts them among the finished requests that wait
        # for a decode (the scheduler's claim deadline and caps): the claim
        # deadline is kept here, so a decode that never comes (a stranger's
        # two-stage half) holds their layer pieces only that long.
        limit = self.config.claim_timeout_s
        now = time.monotonic()
        for pd, prod in self.ledger.producers.where(
            lambda r: r.pages_back and not r.released and not r.unclaimed_asked
            and r.back_at is not None and now - r.back_at >= limit
        ):
            prod.unclaimed_asked = True
            self._producer_call(rt.producer_release_unclaimed, pd,
                                f"no decode claimed it within orbitkv.pd.claim_timeout_s ({limit:g}s)")

    def _fail_load(self, req_id: str | None, table: Any) -> None:
        """The KV of vLLM request ``req_id`` into ``table`` failed to load:
        its blocks are reported as load errors (vLLM recomputes or fails
        them), or, for a model of several KV cache groups, the request
        (:meth:`take_failed_loads`: vLLM's ``failed_recving``)."""
        self._load_errors.update(blocks_of(table))
        if req_id is not None:
            self._failed_loads.add(req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        if self._hybrid:
            # vLLM maps load errors to requests over one group and raises
            # with several: they go as requests (take_failed_loads).
            return set()
        self._failed_loads.clear()
        return out

    def take_failed_loads(self) -> set[str]:
        """The vLLM request ids whose load failed since the last call, for a
        model of several KV cache groups (empty otherwise: those go as
        blocks, :meth:`get_block_ids_with_load_errors`)."""
        if not self._hybrid:
            return set()
        out, self._failed_loads = self._failed_loads, set()
        return out

    def claimed(self) -> list[str]:
        """The vLLM request IDs of the requests vLLM finished here whose
        decode claimed them on this rank (its handshake reached every
        producer of it here) since the last call, each once: the scheduler
        counts them out of its unclaimed caps once every rank said so
        (:class:`PdWorkerMeta`)."""
        rt = self.runtime
        if rt is None:
            return []
        out: list[str] = []
        for pd, prod in self.ledger.producers.where(
            lambda r: r.vllm_done and not r.released and not r.pages_back and not r.claim_reported
            and r.req_id is not None
        ):
            try:
                if not rt.producer_claimed(pd):
                    continue
            except OrbitKVError:
                continue
            prod.claim_reported = True
            out.append(str(prod.req_id))
        return out

    def draining(self) -> int | None:
        """Requests reported sent early (their pages went back) whose
        release this worker has not seen yet; ``None`` where none can be
        (no request is staged by layer here)."""
        if not self._by_layer:
            return None
        return len(self.ledger.producers.where(lambda r: r.pages_back and not r.released))

    def get_kv_connector_stats(self) -> PdConnectorStats | None:
        if self.runtime is None:
            return None
        now = self.runtime.stats()
        delta = {k: now.get(k, 0) - self._last_stats.get(k, 0) for k in COUNTERS}
        self._last_stats = {k: now.get(k, 0) for k in COUNTERS}
        data: dict[str, Any] = dict(delta)
        data["timings"] = {k: v for k, v in self.runtime.take_timings().items() if v}
        for k, v in self._py_timings.items():
            if v:
                data["timings"][k], self._py_timings[k] = v, []
        stats = PdConnectorStats(data=data)
        return None if stats.is_empty() else stats

    def live_requests(self) -> tuple[int, int]:
        return self.runtime.live_requests() if self.runtime is not None else (0, 0)

    def shutdown(self) -> None:
        if self.side_channel is not None:
            self.side_channel.close()
            self.side_channel = None
        if self.runtime is not None:
            self.runtime.shutdown()
            self.runtime = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
