"""The P/D proxy against two fake vLLM servers (real HTTP on 127.0.0.1).

Each fake answers only once it has seen the other side's request, so a proxy
that called prefill and decode one after the other would fail these tests.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

import orbitkv
from orbitkv import proxy
from orbitkv.vllm import params as kvp
from orbitkv.vllm.config import KEY_ENV

WAIT_S = 5.0
DECODE_JSON = {
    "id": "cmpl-decode",
    "object": "text_completion",
    "choices": [{"index": 0, "text": " from decode"}],
}
SSE_EVENTS = [
    b'data: {"choices":[{"index":0,"text":" one"}]}\n\n',
    b'data: {"choices":[{"index":0,"text":" two"}]}\n\n',
    b'data: {"choices":[{"index":0,"text":" three"}]}\n\n',
    b"data: [DONE]\n\n",
]

Reply = Callable[["Backend", web.Request, dict], Awaitable[web.StreamResponse]]


class LoopThread:
    """An event loop in a thread, for the servers; the tests stay synchronous."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-proxy-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


class Backend:
    """A fake vLLM server: records each request, answers with ``reply``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[dict[str, Any]] = []
        self.cancelled: list[dict[str, Any]] = []
        self.reply: Reply | None = None
        self.other: Backend | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.seen.append({"t": time.monotonic(), "body": body, "headers": headers, "path": request.path})
        assert self.reply is not None
        try:
            return await self.reply(self, request, body)
        except asyncio.CancelledError:
            self.cancelled.append(body)
            raise

    async def other_arrived(self) -> bool:
        """Waits (bounded) until the other backend has seen a request."""
        assert self.other is not None
        deadline = time.monotonic() + WAIT_S
        while not self.other.seen:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", _ok)
        # A prefill's OrbitKV side channel health check (rank 0 of TP 1): the
        # fakes serve it themselves, so a fake's address is also its
        # ``--prefill-kv``.
        app.router.add_get(proxy.SIDE_CHANNEL_HEALTH, self.side_channel_health)
        return app

    async def side_channel_health(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True, "tp_rank": 0, "tp_size": 1})


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


class Setup:
    def __init__(self, lt: LoopThread, key: bytes | None = None) -> None:
        self.lt = lt
        self.prefill, self.decode = Backend("prefill"), Backend("decode")
        self.prefill.other, self.decode.other = self.decode, self.prefill
        self.runners: list[web.AppRunner] = []
        ports = []
        for b in (self.prefill, self.decode):
            runner, port = lt.run(_serve(b.app()))
            self.runners.append(runner)
            ports.append(port)
        self.prefill_url = f"http://127.0.0.1:{ports[0]}"
        self.decode_url = f"http://127.0.0.1:{ports[1]}"
        self.prefill_kv = f"127.0.0.1:{ports[0]}"
        self.cfg = proxy.ProxyConfig.make(self.prefill_url, self.decode_url, prefill_kv=self.prefill_kv, key=key)
        runner, self.port = lt.run(_serve(proxy.make_app(self.cfg)))
        self.runners.append(runner)

    def close(self) -> None:
        for r in reversed(self.runners):
            self.lt.run(r.cleanup())

    def post(self, body: dict, port: int | None = None) -> tuple[int, str, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=30)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.getheader("Content-Type", ""), r.read()
        finally:
            conn.close()

    def check_pair(self, client_body: dict) -> tuple[dict, dict]:
        """Both sides got one request each, concurrently, with one identity."""
        assert len(self.prefill.seen) == 1 and len(self.decode.seen) == 1
        p, d = self.prefill.seen[0], self.decode.seen[0]
        pk, dk = p["body"][proxy.KV_PARAMS_FIELD], d["body"][proxy.KV_PARAMS_FIELD]
        assert pk[kvp.ROLE] == kvp.PRODUCER and dk[kvp.ROLE] == kvp.CONSUMER
        assert pk[kvp.REQUEST] == dk[kvp.REQUEST] and len(pk[kvp.REQUEST]) >= 16
        assert dk[kvp.PREFILL_KV] == self.prefill_kv and dk[kvp.PREFILL_TP] == 1
        assert kvp.PdParams.parse(pk) is not None and kvp.PdParams.parse(dk) is not None
        rid_header = proxy.REQUEST_ID_HEADER.lower()
        assert p["headers"][rid_header] == d["headers"][rid_header] == pk[kvp.REQUEST]
        assert abs(p["t"] - d["t"]) < 1.0
        # Prefill runs one token, unstreamed; decode runs the client's request.
        assert p["body"]["max_tokens"] == 1 and p["body"]["stream"] is False
        assert "stream_options" not in p["body"]
        expected = dict(client_body)
        expected.pop(proxy.KV_PARAMS_FIELD, None)
        assert {k: v for k, v in d["body"].items() if k != proxy.KV_PARAMS_FIELD} == expected
        return p["body"], d["body"]


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.stop()


@pytest.fixture
def pd(loop_thread: LoopThread) -> Iterator[Setup]:
    s = Setup(loop_thread)
    yield s
    s.close()


async def prefill_ok(b: Backend, request: web.Request, body: dict) -> web.StreamResponse:
    if not await b.other_arrived():
        return web.json_response({"error": "decode request did not arrive while prefill ran"}, status=500)
    return web.json_response({"id": "cmpl-prefill", "choices": [{"index": 0, "text": " P"}]})


async def decode_json(b: Backend, request: web.Request, body: dict) -> web.StreamResponse:
    if not await b.other_arrived():
        return web.json_response({"error": "prefill request did not arrive while decode waited"}, status=500)
    return web.json_response(DECODE_JSON)


async def decode_sse(b: Backend, request: web.Request, body: dict) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    if not await b.other_arrived():
        await resp.write(b'data: {"error": "prefill request did not arrive"}\n\n')
        return resp
    for event in SSE_EVENTS:
        await resp.write(event)
        await asyncio.sleep(0.05)
    await resp.write_eof()
    return resp


async def wait_then_hang(b: Backend, request: web.Request, body: dict) -> web.StreamResponse:
    await b.other_arrived()
    await asyncio.sleep(60)
    raise AssertionError("not dropped")


def wait_dropped(*backends: Backend) -> None:
    """Waits up to WAIT_S until the proxy dropped its request to each backend."""
    deadline = time.monotonic() + WAIT_S
    while not all(b.cancelled for b in backends) and time.monotonic() < deadline:
        time.sleep(0.02)
    for b in backends:
        assert b.cancelled, f"the request to {b.name} was not dropped"


def test_non_streaming_goes_to_both_at_once(pd: Setup) -> None:
    pd.prefill.reply, pd.decode.reply = prefill_ok, decode_json
    client = {"model": "tiny", "prompt": [0, 5, 9], "max_tokens": 7, "temperature": 0}
    status, ctype, body = pd.post(client)
    assert status == 200, body
    assert ctype.startswith("application/json")
    assert json.loads(body) == DECODE_JSON
    pd.check_pair(client)


def test_streaming_is_passed_through(pd: Setup) -> None:
    pd.prefill.reply, pd.decode.reply = prefill_ok, decode_sse
    client = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": True,
              "stream_options": {"include_usage": True}}
    status, ctype, body = pd.post(client)
    assert status == 200
    assert ctype.startswith("text/event-stream")
    assert body == b"".join(SSE_EVENTS)
    pd.check_pair(client)


def test_client_params_are_replaced(pd: Setup) -> None:
    pd.prefill.reply, pd.decode.reply = prefill_ok, decode_json
    client = {"model": "tiny", "prompt": "x", "max_tokens": 2,
              proxy.KV_PARAMS_FIELD: {kvp.ROLE: kvp.CONSUMER, kvp.REQUEST: "client-chosen"}}
    status, _, _ = pd.post(client)
    assert status == 200
    pk, dk = (b["body"][proxy.KV_PARAMS_FIELD] for b in (pd.prefill.seen[0], pd.decode.seen[0]))
    assert pk[kvp.REQUEST] == dk[kvp.REQUEST] != "client-chosen"


def test_failed_prefill_drops_decode(pd: Setup) -> None:
    async def prefill_fails(b: Backend, request: web.Request, body: dict) -> web.StreamResponse:
        await b.other_arrived()
        return web.json_response({"error": "boom"}, status=500)

    pd.prefill.reply, pd.decode.reply = prefill_fails, wait_then_hang
    t0 = time.monotonic()
    status, _, body = pd.post({"model": "tiny", "prompt": "x", "max_tokens": 4})
    assert status == 502
    assert "prefill failed" in json.loads(body)["error"]["message"]
    assert time.monotonic() - t0 < 3.0
    wait_dropped(pd.decode)


def test_failed_prefill_mid_stream_sends_sse_error(pd: Setup) -> None:
    async def prefill_fails_late(b: Backend, request: web.Request, body: dict) -> web.StreamResponse:
        await b.other_arrived()
        await asyncio.sleep(0.2)
        return web.json_response({"error": "boom"}, status=503)

    async def decode_stream_hang(b: Backend, request: web.Request, body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(SSE_EVENTS[0])
        await asyncio.sleep(60)
        raise AssertionError("not dropped")

    pd.prefill.reply, pd.decode.reply = prefill_fails_late, decode_stream_hang
    status, _, body = pd.post({"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": True})
    assert status == 200
    assert body.startswith(SSE_EVENTS[0])
    events = [e for e in body.split(b"\n\n") if e]
    assert b"prefill failed" in events[-2] and events[-1] == b"data: [DONE]"


def test_failed_decode_drops_prefill(pd: Setup) -> None:
    async def decode_refuses(b: Backend, request: web.Request, body: dict) -> web.StreamResponse:
        await b.other_arrived()
        return web.json_response({"error": {"message": "bad request"}}, status=400)

    pd.prefill.reply, pd.decode.reply = wait_then_hang, decode_refuses
    status, _, body = pd.post({"model": "tiny", "prompt": "x", "max_tokens": 4})
    assert status == 400 and json.loads(body)["error"]["message"] == "bad request"
    wait_dropped(pd.prefill)


def test_client_disconnect_drops_both(pd: Setup) -> None:
    async def decode_slow_stream(b: Backend, request: web.Request, body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(600):
            await resp.write(SSE_EVENTS[0])
            await asyncio.sleep(0.1)
        raise AssertionError("not dropped")

    pd.prefill.reply, pd.decode.reply = wait_then_hang, decode_slow_stream
    conn = http.client.HTTPConnection("127.0.0.1", pd.port, timeout=10)
    conn.request("POST", "/v1/completions",
                 json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 500, "stream": True}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    assert r.read1(1024).startswith(b"data:")
    conn.close()
    wait_dropped(pd.decode, pd.prefill)


def test_a_prefill_reply_after_decode_answered_is_not_dropped(pd: Setup) -> None:
    """Decode's whole answer can reach the client a few ms before prefill's
    reply; a client that then closes at once must not abort the (finished)
    prefill request, or prefill's own counters miss it."""
    landed: list[float] = []

    async def prefill_late(b: Backend, request: web.Request, body: dict) -> web.StreamResponse:
        await b.other_arrived()
        await asyncio.sleep(0.5)  # after decode's answer is out
        landed.append(time.monotonic())
        return web.json_response({"id": "cmpl-prefill", "choices": [{"index": 0, "text": " P"}]})

    pd.prefill.reply, pd.decode.reply = prefill_late, decode_json
    status, _, data = pd.post({"model": "tiny", "prompt": "x", "max_tokens": 4})  # reads, then closes
    assert status == 200 and json.loads(data) == DECODE_JSON
    deadline = time.monotonic() + WAIT_S
    while not landed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert landed, "the prefill request never completed"
    assert pd.prefill.cancelled == [], "the prefill request was dropped after decode answered"


