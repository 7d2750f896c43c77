"""A small P/D proxy for vLLM's MooncakeConnector (vLLM 0.26.0).

    python mc_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
        --bootstrap http://127.0.0.1:8998 --prefill-engine-id big-mc-prefill --port 8000

Each request goes to both instances AT ONCE, with a fresh ``transfer_id``
minted here:

* prefill (``kv_role: kv_producer``): the client's request with
  ``max_tokens: 1``, no streaming, and
  ``kv_transfer_params = {"do_remote_decode": true, "transfer_id": T}``;
* decode (``kv_role: kv_consumer``): the client's request unchanged but for
  ``kv_transfer_params = {"do_remote_prefill": true, "transfer_id": T,
  "remote_engine_id": E, "remote_bootstrap_addr": B}``; decode asks the
  prefill's bootstrap server ``B`` (``GET B/query``) where the prefill's
  workers are, and pulls the KV once the prefill has it.

``E`` is the engine id the prefill registered with its bootstrap server: read
at start-up from ``GET B/query`` (``{"0": {"engine_id": ..., "worker_addr":
...}}``), else ``--prefill-engine-id`` (the ``engine_id`` of the prefill's
``kv_transfer_config``); ``GET /mc_info`` says which and from where.

The decode answer is relayed to the client as it arrives (SSE passed through
for ``stream: true``). If the prefill answers with an error before decode's
first byte, the decode request is dropped (vLLM aborts it) and the prefill's
error is returned. A client that goes away closes both upstream requests
(both instances abort theirs). One line per request, the same as
``orbitkv.proxy``'s and ``nixl_proxy.py``'s:
``decode=<status> prefill_s=… first_byte_s=… done_s=…``.

Used by ``benches/gpu/e2e/driver.py`` as the MooncakeConnector side of the
comparison. Standard library + aiohttp only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
import uuid

import aiohttp
from aiohttp import web

logger = logging.getLogger("mc_proxy")
_SESSION = web.AppKey("session", aiohttp.ClientSession)
_CFG = web.AppKey("cfg", dict)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "McProxyError", "code": status}}, status=status)


def prefill_body(body: dict, transfer_id: str) -> dict:
    p = dict(body)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    p.pop("stream_options", None)
    p["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
    return p


def decode_body(body: dict, transfer_id: str, engine_id: str, bootstrap: str) -> dict:
    d = dict(body)
    d["kv_transfer_params"] = {"do_remote_prefill": True, "transfer_id": transfer_id,
                               "remote_engine_id": engine_id, "remote_bootstrap_addr": bootstrap}
    return d


async def resolve_engine_id(session: aiohttp.ClientSession, bootstrap: str, fallback: str | None,
                            timeout_s: float) -> tuple[str | None, str]:
    """The prefill's engine id from its bootstrap server's ``/query``, else the fallback."""
    deadline = time.monotonic() + timeout_s
    last = "not asked"
    while True:
        try:
            async with session.get(bootstrap + "/query", timeout=aiohttp.ClientTimeout(total=2)) as r:
                raw = await r.read()
                if r.status == 200:
                    entries = json.loads(raw or b"{}")
                    if entries:
                        first = entries[sorted(entries)[0]]
                        return str(first["engine_id"]), f"bootstrap {bootstrap}/query: {json.dumps(entries)[:300]}"
                    last = "bootstrap /query answered no engine yet"
                else:
                    last = f"bootstrap /query answered {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
            last = f"bootstrap /query: {type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            return fallback, f"--prefill-engine-id (the prefill's kv_transfer_config.engine_id); {last}"
        await asyncio.sleep(0.25)


async def generate(request: web.Request) -> web.StreamResponse:
    cfg, session = request.app[_CFG], request.app[_SESSION]
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "request body is not JSON")
    if not cfg.get("engine_id"):
        return _error(503, "the prefill's engine id is unknown (no bootstrap answer, no --prefill-engine-id)")
    rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    tid = uuid.uuid4().hex
    headers = {"X-Request-Id": rid}
    t0 = time.monotonic()
    t_prefill: float | None = None
    t_first: float | None = None

    async def prefill() -> tuple[int, bytes]:
        nonlocal t_prefill
        try:
            async with session.post(cfg["prefill"] + request.path, json=prefill_body(body, tid), headers=headers) as r:
                raw = await r.read()
                t_prefill = time.monotonic()
                return r.status, raw
        except aiohttp.ClientError as e:
            t_prefill = time.monotonic()
            return 502, json.dumps({"error": {"message": f"prefill: {type(e).__name__}: {e}"}}).encode()

    ptask = asyncio.ensure_future(prefill())
    dbody = decode_body(body, tid, cfg["engine_id"], cfg["bootstrap"])
    resp: web.StreamResponse | None = None
    status = "-"
    finished = False
    try:
        async with session.post(cfg["decode"] + request.path, json=dbody, headers=headers) as r:
            status = str(r.status)
            if not body.get("stream"):
                raw = await r.read()
                t_first = time.monotonic()
                pst, praw = await ptask
                if r.status == 200 and pst != 200:
                    logger.warning("%s: prefill answered %s while decode answered 200", rid, pst)
                finished = True
                return web.Response(status=r.status, body=raw, content_type="application/json")
            it = r.content.iter_any()
            first = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({first, ptask}, return_when=asyncio.FIRST_COMPLETED)
            if first not in done and ptask in done and ptask.result()[0] != 200:
                first.cancel()
                pst, praw = ptask.result()
                status = f"dropped-after-prefill-{pst}"
                return web.Response(status=pst, body=praw, content_type="application/json")
            try:
                chunk = await first
            except StopAsyncIteration:
                chunk = b""
            t_first = time.monotonic()
            resp = web.StreamResponse(status=r.status)
            resp.content_type = r.headers.get("Content-Type", "text/event-stream").split(";")[0]
            await resp.prepare(request)
            if chunk:
                await resp.write(chunk)
            async for chunk in it:
                await resp.write(chunk)
            await resp.write_eof()
            finished = True
            return resp
    except aiohttp.ClientError as e:
        status = "502"
        return _error(502, f"decode: {type(e).__name__}: {e}")
    finally:
        if not ptask.done():
            if finished:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(ptask), 30)
            else:
                # the client or decode went away before the prefill answered:
                # drop the prefill request too (vLLM aborts it)
                ptask.cancel()
                status = status if status != "200" else "client-gone"
        logger.info("%s %s: decode=%s prefill_s=%s first_byte_s=%s done_s=%.4f", rid, request.path, status,
                    "-" if t_prefill is None else f"{t_prefill - t0:.4f}",
                    "-" if t_first is None else f"{t_first - t0:.4f}", time.monotonic() - t0)


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def info(request: web.Request) -> web.Response:
    cfg = request.app[_CFG]
    return web.json_response({k: cfg.get(k) for k in ("prefill", "decode", "bootstrap", "engine_id", "engine_id_source")})


async def models(request: web.Request) -> web.Response:
    cfg, session = request.app[_CFG], request.app[_SESSION]
    async with session.get(cfg["decode"] + "/v1/models") as r:
        return web.Response(status=r.status, body=await r.read(), content_type="application/json")


async def _serve(a: argparse.Namespace) -> None:
    app = web.Application(client_max_size=64 << 20)
    cfg = {"prefill": a.prefill.rstrip("/"), "decode": a.decode.rstrip("/"), "bootstrap": a.bootstrap.rstrip("/")}
    app[_CFG] = cfg
    session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0, force_close=False)
    )
    app[_SESSION] = session
    cfg["engine_id"], cfg["engine_id_source"] = await resolve_engine_id(
        session, cfg["bootstrap"], a.prefill_engine_id, a.query_timeout_s)
    logger.info("prefill engine id %r from %s", cfg["engine_id"], cfg["engine_id_source"])
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/mc_info", info)
    app.router.add_get("/v1/models", models)
    # a client that goes away cancels its handler (and so both upstream requests)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, a.host, a.port).start()
    logger.info("MooncakeConnector proxy on http://%s:%d: prefill %s, decode %s, bootstrap %s", a.host, a.port,
                cfg["prefill"], cfg["decode"], cfg["bootstrap"])
    try:
        await asyncio.Event().wait()
    finally:
        await session.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True)
    p.add_argument("--bootstrap", required=True, help="the prefill's bootstrap server, http://host:port "
                   "(VLLM_MOONCAKE_BOOTSTRAP_PORT of the prefill)")
    p.add_argument("--prefill-engine-id", default=None,
                   help="used if the bootstrap server does not answer (the prefill's kv_transfer_config.engine_id)")
    p.add_argument("--query-timeout-s", type=float, default=15.0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_serve(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
