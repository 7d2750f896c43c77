"""The ``kv_transfer_params`` keys OrbitKV reads on a request.

The proxy (``python -m orbitkv.proxy``) sets them; anyone driving vLLM
directly can set them too, so every one of them is client input: parsed
strictly here, and a request whose OrbitKV keys are malformed is served as
a plain request (computed locally, nothing transferred) with a warning —
never an error inside vLLM's scheduler. Imports nothing from vLLM.

With a deployment key, the proxy signs them (``orbitkv_signature``,
:func:`sign`) and an instance accepts them only with a valid signature
(:func:`check_signature`): a client that reaches an engine's API directly
cannot make up its own.

Two other routers' dialects are served too: vLLM's two-stage fields
(``do_remote_decode`` alone, :func:`asks_two_stage`), and, when
``orbitkv.pd.dialects`` names it, the ``mooncake`` dialect of vllm-router's
and llm-d's ``--kv-connector mooncake`` (:class:`MooncakeParams`): both
halves derive one request identity and capability from the router's
``transfer_id`` (:func:`mooncake_identity`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

ROLE = "orbitkv_role"
REQUEST = "orbitkv_request"
CAPABILITY = "orbitkv_capability"
PREFILL_KV = "orbitkv_prefill_kv"
PREFILL_TP = "orbitkv_prefill_tp"
DECODE_TP = "orbitkv_decode_tp"
SIGNATURE = "orbitkv_signature"
KEYS = (ROLE, REQUEST, CAPABILITY, PREFILL_KV, PREFILL_TP, DECODE_TP, SIGNATURE)

PRODUCER = "producer"
CONSUMER = "consumer"

# vLLM's own P/D fields, as NixlConnector's routers send them (vllm-router's
# default `nixl` mode, vLLM's toy proxy, llm-d's `nixlv2`): the prefill half
# carries `do_remote_decode: true` and one output token; the decode half the
# `kv_transfer_params` the prefill's response carried.
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
# Fields of P/D dialects OrbitKV does not serve (vllm-router's and llm-d's
# `mooncake` modes, llm-d's `offloading`): a request that carries one asks
# for a transfer this connector cannot make.
FOREIGN_KEYS = ("transfer_id", "remote_bootstrap_addr", "remote_engine_id", "remote_prefiller", "remote_decoder")
# The `mooncake` dialect (vLLM's MooncakeConnector's fields, as vllm-router's
# and llm-d's `--kv-connector mooncake` send them): both halves carry the
# router's `transfer_id`; the decode half also names the prefill's Mooncake
# bootstrap server (`http://HOST:PORT`) and its engine ID (from `GET /query`).
TRANSFER_ID = "transfer_id"
REMOTE_BOOTSTRAP_ADDR = "remote_bootstrap_addr"
REMOTE_ENGINE_ID = "remote_engine_id"
# llm-d's `offloading` dialect: never the mooncake one.
OFFLOADING_KEYS = ("remote_prefiller", "remote_decoder")
MOONCAKE = "mooncake"
# The dialects `orbitkv.pd.dialects` may turn on.
DIALECTS = (MOONCAKE,)
MAX_TRANSFER_ID_LEN = 256
MAX_ENGINE_ID_LEN = 256

MAX_REQUEST_LEN = 256
MAX_TP = 1024
_CAPABILITY = re.compile(r"[0-9a-fA-F]{32,128}")
_REQUEST = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces
_HOST = re.compile(r"[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]")
_SIGNATURE = re.compile(r"[0-9a-f]{64}")
# Prefixed to the signed bytes: a signature over kv_transfer_params can never
# pass for one over a side channel body, signed with the same key.
_SIGNED_DOMAIN = b"orbitkv kv_transfer_params v1\n"
# A transfer_id: what vllm-router and llm-d mint ("xfer-" + a UUID) and
# other routers' UUIDs or base64 tokens; nothing that could split a log line.
_TRANSFER_ID = re.compile(r"[A-Za-z0-9._:+=@/-]+")
# remote_bootstrap_addr: exactly `http://host:port` (MooncakeConnector
# appends "/query"), IPv6 in brackets.
_BOOTSTRAP = re.compile(r"http://([A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):([0-9]{1,5})")
# What a mooncake-dialect request's identity and capability are derived
# under: two domains, so the request ID (in logs, traces and notices) tells
# nothing of the capability.
_MOONCAKE_ID_DOMAIN = b"orbitkv-mooncake-dialect id\0"
_MOONCAKE_CAPABILITY_DOMAIN = b"orbitkv-mooncake-dialect\0"


class RequestParamsError(ValueError):
    """A request's ``kv_transfer_params`` are malformed."""