class Many:
    """Two fake prefill servers and one fake decode server behind one proxy."""

    def __init__(self, lt: LoopThread) -> None:
        self.lt = lt
        self.prefills = [Backend("prefill-a"), Backend("prefill-b")]
        self.decode = Backend("decode")
        self.runners: list[web.AppRunner] = []
        self.urls: list[str] = []
        for b in (*self.prefills, self.decode):
            runner, port = lt.run(_serve(b.app()))
            self.runners.append(runner)
            self.urls.append(f"http://127.0.0.1:{port}")
        self.kvs = [u.removeprefix("http://") for u in self.urls[:2]]
        self.cfg = proxy.ProxyConfig.make(
            self.urls[0], self.urls[2], prefill_kv=self.kvs[0],
            more_prefills=[(self.urls[1], self.kvs[1])],
        )
        runner, self.port = lt.run(_serve(proxy.make_app(self.cfg)))
        self.runners.append(runner)

    def close(self) -> None:
        for r in reversed(self.runners):
            self.lt.run(r.cleanup())


async def prefill_any(b: Backend, request: web.Request, body: dict) -> web.StreamResponse:
    return web.json_response({"id": "cmpl-prefill", "choices": [{"index": 0, "text": " P"}]})


async def decode_any(b: Backend, request: web.Request, body: dict) -> web.StreamResponse:
    return web.json_response(DECODE_JSON)


