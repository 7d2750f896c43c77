"""The PdConnector's scheduler side: decides what each worker does per step.

Decode (consumer) requests: the prompt's KV is loaded asynchronously; once
vLLM allocated blocks, the worker authorizes them and sends the handshake.
Prefill (producer) requests: each step's computed blocks are streamed layer
by layer; the blocks are held (``request_finished`` delays the free) until
every admitted write drained.

Every request's ``kv_transfer_params`` are client input: a request whose
OrbitKV keys are malformed, unsigned or wrongly signed when a deployment
key is set, whose ``orbitkv_request`` is already live on this instance, or
whose prefill side channels the configuration does not allow
(``orbitkv.pd.allowed_prefill``) is served as a plain request
(computed here, nothing transferred) with a warning naming the reason.
Nothing such a request carries can stop the engine. The same holds for the
routers' dialects this connector serves (vLLM's two-stage fields; the
``mooncake`` dialect when ``orbitkv.pd.dialects`` names it), which are
turned into OrbitKV's own params here.

A request's blocks are reported back to vLLM exactly once:
* consumer: in ``finished_recving`` when the KV arrived or failed, or, if
  vLLM finished the request first, once no producer can write any more;
* producer: in ``finished_sending`` once vLLM finished the request and every
  write drained.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orbitkv._native import new_capability
from orbitkv.vllm.config import ANY, AUTO_STAGING_STEPS, PdConfig, auto_staging_cap_mb
from orbitkv.vllm.groups import GroupsError, KvGroups, blocks_of
from orbitkv.vllm.kv_staging import give_blocks_back, reserved_blocks, runs, take_blocks
from orbitkv.vllm.metadata import (
    ConsumerCancel,
    ConsumerOpen,
    PdConnectorMetadata,
    ProducerChunk,
    ProducerDiscard,
    ProducerUnclaimed,
    RequestEnd,
)
from orbitkv.vllm.params import (
    CAPABILITY,
    CONSUMER,
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    MOONCAKE,
    PREFILL_KV,
    PREFILL_TP,
    PRODUCER,
    REMOTE_BOOTSTRAP_ADDR,
    REQUEST,
    ROLE,
    SIGNATURE,
    MooncakeParams,
    PdParams,
    RateLimitedLog,
    RequestParamsError,
    asks_mooncake,
    asks_two_stage,
    check_signature,
    preview,
    sign,
    unserved_dialect,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("orbitkv.vllm.scheduler")


def _leading(items: Any, pred: Any) -> Any:
    """The leading items of ``items`` for which ``pred`` holds."""
    for x in items:
        if not pred(x):
            return
        yield x


# Consumer requests after which a kv_both instance that keeps the staging's
# blocks and never prefilled for a decode is told to start as kv_consumer.
DECODE_ONLY_HINT_AFTER = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _step_blocks(vllm_config: Any, block_size: int) -> int:
    """Blocks of one scheduler step (vLLM's ``max_num_batched_tokens``;
    each block every layer's KV of its tokens), which sizes the source
    staging (``config.auto_staging_cap_mb``); 0 when unknown."""
    mnbt = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    if not isinstance(mnbt, int) or isinstance(mnbt, bool) or mnbt <= 0 or block_size <= 0:
        return 0
    return _cdiv(mnbt, block_size)


@dataclass
class _Producer:
    pd_id: str
    capability: str
    consumer_tp: int
    prompt_len: int
    opened: bool = False
    done_blocks: int = 0
    last_sent: bool = False


@dataclass
class _Consumer:
    pd_id: str
    blocks: frozenset[int] = frozenset()
    loaded: bool = False
    # The worker reported the load with some of these blocks failed (vLLM
    # then recomputed them, or failed the request).
    failed: bool = False


class PdScheduler:
    def __init__(self, vllm_config: VllmConfig, config: PdConfig, groups: KvGroups | None = None):
        self.config = config
        # The model's KV cache groups (groups.py): one for a dense model.
        self.groups = groups or KvGroups(1, vllm_config.cache_config.block_size)
        self.block_size = self.groups.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._producers: dict[str, _Producer] = {}
        # Prefill halves whose last prompt token was dropped (on_new_request).
        self._truncated: set[str] = set()
        self._consumers: dict[str, _Consumer] = {}
        # What the next step's metadata tells the workers (its producer
        # chunks are added when it is built).
        self._next = PdConnectorMetadata()
        # Requests whose block free vLLM delayed on our word.
        self._delayed: set[str] = set()
        # Prefill requests the workers reported sent whose writes still go
        # out of their layer pieces (their pages went back early), summed
        # over the ranks (the workers' PdWorkerMeta): vLLM keeps stepping
        # while any does, so their release is seen and counted.
        self._draining = 0
        # vLLM request id -> its OrbitKV params (None: a plain request, or
        # one whose params were refused), decided once per request.
        self._params: dict[str, PdParams | None] = {}
        # orbitkv_request -> the vLLM request id that holds it here.
        self._live: dict[str, str] = {}
        self.refused = 0  # requests served plainly because their params were refused
        # Producers vLLM finished whose blocks wait for a decode that may not
        # have claimed them yet (no handshake seen here: the workers know),
        # oldest first: vLLM request id -> (finished at, blocks held).
        self._unclaimed: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self.unclaimed_asked = 0  # producers asked to give up (claimed ones ignore it)
        # Of those, how many ranks said a decode claimed them so far (the
        # workers' PdWorkerMeta); at tp_size they leave _unclaimed.
        self._claims: dict[str, int] = {}
        # The cap in blocks; None when vLLM did not say how many it has.
        num_blocks = getattr(vllm_config.cache_config, "num_gpu_blocks", None)
        self._unclaimed_block_cap: int | None = None
        if isinstance(num_blocks, int) and num_blocks > 0:
            self._cap_unclaimed(num_blocks)
        self._clock = time.monotonic
        self._vllm_config = vllm_config
        # The blocks taken out of vLLM's pool for the source staging
        # (bind_block_pool), as runs; [] when none.
        self.staging_runs: list[tuple[int, int]] = []
        self._pool_seen = False  # bind_block_pool was called (before the first step)
        # Whether this instance prefilled for a decode, and how many requests
        # it decoded with KV from a prefill: a kv_both instance that took the
        # staging's blocks and has only decoded gives them back to vLLM at
        # the DECODE_ONLY_HINT_AFTER-th decode (and is told to start as
        # kv_consumer); its workers stage no more from then on.
        self._prefilled = False
        self._decoded = 0
        self._pool: Any = None  # vLLM's block pool, once the staging's blocks were taken from it
        # Refusals are client-driven: a flood of them must not flood the log.
        self._refusal_log = RateLimitedLog(logger)
        if MOONCAKE in config.dialects:
            logger.info(
                "OrbitKV serves the mooncake dialect (transfer_id; vllm-router / llm-d --kv-connector mooncake): "
                "prefill TP %d, decode TP %d assumed for its requests",
                config.prefill_tp or self.tp_size,
                config.decode_tp or self.tp_size,
            )
            if ANY in config.allowed_prefill:
                logger.warning(
                    "orbitkv.pd.dialects includes 'mooncake' and orbitkv.pd.allowed_prefill is '*': nothing in "
                    "that dialect is signed, so whoever reaches this instance's API can make it post a handshake "
                    "to any side channel; name the prefill side channels instead (docs/security.md)"
                )

    def params_of(self, request: Request) -> PdParams | None:
        """The request's OrbitKV params, or ``None`` to serve it plainly.
        Decided at the first hook that sees the request and kept until it
        finishes; a refusal is logged once with its reason."""
        rid = request.request_id
        if rid in self._params:
            return self._params[rid]
        try:
            raw = getattr(request, "kv_transfer_params", None)
            p = PdParams.parse(raw)
            if p is None and asks_two_stage(raw):
                # vLLM's two-stage flow (vllm-router's nixl mode): this
                # prefill mints the request's identity and capability and
                # answers the decode half's params (request_finished).
                if self.config.side_channel_key is not None and not self.config.two_stage_unsigned:
                    # The answer would be signed: never for whoever reaches
                    # this API unsigned (decode trusts signed params).
                    raise RequestParamsError(
                        "an unsigned two-stage prefill half (do_remote_decode) while a deployment key is set: "
                        "its answer would carry a signature decode trusts; set orbitkv.pd.two_stage_unsigned to "
                        "answer routers that cannot sign anyway, or use orbitkv.proxy (docs/security.md)"
                    )
                p = PdParams(
                    role=PRODUCER,
                    request=uuid.uuid4().hex,
                    capability=new_capability(),
                    decode_tp=self.config.decode_tp or self.tp_size,
                    answer=True,
                )
            elif p is None and asks_mooncake(raw):
                # vllm-router's / llm-d's `--kv-connector mooncake`: both
                # halves at once, one router-minted transfer_id.
                assert raw is not None
                if MOONCAKE not in self.config.dialects:
                    raise RequestParamsError(
                        "kv_transfer_params ask for P/D in the mooncake dialect (transfer_id: a router's "
                        "--kv-connector mooncake), a dialect OrbitKV does not serve unless orbitkv.pd.dialects "
                        "includes 'mooncake' (docs/routers.md)"
                    )
                p = MooncakeParams.parse(raw).to_pd(
                    self.config.side_channel_key,
                    prefill_tp=self.config.prefill_tp or self.tp_size,
                    decode_tp=self.config.decode_tp or self.tp_size,
                )
                self._check_live(p, rid)
            elif p is None:
                dialect = unserved_dialect(raw)
                if dialect is not None:
                    raise RequestParamsError(dialect)
            else:
                key = self.config.side_channel_key
                if key is not None:
                    check_signature(raw or {}, key)
                self._check_live(p, rid)
            if p is not None and p.role == CONSUMER:
                # OrbitKV's own params vouch for their prefill when signed;
                # a dialect's never are.
                self._check_prefill(p, signed=self.config.side_channel_key is not None and p.dialect is None)
        except RequestParamsError as e:
            self.refused += 1
            self._next.refused += 1
            self._refusal_log.warning("request %s is served without P/D transfer: %s", preview(rid), e)
            p = None
        if p is not None:
            self._live[p.request] = rid
        self._params[rid] = p
        return p

    def _check_live(self, p: PdParams, rid: str) -> None:
        holder = self._live.get(p.request)
        if holder is not None and holder != rid:
            what = "its transfer_id" if p.dialect is not None else "orbitkv_request"
            raise RequestParamsError(f"{what} ({p.request!r}) is already live on this instance")

    def _check_prefill(self, p: PdParams, signed: bool) -> None:
        """Decode posts its handshakes and cancels (its Mooncake endpoint and
        every layer's address) to the side channels of every prefill rank,
        ``port + r``: each must be declared in ``orbitkv.pd.allowed_prefill``.
        With a deployment key the params are the proxy's (signed), and the
        proxy learned the ports from the prefill's own side channels: then
        the host must be declared, any port."""
        host, port = p.prefill_host_port
        if signed:
            if not self.config.prefill_host_allowed(host):
                raise RequestParamsError(
                    f"orbitkv_prefill_kv {p.prefill_kv!r}: host {host!r} is not in orbitkv.pd.allowed_prefill"
                )
        elif not self.config.prefill_allowed(host, port, p.prefill_tp):
            last = port + p.prefill_tp - 1
            ranks = f" (its {p.prefill_tp} ranks: ports {port}..{last})" if p.prefill_tp > 1 else ""
            named = (
                f"{REMOTE_BOOTSTRAP_ADDR} 'http://{p.prefill_kv}'" if p.dialect is not None
                else f"orbitkv_prefill_kv {p.prefill_kv!r}"
            )
            raise RequestParamsError(
                f"{named}{ranks} is not an allowed prefill side channel (declare it in orbitkv.pd.allowed_prefill)"
            )

    def _forget(self, rid: str) -> None:
        self._truncated.discard(rid)
        p = self._params.pop(rid, None)
        if p is not None and self._live.get(p.request) == rid:
            del self._live[p.request]

    # ---- hooks -------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """vLLM (0.32 on) tells of each new request. A prefill half of a model
        with recurrent state computes all but the prompt's last token: decode
        needs the state after those (it computes the last token on it
        itself; a state after all of them would take the last token twice)."""
        if not self.groups.has_state or request.request_id in self._truncated:
            return
        p = self.params_of(request)
        if p is None or p.role != PRODUCER:
            return
        prompt = request.prompt_token_ids
        if prompt is None or len(prompt) < 2:
            return
        del prompt[-1]
        del request._all_token_ids[-1]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        self._truncated.add(request.request_id)

    def _loaded_tokens(self, request: Request) -> int:
        """The prompt tokens decode loads: all of them, or, for a model with
        recurrent state, all but the last (which decode computes on the
        state after the others, as prefill stopped before it)."""
        n = len(request.prompt_token_ids or ())
        return n - 1 if self.groups.has_state and n > 1 else n

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        p = self.params_of(request)
        if p is None or p.role != CONSUMER or request.request_id in self._consumers:
            return 0, False
        n = self._loaded_tokens(request) - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        p = self.params_of(request)
        if p is None:
            return
        rid = request.request_id
        if p.role == PRODUCER and rid not in self._producers:
            self._producers[rid] = _Producer(p.request, p.capability, p.decode_tp, len(request.prompt_token_ids or ()))
            self._prefilled = True
            return
        if p.role != CONSUMER or num_external_tokens <= 0 or rid in self._consumers:
            return
        self._decoded += 1
        if self._decoded == DECODE_ONLY_HINT_AFTER and not self._prefilled and self.staging_runs:
            self._release_staging()
        if self.groups.count == 1:
            all_ids = blocks.get_block_ids()[0]
            fresh = blocks.get_unhashed_block_ids()
            # Blocks with a hash come from the local prefix cache and lead the list.
            first_block = len(all_ids) - len(fresh)
        else:
            # The local prefix hit is one block-aligned length for all groups
            # (vLLM's hybrid coordinator): the leading hashed blocks of the
            # group with the fewest (a sliding-window group's leading blocks
            # may be null blocks too, outside its window).
            first_block = min(
                sum(1 for _ in _leading(g, lambda b: b.block_hash is not None or b.is_null))
                for g in blocks.blocks
            )
            try:
                fresh = self.groups.table(blocks.get_block_ids(), first_block)
            except GroupsError as e:
                # The worker refuses an uneven table: the load fails, vLLM recomputes.
                logger.warning("request %s: %s", rid, e)
                fresh = [b for g in blocks.get_block_ids() for b in g[first_block:]]
        self._consumers[rid] = _Consumer(p.request, frozenset(blocks_of(fresh)))
        assert p.prefill_kv is not None
        self._next.consumers_open.append(
            ConsumerOpen(
                rid,
                p.request,
                p.capability,
                first_block,
                list(fresh),
                p.prefill_kv,
                p.prefill_tp,
                tokens=self._loaded_tokens(request),
            )
        )

    def _cap_unclaimed(self, num_blocks: int) -> None:
        """The unclaimed cap: ``unclaimed_kv_share`` of the ``num_blocks``
        vLLM serves requests from, at least one."""
        self._unclaimed_block_cap = max(1, int(num_blocks * self.config.unclaimed_kv_share))

    @property
    def staging_released(self) -> bool:
        """The staging's blocks were taken and given back (_release_staging)."""
        return self._pool is not None and not self.staging_runs

    def _release_staging(self) -> None:
        """A kv_both instance that decoded DECODE_ONLY_HINT_AFTER requests
        and prefilled none: the source staging's blocks go back to vLLM's
        pool (no request ever prefilled here, so no gather wrote them and no
        write reads them), and every later step's metadata tells the workers
        to stage no more: a prefill here later writes its layers from the
        pages. A pool that refuses keeps them (the warning says so)."""
        held = sum(e - b for b, e in self.staging_runs)
        try:
            back = give_blocks_back(self._pool, self.staging_runs)
        except Exception as e:  # noqa: BLE001 - a pool that refuses must not stop the step
            logger.warning("OrbitKV: vLLM's block pool refused the source staging's %d blocks back (%s)", held, e)
            back = 0
        if back == 0:
            logger.warning(
                "OrbitKV: this instance decoded %d requests and prefilled none for a decode, yet keeps %d of its KV "
                "cache blocks for a source staging only a prefill uses (orbitkv.pd.staging_memory kv_cache): start "
                "an instance that only decodes with kv_role kv_consumer (or orbitkv.pd.staging_mb 0) to give vLLM "
                "those blocks", DECODE_ONLY_HINT_AFTER, held)
            return
        self.staging_runs = []
        if self._unclaimed_block_cap is not None:
            self._cap_unclaimed(self._pool.num_gpu_blocks)
        logger.warning(
            "OrbitKV: this instance decoded %d requests and prefilled none for a decode: the %d KV cache blocks it "
            "took for a source staging only a prefill uses are given back to vLLM (a prefill here from now on "
            "writes its layers from the pages); start an instance that only decodes with kv_role kv_consumer, "
            "which takes none", DECODE_ONLY_HINT_AFTER, back)

    def bind_block_pool(self, pool: Any, kv_cache_config: Any, kv_role: str) -> None:
        """vLLM's block pool, before any request: with ``staging_memory``
        ``kv_cache`` on a rank that may prefill, takes the source staging's
        blocks out of it for good (kv_staging.py) and names them in every
        step's metadata from now on. Nothing is taken for a model of several
        KV cache groups (no staging there), without the KV cache config, or
        when the pool has not the room (logged)."""
        self._pool_seen = True
        # (kv_cache goes with staging_mb "auto" only: PdConfig refuses the rest)
        if self.config.staging_memory != "kv_cache" or self.groups.count > 1:
            return
        tensors = getattr(kv_cache_config, "kv_cache_tensors", None)
        num_blocks = getattr(kv_cache_config, "num_blocks", None)
        if not tensors or not isinstance(num_blocks, int):
            logger.warning("OrbitKV: vLLM gave no KV cache config: no source staging (orbitkv.pd.staging_memory "
                           "kv_cache), every layer is written from the pages")
            return
        kv_bytes = sum(int(t.size) for t in tensors)
        max_len = int(getattr(getattr(self._vllm_config, "model_config", None), "max_model_len", 0) or 0)
        step_blocks = _step_blocks(self._vllm_config, self.block_size)
        count = reserved_blocks(kv_bytes, num_blocks, kv_role, _cdiv(max_len, self.block_size),
                                self.config.staging_kv_share, step_blocks)
        if count <= 0:
            if kv_role != "kv_consumer":
                logger.warning("OrbitKV: a KV cache of %d blocks has none to spare beside a request of %d tokens: "
                               "no source staging", num_blocks, max_len)
            return
        try:
            taken = take_blocks(pool, count)
        except Exception as e:  # noqa: BLE001 - a vLLM whose pool works otherwise must still start
            logger.warning("OrbitKV: vLLM's block pool refused %d blocks for the source staging (%s): every layer "
                           "is written from the pages", count, e)
            return
        if not taken:
            logger.warning("OrbitKV: vLLM's block pool gave none of %d blocks for the source staging: every layer "
                           "is written from the pages", count)
            return
        self.staging_runs = runs(taken)
        self._pool = pool
        left = num_blocks - len(taken)
        if self._unclaimed_block_cap is not None:
            self._cap_unclaimed(left)
        steps = f"{len(taken) / step_blocks:.1f} steps of max_num_batched_tokens" if step_blocks else "steps unknown"
        logger.info("OrbitKV: %d of vLLM's %d KV cache blocks (%d MiB per rank) taken for the source staging "
                    "(orbitkv.pd.staging_memory kv_cache, staging_kv_share %g; %s); vLLM serves requests from the "
                    "other %d", len(taken), num_blocks, (kv_bytes // num_blocks * len(taken)) >> 20,
                    self.config.staging_kv_share, steps, left)
        # under staging_pieces write a piece is held only for its write, not
        # from the layer's launch: the steps say nothing of its room
        if step_blocks and len(taken) < 2 * step_blocks and self.config.staging_pieces != "write":
            # what bounds it: the share (a setting), or the cap / a request of max_model_len (not a setting)
            # the share binds where it is under the cap and nothing cut the count below it
            share_mb = int((kv_bytes >> 20) * self.config.staging_kv_share)
            per_block = _cdiv(kv_bytes, num_blocks)
            by_share = (share_mb <= auto_staging_cap_mb(kv_bytes, step_blocks * per_block)
                        and len(taken) >= (share_mb << 20) // per_block)
            fix = (f"raise orbitkv.pd.staging_kv_share (now {self.config.staging_kv_share:g}) or lower "
                   "max_num_batched_tokens" if by_share else
                   "lower max_num_batched_tokens (the region is at its cap: 1 GiB, or three steps up to a tenth "
                   "of the KV cache, and a request of max_model_len left to vLLM)")
            logger.warning("OrbitKV: the source staging holds %.1f steps of max_num_batched_tokens (%d tokens, %d "
                           "blocks a step); its pieces are held from a layer's launch to its write's end, about "
                           "%d steps under load, so some layers will find no room and go from the pages "
                           "(vllm:orbitkv_source_staging_full): %s", len(taken) / step_blocks,
                           step_blocks * self.block_size, step_blocks, AUTO_STAGING_STEPS, fix)

    def build_connector_meta(self, so: SchedulerOutput) -> PdConnectorMetadata:
        meta, self._next = self._next, PdConnectorMetadata()
        meta.staging_blocks = self.staging_runs
        meta.staging_released = self.staging_released
        if not self._pool_seen:
            self._pool_seen = True
            if self.config.staging_memory == "kv_cache":
                logger.warning("OrbitKV: this vLLM never handed the connector its block pool "
                               "(bind_gpu_block_pool): no source staging in its KV cache "
                               "(orbitkv.pd.staging_memory kv_cache), every layer is written from the pages")
        self._give_up_unclaimed(meta)
        for new in so.scheduled_new_reqs:
            if new.req_id in self._producers:
                self._chunk(meta, new.req_id, self._new_blocks(new.req_id, new.block_ids), new.num_computed_tokens, so)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid not in self._producers:
                continue
            if rid in cached.resumed_req_ids:
                # Preempted and resumed: its blocks were replaced. The stream
                # already sent cannot be trusted to continue; abort it.
                self._abort_producer(rid, "preempted on the prefill instance")
                continue
            nb = cached.new_block_ids[i]
            self._chunk(meta, rid, self._new_blocks(rid, nb), cached.num_computed_tokens[i], so)
        return meta

    def _new_blocks(self, rid: str, per_group: Any) -> list[int]:
        """A step's new blocks of producer ``rid`` as one table (groups.py);
        groups of uneven blocks abort it (the runtime could not plan them)."""
        if self.groups.count == 1:
            return list(per_group[0]) if per_group else []
        try:
            return self.groups.new_blocks(per_group)
        except GroupsError as e:
            self._abort_producer(rid, str(e))
            return []

    def _chunk(self, meta: PdConnectorMetadata, rid: str, new_blocks: list[int], computed: int, so: Any) -> None:
        p = self._producers.get(rid)
        if p is None or p.last_sent:
            return
        end_tok = min(computed + so.num_scheduled_tokens.get(rid, 0), p.prompt_len)
        end_block = _cdiv(end_tok, self.block_size)
        # The first chunk also carries blocks of a local prefix-cache hit.
        start_block = 0 if not p.opened else p.done_blocks
        # The last block of a chunk may be partial: send it again next chunk.
        last = end_tok >= p.prompt_len
        meta.producer_chunks.append(
            ProducerChunk(
                rid,
                p.pd_id,
                p.capability,
                p.consumer_tp,
                not p.opened,
                new_blocks,
                min(start_block, end_block),
                end_block,
                last,
                _cdiv(p.prompt_len, self.block_size),
            )
        )
        p.opened = True
        p.done_blocks = end_tok // self.block_size
        p.last_sent = last

    def _give_up_unclaimed(self, meta: PdConnectorMetadata) -> None:
        """Asks the workers to give up, oldest first, the finished producers
        that wait for a decode past ``orbitkv.pd.claim_timeout_s``, or beyond
        ``unclaimed_max_requests`` requests or ``unclaimed_kv_share`` of the
        KV cache together once they waited ``unclaimed_grace_s`` (a real
        decode's handshake may come some milliseconds after the prefill
        finished). Which of them a decode claimed only the workers know (a
        handshake came): those ignore the ask and drain as usual, so each
        producer is asked once. A stranger's unclaimed halves (the two-stage
        flow's prefill half sent without its decode half) so hold at most
        the cap beyond the grace, and only until the claim deadline: real
        requests keep the rest of the KV cache."""
        if not self._unclaimed:
            return
        now = self._clock()
        held = sum(b for _, b in self._unclaimed.values())
        cap = self._unclaimed_block_cap
        while self._unclaimed:
            rid, (at, blocks) = next(iter(self._unclaimed.items()))
            if now - at >= self.config.claim_timeout_s:
                why = f"no decode claimed it within orbitkv.pd.claim_timeout_s ({self.config.claim_timeout_s:g}s)"
            elif now - at < self.config.unclaimed_grace_s:
                break  # the oldest is within its grace: so are the others
            elif len(self._unclaimed) > self.config.unclaimed_max_requests:
                why = (
                    f"more than orbitkv.pd.unclaimed_max_requests ({self.config.unclaimed_max_requests}) "
                    "finished requests wait for a decode; the oldest is given up"
                )
            elif cap is not None and held > cap:
                why = (
                    f"finished requests waiting for a decode hold more than orbitkv.pd.unclaimed_kv_share "
                    f"({self.config.unclaimed_kv_share:g}) of the KV cache; the oldest is given up"
                )
            else:
                break
            del self._unclaimed[rid]
            self._claims.pop(rid, None)
            held -= blocks
            p = self._producers.get(rid)
            if p is not None:
                self.unclaimed_asked += 1
                meta.producers_unclaimed.append(ProducerUnclaimed(p.pd_id, why))

    def _abort_producer(self, rid: str, reason: str) -> None:
        p = self._producers.get(rid)
        if p is not None and p.opened:
            p.last_sent = True
            self._next.producers_end.append(RequestEnd(rid, p.pd_id, True, reason, report=False))

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """vLLM finished ``request`` (``block_ids``: its blocks, of one group
        or of each group: not read, the runtime holds its own copy)."""
        rid = request.request_id
        try:
            return self._finished(request, rid)
        finally:
            if rid not in self._delayed:
                self._forget(rid)

    def _finished(self, request: Request, rid: str) -> tuple[bool, dict[str, Any] | None]:
        status = str(getattr(request, "status", ""))
        aborted = "ABORTED" in status or "ERROR" in status
        if rid in self._producers:
            p = self._producers[rid]
            if not p.opened:
                # Never scheduled here (aborted while queued): its decode may
                # have authorized blocks already; tell it nothing will come.
                del self._producers[rid]
                self._next.producers_discard.append(ProducerDiscard(p.pd_id, p.capability, status))
                return False, None
            complete = p.last_sent and not aborted
            self._next.producers_end.append(RequestEnd(rid, p.pd_id, not complete, status, report=True))
            self._delayed.add(rid)
            if complete:
                # Its blocks now wait for decode (unless it claimed the
                # request already): bounded (_give_up_unclaimed).
                self._unclaimed[rid] = (self._clock(), _cdiv(p.prompt_len, self.block_size))
            params = self._params.get(rid)
            return True, (self._answer(p) if complete and params is not None and params.answer else None)
        if rid in self._consumers:
            c = self._consumers[rid]
            pending = next((o for o in self._next.consumers_open if o.req_id == rid), None)
            if pending is not None:
                # The worker never authorized it: nothing can be written. Tell
                # the producers, so they need not hold their blocks until the
                # handshake deadline.
                self._next.consumers_open.remove(pending)
                del self._consumers[rid]
                self._next.consumers_cancel.append(
                    ConsumerCancel(c.pd_id, pending.capability, pending.prefill_kv, pending.prefill_tp, status)
                )
                return False, None
            if c.loaded and c.failed:
                # The load failed and vLLM recomputed: a producer may never
                # have ended (the deadline), so its writes may still land;
                # the blocks wait for the runtime's word (every producer
                # ended, or the quarantine passed).
                self._next.consumers_end.append(RequestEnd(rid, c.pd_id, aborted, status, report=True, after_load=True))
                self._delayed.add(rid)
                return True, None
            if c.loaded:
                # Complete: every producer reported done.
                self._next.consumers_end.append(RequestEnd(rid, c.pd_id, aborted, status, report=False))
                del self._consumers[rid]
                return False, None
            self._next.consumers_end.append(RequestEnd(rid, c.pd_id, True, status, report=True))
            self._delayed.add(rid)
            return True, None
        params = self.params_of(request)
        if params is not None and params.role == CONSUMER and params.prefill_kv is not None:
            # Finished before any block was allocated for it (e.g. aborted
            # while queued): the producers must not wait for a handshake.
            self._next.consumers_cancel.append(
                ConsumerCancel(params.request, params.capability, params.prefill_kv, params.prefill_tp, status)
            )
        return False, None

    def _answer(self, p: _Producer) -> dict[str, Any]:
        """The decode half's ``kv_transfer_params`` for a two-stage prefill
        (vLLM returns them in this request's response, and the router hands
        them to decode verbatim): this request's identity and capability,
        rank 0's side channel and this instance's TP size; signed with the
        deployment key when one is set. The prefill holds the blocks (its
        producer waits for decode's handshake up to the handshake timeout)."""
        out: dict[str, Any] = {
            ROLE: CONSUMER,
            REQUEST: p.pd_id,
            CAPABILITY: p.capability,
            PREFILL_KV: self.config.advertised_side_channel(0),
            PREFILL_TP: self.tp_size,
        }
        if self.config.side_channel_key is not None:
            out[SIGNATURE] = sign(out, self.config.side_channel_key)
        # What routers and vLLM read of a prefill's answer.
        out[DO_REMOTE_PREFILL] = True
        out[DO_REMOTE_DECODE] = False
        return out

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        failed_blocks = getattr(out, "invalid_block_ids", None) or ()
        # vLLM >= 0.32 with several KV cache groups: failed loads by request.
        failed_reqs = getattr(out, "failed_recving", None) or ()
        for rid in list(out.finished_recving or ()):
            c = self._consumers.get(rid)
            if c is not None:
                first_report = not c.loaded
                if first_report:
                    c.failed = not c.blocks.isdisjoint(failed_blocks) or rid in failed_reqs
                c.loaded = True
                if first_report and c.failed and rid in self._delayed:
                    # vLLM ended the request (a client abort) before it saw
                    # this report of a failed load. vLLM frees a finished
                    # request's blocks on its report (right after this hook),
                    # but a producer that never ended may still write into
                    # them: withhold the report, and have the worker report
                    # again once the runtime released them.
                    assert out.finished_recving is not None
                    out.finished_recving.discard(rid)
                    self._next.consumers_end.append(
                        RequestEnd(rid, c.pd_id, True, "ended before its failed load was seen", report=True,
                                   after_load=True)
                    )
                    continue
            if rid in self._delayed:
                self._delayed.discard(rid)
                self._consumers.pop(rid, None)
                self._forget(rid)
        for rid in out.finished_sending or ():
            self._delayed.discard(rid)
            self._unclaimed.pop(rid, None)
            self._claims.pop(rid, None)
            self._producers.pop(rid, None)
            self._forget(rid)
        meta = getattr(out, "kv_connector_worker_meta", None)
        if meta is not None:
            self._draining = max(0, int(getattr(meta, "draining", 0)))
            self._count_claims(getattr(meta, "claimed", None) or {})

    def _count_claims(self, claimed: dict[str, int]) -> None:
        """Finished producers whose decode claimed them on every rank are no
        longer waiting for a decode: they leave the unclaimed caps' count
        (they write on and release as usual), so a request still waiting
        for its handshake is not given up because claimed ones whose writes
        queue fill the share."""
        for rid, n in claimed.items():
            if rid not in self._unclaimed:
                continue
            got = self._claims.get(rid, 0) + int(n)
            if got >= self.tp_size:
                del self._unclaimed[rid]
                self._claims.pop(rid, None)
            else:
                self._claims[rid] = got

    def has_pending_push_work(self) -> bool:
        return bool(
            self._delayed
            or self._next.consumers_open
            or self._next.consumers_cancel
            or self._next.producers_discard
            or self._next.producers_unclaimed
            or self._next.consumers_end
            or self._next.producers_end
            or any(p.opened for p in self._producers.values())
            or self._draining > 0
        )
