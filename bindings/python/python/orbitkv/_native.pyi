"""Native core of OrbitKV (Rust). Import from `orbitkv` rather than from here."""

import os
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Literal, TypeAlias, TypedDict, final

from typing_extensions import Self, Unpack

__all__ = [
    "DEFAULT_RANGES_IN_FLIGHT",
    "PINNED_MOONCAKE_VERSION",
    "RUNTIME_DEFAULTS",
    "RUNTIME_SETTINGS",
    "SIDE_CHANNEL_CANCEL_PATH",
    "SIDE_CHANNEL_DEFAULTS",
    "SIDE_CHANNEL_HANDSHAKE_PATH",
    "SIDE_CHANNEL_HEALTH_PATH",
    "SIDE_CHANNEL_SIGNATURE_HEADER",
    "STATS_FIELDS",
    "TIMING_NAMES",
    "Batch",
    "MooncakeTransferEngine",
    "Runtime",
    "RuntimeEvent",
    "SideChannel",
    "StagingArena",
    "_ClosesOnExit",
    "__version__",
    "cancel_message",
    "install_trace",
    "new_capability",
    "producer_ranks",
    "side_channel_post",
    "side_channel_sign",
]

__version__: str
"""Version of the `orbitkv` package (the Rust crate's version)."""

PINNED_MOONCAKE_VERSION: str
"""The Mooncake version whose C++ data layouts OrbitKV declares (`0.3.13.post1`)."""

STATS_FIELDS: tuple[str, ...]
"""The runtime's counters: the keys of `Runtime.stats()` (Rust's `StatsSnapshot`)."""

TIMING_NAMES: tuple[str, ...]
"""The request phases `Runtime.take_timings()` times (Rust's `Timing`)."""

RUNTIME_DEFAULTS: dict[str, float | int | bool]
"""The runtime's defaults (Rust's `RuntimeConfig::default()`), keyed by
`Runtime(...)`'s keyword names: the one place they are written."""

RUNTIME_SETTINGS: tuple[str, ...]
"""Every keyword setting `Runtime(...)` takes (Rust's `RuntimeSettings`)."""

DEFAULT_RANGES_IN_FLIGHT: dict[str, int]
"""The range cap (`max_ranges_in_flight_per_peer`) left out, by the
transport Mooncake installed (`Runtime.transport`): 8192 on `nvlink_intra`,
768 on `tcp`, `rdma` and `unknown`."""

SIDE_CHANNEL_HANDSHAKE_PATH: str
"""Where a side channel takes handshakes (`/orbitkv/v1/handshake`)."""
SIDE_CHANNEL_CANCEL_PATH: str
"""Where a side channel takes cancels and fences (`/orbitkv/v1/cancel`)."""
SIDE_CHANNEL_HEALTH_PATH: str
"""Where a side channel answers its health (`/orbitkv/v1/health`)."""
SIDE_CHANNEL_SIGNATURE_HEADER: str
"""The header that carries a POST's signature under the deployment key."""
SIDE_CHANNEL_DEFAULTS: dict[str, float | int]
"""The side channel's defaults (Rust's `SideChannelConfig::default()`),
keyed by `SideChannel(...)`'s keyword names (`max_body`, `read_timeout_s`,
`max_connections`)."""

# An int address, a torch tensor (duck-typed: data_ptr, numel, element_size,
# is_contiguous, device), or a writable C-contiguous buffer (numpy array,
# bytearray, mmap). numpy's stubs declare the buffer protocol only for
# Python >= 3.12, so this stays Any.
_Region: TypeAlias = Any

# The native base of the classes below that close on leaving a `with` block
# (src/context.rs).
class _ClosesOnExit:
    """A context manager over `close()`: `with x:` binds `x` itself; leaving
    the block closes it, and an exception raised inside propagates. A
    subclass has the `close()`."""

    def __enter__(self) -> Self:
        """Returns the object itself."""

    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> bool:
        """Closes the object; exceptions propagate."""