def split_host_port(value: Any, what: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` for IPv6) into its parts, strictly."""
    if not isinstance(value, str) or ":" not in value:
        raise RequestParamsError(f"{what} must be 'host:port', got {preview(value)}")
    host, _, port_s = value.rpartition(":")
    # isdigit() passes digits int() refuses (superscripts), and int() refuses
    # strings of thousands of digits: both would escape as a plain ValueError.
    digits = port_s.isascii() and port_s.isdigit() and len(port_s) <= 5
    if not _HOST.fullmatch(host) or not digits or not 1 <= int(port_s) <= 65535:
        raise RequestParamsError(f"{what} must be 'host:port' with a port in 1..65535, got {preview(value)}")
    return host.strip("[]"), int(port_s)


@dataclass(frozen=True)
class PdParams:
    """OrbitKV's part of one request's ``kv_transfer_params``."""

    role: str
    request: str
    capability: str
    prefill_kv: str | None = None
    prefill_tp: int = 1
    decode_tp: int = 1
    # A two-stage prefill (vLLM's `do_remote_decode`, no OrbitKV keys): the
    # request ID and capability were minted here, and the response carries
    # the decode half's params (`PdScheduler.request_finished`).
    answer: bool = False
    # The dialect these params were derived from (MOONCAKE), None for
    # OrbitKV's own keys and the two-stage flow. Nothing in a dialect is
    # signed: decode then needs every prefill rank's port declared.
    dialect: str | None = None

    @property
    def prefill_host_port(self) -> tuple[str, int]:
        """The prefill's side channel (consumer requests only)."""
        assert self.prefill_kv is not None
        return split_host_port(self.prefill_kv, PREFILL_KV)

    @staticmethod
    def parse(params: Mapping[str, Any] | None) -> PdParams | None:
        """``None`` when the request is not an OrbitKV P/D request; raises
        :class:`RequestParamsError` when its OrbitKV keys are malformed."""
        if not params or not isinstance(params, Mapping) or ROLE not in params:
            return None
        unknown = sorted(k for k in params if isinstance(k, str) and k.startswith("orbitkv_") and k not in KEYS)
        if unknown:
            raise RequestParamsError(f"unknown OrbitKV key(s) {preview(unknown)}; known: {list(KEYS)}")
        role = params.get(ROLE)
        if role not in (PRODUCER, CONSUMER):
            raise RequestParamsError(f"{ROLE} must be {PRODUCER!r} or {CONSUMER!r}, got {preview(role)}")
        request = params.get(REQUEST)
        if not isinstance(request, str) or not _REQUEST.fullmatch(request) or len(request) > MAX_REQUEST_LEN:
            raise RequestParamsError(
                f"{REQUEST} must be 1..{MAX_REQUEST_LEN} printable ASCII characters without spaces, got {preview(request)}"
            )
        capability = params.get(CAPABILITY)
        if not isinstance(capability, str) or not _CAPABILITY.fullmatch(capability):
            raise RequestParamsError(
                f"{CAPABILITY} must be the request's secret, 32..128 hex digits (the router sets it)"
            )
        signature = params.get(SIGNATURE)
        if signature is not None and (not isinstance(signature, str) or not _SIGNATURE.fullmatch(signature)):
            raise RequestParamsError(f"{SIGNATURE} must be 64 lowercase hex digits (HMAC-SHA256)")
        prefill_kv = params.get(PREFILL_KV)
        tp, dtp = params.get(PREFILL_TP, 1), params.get(DECODE_TP, 1)
        if role == CONSUMER:
            _, port = split_host_port(prefill_kv, PREFILL_KV)
            _check_tp(PREFILL_TP, tp)
            if port + tp - 1 > 65535:
                raise RequestParamsError(f"{PREFILL_KV} port {port} + {PREFILL_TP} {tp} passes port 65535")
            dtp = 1
        else:
            prefill_kv, tp = None, 1
            _check_tp(DECODE_TP, dtp)
        return PdParams(
            role=role,
            request=request,
            capability=capability.lower(),
            prefill_kv=prefill_kv,
            prefill_tp=tp,
            decode_tp=dtp,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {ROLE: self.role, REQUEST: self.request, CAPABILITY: self.capability}
        if self.prefill_kv is not None:
            out[PREFILL_KV] = self.prefill_kv
            out[PREFILL_TP] = self.prefill_tp
        else:
            out[DECODE_TP] = self.decode_tp
        return out


def asks_two_stage(params: Mapping[str, Any] | None) -> bool:
    """Whether ``params`` are the prefill half of vLLM's two-stage P/D flow
    (``do_remote_decode: true``) without OrbitKV's own keys: OrbitKV serves
    it by minting the decode half's params (:attr:`PdParams.answer`)."""
    return (
        isinstance(params, Mapping)
        and ROLE not in params
        and params.get(DO_REMOTE_DECODE) is True
        and not any(params.get(k) not in (None, "") for k in FOREIGN_KEYS)
    )


def asks_mooncake(params: Mapping[str, Any] | None) -> bool:
    """Whether ``params`` ask for P/D in the ``mooncake`` dialect: a
    ``transfer_id`` (not null) beside ``do_remote_decode`` or
    ``do_remote_prefill`` set to anything but ``false``/null, without
    ``orbitkv_role`` (OrbitKV's own keys win) and without llm-d's offloading
    fields. Whether they are well formed is :meth:`MooncakeParams.parse`'s
    to say."""
    if not isinstance(params, Mapping) or ROLE in params or params.get(TRANSFER_ID) is None:
        return False
    if any(params.get(k) is not None for k in OFFLOADING_KEYS):
        return False
    flags = (params.get(DO_REMOTE_DECODE), params.get(DO_REMOTE_PREFILL))
    return any(v is not None and v is not False for v in flags)


def mooncake_identity(transfer_id: str, key: bytes | None) -> tuple[str, str]:
    """The OrbitKV request ID and capability of the mooncake-dialect request
    ``transfer_id``, the same on both halves: the request ID is
    ``"mc-"`` + 32 hex digits of SHA-256 over a domain and ``transfer_id``;
    the capability is hex HMAC-SHA256(deployment key,
    ``"orbitkv-mooncake-dialect\\0"`` + ``transfer_id``) with a key, and
    SHA-256 over the same bytes without one, which rests on
    ``transfer_id``'s secrecy alone (docs/security.md)."""
    t = transfer_id.encode()
    request = "mc-" + hashlib.sha256(_MOONCAKE_ID_DOMAIN + t).hexdigest()[:32]
    message = _MOONCAKE_CAPABILITY_DOMAIN + t
    capability = _hmac_hex(key, message) if key is not None else hashlib.sha256(message).hexdigest()
    return request, capability


@dataclass(frozen=True)
class MooncakeParams:
    """One half of a ``mooncake``-dialect request, as vllm-router's and
    llm-d's ``--kv-connector mooncake`` send it (vLLM's MooncakeConnector's
    fields): the prefill half ``{"do_remote_prefill": false,
    "do_remote_decode": true, "transfer_id": T}``, the decode half
    ``{"do_remote_prefill": true, "do_remote_decode": false, "transfer_id":
    T, "remote_bootstrap_addr": "http://HOST:PORT", "remote_engine_id": E}``.
    With OrbitKV the bootstrap address is the prefill rank 0's side channel."""

    role: str  # PRODUCER: the prefill half; CONSUMER: the decode half
    transfer_id: str
    # The decode half: rank 0's side channel, "host:port" ("[v6]:port").
    prefill_kv: str | None = None
    engine_id: str | None = None

    @staticmethod
    def parse(params: Mapping[str, Any]) -> MooncakeParams:
        """Raises :class:`RequestParamsError` naming the first field that is
        not as the dialect has it (booleans are booleans, ``transfer_id``
        1..256 characters of ``[A-Za-z0-9._:+=@/-]``, the bootstrap address
        exactly ``http://host:port``, the engine ID printable ASCII)."""
        mine = sorted(k for k in params if isinstance(k, str) and k.startswith("orbitkv_"))
        if mine:
            raise RequestParamsError(f"OrbitKV keys {preview(mine)} beside the mooncake dialect's transfer_id")
        for k in (DO_REMOTE_DECODE, DO_REMOTE_PREFILL):
            v = params.get(k)
            if v is not None and not isinstance(v, bool):
                raise RequestParamsError(f"mooncake dialect: {k} must be a boolean, got {preview(v)}")
        remote_decode = params.get(DO_REMOTE_DECODE) is True
        remote_prefill = params.get(DO_REMOTE_PREFILL) is True
        if remote_decode and remote_prefill:
            raise RequestParamsError(f"mooncake dialect: {DO_REMOTE_DECODE} and {DO_REMOTE_PREFILL} are both true")
        t = params.get(TRANSFER_ID)
        if not isinstance(t, str) or not _TRANSFER_ID.fullmatch(t) or len(t) > MAX_TRANSFER_ID_LEN:
            raise RequestParamsError(
                f"mooncake dialect: {TRANSFER_ID} must be 1..{MAX_TRANSFER_ID_LEN} characters of "
                f"[A-Za-z0-9._:+=@/-], got {preview(t)}"
            )
        addr, engine = params.get(REMOTE_BOOTSTRAP_ADDR), params.get(REMOTE_ENGINE_ID)
        if remote_decode:
            # The prefill half: the prefill contacts nobody; fields meant for
            # decode are ignored, but must not be junk.
            for k, v in ((REMOTE_BOOTSTRAP_ADDR, addr), (REMOTE_ENGINE_ID, engine)):
                if v is not None and (not isinstance(v, str) or len(v) > MAX_ENGINE_ID_LEN):
                    raise RequestParamsError(f"mooncake dialect: {k} must be a string or null, got {preview(v)}")
            return MooncakeParams(PRODUCER, t)
        m = _BOOTSTRAP.fullmatch(addr) if isinstance(addr, str) else None
        if m is None or not 1 <= int(m.group(2)) <= 65535:
            raise RequestParamsError(
                f"mooncake dialect: {REMOTE_BOOTSTRAP_ADDR} must be 'http://host:port' (the prefill's side "
                f"channel, rank 0), got {preview(addr)}"
            )
        if not isinstance(engine, str) or not _REQUEST.fullmatch(engine) or len(engine) > MAX_ENGINE_ID_LEN:
            raise RequestParamsError(
                f"mooncake dialect: {REMOTE_ENGINE_ID} must be 1..{MAX_ENGINE_ID_LEN} printable ASCII characters "
                f"without spaces, got {preview(engine)}"
            )
        return MooncakeParams(CONSUMER, t, f"{m.group(1)}:{int(m.group(2))}", engine)

    def to_pd(self, key: bytes | None, prefill_tp: int, decode_tp: int) -> PdParams:
        """OrbitKV's params for this half: the derived identity and
        capability (:func:`mooncake_identity`); a producer for decode ranks
        of TP ``decode_tp``, or a consumer of a prefill of TP ``prefill_tp``
        whose rank 0's side channel is the bootstrap address."""
        request, capability = mooncake_identity(self.transfer_id, key)
        if self.role == PRODUCER:
            _check_tp(DECODE_TP, decode_tp)
            return PdParams(PRODUCER, request, capability, decode_tp=decode_tp, dialect=MOONCAKE)
        assert self.prefill_kv is not None
        _check_tp(PREFILL_TP, prefill_tp)
        _, port = split_host_port(self.prefill_kv, REMOTE_BOOTSTRAP_ADDR)
        if port + prefill_tp - 1 > 65535:
            raise RequestParamsError(f"{REMOTE_BOOTSTRAP_ADDR} port {port} + prefill TP {prefill_tp} passes port 65535")
        return PdParams(
            CONSUMER, request, capability, prefill_kv=self.prefill_kv, prefill_tp=prefill_tp, dialect=MOONCAKE
        )


def preview(v: Any) -> str:
    """``repr(v)`` cut to 80 characters: a refusal's log line stays short
    whatever a client sent, and on one line (``repr`` escapes newlines and
    every other character that is not printable)."""
    if isinstance(v, str) and len(v) > 80:
        v = v[:80]  # repr of a huge string would copy it whole first
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


class RateLimitedLog:
    """Warnings caused by client input, rate-limited: a burst of ``burst``
    lines, then ``per_s`` a second (a token bucket); the rest are counted,
    and their number is told with the next line let through (``... (N more
    like it suppressed)``). A flood of refused requests costs the log a line
    a second, not a line each."""

    def __init__(
        self,
        logger: logging.Logger,
        per_s: float = 1.0,
        burst: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._logger = logger
        self._per_s = per_s
        self._burst = float(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()
        self.suppressed = 0

    def warning(self, fmt: str, *args: Any) -> bool:
        """Logs the line if the bucket has a token; whether it did."""
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._per_s)
        self._at = now
        if self._tokens < 1.0:
            self.suppressed += 1
            return False
        self._tokens -= 1.0
        if self.suppressed:
            fmt += " (%d more like it suppressed)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        self._logger.warning(fmt, *args)
        return True


def unserved_dialect(params: Mapping[str, Any] | None) -> str | None:
    """Why a request that asks for P/D in a dialect OrbitKV does not serve
    cannot be (``None``: it asks for nothing OrbitKV cannot do). It is then
    served plainly, logged and counted: never a silent recompute."""
    if not isinstance(params, Mapping) or ROLE in params:
        return None
    foreign = sorted(k for k in FOREIGN_KEYS if params.get(k) not in (None, ""))
    if foreign and (params.get(DO_REMOTE_DECODE) is True or params.get(DO_REMOTE_PREFILL) is True):
        return (
            f"kv_transfer_params ask for P/D in a dialect OrbitKV does not serve (fields {foreign}: "
            "a router's offloading mode, or its mooncake mode without a transfer_id); run the router in its nixl "
            "(two-stage) or mooncake mode, or orbitkv.proxy"
        )
    if params.get(DO_REMOTE_PREFILL) is True:
        return (
            "kv_transfer_params ask for the KV of a remote prefill (do_remote_prefill) without OrbitKV's keys: "
            "the prefill instance did not answer as an OrbitKV producer (is it running this connector?)"
        )
    return None


def signed_bytes(params: Mapping[str, Any]) -> bytes:
    """What :func:`sign` signs: a domain prefix, then the ``orbitkv_*`` keys
    present (but the signature) with their values, as compact JSON with
    sorted keys. Raises :class:`RequestParamsError` for values JSON cannot
    hold."""
    mine = {k: v for k, v in params.items() if isinstance(k, str) and k.startswith("orbitkv_") and k != SIGNATURE}
    try:
        body = json.dumps(mine, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError):
        raise RequestParamsError("OrbitKV params that cannot be signed (not JSON values)") from None
    return _SIGNED_DOMAIN + body.encode()


def _hmac_hex(key: bytes, message: bytes) -> str:
    """Hex HMAC-SHA256 of ``message`` under ``key``: the one way the
    deployment key signs or derives anything on this side."""
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(params: Mapping[str, Any], key: bytes) -> str:
    """``orbitkv_signature`` for ``params``: hex HMAC-SHA256 under the
    deployment key over :func:`signed_bytes`."""
    return _hmac_hex(key, signed_bytes(params))


def check_signature(params: Mapping[str, Any], key: bytes) -> None:
    """Raises :class:`RequestParamsError` unless ``params`` carry a valid
    ``orbitkv_signature`` under ``key`` (compared in constant time). The
    reason names neither the key nor the expected signature."""
    got = params.get(SIGNATURE)
    if got is None:
        raise RequestParamsError(
            f"unsigned: a deployment key is set, and OrbitKV params are accepted only with the proxy's {SIGNATURE}"
        )
    if not isinstance(got, str) or not hmac.compare_digest(got.encode(), sign(params, key).encode()):
        raise RequestParamsError(f"{SIGNATURE} does not match these params under the deployment key")


def _check_tp(key: str, tp: Any) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= MAX_TP:
        raise RequestParamsError(f"{key} must be an integer in 1..{MAX_TP}, got {preview(tp)}")