def _post(port: int, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_several_prefills_share_the_load_and_decode_is_told_which(loop_thread: LoopThread) -> None:
    async def prefill_slow(b: Backend, request: web.Request, body: dict) -> web.StreamResponse:
        await asyncio.sleep(0.3)  # the requests overlap
        return await prefill_any(b, request, body)

    m = Many(loop_thread)
    try:
        for b in m.prefills:
            b.reply = prefill_slow
        m.decode.reply = decode_any
        # Concurrent requests: least outstanding spreads them over both prefills.
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(_post(m.port, {"prompt": "x", "max_tokens": 2})[0]))
                   for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == [200] * 8
        # Decode answers at once; the prefill calls land a little later.
        deadline = time.monotonic() + WAIT_S
        while sum(len(b.seen) for b in m.prefills) < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(b.seen for b in m.prefills), [len(b.seen) for b in m.prefills]
        # Each decode request names the side channel of the prefill that ran its prefill.
        kv_of = {m.prefills[0].name: m.kvs[0], m.prefills[1].name: m.kvs[1]}
        by_id = {b_seen["body"][proxy.KV_PARAMS_FIELD][kvp.REQUEST]: b.name for b in m.prefills for b_seen in b.seen}
        for d in m.decode.seen:
            params = d["body"][proxy.KV_PARAMS_FIELD]
            assert params[kvp.PREFILL_KV] == kv_of[by_id[params[kvp.REQUEST]]]
    finally:
        m.close()