@final
class MooncakeTransferEngine(_ClosesOnExit):
    """A Mooncake Transfer Engine (P2P handshake, no metadata service).

    `MooncakeTransferEngine(bind_host="127.0.0.1", nics=None, library=None,
    allow_version=None)` loads Mooncake's `engine.so` (once per process) and
    starts an engine that listens on `bind_host`; `endpoint` is what peers
    address. `nics` restricts RDMA to those devices; empty or None lets Mooncake
    choose (TCP where there is no RDMA device; `MC_FORCE_TCP=1` forces TCP).
    `library` is `engine.so` or a folder holding it; None uses
    `ORBITKV_MOONCAKE_LIB` if set, else the installed `mooncake` package.
    `allow_version` accepts one Mooncake version besides the pinned one
    (default: `ORBITKV_MOONCAKE_ALLOW_VERSION`).

    Thread-safe. Blocking calls release the GIL. Use it as a context manager,
    or call `close()`, to unregister everything and free the engine.

    Raises `MooncakeLibraryError`, `MooncakeVersionError` or `EngineInitError`.
    """

    def __new__(
        cls,
        bind_host: str = "127.0.0.1",
        nics: list[str] | None = None,
        library: str | os.PathLike[str] | None = None,
        allow_version: str | None = None,
    ) -> Self: ...
    @property
    def endpoint(self) -> str:
        """The endpoint (`ip:port`) peers pass to `write` and `send_notification`."""

    @property
    def mooncake_version(self) -> str | None:
        """The version of the loaded Mooncake wheel, or None if its metadata was not found."""

    @property
    def transport(self) -> str:
        """The transport Mooncake installed, by its own rule: ``tcp``,
        ``rdma``, ``nvlink_intra`` or ``unknown`` (it sets the default range cap)."""
    @property
    def mooncake_library(self) -> str:
        """The path of the loaded Mooncake `engine.so`."""

    def redirect_submit_wait(self) -> int:
        """Takes Mooncake's submit-time wait on the caller's default stream off
        the writer threads (`orbitkv.pd.mooncake_submit_wait = "layer"`): its
        NVLink transport records an event on `cudaStreamPerThread` and waits
        for it before each batch, which under load waits for the forward
        queued ahead of it. Only safe when every write is ordered after its
        source by the caller, as the connector's per-layer events do.
        Process-wide and idempotent. Returns the number of `engine.so` import
        slots redirected (0: this Mooncake has no CUDA, nothing to do)."""

    @staticmethod
    def submit_wait_counts() -> tuple[int, int]:
        """`(redirected, passed)`: events Mooncake recorded since
        `redirect_submit_wait`, on the writer's idle stream and unchanged."""

    @property
    def closed(self) -> bool:
        """True once `close()` ran."""

    def register_memory(self, region: _Region, length: int | None = None, location: str = "") -> tuple[int, int]:
        """Registers memory so it can be a WRITE source here and a WRITE target
        for peers. Returns `(addr, length)` as registered.

        `region` is an int address (then `length` is required), a contiguous
        torch tensor (`data_ptr()`, `numel() * element_size()` bytes, location
        `cpu:0`/`cuda:N` from its device), or a writable C-contiguous buffer
        such as a numpy array. `length` registers only the first `length`
        bytes. `location` overrides the Mooncake location (`cpu:0`, `cuda:1`);
        empty lets it be derived or detected. Tensors and buffers are kept
        alive until `unregister_memory` or `close`; for an address the caller
        keeps the memory alive. Regions must not overlap.

        Raises `RegistrationError`, `InvalidArgumentError`, `TypeError`.
        """

    def unregister_memory(self, region: _Region) -> None:
        """Unregisters the region that starts at `region`'s address (an int
        address, or the tensor/buffer that was registered) and releases the
        object kept alive for it. Raises `RegistrationError` if nothing is
        registered there.
        """

    def is_registered(self, addr: int, length: int) -> bool:
        """True when `[addr, addr + length)` lies inside one registered region."""

    def write(self, peer: str, ranges: Iterable[tuple[int, int, int]], timeout_s: float = 30.0) -> int:
        """Writes `ranges` (`(src_addr, dst_addr, length)` tuples: local source,
        peer's virtual address) to `peer` and waits for the whole batch.
        Returns the bytes written. Every source must be registered here and
        every destination registered by the peer. Raises `TransferError` if the
        batch fails and `TransferTimeoutError` after `timeout_s` seconds (the
        batch is then left to Mooncake: keep its memory registered). The GIL is
        released while submitting and waiting.

        Also raises `BadEndpointError`, `UnregisteredMemoryError`,
        `InvalidArgumentError`.
        """

    def submit_write(self, peer: str, ranges: Iterable[tuple[int, int, int]]) -> Batch:
        """Submits `ranges` to `peer` without waiting; returns a `Batch` to poll
        or wait on. Same rules as `write`.
        """

    def send_notification(self, peer: str, name: str, message: bytes | bytearray | memoryview | str) -> None:
        """Sends a notification `(name, message)` to `peer`'s endpoint; the peer
        receives it from `take_notifications`. The message must be UTF-8 text
        (a `str` is encoded; bytes that are not UTF-8 raise `InvalidArgumentError`,
        since Mooncake would alter them in transit: encode binary payloads).

        Raises `BadEndpointError` or `NotificationError`.
        """

    def take_notifications(self) -> list[tuple[str, bytes]]:
        """Drains the notifications received since the last call, oldest first,
        as `(name, message)` pairs. Each notification is returned once.
        """

    def close(self) -> None:
        """Unregisters every region, frees the engine and releases the objects
        kept alive for registered regions. Waits for calls running in other
        threads to let go of the engine. Idempotent; any later call (also on
        its batches) raises `EngineClosedError`.
        """

