"""The worker's per-request ledger: one record per P/D request and side,
holding what the worker must remember between vLLM's hooks (which vLLM
request it is, which blocks it loads into, whether vLLM ended it, what was
reported). One place to look when debugging a request, instead of a dozen
parallel dicts and sets; a record disappears when nothing is left in it.

The rules that use these fields are in ``worker.py`` (``get_finished``,
``start_load_kv``); the scheduler side keeps its own state
(``scheduler.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar


class _Record(Protocol):
    def empty(self) -> bool: ...


R = TypeVar("R", bound=_Record)


class Records(Generic[R]):
    """The records of one side, by P/D id."""

    def __init__(self, make: Callable[[], R]) -> None:
        self._make = make
        self._by_pd: dict[str, R] = {}

    def get(self, pd: str) -> R:
        """The record of ``pd``, created empty if there is none."""
        rec = self._by_pd.get(pd)
        if rec is None:
            rec = self._by_pd[pd] = self._make()
        return rec

    def peek(self, pd: str) -> R:
        """The record of ``pd``, or an empty one (not stored)."""
        return self._by_pd.get(pd) or self._make()

    def tidy(self, pd: str) -> None:
        """Drops ``pd``'s record once nothing is left in it."""
        rec = self._by_pd.get(pd)
        if rec is not None and rec.empty():
            del self._by_pd[pd]

    def pop(self, pd: str) -> R | None:
        return self._by_pd.pop(pd, None)

    def where(self, keep: Callable[[R], bool]) -> list[tuple[str, R]]:
        """A snapshot of the records ``keep`` selects (safe to change them)."""
        return [(pd, rec) for pd, rec in self._by_pd.items() if keep(rec)]

    def __contains__(self, pd: object) -> bool:
        return pd in self._by_pd

    def __len__(self) -> int:
        return len(self._by_pd)


@dataclass
class ConsumerRecord:
    """A decode (consumer) request on this rank."""

    # The vLLM request id, while the runtime may still report on it.
    req_id: str | None = None
    # The blocks it loads into (reported as load errors if the KV fails).
    blocks: list[int] | None = None
    # vLLM ended it: None not yet; True report it when the runtime releases
    # it; False release without a report.
    end: bool | None = None
    # Reported to vLLM as finished receiving (once).
    reported: bool = False
    # Report at the next get_finished without waiting for the runtime (it no
    # longer knows the request, or released it already).
    release_now: bool = False
    # CUDA: an event recorded after the scatter of its staging grant; the
    # grant goes back (consumer_release) only once it completed.
    scatter_done: Any = None

    def empty(self) -> bool:
        return (
            self.req_id is None and self.blocks is None and self.end is None and not (self.reported or self.release_now)
        )


@dataclass
class ProducerRecord:
    """A prefill (producer) request on this rank."""

    # The vLLM request id, while vLLM may wait for our word.
    req_id: str | None = None
    # vLLM finished it and waits for our word to free its blocks.
    ended: bool = False
    # The runtime released it (or it never opened): nothing reads its blocks.
    released: bool = False
    # producer_finish (or an abort) was called.
    finished: bool = False
    # When producer_finish was called (time.monotonic(); None: aborted, or
    # not yet): the clock of the worker's own phases (PY_TIMINGS).
    finished_at: float | None = None
    # Source staging (orbitkv.staging): (address, capacity in blocks, the
    # staged layout's slots, its group), freed once the runtime released the
    # request and vLLM no longer schedules it (nothing reads or gathers into it).
    staging: tuple[int, int, list[Any], int] | None = None
    # Staged by layer (the default): the units per group of its pieces,
    # which the runtime gives per layer and chunk and takes back itself.
    layer_group: int | None = None
    # A staging request's source blocks so far, in request order (gathered from).
    blocks: list[int] = field(default_factory=list)
    # vLLM ended or aborted it: no chunk of it will be computed any more.
    vllm_done: bool = False
    # Reported to vLLM as sent before the release: the runtime gave its
    # pages back (every layer in a layer piece or at decode); the release
    # reports nothing.
    pages_back: bool = False
    # When its pages went back (time.monotonic()): its decode must claim it
    # within orbitkv.pd.claim_timeout_s of that, or it is given up (asked once).
    back_at: float | None = None
    unclaimed_asked: bool = False
    # Told the scheduler its decode claimed it (PdWorker.claimed): once.
    claim_reported: bool = False
    # The runtime said its pages can only go at the release (decode's
    # authorization is written from them): not asked again.
    pages_never: bool = False

    def empty(self) -> bool:
        return (self.req_id is None and self.staging is None and self.layer_group is None
                and not (self.ended or self.released or self.finished or self.pages_back))


@dataclass
class Ledger:
    """Every request this worker tracks, by P/D id, per side."""

    consumers: Records[ConsumerRecord] = field(default_factory=lambda: Records(ConsumerRecord))
    producers: Records[ProducerRecord] = field(default_factory=lambda: Records(ProducerRecord))
    # pd_id -> vLLM request id of consumers the runtime released after a
    # report vLLM may have withheld (PdScheduler.update_connector_output):
    # reported again if vLLM says so. Bounded: the oldest go first.
    released_after_report: dict[str, str] = field(default_factory=dict)
    released_after_report_cap: int = 4096

    def release_now(self) -> Iterator[str]:
        """The consumers to report without waiting for the runtime."""
        return iter([pd for pd, _ in self.consumers.where(lambda r: r.release_now)])

    def remember_released_after_report(self, pd: str, req_id: str) -> None:
        self.released_after_report[pd] = req_id
        while len(self.released_after_report) > self.released_after_report_cap:
            self.released_after_report.pop(next(iter(self.released_after_report)))

    def ended_and_released(self) -> list[tuple[str, ProducerRecord]]:
        """Producers vLLM waits for whose blocks nothing reads any more."""
        return self.producers.where(lambda r: r.released and r.ended)

    def sizes(self) -> dict[str, int]:
        """Records held, for debugging and leak tests."""
        return {
            "consumers": len(self.consumers),
            "producers": len(self.producers),
            "released_after_report": len(self.released_after_report),
        }