def test_a_dead_prefill_is_failed_over_and_left_out(loop_thread: LoopThread) -> None:
    m = Many(loop_thread)
    try:
        m.prefills[1].reply = prefill_any
        m.decode.reply = decode_any
        loop_thread.run(m.runners[0].cleanup())  # prefill-a is gone: connection refused
        for _ in range(4):
            status, data = _post(m.port, {"prompt": "x", "max_tokens": 2})
            assert status == 200 and json.loads(data) == DECODE_JSON
        assert len(m.prefills[1].seen) == 4
        # Every decode request names the live prefill's side channel.
        assert {d["body"][proxy.KV_PARAMS_FIELD][kvp.PREFILL_KV] for d in m.decode.seen} >= {m.kvs[1]}
        conn = http.client.HTTPConnection("127.0.0.1", m.port, timeout=30)
        conn.request("GET", "/health")
        r = conn.getresponse()
        health = json.loads(r.read())
        assert r.status == 200, health  # one prefill and the decode are enough
        assert health[m.urls[0]]["health"] != 200 and health[m.urls[1]]["health"] == 200
        conn.close()
    finally:
        m.runners.pop(0)
        m.close()


def test_a_prefill_that_dies_under_a_request_is_failed_over_before_any_byte(loop_thread: LoopThread) -> None:
    """A prefill killed while it runs a request (its connection drops) before
    decode sent anything: the client does not see it; the request runs
    again on the other prefill with a fresh identity, and the dead one is
    left out of new requests."""

    async def prefill_dies(b: Backend, request: web.Request, body: dict) -> web.StreamResponse:
        await asyncio.sleep(0.05)  # both halves are under way
        assert request.transport is not None
        request.transport.close()  # the process is gone: connection reset
        await asyncio.sleep(60)
        raise AssertionError("not dropped")

    async def decode_waits_for_kv(b: Backend, request: web.Request, body: dict) -> web.StreamResponse:
        await asyncio.sleep(0.3)  # decode waits for its KV: nothing sent yet
        return await decode_any(b, request, body)

    m = Many(loop_thread)
    try:
        m.prefills[0].reply = prefill_dies
        m.prefills[1].reply = prefill_any
        m.decode.reply = decode_waits_for_kv
        # Idle pool: the first pick is prefill-a (least outstanding, first listed).
        status, data = _post(m.port, {"prompt": "x", "max_tokens": 2})
        assert status == 200 and json.loads(data) == DECODE_JSON
        assert len(m.prefills[0].seen) == 1 and len(m.prefills[1].seen) == 1
        first, second = (d["body"][proxy.KV_PARAMS_FIELD] for d in m.decode.seen)
        assert first[kvp.REQUEST] != second[kvp.REQUEST] and first[kvp.CAPABILITY] != second[kvp.CAPABILITY]
        assert (first[kvp.PREFILL_KV], second[kvp.PREFILL_KV]) == (m.kvs[0], m.kvs[1])
        assert len(m.decode.cancelled) == 1, "the first decode request was not dropped"
        # Left out until its health check passes again.
        status, _ = _post(m.port, {"prompt": "y", "max_tokens": 2})
        assert status == 200 and len(m.prefills[0].seen) == 1
    finally:
        m.close()