@final
class Batch:
    """A submitted batch of WRITEs (from `MooncakeTransferEngine.submit_write`).

    `poll()` and `wait()` release the GIL. Once the batch is terminal its
    outcome is remembered: `poll()` keeps returning `"completed"` (or raising
    the same `TransferError`).
    """

    @property
    def peer(self) -> str:
        """The peer endpoint the batch writes to."""

    @property
    def tasks(self) -> int:
        """Number of ranges in the batch."""

    @property
    def nbytes(self) -> int:
        """Total bytes the batch writes."""

    def poll(self) -> Literal["in_flight", "completed"]:
        """Checks the batch once without waiting: `"in_flight"` or `"completed"`;
        raises `TransferError` if it failed.
        """

    def wait(self, timeout_s: float = 30.0) -> int:
        """Waits until the batch is terminal; returns the bytes written. Raises
        `TransferError` if it failed and `TransferTimeoutError` after
        `timeout_s` seconds (the batch stays pending: wait or poll again).
        """

@final
class RuntimeEvent:
    """Something the runtime reports: a decode request's KV arrived
    (`"consumer_completed"`) or will not (`"consumer_failed"`), no producer is
    waited for after a held failure (`"consumer_quiesced"`), its blocks are
    free of writers (`"consumer_released"`), or a prefill request's writes all
    drained (`"producer_released"`, with `outcome` `"done"`, `"failed"` or
    `"aborted"`)."""

    @property
    def kind(
        self,
    ) -> Literal["consumer_completed", "consumer_failed", "consumer_quiesced", "consumer_released", "producer_released"]:
        """`"consumer_completed"`, `"consumer_failed"`, `"consumer_quiesced"`,
        `"consumer_released"` or `"producer_released"`."""

    @property
    def request_id(self) -> str:
        """The P/D request ID."""

    @property
    def generation(self) -> int | None:
        """The consumer generation (consumer events only)."""

    @property
    def bytes(self) -> int | None:
        """Bytes that arrived (`consumer_completed` only)."""

    @property
    def outcome(self) -> Literal["done", "failed", "aborted"] | None:
        """`"done"`, `"failed"` or `"aborted"` (`producer_released` only)."""

    @property
    def held(self) -> bool | None:
        """`consumer_failed` only: at the deadline, with a producer that never
        ended; the blocks must not be reused before `consumer_quiesced` or
        `consumer_released`."""

    @property
    def reason(self) -> str | None:
        """Why (failures, aborts)."""

    @property
    def staged(self) -> tuple[int, int, list[tuple[int, int]], int] | None:
        """`consumer_completed` only, when producers wrote into the request's
        staging grant: `(grant address, authorized blocks, [(first unit, end
        unit), ...], group)`. The worker scatters those units of every
        authorized block from the grant (staged grouped by `group` units)
        into its pages before the KV is used."""

