"""OpenAI-compatible P/D proxy in front of prefill and decode vLLM instances
(one or several of each: docs/configuration.md, "The proxy in front of
several instances").

    python -m orbitkv.proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

Each request is admitted to prefill **and** decode at once: the proxy gives it
a fresh identity, sends the prefill request (``max_tokens=1``, marked as the
producer) and the decode request (the client's request, marked as the
consumer with the same identity) concurrently, and relays the decode
response to the client as it arrives (SSE passed through for
``stream: true``). Decode allocates its pages and hands its endpoint to the
prefill while the prefill computes; there is no serial hand-off.

Failures: if the prefill answers with an error (or cannot be reached) before
the decode is done, the decode request is dropped (vLLM aborts it on
disconnect) and the client gets ``502``, or an SSE error event when the
stream has already started. If the decode fails, the prefill request is
dropped. A client that disconnects drops both, unless decode already
answered in full: the prefill's reply (which comes right after its last
layer, often a few ms after decode's answer) is then let land, so that the
prefill request is not aborted after the fact.

With a deployment key (``--side-channel-key-file``, else
``$ORBITKV_SIDE_CHANNEL_KEY``: the instances' key), each half's
``kv_transfer_params`` carry ``orbitkv_signature``, which the instances
require (docs/security.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import secrets
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from orbitkv import _native
from orbitkv.vllm.config import DEFAULT_SIDE_CHANNEL_PORT, KEY_ENV, read_side_channel_key
from orbitkv.vllm.params import CONSUMER, PRODUCER, SIGNATURE, PdParams, sign

__all__ = ["ProxyConfig", "decode_body", "main", "make_app", "prefill_body"]

_T = TypeVar("_T")

# The request field vLLM copies into the connector's view of a request.
KV_PARAMS_FIELD = "kv_transfer_params"
# vLLM uses this header as the base of its own request id (logs line up).
REQUEST_ID_HEADER = "X-Request-Id"
# OpenAI routes the proxy splits into prefill + decode.
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")

logger = logging.getLogger("orbitkv.proxy")

@dataclass(frozen=True)
class Prefill:
    """One prefill instance: its URL, its OrbitKV side channel (``host:port``
    of its TP rank 0, which decode contacts; rank ``r`` listens on ``port +
    r``) and its TP size as configured (``None``: learned from the side
    channels, see :func:`probe_prefill`)."""

    url: str
    kv: str
    tp: int | None = None


@dataclass(frozen=True)
class ProxyConfig:
    """Where the instances are. ``prefill``/``prefill_kv``/``prefill_tp`` and
    ``decode`` are the first of each side; ``more_prefills`` and
    ``more_decodes`` the others (every instance of a side is used in turn:
    least outstanding requests first, unhealthy ones left out). ``key``: the
    deployment key, which signs every ``kv_transfer_params`` (None: unsigned)."""

    prefill: str
    decode: str
    prefill_kv: str
    prefill_tp: int | None = None
    timeout_s: float | None = None
    decode_tp: int = 1
    more_prefills: tuple[Prefill, ...] = ()
    more_decodes: tuple[str, ...] = ()
    key: bytes | None = field(default=None, repr=False)

    @property
    def prefills(self) -> tuple[Prefill, ...]:
        return (Prefill(self.prefill, self.prefill_kv, self.prefill_tp), *self.more_prefills)

    @property
    def decodes(self) -> tuple[str, ...]:
        return (self.decode, *self.more_decodes)

    @staticmethod
    def make(
        prefill: str,
        decode: str,
        prefill_kv: str | None = None,
        prefill_tp: int | None = None,
        timeout_s: float | None = None,
        decode_tp: int = 1,
        more_prefills: Sequence[tuple[str, str | None]] = (),
        more_decodes: Sequence[str] = (),
        key: bytes | None = None,
    ) -> ProxyConfig:
        """``more_prefills``: (URL, side channel or None) of further prefill
        instances (same TP size); ``more_decodes``: further decode URLs."""

        def url_of(name: str, url: str) -> str:
            url = url.rstrip("/")
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"--{name} must be an http(s) URL, got {url!r}")
            return url

        def kv_of(url: str, kv: str | None) -> str:
            return kv or f"{urlsplit(url).hostname}:{DEFAULT_SIDE_CHANNEL_PORT}"

        prefill, decode = url_of("prefill", prefill), url_of("decode", decode)
        for name, tp in (("prefill-tp", prefill_tp), ("decode-tp", decode_tp)):
            if tp is not None and tp < 1:
                raise ValueError(f"--{name} must be at least 1, got {tp}")
        extra_p = tuple(Prefill(url_of("prefill", u), kv_of(u.rstrip("/"), k), prefill_tp) for u, k in more_prefills)
        extra_d = tuple(url_of("decode", u) for u in more_decodes)
        urls = [prefill, decode, *(p.url for p in extra_p), *extra_d]
        if len(set(urls)) != len(urls):
            raise ValueError(f"an instance is named twice: {urls}")
        return ProxyConfig(
            prefill, decode, kv_of(prefill, prefill_kv), prefill_tp, timeout_s, decode_tp, extra_p, extra_d, key
        )

    def params(
        self,
        role: str,
        request_id: str,
        capability: str,
        prefill: Prefill | None = None,
        prefill_tp: int | None = None,
    ) -> dict[str, Any]:
        """The ``kv_transfer_params`` for one side of one request. Both sides
        get the request's ``capability``, a fresh secret per request: prefill
        accepts the decode's handshake and cancel only with it. ``prefill``:
        the instance that runs the request's prefill (default: the first);
        ``prefill_tp``: its TP size as learned (default: as configured, else
        1; a wrong one makes the prefill refuse decode's handshake at once).
        With a key, they carry ``orbitkv_signature`` over all of them: an
        instance with the key accepts only such params, and a decode then
        trusts the side channel port the proxy learned."""
        if role == PRODUCER:
            out = PdParams(role=PRODUCER, request=request_id, capability=capability, decode_tp=self.decode_tp).to_dict()
        else:
            p = prefill or self.prefills[0]
            out = PdParams(
                role=CONSUMER,
                request=request_id,
                capability=capability,
                prefill_kv=p.kv,
                prefill_tp=prefill_tp or p.tp or 1,
            ).to_dict()
        if self.key is not None:
            out[SIGNATURE] = sign(out, self.key)
        return out


class Pool:
    """Every instance's outstanding requests and health: ``pick`` returns the
    healthy instance of a side with the fewest requests in flight (all of
    them, if none is healthy: a request then fails on its own rather than
    never being tried)."""

    def __init__(self, cfg: ProxyConfig):
        self.cfg = cfg
        self.outstanding: dict[str, int] = {u: 0 for u in (*(p.url for p in cfg.prefills), *cfg.decodes)}
        self.healthy: dict[str, bool] = {u: True for u in self.outstanding}
        # Each prefill's TP size as its side channels report it, and why an
        # instance was last found unhealthy (shown by /health).
        self.tp: dict[str, int] = {}
        self.why: dict[str, str] = {}

    def tp_of(self, p: Prefill) -> int | None:
        return self.tp.get(p.url, p.tp)

    def pick_prefill(self, exclude: frozenset[str] = frozenset()) -> Prefill:
        return min(self._eligible(list(self.cfg.prefills), lambda p: p.url, exclude), key=lambda p: self.outstanding[p.url])

    def pick_decode(self, exclude: frozenset[str] = frozenset()) -> str:
        return min(self._eligible(list(self.cfg.decodes), lambda u: u, exclude), key=lambda u: self.outstanding[u])

    def _eligible(self, items: list[_T], url: Callable[[_T], str], exclude: frozenset[str]) -> list[_T]:
        live = [i for i in items if url(i) not in exclude and self.healthy[url(i)]]
        return live or [i for i in items if url(i) not in exclude] or items

    def mark(self, url: str, healthy: bool, why: str = "") -> None:
        if self.healthy.get(url) != healthy or (not healthy and why and why != self.why.get(url)):
            if healthy:
                logger.warning("%s is now healthy", url)
            else:
                logger.warning("%s is now UNHEALTHY (left out)%s", url, f": {why}" if why else "")
        self.healthy[url] = healthy
        if healthy:
            self.why.pop(url, None)
        elif why:
            self.why[url] = why

    async def check(self, session: aiohttp.ClientSession, url: str) -> int | str:
        """Probes one instance (a prefill: its vLLM server and every rank's
        side channel) and records the outcome; returns the vLLM server's
        status (or the error's name)."""
        prefill = next((p for p in self.cfg.prefills if p.url == url), None)
        status = await _probe(session, url)
        if status != 200:
            self.mark(url, False, f"/health answered {status}")
            return status
        if prefill is not None:
            try:
                self.tp[url] = await probe_prefill(session, prefill)
            except PrefillMismatch as e:
                self.mark(url, False, str(e))
                return status
        self.mark(url, True)
        return status

    async def check_all(self, session: aiohttp.ClientSession) -> dict[str, int | str]:
        """:meth:`check` of every instance at once (a dead one costs its
        timeout once, not once per instance after it)."""
        urls = [*(p.url for p in self.cfg.prefills), *self.cfg.decodes]
        return dict(zip(urls, await asyncio.gather(*(self.check(session, u) for u in urls))))


_CONFIG = web.AppKey("orbitkv_proxy_config", ProxyConfig)
_SESSION = web.AppKey("orbitkv_proxy_session", aiohttp.ClientSession)
# Prefill calls left to finish after their client's answer was complete.
_BACKGROUND = web.AppKey("orbitkv_proxy_background", set)
_POOL = web.AppKey("orbitkv_proxy_pool", Pool)
# How often every instance's /health is checked (unhealthy ones are left out).
HEALTH_EVERY_S = 2.0


def prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The client's request as the prefill runs it: one token, no stream."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out[KV_PARAMS_FIELD] = params
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The client's request as the decode runs it: unchanged but for the params."""
    out = dict(body)
    out[KV_PARAMS_FIELD] = params
    return out


def _error_json(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "OrbitKVProxyError", "code": status}}, status=status
    )