def test_body_prefill_and_decode_helpers() -> None:
    body = {"messages": [], "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}}
    p = proxy.prefill_body(body, {"a": 1})
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False
    assert "stream_options" not in p and p[proxy.KV_PARAMS_FIELD] == {"a": 1}
    d = proxy.decode_body(body, {"b": 2})
    assert d["max_completion_tokens"] == 50 and d["stream"] is True and d[proxy.KV_PARAMS_FIELD] == {"b": 2}
    assert proxy.KV_PARAMS_FIELD not in body  # the client's dict is left alone


KEY = b"deployment-key-0123456789"


def test_keyed_params_carry_a_valid_signature() -> None:
    """With the deployment key, both halves' params are signed over every
    orbitkv_* key: an instance holding the key accepts them, and the decode
    side vouches for the prefill side channel the proxy names."""
    cfg = proxy.ProxyConfig.make("http://10.0.0.2:8100", "http://10.0.0.3:8200", "10.0.0.2:23000", key=KEY)
    assert "deployment-key" not in repr(cfg)
    cap = "ab" * 32
    pk = cfg.params(kvp.PRODUCER, "rid-1", cap)
    dk = cfg.params(kvp.CONSUMER, "rid-1", cap, cfg.prefills[0], 2)
    for got in (pk, dk):
        kvp.check_signature(got, KEY)  # raises when wrong
        assert kvp.PdParams.parse(got) is not None
        assert got[kvp.SIGNATURE] == kvp.sign({k: v for k, v in got.items() if k != kvp.SIGNATURE}, KEY)
        with pytest.raises(kvp.RequestParamsError, match="does not match"):
            kvp.check_signature(got, b"another-key-0123456789")
    assert (dk[kvp.PREFILL_KV], dk[kvp.PREFILL_TP]) == ("10.0.0.2:23000", 2)
    with pytest.raises(kvp.RequestParamsError, match="does not match"):
        kvp.check_signature(dict(dk, **{kvp.PREFILL_KV: "10.0.0.2:23001"}), KEY)
    # Unkeyed: no signature.
    plain = proxy.ProxyConfig.make("http://10.0.0.2:8100", "http://10.0.0.3:8200")
    assert kvp.SIGNATURE not in plain.params(kvp.CONSUMER, "rid-2", cap)
    assert kvp.SIGNATURE not in plain.params(kvp.PRODUCER, "rid-2", cap)


def test_a_keyed_proxy_signs_both_halves(loop_thread: LoopThread) -> None:
    s = Setup(loop_thread, key=KEY)
    try:
        s.prefill.reply, s.decode.reply = prefill_ok, decode_json
        client = {"model": "tiny", "prompt": "x", "max_tokens": 2,
                  proxy.KV_PARAMS_FIELD: {kvp.ROLE: kvp.CONSUMER, kvp.SIGNATURE: "0" * 64}}
        status, _, body = s.post(client)
        assert status == 200, body
        for b in (s.prefill, s.decode):
            got = b.seen[0]["body"][proxy.KV_PARAMS_FIELD]
            kvp.check_signature(got, KEY)
            assert got[kvp.SIGNATURE] != "0" * 64
    finally:
        s.close()


def _run_cli(pd: Setup, *extra: str, env_extra: dict[str, str] | None = None) -> str:
    """Runs ``python -m orbitkv.proxy`` in front of ``pd``'s fakes, posts one
    request through it; its "listening" line."""
    env = dict(os.environ)
    env.pop(KEY_ENV, None)
    env.update(env_extra or {})
    pkg_root = str(Path(orbitkv.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbitkv.proxy", "--prefill", pd.prefill_url, "--decode", pd.decode_url,
         "--port", "0", "--prefill-kv", pd.prefill_kv, "--log-level", "WARNING", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        line = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stdout.readline() if proc.stdout else ""
            if "listening on" in line or not line:
                break
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        assert m, f"proxy did not start: {line!r}"
        status, _, body = pd.post({"model": "tiny", "prompt": "x", "max_tokens": 2}, port=int(m.group(1)))
        assert status == 200 and json.loads(body) == DECODE_JSON
        return line
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_cli_serves(pd: Setup) -> None:
    pd.prefill.reply, pd.decode.reply = prefill_ok, decode_json
    assert "kv_transfer_params unsigned" in _run_cli(pd)
    assert kvp.SIGNATURE not in pd.decode.seen[0]["body"][proxy.KV_PARAMS_FIELD]


def test_cli_signs_with_the_key_file_or_the_environment(pd: Setup, tmp_path: Path) -> None:
    pd.prefill.reply, pd.decode.reply = prefill_ok, decode_json
    f = tmp_path / "key"
    f.write_bytes(KEY + b"\n")
    assert "kv_transfer_params signed" in _run_cli(pd, "--side-channel-key-file", str(f))
    assert "kv_transfer_params signed" in _run_cli(pd, env_extra={KEY_ENV: KEY.decode()})
    for b in (pd.prefill, pd.decode):
        assert len(b.seen) == 2
        for seen in b.seen:
            kvp.check_signature(seen["body"][proxy.KV_PARAMS_FIELD], KEY)


def test_cli_refuses_a_short_or_missing_key_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"short")
    for path, why in ((short, "at least 16 bytes"), (tmp_path / "missing", "cannot read")):
        with pytest.raises(SystemExit) as e:
            proxy.main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                        "--side-channel-key-file", str(path)])
        assert e.value.code == 2 and why in capsys.readouterr().err


