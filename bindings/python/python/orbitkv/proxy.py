"""OpenAI-compatible P/D proxy in front of one prefill and one decode vLLM.

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
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from orbitkv.vllm.params import CONSUMER, PRODUCER, PdParams
from orbitkv.vllm.params import REQUEST as REQUEST_KEY
from orbitkv.vllm.params import ROLE as ROLE_KEY

__all__ = ["ProxyConfig", "make_app", "prefill_body", "decode_body", "main"]

# The request field vLLM copies into the connector's view of a request.
KV_PARAMS_FIELD = "kv_transfer_params"
# vLLM uses this header as the base of its own request id (logs line up).
REQUEST_ID_HEADER = "X-Request-Id"
# OpenAI routes the proxy splits into prefill + decode.
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
# PdConnector's default side channel port (orbitkv.pd.side_channel_port).
DEFAULT_SIDE_CHANNEL_PORT = 17500

logger = logging.getLogger("orbitkv.proxy")

@dataclass(frozen=True)
class ProxyConfig:
    """Where the two instances are. ``prefill_kv`` is the prefill's OrbitKV
    side channel (``host:port`` of its TP rank 0), which decode contacts."""

    prefill: str
    decode: str
    prefill_kv: str
    prefill_tp: int = 1
    timeout_s: float | None = None
    decode_tp: int = 1

    @staticmethod
    def make(
        prefill: str,
        decode: str,
        prefill_kv: str | None = None,
        prefill_tp: int = 1,
        timeout_s: float | None = None,
        decode_tp: int = 1,
    ) -> "ProxyConfig":
        prefill, decode = prefill.rstrip("/"), decode.rstrip("/")
        for name, url in (("prefill", prefill), ("decode", decode)):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"--{name} must be an http(s) URL, got {url!r}")
        if prefill_kv is None:
            prefill_kv = f"{urlsplit(prefill).hostname}:{DEFAULT_SIDE_CHANNEL_PORT}"
        for name, tp in (("prefill-tp", prefill_tp), ("decode-tp", decode_tp)):
            if tp < 1:
                raise ValueError(f"--{name} must be at least 1, got {tp}")
        return ProxyConfig(prefill, decode, prefill_kv, prefill_tp, timeout_s, decode_tp)

    def params(self, role: str, request_id: str, capability: str) -> dict[str, Any]:
        """The ``kv_transfer_params`` for one side of one request. Both sides
        get the request's ``capability``, a fresh secret per request: prefill
        accepts the decode's handshake and cancel only with it."""
        if role == PRODUCER:
            return PdParams(
                role=PRODUCER, request=request_id, capability=capability, decode_tp=self.decode_tp
            ).to_dict()
        return PdParams(
            role=CONSUMER,
            request=request_id,
            capability=capability,
            prefill_kv=self.prefill_kv,
            prefill_tp=self.prefill_tp,
        ).to_dict()


_CONFIG = web.AppKey("orbitkv_proxy_config", ProxyConfig)
_SESSION = web.AppKey("orbitkv_proxy_session", aiohttp.ClientSession)
# Prefill calls left to finish after their client's answer was complete.
_BACKGROUND = web.AppKey("orbitkv_proxy_background", set)


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


