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


def test_every_prometheus_name_is_documented() -> None:
    text = DOCS.read_text()
    documented = set(re.findall(r"`(vllm:orbitkv_[a-z_]+)`", text))
    exported = {n for n, _ in stats._PROM.values()} | {n for n, _ in stats._SECONDS.values()}
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
    exported = {f"{n}_total" for n, _ in stats._PROM.values()} | {f"{n}_total" for n, _ in stats._SECONDS.values()}
    assert queried - exported == set(), "the dashboard queries series the connector does not export"
    assert exported - queried == set(), "exported series without a panel"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
