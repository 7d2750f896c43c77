"""The PdConnector's bookkeeping rules, step by step, without servers.

vLLM's `Request`, `KVCacheBlocks` and `SchedulerOutput` are replaced by small
test doubles carrying only the fields the connector reads, and the worker's
runtime by `RecordingRuntime`, a test double that records calls and hands out
the events a test queues. The real runtime, Mooncake and vLLM are exercised by
`test_runtime.py` and `e2e/`; this file pins the rules that keep vLLM's block
accounting right: every request's blocks are reported back exactly once, and
never while vLLM still runs the request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import inspect
import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import orbitkv
from orbitkv.staging import StagingCopier
from orbitkv.vllm import params as kvp
from orbitkv.vllm.config import PdConfig
from orbitkv.vllm.metadata import ConsumerOpen, PdConnectorMetadata, ProducerChunk, RequestEnd
from orbitkv.vllm.scheduler import PdScheduler
from orbitkv.vllm.worker import PdWorker

BS = 16


@dataclass
class FakeRequest:
    """Test double of vLLM's Request."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    status: str = "RUNNING"


@dataclass
class FakeBlocks:
    """Test double of KVCacheBlocks: `hashed` leading blocks from the prefix cache."""

    ids: list[int]
    hashed: int = 0

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)

    def get_unhashed_block_ids(self) -> list[int]:
        return self.ids[self.hashed :]


@dataclass
class FakeNewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class FakeCached:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[Any] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


def sched_output(new=(), cached: FakeCached | None = None, scheduled: dict[str, int] | None = None) -> Any:
    """Test double of SchedulerOutput."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or FakeCached(),
        num_scheduled_tokens=scheduled or {},
    )


def scheduler() -> PdScheduler:
    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS), parallel_config=SimpleNamespace(tensor_parallel_size=1))
    return PdScheduler(cfg, PdConfig())  # type: ignore[arg-type]


CAP = "0123456789abcdef" * 4


def consumer(rid: str, n_tokens: int, pd: str = "pd-1") -> FakeRequest:
    params = {
        "orbitkv_role": "consumer",
        "orbitkv_request": pd,
        "orbitkv_capability": CAP,
        "orbitkv_prefill_kv": "127.0.0.1:17500",
    }
    return FakeRequest(rid, list(range(n_tokens)), params)


def producer(rid: str, n_tokens: int, pd: str = "pd-1") -> FakeRequest:
    params = {"orbitkv_role": "producer", "orbitkv_request": pd, "orbitkv_capability": CAP}
    return FakeRequest(rid, list(range(n_tokens)), params)


def out(recving=(), sending=(), invalid=()) -> Any:
    return SimpleNamespace(finished_recving=set(recving), finished_sending=set(sending), invalid_block_ids=set(invalid))


# ---- scheduler, decode side ---------------------------------------------------------


def test_consumer_loads_the_prompt_once_and_skips_its_prefix_hit() -> None:
    s = scheduler()
    r = consumer("d1", 40)
    assert s.get_num_new_matched_tokens(r, 16) == (24, True)
    s.update_state_after_alloc(r, FakeBlocks([7, 8, 9], hashed=1), 24)
    # Asked again (a retry after a load error): nothing more to load.
    assert s.get_num_new_matched_tokens(r, 16) == (0, False)
    s.update_state_after_alloc(r, FakeBlocks([7, 8, 9], hashed=1), 0)
    meta = s.build_connector_meta(sched_output())
    assert [(o.pd_id, o.first_block, o.block_ids) for o in meta.consumers_open] == [("pd-1", 1, [8, 9])]
    assert s.build_connector_meta(sched_output()).consumers_open == []


def test_consumer_finished_before_authorization_frees_now_and_cancels_the_producer() -> None:
    s = scheduler()
    r = consumer("d1", 40)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, FakeBlocks([1, 2, 3]), 40)
    assert s.request_finished(r, [1, 2, 3]) == (False, None)
    meta = s.build_connector_meta(sched_output())
    assert meta.consumers_open == []
    assert [c.pd_id for c in meta.consumers_cancel] == ["pd-1"]
    # Never allocated at all (aborted while queued): cancelled too.
    q = consumer("d2", 40, pd="pd-2")
    assert s.request_finished(q, []) == (False, None)
    assert [c.pd_id for c in s.build_connector_meta(sched_output()).consumers_cancel] == ["pd-2"]


def test_consumer_aborted_while_waiting_keeps_its_blocks_until_reported() -> None:
    s = scheduler()
    r = consumer("d1", 40)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, FakeBlocks([1, 2, 3]), 40)
    s.build_connector_meta(sched_output())
    assert s.request_finished(r, [1, 2, 3]) == (True, None)
    ends = s.build_connector_meta(sched_output()).consumers_end
    assert [(e.pd_id, e.report) for e in ends] == [("pd-1", True)]
    assert s.has_pending_push_work()
    s.update_connector_output(out(recving={"d1"}))
    assert not s.has_pending_push_work()


def test_consumer_finished_after_its_load_frees_at_once() -> None:
    s = scheduler()
    r = consumer("d1", 40)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, FakeBlocks([1, 2, 3]), 40)
    s.build_connector_meta(sched_output())
    s.update_connector_output(out(recving={"d1"}))  # KV arrived
    r.status = "FINISHED_STOPPED"
    assert s.request_finished(r, [1, 2, 3]) == (False, None)
    ends = s.build_connector_meta(sched_output()).consumers_end
    assert [(e.pd_id, e.report) for e in ends] == [("pd-1", False)]


def test_consumer_whose_load_failed_and_was_recomputed_keeps_its_blocks_until_reported_again() -> None:
    """Recompute policy: a failed load (maybe at the deadline, a producer that
    never ended may still write) runs on; when vLLM finishes the request the
    blocks wait for the worker's second report."""
    s = scheduler()
    r = consumer("d1", 40)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, FakeBlocks([1, 2, 3]), 40)
    s.build_connector_meta(sched_output())
    s.update_connector_output(out(recving={"d1"}, invalid={2, 3}))  # the failed load
    r.status = "FINISHED_LENGTH_CAPPED"  # recomputed and decoded
    assert s.request_finished(r, [1, 2, 3]) == (True, None)
    ends = s.build_connector_meta(sched_output()).consumers_end
    assert [(e.pd_id, e.report, e.after_load) for e in ends] == [("pd-1", True, True)]
    assert s.has_pending_push_work()
    s.update_connector_output(out(recving={"d1"}))  # the worker's second report
    assert not s.has_pending_push_work()

    # Another request's failed blocks do not make this load a failure.
    r2 = consumer("d2", 40)
    s.get_num_new_matched_tokens(r2, 0)
    s.update_state_after_alloc(r2, FakeBlocks([7, 8, 9]), 40)
    s.update_connector_output(out(recving={"d2"}, invalid={2, 3}))
    r2.status = "FINISHED_STOPPED"
    assert s.request_finished(r2, [7, 8, 9]) == (False, None)


def test_a_failed_load_seen_only_after_vllm_ended_the_request_is_withheld_until_released() -> None:
    """With async scheduling (vLLM's GPU default) a client abort can end the
    request between the worker's report of a failed load and the scheduler
    seeing it. vLLM frees a finished request's blocks on that report, while
    a producer that never ended may still write into them: the report is
    withheld and the worker asked to report again once the runtime released
    them. A load that completed is not held back."""
    s = scheduler()
    r = consumer("d1", 40)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, FakeBlocks([1, 2, 3]), 40)
    s.build_connector_meta(sched_output())
    r.status = "FINISHED_ABORTED"
    assert s.request_finished(r, [1, 2, 3]) == (True, None)  # before the report was seen
    report = out(recving={"d1"}, invalid={2, 3})
    s.update_connector_output(report)
    assert "d1" not in report.finished_recving, "vLLM would free blocks a late write may still reach"
    ends = s.build_connector_meta(sched_output()).consumers_end
    assert [(e.pd_id, e.report, e.after_load) for e in ends] == [("pd-1", True, False), ("pd-1", True, True)]
    assert s.has_pending_push_work()
    again = out(recving={"d1"})  # the worker, once the runtime released them
    s.update_connector_output(again)
    assert again.finished_recving == {"d1"} and not s.has_pending_push_work()

    r2 = consumer("d2", 40, pd="pd-2")
    s.get_num_new_matched_tokens(r2, 0)
    s.update_state_after_alloc(r2, FakeBlocks([7, 8, 9]), 40)
    s.build_connector_meta(sched_output())
    r2.status = "FINISHED_ABORTED"
    assert s.request_finished(r2, [7, 8, 9]) == (True, None)
    done = out(recving={"d2"})  # complete: every producer ended
    s.update_connector_output(done)
    assert done.finished_recving == {"d2"}
    ends = s.build_connector_meta(sched_output()).consumers_end
    assert [(e.pd_id, e.report, e.after_load) for e in ends] == [("pd-2", True, False)]
    assert not s.has_pending_push_work()


# ---- scheduler, prefill side --------------------------------------------------------


def test_producer_chunks_cover_every_block_and_resend_a_partial_one() -> None:
    s = scheduler()
    r = producer("p1", 40)  # 3 blocks of 16: the last one partial
    s.update_state_after_alloc(r, FakeBlocks([]), 0)
    m1 = s.build_connector_meta(sched_output([FakeNewReq("p1", ([4, 5],), 0)], scheduled={"p1": 24}))
    (c1,) = m1.producer_chunks
    assert (c1.opens, c1.new_block_ids, c1.start_block, c1.end_block, c1.last) == (True, [4, 5], 0, 2, False)
    cached = FakeCached(["p1"], set(), [([6],)], [24])
    (c2,) = s.build_connector_meta(sched_output(cached=cached, scheduled={"p1": 16})).producer_chunks
    # Block 1 was half written by the first chunk: it is sent again.
    assert (c2.opens, c2.new_block_ids, c2.start_block, c2.end_block, c2.last) == (False, [6], 1, 3, True)
    # The decode steps after the prompt stream nothing more.
    cached = FakeCached(["p1"], set(), [None], [40])
    assert s.build_connector_meta(sched_output(cached=cached, scheduled={"p1": 1})).producer_chunks == []


def finished_producer() -> tuple[PdScheduler, Any]:
    """A scheduler with prefill request `p1` (`pd-1`, blocks 1 and 2)
    scheduled whole and finished by vLLM, its blocks held for the writes;
    the step's metadata, which ends it on the workers."""
    s = scheduler()
    r = producer("p1", 20)
    s.update_state_after_alloc(r, FakeBlocks([]), 0)
    s.build_connector_meta(sched_output([FakeNewReq("p1", ([1, 2],), 0)], scheduled={"p1": 20}))
    r.status = "FINISHED_LENGTH_CAPPED"
    assert s.request_finished(r, [1, 2]) == (True, None)
    return s, s.build_connector_meta(sched_output())


def test_producer_blocks_are_held_until_its_writes_drained() -> None:
    s, meta = finished_producer()
    (end,) = meta.producers_end
    assert (end.pd_id, end.aborted, end.report) == ("pd-1", False, True)
    assert s.has_pending_push_work()
    s.update_connector_output(out(sending={"p1"}))
    assert not s.has_pending_push_work()
    # Never scheduled: nothing to hold.
    q = producer("p2", 20, pd="pd-2")
    s.update_state_after_alloc(q, FakeBlocks([]), 0)
    assert s.request_finished(q, []) == (False, None)


def test_vllm_keeps_stepping_while_requests_reported_sent_early_still_drain() -> None:
    """A request whose pages went back early is reported sent before its
    release; the workers say how many such still drain (summed over the
    ranks), and vLLM keeps stepping until none does, so their release is
    seen (and counted) without waiting for the next request."""
    from orbitkv.vllm.pd import PdWorkerMeta

    s, _ = finished_producer()
    ranks = PdWorkerMeta(1).aggregate(PdWorkerMeta(1)).aggregate(None)
    early = out(sending={"p1"})
    early.kv_connector_worker_meta = ranks
    s.update_connector_output(early)
    assert s.has_pending_push_work(), "two ranks still drain it"
    s.update_connector_output(out())  # a step without the workers' word: as it was
    assert s.has_pending_push_work()
    done = out()
    done.kv_connector_worker_meta = PdWorkerMeta(0).aggregate(PdWorkerMeta(0))
    s.update_connector_output(done)
    assert not s.has_pending_push_work()


# ---- worker reporting ---------------------------------------------------------------