class _Retry(Exception):
    """An instance could not be reached before anything was sent to the
    client: the request is tried once more on other instances."""

    def __init__(self, url: str, why: str):
        super().__init__(why)
        self.url = url


class _Exchange:
    """One client request: the prefill call and the relayed decode response."""

    def __init__(
        self,
        request: web.Request,
        session: aiohttp.ClientSession,
        cfg: ProxyConfig,
        background: set[asyncio.Task[Any]],
        pool: Pool | None = None,
    ):
        self.request = request
        self.session = session
        self.cfg = cfg
        self.background = background
        self.pool = pool or Pool(cfg)
        self.id = uuid.uuid4().hex
        # 256 bits from the OS's cryptographic source, never logged.
        self.capability = secrets.token_hex(32)
        self.response: web.StreamResponse | None = None
        self.stream = False
        self.prefill_at: Prefill = cfg.prefills[0]
        self.decode_at: str = cfg.decode
        # Seconds after arrival (time.monotonic() based): the prefill's
        # answer, decode's first byte, decode's end; logged once per request.
        self.t0 = time.monotonic()
        self.t_prefill: float | None = None
        self.t_first: float | None = None
        self.t_done: float | None = None
        self.status: int | str = "-"

    async def run(self) -> web.StreamResponse:
        try:
            body = await self.request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error_json(400, "request body is not JSON")
        if not isinstance(body, dict):
            return _error_json(400, "request body must be a JSON object")
        self.stream = bool(body.get("stream"))
        tried: set[str] = set()
        for attempt in range(2):
            self.prefill_at = self.pool.pick_prefill(frozenset(tried))
            self.decode_at = self.pool.pick_decode(frozenset(tried))
            try:
                return await self._attempt(self.request.path, body)
            except _Retry as r:
                self.pool.mark(r.url, False)
                tried.add(r.url)
                logger.warning("%s: %s unreachable (%s); %s", self.id, r.url, r,
                               "trying other instances" if attempt == 0 else "giving up")
                # A fresh identity: nothing of the first try may match it.
                self.id, self.capability = uuid.uuid4().hex, secrets.token_hex(32)
        return _error_json(502, f"no instance reachable (tried {sorted(tried)})")

    async def _attempt(self, path: str, body: dict[str, Any]) -> web.StreamResponse:
        prefill = asyncio.create_task(
            self._prefill(path, prefill_body(body, self.cfg.params(PRODUCER, self.id, self.capability))),
            name=f"orbitkv-prefill-{self.id}",
        )
        decode = asyncio.create_task(
            self._relay_decode(
                path,
                decode_body(
                    body,
                    self.cfg.params(
                        CONSUMER, self.id, self.capability, self.prefill_at, self.pool.tp_of(self.prefill_at)
                    ),
                ),
            ),
            name=f"orbitkv-decode-{self.id}",
        )
        self._count(prefill, self.prefill_at.url)
        self._count(decode, self.decode_at)
        try:
            await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            for task, url in ((prefill, self.prefill_at.url), (decode, self.decode_at)):
                if task.done() and not task.cancelled() and self.response is None:
                    # Refused, reset or dropped (the instance died under the
                    # request) before any byte reached the client: the
                    # request runs again elsewhere, under a fresh identity.
                    exc = task.exception()
                    if isinstance(exc, aiohttp.ClientConnectionError):
                        raise _Retry(url, str(exc) or type(exc).__name__)
            if not decode.done():
                failure = _failure(prefill)
                if failure is not None:
                    return await self._prefill_failed(decode, failure)
                # The prefill went fine: the decode finishes the request.
                await asyncio.wait({decode})
            if decode.exception() is not None:
                exc = decode.exception()
                if isinstance(exc, aiohttp.ClientConnectionError) and self.response is None:
                    raise _Retry(self.decode_at, str(exc) or type(exc).__name__)
                logger.warning("%s: decode failed: %s: %s", self.id, type(exc).__name__, exc)
                await _cancel(prefill)
                if self.response is None:
                    return _error_json(502, f"decode failed: {type(exc).__name__}: {exc}")
                return self.response  # the relay broke off mid-way; nothing more to send
            status = self.status = decode.result()
            if status != 200:
                await _cancel(prefill)  # decode refused it: the prefill is not needed
            elif not prefill.done():
                # Decode is done, so the KV has arrived and the prefill's reply
                # comes right after its last layer: let it land whatever the
                # client does now (a client that closes as soon as it has its
                # answer would otherwise abort a finished prefill request, and
                # prefill's counters would miss it). Bounded by the session's
                # timeout; logged when it ends.
                self.background.add(prefill)
                prefill.add_done_callback(self._prefill_landed(path))
            assert self.response is not None
            return self.response
        except _Retry:
            await _cancel(decode)
            await _cancel(prefill)
            raise
        finally:
            # Client gone (handler cancelled) or an error above: drop both calls,
            # which makes vLLM abort them; a prefill left to land is logged then.
            await _cancel(decode)
            if prefill not in self.background:
                self._log(path)
                await _cancel(prefill)

    def _prefill_landed(self, path: str) -> Callable[[asyncio.Task[Any]], None]:
        def done(task: asyncio.Task[Any]) -> None:
            self.background.discard(task)
            if not task.cancelled() and task.exception() is not None:
                logger.warning("%s: prefill failed after decode answered: %s", self.id, task.exception())
            self._log(path)

        return done

    def _log(self, path: str) -> None:
        """One line per request, whatever happened (a client that hangs up
        as soon as it has its answer cancels this handler): when the prefill
        answered, when decode's first byte and its end came, in seconds after
        arrival (``-``: never)."""

        def at(t: float | None) -> str:
            return "-" if t is None else f"{t - self.t0:.4f}"

        logger.info(
            "%s %s: decode=%s prefill_s=%s first_byte_s=%s done_s=%s prefill_at=%s decode_at=%s",
            self.id, path, self.status, at(self.t_prefill), at(self.t_first), at(self.t_done),
            self.prefill_at.url, self.decode_at,
        )

    def _headers(self) -> dict[str, str]:
        return {REQUEST_ID_HEADER: self.id}

    def _count(self, task: asyncio.Task[Any], url: str) -> None:
        """Counts ``task`` as in flight at ``url`` from now until it ends
        (cancelled before it ran included). Called right after the pick,
        before the handler yields: concurrent arrivals see it and spread."""
        self.pool.outstanding[url] += 1

        def done(_: asyncio.Task[Any]) -> None:
            self.pool.outstanding[url] -= 1

        task.add_done_callback(done)

    async def _prefill(self, path: str, body: dict[str, Any]) -> None:
        url = self.prefill_at.url
        async with self.session.post(url + path, json=body, headers=self._headers()) as r:
            text = await r.text()
            self.t_prefill = time.monotonic()
            if r.status != 200:
                raise _BackendError(f"prefill {url} answered {r.status}: {text[:500]}")

    async def _relay_decode(self, path: str, body: dict[str, Any]) -> int:
        return await self._relay(self.decode_at + path, body)

    async def _relay(self, target: str, body: dict[str, Any]) -> int:
        async with self.session.post(target, json=body, headers=self._headers()) as r:
            resp = web.StreamResponse(status=r.status)
            resp.content_type = r.content_type
            if r.charset:
                resp.charset = r.charset
            resp.headers[REQUEST_ID_HEADER] = self.id
            await resp.prepare(self.request)
            self.response = resp
            async for chunk in r.content.iter_any():
                if self.t_first is None:
                    self.t_first = time.monotonic()
                await resp.write(chunk)
            await resp.write_eof()
            self.t_done = time.monotonic()
            return r.status

    async def _prefill_failed(self, decode: asyncio.Task[Any], failure: str) -> web.StreamResponse:
        logger.warning("%s: %s; dropping the decode request", self.id, failure)
        await _cancel(decode)
        if self.response is None:
            return _error_json(502, f"prefill failed: {failure}")
        if self.stream:  # headers are out: report it the way vLLM reports stream errors
            with contextlib.suppress(ConnectionError, RuntimeError):
                message = f"prefill failed: {failure}"
                event = {"error": {"message": message, "type": "OrbitKVProxyError", "code": 502}}
                await self.response.write(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
                await self.response.write_eof()
        return self.response


class _BackendError(RuntimeError):
    pass


def _failure(task: asyncio.Task[Any]) -> str | None:
    """Why a finished prefill task failed, or None if it succeeded."""
    if task.cancelled():
        return "prefill request cancelled"
    exc = task.exception()
    if exc is None:
        return None
    if isinstance(exc, _BackendError):
        return str(exc)
    return f"prefill unreachable: {type(exc).__name__}: {exc}"


async def _cancel(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(BaseException):
        await task


async def _generate(request: web.Request) -> web.StreamResponse:
    app = request.app
    return await _Exchange(request, app[_SESSION], app[_CONFIG], app[_BACKGROUND], app[_POOL]).run()


async def _models(request: web.Request) -> web.Response:
    pool = request.app[_POOL]
    async with request.app[_SESSION].get(pool.pick_decode() + "/v1/models") as r:
        return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)


async def _probe(session: aiohttp.ClientSession, url: str) -> int | str:
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=HEALTH_EVERY_S)) as r:
            return r.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return type(e).__name__


