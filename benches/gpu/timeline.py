#!/usr/bin/env python3
"""Where a KV request's time goes, from a `qualify.py --trace` run: each
timed request's producer loop, GPU gathers, layer writes, completion notice
and the consumer's arrival, laid side by side on one clock.

    python3 benches/gpu/timeline.py RESULTS_JSON TRACES [--md OUT.md]

RESULTS_JSON: run.sh's results.json; TRACES: its traces.tar.xz (or the
folder it unpacks to). Every time is µs after the request's start: before the
producer's first gather (staged, from the CUDA events `--trace` records) or
its first `layer_ready` (direct, the first `LayerReady` span). The
processes' traces are put on one clock by the wall clock each recorded at
its start (one machine: one clock). Medians over a step's repetitions:

  loop      the producer's calls returned (every layer handed over)
  gathers   the last layer's gather ran on the GPU (staged)
  writes    the last layer write completed (Mooncake's batch status)
  notice    the producer's completion notice went out (its send, which
            Mooncake makes a synchronous message to the peer, took `send`)
  arrived   the consumer's actor had the notice (the router polls
            `take_notifications` every `notify_poll`, 1 ms)
  done      the consumer's `consumer_completed` event reached Python (staged
            through a grant: the scatter done)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tarfile
import tempfile
from collections import defaultdict
from typing import Any


def load_traces(where: str) -> dict[int, dict[str, Any]]:
    """Every process's trace, by pid (from the file name, `ROLE-PID.json`)."""
    if os.path.isfile(where):
        tmp = tempfile.mkdtemp(prefix="orbitkv-timeline-")
        with tarfile.open(where) as t:
            t.extractall(tmp, filter="data")
        where = tmp
    out = {}
    for f in glob.glob(os.path.join(where, "**", "*.json"), recursive=True):
        pid = int(os.path.basename(f).rsplit("-", 1)[1].split(".")[0])
        out[pid] = json.load(open(f))
    return out


def by_request(trace: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The trace's events by request, each with `t` (µs, unix) and, for a
    write's async slice, `end`."""
    base = trace["otherData"]["start_unix_us"]
    reqs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    open_writes: dict[str, dict[str, Any]] = {}
    for e in sorted(trace["traceEvents"], key=lambda e: e.get("ts", 0)):
        if "ts" not in e:
            continue
        t = base + e["ts"]
        if e.get("name") == "write" and e.get("ph") == "e":
            w = open_writes.pop(e["id"], None)
            if w is not None:
                w["end"] = t
            continue
        req = (e.get("args") or {}).get("request")
        if req is None:
            continue
        rec = {"name": e["name"], "t": t, "dur": e.get("dur", 0.0)}
        if e.get("name") == "write" and e.get("ph") == "b":
            open_writes[e["id"]] = rec
        reqs[req].append(rec)
    return reqs


def request_timeline(p: dict[str, Any], prod: list[dict[str, Any]],
                     cons: list[list[dict[str, Any]]]) -> dict[str, float | None]:
    gpu = p.get("gpu_trace")
    ready = [e["t"] for e in prod if e["name"] == "LayerReady"]
    if gpu:
        t0 = gpu["t0_unix_ns"] / 1e3
    elif ready:
        t0 = min(ready)
    else:
        return {}
    writes = [e for e in prod if e["name"] == "write" and "end" in e]
    sends = [e for e in prod if e["name"] == "send_notice"]
    arrived = [min(e["t"] for e in c if e["name"] == "NoticeArrived") for c in cons
               if any(e["name"] == "NoticeArrived" for e in c)]
    return {
        "loop": p["calls_s"] * 1e6,
        "gathers": gpu["gather_done_ms"][-1] * 1e3 if gpu else None,
        "writes": max(w["end"] for w in writes) - t0 if writes else None,
        "notice": max(s["t"] for s in sends) - t0 if sends else None,
        "send": statistics.median(s["dur"] for s in sends) if sends else None,
        "arrived": max(arrived) - t0 if arrived else None,
        "done": max(d - p["t0_ns"] for d in p["done_ns"]) / 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("traces")
    ap.add_argument("--md", help="also write the table here")
    a = ap.parse_args()
    results = json.load(open(a.results))
    traces = load_traces(a.traces)
    cols = ("loop", "gathers", "writes", "notice", "send", "arrived", "done")
    md = ["| configuration | step | reps | " + " | ".join(f"{c} µs" for c in cols) + " |",
          "|---|---|---|" + "---|" * len(cols)]
    for c in results["configs"]:
        reg = (c.get("steps") or {}).get("start_and_register") or {}
        if "producer" not in reg or reg["producer"]["pid"] not in traces:
            continue
        prod = by_request(traces[reg["producer"]["pid"]])
        cons = [by_request(traces[h["pid"]]) for k, h in sorted(reg.items())
                if k.startswith("consumer") and isinstance(h, dict) and h.get("pid") in traces]
        geo = c.get("geometry") or {}
        name = f"{c.get('transport')}, {'HND' if 'HND' in str(geo.get('layout')) else 'NHD'}, TP 1 → {geo.get('consumer_tp', 1)}"
        if (geo.get("consumer_tp") or 1) > 1:
            name += ", both ranks" if (geo.get("consumer_ranks") or 1) > 1 else ", rank 0 alone"
        for step, s in c["steps"].items():
            if not step.startswith("kv_") or not s.get("producer") or "req" not in s["producer"][0]:
                continue
            rows = [request_timeline(p, prod.get(p["req"], []), [x.get(p["req"], []) for x in cons])
                    for p in s["producer"]]
            rows = [r for r in rows if r]
            if not rows:
                continue
            med = {k: statistics.median(v) if (v := [r[k] for r in rows if r.get(k) is not None]) else None
                   for k in cols}
            md.append(f"| {name} | {step[3:]} | {len(rows)} | "
                      + " | ".join("—" if med[k] is None else f"{med[k]:.0f}" for k in cols) + " |")
    text = "\n".join(md) + "\n"
    print(text, end="")
    if a.md:
        open(a.md, "w").write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