class RecordingRuntime:
    """Test double of `orbitkv.Runtime`, spec'd by it: records calls,
    returns queued events. A method the real `Runtime` does not have, or a
    call its signature does not accept, fails the test (an API change
    cannot pass unseen); `test_the_recording_runtime_is_specd_by_the_real_one`
    holds the methods written out below to the same rule."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.events: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        real = getattr(orbitkv.Runtime, name)  # AttributeError: not the Runtime's
        sig = inspect.signature(real)

        def call(*a: Any, **kw: Any) -> Any:
            sig.bind(self, *a, **kw)  # TypeError: the real one would refuse these arguments
            self.calls.append((name, *a, *kw.items()))
            return "{}"

        return call

    def staged_layout(self, capacity: int) -> dict[str, Any]:
        return {"units": 1, "bytes": 4096 * capacity, "slots": [[(0, 4096)]]}

    def producer_gather_order(
        self, request_id: str, start_block: int, end_block: int, *, pin_first: bool = True, pin_last: bool = True
    ) -> list[int] | None:
        return None  # the request's order (no authorization written into pages here)

    def producer_claimed(self, request_id: str) -> bool:
        return False  # no decode's handshake reached it here

    def add_source_staging(self, segments: list[tuple[int, int]]) -> tuple[int, int]:
        self.calls.append(("add_source_staging", segments))
        return len(segments), sum(n for _, n in segments)

    def layers_ready(self, layer: int, chunks: list[tuple[str, int, int]]) -> list[tuple[str, Exception]]:
        self.calls.append(("layers_ready", layer, chunks))
        return []  # every request admitted

    def poll_events(self) -> list[Any]:
        ev, self.events = self.events, []
        return ev


def test_the_recording_runtime_is_specd_by_the_real_one() -> None:
    rt = RecordingRuntime()
    for name, fn in vars(RecordingRuntime).items():
        if name.startswith("_") or not callable(fn):
            continue
        real = inspect.signature(getattr(orbitkv.Runtime, name))
        mine = inspect.signature(fn)
        assert [p.name for p in mine.parameters.values()][1:] == [
            p.name for p in real.parameters.values()
        ][1:], f"{name}: {mine} vs the real {real}"
    with pytest.raises(AttributeError):
        rt.no_such_method()
    with pytest.raises(TypeError):
        rt.layer_ready("r", 0)  # the real one takes (request_id, layer, start, end)


def ev(kind: str, pd: str, **kw: Any) -> Any:
    return SimpleNamespace(kind=kind, request_id=pd, reason=kw.get("reason"), outcome=kw.get("outcome"))


@pytest.fixture
def worker() -> PdWorker:
    cfg = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2),
    )
    w = PdWorker(cfg, PdConfig())  # type: ignore[arg-type]
    w.runtime = RecordingRuntime()  # type: ignore[assignment]
    return w


def test_the_step_work_runs_when_the_metadata_is_bound_before_the_forward() -> None:
    """vLLM 0.32 calls start_load_kv after the forward when no load is
    synchronous; the forward's save_kv_layer calls must already know the
    step's producer chunks, so the work runs at bind time (before the forward
    in 0.26 and 0.32) and start_load_kv adds nothing."""
    from orbitkv.vllm.pd import PdConnector

    c = object.__new__(PdConnector)
    calls: list[PdConnectorMetadata] = []
    c.worker = SimpleNamespace(start_load_kv=calls.append)  # type: ignore[assignment]
    meta = PdConnectorMetadata()
    c.bind_connector_metadata(meta)
    assert calls == [meta]
    c.start_load_kv(None)  # type: ignore[arg-type]
    assert calls == [meta]


def test_producer_reported_only_after_vllm_finished_it(worker: PdWorker) -> None:
    rt = worker.runtime
    meta = PdConnectorMetadata()
    meta.producer_chunks.append(ProducerChunk("p1", "pd-1", CAP, 1, True, [1], 0, 1, False))
    worker.start_load_kv(meta)
    # Preempted: aborted, but vLLM still runs the request: no report.
    worker.start_load_kv(PdConnectorMetadata(producers_end=[RequestEnd("p1", "pd-1", True, "preempted", report=False)]))
    rt.events.append(ev("producer_released", "pd-1", outcome="aborted"))
    assert worker.get_finished() == (None, None)
    # vLLM finishes it: now, and only now, its blocks are reported, once.
    worker.start_load_kv(PdConnectorMetadata(producers_end=[RequestEnd("p1", "pd-1", False, "done", report=True)]))
    assert worker.get_finished() == ({"p1"}, None)
    assert worker.get_finished() == (None, None)
    # Nothing is left of it in the worker's ledger.
    assert worker.ledger.sizes() == {"consumers": 0, "producers": 0, "released_after_report": 0}


def test_consumer_reported_exactly_once(worker: PdWorker) -> None:
    rt = worker.runtime
    worker.start_load_kv(PdConnectorMetadata(consumers_open=[ConsumerOpen("d1", "pd-1", CAP, 0, [3, 4], "127.0.0.1:1", 1)]))
    rt.events.append(ev("consumer_failed", "pd-1", reason="producer aborted"))
    assert worker.get_finished() == (None, {"d1"})
    assert worker.get_block_ids_with_load_errors() == {3, 4}
    # vLLM ends it after the report: the release is bookkeeping only.
    worker.start_load_kv(PdConnectorMetadata(consumers_end=[RequestEnd("d1", "pd-1", False, "", report=False)]))
    rt.events.append(ev("consumer_released", "pd-1"))
    assert worker.get_finished() == (None, None)

    # Aborted while waiting: reported once no producer can write any more.
    worker.start_load_kv(PdConnectorMetadata(consumers_open=[ConsumerOpen("d2", "pd-2", CAP, 0, [5], "127.0.0.1:1", 1)]))
    worker.start_load_kv(PdConnectorMetadata(consumers_end=[RequestEnd("d2", "pd-2", True, "aborted", report=True)]))
    rt.events.append(ev("consumer_completed", "pd-2"))  # a late completion is not a report
    assert worker.get_finished() == (None, None)
    rt.events.append(ev("consumer_released", "pd-2"))
    assert worker.get_finished() == (None, {"d2"})
    assert worker.ledger.sizes() == {"consumers": 0, "producers": 0, "released_after_report": 0}


def test_held_failure_is_reported_only_once_nothing_can_write(worker: PdWorker) -> None:
    """A failure at the deadline with a producer that never ended: vLLM gets
    the failed blocks at once, but the request's report (which lets vLLM free
    or recompute the blocks) only once the runtime says no write can land."""
    rt = worker.runtime
    worker.recompute_failed_loads = False  # kv_load_failure_policy "fail"
    worker.start_load_kv(PdConnectorMetadata(consumers_open=[ConsumerOpen("d1", "pd-1", CAP, 0, [3, 4], "127.0.0.1:1", 1)]))
    rt.events.append(
        SimpleNamespace(kind="consumer_failed", request_id="pd-1", reason="timed out", outcome=None, held=True)
    )
    assert worker.get_finished() == (None, None)
    assert worker.get_block_ids_with_load_errors() == {3, 4}
    # The producer's late notice quiesces it before vLLM ended it: reported.
    rt.events.append(ev("consumer_quiesced", "pd-1"))
    assert worker.get_finished() == (None, {"d1"})
    worker.start_load_kv(PdConnectorMetadata(consumers_end=[RequestEnd("d1", "pd-1", True, "", report=True)]))
    rt.events.append(ev("consumer_released", "pd-1"))
    assert worker.get_finished() == (None, None)

    # Fail policy: vLLM fails the request on the failed blocks and waits for
    # the report to free them; the runtime's release gives it.
    worker.start_load_kv(PdConnectorMetadata(consumers_open=[ConsumerOpen("d2", "pd-2", CAP, 0, [5], "127.0.0.1:1", 1)]))
    rt.events.append(
        SimpleNamespace(kind="consumer_failed", request_id="pd-2", reason="timed out", outcome=None, held=True)
    )
    assert worker.get_finished() == (None, None)
    worker.start_load_kv(PdConnectorMetadata(consumers_end=[RequestEnd("d2", "pd-2", True, "error", report=True)]))
    assert ("consumer_release", "pd-2") in rt.calls
    assert worker.get_finished() == (None, None)
    rt.events.append(ev("consumer_released", "pd-2"))
    assert worker.get_finished() == (None, {"d2"})
    assert worker.get_finished() == (None, None)


def test_held_failure_under_recompute_is_reported_at_once_and_again_when_released(worker: PdWorker) -> None:
    """vLLM's default policy recomputes a failed load into the same blocks at
    once (no wait past the deadline); the blocks are held after the request
    ends until the runtime releases them."""
    rt = worker.runtime
    assert worker.recompute_failed_loads  # vLLM's default
    worker.start_load_kv(PdConnectorMetadata(consumers_open=[ConsumerOpen("d1", "pd-1", CAP, 0, [3, 4], "127.0.0.1:1", 1)]))
    rt.events.append(
        SimpleNamespace(kind="consumer_failed", request_id="pd-1", reason="timed out", outcome=None, held=True)
    )
    assert worker.get_finished() == (None, {"d1"})
    assert worker.get_block_ids_with_load_errors() == {3, 4}
    worker.start_load_kv(
        PdConnectorMetadata(consumers_end=[RequestEnd("d1", "pd-1", False, "", report=True, after_load=True)])
    )
    assert ("consumer_release", "pd-1") in rt.calls
    assert worker.get_finished() == (None, None)
    rt.events.append(ev("consumer_released", "pd-1"))
    assert worker.get_finished() == (None, {"d1"})
    assert worker.get_finished() == (None, None)


@pytest.mark.parametrize("released_first", [True, False], ids=["released-first", "rearmed-first"])
def test_a_withheld_report_is_made_again_once_released_and_only_then(worker: PdWorker, released_first: bool) -> None:
    """The worker's half of the withheld report: vLLM ended the request
    (RequestEnd, report) after the worker reported a held failure; the
    scheduler withheld that report and re-arms it (RequestEnd, after_load).
    The worker reports once the runtime released the blocks, whichever of
    the release and the re-arm comes first, never sooner, and releases once."""
    rt = worker.runtime
    worker.start_load_kv(PdConnectorMetadata(consumers_open=[ConsumerOpen("d1", "pd-1", CAP, 0, [3, 4], "127.0.0.1:1", 1)]))
    rt.events.append(
        SimpleNamespace(kind="consumer_failed", request_id="pd-1", reason="timed out", outcome=None, held=True)
    )
    assert worker.get_finished() == (None, {"d1"})  # recompute: at once
    worker.start_load_kv(PdConnectorMetadata(consumers_end=[RequestEnd("d1", "pd-1", True, "aborted", report=True)]))
    rearm = PdConnectorMetadata(consumers_end=[RequestEnd("d1", "pd-1", True, "", report=True, after_load=True)])
    if released_first:
        rt.events.append(ev("consumer_released", "pd-1"))
        assert worker.get_finished() == (None, None)
        worker.start_load_kv(rearm)
        assert worker.get_finished() == (None, {"d1"})
    else:
        worker.start_load_kv(rearm)
        assert worker.get_finished() == (None, None), "reported while a producer may still write"
        rt.events.append(ev("consumer_released", "pd-1"))
        assert worker.get_finished() == (None, {"d1"})
    assert worker.get_finished() == (None, None)
    assert [c for c in rt.calls if c[0] == "consumer_release"] == [("consumer_release", "pd-1")]


def test_a_report_withheld_after_a_release_in_the_same_step_is_made_again(worker: PdWorker) -> None:
    """The decode KV leak the 30-minute soak found (3.9 % of decode's KV held
    with nothing running): the client aborted (vLLM's RequestEnd, report)
    while the producer's `aborted` notice was on its way, so the runtime
    emitted `consumer_failed` and `consumer_released` in one poll. The worker
    reported the request (with its failed blocks); the scheduler withheld that
    report (a failed load seen after vLLM ended the request) and asked again
    (RequestEnd, after_load). The runtime no longer knows the consumer
    (released), and the ledger had tidied it: the report must still be made,
    or vLLM holds the blocks forever."""
    import orbitkv

    class Released(RecordingRuntime):
        """The runtime after the consumer was released: a second release is unknown."""

        def consumer_release(self, pd: str) -> None:
            self.calls.append(("consumer_release", pd))
            if sum(1 for c in self.calls if c[0] == "consumer_release") > 1:
                raise orbitkv.UnknownRequestError("released", kind="UnknownRequest", request_id=pd)

    rt = Released()
    worker.runtime = rt  # type: ignore[assignment]
    worker.start_load_kv(PdConnectorMetadata(consumers_open=[ConsumerOpen("d1", "pd-1", CAP, 0, [3, 4], "127.0.0.1:1", 1)]))
    worker.start_load_kv(PdConnectorMetadata(consumers_end=[RequestEnd("d1", "pd-1", True, "aborted", report=True)]))
    rt.events += [
        SimpleNamespace(kind="consumer_failed", request_id="pd-1", reason="aborted", outcome=None, held=False),
        ev("consumer_released", "pd-1"),
    ]
    assert worker.get_finished() == (None, {"d1"})
    assert worker.get_block_ids_with_load_errors() == {3, 4}
    # the scheduler withheld it and asks again
    worker.start_load_kv(
        PdConnectorMetadata(consumers_end=[RequestEnd("d1", "pd-1", True, "", report=True, after_load=True)])
    )
    assert worker.get_finished() == (None, {"d1"}), "the re-armed report was never made: vLLM holds the blocks"
    assert worker.get_finished() == (None, None)


def test_release_the_runtime_refuses_is_reported_at_once(worker: PdWorker) -> None:
    class Refusing(RecordingRuntime):
        def consumer_release(self, pd: str) -> None:
            raise KeyError(pd)

    worker.runtime = Refusing()  # type: ignore[assignment]
    worker.start_load_kv(PdConnectorMetadata(consumers_open=[ConsumerOpen("d1", "pd-1", CAP, 0, [3], "127.0.0.1:1", 1)]))
    worker.start_load_kv(PdConnectorMetadata(consumers_end=[RequestEnd("d1", "pd-1", True, "aborted", report=True)]))
    # Nothing could be waited for: vLLM gets its blocks back instead of holding them forever.
    assert worker.get_finished() == (None, {"d1"})


# ---- hostile kv_transfer_params: the request is served plainly, nothing else changes ----

BAD_PARAMS = {
    "bogus role": {"orbitkv_role": "bogus", "orbitkv_request": "x"},
    "no capability": {"orbitkv_role": "consumer", "orbitkv_request": "x", "orbitkv_prefill_kv": "127.0.0.1:1"},
    "short capability": {"orbitkv_role": "producer", "orbitkv_request": "x", "orbitkv_capability": "ab" * 8},
    "port not a number": {
        "orbitkv_role": "consumer", "orbitkv_request": "x", "orbitkv_capability": CAP, "orbitkv_prefill_kv": "host:abc",
    },
    "port out of range": {
        "orbitkv_role": "consumer", "orbitkv_request": "x", "orbitkv_capability": CAP, "orbitkv_prefill_kv": "h:70000",
    },
    "tp a string": {
        "orbitkv_role": "consumer", "orbitkv_request": "x", "orbitkv_capability": CAP,
        "orbitkv_prefill_kv": "127.0.0.1:17500", "orbitkv_prefill_tp": "2",
    },
    "tp zero": {
        "orbitkv_role": "consumer", "orbitkv_request": "x", "orbitkv_capability": CAP,
        "orbitkv_prefill_kv": "127.0.0.1:17500", "orbitkv_prefill_tp": 0,
    },
    "decode tp zero": {"orbitkv_role": "producer", "orbitkv_request": "x", "orbitkv_capability": CAP, "orbitkv_decode_tp": 0},
    "decode tp a bool": {
        "orbitkv_role": "producer", "orbitkv_request": "x", "orbitkv_capability": CAP, "orbitkv_decode_tp": True,
    },
    "request id with spaces": {"orbitkv_role": "producer", "orbitkv_request": "a b", "orbitkv_capability": CAP},
    "request id a list": {"orbitkv_role": "producer", "orbitkv_request": ["x"], "orbitkv_capability": CAP},
    "unknown key": {"orbitkv_role": "producer", "orbitkv_request": "x", "orbitkv_capability": CAP, "orbitkv_rkey": 1},
    "prefill not allowed": {
        "orbitkv_role": "consumer", "orbitkv_request": "x", "orbitkv_capability": CAP,
        "orbitkv_prefill_kv": "127.0.0.2:17500",
    },
}


@pytest.mark.parametrize("params", list(BAD_PARAMS.values()), ids=list(BAD_PARAMS))
def test_malformed_params_serve_the_request_plainly(params: dict[str, Any]) -> None:
    s = scheduler()
    r = FakeRequest("bad", list(range(40)), params)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # no error inside vLLM's scheduler
    s.update_state_after_alloc(r, FakeBlocks([1, 2, 3]), 0)
    meta = s.build_connector_meta(sched_output([FakeNewReq("bad", ([1, 2, 3],), 0)], scheduled={"bad": 40}))
    assert (meta.consumers_open, meta.producer_chunks) == ([], [])
    assert s.request_finished(r, [1, 2, 3]) == (False, None)
    assert s.refused == 1
    assert not s.has_pending_push_work()
    # A good request on the same scheduler still works.
    ok = consumer("good", 40)
    assert s.get_num_new_matched_tokens(ok, 0) == (40, True)


def keyed_scheduler(allowed: list[str] | None = None, key: bytes | None = None) -> PdScheduler:
    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS), parallel_config=SimpleNamespace(tensor_parallel_size=1))
    extra = {} if allowed is None else {"orbitkv.pd.allowed_prefill": allowed}
    pd_config = dataclasses.replace(PdConfig.from_extra_config(extra), side_channel_key=key)
    return PdScheduler(cfg, pd_config)  # type: ignore[arg-type]


def with_params(r: FakeRequest, **changes: Any) -> FakeRequest:
    r.kv_transfer_params = dict(r.kv_transfer_params or {}, **changes)
    return r


def signed(r: FakeRequest, key: bytes) -> FakeRequest:
    params = dict(r.kv_transfer_params or {})
    params.pop(kvp.SIGNATURE, None)
    r.kv_transfer_params = dict(params, **{kvp.SIGNATURE: kvp.sign(params, key)})
    return r


def assert_served_plainly(s: PdScheduler, r: FakeRequest, refused: int) -> None:
    """``r``'s params were refused: counted, and the request runs as a plain
    one through every hook, nothing sent anywhere (no handshake, no cancel,
    no producer)."""
    assert s.params_of(r) is None
    assert s.refused == refused
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, FakeBlocks([1, 2, 3]), 0)
    rid = r.request_id
    meta = s.build_connector_meta(sched_output([FakeNewReq(rid, ([1, 2, 3],), 0)], scheduled={rid: 40}))
    assert (meta.consumers_open, meta.producer_chunks) == ([], [])
    r.status = "FINISHED_STOPPED"
    assert s.request_finished(r, [1, 2, 3]) == (False, None)
    after = s.build_connector_meta(sched_output())
    assert (after.consumers_cancel, after.producers_discard, after.producers_end) == ([], [], [])
    assert s.refused == refused  # decided once per request
    assert not s.has_pending_push_work()


def assert_accepted(s: PdScheduler, r: FakeRequest) -> None:
    p = s.params_of(r)
    assert p is not None and p.role == (r.kv_transfer_params or {})[kvp.ROLE]
    if p.role == kvp.CONSUMER:
        assert s.get_num_new_matched_tokens(r, 0) == (40, True)


def test_the_allow_list_decides_where_decode_may_send_a_handshake() -> None:
    s = keyed_scheduler(["10.0.0.7:17500"])
    r = consumer("d1", 40)  # names 127.0.0.1:17500, not on this list
    assert_served_plainly(s, r, 1)
    assert_accepted(s, with_params(consumer("d2", 40, pd="pd-2"), orbitkv_prefill_kv="10.0.0.7:17500"))
    assert s.refused == 1


def test_an_undeclared_port_on_an_allowed_host_is_served_plainly() -> None:
    """Issue 31, item 2: `127.0.0.1:<any port>` made decode post its whole
    handshake to a listener the sender owned. Loopback's default entries
    name the default side channel ports only."""
    s = scheduler()
    for i, kv in enumerate(("127.0.0.1:9999", "localhost:17508", "[::1]:17499", "127.0.0.1:1"), start=1):
        assert_served_plainly(s, with_params(consumer(f"d{i}", 40, pd=f"pd-{i}"), orbitkv_prefill_kv=kv), i)
    assert_accepted(s, with_params(consumer("ok", 40, pd="pd-ok"), orbitkv_prefill_kv="[::1]:17507"))
    declared = keyed_scheduler(["10.0.0.7:17500-17503"])
    assert_served_plainly(declared, with_params(consumer("d1", 40), orbitkv_prefill_kv="10.0.0.7:17504"), 1)
    assert_accepted(declared, with_params(consumer("d2", 40, pd="pd-2"), orbitkv_prefill_kv="10.0.0.7:17503"))


def test_every_prefill_ranks_port_must_be_declared() -> None:
    """Decode posts to rank 0's port + r for every prefill rank r: a TP 2
    prefill whose rank 1 port is outside the list is refused whole."""
    s = keyed_scheduler(["10.0.0.7:17500-17501"])
    tp2 = {"orbitkv_prefill_kv": "10.0.0.7:17500", "orbitkv_prefill_tp": 2}
    assert_accepted(s, with_params(consumer("ok", 40, pd="pd-ok"), **tp2))
    shifted = {"orbitkv_prefill_kv": "10.0.0.7:17501", "orbitkv_prefill_tp": 2}  # rank 1 on 17502
    assert_served_plainly(s, with_params(consumer("d1", 40), **shifted), 1)
    assert_served_plainly(s, with_params(consumer("d2", 40, pd="pd-2"), **{**tp2, "orbitkv_prefill_tp": 3}), 2)
    # The default: loopback, ranks 0..7 of a prefill on port 17500.
    d = scheduler()
    assert_accepted(d, with_params(consumer("ok", 40), orbitkv_prefill_tp=8))
    assert_served_plainly(d, with_params(consumer("d1", 40, pd="pd-2"), orbitkv_prefill_kv="127.0.0.1:17507",
                                         orbitkv_prefill_tp=2), 1)
    assert_served_plainly(d, with_params(consumer("d2", 40, pd="pd-3"), orbitkv_prefill_tp=9), 2)


KEY = b"deployment-key-0123456789"


def test_with_a_key_params_are_accepted_only_signed() -> None:
    s = keyed_scheduler(["10.0.0.7:17500"], KEY)
    n = 0

    def refused(r: FakeRequest) -> None:
        nonlocal n
        n += 1
        assert_served_plainly(s, r, n)

    at = {"orbitkv_prefill_kv": "10.0.0.7:17500"}
    refused(with_params(consumer("unsigned", 40, pd="pd-1"), **at))  # a declared endpoint, but unsigned
    refused(with_params(consumer("zeros", 40, pd="pd-2"), **at, orbitkv_signature="0" * 64))
    refused(signed(with_params(consumer("other-key", 40, pd="pd-3"), **at), b"another-key-0123456789"))
    # Signed over other values: the proxy's params, then the prefill moved to
    # a listener of the sender's (or the TP changed, or the role).
    tampered = signed(with_params(consumer("tampered", 40, pd="pd-4"), **at), KEY)
    refused(with_params(tampered, orbitkv_prefill_kv="10.0.0.7:31337"))
    refused(with_params(signed(with_params(consumer("tp", 40, pd="pd-5"), **at), KEY), orbitkv_prefill_tp=2))
    # A signature that is not 64 lowercase hex digits is malformed.
    refused(with_params(consumer("short", 40, pd="pd-6"), **at, orbitkv_signature="abc"))
    refused(with_params(consumer("upper", 40, pd="pd-7"), **at, orbitkv_signature=kvp.sign(at, KEY).upper()))
    refused(with_params(consumer("number", 40, pd="pd-8"), **at, orbitkv_signature=7))
    # Signed, but on a host the list does not name.
    refused(signed(with_params(consumer("host", 40, pd="pd-9"), orbitkv_prefill_kv="10.0.0.9:17500"), KEY))
    # A producer request, unsigned or wrongly signed.
    refused(producer("p-unsigned", 40, pd="pd-10"))
    refused(with_params(signed(producer("p-tampered", 40, pd="pd-11"), KEY), orbitkv_decode_tp=2))
    assert n == 11
    # Signed by the proxy: accepted, on any port of a declared host (the
    # proxy learned the ports from the prefill's side channels).
    assert_accepted(s, signed(with_params(consumer("ok", 40, pd="pd-ok"), **at), KEY))
    far = {"orbitkv_prefill_kv": "10.0.0.7:20000", "orbitkv_prefill_tp": 4}
    assert_accepted(s, signed(with_params(consumer("far", 40, pd="pd-far"), **far), KEY))
    assert_accepted(s, signed(producer("p-ok", 40, pd="pd-p"), KEY))
    # Keys of other connectors in the same dict are not signed and do not matter.
    assert_accepted(s, with_params(signed(producer("p-other", 40, pd="pd-q"), KEY), do_remote_decode=True))
    assert s.refused == n


def test_refusals_are_logged_short_on_one_line_and_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 44's log forging: a client's strings (a 4 MiB key name, a request
    ID with a newline and a fake WARN line) reach the log escaped and cut
    short, and a flood of refusals costs a burst, then a line a second."""
    s = scheduler()
    now = [0.0]
    s._refusal_log = kvp.RateLimitedLog(s._refusal_log._logger, clock=lambda: now[0])
    forged = "x\n2026-12-03 WARN orbitkv: all good"
    huge = {"orbitkv_" + "k" * (4 << 20): 1}
    with caplog.at_level("WARNING", logger="orbitkv.vllm.scheduler"):
        s.params_of(with_params(consumer("d1", 40), orbitkv_request=forged))
        s.params_of(with_params(consumer("d2", 40), **huge))
    first, second = (r.getMessage() for r in caplog.records)
    assert "\n" not in first and "\\n" in first and len(first) < 400, first
    assert len(second) < 600, len(second)
    caplog.clear()
    with caplog.at_level("WARNING", logger="orbitkv.vllm.scheduler"):
        for i in range(100):  # a flood within one second: a burst of 10 (8 left), the rest counted
            s.params_of(with_params(consumer(f"f{i}", 40), orbitkv_request=""))
        assert len(caplog.records) == 8 and s._refusal_log.suppressed == 92
        now[0] += 1.0
        s.params_of(with_params(consumer("late", 40), orbitkv_request=""))
    assert caplog.records[-1].getMessage().endswith("(92 more like it suppressed)")
    assert s.refused == 103  # every refusal is still counted


def test_a_refusal_names_its_reason_never_the_key_or_the_capability(caplog: pytest.LogCaptureFixture) -> None:
    s = keyed_scheduler(None, KEY)
    with caplog.at_level("WARNING", logger="orbitkv.vllm.scheduler"):
        s.params_of(consumer("unsigned", 40, pd="pd-1"))
        s.params_of(with_params(consumer("bad", 40, pd="pd-2"), orbitkv_signature="f" * 64))
    first, second = (r.getMessage() for r in caplog.records)
    assert "unsigned" in first and "does not match" in second
    for message in (first, second):
        assert CAP not in message and KEY.decode() not in message and KEY.hex() not in message
    unkeyed = scheduler()
    with caplog.at_level("WARNING", logger="orbitkv.vllm.scheduler"):
        unkeyed.params_of(with_params(consumer("port", 40), orbitkv_prefill_kv="127.0.0.1:9999"))
    assert "'127.0.0.1:9999' is not an allowed prefill side channel" in caplog.records[-1].getMessage()


def test_without_a_key_a_signature_vouches_for_nothing() -> None:
    """A decode without the key ignores a (well-formed) signature: only
    declared endpoints, as for any unsigned request."""
    s = scheduler()
    assert_accepted(s, signed(consumer("ok", 40), KEY))
    far = signed(with_params(consumer("far", 40, pd="pd-2"), orbitkv_prefill_kv="127.0.0.1:9999"), KEY)
    assert_served_plainly(s, far, 1)


def test_a_duplicate_request_id_is_served_plainly_and_the_first_keeps_its_transfer() -> None:
    s = scheduler()
    first, second = consumer("d1", 40), consumer("d2", 40)  # both "pd-1"
    assert s.get_num_new_matched_tokens(first, 0) == (40, True)
    assert s.get_num_new_matched_tokens(second, 0) == (0, False)
    s.update_state_after_alloc(first, FakeBlocks([1, 2, 3]), 40)
    s.update_state_after_alloc(second, FakeBlocks([4, 5, 6]), 0)
    meta = s.build_connector_meta(sched_output())
    assert [o.req_id for o in meta.consumers_open] == ["d1"]
    # Once the first is gone, the ID may be used again.
    s.update_connector_output(out(recving={"d1"}))
    first.status = "FINISHED_STOPPED"
    s.request_finished(first, [1, 2, 3])
    assert s.get_num_new_matched_tokens(consumer("d3", 40), 0) == (40, True)


def test_a_producer_finished_before_it_was_scheduled_is_discarded() -> None:
    s = scheduler()
    r = producer("p1", 40)
    s.update_state_after_alloc(r, FakeBlocks([]), 0)
    r.status = "FINISHED_ABORTED"
    assert s.request_finished(r, []) == (False, None)
    (d,) = s.build_connector_meta(sched_output()).producers_discard
    assert (d.pd_id, d.capability) == ("pd-1", CAP)


class RaisingRuntime(RecordingRuntime):
    """Test double of `orbitkv.Runtime` whose producers were all released
    (a dead decode, a cancel, a deadline) and whose consumer_open refuses."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        sig = inspect.signature(getattr(orbitkv.Runtime, name))  # spec'd, as RecordingRuntime

        def call(*a: Any, **kw: Any) -> Any:
            sig.bind(self, *a, **kw)
            self.calls.append((name, *a, *kw.items()))
            if name in ("layer_ready", "producer_finish", "producer_add_blocks", "producer_abort"):
                raise orbitkv.UnknownRequestError("released", kind="UnknownRequest", request_id=a[0])
            if name == "consumer_open":
                raise orbitkv.DuplicateRequestError("dup", kind="DuplicateRequest", request_id=a[0])
            return "{}"

        return call

    def layers_ready(self, layer: int, chunks: list[tuple[str, int, int]]) -> list[tuple[str, Exception]]:
        self.calls.append(("layers_ready", layer, chunks))
        return [(pd, orbitkv.UnknownRequestError("released", kind="UnknownRequest", request_id=pd)) for pd, _, _ in chunks]


def test_a_released_producer_never_raises_inside_the_forward(worker: PdWorker) -> None:
    worker.runtime = RaisingRuntime()  # type: ignore[assignment]
    worker._layer_index = {"layer.0": 0, "layer.1": 1}
    meta = PdConnectorMetadata()
    meta.producer_chunks.append(ProducerChunk("p1", "pd-1", CAP, 1, True, [1], 0, 1, True))
    worker.start_load_kv(meta)
    worker.save_kv_layer("layer.0", None)  # type: ignore[arg-type]
    worker.save_kv_layer("layer.1", None)  # type: ignore[arg-type]
    worker.wait_for_save()
    worker.start_load_kv(PdConnectorMetadata(producers_end=[RequestEnd("p1", "pd-1", False, "done", report=True)]))
    names = [c[0] for c in worker.runtime.calls]  # type: ignore[attr-defined]
    assert names.count("layers_ready") == 1  # dropped from the step after the first refusal
    assert names.count("producer_finish") <= 1


class GatherFailsFor:
    """Test double of `orbitkv.staging.StagingCopier` whose device copy
    fails for the block IDs `bad` (e.g. a CUDA error), and succeeds otherwise."""

    def __init__(self, bad: list[int]) -> None:
        self.bad = bad
        self.gathered: list[list[int]] = []

    def index(self, blocks: list[int]) -> list[int]:
        return list(blocks)

    def gather(self, layer: int, blocks: list[int], *rest: Any) -> None:
        if blocks == self.bad:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.gathered.append(blocks)


def test_a_failed_staging_gather_aborts_that_request_alone(worker: PdWorker) -> None:
    import orbitkv

    worker._copier = GatherFailsFor([1])  # type: ignore[assignment]
    worker._source_arena = orbitkv.StagingArena(1 << 20, 1 << 20)
    worker._layer_index = {"layer.0": 0, "layer.1": 1}
    meta = PdConnectorMetadata()
    meta.producer_chunks.append(ProducerChunk("p1", "pd-1", CAP, 1, True, [1], 0, 1, True, 1))
    meta.producer_chunks.append(ProducerChunk("p2", "pd-2", CAP, 1, True, [2], 0, 1, True, 1))
    worker.start_load_kv(meta)
    # both requests got a source staging
    opens = [c for c in worker.runtime.calls if c[0] == "producer_open"]  # type: ignore[attr-defined]
    assert [c[1] for c in opens] == ["pd-1", "pd-2"] and all(("staging_blocks", 1) in c for c in opens)
    worker.save_kv_layer("layer.0", None)  # type: ignore[arg-type]  # must not raise
    worker.save_kv_layer("layer.1", None)  # type: ignore[arg-type]
    aborts = [c for c in worker.runtime.calls if c[0] == "producer_abort"]  # type: ignore[attr-defined]
    assert [c[1] for c in aborts] == ["pd-1"] and "staging gather failed" in aborts[0][2]
    # the other request was gathered for every layer; the failed one not again
    assert worker._copier.gathered == [[2], [2]]  # type: ignore[attr-defined]


def test_a_request_that_finds_the_source_staging_full_is_written_page_to_page_and_counted(worker: PdWorker) -> None:
    import orbitkv

    worker._copier = GatherFailsFor([])  # type: ignore[assignment]
    worker._source_arena = orbitkv.StagingArena(1 << 20, 2 * 4096)  # room for two one-block prompts
    meta = PdConnectorMetadata()
    for i in (1, 2, 3):
        meta.producer_chunks.append(ProducerChunk(f"p{i}", f"pd-{i}", CAP, 1, True, [i], 0, 1, True, 1))
    worker.start_load_kv(meta)
    opens = [c for c in worker.runtime.calls if c[0] == "producer_open"]  # type: ignore[attr-defined]
    staged = [c[1] for c in opens if ("staging_blocks", 1) in c]
    assert [c[1] for c in opens] == ["pd-1", "pd-2", "pd-3"] and staged == ["pd-1", "pd-2"]
    full = [c for c in worker.runtime.calls if c[0] == "note_source_staging_full"]  # type: ignore[attr-defined]
    assert full == [("note_source_staging_full", 1)]


class PiecesRuntime(RecordingRuntime):
    """`RecordingRuntime` of a prefill that stages by layer: `pd-1` is given
    a piece for every layer, `pd-2` none (no room), `pd-3` was released by
    the runtime (aborted under the worker)."""

    def staging_group(self, consumer_tp: int) -> int:
        return 1

    def producer_stage_layer(self, request_id: str, layer: int, start_block: int,
                             end_block: int) -> tuple[int, list[tuple[int, int]]] | None:
        self.calls.append(("producer_stage_layer", request_id, layer, start_block, end_block))
        if request_id == "pd-3":
            raise orbitkv.UnknownRequestError(request_id)
        return (0x10000 + 0x1000 * layer, [(0, 4096)]) if request_id == "pd-1" else None


class PieceCopier(GatherFailsFor):
    """`GatherFailsFor` that records gathers into layer pieces."""

    def gather_piece(self, layer: int, blocks: list[int], base: int, slots: Any, group: int = 1) -> None:
        self.gathered.append([layer, base, *blocks])


def test_staged_by_layer_each_layer_is_gathered_into_the_piece_the_runtime_gives(worker: PdWorker) -> None:
    """The default (`staging_mb` auto): producers open staged by layer; per
    layer the worker asks the runtime for a piece and gathers exactly into
    it; no piece (no room) means no gather but the layer is still handed
    over (written from the pages); a request the runtime released is
    skipped quietly from then on (no abort, no warning path); the worker
    counts nothing itself (the runtime does)."""
    worker.runtime = PiecesRuntime()  # type: ignore[assignment]
    worker._copier = PieceCopier([])  # type: ignore[assignment]
    worker._by_layer = True
    worker._heads = (False, 2)
    worker._layer_index = {"layer.0": 0, "layer.1": 1}
    meta = PdConnectorMetadata()
    for i in (1, 2, 3):
        meta.producer_chunks.append(ProducerChunk(f"p{i}", f"pd-{i}", CAP, 1, True, [10 * i, 10 * i + 1], 0, 2,
                                                  True, 2))
    worker.start_load_kv(meta)
    calls = worker.runtime.calls  # type: ignore[attr-defined]
    opens = [c for c in calls if c[0] == "producer_open"]
    assert [c[1] for c in opens] == ["pd-1", "pd-2", "pd-3"]
    assert all(("stage_by_layer", True) in c and ("staging_group", 1) in c for c in opens), opens
    assert all(worker.ledger.producers.peek(f"pd-{i}").layer_group == 1 for i in (1, 2, 3))
    worker.save_kv_layer("layer.0", None)  # type: ignore[arg-type]
    worker.save_kv_layer("layer.1", None)  # type: ignore[arg-type]
    asked = [(c[1], c[2]) for c in calls if c[0] == "producer_stage_layer"]
    assert asked == [("pd-1", 0), ("pd-2", 0), ("pd-3", 0), ("pd-1", 1), ("pd-2", 1)], asked
    # gathered into the piece given, and only there
    assert worker._copier.gathered == [[0, 0x10000, 10, 11], [1, 0x11000, 10, 11]]  # type: ignore[attr-defined]
    ready = [c for c in calls if c[0] == "layers_ready"]
    assert [sorted(pd for pd, _, _ in c[2]) for c in ready] == [["pd-1", "pd-2", "pd-3"]] * 2
    assert not [c for c in calls if c[0] in ("producer_abort", "note_source_staging_full")]


def test_once_the_staging_blocks_went_back_a_request_in_the_same_step_opens_from_the_pages(worker: PdWorker) -> None:
    """The scheduler gave the staging's blocks back to vLLM (a kv_both
    instance that only decoded): the step that says so, and any after,
    opens its producers from the pages (not staged by layer), asks the
    runtime for no piece and gathers nothing, while the layers are still
    handed over; a worker that had not taken the blocks yet never takes
    them."""
    worker.runtime = PiecesRuntime()  # type: ignore[assignment]
    worker._copier = PieceCopier([])  # type: ignore[assignment]
    worker._by_layer = True
    worker._heads = (False, 2)
    worker._layer_index = {"layer.0": 0, "layer.1": 1}
    chunk = ProducerChunk("p1", "pd-1", CAP, 1, True, [10, 11], 0, 2, True, 2)
    worker.start_load_kv(PdConnectorMetadata(producer_chunks=[chunk], staging_released=True))
    calls = worker.runtime.calls  # type: ignore[attr-defined]
    opens = [c for c in calls if c[0] == "producer_open"]
    assert [c[1] for c in opens] == ["pd-1"] and not [x for x in opens[0] if x == ("stage_by_layer", True)], opens
    worker.save_kv_layer("layer.0", None)  # type: ignore[arg-type]
    worker.save_kv_layer("layer.1", None)  # type: ignore[arg-type]
    assert not [c for c in calls if c[0] == "producer_stage_layer"]
    assert worker._copier.gathered == []  # type: ignore[attr-defined]
    assert len([c for c in calls if c[0] == "layers_ready"]) == 2
    assert not worker._by_layer
    # not taken yet: named and released in one step, never taken
    worker._staging_later = True
    worker.start_load_kv(PdConnectorMetadata(staging_blocks=[], staging_released=True))
    assert not worker._staging_later and not [c for c in calls if c[0] == "add_source_staging"]


class PagesBackRuntime(PiecesRuntime):
    """`PiecesRuntime` that lets `pd-1`'s pages go as soon as it is asked,
    `pd-2`'s not yet (a layer found no room), `pd-4`'s never (its decode's
    authorization is written from the pages), and no longer knows `pd-3`."""

    def producer_give_back_pages(self, request_id: str) -> str:
        self.calls.append(("producer_give_back_pages", request_id))
        if request_id == "pd-3":
            raise orbitkv.UnknownRequestError(request_id)
        return {"pd-1": "now", "pd-4": "never"}.get(request_id, "not_yet")


def test_a_request_whose_pages_went_back_is_reported_sent_at_once_and_once(worker: PdWorker) -> None:
    """vLLM finished four requests staged by layer: the one whose pages the
    runtime lets go is reported as sent at once, before its release, and not
    again at the release; the others are reported at their release as
    before; nothing is asked before vLLM finished a request, nor after, nor
    again once the runtime said never."""
    rt = worker.runtime = PagesBackRuntime()  # type: ignore[assignment]
    worker._copier = PieceCopier([])  # type: ignore[assignment]
    worker._by_layer = True
    worker._heads = (False, 2)
    worker._layer_index = {"layer.0": 0, "layer.1": 1}
    chunks = [ProducerChunk(f"p{i}", f"pd-{i}", CAP, 1, True, [10 * i, 10 * i + 1], 0, 2, True, 2) for i in (1, 2, 3, 4)]
    worker.start_load_kv(PdConnectorMetadata(producer_chunks=chunks))
    worker.save_kv_layer("layer.0", None)  # type: ignore[arg-type]
    worker.save_kv_layer("layer.1", None)  # type: ignore[arg-type]
    worker.wait_for_save()
    asked = lambda: [c[1] for c in rt.calls if c[0] == "producer_give_back_pages"]  # noqa: E731
    assert worker.get_finished() == (None, None)
    assert asked() == [], "vLLM did not finish them yet"
    worker.start_load_kv(PdConnectorMetadata(
        producers_end=[RequestEnd(f"p{i}", f"pd-{i}", False, "done", report=True) for i in (1, 2, 3, 4)]))
    assert worker.get_finished() == ({"p1"}, None)
    assert sorted(asked()) == ["pd-1", "pd-2", "pd-3", "pd-4"]
    assert worker.draining() == 1, "its writes still go out of the pieces"
    rt.calls.clear()
    assert worker.get_finished() == (None, None)
    assert sorted(asked()) == ["pd-2", "pd-3"], "pd-1's pages are back, pd-4's never go: not asked again"
    # out of the scheduler's unclaimed count now: the claim deadline is the
    # worker's, asked once (a claimed producer ignores it)
    unclaimed = lambda: [c[1:] for c in rt.calls if c[0] == "producer_release_unclaimed"]  # noqa: E731
    assert unclaimed() == []
    worker.config = dataclasses.replace(worker.config, claim_timeout_s=0.0)
    assert worker.get_finished() == (None, None)
    assert worker.get_finished() == (None, None)
    assert unclaimed() == [("pd-1", "no decode claimed it within orbitkv.pd.claim_timeout_s (0s)")]
    for i in (1, 2, 3, 4):
        rt.events.append(ev("producer_released", f"pd-{i}", outcome="done"))
    rt.calls.clear()
    assert worker.get_finished() == ({"p2", "p3", "p4"}, None), "p1 was reported already"
    assert asked() == []
    assert worker.draining() == 0
    assert worker.get_finished() == (None, None)
    assert worker.ledger.sizes() == {"consumers": 0, "producers": 0, "released_after_report": 0}


def test_a_refused_authorization_fails_that_request_alone(worker: PdWorker) -> None:
    worker.runtime = RaisingRuntime()  # type: ignore[assignment]
    worker.start_load_kv(PdConnectorMetadata(consumers_open=[ConsumerOpen("d1", "pd-1", CAP, 0, [3, 4], "127.0.0.1:1", 1)]))
    assert worker.get_finished() == (None, {"d1"})
    assert worker.get_block_ids_with_load_errors() == {3, 4}
    assert worker.get_finished() == (None, None)


# ---- GPU worker path (the runtime's layer gate), with a runtime double ------------


def gpu_worker(worker: PdWorker, monkeypatch: pytest.MonkeyPatch) -> PdWorker:
    """The worker as on a GPU with the layer gate (no GPU needed: the runtime
    is the recording double, the stream handle a constant)."""
    import orbitkv.vllm.worker as wmod

    monkeypatch.setattr(wmod, "_stream_handle", lambda: 0x5EED)
    worker.is_cuda, worker._rust_gate = True, True
    worker._layer_index = {"layer.0": 0, "layer.1": 1}
    return worker


def one_step(w: PdWorker, *chunks: ProducerChunk) -> list[tuple]:
    """Runs one forward of `chunks` through the worker (both layers saved)
    and returns the runtime calls it made, the opens left out."""
    w.start_load_kv(PdConnectorMetadata(producer_chunks=list(chunks)))
    w.save_kv_layer("layer.0", None)  # type: ignore[arg-type]
    w.save_kv_layer("layer.1", None)  # type: ignore[arg-type]
    w.wait_for_save()
    return [c for c in w.runtime.calls if c[0] != "producer_open"]  # type: ignore[attr-defined]


def test_gpu_layers_go_to_the_gate_with_the_stream_and_the_finish_is_queued_behind_them(
    worker: PdWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = gpu_worker(worker, monkeypatch)
    calls = one_step(
        w,
        ProducerChunk("p1", "pd-1", CAP, 1, True, [1, 2], 0, 2, True),
        ProducerChunk("p2", "pd-2", CAP, 1, True, [5], 0, 1, False),
    )
    assert calls == [
        ("layers_ready_after", 0x5EED, 0, [("pd-1", 0, 2), ("pd-2", 0, 1)]),
        ("layers_ready_after", 0x5EED, 1, [("pd-1", 0, 2), ("pd-2", 0, 1)]),
        # only the request whose last chunk this was, through the gate's queue
        ("producer_finish_after", "pd-1"),
    ]


class GateFailsRuntime(RecordingRuntime):
    """The layer gate takes `ok` layers, then the CUDA driver fails."""

    def __init__(self, ok: int) -> None:
        super().__init__()
        self.ok = ok

    def layers_ready_after(self, *a: Any) -> None:
        from orbitkv.errors import CudaError

        if self.ok == 0:
            raise CudaError("cuEventRecord returned CUDA error 700")
        self.ok -= 1
        self.calls.append(("layers_ready_after", *a))


def test_a_gate_that_fails_after_taking_layers_aborts_that_steps_requests(
    worker: PdWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Falling back to the CPU way mid-request could let a finish overtake
    layers the gate still holds: the step's requests are aborted instead
    (decode recomputes), and never finished."""
    w = gpu_worker(worker, monkeypatch)
    w.runtime = GateFailsRuntime(ok=1)  # type: ignore[assignment]
    # the gate takes layer 0 and fails at layer 1
    calls = one_step(w, ProducerChunk("p1", "pd-1", CAP, 1, True, [1], 0, 1, True))
    assert [c[0] for c in calls] == ["layers_ready_after", "producer_abort"]
    assert not w._rust_gate


