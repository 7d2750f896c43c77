"""``kv_connector_extra_config`` keys of the PdConnector, their defaults and
their checks. The keys are the aliases of one pydantic model
(:class:`ExtraConfig`: strict types, unknown ``orbitkv.pd.*`` keys refused);
every bad value raises :class:`ConfigError` naming the key. Imports nothing
from vLLM (pydantic is one of vLLM's own dependencies).
``docs/configuration.md`` documents each key."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from orbitkv._native import RUNTIME_DEFAULTS as _RT
from orbitkv.vllm.params import DIALECTS

PREFIX = "orbitkv.pd."

# The deployment key, when it is not in a file (`side_channel_key_file`).
KEY_ENV = "ORBITKV_SIDE_CHANNEL_KEY"
MIN_KEY_BYTES = 16


# Where a prefill rank 0's side channel listens unless configured (rank r:
# this + r); the proxy assumes it for a prefill given without --prefill-kv.
DEFAULT_SIDE_CHANNEL_PORT = 17500
# Ports an `orbitkv.pd.allowed_prefill` range entry may span at most.
MAX_ALLOWED_SPAN = 1024


class Endpoints(NamedTuple):
    """One `orbitkv.pd.allowed_prefill` entry: side channels on ``host``
    with a port in ``lo..hi`` (inclusive); host ``"*"``: any side channel."""

    host: str
    lo: int
    hi: int


ANY = Endpoints("*", 1, 65535)
# Where decode may send handshakes when `orbitkv.pd.allowed_prefill` is
# unset: the loopback hosts, on the side channel ports of a prefill on the
# default base port with up to 8 TP ranks (the GPUs of one host: a loopback
# deployment on default ports works as is; any other prefill side channel,
# a larger TP included, must be declared). Anything listening on these
# ports of this host receives decode's handshakes; `orbitkv doctor` says so.
LOOPBACK = ("127.0.0.1", "localhost", "::1")
DEFAULT_PREFILL_TP_ALLOWED = 8
DEFAULT_ALLOWED_PREFILL = tuple(
    Endpoints(h, DEFAULT_SIDE_CHANNEL_PORT, DEFAULT_SIDE_CHANNEL_PORT + DEFAULT_PREFILL_TP_ALLOWED - 1)
    for h in LOOPBACK
)


# A prefill's requests that vLLM finished but no decode claimed yet (no
# handshake) hold their blocks at most this long, at most this share of the
# KV cache and this many requests together; beyond, the oldest are given up
# (docs/security.md: a stranger's unclaimed halves must not pin the prefill).
DEFAULT_CLAIM_TIMEOUT_S = 30.0
# The share and count caps give up only requests that have waited at least
# this long: a decode's handshake comes some milliseconds after the prefill
# finished even when nothing queues (it is sent when decode's scheduler took
# the request), and a short prompt can finish on the GPU before it. Without
# it, two long prompts finished back to back on a small KV cache gave up the
# first while its decode was on its way (one H100, 2026-12-05).
DEFAULT_UNCLAIMED_GRACE_S = 2.0
# orbitkv.pd.staging_mb "auto" (the default): a prefill rank gathers each
# chunk in decode's block order into a source staging of at most this many
# MiB, and at most AUTO_STAGING_KV_SHARE of its KV cache. A quarter, not
# the tenth it was up to 2026-12-06: on one H100 at 16 and 32 requests of
# 4.6k tokens in flight a tenth (two requests' KV) left 42-43 % of the
# layers without a piece, written from the pages in 6x more ranges, and the
# prefill's KV peaked at 75-94 %; a quarter left none without one and
# peaked at 56-57 % with the taken blocks (docs/qualification.md, run 44).
AUTO_STAGING_MAX_MB = 1024
AUTO_STAGING_KV_SHARE = 0.25
# A layer piece is taken when its layer's kernels are launched and given
# back when its write ended, so the region holds the pieces of every step
# the GPU has not finished writing: with vLLM's async scheduling about
# three steps of max_num_batched_tokens, every layer (on one H100, 8192
# tokens a step: 1.2 steps' room left 40 % of the layers without a piece,
# 3.0 steps none; 16 layers on one H200, 1.3 steps: 33-38 % without;
# docs/qualification.md, runs 40, 44, 45). A deep model's step outgrows
# AUTO_STAGING_MAX_MB (Llama-3-8B at 8192 tokens: 1 GiB a step), so where
# three steps are more, the region may grow to them, up to
# AUTO_STAGING_BUDGET_SHARE of the KV cache (issue 48's memory bound: 1 GiB
# or a tenth of the cache) and never beyond ``staging_kv_share``. Only the
# staging taken out of vLLM's KV cache grows so (the scheduler knows the
# step); ``staging_memory`` ``beside``, outside vLLM's budget, stays at
# most AUTO_STAGING_MAX_MB.
AUTO_STAGING_STEPS = 3
AUTO_STAGING_BUDGET_SHARE = 0.10


def auto_staging_cap_mb(kv_bytes: int, step_bytes: int | None = None) -> int:
    """The most MiB ``staging_mb`` ``auto`` takes whatever the share, on a
    rank whose KV cache holds ``kv_bytes`` and one step of
    ``max_num_batched_tokens`` of which (every layer) is ``step_bytes``
    (None: unknown): AUTO_STAGING_MAX_MB, or AUTO_STAGING_STEPS steps where
    those are more, up to AUTO_STAGING_BUDGET_SHARE of the cache."""
    if step_bytes is None or step_bytes <= 0:
        return AUTO_STAGING_MAX_MB
    steps_mb = (AUTO_STAGING_STEPS * step_bytes) >> 20
    return max(AUTO_STAGING_MAX_MB, min(steps_mb, int((kv_bytes >> 20) * AUTO_STAGING_BUDGET_SHARE)))


def auto_staging_mb(kv_bytes: int, kv_share: float = AUTO_STAGING_KV_SHARE, step_bytes: int | None = None) -> int:
    """MiB of source staging ``staging_mb`` ``auto`` gives a rank that may
    prefill: ``kv_share`` of its KV cache of ``kv_bytes``, at most
    ``auto_staging_cap_mb``."""
    return min(auto_staging_cap_mb(kv_bytes, step_bytes), int((kv_bytes >> 20) * kv_share))


def staging_parts(staging_mb: int | str, role: str, kv_bytes: int,
                  kv_share: float = AUTO_STAGING_KV_SHARE, step_bytes: int | None = None) -> tuple[int, int]:
    """MiB of staging for grants and for sources on a rank of ``role``
    (vLLM's ``kv_role``) whose KV cache holds ``kv_bytes``: ``auto``, a
    source staging of ``auto_staging_mb`` (``kv_share``:
    ``orbitkv.pd.staging_kv_share``, AUTO_STAGING_KV_SHARE by default) where
    the rank may prefill, no grants; a size, split by role (half each under
    ``kv_both``)."""
    if staging_mb == "auto":
        if role == "kv_consumer":
            return 0, 0
        return 0, auto_staging_mb(kv_bytes, kv_share, step_bytes)
    assert isinstance(staging_mb, int)
    mb = staging_mb
    return {"kv_producer": (0, mb), "kv_consumer": (mb, 0)}.get(role, (mb - mb // 2, mb // 2))
DEFAULT_UNCLAIMED_KV_SHARE = 0.25
DEFAULT_UNCLAIMED_MAX_REQUESTS = 64


class ConfigError(ValueError):
    """A ``kv_connector_extra_config`` value OrbitKV cannot use."""


# Value types (strict: no bool for a number, no string for an int, no int
# for a string).
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False, description="a positive, finite number of seconds")]
SecondsOrZero = Annotated[
    float, Field(ge=0, allow_inf_nan=False, description="a finite number of seconds, 0 or more")
]
Port = Annotated[int, Field(ge=1, le=65535, description="a TCP port in 1..65535")]
Positive = Annotated[int, Field(ge=1, description="a positive integer")]
Text = Annotated[str, Field(min_length=1)]


class ExtraConfig(BaseModel):
    """The ``orbitkv.pd.*`` keys of ``kv_connector_extra_config``, as given
    (each field's alias is its key; ``None``: not given, the default
    applies). :meth:`PdConfig.from_extra_config` turns it into a
    :class:`PdConfig`."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    bind_host: Text | None = Field(None, alias="orbitkv.pd.mooncake.bind_host", description="a host name or IP")
    rank_map: dict[int, list[str]] | None = Field(None, alias="orbitkv.pd.mooncake.rank_map")
    library: str | None = Field(None, alias="orbitkv.pd.mooncake.library", description="a path")
    side_channel_host: Text | None = Field(None, alias="orbitkv.pd.side_channel_host", description="a host")
    side_channel_port: Port = Field(DEFAULT_SIDE_CHANNEL_PORT, alias="orbitkv.pd.side_channel_port")
    decode_tp: Annotated[int, Field(ge=1, le=1024, description="an integer in 1..1024")] | None = Field(
        None, alias="orbitkv.pd.decode_tp"
    )
    prefill_tp: Annotated[int, Field(ge=1, le=1024, description="an integer in 1..1024")] | None = Field(
        None, alias="orbitkv.pd.prefill_tp"
    )
    dialects: tuple[str, ...] = Field((), alias="orbitkv.pd.dialects")
    # The runtime's settings default to the runtime's own defaults (Rust's
    # RuntimeConfig::default(), the one place they are written).
    timeout_s: Seconds = Field(float(_RT["consumer_timeout_s"]), alias="orbitkv.pd.timeout_s")
    handshake_timeout_s: Seconds = Field(float(_RT["handshake_timeout_s"]), alias="orbitkv.pd.handshake_timeout_s")
    write_timeout_s: Seconds = Field(float(_RT["write_timeout_s"]), alias="orbitkv.pd.write_timeout_s")
    quarantine_s: Seconds = Field(float(_RT["quarantine_s"]), alias="orbitkv.pd.quarantine_s")
    max_inflight_mb: Positive = Field(int(_RT["max_bytes_in_flight_per_peer"]) >> 20, alias="orbitkv.pd.max_inflight_mb")
    # None: the transport's default (8192 on Mooncake's intra-node NVLink
    # transport, 768 on TCP and RDMA), chosen by the runtime when it starts.
    max_inflight_ranges: Positive | None = Field(None, alias="orbitkv.pd.max_inflight_ranges")
    writer_lanes: Annotated[int, Field(ge=1, le=64, description="an integer in 1..64")] = Field(
        int(_RT["writer_lanes_per_peer"]), alias="orbitkv.pd.writer_lanes"
    )
    inline_submit_max_ranges: Annotated[int, Field(ge=0, description="an integer >= 0 (0: off)")] = Field(
        int(_RT["inline_submit_max_ranges"]), alias="orbitkv.pd.inline_submit_max_ranges"
    )
    mooncake_submit_wait: Literal["layer", "device"] = Field(
        "layer", alias="orbitkv.pd.mooncake_submit_wait", description="'layer' or 'device'"
    )
    gpu_wait: Literal["park", "block"] = Field(
        "park" if _RT["lanes_park_on_gpu"] else "block", alias="orbitkv.pd.gpu_wait", description="'park' or 'block'"
    )
    trace: str | None = Field(None, alias="orbitkv.pd.trace", description="a file path")
    staging_mb: int | Literal["auto"] = Field("auto", alias="orbitkv.pd.staging_mb")
    staging_min_ranges: Positive = Field(int(_RT["staging_min_ranges"]), alias="orbitkv.pd.staging_min_ranges")
    staging_memory: Literal["beside", "kv_cache"] = Field(
        "kv_cache", alias="orbitkv.pd.staging_memory", description="'beside' or 'kv_cache'"
    )
    staging_kv_share: Annotated[
        float, Field(gt=0, le=0.5, allow_inf_nan=False, description="a share of the KV cache in (0, 0.5]")
    ] = Field(AUTO_STAGING_KV_SHARE, alias="orbitkv.pd.staging_kv_share")
    staging_pieces: Literal["layer", "request", "write"] = Field(
        "write" if _RT["gather_in_writer"] else "request" if _RT["pieces_whole_requests"] else "layer",
        alias="orbitkv.pd.staging_pieces",
        description="'layer', 'request' or 'write'",
    )
    allowed_prefill: tuple[Endpoints, ...] = Field(DEFAULT_ALLOWED_PREFILL, alias="orbitkv.pd.allowed_prefill")
    side_channel_key_file: Text | None = Field(
        None, alias="orbitkv.pd.side_channel_key_file", description="a file path"
    )
    # Prefill: what may wait for a decode that has not claimed its request
    # (no handshake yet) once vLLM finished it here (docs/security.md).
    claim_timeout_s: Seconds = Field(DEFAULT_CLAIM_TIMEOUT_S, alias="orbitkv.pd.claim_timeout_s")
    unclaimed_grace_s: SecondsOrZero = Field(DEFAULT_UNCLAIMED_GRACE_S, alias="orbitkv.pd.unclaimed_grace_s")
    unclaimed_kv_share: Annotated[
        float, Field(gt=0, le=1, allow_inf_nan=False, description="a share of the KV cache in (0, 1]")
    ] = Field(DEFAULT_UNCLAIMED_KV_SHARE, alias="orbitkv.pd.unclaimed_kv_share")
    unclaimed_max_requests: Positive = Field(
        DEFAULT_UNCLAIMED_MAX_REQUESTS, alias="orbitkv.pd.unclaimed_max_requests"
    )
    # With a deployment key: answer an unsigned two-stage prefill half
    # (vLLM's do_remote_decode, as vllm-router sends it) with signed decode
    # params all the same (off: such a request is served plainly).
    two_stage_unsigned: bool = Field(False, alias="orbitkv.pd.two_stage_unsigned", description="true or false")

    @field_validator("staging_mb", mode="before")
    @classmethod
    def _staging_mb(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return v
        raise ValueError("must be a size in MiB (0: off) or 'auto'")

    @field_validator("bind_host", "side_channel_host", mode="after")
    @classmethod
    def _host(cls, v: str | None) -> str | None:
        if v is not None and any(c.isspace() for c in v):
            raise ValueError("must be a host name or IP")
        return v

    @field_validator("rank_map", mode="before")
    @classmethod
    def _rank_map(cls, v: Any) -> dict[int, list[str]] | None:
        """TP rank (an int, or its decimal string as JSON keys are) ->
        ``{'nic': NAME}`` or ``{'nic': [NAME, ...]}``."""
        if v is None:
            return None
        if not isinstance(v, Mapping):
            raise ValueError("must map TP rank -> {'nic': NAME}")
        out: dict[int, list[str]] = {}
        for rank, entry in v.items():
            try:
                r = int(rank)
            except (TypeError, ValueError):
                raise ValueError(f"rank {rank!r} is not an integer") from None
            if isinstance(rank, bool) or r < 0:
                raise ValueError(f"rank {rank!r} is not a TP rank")
            if not isinstance(entry, Mapping) or set(entry) - {"nic"}:
                raise ValueError(f"[{rank!r}] must be {{'nic': NAME}}, got {entry!r}")
            nic = entry.get("nic")
            nics = [nic] if isinstance(nic, str) else nic
            if not isinstance(nics, list) or not all(isinstance(n, str) and n for n in nics):
                raise ValueError(f"[{rank!r}].nic must be a NIC name, got {nic!r}")
            out[r] = nics
        return out

    @field_validator("dialects", mode="before")
    @classmethod
    def _dialects(cls, v: Any) -> tuple[str, ...]:
        """A list of the routers' P/D dialects to accept besides OrbitKV's
        own keys and vLLM's two-stage fields: ``["mooncake"]`` or ``[]``."""
        known = list(DIALECTS)
        if not isinstance(v, (list, tuple)) or not all(isinstance(d, str) for d in v):
            raise ValueError(f"must be a list of P/D dialects to accept (known: {known})")
        unknown = [d for d in v if d not in DIALECTS]
        if unknown:
            raise ValueError(f"unknown dialect(s) {unknown}; known: {known}")
        return tuple(dict.fromkeys(v))

    @field_validator("allowed_prefill", mode="before")
    @classmethod
    def _allowed(cls, v: Any) -> tuple[Endpoints, ...]:
        """``"*"``, or a list of ``"host:port"`` / ``"host:lo-hi"`` entries."""
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, (list, tuple)):
            raise ValueError("must be a list of 'host:port' or 'host:lo-hi' entries (or '*')")
        return tuple(_allow_entry(a) for a in v)

    @staticmethod
    def keys() -> set[str]:
        """Every key, as written in ``kv_connector_extra_config``."""
        return {f.alias for f in ExtraConfig.model_fields.values() if f.alias}


KEYS = ExtraConfig.keys()


def _config_error(e: ValidationError) -> ConfigError:
    """The first problem of ``e``, naming its key and the value given."""
    unknown = sorted(str(err["loc"][0]) for err in e.errors() if err["type"] == "extra_forbidden")
    if unknown:
        return ConfigError(f"unknown OrbitKV setting(s) {unknown}; known: {sorted(KEYS)}")
    err = e.errors()[0]
    key = str(err["loc"][0])
    described = {f.alias: f.description for f in ExtraConfig.model_fields.values()}
    if err["type"] == "value_error":  # one of the validators below said why
        what = err["msg"].removeprefix("Value error, ")
    elif described.get(key):
        what = f"must be {described[key]}"
    else:
        what = err["msg"]
    sep = " " if what.startswith("must") else ": "
    return ConfigError(f"{key}{sep}{what}, got {err['input']!r}")


@dataclass(frozen=True)
class PdConfig:
    """The connector's settings, validated (:meth:`from_extra_config`); the
    defaults are :class:`ExtraConfig`'s."""

    bind_host: str = "127.0.0.1"
    rank_nics: dict[int, list[str]] = field(default_factory=dict)
    library: str | None = None
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    # A two-stage or mooncake-dialect prefill's decode TP size (the router
    # names no decode before the prefill answered); None: this instance's
    # own TP size.
    decode_tp: int | None = None
    # A mooncake-dialect decode's prefill TP size (the dialect does not carry
    # it); None: this instance's own TP size.
    prefill_tp: int | None = None
    # The routers' P/D dialects accepted besides OrbitKV's keys and vLLM's
    # two-stage fields (params.DIALECTS); off by default.
    dialects: tuple[str, ...] = ()
    timeout_s: float = ExtraConfig.model_fields["timeout_s"].default
    handshake_timeout_s: float = ExtraConfig.model_fields["handshake_timeout_s"].default
    write_timeout_s: float = ExtraConfig.model_fields["write_timeout_s"].default
    quarantine_s: float = ExtraConfig.model_fields["quarantine_s"].default
    max_inflight_mb: int = ExtraConfig.model_fields["max_inflight_mb"].default
    # None: the transport's default, chosen by the runtime (Runtime.max_ranges_in_flight_per_peer)
    max_inflight_ranges: int | None = ExtraConfig.model_fields["max_inflight_ranges"].default
    writer_lanes: int = ExtraConfig.model_fields["writer_lanes"].default
    # A layer write of at most this many ranges, without a layer mark (CPU),
    # is submitted on the worker's thread when its writer is idle (0: never).
    inline_submit_max_ranges: int = ExtraConfig.model_fields["inline_submit_max_ranges"].default
    # On CUDA, what a Mooncake submit waits for before its copies: "layer",
    # only the layer's own event, which OrbitKV waited for already (Mooncake's
    # wait on the caller's default stream redirected); "device", as Mooncake
    # does it: also everything queued on the legacy default stream.
    mooncake_submit_wait: str = "layer"
    # On CUDA, what a writer lane does when the layer at the front of its
    # queue is not yet written by the GPU and nothing else can go: "park"
    # (keep taking writes; the mark watcher wakes it) or "block" (wait for
    # the layer on its thread, as before 2026-12-05; for A/B runs).
    gpu_wait: str = ExtraConfig.model_fields["gpu_wait"].default
    trace: str | None = None
    # Staging memory per rank, MiB, on the KV device (0: off; "auto": a
    # prefill rank's source staging of auto_staging_mb, a quarter of its
    # KV cache at most 1 GiB or three steps' KV, no grants;
    # docs/configuration.md).
    staging_mb: int | Literal["auto"] = "auto"
    staging_min_ranges: int = ExtraConfig.model_fields["staging_min_ranges"].default
    # Where the staging lives: in blocks taken out of vLLM's KV cache
    # ("kv_cache", the default for staging_mb "auto": kv_staging.py) or
    # "beside" it (memory of its own, outside gpu_memory_utilization; the
    # only place for a size set by hand).
    staging_memory: str = "kv_cache"
    # The share of its KV cache a prefill rank's staging_mb "auto" takes,
    # at most auto_staging_cap_mb.
    staging_kv_share: float = AUTO_STAGING_KV_SHARE
    # How staging_mb "auto"'s layer pieces are handed out when the region is
    # short: "layer" (a layer without room alone is written from the pages)
    # or "request" (a request a layer of which finds no room gives back the
    # pieces no write took and takes no more: the room goes to requests it
    # can stage whole, whose pages may go back before their writes); or
    # "write" (no piece at the layer's launch: a writer lane gathers a
    # computed layer's scattered pages into a piece only for its write).
    staging_pieces: str = ExtraConfig.model_fields["staging_pieces"].default
    # The side channels decode may post to; ANY ("*") allows every one
    # (trusts whoever reaches decode's API).
    allowed_prefill: tuple[Endpoints, ...] = DEFAULT_ALLOWED_PREFILL
    side_channel_key: bytes | None = field(default=None, repr=False)
    claim_timeout_s: float = DEFAULT_CLAIM_TIMEOUT_S
    unclaimed_grace_s: float = DEFAULT_UNCLAIMED_GRACE_S
    unclaimed_kv_share: float = DEFAULT_UNCLAIMED_KV_SHARE
    unclaimed_max_requests: int = DEFAULT_UNCLAIMED_MAX_REQUESTS
    two_stage_unsigned: bool = False

    def runtime_settings(self) -> dict[str, Any]:
        """The settings of this configuration the runtime takes
        (``orbitkv.Runtime(...)``'s keywords, ``RUNTIME_SETTINGS``), in its
        names and units; the worker adds the staging regions it allocated."""
        return {
            "consumer_timeout_s": self.timeout_s,
            "handshake_timeout_s": self.handshake_timeout_s,
            "write_timeout_s": self.write_timeout_s,
            "quarantine_s": self.quarantine_s,
            "max_bytes_in_flight_per_peer": self.max_inflight_mb << 20,
            "max_ranges_in_flight_per_peer": self.max_inflight_ranges,
            "writer_lanes_per_peer": self.writer_lanes,
            "inline_submit_max_ranges": self.inline_submit_max_ranges,
            "side_channel_key": self.side_channel_key,
            "publish_timeout_s": min(10.0, self.timeout_s),
            "staging_min_ranges": self.staging_min_ranges,
            "lanes_park_on_gpu": self.gpu_wait == "park",
            "pieces_whole_requests": self.staging_pieces == "request",
            "gather_in_writer": self.staging_pieces == "write",
        }

    def prefill_allowed(self, host: str, port: int, tp: int = 1) -> bool:
        """Whether decode may send a request's handshakes and cancels to the
        side channels of a prefill of TP ``tp`` whose rank 0 is ``host:port``
        (a client names them in ``kv_transfer_params``): every rank's port,
        ``port .. port + tp - 1``, must be declared for that host."""
        h = _norm_host(host)
        mine = [e for e in self.allowed_prefill if e.host in ("*", h)]
        return all(any(e.lo <= q <= e.hi for e in mine) for q in range(port, port + tp))

    def prefill_host_allowed(self, host: str) -> bool:
        """Whether some entry names ``host`` (or is ``"*"``): with a
        deployment key, the proxy's signed ``orbitkv_prefill_kv`` on such a
        host is accepted on any port (the proxy learned the ports from the
        prefill's side channels)."""
        h = _norm_host(host)
        return any(e.host in ("*", h) for e in self.allowed_prefill)

    def advertised_side_channel(self, rank: int = 0) -> str:
        """``host:port`` (``[v6]:port``) where peers reach rank ``rank``'s
        side channel: the side channel host, or the bind host when it
        listens on every address."""
        host = self.side_channel_host
        if host in ("0.0.0.0", "::", ""):
            host = self.bind_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.side_channel_port_for(rank)}"

    def nics_for(self, rank: int) -> list[str]:
        return list(self.rank_nics.get(rank, []))

    def side_channel_port_for(self, rank: int) -> int:
        return self.side_channel_port + rank

    @staticmethod
    def from_extra_config(extra: Mapping[str, Any] | None) -> PdConfig:
        """Validates the ``orbitkv.pd.*`` keys of ``extra`` (other keys belong
        to other connectors and are ignored)."""
        given = {k: v for k, v in (extra or {}).items() if isinstance(k, str) and k.startswith(PREFIX)}
        for key in ("orbitkv.pd.mooncake.bind_host", "orbitkv.pd.side_channel_host"):
            if key in given and given[key] is None:
                raise ConfigError(f"{key}: must be a host name or IP, got None")
        try:
            x = ExtraConfig.model_validate(given)
        except ValidationError as e:
            raise _config_error(e) from None
        staging_memory = x.staging_memory
        if "staging_memory" not in x.model_fields_set and x.staging_mb != "auto":
            staging_memory = "beside"  # a size set by hand is memory beside the KV cache
        if staging_memory == "kv_cache" and x.staging_mb != "auto":
            raise ConfigError(
                "orbitkv.pd.staging_memory: 'kv_cache' holds the layer pieces of orbitkv.pd.staging_mb 'auto'; "
                f"a size set by hand ({x.staging_mb} MiB) is memory beside the KV cache, got 'kv_cache'"
            )
        # settings of staging_mb "auto" alone, ignored beside a size set by hand
        for key, what in (("staging_kv_share", "sizes the staging"), ("staging_pieces", "hands out the layer pieces")):
            if key in x.model_fields_set and x.staging_mb != "auto":
                raise ConfigError(
                    f"orbitkv.pd.{key}: {what} of orbitkv.pd.staging_mb 'auto'; "
                    f"with a size set by hand ({x.staging_mb} MiB) it would be ignored"
                )
        bind_host = x.bind_host or os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
        return PdConfig(
            bind_host=bind_host,
            rank_nics=dict(x.rank_map or {}),
            library=x.library,
            side_channel_host=x.side_channel_host or bind_host,
            side_channel_port=x.side_channel_port,
            decode_tp=x.decode_tp,
            prefill_tp=x.prefill_tp,
            dialects=x.dialects,
            timeout_s=x.timeout_s,
            handshake_timeout_s=x.handshake_timeout_s,
            write_timeout_s=x.write_timeout_s,
            quarantine_s=x.quarantine_s,
            max_inflight_mb=x.max_inflight_mb,
            max_inflight_ranges=x.max_inflight_ranges,
            writer_lanes=x.writer_lanes,
            inline_submit_max_ranges=x.inline_submit_max_ranges,
            mooncake_submit_wait=x.mooncake_submit_wait,
            gpu_wait=x.gpu_wait,
            trace=x.trace,
            staging_mb=x.staging_mb,
            staging_min_ranges=x.staging_min_ranges,
            staging_memory=staging_memory,
            staging_kv_share=x.staging_kv_share,
            staging_pieces=x.staging_pieces,
            allowed_prefill=x.allowed_prefill,
            side_channel_key=read_side_channel_key(x.side_channel_key_file),
            claim_timeout_s=x.claim_timeout_s,
            unclaimed_grace_s=x.unclaimed_grace_s,
            unclaimed_kv_share=x.unclaimed_kv_share,
            unclaimed_max_requests=x.unclaimed_max_requests,
            two_stage_unsigned=x.two_stage_unsigned,
        )


