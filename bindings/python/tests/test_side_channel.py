"""The P/D HTTP control channel, over real HTTP on 127.0.0.1 into a real
`orbitkv.Runtime`: a handshake is admitted or refused with its typed error,
and a cancellation releases a producer without waiting for its deadline."""

from __future__ import annotations

import json
import time

import pytest
import torch

import orbitkv
from orbitkv.vllm.side_channel import HandshakeRejected, SideChannelServer, post_cancel, post_handshake

from test_runtime import LAYERS, Rank, wait_event


@pytest.fixture
def served():
    p, c = Rank(None), Rank(-7.0)
    server = SideChannelServer("127.0.0.1", 0, p.runtime.producer_handshake, p.runtime.producer_cancel)
    yield p, c, server.address
    server.close()
    p.close()
    c.close()


def test_handshake_over_http_then_layers_land(served) -> None:
    p, c, addr = served
    hs = c.runtime.consumer_open("req-http", 0, [3, 4], 1)
    p.runtime.producer_open("req-http", [0, 1])
    post_handshake(addr, hs)
    for layer in range(LAYERS):
        p.runtime.layer_ready("req-http", layer, 0, 2)
    p.runtime.producer_finish("req-http")
    ev = wait_event(c.runtime, {"consumer_completed", "consumer_failed"})
    assert ev.kind == "consumer_completed", ev
    assert torch.equal(c.caches[0][3], p.caches[0][0])


def test_a_bad_handshake_is_refused_with_its_error(served) -> None:
    p, c, addr = served
    hs = json.loads(c.runtime.consumer_open("req-bad", 0, [3], 1))
    hs["layout"]["layers"].pop()
    with pytest.raises(HandshakeRejected, match="GeometryError"):
        post_handshake(addr, json.dumps(hs))
    with pytest.raises(HandshakeRejected, match="HandshakeError"):
        post_handshake(addr, '{"version": 9}')


def test_cancel_releases_the_producer_at_once(served) -> None:
    p, _, addr = served
    p.runtime.producer_open("req-gone", [0])
    start = time.monotonic()
    post_cancel(addr, "req-gone", "client went away")
    ev = wait_event(p.runtime, {"producer_released"}, timeout_s=10.0)
    assert (ev.request_id, ev.outcome) == ("req-gone", "aborted")
    assert "cancelled by the consumer" in (ev.reason or "")
    assert time.monotonic() - start < 5.0  # not the 120 s handshake deadline
    with pytest.raises(HandshakeRejected):
        post_cancel(addr, "", "")  # malformed: refused, nothing changes
