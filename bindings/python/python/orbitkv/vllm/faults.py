"""The worker's one seam to the test-only fault hooks.

:class:`Faults` is what the worker calls on its data path; these are the
production no-ops. The hooks themselves (``_testing.py``) are imported only
when the environment asks for one (an ``ORBITKV_TESTING_*`` variable set when
the worker is built), so a production worker never loads test code.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from orbitkv import Runtime

# The variables that turn a test hook on (``_testing.py`` reads them).
CORRUPT_ENV = "ORBITKV_TESTING_CORRUPT_AFTER_LOAD"
WRITE_DELAY_ENV = "ORBITKV_TESTING_WRITE_DELAY"
KV_DIGEST_ENV = "ORBITKV_TESTING_KV_DIGEST"


class Faults:
    """What the worker calls on its data path: the production no-ops;
    ``_testing.TestingHooks`` overrides them. :func:`faults_from_env` makes
    the worker's one instance."""

    def wrap_runtime(self, runtime: Runtime) -> Runtime:
        """The runtime the worker makes its calls on: ``runtime`` itself
        (the test hooks may put a slow link in front of it)."""
        return runtime

    def after_load(
        self, kv_caches: dict[str, torch.Tensor], num_blocks: int, blocks: list[int] | None, pd_id: str | None = None
    ) -> None:
        """A consumer's KV load into ``blocks`` completed (after any staging
        scatter, before the request is reported to vLLM); ``pd_id``: its P/D
        request id (the one both sides share)."""

    def consumer_opened(self, pd_id: str, first_block: int, block_ids: list[int], tokens: int) -> None:
        """A consumer authorized ``block_ids`` (the request's blocks from
        ``first_block`` on) for its tokens up to ``tokens``."""

    def producer_chunk(self, pd_id: str, new_block_ids: list[int]) -> None:
        """A producer's step chunk: the blocks vLLM gave the request in this
        step (its first chunk: every block it holds), in request order."""

    def before_send_done(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, pd_id: str) -> None:
        """A producer's sending is over (nothing reads its blocks any more):
        right before the worker reports it to vLLM, which frees the blocks."""


def faults_from_env() -> Faults:
    """The test hooks the environment asks for, else the no-ops (without
    importing the hooks' module)."""
    if not any(os.environ.get(v) for v in (CORRUPT_ENV, WRITE_DELAY_ENV, KV_DIGEST_ENV)):
        return Faults()
    from orbitkv.vllm._testing import TestingHooks

    return TestingHooks.from_env() or Faults()