class PrefillMismatch(RuntimeError):
    """A prefill's side channels disagree with the configuration (or with
    each other), or cannot be reached: decode could not hand it its pages."""


# The side channel's health route (written once, in the core: HEALTH_PATH).
SIDE_CHANNEL_HEALTH: str = _native.SIDE_CHANNEL_HEALTH_PATH


async def _side_channel_health(session: aiohttp.ClientSession, host: str, port: int) -> dict[str, Any]:
    url = f"http://{host}:{port}{SIDE_CHANNEL_HEALTH}"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=HEALTH_EVERY_S)) as r:
            if r.status != 200:
                raise PrefillMismatch(f"side channel {host}:{port} answered {r.status}")
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise PrefillMismatch(f"side channel {host}:{port} unreachable ({type(e).__name__})") from None
    try:
        got = json.loads(text)
    except ValueError:
        got = text
    # type() is int: JSON true/false would pass isinstance(..., int).
    if not (isinstance(got, dict) and type(got.get("tp_rank")) is int and type(got.get("tp_size")) is int):
        raise PrefillMismatch(f"side channel {host}:{port} is not an OrbitKV side channel (answered {got!r:.80})")
    return got


async def probe_prefill(session: aiohttp.ClientSession, p: Prefill) -> int:
    """The prefill's TP size, learned from its side channels: rank 0 at
    ``p.kv`` names the size ``N``, and ranks ``1..N-1`` must answer at the
    following ports with their own rank and the same size. Raises
    :class:`PrefillMismatch` with the reason when a rank is missing or
    answers otherwise, or when ``N`` differs from the configured size."""
    host, port_s = p.kv.rsplit(":", 1)
    port = int(port_s)
    first = await _side_channel_health(session, host, port)
    tp: int = first["tp_size"]
    if first["tp_rank"] != 0 or tp < 1:
        raise PrefillMismatch(
            f"side channel {p.kv} is rank {first['tp_rank']} of {tp}, not rank 0: --prefill-kv must name rank 0"
        )
    if p.tp is not None and p.tp != tp:
        raise PrefillMismatch(f"--prefill-tp is {p.tp} but the prefill at {p.kv} runs TP {tp}")
    ranks = await asyncio.gather(*(_side_channel_health(session, host, port + r) for r in range(1, tp)))
    for r, got in enumerate(ranks, start=1):
        if (got["tp_rank"], got["tp_size"]) != (r, tp):
            raise PrefillMismatch(
                f"side channel {host}:{port + r} is rank {got['tp_rank']} of {got['tp_size']}, "
                f"expected rank {r} of {tp}"
            )
    return tp


