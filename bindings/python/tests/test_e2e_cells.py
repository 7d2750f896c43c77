"""benches/gpu/e2e/cells.py: issue 48's load cells across samples of the GPU
end-to-end driver, read from the result tarballs it returned. Checked on
synthetic samples whose ratios are known."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
import tarfile
from contextlib import redirect_stdout
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

CELLS = Path(__file__).resolve().parents[3] / "benches" / "gpu" / "e2e" / "cells.py"


def _cells() -> ModuleType:
    spec = importlib.util.spec_from_file_location("orbitkv_e2e_cells", CELLS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


cells = _cells()
LEVELS = [("c1", 1, 4), ("c4", 4, 4), ("c8", 8, 4), ("c16", 16, 4), ("c32", 32, 4)]


def _run(ttft: float, tok_s: float, e2el: float, peak: float, taken: bool) -> dict[str, Any]:
    prefill: dict[str, Any] = {"kv_usage_peak": peak, "running_peak": 4.0, "waiting_peak": 3.0}
    if taken:  # OrbitKV: a quarter of the blocks taken for the source staging
        prefill.update(kv_usage_peak_pages=peak * 0.75, kv_usage_peak_whole=peak * 0.75 + 0.25,
                       kv_taken=[1536, 6144])
    return {"p50_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "output_throughput": tok_s, "mean_ttft_ms": ttft,
            "mean_e2el_ms": e2el, "request_throughput": tok_s / 64, "servers": {"big-x-prefill": prefill, "big-x-decode": {"kv_usage_peak": 0.1}}}


def _sample(root: Path, name: str, *, control: bool, prefill_ms: dict[str, tuple[float, float]]) -> Path:
    """A driver result directory: OrbitKV's TTFT 0.8 x MC's, tok/s 1.2 x, its
    prefill peak 0.4 of vLLM's blocks (0.3 of the cache in pages, 0.55 with
    the taken quarter) against MC's 0.5; the proxies' lines per level give
    (prefill answered, first byte) in ms per system."""
    d = root / name
    work = root / f"{name}-src"
    (work / "results").mkdir(parents=True)
    (work / "logcut").mkdir()
    runs = "warmup:4:2:1000," + ",".join(f"{lv}:{c}:{n}:1" for lv, c, n in LEVELS)
    systems: dict[str, Any] = {}
    for sys_name, ttft, tok_s, peak, taken in [("orbit", 80.0, 120.0, 0.4, True), ("mc", 100.0, 100.0, 0.5, False),
                                               ("orbit-control", 88.0, 120.0, 0.4, True)]:
        if sys_name == "orbit-control" and not control:
            continue
        systems[sys_name] = {"runs": {lv: _run(ttft, tok_s, 200.0, peak, taken) for lv, _, _ in LEVELS}}
        lines = ["# header line the proxy prints", "orbitkv.proxy: listening on ..."]
        for lv, n in [("warmup", 2)] + [(lv, n) for lv, _, n in LEVELS]:
            pre, first = prefill_ms[sys_name if sys_name != "orbit-control" else "orbit"] if lv != "warmup" else (1, 2)
            lines += [f"2026-12-06 19:13:13,709 proxy INFO id /v1/completions: decode=200 prefill_s={pre / 1e3} "
                      f"first_byte_s={first / 1e3} done_s=0.3" for _ in range(n)]
        (work / "logcut" / f"big-{sys_name}-proxy.log").write_text("\n".join(lines) + "\n")
    stage = {"config": {"warmup": runs.split(",")[0], "runs": runs.split(",", 1)[1]}, "systems": systems}
    (work / "results" / "b-default.json").write_text(json.dumps(stage))
    d.mkdir()
    with tarfile.open(d / "results.tar.xz", "w:xz") as tf:
        tf.add(work / "results", arcname="results")
    with tarfile.open(d / "logs.tar.xz", "w:xz") as tf:
        tf.add(work / "logcut", arcname="logcut")
    return d


def _report(tmp_path: Path, **samples: Path) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cells.main([f"{k}={v}" for k, v in samples.items()]) == 0
    return out.getvalue()


def test_the_ratios_per_sample_the_medians_against_the_goals_and_the_aa_spread(tmp_path: Path) -> None:
    times = {"orbit": (50.0, 60.0), "mc": (40.0, 100.0)}
    a = _sample(tmp_path, "a", control=True, prefill_ms=times)
    b = _sample(tmp_path, "b", control=False, prefill_ms=times)
    text = _report(tmp_path, a=a, b=b)
    # per sample: TTFT 0.80 at p50 and p99, tok/s 1.20, request pages 0.3 / 0.5,
    # with the taken quarter 0.55 / 0.5; the A/A pair 1.10 / 1.10 / 1.00
    assert "| 16 | a | 0.80 | 0.80 | 1.20 | 0.60 | 1.10 | 1.10 / 1.10 / 1.00 |" in text
    assert "| 16 | b | 0.80 | 0.80 | 1.20 | 0.60 | 1.10 | - |" in text
    assert "| 32 | ttft_p50 | 0.80 (0.80 – 0.80) | ≤ 0.85 | yes | 1.10 – 1.10 |" in text
    assert "| 32 | kv_pages | 0.60 (0.60 – 0.60) | ≤ 0.8 | yes |" in text
    assert "| 32 | kv_whole | 1.10 (1.10 – 1.10) | ≤ 0.8 | **no** |" in text
    assert "| 1 | kv_whole" not in text  # the KV goal is set at 16 and 32 in flight only
    # the bounds: MC's prefill answered at 40 of its first byte's 100 ms (0.40),
    # OrbitKV's prefill at 50 (1.25 x MC's), hand-offs 10 and 60 ms; at 1 in
    # flight a hand-off of 0 takes 10 of 200 ms off each request: 1.20 x 200 / 190;
    # requests/s 1.20 x MC's, and 200 / (0.85 x 100 + 120) = 0.98 x would give
    # a mean TTFT of 0.85 x MC's; Little's law: 1.20 x 200 / (1 x 200)
    bounds = text.split("## What bounds them")[1]
    row = next(line for line in bounds.splitlines() if line.startswith("| 1 | a |"))
    assert row == ("| 1 | a | 0.40 / 0.40 | 1.25 / 1.25 | 10 / 60 | 3 / 3 | 0.50 | 1.20 / 0.98 (1.20) | 1.26 "
                   "| 0.60 |")


def test_old_wheels_without_the_pages_share_count_vllms_blocks_only(tmp_path: Path) -> None:
    """A driver of a wheel before 496bf08 wrote the prefill's peak over the
    blocks vLLM kept and the whole-cache peak, not the pages' share of the
    whole cache: it is derived from the taken blocks."""
    server = {"kv_usage_peak": 0.4, "kv_usage_peak_whole": 0.55, "kv_taken": [1536, 6144]}
    mc = {"kv_usage_peak": 0.5}
    a = {"c16": {"p50_ttft_ms": 1, "p99_ttft_ms": 1, "output_throughput": 1, "servers": {"p-prefill": server}}}
    b = {"c16": {"p50_ttft_ms": 1, "p99_ttft_ms": 1, "output_throughput": 1, "servers": {"m-prefill": mc}}}
    r = cells.ratios(a, b, "c16")
    assert r["kv_pages"] == pytest.approx(0.4 * 0.75 / 0.5)
    assert r["kv_whole"] == pytest.approx(0.55 / 0.5)


def test_a_sample_without_both_systems_or_a_label_twice_is_refused(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    times = {"orbit": (50.0, 60.0), "mc": (40.0, 100.0)}
    a = _sample(tmp_path, "a", control=False, prefill_ms=times)
    with pytest.raises(SystemExit) as e:
        cells.main([f"a={a}", f"a={a}"])
    assert e.value.code == 2 and "every LABEL once" in capsys.readouterr().err
    stage = tmp_path / "x"
    with tarfile.open(a / "results.tar.xz") as tf:
        tf.extractall(stage, filter="data")
    data = json.loads((stage / "results" / "b-default.json").read_text())
    del data["systems"]["mc"]
    (stage / "results" / "b-default.json").write_text(json.dumps(data))
    b = tmp_path / "b"
    b.mkdir()
    with tarfile.open(b / "results.tar.xz", "w:xz") as tf:
        tf.add(stage / "results", arcname="results")
    (b / "logs.tar.xz").write_bytes((a / "logs.tar.xz").read_bytes())
    with pytest.raises(SystemExit) as e:
        cells.main([f"b={b}"])
    assert e.value.code == 2 and "sample b: no mc system" in capsys.readouterr().err
