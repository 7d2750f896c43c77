"""Issue 48's load cells across samples, read from the committed raw results.

Each sample is a directory the GPU end-to-end driver returned (``summary.md``,
``results.tar.xz`` with ``results/b-default.json``, ``logs.tar.xz`` with the
proxies' logs) of a ``b-default`` stage that ran OrbitKV's defaults (``orbit``)
and vLLM's MooncakeConnector (``mc``) on the same prompts, and maybe an
identical second OrbitKV pair (``orbit-control``: the A/A spread)::

    python benches/gpu/e2e/cells.py 45a=benches/results/.../load-aa 48=... > cells.md

For every level of requests in flight and every sample it prints OrbitKV ÷ MC
(TTFT p50 and p99, output tok/s, the prefill's KV peak in request pages and
with the blocks taken for the source staging) and the A/A ratios; then, across
the samples, the median and the range of each cell beside its goal; then what
bounds the cells that are not met, from the proxies' per-request lines (when
the prefill answered and when decode's first byte came, ms after the proxy
took the request):

* ``MC zero-handoff bound``: MC's prefill answered ÷ MC's first byte, at p50
  and p99 — the TTFT ratio a connector whose hand-off cost nothing (decode's
  first byte at the moment the prefill answered) would get against MC, were
  its prefill as fast as MC's;
* ``prefill ÷ MC's``: OrbitKV's prefill answered ÷ MC's, at p50 and p99 (the
  prefill's queue and compute, which the connector does not do);
* ``requests/s``: OrbitKV's requests per second ÷ MC's, and the ratio a mean
  TTFT of 0.85 x MC's takes. ``vllm bench serve`` with a concurrency of N is a
  closed loop (Little's law: requests/s = N / mean request time, checked in
  brackets), so where the prefill is saturated a shorter hand-off only moves
  time into the prefill's queue: TTFT falls only as far as the pair serves
  more requests per second;
* at 1 in flight, ``tok/s bound``: the output tok/s ratio OrbitKV would reach
  against MC with a hand-off of 0 (each request shorter by its measured
  first byte − prefill answered): one request at a time, tok/s is 64 tokens
  over the request's whole time, most of which is decode's 63 steps.

Standard library only; reads the tarballs into a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

LEVELS = ("c1", "c4", "c8", "c16", "c32")
PROXY_LINE = re.compile(r"/v1/completions: decode=(\S+) prefill_s=(\S+) first_byte_s=(\S+) done_s=(\S+)")
# (measure, goal, direction): a cell is met when OrbitKV ÷ MC is <= goal ("le") or >= goal ("ge")
GOALS = {"ttft_p50": (0.85, "le"), "ttft_p99": (0.85, "le"), "tok_s": (1.10, "ge"),
         "kv_pages": (0.8, "le"), "kv_whole": (0.8, "le")}
KV_LEVELS = ("c16", "c32")


def quantile(xs: list[float], p: float) -> float:
    """The nearest-rank quantile the driver uses (``driver.q``)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]


def proxy_levels(log: Path, counts: list[tuple[str, int]]) -> dict[str, list[tuple[float, float]]]:
    """(prefill answered, first byte) in ms per request, per level: the proxy's
    completed requests in the order they were logged, cut by the levels'
    request counts (warm-up first); a request without either time is dropped."""
    rows: list[tuple[float, float] | None] = []
    for line in log.read_text(errors="replace").splitlines():
        m = PROXY_LINE.search(line)
        if not m:
            continue
        p, f = m.group(2), m.group(3)
        rows.append(None if "-" in (p, f) else (float(p) * 1e3, float(f) * 1e3))
    out: dict[str, list[tuple[float, float]]] = {}
    i = 0
    for name, n in counts:
        out[name] = [r for r in rows[i : i + n] if r is not None]
        i += n
    return out


def load_sample(path: Path, tmp: Path) -> dict[str, Any]:
    dest = tmp / path.as_posix().replace("/", "_")
    dest.mkdir(parents=True)
    for t in ("results.tar.xz", "logs.tar.xz"):
        with tarfile.open(path / t) as tf:
            tf.extractall(dest, filter="data")
    stage = json.loads((dest / "results" / "b-default.json").read_text())
    counts = [(n, int(r.split(":")[2])) for r in
              [stage["config"]["warmup"]] + stage["config"]["runs"].split(",") for n in [r.split(":")[0]]]
    sample: dict[str, Any] = {"stage": stage, "proxy": {}}
    for system in stage["systems"]:
        log = dest / "logcut" / f"big-{system}-proxy.log"
        if log.exists():
            sample["proxy"][system] = proxy_levels(log, counts)
    return sample