class _RuntimeSettings(TypedDict, total=False):
    """`Runtime(...)`'s keyword settings: the core's `RuntimeSettings`, by
    name (`RUNTIME_SETTINGS`); each optional, None or left out is the
    default (`RUNTIME_DEFAULTS`)."""

    consumer_timeout_s: float | None
    handshake_timeout_s: float | None
    write_timeout_s: float | None
    quarantine_s: float | None
    max_bytes_in_flight_per_peer: int | None
    max_ranges_in_flight_per_peer: int | None
    writer_lanes_per_peer: int | None
    notify_poll_ms: float | None
    max_parked: int | None
    max_parked_bytes: int | None
    max_parked_per_source: int | None
    max_parked_bytes_per_source: int | None
    side_channel_key: bytes | None
    publish_timeout_s: float | None
    staging_region: tuple[int, int] | None
    source_staging_region: tuple[int, int] | None
    source_staging_later: bool | None
    staging_min_ranges: int | None
    inline_submit_max_ranges: int | None
    peer_idle_reclaim_s: float | None
    # CUDA prefill: a writer lane with nothing to send parks on the earliest
    # layer mark of its queued writes (True) or waits for its front write's
    # mark on its thread (False).
    lanes_park_on_gpu: bool | None
    # Prefill, requests staged by layer: a request a layer of which finds no
    # room gives back the pieces no write took and takes no more (True), or
    # only that layer goes page to page (False).
    pieces_whole_requests: bool | None
    # Prefill, with a source staging region: a writer lane gathers a layer
    # write whose sources are scattered into one piece of the region once
    # the layer is computed, and writes the piece (from set_writer_gather on).
    gather_in_writer: bool | None

