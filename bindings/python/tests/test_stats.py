"""The runtime's counters reach vLLM's logger and Prometheus from one list:
Rust's `StatsSnapshot` (exported as `orbitkv._native.STATS_FIELDS`), each
under one documented Prometheus name."""

from __future__ import annotations

import re
from pathlib import Path

from orbitkv import _native
from orbitkv.vllm import stats

DOCS = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"
DASHBOARD = DOCS.parent / "grafana" / "orbitkv-pd.json"


def test_every_runtime_counter_is_reported_and_exported_once() -> None:
    assert tuple(_native.STATS_FIELDS) == stats.COUNTERS
    assert len(set(stats.COUNTERS)) == len(stats.COUNTERS) > 20
    for name in stats.COUNTERS:
        counters = name in stats._PROM
        seconds = name in stats._SECONDS
        assert counters != seconds, f"{name}: exported {'twice' if counters else 'nowhere'}"
        assert seconds == name.endswith("_micros"), f"{name}: a time sum is exported in seconds"
    assert set(stats._PROM) | set(stats._SECONDS) <= set(stats.COUNTERS), "an exported name the runtime lacks"


def test_every_timed_phase_is_a_histogram() -> None:
    assert tuple(_native.TIMING_NAMES) == stats.TIMINGS
    assert set(stats._HISTOGRAMS) == set(stats.TIMINGS) | set(stats.PY_TIMINGS), \
        "a timed phase without a histogram, or one nobody times"
    assert not set(stats.TIMINGS) & set(stats.PY_TIMINGS)
    assert all(n.endswith("_seconds") for n, _ in stats._HISTOGRAMS.values())
    assert list(stats.TIMING_BUCKETS) == sorted(set(stats.TIMING_BUCKETS))


def _exported() -> set[str]:
    return ({n for n, _ in stats._PROM.values()} | {n for n, _ in stats._SECONDS.values()}
            | {n for n, _ in stats._HISTOGRAMS.values()})


def test_every_prometheus_name_is_documented() -> None:
    text = DOCS.read_text()
    documented = set(re.findall(r"`(vllm:orbitkv_[a-z_]+)`", text))
    exported = _exported()
    assert exported - documented == set(), "metrics missing from docs/configuration.md#metrics"
    assert documented - exported == set(), "documented metrics nothing exports"


def test_the_stats_object_reports_every_counter() -> None:
    snapshot = stats.PdConnectorStats(data={k: 1 for k in stats.COUNTERS})
    assert not snapshot.is_empty()
    assert set(snapshot.reduce()) >= set(stats.COUNTERS)


def test_the_grafana_dashboard_shows_every_orbitkv_metric_by_its_exported_name() -> None:
    """docs/grafana/orbitkv-pd.json: every vllm:orbitkv_* series it queries is
    one the connector exports (Prometheus adds _total to counters), and every
    exported one has a panel. (That vLLM's own series it queries exist is
    checked against real servers: e2e/test_pd_vllm.py.)"""
    import json

    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    queried = {n for e in exprs for n in re.findall(r"vllm:orbitkv_[a-z_]+", e)}
    exported = ({f"{n}_total" for n, _ in stats._PROM.values()} | {f"{n}_total" for n, _ in stats._SECONDS.values()}
                | {f"{n}_bucket" for n, _ in stats._HISTOGRAMS.values()})
    assert queried - exported == set(), "the dashboard queries series the connector does not export"
    assert exported - queried == set(), "exported series without a panel"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_timings_travel_aggregate_and_reduce_without_touching_what_they_were_given() -> None:
    """Two workers' reports (TP ranks) joined: the lists concatenated into
    new ones (vLLM may hand the same dict to its logger and to Prometheus),
    p50 / p90 in the log line, a report with only timings is not empty."""
    mine = {"written_after_finish": [0.010, 0.030]}
    theirs = {"written_after_finish": [0.020], "complete_to_taken": [0.001]}
    a = stats.PdConnectorStats(data={"timings": mine})
    b = stats.PdConnectorStats(data={"timings": theirs})
    assert not a.is_empty() and not b.is_empty()
    joined = a.aggregate(b)
    assert sorted(joined.data["timings"]["written_after_finish"]) == [0.010, 0.020, 0.030]
    assert joined.data["timings"]["complete_to_taken"] == [0.001]
    assert mine == {"written_after_finish": [0.010, 0.030]} and theirs["written_after_finish"] == [0.020]
    out = joined.reduce()
    assert (out["written_after_finish_n"], out["written_after_finish_p50_ms"]) == (3, 20.0)
    assert out["written_after_finish_p90_ms"] == 30.0
    assert "pages_held_after_finish_n" not in out, "a phase with no request is left out of the log line"
    joined.reset()
    assert joined.is_empty() and joined.data["timings"] == {}
    assert stats.PdConnectorStats(data={k: 0 for k in stats.COUNTERS}).is_empty()


def test_timings_become_prometheus_histograms_and_counters_stay_counters() -> None:
    from functools import partial

    import prometheus_client as pc

    reg = pc.CollectorRegistry()
    types = {cls: partial(cls, registry=reg) for cls in (pc.Gauge, pc.Counter, pc.Histogram)}

    class _Cfg:
        kv_transfer_config = None

    m = stats.PdPromMetrics(_Cfg(), types, ["engine"], {0: ["0"]})
    m.observe({"bytes_written": 5, "layer_write_micros": 2_000_000,
               "timings": {"written_after_finish": [0.004, 0.3], "complete_to_taken": [0.002]}})

    def value(name: str, **labels: str) -> float | None:
        return reg.get_sample_value(name, {"engine": "0", **labels})

    assert value("vllm:orbitkv_written_after_finish_seconds_count") == 2
    assert value("vllm:orbitkv_written_after_finish_seconds_bucket", le="0.005") == 1
    assert value("vllm:orbitkv_written_after_finish_seconds_bucket", le="0.5") == 2
    assert abs((value("vllm:orbitkv_written_after_finish_seconds_sum") or 0) - 0.304) < 1e-9
    assert value("vllm:orbitkv_complete_to_taken_seconds_count") == 1
    assert value("vllm:orbitkv_pages_held_after_finish_seconds_count") == 0
    assert value("vllm:orbitkv_bytes_written_total") == 5
    assert value("vllm:orbitkv_layer_write_seconds_total") == 2.0