# ---- the prefill's TP size, learned from its side channels ---------------------


def _side_channel(rank: int | str, size: int = 0) -> web.Application:
    """A fake rank's side channel: ``{"ok":true,"tp_rank":rank,"tp_size":size}``,
    or, when ``rank`` is a string, that raw body (a hostile or foreign peer)."""

    async def health(_: web.Request) -> web.Response:
        if isinstance(rank, str):
            return web.Response(text=rank, content_type="application/json")
        return web.json_response({"ok": True, "tp_rank": rank, "tp_size": size})

    app = web.Application()
    app.router.add_get(proxy.SIDE_CHANNEL_HEALTH, health)
    return app


def _serve_ranks(lt: LoopThread, ranks: Sequence[tuple[int, int] | str]) -> tuple[list[web.AppRunner], int]:
    """Fake side channels for ``(rank, size)`` pairs on consecutive ports
    (rank i at base + i, as the PdConnector binds them); returns the base."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + len(ranks) > 65535:
            continue
        runners: list[web.AppRunner] = []
        try:
            for i, r in enumerate(ranks):
                runner = web.AppRunner(_side_channel(r) if isinstance(r, str) else _side_channel(*r), access_log=None)
                lt.run(runner.setup())
                runners.append(runner)
                lt.run(web.TCPSite(runner, "127.0.0.1", base + i).start())
            return runners, base
        except OSError:
            for r in runners:
                lt.run(r.cleanup())
    raise RuntimeError("no consecutive free ports")


def _proxy_health(port: int) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


class Ranked:
    """A fake prefill and decode whose prefill side channels are separate fake
    ranks (``ranks``: (tp_rank, tp_size) each), behind a proxy configured
    with ``prefill_tp``."""

    def __init__(self, lt: LoopThread, ranks: Sequence[tuple[int, int] | str], prefill_tp: int | None) -> None:
        self.lt = lt
        self.prefill, self.decode = Backend("prefill"), Backend("decode")
        self.runners, base = _serve_ranks(lt, ranks)
        urls = []
        for b in (self.prefill, self.decode):
            runner, port = lt.run(_serve(b.app()))
            self.runners.append(runner)
            urls.append(f"http://127.0.0.1:{port}")
        self.prefill_url = urls[0]
        self.kv = f"127.0.0.1:{base}"
        self.cfg = proxy.ProxyConfig.make(urls[0], urls[1], prefill_kv=self.kv, prefill_tp=prefill_tp)
        runner, self.port = lt.run(_serve(proxy.make_app(self.cfg)))
        self.runners.append(runner)

    def close(self) -> None:
        for r in reversed(self.runners):
            self.lt.run(r.cleanup())


def test_the_prefill_tp_is_learned_from_its_side_channels(loop_thread: LoopThread) -> None:
    r = Ranked(loop_thread, [(0, 2), (1, 2)], prefill_tp=None)
    try:
        r.prefill.reply, r.decode.reply = prefill_any, decode_any
        status, health = _proxy_health(r.port)
        assert status == 200 and health == {"prefill": 200, "decode": 200}, health
        status, data = _post(r.port, {"prompt": "x", "max_tokens": 2})
        assert status == 200 and json.loads(data) == DECODE_JSON
        # Decode is told the TP size the prefill's ranks reported, and rank 0's side channel.
        dk = r.decode.seen[0]["body"][proxy.KV_PARAMS_FIELD]
        assert dk[kvp.PREFILL_TP] == 2 and dk[kvp.PREFILL_KV] == r.kv
    finally:
        r.close()


@pytest.mark.parametrize(
    ("ranks", "prefill_tp", "reason"),
    [
        ([(0, 1)], 2, "--prefill-tp is 2 but the prefill at"),  # the flag disagrees with the prefill
        ([(0, 2)], None, "unreachable"),  # rank 1's side channel is missing
        ([(0, 2), (0, 2)], None, "expected rank 1 of 2"),  # two instances' ranks mixed up
        ([(1, 2)], None, "not rank 0"),  # --prefill-kv names rank 1
        # Malformed answers (a foreign service on the port, a hostile peer):
        # the prefill is left out, the proxy keeps serving its /health.
        (['{"ok": true}'], None, "not an OrbitKV side channel"),
        (['{"ok": true, "tp_rank": "0", "tp_size": 2}'], None, "not an OrbitKV side channel"),
        (["[1, 2]"], None, "not an OrbitKV side channel"),
        (['{"ok": true, "tp_rank": false, "tp_size": true}'], None, "not an OrbitKV side channel"),
        (["not json"], None, "not an OrbitKV side channel"),
        (['{"ok": true, "tp_rank": 0, "tp_size": 0}'], None, "not rank 0"),
        (['{"ok": true, "tp_rank": 0, "tp_size": -3}'], None, "not rank 0"),
    ],
    ids=["flag-disagrees", "rank-missing", "wrong-rank", "not-rank-0", "no-rank", "rank-as-string", "not-an-object",
         "bools", "not-json", "size-zero", "size-negative"],
)
def test_a_prefill_whose_side_channels_disagree_is_left_out_with_the_reason(
    loop_thread: LoopThread, ranks: list[tuple[int, int] | str], prefill_tp: int | None, reason: str
) -> None:
    r = Ranked(loop_thread, ranks, prefill_tp=prefill_tp)
    try:
        status, health = _proxy_health(r.port)
        assert status == 503, health
        assert reason in str(health["prefill"]), health
    finally:
        r.close()