@final
class Runtime:
    """The request runtime of one rank: a request actor per P/D request and
    side, a layer writer per peer, a notification router (Rust, actix).

    Decode side: `consumer_open` -> publish the returned handshake ->
    `consumer_completed`/`consumer_failed` event -> `consumer_release` ->
    `consumer_released`. Prefill side: `producer_open`, `producer_handshake`
    (any order), `layer_ready` per computed layer, `producer_finish` or
    `producer_abort` -> `producer_released` once every write drained.
    Calls only send messages; `next_event` and `shutdown` release the GIL.
    """

    def __new__(cls, engine: MooncakeTransferEngine, layout_json: str, **settings: Unpack[_RuntimeSettings]) -> Self:
        """Each setting (:class:`_RuntimeSettings`, keywords) left out or None
        is the Rust `RuntimeConfig::default()`'s (`RUNTIME_DEFAULTS`);
        ``max_ranges_in_flight_per_peer`` left out is the transport's
        default (8192 on ``nvlink_intra``, 768 otherwise). A name the core
        does not know, or a value of the wrong kind or out of range, is an
        `InvalidArgumentError` naming the setting."""
    @property
    def endpoint(self) -> str:
        """This rank's Mooncake endpoint (`ip:port`)."""
    @property
    def transport(self) -> str:
        """The transport Mooncake installed, by its own rule: ``tcp``,
        ``rdma``, ``nvlink_intra`` or ``unknown``."""
    @property
    def max_ranges_in_flight_per_peer(self) -> int:
        """Ranges in flight per peer: the setting, else the transport's default."""

    def consumer_open(
        self,
        request_id: str,
        capability_hex: str,
        first_block: int,
        block_ids: list[int],
        producer_tp: int,
        publish_to: list[tuple[str, int]] | None = None,
        tokens: int = 0,
    ) -> str:
        """Decode side: authorizes `block_ids` for request blocks `first_block..`
        of `request_id`, expecting the producers of a prefill instance of TP
        size `producer_tp`. Returns the handshake (JSON); it carries
        `capability` (hex), the request's secret, and `notice_key` (hex),
        this authorization's: only holders of the key can make a notice the
        consumer believes, so the handshake goes only to the allowed prefill
        side channels and is never logged. With `publish_to`
        (`[(host:port, producer rank)]`) the runtime also sends it there
        from its own threads (signed with the runtime's `side_channel_key`),
        and fails a rank that refuses it at once. `tokens`: the request's
        tokens decode loads, counted from its start (its prompt length),
        which a prefill of another block size needs (0: not said; only an
        equal block size is served then)."""

    def consumer_send_cancel(self, request_id: str, capability_hex: str, reason: str, addrs: list[str]) -> None:
        """Decode side: sends the cancel of `request_id` (it gave the request up
        before authorizing anything) to the prefill side channels `addrs`,
        from the runtime's own threads."""

    def consumer_handshake_refused(self, request_id: str, generation: int, producer_rank: int, reason: str) -> None:
        """Decode side: producer rank `producer_rank` refused the handshake of
        `generation` (or could not be reached), so nothing from it can land;
        the consumer counts that rank as failed now rather than at its
        deadline. `StaleGenerationError`/`UnknownRequestError` otherwise."""

    def consumer_release(self, request_id: str) -> None:
        """Decode side: vLLM is done with the request; a `consumer_released`
        event follows once no producer can write into its blocks."""

    def producer_open(
        self,
        request_id: str,
        block_ids: list[int],
        capability_hex: str,
        consumer_tp: int = 1,
        *,
        staging_base: int | None = None,
        staging_blocks: int = 0,
        staging_group: int | None = None,
        stage_by_layer: bool = False,
    ) -> None:
        """Prefill side: opens the request with its source blocks (request
        order) for a decode instance of TP size `consumer_tp`; only
        handshakes and cancels carrying `capability` (hex) are accepted for it.

        With `staging_base` (an address inside the runtime's
        `source_staging_region`) the caller gathers each computed layer of
        request blocks `0..staging_blocks` there in the staged order
        (`staged_layout`) before it reports the layer ready, and keeps that
        memory for the request until its `producer_released` event; the
        runtime then writes from it into consumers' staging grants or
        pages. `staging_group`: the units per group of its staged order
        (default: `staging_group(consumer_tp)`, the one that lets it write
        a consumer of a larger TP size straight into its pages).

        With `stage_by_layer` (and no `staging_base`) the request is staged
        by layer and chunk: before gathering a layer of a chunk the caller
        asks `producer_stage_layer` for a piece of the source staging region
        (the runtime gives it and takes it back as soon as its writes ended),
        and a layer given no piece is written from the pages. Grouped by
        `staging_group` as above; never into a staging grant."""

    def producer_stage_layer(
        self, request_id: str, layer: int, start_block: int, end_block: int
    ) -> tuple[int, list[tuple[int, int]]] | None:
        """Prefill side: a piece of the source staging region for layer
        `layer` of request blocks `start_block..end_block` (this step's
        chunk) of a request opened with `stage_by_layer`, to gather that
        layer of the chunk into now, in the order `producer_gather_order`
        gave: `(address, planes)`, each plane's `(offset, unit bytes)` in
        the piece (`StagingCopier.gather_piece`'s `slots`). `None`: no room
        now (the layer is written from the pages). The runtime takes the
        piece back itself (when its writes ended, or at the release)."""

    def producer_give_back_pages(self, request_id: str) -> Literal["now", "before", "not_yet", "never"]:
        """Prefill side: whether vLLM may free the pages of `request_id`
        (opened with `stage_by_layer`, finished) now, before its writes
        ended: every layer of every chunk is in a layer piece or at decode
        already, and no write reads the pages. `"now"`: given up for good by
        this call (nothing reads them any more; each piece goes back once its
        writes ended); `"before"`: by an earlier call; `"not_yet"`: ask again
        later; `"never"`: only the release frees them (not staged by layer,
        or decode's authorization is written from the pages): do not ask again."""

    def add_source_staging(self, segments: list[tuple[int, int]]) -> tuple[int, int]:
        """Prefill, on a runtime started with `source_staging_later=True`:
        adds `segments` (`(address, bytes)` each: registered memory nothing
        else writes, such as the KV blocks the scheduler took out of vLLM's
        pool) to the source staging the layer pieces come from; a piece lies
        inside one segment. All or nothing (`InvalidArgumentError` for a
        segment empty, at 0, overflowing or overlapping). Returns the
        region's `(segments, bytes)`."""

    def set_writer_gather(self, copy: str) -> str:
        """Prefill, a runtime made with `gather_in_writer=True` and a source
        staging region: from now on the writer lanes gather scattered layer
        writes into pieces of the region, copying with `copy`: "cuda" on
        the GPU whose CUDA context is current on the calling thread, with
        OrbitKV's gather kernel on the SMs (the copy engines where it does
        not load), "cuda-copy-engines" there on the copy engines only,
        "host" with memcpy (a KV cache in host memory); "off" stops it (a
        region given back, no write in flight). Returns how it copies
        ("gather kernel", "cuMemcpyBatchAsync", "cuMemcpyAsync per range",
        "memcpy", "off"; with why, where the kernel did not load).
        `InvalidArgumentError` without the setting or for another word;
        `CudaError` without a CUDA driver or context."""
    def writer_gathers(self) -> bool:
        """Whether the writer lanes gather (`set_writer_gather` ran)."""
    def source_staging_in_use(self) -> tuple[int, int]:
        """`(bytes, pieces)` of the source staging region given out as layer
        pieces now (`(0, 0)` once every write from them ended)."""

    def staging_group(self, consumer_tp: int) -> int:
        """The units per group of the source staging a request for a decode of
        TP size `consumer_tp` gathers (`orbitkv.staging`'s `group`): the
        heads of one decode rank when that rank's blocks are whole groups of
        this rank's heads (written straight into its pages), else 1."""

    def staged_layout(self, capacity: int) -> dict[str, Any]:
        """Where each (layer, plane) of `capacity` request blocks lies in this
        rank's staged order: `{"units": units per block, "bytes": total,
        "slots": [[(offset, unit bytes) per plane] per layer]}`. Unit `u` of
        request block `i` of (layer, plane) is at `offset + ((u / G *
        capacity + i) * G + u % G) * unit_bytes`, `G` the order's group (1:
        `offset + (u * capacity + i) * unit_bytes`); the slots do not depend
        on `G` (`orbitkv.staging` gathers and scatters so)."""

    def staging_in_use(self) -> tuple[int, int]:
        """Decode side: `(bytes, grants)` of staging given out now (each grant
        goes back when its request's `consumer_released` comes)."""

    def producer_add_blocks(self, request_id: str, block_ids: list[int]) -> None:
        """Prefill side: appends source blocks (chunked prefill)."""

    def producer_gather_order(
        self, request_id: str, start_block: int, end_block: int, *, pin_first: bool = True, pin_last: bool = True
    ) -> list[int] | None:
        """Prefill side: the order in which to gather request blocks
        `start_block..end_block` (this step's chunk) into the request's
        source staging, asked once before its first layer is gathered:
        `order[k]` is the request block for slot `start_block + k`; `None`:
        the request's order. The writes of the chunk follow it. `pin_first`,
        `pin_last`: those blocks stay in their slots (a block the chunk may
        share with the one before or after it: set both unless the chunk is
        the request's first, resp. last); a request staged by layer pins
        nothing (each chunk has pieces of its own)."""

    def producer_handshake(self, handshake_json: str) -> None:
        """Prefill side: admits a consumer's handshake (JSON). Strict: a bad one
        raises `HandshakeError`/`GeometryError`, one without the request's
        capability `ForbiddenError`, one over the parking budget
        `OverloadedError`; none changes anything."""

    def layer_ready(self, request_id: str, layer: int, start: int, end: int) -> None:
        """Prefill side: `layer` is computed for request blocks `[start, end)`.
        Never waits for the transfer."""

    def layers_ready(self, layer: int, chunks: list[tuple[str, int, int]]) -> list[tuple[str, Exception]]:
        """Prefill side: `layer` is computed for each `(request_id, start, end)`,
        in one call into the runtime. Returns `(request_id, error)` for each
        request it could not admit (`UnknownRequestError`: released meanwhile);
        the others are admitted. Never waits for the transfer."""

    def layers_ready_after(self, stream: int, layer: int, chunks: list[tuple[str, int, int]]) -> None:
        """Prefill side, on a GPU: `layer` of each `(request_id, start, end)`
        was launched on CUDA stream `stream` by the calling thread. Records an
        event there and returns at once; the runtime's layer gate waits for it
        on its own thread (no GIL) and then admits the layer for each request,
        in call order. Raises `CudaError` when the CUDA driver cannot be used."""

    def producer_finish_after(self, request_id: str) -> None:
        """Prefill side, on a GPU: `producer_finish` once every layer handed to
        `layers_ready_after` before was admitted."""

    def producer_finish(self, request_id: str) -> None:
        """Prefill side: no more layers come; notify the consumer once drained."""

    def producer_abort(self, request_id: str, reason: str) -> None:
        """Prefill side: stop; writes in flight still drain, then the consumer is
        told the request was aborted."""

    def producer_release_unclaimed(self, request_id: str, reason: str) -> None:
        """Prefill side: give the request up if no consumer claimed it yet (no
        handshake came); a claimed one writes on. Its release is reported as
        usual (`producer_released`); counted in `producers_unclaimed_released`
        when it ends one."""

    def producer_claimed(self, request_id: str) -> bool:
        """Prefill side: whether a decode claimed the request on this rank
        (every producer of it here took a handshake). ``False`` once it
        released, or when it is unknown."""

    def producer_cancel(self, cancel_json: str) -> str | None:
        """Prefill side: the consumer gave the request up (no handshake will
        come, or it released an authorization); `cancel_json` is the wire
        message (`cancel_message`). An open producer is aborted; one not yet
        open is aborted as soon as it opens. Without the request's
        capability: `ForbiddenError`, and nothing changes. A cancel carrying
        a generation is a fence: returns what may still be written into it
        from this rank, `"fenced"`, `"notice_follows"` or `"held"`; else
        `None`."""

    def producer_discard(self, request_id: str, capability_hex: str, reason: str) -> None:
        """Prefill side: vLLM finished the request before it was ever scheduled
        here (aborted while queued). Its consumer is told `aborted` at once —
        for a handshake parked under `capability` or one arriving later — so
        decode frees its blocks now instead of at its deadline."""

    def poll_events(self) -> list[RuntimeEvent]:
        """Every event since the last call."""

    def next_event(self, timeout_s: float) -> RuntimeEvent | None:
        """Waits up to `timeout_s` for the next event (GIL released)."""

    def live_requests(self) -> tuple[int, int]:
        """`(consumers, producers)` with a live request actor (leak checks)."""

    def _stall_directory(self, for_s: float) -> None:
        """For tests, in the development build only (the binding's feature
        `testing`, which `scripts/setup.sh` turns on; no wheel has it): occupies the runtime's request directory for `for_s` seconds,
        from now, without waiting; calls made meanwhile wait for it, the GIL
        released."""

    def note_source_staging_full(self, requests: int) -> None:
        """Counts requests opened without a source staging because the
        staging region had no room for them (`source_staging_full`)."""

    def note_layers_saved_at_wait(self, layers: int) -> None:
        """Counts request-layers admitted at `wait_for_save` because vLLM
        skipped `save_kv_layer` for them (`layers_saved_at_wait`)."""

    def note_params_refused(self, requests: int) -> None:
        """Counts `requests` served plainly because their P/D parameters were
        refused (`params_refused`)."""

    def stats(self) -> dict[str, int]:
        """The runtime's counters."""

    def take_timings(self) -> dict[str, list[float]]:
        """The durations of request phases kept since the last call, in
        seconds, by name (``TIMING_NAMES``): taken, so the connector's stats
        report is their one reader."""

    def shutdown(self) -> None:
        """Stops the actors (writes in flight are abandoned). Idempotent."""

