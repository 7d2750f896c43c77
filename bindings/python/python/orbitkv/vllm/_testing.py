"""Test-only fault hooks of the PdConnector worker, for the end-to-end tests.

Off unless the vLLM server runs with one of these environment variables
(read once, when the worker is built); ``docs/configuration.md`` lists them.
Never set them in production.

``ORBITKV_TESTING_CORRUPT_AFTER_LOAD`` (decode instance)
    ``1``: every KV load that completes gets one block corrupted. A path: the
    next load that completes while that file exists gets one block corrupted,
    and the file is removed (one shot). The corrupted block is the first
    block the request authorized: its bytes are changed (the sign bit of every
    element flipped, in every layer) after the consumer completed and before
    the request is reported to vLLM, so decode computes on KV that differs
    from the prefill's. It shows that decode really uses the transferred KV.

``ORBITKV_TESTING_WRITE_DELAY`` (prefill instance, CPU)
    A path. While that file exists and holds a number of seconds, each layer
    hand-over (``Runtime.layers_ready``) reaches the runtime that much later,
    from a background thread (a slow link, :class:`SlowLink`, put in front
    of the worker's runtime once, when it starts): prefill finishes
    computing before its KV has reached decode, which opens a window for
    "aborted during transfer". While the variable is set, hand-overs go
    through that thread whenever the file holds a positive delay or earlier
    ones are still queued, and a finish goes behind those still queued, so
    their order is kept. The worker's own dispatch has no branch for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from orbitkv import OrbitKVError
from orbitkv.vllm.faults import CORRUPT_ENV, WRITE_DELAY_ENV, Faults
from orbitkv.vllm.faults import faults_from_env as _faults_from_env

if TYPE_CHECKING:
    from orbitkv import Runtime

logger = logging.getLogger("orbitkv.vllm.testing")



def faults_from_env() -> Faults:
    """The test hooks the environment asks for, else the no-ops
    (``faults.faults_from_env``, which the worker calls)."""
    return _faults_from_env()


class SlowLink:
    """A slow link in front of a runtime (``ORBITKV_TESTING_WRITE_DELAY``):
    ``layers_ready`` reaches the runtime ``delay_s()`` seconds later, from a
    background thread, while the delay is positive or earlier calls are
    still queued there (then it answers that nothing was refused; the
    thread logs what the runtime refused); ``producer_finish`` goes behind
    the calls still queued; every other call goes straight through."""

    def __init__(self, runtime: Runtime, delay_s: Any) -> None:
        self._rt = runtime
        self._delay_s = delay_s
        self._q: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._t = threading.Thread(target=self._run, name="orbitkv-testing-slow-link", daemon=True)
        self._t.start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            delay, fn, args = item
            try:
                if delay > 0:
                    time.sleep(delay)
                refused = fn(*args)
                for pd_id, err in refused or ():
                    logger.debug("slow link: %s for %s refused: %s", fn.__name__, pd_id, err)
            except OrbitKVError as e:
                logger.debug("slow link: %s failed: %s", fn.__name__, e)
            except Exception:
                logger.exception("slow link: %s failed", fn.__name__)
            finally:
                with self._lock:
                    self._pending -= 1

    def _put(self, delay: float, fn: Any, *args: Any) -> None:
        with self._lock:
            self._pending += 1
        self._q.put((delay, fn, args))

    def _queued(self) -> int:
        with self._lock:
            return self._pending

    def layers_ready(self, layer: int, chunks: list[tuple[str, int, int]]) -> list[tuple[str, Exception]]:
        delay = self._delay_s()
        if delay <= 0 and self._queued() == 0:
            return self._rt.layers_ready(layer, chunks)
        self._put(delay, self._rt.layers_ready, layer, chunks)
        return []

    def producer_finish(self, pd_id: str) -> None:
        if self._queued() == 0:
            self._rt.producer_finish(pd_id)
        else:
            self._put(0.0, self._rt.producer_finish, pd_id)

    def shutdown(self) -> None:
        self._q.put(None)
        self._t.join(timeout=10)
        self._rt.shutdown()


@dataclass
class TestingHooks(Faults):
    corrupt: str | None = None  # "1" (always) or a path (one shot while it exists)
    write_delay_file: str | None = None

    @staticmethod
    def from_env() -> TestingHooks | None:
        corrupt = os.environ.get(CORRUPT_ENV) or None
        delay = os.environ.get(WRITE_DELAY_ENV) or None
        if corrupt is None and delay is None:
            return None
        logger.warning(
            "OrbitKV TEST HOOKS ENABLED (%s=%r, %s=%r): not for production",
            CORRUPT_ENV,
            corrupt,
            WRITE_DELAY_ENV,
            delay,
        )
        return TestingHooks(corrupt, delay)

    def take_corruption(self) -> bool:
        """Whether to corrupt the load that just completed (consumes a one-shot)."""
        if self.corrupt is None:
            return False
        if self.corrupt == "1":
            return True
        try:
            os.remove(self.corrupt)
        except FileNotFoundError:
            return False
        except OSError as e:
            logger.warning("corruption hook: cannot remove %s: %s", self.corrupt, e)
            return False
        return True

    def write_delay_s(self) -> float:
        if self.write_delay_file is None:
            return 0.0
        try:
            with open(self.write_delay_file) as f:
                return max(0.0, float(f.read().strip() or 0))
        except (OSError, ValueError):
            return 0.0

    def wrap_runtime(self, runtime: Runtime) -> Runtime:
        if self.write_delay_file is None:
            return runtime
        return cast("Runtime", SlowLink(runtime, self.write_delay_s))

    def after_load(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, blocks: list[int] | None) -> None:
        # Decode must compute on changed KV: the first block the request
        # authorized. A one-shot is consumed even when there is no block.
        if self.take_corruption() and blocks:
            corrupt_block(kv_caches, num_blocks, blocks[0])


def corrupt_block(kv_caches: dict[str, torch.Tensor], num_blocks: int, block_id: int) -> None:
    """Flips the sign bit of every element of ``block_id`` in every layer."""
    with torch.no_grad():
        for t in kv_caches.values():
            if t.shape[0] == num_blocks:
                view = t[block_id]
            else:  # [2, num_blocks, ...]
                view = t[:, block_id]
            view.neg_()
    with contextlib.suppress(Exception):
        logger.warning("TEST HOOK: corrupted block %d in %d layers", block_id, len(kv_caches))