async def _health(request: web.Request) -> web.Response:
    """200 when at least one prefill and one decode instance is healthy;
    every instance's state, outstanding requests and role in the body."""
    cfg = request.app[_CONFIG]
    pool = request.app[_POOL]
    session = request.app[_SESSION]
    statuses = await pool.check_all(session)
    states: dict[str, Any] = {}
    for role, urls in (("prefill", [p.url for p in cfg.prefills]), ("decode", list(cfg.decodes))):
        for url in urls:
            status = statuses[url]
            states[url] = {"role": role, "health": status, "healthy": pool.healthy[url],
                           "outstanding": pool.outstanding[url]}
            if role == "prefill":
                states[url]["tp"] = pool.tp.get(url)
            if not pool.healthy[url]:
                states[url]["error"] = pool.why.get(url, "")
    ok = all(any(v["healthy"] for v in states.values() if v["role"] == role) for role in ("prefill", "decode"))
    if len(cfg.prefills) == 1 and len(cfg.decodes) == 1:  # the one-pair shape, as before
        states = {v["role"]: v["health"] if v["healthy"] else v.get("error", v["health"]) for v in states.values()}
    return web.json_response(states, status=200 if ok else 503)


async def _watch_health(app: web.Application) -> None:
    """Checks every instance every HEALTH_EVERY_S: unhealthy ones are left out
    of new requests until they answer /health again."""
    pool = app[_POOL]
    while True:
        # At once, then every HEALTH_EVERY_S: a prefill's TP size is known
        # before the first request when its side channels answer.
        await pool.check_all(app[_SESSION])
        await asyncio.sleep(HEALTH_EVERY_S)