@final
class StagingArena:
    """Disjoint, 256-byte aligned pieces of `len` bytes at `base` (the core's
    allocator; the prefill worker's source staging)."""

    def __new__(cls, base: int, len: int) -> Self: ...
    def alloc(self, len: int) -> int | None:
        """The address of a free piece of at least `len` bytes, or `None` when
        no piece is that large."""

    def free(self, addr: int) -> None:
        """Gives piece `addr` back (`InvalidArgumentError` if it is not one in use)."""

    def in_use(self) -> tuple[int, int]:
        """`(bytes, pieces)` in use."""

    @property
    def region(self) -> tuple[int, int]:
        """`(base, len)` of the region."""

@final
class SideChannel(_ClosesOnExit):
    """The HTTP side channel of a prefill rank (Rust, actix-web): decode ranks
    POST their handshakes to `/orbitkv/v1/handshake` and cancels to
    `/orbitkv/v1/cancel`; `GET /orbitkv/v1/health` answers `{"ok": true}`.

    `SideChannel(runtime, host, port, *, key=None, read_timeout_s=10.0,
    max_connections=64, max_body=16 MiB, mooncake_bootstrap=None)` (a setting
    left out or None: `SIDE_CHANNEL_DEFAULTS`'s) listens at
    once (port 0 picks a free one; `address` tells) and serves `runtime`'s
    producer side on its own threads until `close()`; nothing touches Python
    while it serves. `mooncake_bootstrap=(engine_id, [rank 0's side channel
    "host:port", rank 1's, ...])` also answers `GET /query` as vLLM's
    `MooncakeBootstrapServer` does (`{"0": {"engine_id": E, "worker_addr":
    {"0": {"0": ADDR}, ...}}}`), for a router in its `mooncake` mode: a
    prefill's rank 0 with `orbitkv.pd.dialects` `["mooncake"]`. Without it
    `GET /query` is `404`.
    Replies: `200 {"ok": true}`, or `{"error": NAME, "message": TEXT}` with
    `400` (malformed, geometry), `401` (with `key`: a missing or wrong
    `X-OrbitKV-Signature`, checked before parsing), `403` (not the request's
    capability), `404`, `408` (not received within `read_timeout_s`), `413`
    (over `max_body`), `503` (a budget full, the runtime stopped, or more than
    `max_connections` connections: answered at once and closed). It holds
    the runtime weakly: after `runtime.shutdown()` POSTs get `503`.

    Raises `SideChannelError` (`kind` `"AddressInUse"` when the port is
    taken) or `InvalidArgumentError`.
    """

    def __new__(
        cls,
        runtime: Runtime,
        host: str,
        port: int,
        *,
        key: bytes | None = None,
        read_timeout_s: float | None = None,
        max_connections: int | None = None,
        max_body: int | None = None,
        mooncake_bootstrap: tuple[str, list[str]] | None = None,
    ) -> Self: ...
    @property
    def address(self) -> str:
        """The bound address, `host:port`."""

    @property
    def refused(self) -> dict[str, int]:
        """What was refused since the start, by cause: `signature` (401),
        `forbidden` (403), `malformed` (400), `busy` (503: a runtime budget
        full, the runtime stopped, or too many connections), `too_large`
        (413), `timed_out` (408), `shed` (closed unanswered: a connection
        with no complete request head, to serve a newcomer at
        `max_connections`)."""

    @property
    def connections(self) -> int:
        """Connections being served now."""

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""

    def close(self) -> None:
        """Stops listening, lets requests in progress finish (up to 1 s), then
        closes every connection; returns within about 3 s (GIL released).
        Idempotent."""