def test_a_gate_unavailable_from_the_start_waits_for_each_layer_then_goes_the_cpu_way(
    worker: PdWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No usable CUDA driver from Rust before any layer: each layer waits for
    the stream's kernels on the worker's thread, then goes as on CPU (one
    call for the step's requests), and the finish follows it directly."""
    w = gpu_worker(worker, monkeypatch)
    w.runtime = GateFailsRuntime(ok=0)  # type: ignore[assignment]
    synced: list[int] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(synchronize=lambda: synced.append(1)))
    calls = one_step(w, ProducerChunk("p1", "pd-1", CAP, 1, True, [1], 0, 1, True))
    assert calls == [
        ("layers_ready", 0, [("pd-1", 0, 1)]),
        ("layers_ready", 1, [("pd-1", 0, 1)]),
        ("producer_finish", "pd-1"),
    ]
    assert synced == [1, 1], "each layer waited for its kernels before it was handed over"
    assert not w._rust_gate


# ---- vLLM's two-stage flow (vllm-router's nixl mode), and dialects OrbitKV does not serve ----

# What vllm-router 0.1.17 sends the prefill half (shared/notes/routers.md).
ROUTER_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def two_stage(cfg: PdConfig, tp: int = 1) -> tuple[PdScheduler, FakeRequest, dict[str, Any] | None]:
    """A two-stage prefill request scheduled in one step and finished; the
    scheduler and what its response carries."""
    vc = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BS), parallel_config=SimpleNamespace(tensor_parallel_size=tp)
    )
    s = PdScheduler(vc, cfg)  # type: ignore[arg-type]
    r = FakeRequest("p1", list(range(20)), dict(ROUTER_PREFILL))
    s.update_state_after_alloc(r, FakeBlocks([]), 0)
    (chunk,) = s.build_connector_meta(
        sched_output([FakeNewReq("p1", ([1, 2],), 0)], scheduled={"p1": 20})
    ).producer_chunks
    assert chunk.opens and chunk.last
    r.status = "FINISHED_LENGTH_CAPPED"
    delay, answer = s.request_finished(r, [1, 2])
    assert delay, "the two-stage prefill's blocks must be held for the decode that comes next"
    return s, r, answer