class _Exchange:
    """One client request: the prefill call and the relayed decode response."""

    def __init__(
        self, request: web.Request, session: aiohttp.ClientSession, cfg: ProxyConfig, background: set[asyncio.Task]
    ):
        self.request = request
        self.session = session
        self.cfg = cfg
        self.background = background
        self.id = uuid.uuid4().hex
        # 256 bits from the OS's cryptographic source, never logged.
        self.capability = secrets.token_hex(32)
        self.response: web.StreamResponse | None = None
        self.stream = False
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
        path = self.request.path
        prefill = asyncio.create_task(
            self._prefill(path, prefill_body(body, self.cfg.params(PRODUCER, self.id, self.capability))),
            name=f"orbitkv-prefill-{self.id}",
        )
        decode = asyncio.create_task(
            self._relay_decode(path, decode_body(body, self.cfg.params(CONSUMER, self.id, self.capability))),
            name=f"orbitkv-decode-{self.id}",
        )
        try:
            await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            if not decode.done():
                failure = _failure(prefill)
                if failure is not None:
                    return await self._prefill_failed(decode, failure)
                # The prefill went fine: the decode finishes the request.
                await asyncio.wait({decode})
            if decode.exception() is not None:
                exc = decode.exception()
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
        finally:
            # Client gone (handler cancelled) or an error above: drop both calls,
            # which makes vLLM abort them; a prefill left to land is logged then.
            await _cancel(decode)
            if prefill not in self.background:
                self._log(path)
                await _cancel(prefill)

    def _prefill_landed(self, path: str) -> "Callable[[asyncio.Task], None]":
        def done(task: asyncio.Task) -> None:
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
            "%s %s: decode=%s prefill_s=%s first_byte_s=%s done_s=%s",
            self.id, path, self.status, at(self.t_prefill), at(self.t_first), at(self.t_done),
        )

    def _headers(self) -> dict[str, str]:
        return {REQUEST_ID_HEADER: self.id}

    async def _prefill(self, path: str, body: dict[str, Any]) -> None:
        async with self.session.post(self.cfg.prefill + path, json=body, headers=self._headers()) as r:
            text = await r.text()
            self.t_prefill = time.monotonic()
            if r.status != 200:
                raise _BackendError(f"prefill answered {r.status}: {text[:500]}")

    async def _relay_decode(self, path: str, body: dict[str, Any]) -> int:
        async with self.session.post(self.cfg.decode + path, json=body, headers=self._headers()) as r:
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

    async def _prefill_failed(self, decode: asyncio.Task, failure: str) -> web.StreamResponse:
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


def _failure(task: asyncio.Task) -> str | None:
    """Why a finished prefill task failed, or None if it succeeded."""
    if task.cancelled():
        return "prefill request cancelled"
    exc = task.exception()
    if exc is None:
        return None
    if isinstance(exc, _BackendError):
        return str(exc)
    return f"prefill unreachable: {type(exc).__name__}: {exc}"


async def _cancel(task: asyncio.Task) -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(BaseException):
        await task


async def _generate(request: web.Request) -> web.StreamResponse:
    return await _Exchange(request, request.app[_SESSION], request.app[_CONFIG], request.app[_BACKGROUND]).run()


async def _models(request: web.Request) -> web.Response:
    cfg = request.app[_CONFIG]
    async with request.app[_SESSION].get(cfg.decode + "/v1/models") as r:
        return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)


async def _health(request: web.Request) -> web.Response:
    cfg = request.app[_CONFIG]
    session = request.app[_SESSION]
    states = {}
    for name, url in (("prefill", cfg.prefill), ("decode", cfg.decode)):
        try:
            async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                states[name] = r.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            states[name] = f"{type(e).__name__}"
    ok = all(v == 200 for v in states.values())
    return web.json_response(states, status=200 if ok else 503)


def make_app(cfg: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application (run it with ``handler_cancellation=True``
    so a client that disconnects drops its backend requests)."""
    app = web.Application()
    app[_CONFIG] = cfg
    app[_BACKGROUND] = set()

    async def session_ctx(app: web.Application):
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        # No connection limit: every client request holds two backend calls.
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            app[_SESSION] = session
            yield

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
          f"(prefill {cfg.prefill}, decode {cfg.decode}, prefill side channel {cfg.prefill_kv})", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orbitkv.proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", required=True, help="base URL of the prefill vLLM server")
    p.add_argument("--decode", required=True, help="base URL of the decode vLLM server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    p.add_argument("--prefill-kv", help="prefill's OrbitKV side channel host:port "
                   f"(default: the prefill URL's host, port {DEFAULT_SIDE_CHANNEL_PORT})")
    p.add_argument("--prefill-tp", type=int, default=1, help="prefill tensor-parallel size")
    p.add_argument("--decode-tp", type=int, default=1, help="decode tensor-parallel size")
    p.add_argument("--timeout-s", type=float, default=None, help="limit for one backend call")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = ProxyConfig.make(
            args.prefill, args.decode, args.prefill_kv, args.prefill_tp, args.timeout_s, args.decode_tp
        )
    except ValueError as e:
        p.error(str(e))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(cfg, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
