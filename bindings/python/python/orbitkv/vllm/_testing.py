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

``ORBITKV_TESTING_WRITE_DELAY`` (prefill instance)
    A path. While that file exists and holds a number of seconds, each layer
    write a producer submits is handed to the runtime that much later, from a
    background thread (a slow link): prefill finishes computing before its KV
    has reached decode, which opens a window for "aborted during transfer".
    While the variable is set, writes go through that thread whenever the
    file holds a positive delay or earlier writes are still queued, so their
    order is kept.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("orbitkv.vllm.testing")

CORRUPT_ENV = "ORBITKV_TESTING_CORRUPT_AFTER_LOAD"
WRITE_DELAY_ENV = "ORBITKV_TESTING_WRITE_DELAY"


class Faults:
    """The worker's one seam to the test hooks: what it calls on its data
    path. These are the production no-ops; :class:`TestingHooks` overrides
    them. :func:`faults_from_env` makes the worker's one instance."""

    @property
    def delays_writes(self) -> bool:
        """Whether layer writes may be delayed (the worker then keeps a
        background thread for them)."""
        return False

    def write_delay(self, queued: int) -> float | None:
        """The delay to hand this layer's writes to the runtime with, from the
        background thread, given the calls ``queued`` there; None: write them
        the ordinary way."""
        return None

    def after_load(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, blocks: list[int] | None) -> None:
        """A consumer's KV load into ``blocks`` completed (after any staging
        scatter, before the request is reported to vLLM)."""


def faults_from_env() -> Faults:
    """The test hooks the environment asks for, else the no-ops."""
    return TestingHooks.from_env() or Faults()


def delayed(delay_s: float, fn: Any, *args: Any) -> None:
    """Calls ``fn(*args)`` after ``delay_s`` seconds (a slow link)."""
    if delay_s > 0:
        time.sleep(delay_s)
    fn(*args)


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

    @property
    def delays_writes(self) -> bool:
        return self.write_delay_file is not None

    def write_delay(self, queued: int) -> float | None:
        # Through the thread while the file holds a positive delay or earlier
        # writes are still queued there, so their order is kept.
        if not self.delays_writes or not (queued > 0 or self.write_delay_s() > 0):
            return None
        return self.write_delay_s()

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