def test_a_two_stage_prefill_mints_its_identity_and_answers_the_decode_half() -> None:
    cfg = PdConfig(side_channel_host="10.0.0.2", side_channel_port=17500)
    s, r, answer = two_stage(cfg, tp=2)
    p = s.params_of(r)
    assert p is not None and p.role == kvp.PRODUCER and p.answer
    assert p.decode_tp == 2, "decode's TP defaults to this instance's"
    assert answer is not None
    # decode parses the answer as its own params: a consumer of this request
    d = kvp.PdParams.parse(answer)
    assert d is not None and d.role == kvp.CONSUMER
    assert (d.request, d.capability, d.prefill_kv, d.prefill_tp) == (p.request, p.capability, "10.0.0.2:17500", 2)
    assert answer["do_remote_prefill"] is True and kvp.SIGNATURE not in answer
    # every request gets its own identity and capability (never a client's)
    _, _, answer2 = two_stage(cfg)
    assert answer2 is not None and (answer2[kvp.REQUEST], answer2[kvp.CAPABILITY]) != (d.request, d.capability)
    assert len(answer2[kvp.CAPABILITY]) >= 32


def test_a_two_stage_answer_is_signed_with_the_deployment_key_only_when_allowed() -> None:
    key = b"k" * 32
    # With a key, an unsigned two-stage half gets no signed answer: anyone
    # reaching the prefill's API could otherwise mint params decode trusts.
    cfg = PdConfig(side_channel_host="10.0.0.2", side_channel_key=key, decode_tp=4)
    s = PdScheduler(
        SimpleNamespace(cache_config=SimpleNamespace(block_size=BS), parallel_config=SimpleNamespace(tensor_parallel_size=1)),  # type: ignore[arg-type]
        cfg,
    )
    r = FakeRequest("p1", list(range(20)), dict(ROUTER_PREFILL))
    assert s.params_of(r) is None and s.refused == 1
    # The operator's explicit opt-in for a router that cannot sign.
    cfg = dataclasses.replace(cfg, two_stage_unsigned=True)
    s, r, answer = two_stage(cfg)
    assert answer is not None
    kvp.check_signature(answer, key)  # decode accepts it
    p = s.params_of(r)
    assert p is not None and p.decode_tp == 4


