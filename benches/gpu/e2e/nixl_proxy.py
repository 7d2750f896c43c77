"""A small P/D proxy for vLLM's NixlConnector (the flow of vLLM's own
``toy_proxy_server.py`` example, which the vLLM wheel does not ship).

    python nixl_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each request runs in two steps, one after the other: the prefill instance gets
the request with ``max_tokens=1``, no streaming, and
``kv_transfer_params = {"do_remote_decode": true, ...}``; its answer carries
``kv_transfer_params`` (the prefill's engine, block ids, side channel), which
go with the client's unchanged request to the decode instance, which pulls the
KV over NIXL and generates. The decode answer is relayed to the client as it
arrives (SSE passed through for ``stream: true``).

Used by ``benches/gpu/e2e/driver.py`` as the NIXL side of the comparison with
``orbitkv.proxy`` (which, unlike this, admits each request to prefill and
decode at once). Standard library + aiohttp only.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
import uuid

import aiohttp
from aiohttp import web

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
logger = logging.getLogger("nixl_proxy")
_SESSION = web.AppKey("session", aiohttp.ClientSession)
_CFG = web.AppKey("cfg", dict)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "NixlProxyError", "code": status}}, status=status)


async def generate(request: web.Request) -> web.StreamResponse:
    cfg, session = request.app[_CFG], request.app[_SESSION]
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "request body is not JSON")
    rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    headers = {"X-Request-Id": rid}
    pbody = dict(body)
    pbody["max_tokens"] = 1
    if "max_completion_tokens" in pbody:
        pbody["max_completion_tokens"] = 1
    pbody["stream"] = False
    pbody.pop("stream_options", None)
    pbody["kv_transfer_params"] = dict(PREFILL_PARAMS)
    t0 = time.monotonic()
    t_first = None
    try:
        async with session.post(cfg["prefill"] + request.path, json=pbody, headers=headers) as r:
            raw = await r.read()
            t_prefill = time.monotonic()
            if r.status != 200:
                return web.Response(status=r.status, body=raw, content_type="application/json")
            pjson = await r.json(content_type=None)
    except aiohttp.ClientError as e:
        return _error(502, f"prefill: {type(e).__name__}: {e}")
    kv = pjson.get("kv_transfer_params")
    dbody = dict(body)
    if kv:
        dbody["kv_transfer_params"] = kv
    else:
        logger.warning("prefill answered without kv_transfer_params (request %s)", rid)
    try:
        async with session.post(cfg["decode"] + request.path, json=dbody, headers=headers) as r:
            if not body.get("stream"):
                raw = await r.read()
                return web.Response(status=r.status, body=raw, content_type="application/json")
            resp = web.StreamResponse(status=r.status)
            resp.content_type = r.headers.get("Content-Type", "text/event-stream").split(";")[0]
            await resp.prepare(request)
            async for chunk in r.content.iter_any():
                if t_first is None:
                    t_first = time.monotonic()
                await resp.write(chunk)
            await resp.write_eof()
            # the same line as orbitkv.proxy's, for the driver's breakdown
            logger.info("%s %s: decode=%s prefill_s=%.4f first_byte_s=%s done_s=%.4f", rid, request.path, r.status,
                        t_prefill - t0, "-" if t_first is None else f"{t_first - t0:.4f}", time.monotonic() - t0)
            return resp
    except aiohttp.ClientError as e:
        return _error(502, f"decode: {type(e).__name__}: {e}")


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def models(request: web.Request) -> web.Response:
    cfg, session = request.app[_CFG], request.app[_SESSION]
    async with session.get(cfg["decode"] + "/v1/models") as r:
        return web.Response(status=r.status, body=await r.read(), content_type="application/json")


async def _serve(prefill: str, decode: str, host: str, port: int) -> None:
    app = web.Application(client_max_size=64 << 20)
    app[_CFG] = {"prefill": prefill.rstrip("/"), "decode": decode.rstrip("/")}
    session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0, force_close=False)
    )
    app[_SESSION] = session
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    logger.info("NIXL proxy on http://%s:%d: prefill %s, decode %s", host, port, prefill, decode)
    try:
        await asyncio.Event().wait()
    finally:
        await session.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_serve(a.prefill, a.decode, a.host, a.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