def make_app(cfg: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application (run it with ``handler_cancellation=True``
    so a client that disconnects drops its backend requests)."""
    app = web.Application()
    app[_CONFIG] = cfg
    app[_BACKGROUND] = set()
    app[_POOL] = Pool(cfg)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        # No connection limit: every client request holds two backend calls.
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            app[_SESSION] = session
            watcher = asyncio.create_task(_watch_health(app))
            yield
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    app.cleanup_ctx.append(session_ctx)
    for path in GENERATE_PATHS:
        app.router.add_post(path, _generate)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    return app


async def _serve(cfg: ProxyConfig, host: str, port: int) -> None:
    runner = web.AppRunner(make_app(cfg), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    print(f"orbitkv.proxy: listening on http://{host}:{bound} "
          f"(prefill {', '.join(f'{p.url} [side channel {p.kv}]' for p in cfg.prefills)}; "
          f"decode {', '.join(cfg.decodes)}; kv_transfer_params {'signed' if cfg.key else 'unsigned'})", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orbitkv.proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", required=True, action="append",
                   help="base URL of a prefill vLLM server (repeat for several)")
    p.add_argument("--decode", required=True, action="append",
                   help="base URL of a decode vLLM server (repeat for several)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    p.add_argument("--prefill-kv", action="append", default=[],
                   help="a prefill's OrbitKV side channel host:port, in the order of --prefill "
                   f"(default: the prefill URL's host, port {DEFAULT_SIDE_CHANNEL_PORT})")
    p.add_argument("--prefill-tp", type=int, default=None,
                   help="prefill tensor-parallel size (default: learned from the prefill's side channels; "
                   "given, a prefill that runs another size is left out with the reason in /health)")
    p.add_argument("--decode-tp", type=int, default=1, help="decode tensor-parallel size")
    p.add_argument("--timeout-s", type=float, default=None, help="limit for one backend call")
    p.add_argument("--side-channel-key-file", default=None,
                   help="the deployment key (the instances' orbitkv.pd.side_channel_key_file): signs every "
                   f"request's kv_transfer_params (default: ${KEY_ENV}, else unsigned)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if len(args.prefill_kv) > len(args.prefill):
            raise ValueError("more --prefill-kv than --prefill")
        kvs = [*args.prefill_kv, *[None] * (len(args.prefill) - len(args.prefill_kv))]
        cfg = ProxyConfig.make(
            args.prefill[0], args.decode[0], kvs[0], args.prefill_tp, args.timeout_s, args.decode_tp,
            more_prefills=list(zip(args.prefill[1:], kvs[1:])), more_decodes=args.decode[1:],
            key=read_side_channel_key(args.side_channel_key_file),
        )
    except ValueError as e:
        p.error(str(e))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(cfg, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