def unclaimed_scheduler(num_blocks: int | None, **cfg: Any) -> tuple[PdScheduler, list[float]]:
    """A prefill scheduler of ``num_blocks`` KV blocks on a clock the test moves."""
    cache = SimpleNamespace(block_size=BS, num_gpu_blocks=num_blocks)
    vc = SimpleNamespace(cache_config=cache, parallel_config=SimpleNamespace(tensor_parallel_size=1))
    s = PdScheduler(vc, PdConfig(**cfg))  # type: ignore[arg-type]
    now = [100.0]
    s._clock = lambda: now[0]
    return s, now


def finish_two_stage(s: PdScheduler, rid: str, n_tokens: int, blocks: list[int], asked: list[str] | None = None) -> str:
    """One two-stage prefill scheduled in one step and finished (its blocks
    held for a decode); its OrbitKV request ID. The producers that step asked
    to give up go to ``asked``."""
    r = FakeRequest(rid, list(range(n_tokens)), dict(ROUTER_PREFILL))
    s.update_state_after_alloc(r, FakeBlocks([]), 0)
    meta = s.build_connector_meta(sched_output([FakeNewReq(rid, (blocks,), 0)], scheduled={rid: n_tokens}))
    if asked is not None:
        asked.extend(u.pd_id for u in meta.producers_unclaimed)
    r.status = "FINISHED_LENGTH_CAPPED"
    delay, answer = s.request_finished(r, blocks)
    assert delay and answer is not None
    return str(answer[kvp.REQUEST])


def test_unclaimed_producers_are_given_up_oldest_first_beyond_the_kv_share() -> None:
    # 100 blocks, a quarter for requests no decode claimed: 10 blocks each.
    s, now = unclaimed_scheduler(100)
    ids: list[str] = []
    asked: list[str] = []
    for i in range(4):
        now[0] += 1
        ids.append(finish_two_stage(s, f"p{i}", 10 * BS, list(range(10 * i, 10 * i + 10)), asked))
    # The third made 30 blocks > 25: the oldest was given up at the next step.
    assert asked == ids[:1]
    # The fourth: 30 again: the next oldest, once each.
    meta = s.build_connector_meta(sched_output())
    assert [u.pd_id for u in meta.producers_unclaimed] == ids[1:2]
    assert "unclaimed_kv_share" in meta.producers_unclaimed[0].reason
    assert s.build_connector_meta(sched_output()).producers_unclaimed == []
    # The workers released them: vLLM gets their blocks back.
    s.update_connector_output(out(sending={"p0", "p1"}))
    assert s.unclaimed_asked == 2 and s.has_pending_push_work()


def test_unclaimed_producers_are_given_up_at_the_claim_deadline_and_beyond_the_count() -> None:
    s, now = unclaimed_scheduler(None, claim_timeout_s=5.0, unclaimed_max_requests=2)
    a = finish_two_stage(s, "p0", 20, [1, 2])
    now[0] += 3
    b = finish_two_stage(s, "p1", 20, [3, 4])
    assert s.build_connector_meta(sched_output()).producers_unclaimed == []  # no KV size known: no share cap
    now[0] += 2.5  # p0 is 5.5 s old, p1 2.5 s
    meta = s.build_connector_meta(sched_output())
    assert [(u.pd_id, "claim_timeout_s" in u.reason) for u in meta.producers_unclaimed] == [(a, True)]
    c = finish_two_stage(s, "p2", 20, [5, 6])
    d = finish_two_stage(s, "p3", 20, [7, 8])
    meta = s.build_connector_meta(sched_output())
    # three wait, two may: the oldest (p1) goes
    assert [u.pd_id for u in meta.producers_unclaimed] == [b]
    assert "unclaimed_max_requests" in meta.producers_unclaimed[0].reason
    # one that finished sending (its decode claimed it, the writes drained) is no longer counted
    s.update_connector_output(out(sending={"p2"}))
    now[0] += 1
    assert s.build_connector_meta(sched_output()).producers_unclaimed == []
    assert list(s._unclaimed) == ["p3"] and c != d


