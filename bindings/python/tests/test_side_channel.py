"""The P/D HTTP control channel, over real HTTP on 127.0.0.1 into a real
`orbitkv.Runtime` and real Mooncake: a handshake is admitted or refused with
its typed error, a cancellation releases a producer without waiting for its
deadline, and a stranger — without the request's capability, or without the
deployment key's signature — can neither steer a write nor cancel a request.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch
from test_runtime import CAP, GUARD, LAYERS, Rank, wait_event

import orbitkv
from orbitkv.vllm.side_channel import (
    SIGNATURE_HEADER,
    HandshakeRejected,
    post_cancel,
    post_handshake,
)

STRANGER = "f" * 64
KEY = b"deployment-key-0123456789"


def serve(p: Rank, **kw) -> orbitkv.SideChannel:
    return orbitkv.SideChannel(p.runtime, "127.0.0.1", 0, **kw)


@pytest.fixture
def served():
    p, c = Rank(None), Rank(GUARD)
    server = serve(p)
    yield p, c, server.address
    server.close()
    p.close()
    c.close()


def stream_all(p: Rank, req: str, blocks: int) -> None:
    for layer in range(LAYERS):
        p.runtime.layer_ready(req, layer, 0, blocks)
    p.runtime.producer_finish(req)


def test_handshake_over_http_then_layers_land(served) -> None:
    p, c, addr = served
    hs = c.runtime.consumer_open("req-http", CAP, 0, [3, 4], 1)
    p.runtime.producer_open("req-http", [0, 1], CAP)
    post_handshake(addr, hs)
    stream_all(p, "req-http", 2)
    ev = wait_event(c.runtime, {"consumer_completed", "consumer_failed"})
    assert ev.kind == "consumer_completed", ev
    assert torch.equal(c.caches[0][3], p.caches[0][0])


def test_a_bad_handshake_is_refused_with_its_error(served) -> None:
    _, c, addr = served
    hs = json.loads(c.runtime.consumer_open("req-bad", CAP, 0, [3], 1))
    hs["layout"]["layers"].pop()
    with pytest.raises(HandshakeRejected, match="GeometryError"):
        post_handshake(addr, json.dumps(hs))
    with pytest.raises(HandshakeRejected, match="HandshakeError"):
        post_handshake(addr, '{"version": 9}')


def test_cancel_releases_the_producer_at_once(served) -> None:
    p, _, addr = served
    p.runtime.producer_open("req-gone", [0], CAP)
    start = time.monotonic()
    post_cancel(addr, orbitkv.cancel_message("req-gone", CAP, "client went away"))
    ev = wait_event(p.runtime, {"producer_released"}, timeout_s=10.0)
    assert (ev.request_id, ev.outcome) == ("req-gone", "aborted")
    assert "cancelled by the consumer" in (ev.reason or "")
    assert time.monotonic() - start < 5.0  # not the 120 s handshake deadline
    with pytest.raises(HandshakeRejected) as e:
        post_cancel(addr, '{"version": 4, "request_id": ""}')  # malformed: refused, nothing changes
    assert e.value.status == 400


# ---- strangers ------------------------------------------------------------------------


def test_a_forged_handshake_is_forbidden_and_steers_nothing(served) -> None:
    """A stranger who learned the request ID and the decode's geometry (the
    attack the hardening issue showed) forges a newer handshake (a greater
    sequence, which orders a consumer's authorizations; generations are
    random) into a third party's memory: 403, nothing written there, and the
    real decode still gets its KV."""
    p, c, addr = served
    victim = Rank(GUARD)  # a third process's registered memory
    try:
        real = c.runtime.consumer_open("req-x", CAP, 0, [3, 4], 1)
        forged = json.loads(victim.runtime.consumer_open("req-x", STRANGER, 0, [5, 6], 1))
        forged["sequence"] = json.loads(real)["sequence"] + 1000
        # Before the producer opened (parked) and after (live): refused or ignored.
        post_handshake(addr, json.dumps(forged))  # parked beside the real one, never taken
        p.runtime.producer_open("req-x", [0, 1], CAP)
        with pytest.raises(HandshakeRejected) as e:
            post_handshake(addr, json.dumps(forged))
        assert e.value.status == 403 and "ForbiddenError" in str(e.value)
        post_handshake(addr, real)
        stream_all(p, "req-x", 2)
        ev = wait_event(c.runtime, {"consumer_completed", "consumer_failed"})
        assert ev.kind == "consumer_completed", ev
        assert torch.equal(c.caches[1][4], p.caches[1][1])
        assert all(bool((t == GUARD).all()) for t in victim.caches), "a forged handshake steered a write"
        assert victim.runtime.next_event(0.5) is None  # and no notice reached the victim
        assert p.runtime.stats()["side_channel_forbidden"] >= 2
    finally:
        victim.close()


def test_a_strangers_cancel_is_forbidden_and_changes_nothing(served) -> None:
    p, c, addr = served
    hs = c.runtime.consumer_open("req-c", CAP, 0, [7], 1)
    # Early (before open) and late (while open): neither aborts the request.
    post_cancel(addr, orbitkv.cancel_message("req-c", STRANGER, "stranger"))
    p.runtime.producer_open("req-c", [2], CAP)
    with pytest.raises(HandshakeRejected) as e:
        post_cancel(addr, orbitkv.cancel_message("req-c", STRANGER, "stranger"))
    assert e.value.status == 403
    post_handshake(addr, hs)
    stream_all(p, "req-c", 1)
    ev = wait_event(p.runtime, {"producer_released"})
    assert ev.outcome == "done", ev
    assert wait_event(c.runtime, {"consumer_completed", "consumer_failed"}).kind == "consumer_completed"


def test_parking_is_bounded_and_refuses_a_flood() -> None:
    p, c = Rank(None), Rank(GUARD)
    p.runtime.shutdown()
    # The whole table to one address (these handshakes all come from 127.0.0.1).
    p.runtime = orbitkv.Runtime(p.engine, p.layout_json, max_parked=8, max_parked_per_source=8)
    server = serve(p)
    try:
        for i in range(8):
            post_handshake(server.address, c.runtime.consumer_open(f"flood-{i}", CAP, 0, [1], 1))
        with pytest.raises(HandshakeRejected) as e:
            post_handshake(server.address, c.runtime.consumer_open("flood-9", CAP, 0, [1], 1))
        assert e.value.status == 503 and "OverloadedError" in str(e.value)
        assert p.runtime.stats()["side_channel_overloaded"] == 1
    finally:
        server.close()
        p.close()
        c.close()


def test_parked_handshakes_expire_on_a_timer() -> None:
    p, c = Rank(None), Rank(GUARD)
    p.runtime.shutdown()
    p.runtime = orbitkv.Runtime(p.engine, p.layout_json, handshake_timeout_s=0.3)
    try:
        p.runtime.producer_handshake(c.runtime.consumer_open("late", CAP, 0, [1], 1))
        deadline = time.monotonic() + 5
        while p.runtime.stats()["parked_expired"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # nothing else happens on this runtime: the timer expires it
        assert p.runtime.stats()["parked_expired"] == 1
    finally:
        p.close()
        c.close()


def test_the_deployment_key_authenticates_every_post() -> None:
    p, c = Rank(None), Rank(GUARD)
    server = serve(p, key=KEY)
    try:
        hs = c.runtime.consumer_open("req-k", CAP, 0, [3], 1)
        for key in (None, b"another-key-0123456789"):
            with pytest.raises(HandshakeRejected) as e:
                post_handshake(server.address, hs, key=key)
            assert e.value.status == 401
            with pytest.raises(HandshakeRejected) as e:
                post_cancel(server.address, orbitkv.cancel_message("req-k", CAP, "x"), key=key)
            assert e.value.status == 401
        assert server.refused["signature"] == 4
        p.runtime.producer_open("req-k", [0], CAP)
        post_handshake(server.address, hs, key=KEY)
        stream_all(p, "req-k", 1)
        assert wait_event(c.runtime, {"consumer_completed", "consumer_failed"}).kind == "consumer_completed"
    finally:
        server.close()
        p.close()
        c.close()


def test_slow_and_excess_connections_are_bounded() -> None:
    """Slow clients neither hold a thread past the read timeout nor keep a
    real request out: at the connection cap a newcomer takes the place of
    the oldest connection trickling its body (issue 44: slow bodies are shed
    like slow heads), and when every place is held by a connection whose
    body is arriving fast it is answered 503 at once."""
    p = Rank(None)
    server = serve(p, read_timeout_s=0.5, max_connections=4)
    host, port = server.address.rsplit(":", 1)
    head = b"POST /orbitkv/v1/handshake HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
    held = []
    try:
        # Four bodies half sent at once (1 MiB of 2): arriving at many MiB/s,
        # none may be shed, so one more connection is refused at once.
        for _ in range(4):
            s = socket.create_connection((host, int(port)))
            s.sendall(head % (2 << 20) + b"x" * (1 << 20))
            held.append(s)
        time.sleep(0.1)
        extra = socket.create_connection((host, int(port)))
        extra.settimeout(2)
        assert extra.recv(64).startswith(b"HTTP/1.1 503")
        extra.close()
        for s in held:  # each is answered 408 and closed at the read timeout
            s.settimeout(3)
            assert s.recv(64).startswith(b"HTTP/1.1 408")
            s.close()
        held.clear()
        # Four heads promising a body that never comes: a newcomer past the
        # grace sheds the oldest and is served; the rest time out.
        for _ in range(4):
            s = socket.create_connection((host, int(port)))
            s.sendall(head % 100)
            held.append(s)
        time.sleep(0.1)
        with pytest.raises(HandshakeRejected) as e:
            post_handshake(server.address, '{"version": 9}')
        assert e.value.status == 400
        held[0].settimeout(3)
        try:
            shed = held[0].recv(64)
        except ConnectionResetError:
            shed = b""
        assert shed == b"", shed  # closed with no answer
        for s in held[1:]:
            s.settimeout(3)
            assert s.recv(64).startswith(b"HTTP/1.1 408")
    finally:
        for s in held:
            s.close()
        server.close()
        p.close()


def test_oversized_and_unsigned_bodies_are_refused_before_parsing(served) -> None:
    _, _, addr = served
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /orbitkv/v1/handshake HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n")
        s.settimeout(2)
        assert s.recv(64).startswith(b"HTTP/1.1 413")
    assert SIGNATURE_HEADER.startswith("X-OrbitKV")


# ---- the Rust server itself -------------------------------------------------------------


def test_a_taken_port_is_a_typed_error_and_close_is_idempotent() -> None:
    p = Rank(None)
    try:
        with serve(p) as server:
            host, port = server.address.rsplit(":", 1)
            with pytest.raises(orbitkv.SideChannelError) as e:
                orbitkv.SideChannel(p.runtime, host, int(port))
            assert e.value.kind == "AddressInUse" and isinstance(e.value, OSError)
            assert server.address in str(e.value)
            with pytest.raises(orbitkv.InvalidArgumentError):
                orbitkv.SideChannel(p.runtime, "127.0.0.1", 0, max_connections=0)
            assert not server.closed and server.connections == 0
            assert server.refused == {
                "signature": 0,
                "forbidden": 0,
                "malformed": 0,
                "busy": 0,
                "too_large": 0,
                "timed_out": 0,
                "shed": 0,
            }
        assert server.closed
        server.close()  # again: nothing happens
        with pytest.raises(ConnectionRefusedError):
            post_handshake(server.address, "{}")
    finally:
        p.close()


def test_the_server_does_not_keep_a_shut_down_runtime() -> None:
    p = Rank(None)
    server = serve(p)
    try:
        p.runtime.shutdown()
        with pytest.raises(HandshakeRejected) as e:
            post_handshake(server.address, '{"version": 9}')
        assert e.value.status == 503 and "RuntimeStoppedError" in str(e.value)
        assert server.refused["busy"] == 1
    finally:
        server.close()
        p.close()


def test_decode_publishes_its_handshake_from_rust_signed_with_the_key() -> None:
    """The decode rank's runtime sends the handshake itself (no Python
    thread), signed with the deployment key; the KV lands."""
    p, c = Rank(None), Rank(GUARD)
    c.runtime.shutdown()
    c.runtime = orbitkv.Runtime(c.engine, c.layout_json, side_channel_key=KEY)
    server = serve(p, key=KEY)
    try:
        p.runtime.producer_open("req-pub", [0, 1], CAP)
        c.runtime.consumer_open("req-pub", CAP, 0, [5, 6], 1, [(server.address, 0)])
        stream_all(p, "req-pub", 2)
        ev = wait_event(c.runtime, {"consumer_completed", "consumer_failed"})
        assert ev.kind == "consumer_completed", ev
        assert torch.equal(c.caches[2][6], p.caches[2][1])
        assert server.refused["signature"] == 0
    finally:
        server.close()
        p.close()
        c.close()


def test_a_handshake_refused_by_the_producer_fails_the_consumer_at_once(served) -> None:
    p, c, addr = served
    start = time.monotonic()
    # The producer knows the request under another capability: 403.
    p.runtime.producer_open("req-403", [0], STRANGER)
    c.runtime.consumer_open("req-403", CAP, 0, [3], 1, [(addr, 0)])
    ev = wait_event(c.runtime, {"consumer_completed", "consumer_failed"})
    assert ev.kind == "consumer_failed" and "403" in (ev.reason or ""), ev
    assert time.monotonic() - start < 5.0


def _http(addr: str, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    import http.client

    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_get_query_answers_as_a_mooncake_bootstrap_server_only_when_given_one() -> None:
    """A prefill's rank 0 with the mooncake dialect on answers `GET /query`
    as vLLM's MooncakeBootstrapServer does (mooncake_utils.py): DP rank ->
    engine ID and each TP rank's address; a router in its mooncake mode
    reads the engine ID there. Unauthenticated even with a deployment key
    (routers do not sign), read only; without a bootstrap, 404."""
    p = Rank(None)
    try:
        bootstrap = ("prefill-engine_dp0", ["10.0.0.2:17500", "10.0.0.2:17501"])
        with serve(p, key=KEY, mooncake_bootstrap=bootstrap) as server:
            status, body = _http(server.address, "GET", "/query")
            assert status == 200, body
            assert json.loads(body) == {
                "0": {
                    "engine_id": "prefill-engine_dp0",
                    "worker_addr": {"0": {"0": "10.0.0.2:17500"}, "1": {"0": "10.0.0.2:17501"}},
                }
            }
            # what vLLM's MooncakeConnector (decode) and llm-d read of it
            (entry,) = json.loads(body).values()
            assert {int(r): {int(q): a for q, a in pp.items()} for r, pp in entry["worker_addr"].items()} == {
                0: {0: "10.0.0.2:17500"},
                1: {0: "10.0.0.2:17501"},
            }
            # read only: no other method, nothing registers (vLLM's POST /register)
            assert _http(server.address, "POST", "/query")[0] == 404
            assert _http(server.address, "POST", "/register")[0] == 404
            assert server.refused["signature"] == 0
        with serve(p) as server:
            assert _http(server.address, "GET", "/query")[0] == 404
            assert _http(server.address, "GET", "/orbitkv/v1/health")[0] == 200
        for bad in [
            ("", ["h:1"]),
            ("e e", ["h:1"]),
            ("e\n", ["h:1"]),
            ("x" * 257, ["h:1"]),
            ("e", []),
            ("e", ["h 1"]),
            ("e", [""]),
        ]:
            with pytest.raises(orbitkv.InvalidArgumentError):
                serve(p, mooncake_bootstrap=bad)
    finally:
        p.close()
