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


class Faults:
    """What the worker calls on its data path: the production no-ops;
    ``_testing.TestingHooks`` overrides them. :func:`faults_from_env` makes
    the worker's one instance."""

    def wrap_runtime(self, runtime: Runtime) -> Runtime:
        """The runtime the worker makes its calls on: ``runtime`` itself
        (the test hooks may put a slow link in front of it)."""
        return runtime

    def after_load(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, blocks: list[int] | None) -> None:
        """A consumer's KV load into ``blocks`` completed (after any staging
        scatter, before the request is reported to vLLM)."""


def faults_from_env() -> Faults:
    """The test hooks the environment asks for, else the no-ops (without
    importing the hooks' module)."""
    if not (os.environ.get(CORRUPT_ENV) or os.environ.get(WRITE_DELAY_ENV)):
        return Faults()
    from orbitkv.vllm._testing import TestingHooks

    return TestingHooks.from_env() or Faults()