def test_two_long_prompts_finished_back_to_back_are_not_given_up_while_their_decode_is_on_its_way() -> None:
    """Seen on one H100 (2026-12-05, the GPU driver's chunk-split case on a
    0.75 GiB KV cache): prompts of 8100 and 8000 tokens sent 10 ms apart
    through the proxy finished on the prefill in consecutive steps, before
    decode's handshake for the first came; together they held more than a
    quarter of the cache, and the first was given up (decode failed it,
    500). The share and count caps now give up only requests that waited
    ``orbitkv.pd.unclaimed_grace_s`` (2 s)."""
    # 100 blocks, a quarter for requests no decode claimed: 25 blocks.
    s, now = unclaimed_scheduler(100)
    asked: list[str] = []
    a = finish_two_stage(s, "p0", 20 * BS, list(range(0, 20)), asked)
    now[0] += 0.06
    b = finish_two_stage(s, "p1", 19 * BS, list(range(20, 39)), asked)
    now[0] += 0.05
    assert s.build_connector_meta(sched_output()).producers_unclaimed == [] and asked == []
    # decode's handshakes came; the workers wrote both and reported them sent
    now[0] += 0.2
    s.update_connector_output(out(sending={"p0", "p1"}))
    now[0] += 10
    assert s.build_connector_meta(sched_output()).producers_unclaimed == [] and s.unclaimed_asked == 0
    assert a != b
    # Two such halves that no decode claims: past the grace the oldest goes.
    s, now = unclaimed_scheduler(100)
    a = finish_two_stage(s, "p0", 20 * BS, list(range(0, 20)))
    now[0] += 0.06
    finish_two_stage(s, "p1", 19 * BS, list(range(20, 39)))
    now[0] += 1.9
    assert s.build_connector_meta(sched_output()).producers_unclaimed == []
    now[0] += 0.1  # p0 waited 2.06 s, p1 2.0 s; 39 blocks > 25 without p0: 19
    meta = s.build_connector_meta(sched_output())
    assert [u.pd_id for u in meta.producers_unclaimed] == [a]
    assert "unclaimed_kv_share" in meta.producers_unclaimed[0].reason
    # A grace of 0: asked at the first step, as before.
    s, now = unclaimed_scheduler(100, unclaimed_grace_s=0.0)
    a = finish_two_stage(s, "p0", 20 * BS, list(range(0, 20)))
    finish_two_stage(s, "p1", 19 * BS, list(range(20, 39)))
    assert [u.pd_id for u in s.build_connector_meta(sched_output()).producers_unclaimed] == [a]


def test_requests_a_decode_claimed_on_every_rank_leave_the_unclaimed_count() -> None:
    """Under load most finished producers are claimed (their writes queue):
    counted as unclaimed, they filled the share, and walking the oldest
    past the grace reached a request whose decode was merely late. The
    workers now say which their decode claimed; those leave the count."""
    from orbitkv.vllm.pd import PdWorkerMeta

    def three(told: list[str]) -> tuple[PdScheduler, str]:
        """c1, u1 and c2 finished 0.1 s apart on 100 blocks (a quarter: 25),
        the workers told ``told`` claimed, all past the grace: the
        scheduler, and u1's OrbitKV id."""
        s, now = unclaimed_scheduler(100)
        finish_two_stage(s, "c1", 20 * BS, list(range(0, 20)))
        now[0] += 0.1
        u1 = finish_two_stage(s, "u1", 10 * BS, list(range(20, 30)))
        now[0] += 0.1
        finish_two_stage(s, "c2", 20 * BS, list(range(30, 50)))
        if told:
            s.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving=None,
                                                      invalid_block_ids=set(),
                                                      kv_connector_worker_meta=PdWorkerMeta(0, told)))
        now[0] += 5
        return s, u1

    s, _ = three(["c1", "c2"])  # 10 unclaimed blocks: under the share
    assert s.build_connector_meta(sched_output()).producers_unclaimed == []
    assert list(s._unclaimed) == ["u1"]
    # without the workers' word (before): c1 asked, then u1 with 30 left
    s, u1 = three([])
    asked = [u.pd_id for u in s.build_connector_meta(sched_output()).producers_unclaimed]
    assert len(asked) == 2 and asked[1] == u1


def test_a_claim_counts_once_every_rank_said_so() -> None:
    from orbitkv.vllm.pd import PdWorkerMeta

    s, _ = unclaimed_scheduler(100)
    s.tp_size = 2
    finish_two_stage(s, "a", 20 * BS, list(range(0, 20)))
    finish_two_stage(s, "b", 20 * BS, list(range(20, 40)))

    def step(*metas: PdWorkerMeta) -> None:
        m = metas[0]
        for other in metas[1:]:
            m = m.aggregate(other)
        s.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving=None,
                                                  invalid_block_ids=set(), kv_connector_worker_meta=m))

    step(PdWorkerMeta(0, ["a", "b"]), PdWorkerMeta(1, ["a"]))  # rank 1 saw only a's handshake
    assert list(s._unclaimed) == ["b"] and s._draining == 1
    step(PdWorkerMeta(0, ["b", "unknown"]))  # b's second rank, a step later; an id it never had
    assert list(s._unclaimed) == [] and s._claims == {}


def test_the_worker_tells_each_claim_of_a_finished_producer_once(worker: PdWorker) -> None:
    class Claims(RecordingRuntime):
        def __init__(self) -> None:
            super().__init__()
            self.claimed: set[str] = set()

        def producer_claimed(self, request_id: str) -> bool:
            self.calls.append(("producer_claimed", request_id))
            if request_id == "pd-3":
                raise orbitkv.UnknownRequestError(request_id)
            return request_id in self.claimed

    rt = worker.runtime = Claims()  # type: ignore[assignment]
    worker._layer_index = {"layer.0": 0}
    meta = PdConnectorMetadata()
    for i in (1, 2, 3):
        meta.producer_chunks.append(ProducerChunk(f"p{i}", f"pd-{i}", CAP, 1, True, [i], 0, 1, True))
    worker.start_load_kv(meta)
    worker.save_kv_layer("layer.0", None)  # type: ignore[arg-type]
    worker.wait_for_save()
    rt.claimed = {"pd-1", "pd-2"}
    assert worker.claimed() == [], "vLLM has not finished them: the scheduler does not count them"
    worker.start_load_kv(PdConnectorMetadata(
        producers_end=[RequestEnd(f"p{i}", f"pd-{i}", False, "done", report=True) for i in (1, 2, 3)]))
    rt.claimed = {"pd-1"}
    assert worker.claimed() == ["p1"]
    rt.claimed = {"pd-1", "pd-2"}
    assert worker.claimed() == ["p2"], "each once"
    assert worker.claimed() == []


def test_a_producer_that_did_not_complete_is_not_counted_as_unclaimed() -> None:
    # An aborted prefill's producer is aborted outright: nothing to ask.
    s, now = unclaimed_scheduler(4)
    r = FakeRequest("p1", list(range(64)), dict(ROUTER_PREFILL))
    s.update_state_after_alloc(r, FakeBlocks([]), 0)
    s.build_connector_meta(sched_output([FakeNewReq("p1", ([1, 2, 3, 4],), 0)], scheduled={"p1": 64}))
    r.status = "FINISHED_ABORTED"
    assert s.request_finished(r, [1, 2, 3, 4]) == (True, None)
    now[0] += 1000
    assert s.build_connector_meta(sched_output()).producers_unclaimed == []


def test_a_two_stage_prefill_that_did_not_complete_answers_nothing() -> None:
    s = scheduler()
    r = FakeRequest("p1", list(range(20)), dict(ROUTER_PREFILL))
    s.update_state_after_alloc(r, FakeBlocks([]), 0)
    s.build_connector_meta(sched_output([FakeNewReq("p1", ([1, 2],), 0)], scheduled={"p1": 20}))
    r.status = "FINISHED_ABORTED"
    assert s.request_finished(r, [1, 2]) == (True, None)
    # never scheduled: discarded, nothing held, nothing answered
    s = scheduler()
    r = FakeRequest("p2", list(range(20)), dict(ROUTER_PREFILL))
    s.update_state_after_alloc(r, FakeBlocks([]), 0)
    r.status = "FINISHED_ABORTED"
    assert s.request_finished(r, []) == (False, None)
    assert len(s.build_connector_meta(sched_output()).producers_discard) == 1


@pytest.mark.parametrize(
    "params",
    [
        # a decode half whose prefill answered no OrbitKV params
        {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h"},
        # the mooncake dialect (vllm-router / llm-d --kv-connector mooncake), either half
        {"do_remote_prefill": True, "transfer_id": "t", "remote_bootstrap_addr": "http://h:1", "remote_engine_id": "e"},
        {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "t"},
        # llm-d's offloading dialect
        {"do_remote_prefill": True, "remote_prefiller": {"kv_request_id": "x", "remote_host": "h", "remote_port": 1}},
    ],
    ids=["remote-prefill-without-orbitkv", "mooncake-decode", "mooncake-prefill", "offloading"],
)
def test_a_dialect_orbitkv_does_not_serve_is_served_plainly_and_counted(params: dict[str, Any]) -> None:
    s = scheduler()
    r = FakeRequest("x1", list(range(20)), params)
    assert s.params_of(r) is None
    assert s.refused == 1
    assert s.build_connector_meta(sched_output()).refused == 1, "the worker is told to count it"
    assert s.build_connector_meta(sched_output()).refused == 0, "counted once"


def test_plain_requests_and_other_connectors_fields_are_not_counted() -> None:
    s = scheduler()
    for i, params in enumerate(
        [None, {}, {"do_remote_decode": False}, {"do_remote_decode": "true"}, {"do_remote_decode": 1}, {"some_other": 1}]
    ):
        assert s.params_of(FakeRequest(f"x{i}", list(range(4)), params)) is None  # type: ignore[arg-type]
    assert s.refused == 0


# ---- the mooncake dialect (vllm-router / llm-d --kv-connector mooncake) ----------

T = "xfer-0a1b250a-5acf-4daa-a810-ba4550601cbc"  # vllm-router 0.1.17 mints "xfer-" + a UUID
# What vllm-router 0.1.17 (--kv-connector mooncake, seen through stand-in
# servers) and llm-d's sidecar (connector_mooncake.go) send each half.
MC_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": T}
MC_DECODE = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "transfer_id": T,
    "remote_bootstrap_addr": "http://127.0.0.1:17500",
    "remote_engine_id": "prefill",
}


def mooncake_scheduler(key: bytes | None = None, tp: int = 1, **extra: Any) -> PdScheduler:
    vc = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BS), parallel_config=SimpleNamespace(tensor_parallel_size=tp)
    )
    cfg = PdConfig.from_extra_config({"orbitkv.pd.dialects": ["mooncake"], **extra})
    return PdScheduler(vc, dataclasses.replace(cfg, side_channel_key=key))  # type: ignore[arg-type]


def mc(rid: str, params: dict[str, Any], n_tokens: int = 40, **changes: Any) -> FakeRequest:
    return FakeRequest(rid, list(range(n_tokens)), {**params, **changes})


def test_both_mooncake_halves_derive_one_identity_and_capability() -> None:
    for key in (None, b"k" * 32):
        p = mooncake_scheduler(key).params_of(mc("p1", MC_PREFILL))
        d = mooncake_scheduler(key).params_of(mc("d1", MC_DECODE))
        assert p is not None and d is not None
        assert (p.role, d.role) == (kvp.PRODUCER, kvp.CONSUMER)
        assert (p.request, p.capability) == (d.request, d.capability)
        assert (p.dialect, d.dialect) == ("mooncake", "mooncake")
        assert (d.prefill_kv, d.prefill_tp, p.decode_tp) == ("127.0.0.1:17500", 1, 1)
        # the ID tells nothing of the transfer_id or the capability
        assert p.request.startswith("mc-") and T not in p.request and p.request[3:] not in p.capability
        assert re.fullmatch(r"[0-9a-f]{64}", p.capability)
        assert (p.request, p.capability) == kvp.mooncake_identity(T, key)
    # another transfer_id, another key, or none: another capability; the ID
    # depends on the transfer_id alone
    plain, k1, k2 = (kvp.mooncake_identity(T, k) for k in (None, b"k" * 32, b"j" * 32))
    other = kvp.mooncake_identity(T + "x", b"k" * 32)
    assert len({plain[1], k1[1], k2[1], other[1]}) == 4
    assert plain[0] == k1[0] == k2[0] != other[0]
    # known answers: without a key, SHA-256 over the domain and T; with one, its HMAC
    assert plain[1] == hashlib.sha256(b"orbitkv-mooncake-dialect\0" + T.encode()).hexdigest()
    assert k1[1] == hmac.new(b"k" * 32, b"orbitkv-mooncake-dialect\0" + T.encode(), hashlib.sha256).hexdigest()


def test_a_mooncake_prefill_streams_as_a_producer_and_holds_its_blocks_answering_nothing() -> None:
    s = mooncake_scheduler(tp=2, **{"orbitkv.pd.decode_tp": 4})
    r = mc("p1", MC_PREFILL, n_tokens=20)
    s.update_state_after_alloc(r, FakeBlocks([]), 0)
    (chunk,) = s.build_connector_meta(sched_output([FakeNewReq("p1", ([1, 2],), 0)], scheduled={"p1": 20})).producer_chunks
    request, capability = kvp.mooncake_identity(T, None)
    assert (chunk.pd_id, chunk.capability, chunk.consumer_tp) == (request, capability, 4)
    assert chunk.opens and chunk.last, "opened when scheduled: layers stream as they are computed"
    r.status = "FINISHED_LENGTH_CAPPED"
    # held for decode's handshake; the response carries nothing (the
    # router does not read it, and the transfer_id is not echoed)
    assert s.request_finished(r, [1, 2]) == (True, None)


def test_a_mooncake_decode_loads_from_the_bootstrap_address_as_a_consumer() -> None:
    s = mooncake_scheduler(tp=2, **{"orbitkv.pd.prefill_tp": 4})
    r = mc("d1", MC_DECODE)
    assert s.get_num_new_matched_tokens(r, 0) == (40, True)
    s.update_state_after_alloc(r, FakeBlocks([7, 8, 9]), 40)
    (o,) = s.build_connector_meta(sched_output()).consumers_open
    assert (o.pd_id, o.capability) == kvp.mooncake_identity(T, None)
    assert (o.prefill_kv, o.prefill_tp, o.block_ids) == ("127.0.0.1:17500", 4, [7, 8, 9])
    # without orbitkv.pd.prefill_tp: this instance's TP size
    d = mooncake_scheduler(tp=2).params_of(mc("d2", MC_DECODE))
    assert d is not None and d.prefill_tp == 2
    # IPv6 in brackets
    d = mooncake_scheduler().params_of(mc("d3", MC_DECODE, remote_bootstrap_addr="http://[::1]:17500"))
    assert d is not None and d.prefill_kv == "[::1]:17500"