def prefill_server(runs: dict[str, Any], level: str) -> dict[str, Any]:
    servers = runs[level]["servers"]
    return next(v for k, v in servers.items() if k.endswith("-prefill"))


def ratios(a: dict[str, Any], b: dict[str, Any], level: str) -> dict[str, float | None]:
    """System a ÷ system b at a level (their ``runs`` dicts)."""
    ra, rb = a[level], b[level]
    pa, pb = prefill_server(a, level), prefill_server(b, level)
    # over the whole cache: vLLM's usage counts only the blocks it kept (the
    # driver of a wheel before 496bf08 did not write the pages' share); a
    # system without taken blocks: its whole-cache peak is its peak
    def pages(p: dict[str, Any]) -> float:
        if "kv_usage_peak_pages" in p:
            return float(p["kv_usage_peak_pages"])
        taken, total = p.get("kv_taken", (0, 1))
        return float(p["kv_usage_peak"]) * (int(total) - int(taken)) / int(total)

    def whole(p: dict[str, Any]) -> float:
        return float(p.get("kv_usage_peak_whole", p["kv_usage_peak"]))

    return {"ttft_p50": ra["p50_ttft_ms"] / rb["p50_ttft_ms"], "ttft_p99": ra["p99_ttft_ms"] / rb["p99_ttft_ms"],
            "tok_s": ra["output_throughput"] / rb["output_throughput"],
            "kv_pages": pages(pa) / pages(pb) if pages(pb) > 0 else None,
            "kv_whole": whole(pa) / whole(pb) if whole(pb) > 0 else None}


def bounds(sample: dict[str, Any], level: str) -> dict[str, float | None]:
    mc, orbit = sample["proxy"].get("mc", {}).get(level), sample["proxy"].get("orbit", {}).get(level)
    out: dict[str, float | None] = {}
    if not mc or not orbit:
        return out
    for p, tag in ((0.5, "p50"), (0.99, "p99")):
        mc_pre, mc_first = quantile([r[0] for r in mc], p), quantile([r[1] for r in mc], p)
        out[f"mc_zero_handoff_{tag}"] = mc_pre / mc_first
        out[f"prefill_vs_mc_{tag}"] = quantile([r[0] for r in orbit], p) / mc_pre
    out["orbit_handoff_p50_ms"] = quantile([r[1] - r[0] for r in orbit], 0.5)
    out["mc_handoff_p50_ms"] = quantile([r[1] - r[0] for r in mc], 0.5)
    runs = sample["stage"]["systems"]
    o, m = runs["orbit"]["runs"][level], runs["mc"]["runs"][level]
    out["prefill_waiting_orbit"] = prefill_server(runs["orbit"]["runs"], level)["waiting_peak"]
    out["prefill_waiting_mc"] = prefill_server(runs["mc"]["runs"], level)["waiting_peak"]
    out["mc_ttft_share"] = m["mean_ttft_ms"] / m["mean_e2el_ms"]
    # a closed loop of N clients: requests/s = N / mean request time (Little's
    # law), so OrbitKV's mean TTFT is MC's request time / the throughput ratio
    # less its own decode time; the ratio it takes for a mean TTFT of 0.85 x MC's
    out["throughput"] = o["request_throughput"] / m["request_throughput"]
    decode_o = o["mean_e2el_ms"] - o["mean_ttft_ms"]
    out["throughput_for_085"] = m["mean_e2el_ms"] / (0.85 * m["mean_ttft_ms"] + decode_o)
    out["little"] = (o["mean_e2el_ms"] * o["request_throughput"]) / (m["mean_e2el_ms"] * m["request_throughput"])
    if level == "c1":
        gap = statistics.mean(r[1] - r[0] for r in orbit)
        # one at a time: tok/s ~ tokens / sum of the requests' times
        out["tok_s_zero_handoff"] = (o["output_throughput"] / m["output_throughput"]
                                     * o["mean_e2el_ms"] / (o["mean_e2el_ms"] - gap))
        out["decode_share_c1"] = (o["mean_e2el_ms"] - o["mean_ttft_ms"]) / o["mean_e2el_ms"]
    return out


def fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def met(key: str, x: float | None) -> str:
    if x is None:
        return "-"
    goal, how = GOALS[key]
    return "yes" if (x <= goal if how == "le" else x >= goal) else "**no**"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("samples", nargs="+", help="LABEL=DIR, DIR a driver result directory of a b-default stage")
    args = ap.parse_args(argv)
    names = [s.split("=", 1)[0] for s in args.samples]
    if len(set(names)) != len(names) or any("=" not in s for s in args.samples):
        ap.error("each sample is LABEL=DIR, every LABEL once")
    with tempfile.TemporaryDirectory() as t:
        samples = {s.split("=", 1)[0]: load_sample(Path(s.split("=", 1)[1]), Path(t)) for s in args.samples}
    for n, sample in samples.items():
        missing = {"orbit", "mc"} - set(sample["stage"]["systems"])
        if missing:
            ap.error(f"sample {n}: no {' and no '.join(sorted(missing))} system in its b-default stage")
    w = sys.stdout.write
    w("# Issue 48's load cells, the shipped defaults against vLLM's MooncakeConnector, sample by sample\n\n")
    w("Samples: " + ", ".join(f"`{s}`" for s in args.samples) + "\n\n")
    cells: dict[str, dict[str, list[float]]] = {lv: {k: [] for k in GOALS} for lv in LEVELS}
    aa: dict[str, dict[str, list[float]]] = {lv: {k: [] for k in GOALS} for lv in LEVELS}
    w("## OrbitKV ÷ MC per sample (A/A: a second identical OrbitKV pair ÷ the first, where the sample has one)\n\n")
    w("| level | sample | TTFT p50 | TTFT p99 | tok/s | KV peak, request pages | KV peak, with the taken blocks "
      "| A/A: TTFT p50 / p99 / tok/s |\n|---|---|---|---|---|---|---|---|\n")
    for lv in LEVELS:
        for n in names:
            systems = samples[n]["stage"]["systems"]
            r = ratios(systems["orbit"]["runs"], systems["mc"]["runs"], lv)
            for k, v in r.items():
                if v is not None:
                    cells[lv][k].append(v)
            a = "-"
            if "orbit-control" in systems:
                ra = ratios(systems["orbit-control"]["runs"], systems["orbit"]["runs"], lv)
                for k, v in ra.items():
                    if v is not None:
                        aa[lv][k].append(v)
                a = f"{fmt(ra['ttft_p50'])} / {fmt(ra['ttft_p99'])} / {fmt(ra['tok_s'])}"
            w(f"| {lv[1:]} | {n} | {fmt(r['ttft_p50'])} | {fmt(r['ttft_p99'])} | {fmt(r['tok_s'])} | "
              f"{fmt(r['kv_pages'])} | {fmt(r['kv_whole'])} | {a} |\n")
    w("\n## Across the samples: median (min – max), the goal, met by the median; the A/A spread (min – max)\n\n")
    w("| level | measure | OrbitKV ÷ MC | goal | met | A/A |\n|---|---|---|---|---|---|\n")
    for lv in LEVELS:
        for k, (goal, how) in GOALS.items():
            xs = cells[lv][k]
            if not xs or (k.startswith("kv") and lv not in KV_LEVELS):
                continue
            med = statistics.median(xs)
            spread = f"{min(aa[lv][k]):.2f} – {max(aa[lv][k]):.2f}" if aa[lv][k] else "-"
            w(f"| {lv[1:]} | {k} | {med:.2f} ({min(xs):.2f} – {max(xs):.2f}) | {'≤' if how == 'le' else '≥'} "
              f"{goal} | {met(k, med)} | {spread} |\n")
    w("\n## What bounds them, from the proxies' per-request lines\n\n")
    w("| level | sample | MC zero-handoff bound p50 / p99 | OrbitKV's prefill ÷ MC's p50 / p99 | hand-off p50 "
      "ms, OrbitKV / MC | prefill's queue at its peak, OrbitKV / MC | MC's TTFT ÷ its request time (means) "
      "| requests/s, OrbitKV ÷ MC / what a mean TTFT of 0.85 x MC's takes (Little's law holds: ratio of "
      "requests/s x mean time) | tok/s with a hand-off of 0 (1 in flight) | decode's share of a request "
      "(1 in flight) |\n|---|---|---|---|---|---|---|---|---|---|\n")
    for lv in LEVELS:
        for n in names:
            b = bounds(samples[n], lv)
            if not b:
                continue
            w(f"| {lv[1:]} | {n} | {fmt(b['mc_zero_handoff_p50'])} / {fmt(b['mc_zero_handoff_p99'])} | "
              f"{fmt(b['prefill_vs_mc_p50'])} / {fmt(b['prefill_vs_mc_p99'])} | {b['orbit_handoff_p50_ms']:.0f} / "
              f"{b['mc_handoff_p50_ms']:.0f} | {b['prefill_waiting_orbit']:.0f} / {b['prefill_waiting_mc']:.0f} | "
              f"{fmt(b['mc_ttft_share'])} | {fmt(b['throughput'])} / {fmt(b['throughput_for_085'])} "
              f"({fmt(b['little'])}) | {fmt(b.get('tok_s_zero_handoff'))} | "
              f"{fmt(b.get('decode_share_c1'))} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
