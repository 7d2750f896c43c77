"""Test-cluster only: the upstream fix for a vLLM 0.26.0 hang with TP > 1.

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

`orbitkv.testing.cluster` puts this folder first on ``PYTHONPATH`` of the
vLLM servers it starts when an instance has TP > 1 and
``ORBITKV_TESTING_SHM_RECHECK_MS`` is set (the cluster sets it): the
reader's idle wait is then capped at that many milliseconds, the upstream
fix's behaviour with a shorter period.

``ORBITKV_TESTING_SHM_SPIN_S`` (the cluster sets 0) replaces the readers'
busy-wait period (vLLM: 1 s after each read, spinning on ``sched_yield``).
While decode waits for remote KV its engine steps every millisecond, so its
worker and engine core never leave that busy loop; with a TP 2 prefill's two
ranks pinned to the same two cores as decode's worker, those spinners took
the CPU that the prefill's step and both API servers needed, and a P/D
request through a TP 2 prefill stalled for 15-60 s (top: decode's worker
and the prefill ranks at ~100 % while py-spy showed them waiting for a
step). Without the spin a reader waits in ``poll`` for the writer's
notification (capped as above). Nothing else changes; other processes never
load this file.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_TARGET = "vllm.distributed.device_communicators.shm_broadcast"


def _patch(module) -> None:  # noqa: ANN001 - a vLLM module
    cap = int(os.environ["ORBITKV_TESTING_SHM_RECHECK_MS"])
    cls = getattr(module, "SpinCondition", None)
    if cls is None or getattr(cls, "_orbitkv_capped", False):
        return
    wait = cls.wait

    def capped_wait(self, timeout_ms: int | None = None) -> None:
        return wait(self, cap if timeout_ms is None else min(timeout_ms, cap))

    cls.wait = capped_wait
    cls._orbitkv_capped = True

    spin_s = os.environ.get("ORBITKV_TESTING_SHM_SPIN_S")
    if spin_s is not None:
        init = cls.__init__

        def init_spin(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            init(self, *args, **kwargs)
            if getattr(self, "is_reader", False):
                self.busy_loop_s = float(spin_s)

        cls.__init__ = init_spin


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec):  # noqa: ANN001, ANN201
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:  # noqa: ANN001
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if os.environ.get("ORBITKV_TESTING_SHM_RECHECK_MS"):
    sys.meta_path.insert(0, _Finder())