def install_trace(path: str | None = None, *, filter: str | None = None, max_events: int | None = None) -> str | None:
    """Installs, once per process, OrbitKV's global subscriber: its warnings on
    stderr (`ORBITKV_LOG` filters them) and, with `path`, a Chrome trace of
    the actors written there. Later calls, and runtimes started later, keep
    the first setting. Returns the trace path in effect, or None."""

def new_capability() -> str:
    """A fresh random capability (256 bits from the OS's cryptographic
    source) for one request, as a router hands it to both halves."""

def cancel_message(
    request_id: str,
    capability_hex: str,
    reason: str,
    generation: int | None = None,
    consumer_rank: int | None = None,
) -> str:
    """The cancel message (wire JSON) a consumer sends to a producer rank's
    side channel when it gives `request_id` up before authorizing anything,
    or, with `generation` and `consumer_rank`, the fence of an authorization
    it released."""

def side_channel_post(
    address: str, path: str, body: str, timeout_s: float, key: bytes | None = None
) -> tuple[int, str]:
    """One POST of `body` to a side channel at `address` (`host:port`) with
    the core's client (the one the decode side's publisher uses), signed
    with `key` when given, without the GIL: the status and the reply body.
    Raises `OSError` (`ConnectionRefusedError`, `TimeoutError`, ...) when
    nothing was answered."""

def side_channel_sign(key: bytes, body: bytes) -> str:
    """The signature header's value for `body` under the deployment key:
    `sha256=<hex HMAC-SHA256(key, body)>`."""

def producer_ranks(total_kv_heads: int, consumer_rank: int, consumer_tp: int, producer_tp: int) -> list[int]:
    """The prefill ranks (TP size `producer_tp`) that send to decode rank
    `consumer_rank` of TP size `consumer_tp`, for a model of `total_kv_heads`
    KV heads: for each head the decode rank holds, the lowest prefill rank
    holding it (vLLM replicates heads when there are fewer than ranks). The
    ranks decode sends its handshake to, and the producers it waits for."""