_NAME = re.compile(r"[A-Za-z0-9.\-]+")  # a host name or IPv4 address
_V6 = re.compile(r"[0-9A-Fa-f:.]+")


def _norm_host(host: str) -> str:
    return host.strip("[]").lower()


def _allow_entry(a: Any) -> Endpoints:
    """``"*"``, ``"host:port"``, ``"host:lo-hi"``, ``"[v6]:port"`` or
    ``"[v6]:lo-hi"``. A host without a port (the old form) is refused: an
    entry names side channels, not every port of a host."""
    form = "entries are 'host:port' or 'host:lo-hi' ('[v6]:port' for IPv6; '*' allows any)"
    if not isinstance(a, str) or not a or any(c.isspace() for c in a):
        raise ValueError(f"{form}, not {a!r}")
    if a == "*":
        return ANY
    if a.startswith("["):
        host, bracket, rest = a[1:].partition("]")
        if not bracket or not _V6.fullmatch(host) or (rest and not rest.startswith(":")):
            raise ValueError(f"{form}, not {a!r}")
        ports = rest[1:] if rest else None
    elif a.count(":") > 1:
        raise ValueError(f"entry {a!r}: an IPv6 address takes brackets and a port, '[{a}]:17500'")
    else:
        host, colon, ports_s = a.partition(":")
        if not _NAME.fullmatch(host):
            raise ValueError(f"{form}, not {a!r}")
        ports = ports_s if colon else None
    if ports is None:
        raise ValueError(
            f"entry {a!r} names no port: name the prefill side channel's port or ports, '{a}:17500' or "
            f"'{a}:17500-17507' (a prefill of TP n listens on port .. port + n - 1)"
        )
    lo_s, dash, hi_s = ports.partition("-")
    if not dash:
        hi_s = lo_s
    digits = all(x.isascii() and x.isdigit() and len(x) <= 5 for x in (lo_s, hi_s))
    if not (digits and 1 <= int(lo_s) <= 65535 and 1 <= int(hi_s) <= 65535):
        raise ValueError(f"entry {a!r}: ports must be in 1..65535 ('host:port' or 'host:lo-hi')")
    lo, hi = int(lo_s), int(hi_s)
    if lo > hi:
        raise ValueError(f"entry {a!r}: the range's first port is above its last")
    if hi - lo + 1 > MAX_ALLOWED_SPAN:
        raise ValueError(f"entry {a!r}: a range spans at most {MAX_ALLOWED_SPAN} ports")
    return Endpoints(_norm_host(host), lo, hi)


def read_side_channel_key(path: str | None) -> bytes | None:
    """The deployment key: the file `side_channel_key_file` names, else the
    environment variable ORBITKV_SIDE_CHANNEL_KEY, else none (the proxy's
    ``--side-channel-key-file`` reads it the same way)."""
    if path is not None:
        try:
            with open(path, "rb") as f:
                key = f.read().strip()
        except OSError as e:
            raise ConfigError(f"orbitkv.pd.side_channel_key_file: cannot read {path!r}: {e}") from None
    else:
        key = os.environ.get(KEY_ENV, "").strip().encode()
        if not key:
            return None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"the side channel key must be at least {MIN_KEY_BYTES} bytes, got {len(key)}")
    return key
