"""Shared fixtures: real Mooncake engines on loopback (TCP, 127.0.0.1)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import orbitkv

# Mooncake logs INFO lines through glog; keep warnings and errors.
os.environ.setdefault("GLOG_minloglevel", "1")


@pytest.fixture(scope="session")
def pair() -> Iterator[tuple[orbitkv.MooncakeTransferEngine, orbitkv.MooncakeTransferEngine]]:
    """Two engines in this process: `a` writes, `b` receives (or the other way)."""
    with orbitkv.MooncakeTransferEngine() as a, orbitkv.MooncakeTransferEngine() as b:
        assert a.endpoint != b.endpoint
        yield a, b


Register = Callable[..., tuple[int, int]]


@pytest.fixture
def register() -> Iterator[Register]:
    """`register(engine, region, **kw)`: registers and unregisters at teardown."""
    done: list[tuple[orbitkv.MooncakeTransferEngine, int]] = []

    def _register(engine: orbitkv.MooncakeTransferEngine, region: Any, **kw: Any) -> tuple[int, int]:
        registered = engine.register_memory(region, **kw)
        done.append((engine, registered[0]))
        return registered

    yield _register
    for engine, start in reversed(done):
        if engine.closed:
            continue
        try:
            engine.unregister_memory(start)
        except orbitkv.RegistrationError:
            pass  # the test unregistered it itself


@pytest.fixture
def regions(register: Register) -> Callable[..., tuple[np.ndarray, np.ndarray]]:
    """`regions(a, b, nbytes, seed)`: `nbytes` random bytes registered with
    `a` and a zeroed destination of the same size registered with `b`."""

    def make(
        a: orbitkv.MooncakeTransferEngine, b: orbitkv.MooncakeTransferEngine, nbytes: int, seed: int
    ) -> tuple[np.ndarray, np.ndarray]:
        src = np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)
        dst = np.zeros_like(src)
        register(a, src)
        register(b, dst)
        return src, dst

    return make
