"""Waiting calls release the GIL: another Python thread keeps running."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from _util import addr

import orbitkv

SIZE = 1 << 30  # about 0.8 s over Mooncake's loopback TCP on a 2-core machine


@pytest.fixture(scope="module")
def big(pair):
    a, b = pair
    src = np.ones(SIZE, dtype=np.uint8)
    dst = np.zeros(SIZE, dtype=np.uint8)
    a.register_memory(src)
    b.register_memory(dst)
    yield src, dst
    a.unregister_memory(src)
    b.unregister_memory(dst)


def heartbeat_during(call) -> tuple[float, float]:
    """Runs `call` in a thread while this thread ticks; returns (how long the
    call took, the longest pause between ticks during it)."""
    ticks: list[float] = []
    span: list[float] = []
    done = threading.Event()

    def run() -> None:
        span.append(time.monotonic())
        try:
            call()
        finally:
            span.append(time.monotonic())
            done.set()

    thread = threading.Thread(target=run)
    thread.start()
    while not done.is_set():
        ticks.append(time.monotonic())
        time.sleep(0.001)
    thread.join()
    start, end = span
    inside = [start] + [t for t in ticks if start <= t <= end] + [end]
    return end - start, max(b - a for a, b in zip(inside, inside[1:]))


def test_batch_wait_releases_the_gil(pair, big):
    a, b = pair
    src, dst = big
    batch = a.submit_write(b.endpoint, [(addr(src), addr(dst), SIZE)])

    def wait_briefly() -> None:
        try:
            batch.wait(timeout_s=0.25)
        except orbitkv.TransferTimeoutError:
            pass

    took, longest_pause = heartbeat_during(wait_briefly)
    assert batch.wait(timeout_s=120.0) == SIZE
    assert took >= 0.2, f"the wait took only {took:.3f} s: nothing to measure"
    assert longest_pause < took / 2, f"main thread paused {longest_pause:.3f} s of a {took:.3f} s wait"


def test_write_releases_the_gil(pair, big):
    a, b = pair
    src, dst = big
    src[::4096] = 7
    took, longest_pause = heartbeat_during(lambda: a.write(b.endpoint, [(addr(src), addr(dst), SIZE)], 120.0))
    assert np.array_equal(dst[::4096], src[::4096])
    assert took >= 0.2, f"the write took only {took:.3f} s: nothing to measure"
    assert longest_pause < took / 2, f"main thread paused {longest_pause:.3f} s of a {took:.3f} s write"


def test_a_batchs_repr_does_not_wait_for_its_wait(pair, big):
    """`repr(batch)` while another thread waits on it (holding its slot for
    up to the wait's timeout) answers at once instead of waiting, GIL held,
    for the wait to end."""
    a, b = pair
    src, dst = big
    batch = a.submit_write(b.endpoint, [(addr(src), addr(dst), SIZE)])
    waiter = threading.Thread(target=lambda: batch.wait(timeout_s=120.0))
    waiter.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    text = repr(batch)
    took = time.monotonic() - t0
    waiter.join()
    assert "being waited for" in text or "completed" in text, text
    assert took < 0.05, f"repr took {took:.3f} s"
    assert batch.wait(timeout_s=1.0) == SIZE

