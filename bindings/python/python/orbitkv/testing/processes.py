"""The processes of a test cluster: free loopback ports, a process in its
own group logging to a file (``Proc``), and bounded waits that fail at once,
naming the log, when a process dies (``wait_until``). Used by
``orbitkv.testing.cluster``."""

from __future__ import annotations

import contextlib
import http.client
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"


class ClusterError(RuntimeError):
    """A process of the cluster failed to start, died, or a wait ran out."""


# Ports handed out: below the kernel's ephemeral range (32768+ by default),
# so no outgoing connection takes one between our check and the server's
# bind, and away from Mooncake's (12001, 15000-17000).
_PORTS = (20000, 32000)
_taken: set[int] = set()
_ports_lock = threading.Lock()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, with the
    ``span - 1`` ports after it free too (a TP instance's side channels),
    outside the ephemeral range and never handed out twice by this process."""
    rng = random.Random()
    with _ports_lock:
        for _ in range(500):
            p = rng.randrange(_PORTS[0], _PORTS[1] - span)
            ports = range(p, p + span)
            if not _taken.intersection(ports) and all(_bindable(q) for q in ports):
                _taken.update(ports)
                return p
    raise ClusterError(f"no {span} free port(s) in {_PORTS[0]}..{_PORTS[1]}")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text[-lines:])


class Proc:
    """One process of the cluster, in its own process group, logging to a file."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log_path: Path):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "ab", buffering=0)
        self._log.write(f"# {time.strftime('%H:%M:%S')} {' '.join(self.argv)}\n".encode())
        self.popen = subprocess.Popen(
            self.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killpg reaches vLLM's children
        )
        self.pgid = self.popen.pid
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def check(self) -> None:
        """Raises :class:`ClusterError` (with the log's tail) if the process ended."""
        rc = self.popen.poll()
        if rc is not None:
            raise ClusterError(
                f"{self.name} (pid {self.pid}) exited with {rc}; log {self.log_path}:\n{_tail(self.log_path)}"
            )

    def _signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.pgid, sig)
            return True
        except ProcessLookupError:
            return False

    def group_alive(self) -> bool:
        """Whether any process of its group is left (vLLM's children included)."""
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def kill(self) -> None:
        """SIGKILL to the whole group, now (a crash, as far as peers can tell)."""
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the process (vLLM's API server then shuts its engine
        down), after half of ``grace_s`` SIGTERM to the whole group, and
        SIGKILL to what is left after ``grace_s``."""
        if self.group_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            group_term = time.monotonic() + grace_s / 2
            while time.monotonic() < deadline and self.group_alive():
                if self.popen.poll() is not None or time.monotonic() >= group_term:
                    if group_term < float("inf"):
                        self._signal_group(signal.SIGTERM)
                        group_term = float("inf")
                time.sleep(0.1)
            self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        with contextlib.suppress(OSError):
            self._log.close()


def wait_until(
    pred: Any, timeout_s: float, what: str | Any, procs: Sequence[Proc] = (), every_s: float = 0.1
) -> Any:
    """Polls ``pred()`` until it returns something truthy (returned), checking
    that ``procs`` are alive between polls. Raises :class:`ClusterError` when
    a process died or ``timeout_s`` passed (``what``, a string or a callable
    giving one, says what was awaited)."""
    deadline = time.monotonic() + timeout_s
    last_exc: BaseException | None = None
    while True:
        for p in procs:
            p.check()
        try:
            got = pred()
            if got:
                return got
        except (OSError, http.client.HTTPException, ValueError) as e:
            last_exc = e
        if time.monotonic() >= deadline:
            extra = f" (last error: {type(last_exc).__name__}: {last_exc})" if last_exc else ""
            desc = what() if callable(what) else what
            raise ClusterError(f"timed out after {timeout_s:.0f}s waiting for {desc}{extra}")
        time.sleep(every_s)


# ---- HTTP client helpers ---------------------------------------------------
