"""Helpers for the tests (fixtures are in conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

import orbitkv


def wait_event(rt: orbitkv.Runtime, kinds: set[str], timeout_s: float = 20.0) -> orbitkv.RuntimeEvent:
    """The runtime's next event of one of ``kinds`` (others are skipped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ev = rt.next_event(0.2)
        if ev is not None and ev.kind in kinds:
            return ev
    raise AssertionError(f"no {kinds} event within {timeout_s}s")


def addr(array: np.ndarray) -> int:
    """Address of a numpy array's first byte."""
    return int(array.ctypes.data)


def wait_for_notifications(
    engine: orbitkv.MooncakeTransferEngine, count: int, timeout_s: float = 10.0
) -> list[tuple[str, bytes]]:
    """Drains notifications until `count` arrived (or the deadline passes)."""
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got.extend(engine.take_notifications())
        if len(got) < count:
            time.sleep(0.005)
    return got


def run_python(code: str, env: dict[str, str | None] | None = None, timeout: float = 120.0) -> dict[str, Any]:
    """Runs `code` in a fresh interpreter (Mooncake is loaded once per process)
    and returns the JSON object it prints on its last stdout line. `env`
    entries set (or, when None, remove) environment variables."""
    full_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, (
        f"child failed (rc {proc.returncode})\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )
    return json.loads(lines[-1])
