"""Test-cluster only: patches to vLLM in the servers `orbitkv.testing.cluster`
starts (this folder is first on their ``PYTHONPATH``); each is inert unless
its ``ORBITKV_TESTING_*`` variable is set. Other processes never load it.

1. The upstream fix for a vLLM 0.26.0 hang with TP > 1 (below).
2. ``ORBITKV_TESTING_SKIP_LAYER_HOOK=<file>``: while that file exists, the
   attention layers skip vLLM's per-layer connector hooks
   (``maybe_transfer_kv_layer``: ``wait_for_layer_load`` and
   ``save_kv_layer``), as some model paths do (vllm-project/vllm#56762), so a
   test can show the connector sending those layers at ``wait_for_save``.
3. ``ORBITKV_TESTING_SCATTER_FREE_BLOCKS=1``: vLLM's block pool hands out
   its free blocks even IDs first, then odd ones (2, 4, 6, ..., 1, 3, ...),
   so that a request's blocks are never consecutive, as in a pool
   fragmented by load; a test of the writer's gather runs on it.

The TP hang:

vLLM 0.26.0's multiprocess executor broadcasts each step to the TP workers
through a shared-memory ring (``vllm/distributed/device_communicators/
shm_broadcast.py``). A worker that has been idle for a second parks on a
ZMQ notification, with no timeout (``dequeue(indefinite=True)``); the
notification is best effort (PUB ``SNDHWM=1`` drops silently, SUB
``CONFLATE``), so a lost one leaves that rank asleep while the others run
the step and wait for it in their first all-reduce, until some later
message happens to wake it. On the 2-core CI machine this stalled P/D
requests through a TP 2 instance for 15-30 s (py-spy: rank 0 in
``all_reduce`` inside the forward, rank 1 in ``SpinCondition.wait``).
vLLM fixed it upstream (vllm-project/vllm#45224: an idle reader re-checks
the ring at least every 5 s).

With ``ORBITKV_TESTING_SHM_RECHECK_MS`` set (the cluster sets it for every
instance) the reader's idle wait is capped at that many milliseconds, the
upstream fix's behaviour with a shorter period.

``ORBITKV_TESTING_SHM_SPIN_S`` (the cluster sets 0) replaces the readers'
busy-wait period (vLLM: 1 s after each read, spinning on ``sched_yield``).
While decode waits for remote KV its engine steps every millisecond, so its
worker and engine core never leave that busy loop; with a TP 2 prefill's two
ranks pinned to the same two cores as decode's worker, those spinners took
the CPU that the prefill's step and both API servers needed, and a P/D
request through a TP 2 prefill stalled for 15-60 s (top: decode's worker
and the prefill ranks at ~100 % while py-spy showed them waiting for a
step). Without the spin a reader waits in ``poll`` for the writer's
notification (capped as above).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

Patch = Callable[[ModuleType], None]

_TARGET = "vllm.distributed.device_communicators.shm_broadcast"


def _patch(module: ModuleType) -> None:
    cap = int(os.environ["ORBITKV_TESTING_SHM_RECHECK_MS"])
    cls = getattr(module, "SpinCondition", None)
    if cls is None or getattr(cls, "_orbitkv_capped", False):
        return
    wait = cls.wait

    def capped_wait(self: Any, timeout_ms: int | None = None) -> None:
        wait(self, cap if timeout_ms is None else min(timeout_ms, cap))

    cls.wait = capped_wait
    cls._orbitkv_capped = True

    spin_s = os.environ.get("ORBITKV_TESTING_SHM_SPIN_S")
    if spin_s is not None:
        init = cls.__init__

        def init_spin(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            if getattr(self, "is_reader", False):
                self.busy_loop_s = float(spin_s)

        cls.__init__ = init_spin


_HOOK_TARGET = "vllm.model_executor.layers.attention.kv_transfer_utils"


def _patch_layer_hook(module: ModuleType) -> None:
    flag = os.environ["ORBITKV_TESTING_SKIP_LAYER_HOOK"]
    hooked = module.maybe_transfer_kv_layer

    def maybe_transfer_kv_layer(func: Callable[..., Any]) -> Callable[..., Any]:
        with_hooks = hooked(func)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if os.path.exists(flag):
                return func(*args, **kwargs)  # no connector hook for this layer
            return with_hooks(*args, **kwargs)

        return wrapper

    setattr(module, "maybe_transfer_kv_layer", maybe_transfer_kv_layer)  # noqa: B010 - a vLLM module


_POOL_TARGET = "vllm.v1.core.block_pool"


def _patch_block_pool(module: ModuleType) -> None:
    cls = module.BlockPool
    init = cls.__init__

    def scattered_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        free = self.free_block_queue.get_all_free_blocks()  # 1, 2, 3, ... (0 is the null block)
        self.free_block_queue = module.FreeKVCacheBlockQueue(free[1::2] + free[0::2])

    cls.__init__ = scattered_init


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Patch) -> None:
        self.inner = inner
        self.patch = patch

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, patches: dict[str, Patch]) -> None:
        self.patches = patches

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        patch = self.patches.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, patch)
        return spec


_patches: dict[str, Patch] = {}
if os.environ.get("ORBITKV_TESTING_SHM_RECHECK_MS"):
    _patches[_TARGET] = _patch
if os.environ.get("ORBITKV_TESTING_SKIP_LAYER_HOOK"):
    _patches[_HOOK_TARGET] = _patch_layer_hook
if os.environ.get("ORBITKV_TESTING_SCATTER_FREE_BLOCKS") == "1":
    _patches[_POOL_TARGET] = _patch_block_pool
if _patches:
    sys.meta_path.insert(0, _Finder(_patches))