def test_with_the_mooncake_dialect_off_it_is_served_plainly_counted_and_says_how(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for params in (MC_PREFILL, MC_DECODE):
        s = scheduler()  # orbitkv.pd.dialects: [] (the default)
        with caplog.at_level("WARNING", logger="orbitkv.vllm.scheduler"):
            assert_served_plainly(s, mc("x1", params), 1)
        assert "mooncake dialect" in caplog.text and "orbitkv.pd.dialects" in caplog.text
        assert T not in caplog.text, "the transfer_id (the capability's secret without a key) is never logged"
        caplog.clear()


BAD_MOONCAKE = {
    "empty-transfer-id": (MC_DECODE, {"transfer_id": ""}),
    "transfer-id-not-a-string": (MC_PREFILL, {"transfer_id": 12345}),
    "transfer-id-with-a-space": (MC_DECODE, {"transfer_id": "xfer 1"}),
    "transfer-id-with-a-newline": (MC_PREFILL, {"transfer_id": "xfer-1\nforged log line"}),
    "transfer-id-too-long": (MC_DECODE, {"transfer_id": "x" * 257}),
    "flag-a-string": (MC_DECODE, {"do_remote_prefill": "true"}),
    "flag-an-int": (MC_PREFILL, {"do_remote_decode": 1}),
    "other-flag-not-a-bool": (MC_PREFILL, {"do_remote_prefill": "no"}),
    "both-flags-true": (MC_DECODE, {"do_remote_decode": True}),
    "no-bootstrap-addr": (MC_DECODE, {"remote_bootstrap_addr": None}),
    "addr-without-scheme": (MC_DECODE, {"remote_bootstrap_addr": "127.0.0.1:17500"}),
    "addr-https": (MC_DECODE, {"remote_bootstrap_addr": "https://127.0.0.1:17500"}),
    "addr-with-a-path": (MC_DECODE, {"remote_bootstrap_addr": "http://127.0.0.1:17500/"}),
    "addr-with-userinfo": (MC_DECODE, {"remote_bootstrap_addr": "http://u@127.0.0.1:17500"}),
    "addr-port-0": (MC_DECODE, {"remote_bootstrap_addr": "http://127.0.0.1:0"}),
    "addr-port-too-large": (MC_DECODE, {"remote_bootstrap_addr": "http://127.0.0.1:65536"}),
    "addr-no-port": (MC_DECODE, {"remote_bootstrap_addr": "http://127.0.0.1"}),
    "addr-bare-ipv6": (MC_DECODE, {"remote_bootstrap_addr": "http://::1:17500"}),
    "addr-not-a-string": (MC_DECODE, {"remote_bootstrap_addr": ["http://127.0.0.1:17500"]}),
    "no-engine-id": (MC_DECODE, {"remote_engine_id": None}),
    "engine-id-with-a-space": (MC_DECODE, {"remote_engine_id": "a b"}),
    "engine-id-not-a-string": (MC_DECODE, {"remote_engine_id": 7}),
    "prefill-half-junk-addr": (MC_PREFILL, {"remote_bootstrap_addr": 7}),
    "orbitkv-key-beside": (MC_DECODE, {"orbitkv_capability": CAP}),
}


@pytest.mark.parametrize(("params", "changes"), list(BAD_MOONCAKE.values()), ids=list(BAD_MOONCAKE))
def test_a_malformed_mooncake_half_is_served_plainly_and_counted(
    params: dict[str, Any], changes: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    s = mooncake_scheduler()
    with caplog.at_level("WARNING", logger="orbitkv.vllm.scheduler"):
        assert_served_plainly(s, mc("x1", params, **changes), 1)
    assert "mooncake dialect" in caplog.text, caplog.text
    assert s.build_connector_meta(sched_output()).refused == 0, "counted when the request was decided"


def test_a_mooncake_decode_posts_only_to_declared_side_channels_even_with_a_key() -> None:
    """The dialect is unsigned: its bootstrap address must name a declared
    endpoint for every prefill rank (a signed orbitkv_prefill_kv needs only
    its host), whether or not a deployment key is set."""
    for key in (None, b"k" * 32):
        allowed = {"orbitkv.pd.allowed_prefill": ["10.0.0.2:17500-17501"]}
        s = mooncake_scheduler(key, **allowed)
        assert_served_plainly(s, mc("x1", MC_DECODE, remote_bootstrap_addr="http://10.0.0.2:17502"), 1)
        assert_served_plainly(s, mc("x2", MC_DECODE, remote_bootstrap_addr="http://10.0.0.3:17500"), 2)
        # rank 1 of a TP 2 prefill on 17501 would listen on 17502: undeclared
        s2 = mooncake_scheduler(key, **allowed, **{"orbitkv.pd.prefill_tp": 2})
        assert_served_plainly(s2, mc("x3", MC_DECODE, remote_bootstrap_addr="http://10.0.0.2:17501"), 1)
        d = s2.params_of(mc("d1", MC_DECODE, remote_bootstrap_addr="http://10.0.0.2:17500"))
        assert d is not None and (d.prefill_kv, d.prefill_tp) == ("10.0.0.2:17500", 2)
    # the default allow-list: loopback on the default ports only
    assert_served_plainly(mooncake_scheduler(), mc("x4", MC_DECODE, remote_bootstrap_addr="http://127.0.0.1:1"), 1)


def test_a_mooncake_transfer_id_live_twice_on_one_instance_is_served_plainly_the_second_time() -> None:
    s = mooncake_scheduler()
    assert s.get_num_new_matched_tokens(mc("d1", MC_DECODE), 0) == (40, True)
    assert_served_plainly(s, mc("d2", MC_DECODE), 1)


def test_transfer_id_without_a_p_d_flag_is_a_plain_request_not_counted() -> None:
    s = mooncake_scheduler()
    for i, params in enumerate(
        [
            {"transfer_id": T},
            {"transfer_id": T, "do_remote_decode": False, "do_remote_prefill": False},
            {"transfer_id": None, "do_remote_decode": False},
        ]
    ):
        assert s.params_of(FakeRequest(f"x{i}", list(range(4)), params)) is None
    assert s.refused == 0


def test_orbitkv_keys_win_over_the_mooncake_fields() -> None:
    s = mooncake_scheduler()
    r = with_params(producer("p1", 40), transfer_id=T, do_remote_decode=True)
    p = s.params_of(r)
    assert p is not None and (p.request, p.capability, p.dialect) == ("pd-1", CAP, None)


def test_mooncake_with_an_open_allow_list_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="orbitkv.vllm.scheduler"):
        mooncake_scheduler(**{"orbitkv.pd.allowed_prefill": "*"})
    assert "allowed_prefill is '*'" in caplog.text


@dataclass
class FakeStateRequest(FakeRequest):
    """A FakeRequest with what vLLM's Request keeps beside its prompt."""

    num_prompt_tokens: int = 0
    max_tokens: int = 16
    _all_token_ids: list[int] = field(default_factory=list)


def test_a_model_with_recurrent_state_loads_all_but_the_last_prompt_token() -> None:
    """Decode needs the state after all but the prompt's last token (it
    computes that one itself on it): prefill drops the last token of its
    half, once, and decode claims and authorizes one token less; a model
    without state claims the whole prompt as before."""
    from orbitkv.vllm.groups import KvGroups

    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS), parallel_config=SimpleNamespace(tensor_parallel_size=1))
    groups = KvGroups(2, BS, {"m": 0, "a": 1}, frozenset({0}))
    s = PdScheduler(cfg, PdConfig(), groups)  # type: ignore[arg-type]
    p = producer("p1", 40)
    half = FakeStateRequest(p.request_id, list(p.prompt_token_ids), p.kv_transfer_params, num_prompt_tokens=40,
                            _all_token_ids=list(p.prompt_token_ids))
    s.on_new_request(half)  # type: ignore[arg-type]
    s.on_new_request(half)  # type: ignore[arg-type]  # once only (a preempted request is seen again)
    assert (len(half.prompt_token_ids), len(half._all_token_ids), half.num_prompt_tokens, half.max_tokens) == (39, 39, 39, 1)
    c = consumer("d1", 40, pd="pd-d")
    assert s.get_num_new_matched_tokens(c, 0) == (39, True)  # type: ignore[arg-type]
    assert s.get_num_new_matched_tokens(c, 32) == (7, True)  # type: ignore[arg-type]
    # A consumer is never truncated; a model without state never either.
    s.on_new_request(c)  # type: ignore[arg-type]
    assert len(c.prompt_token_ids) == 40
    dense = scheduler()
    p2 = producer("p2", 40, pd="pd-2")
    whole = FakeStateRequest(p2.request_id, list(p2.prompt_token_ids), p2.kv_transfer_params, num_prompt_tokens=40,
                             _all_token_ids=list(p2.prompt_token_ids))
    dense.on_new_request(whole)  # type: ignore[arg-type]
    assert len(whole.prompt_token_ids) == 40
    assert dense.get_num_new_matched_tokens(consumer("d2", 40, pd="pd-3"), 0) == (40, True)  # type: ignore[arg-type]


# ---- the source staging taken out of vLLM's KV cache ---------------------------


def kv_cache_config(num_blocks: int, block_bytes: int) -> Any:
    """Test double of vLLM's KVCacheConfig: the fields the scheduler reads."""
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=[SimpleNamespace(size=num_blocks * block_bytes)])


@pytest.mark.parametrize(
    "extra,role,groups,taken",
    [
        ({"orbitkv.pd.staging_memory": "kv_cache"}, "kv_both", 1, 250),
        ({"orbitkv.pd.staging_memory": "kv_cache"}, "kv_producer", 1, 250),
        ({"orbitkv.pd.staging_memory": "kv_cache"}, "kv_consumer", 1, 0),
        ({"orbitkv.pd.staging_memory": "kv_cache"}, "kv_both", 2, 0),  # hybrid: no staging
        ({}, "kv_both", 1, 250),  # the default: kv_cache
        ({"orbitkv.pd.staging_kv_share": 0.1}, "kv_producer", 1, 100),  # a tenth instead of a quarter
        ({"orbitkv.pd.staging_memory": "beside"}, "kv_both", 1, 0),  # beside: nothing taken
        ({"orbitkv.pd.staging_mb": 512}, "kv_both", 1, 0),  # a size set by hand: beside
        ({"orbitkv.pd.staging_mb": 0}, "kv_both", 1, 0),  # staging off
    ],
)
def test_the_scheduler_takes_the_staging_out_of_vllms_pool_only_where_it_stages(
    extra: dict[str, Any], role: str, groups: int, taken: int
) -> None:
    """A quarter of a 1001-block pool (1 MiB blocks; ``staging_kv_share`` of
    it when set) on a rank that may
    prefill with ``staging_memory`` ``kv_cache``: blocks 1..250 from vLLM's
    real block pool, named in every step's metadata; the pool then counts
    only the rest. Nowhere else is anything taken."""
    from vllm.v1.core.block_pool import BlockPool

    from orbitkv.vllm.groups import KvGroups

    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BS, num_gpu_blocks=1001),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=SimpleNamespace(max_model_len=4096),
    )
    kg = KvGroups(2, BS, {"a": 0, "b": 1}) if groups == 2 else None
    s = PdScheduler(cfg, PdConfig.from_extra_config(extra), kg)  # type: ignore[arg-type]
    pool = BlockPool(num_gpu_blocks=1001, enable_caching=True, hash_block_size=BS)
    s.bind_block_pool(pool, kv_cache_config(1001, 1 << 20), role)
    want = [(1, 1 + taken)] if taken else []
    for _ in range(2):
        assert s.build_connector_meta(sched_output()).staging_blocks == want
    assert (pool.num_gpu_blocks, pool.get_num_free_blocks()) == (1001 - taken, 1000 - taken)
    if taken:
        # the unclaimed cap is a share of what vLLM serves from
        assert s._unclaimed_block_cap == int((1001 - taken) * 0.25)


def bind_logged(num_blocks: int, block_bytes: int, block_size: int, mnbt: int | None,
                max_len: int = 4096, extra: dict[str, Any] | None = None) -> tuple[PdScheduler, Any, list[str], list[str]]:
    """A default kv_producer scheduler bound to vLLM's real block pool of
    ``num_blocks`` blocks of ``block_bytes`` (``max_num_batched_tokens``
    ``mnbt``, None: no scheduler config): the scheduler, the pool, and what
    it logged at info and at warning while binding."""
    from vllm.v1.core.block_pool import BlockPool

    import orbitkv.vllm.scheduler as sm

    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block_size, num_gpu_blocks=num_blocks),
        parallel_config=SimpleNamespace(tensor_parallel_size=1), model_config=SimpleNamespace(max_model_len=max_len),
    )
    if mnbt is not None:
        cfg.scheduler_config = SimpleNamespace(max_num_batched_tokens=mnbt)
    s = PdScheduler(cfg, PdConfig.from_extra_config(extra or {}))  # type: ignore[arg-type]
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=block_size)
    infos: list[str] = []
    warnings: list[str] = []
    orig = sm.logger.info, sm.logger.warning
    sm.logger.info = lambda msg, *a: infos.append(msg % a)  # type: ignore[method-assign]
    sm.logger.warning = lambda msg, *a: warnings.append(msg % a)  # type: ignore[method-assign]
    try:
        s.bind_block_pool(pool, kv_cache_config(num_blocks, block_bytes), "kv_producer")
    finally:
        sm.logger.info, sm.logger.warning = orig  # type: ignore[method-assign]
    return s, pool, infos, warnings


@pytest.mark.parametrize("mnbt,taken,warned", [
    (None, 250, False),  # no scheduler config: the quarter, at most 1 GiB
    (96 * BS, 250, False),  # 96 blocks a step: the quarter is 2.6 steps
    (200 * BS, 250, True),  # 200 blocks a step: the quarter holds 1.25 steps, and the log says so
])
def test_the_scheduler_counts_the_staging_in_steps_of_max_num_batched_tokens_and_warns_below_two(
    mnbt: int | None, taken: int, warned: bool
) -> None:
    """A 1001-block pool of 1 MiB blocks (1000 MiB): a quarter, 250 blocks,
    is under 1 GiB, so a step's size leaves it as it is; the info line says
    how many steps of ``max_num_batched_tokens`` the region holds, and a
    warning names the setting to raise when it holds fewer than two (its
    pieces are held about three steps under load)."""
    s, _, infos, warnings = bind_logged(1001, 1 << 20, BS, mnbt)
    assert s.build_connector_meta(sched_output()).staging_blocks == [(1, 1 + taken)]
    steps = "steps unknown" if mnbt is None else f"{taken / (mnbt // BS):.1f} steps of max_num_batched_tokens"
    assert [x for x in infos if "taken for the source staging" in x and steps in x], infos
    low = [x for x in warnings if "holds 1.2 steps of max_num_batched_tokens" in x]
    assert bool(low) is warned, warnings
    if warned:
        # the quarter binds here (250 MiB of 1000, under the cap): the share is the setting to raise
        assert "raise orbitkv.pd.staging_kv_share (now 0.25)" in low[0], low
    # staging_pieces write: a piece is held for its write alone, so the
    # steps warn of nothing (the same blocks are taken)
    s, _, _, warnings = bind_logged(1001, 1 << 20, BS, mnbt, extra={"orbitkv.pd.staging_pieces": "write"})
    assert s.build_connector_meta(sched_output()).staging_blocks == [(1, 1 + taken)]
    assert not [x for x in warnings if "steps of max_num_batched_tokens" in x], warnings


@pytest.mark.parametrize("mnbt", [0, -8192, True, "8192", 8192.0])
def test_a_max_num_batched_tokens_that_is_no_count_of_tokens_sizes_no_step(mnbt: Any) -> None:
    """vLLM's ``max_num_batched_tokens`` read as a step only when it is a
    positive int: anything else is no step (the quarter at most 1 GiB, "steps
    unknown" in the log), never an exception at bind time."""
    from orbitkv.vllm.scheduler import _step_blocks

    assert _step_blocks(SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=mnbt)), BS) == 0
    s, _, infos, warnings = bind_logged(1001, 1 << 20, BS, mnbt)
    assert s.build_connector_meta(sched_output()).staging_blocks == [(1, 251)]
    assert [x for x in infos if "steps unknown" in x] and not warnings, (infos, warnings)


def test_a_staging_at_its_cap_below_two_steps_names_the_step_not_the_share() -> None:
    """8 GiB in 4096 blocks of 2 MiB, 8192 tokens a step (512 blocks, 1
    GiB): a tenth of the cache is under 1 GiB, so the region is the 1 GiB
    cap, one step, which a larger share would not change: the warning says
    to lower max_num_batched_tokens and names the cap, not the share."""
    s, _, _, warnings = bind_logged(4096, 2 << 20, 16, 8192, max_len=8192)
    assert s.build_connector_meta(sched_output()).staging_blocks == [(1, 1 + 512)]
    assert len(warnings) == 1 and "holds 1.0 steps" in warnings[0], warnings
    assert "lower max_num_batched_tokens (the region is at its cap" in warnings[0]
    assert "staging_kv_share" not in warnings[0]


def test_a_deep_models_step_grows_the_staging_past_a_gib_within_a_tenth_of_the_cache() -> None:
    """48 GiB in 24,576 blocks of 2 MiB (Llama-3-8B's block of 16 tokens),
    8192 tokens a step (512 blocks, 1 GiB): the scheduler takes three steps,
    1536 blocks (3 GiB, 6.25 % of the cache), out of vLLM's real pool, not
    the 512 of the 1 GiB cap, and does not warn."""
    s, pool, infos, warnings = bind_logged(24_576, 2 << 20, 16, 8192, max_len=8192)
    assert s.build_connector_meta(sched_output()).staging_blocks == [(1, 1 + 1536)]
    assert pool.num_gpu_blocks == 24_576 - 1536 and not warnings, warnings
    assert [x for x in infos if "(3072 MiB per rank)" in x and "3.0 steps of max_num_batched_tokens" in x], infos


def test_a_pool_too_small_for_a_whole_request_gives_nothing_and_a_vllm_that_never_binds_is_said() -> None:
    from vllm.v1.core.block_pool import BlockPool

    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BS), parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=SimpleNamespace(max_model_len=1000 * BS),
    )
    s = PdScheduler(cfg, PdConfig.from_extra_config({"orbitkv.pd.staging_memory": "kv_cache"}))  # type: ignore[arg-type]
    pool = BlockPool(num_gpu_blocks=1001, enable_caching=True, hash_block_size=BS)
    s.bind_block_pool(pool, kv_cache_config(1001, 1 << 20), "kv_both")
    assert s.build_connector_meta(sched_output()).staging_blocks == []
    assert pool.num_gpu_blocks == 1001
    unbound = PdScheduler(cfg, PdConfig.from_extra_config({"orbitkv.pd.staging_memory": "kv_cache"}))  # type: ignore[arg-type]
    logged: list[str] = []
    import orbitkv.vllm.scheduler as sm

    orig = sm.logger.warning
    sm.logger.warning = lambda msg, *a: logged.append(msg % a)  # type: ignore[method-assign]
    try:
        for _ in range(3):
            assert unbound.build_connector_meta(sched_output()).staging_blocks == []
    finally:
        sm.logger.warning = orig  # type: ignore[method-assign]
    assert len(logged) == 1 and "bind_gpu_block_pool" in logged[0], logged


def test_a_kv_both_instance_that_only_decodes_gives_the_staging_blocks_back_once() -> None:
    """The default takes the staging's blocks on every rank that may
    prefill, kv_both included: one that has decoded 64 requests and
    prefilled none gives them back to vLLM's real block pool at the 64th
    (the pool counts all its blocks again, every one free that no request
    holds), says so once with the advice to start as kv_consumer, and names
    no staging but ``staging_released`` in every later step's metadata; one
    that prefilled first, or took nothing (kv_consumer), keeps what it has
    and says nothing. A pool that cannot take them back keeps them, and the
    warning says how many it keeps."""
    from vllm.v1.core.block_pool import BlockPool

    import orbitkv.vllm.scheduler as sm

    def run(role: str, prefill_first: bool, n: int, pool: Any = None) -> tuple[list[str], PdScheduler, Any]:
        cfg = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=BS, num_gpu_blocks=1001),
            parallel_config=SimpleNamespace(tensor_parallel_size=1), model_config=SimpleNamespace(max_model_len=4096),
        )
        s = PdScheduler(cfg, PdConfig.from_extra_config({}))  # type: ignore[arg-type]
        pool = pool or BlockPool(num_gpu_blocks=1001, enable_caching=True, hash_block_size=BS)
        s.bind_block_pool(pool, kv_cache_config(1001, 1 << 20), role)
        logged: list[str] = []
        orig = sm.logger.warning
        sm.logger.warning = lambda msg, *a: logged.append(msg % a)  # type: ignore[method-assign]
        try:
            if prefill_first:
                r = producer("p0", 40, pd="pd-p0")
                s.get_num_new_matched_tokens(r, 0)
                s.update_state_after_alloc(r, FakeBlocks([200, 201, 202]), 0)
            for i in range(n):
                r = consumer(f"d{i}", 40, pd=f"pd-{i}")
                assert s.get_num_new_matched_tokens(r, 0) == (40, True)
                s.update_state_after_alloc(r, FakeBlocks([300 + 3 * i, 301 + 3 * i, 302 + 3 * i]), 40)
                if i == sm.DECODE_ONLY_HINT_AFTER - 2:
                    # one short of the count: the blocks are still the staging's
                    meta = s.build_connector_meta(sched_output())
                    assert (meta.staging_blocks, meta.staging_released) == (s.staging_runs, False)
        finally:
            sm.logger.warning = orig  # type: ignore[method-assign]
        return [m for m in logged if "kv_consumer" in m], s, pool

    said, s, pool = run("kv_both", False, sm.DECODE_ONLY_HINT_AFTER - 1)
    assert said == [] and s.staging_runs == [(1, 251)] and pool.num_gpu_blocks == 1001 - 250
    said, s, pool = run("kv_both", False, 2 * sm.DECODE_ONLY_HINT_AFTER)
    assert len(said) == 1 and "the 250 KV cache blocks it took" in said[0] and "given back to vLLM" in said[0], said
    # vLLM's pool has every block again, all free (the test's requests hold
    # none of the pool's own), the null block aside
    assert (pool.num_gpu_blocks, pool.get_num_free_blocks()) == (1001, 1000)
    assert all(pool.blocks[b].ref_cnt == 0 for b in range(1, 251))
    assert s._unclaimed_block_cap == int(1001 * 0.25)
    for _ in range(2):
        meta = s.build_connector_meta(sched_output())
        assert (meta.staging_blocks, meta.staging_released) == ([], True)
    # what was given back is handed out again by vLLM as any block
    again = pool.get_new_blocks(1000)
    assert {b.block_id for b in again} == set(range(1, 1001))
    said, s, pool = run("kv_both", True, 2 * sm.DECODE_ONLY_HINT_AFTER)
    assert said == [] and s.staging_runs == [(1, 251)] and not s.staging_released and pool.num_gpu_blocks == 751
    said, s, pool = run("kv_consumer", False, 2 * sm.DECODE_ONLY_HINT_AFTER)
    assert said == [] and s.staging_runs == [] and pool.num_gpu_blocks == 1001

    class NoFree(BlockPool):  # test double: a vLLM whose pool has no free_blocks to call
        def __getattribute__(self, name: str) -> Any:
            if name == "free_blocks":
                raise AttributeError(name)
            return super().__getattribute__(name)

    said, s, pool = run("kv_both", False, 2 * sm.DECODE_ONLY_HINT_AFTER,
                        NoFree(num_gpu_blocks=1001, enable_caching=True, hash_block_size=BS))
    assert len(said) == 1 and "keeps 250 of its KV cache blocks" in said[0], said
    assert s.staging_runs == [(1, 251)] and not s.staging_released and pool.num_gpu_blocks == 751


def test_a_pool_that_refuses_the_blocks_leaves_the_scheduler_serving_without_staging() -> None:
    """A block pool (test double) whose ``get_new_blocks`` raises: nothing
    is taken, nothing is named, the scheduler goes on."""

    class Refusing:
        num_gpu_blocks = 1001

        def get_num_free_blocks(self) -> int:
            return 1000

        def get_new_blocks(self, n: int) -> list[Any]:
            raise RuntimeError("not now")

    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=BS), parallel_config=SimpleNamespace(tensor_parallel_size=1))
    s = PdScheduler(cfg, PdConfig.from_extra_config({"orbitkv.pd.staging_memory": "kv_cache"}))  # type: ignore[arg-type]
    pool = Refusing()
    s.bind_block_pool(pool, kv_cache_config(1001, 1 << 20), "kv_both")
    assert s.build_connector_meta(sched_output()).staging_blocks == [] and pool.num_gpu_blocks == 1001


def test_the_worker_takes_the_named_blocks_once_and_stages_by_layer_from_then_on(worker: PdWorker) -> None:
    """A worker started for ``kv_cache`` hands the runtime the bytes of the
    named blocks in its own KV tensors the first time a step's metadata
    names them, and stages by layer from then on; blocks outside its KV
    cache are refused (logged), and the rank stays page to page."""
    kv = torch.zeros(2, 8, 4, dtype=torch.float32)  # [K/V, 8 blocks, 16-byte blocks]
    es = kv.element_size()
    layout = {"num_blocks": 8, "layers": [{"planes": [
        {"base": kv[i].data_ptr(), "block_stride": 4 * es, "block_bytes": 4 * es} for i in (0, 1)
    ]}]}
    worker._kv_storages = {kv.untyped_storage().data_ptr(): kv.untyped_storage().nbytes()}
    worker._layout = layout
    worker._copier = StagingCopier(layout, 1, [kv])
    rt: RecordingRuntime = worker.runtime  # type: ignore[assignment]
    # not one run from block 1 (where vLLM's pool starts), or past the
    # cache: refused, nothing handed over, never staged by layer
    for bad in ([(2, 5)], [(1, 3), (4, 5)], [(1, 9)]):
        worker._staging_later, rt.calls[:] = True, []
        worker.start_load_kv(PdConnectorMetadata(staging_blocks=bad))
        assert not [c for c in rt.calls if c[0] == "add_source_staging"], bad
        assert not worker._by_layer and not worker._staging_later
    worker._staging_later = True
    worker.start_load_kv(PdConnectorMetadata(staging_blocks=[(1, 4)]))
    added = [c for c in rt.calls if c[0] == "add_source_staging"]
    assert added == [("add_source_staging", [(kv[0, 1].data_ptr(), 48), (kv[1, 1].data_ptr(), 48)])]
    assert worker._by_layer and not worker._staging_later
    worker.start_load_kv(PdConnectorMetadata(staging_blocks=[(1, 4)]))
    assert len([c for c in rt.calls if c[0] == "add_source_staging"]) == 1, "taken twice"
    # the copier's views start past the taken blocks
    with pytest.raises(ValueError, match="below 4"):
        worker._copier.index([5, 3])
