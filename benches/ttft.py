"""Time to first token: one engine against P/D through OrbitKV, same prompts,
one run, medians side by side (a markdown table on stdout).

    .venv/bin/python benches/ttft.py [--lengths 128,512,2048] [--reps 9]

Starts a prefill and a decode vLLM server (CPU, tiny random-weight model,
``PdConnector``) and ``orbitkv.proxy`` on 127.0.0.1 (``orbitkv.testing.cluster``).
For each repetition and prompt length it sends one streamed greedy request
to one engine (the prefill server, plainly: no ``kv_transfer_params``) and
one through the proxy (P/D), each with a prompt of its own (random token
ids, so no prefix-cache hit anywhere), alternating which goes first. TTFT =
from sending the request to the first streamed token, measured by the
client. Also reported per P/D request: decode's time from authorizing its
blocks to the KV being complete (``vllm:orbitkv_transfer_seconds``), which
overlaps the prefill's compute, and (with the Chrome traces the workers write,
``ORBITKV_TRACE``; ``--no-trace`` turns them off) a timeline: when the
prefill opened the request, when its last layer was handed to the runtime,
when decode had the complete KV, all from the client's send. Not a timed test:
nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from orbitkv.testing.cluster import Cluster, complete
from orbitkv.testing.tiny_model import make_tiny_model


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="128,512,2048", help="prompt lengths in tokens")
    p.add_argument("--reps", type=int, default=9, help="requests per length and path")
    p.add_argument("--warmup", type=int, default=3, help="discarded requests per path first")
    p.add_argument("--gen", type=int, default=4, help="tokens generated per request")
    p.add_argument("--run-dir", type=Path, help="logs (default: a new temporary directory)")
    p.add_argument("--model-dir", type=Path, help="where the tiny model is made (default: in the run dir)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--no-trace", action="store_true", help="no Chrome traces, no timeline")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    run_dir = (args.run_dir or Path(tempfile.mkdtemp(prefix="orbitkv-ttft-"))).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = make_tiny_model(args.model_dir or run_dir / "tiny-model")
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 1024) for _ in range(n)]

    t_start = time.monotonic()
    sent: dict[str, tuple[int, float, float]] = {}  # P/D id -> (length, wall-clock send, ttft)
    with Cluster(model, run_dir, trace=not args.no_trace) as c:
        print(f"# cluster up in {time.monotonic() - t_start:.0f}s; logs in {run_dir}", file=sys.stderr, flush=True)

        def ttft(url: str, n: int) -> float:
            r = complete(url, prompt(n), args.gen, stream=True, timeout_s=300)
            if r.status != 200 or r.ttft_s is None:
                raise RuntimeError(f"{url}: HTTP {r.status}: {r.error}")
            return r.ttft_s

        def pd_ttft(n: int, record: bool = True) -> tuple[float, float]:
            before = c.metrics("decode")
            wall = time.time()
            r = complete(c.proxy_url, prompt(n), args.gen, stream=True, timeout_s=300)
            if r.status != 200 or r.ttft_s is None:
                raise RuntimeError(f"proxy: HTTP {r.status}: {r.error}")
            t = r.ttft_s
            if record and r.request_id:
                sent[r.request_id] = (n, wall, t)
            # Decode's counters are published with the step's stats: wait for them.
            deadline = time.monotonic() + 10
            while True:
                after = c.metrics("decode")
                if after["vllm:orbitkv_transfers_completed_total"] > before["vllm:orbitkv_transfers_completed_total"]:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("decode did not count the transfer")
                time.sleep(0.05)
            xfer = after["vllm:orbitkv_transfer_seconds_total"] - before["vllm:orbitkv_transfer_seconds_total"]
            return t, xfer

        for _ in range(args.warmup):
            for n in lengths:
                ttft(c.prefill_url, n)
                pd_ttft(n, record=False)
        one: dict[int, list[float]] = {n: [] for n in lengths}
        pd: dict[int, list[float]] = {n: [] for n in lengths}
        xfer: dict[int, list[float]] = {n: [] for n in lengths}
        for rep in range(args.reps):
            for n in lengths:
                if rep % 2 == 0:
                    one[n].append(ttft(c.prefill_url, n))
                    t, x = pd_ttft(n)
                else:
                    t, x = pd_ttft(n)
                    one[n].append(ttft(c.prefill_url, n))
                pd[n].append(t)
                xfer[n].append(x)
            print(f"# rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
        if not args.no_trace and not c.wait_for_traces(list(sent), timeout_s=30):
            print("# the traces do not name every request", file=sys.stderr, flush=True)

    import vllm

    import orbitkv

    ms = 1000.0
    print(
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.node()} "
        f"({os.cpu_count()} CPUs, {platform.machine()}, Linux {platform.release()}), "
        f"vLLM {vllm.__version__}, orbitkv {orbitkv.__version__}, Python {platform.python_version()}; "
        f"{args.reps} requests per cell after {args.warmup} warm-up rounds, {args.gen} tokens generated."
    )
    print()
    print(
        "| prompt tokens | one engine TTFT, median [p10 .. p90] | P/D TTFT, median [p10 .. p90] "
        "| P/D / one engine | P/D - one engine | decode: authorization to KV complete, median |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for n in lengths:
        a, b = statistics.median(one[n]), statistics.median(pd[n])
        print(
            f"| {n} | {a * ms:.1f} ms [{_q(one[n], 0.1) * ms:.1f} .. {_q(one[n], 0.9) * ms:.1f}] "
            f"| {b * ms:.1f} ms [{_q(pd[n], 0.1) * ms:.1f} .. {_q(pd[n], 0.9) * ms:.1f}] "
            f"| {b / a:.3f} | {(b - a) * ms:+.1f} ms | {statistics.median(xfer[n]) * ms:.1f} ms |"
        )
    if not args.no_trace:
        timeline(c, lengths, sent)
    return 0


def _lanes(path: Path) -> dict[str, dict[str, float]]:
    """Per request id: the wall-clock µs of the marks the timeline uses."""
    d = json.loads(path.read_text())
    start = d["otherData"]["start_unix_us"]
    out: dict[str, dict[str, float]] = {}
    for e in d["traceEvents"]:
        a = e.get("args") or {}
        rid = a.get("request")
        if not rid or "ts" not in e:
            continue
        marks = out.setdefault(rid, {})
        ts = start + e["ts"]
        name = e.get("name")
        if name == "request" and e.get("ph") == "X":
            marks["open"] = ts
        elif name == "LayerReady":
            marks["last_layer"] = max(marks.get("last_layer", 0), ts)
        elif name == "NoticeArrived":
            marks["complete"] = max(marks.get("complete", 0), ts)
    return out


def timeline(c: Cluster, lengths: list[int], sent: dict[str, tuple[int, float, float]]) -> None:
    try:
        prod = _lanes(c.trace_path("prefill"))
        cons = _lanes(c.trace_path("decode"))
    except (OSError, ValueError, KeyError) as e:
        print(f"\n(no timeline: traces unreadable: {e})")
        return
    print()
    print(
        "P/D timeline, medians in ms from the client's send: decode authorized its blocks (and sent the "
        "handshake), prefill opened the request (its first step began), prefill's last layer handed to the "
        "runtime, decode had the complete KV, first token at the client."
    )
    print()
    print("| prompt tokens | decode authorized | prefill opened | last layer ready | KV complete on decode | first token | first token - KV complete |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in lengths:
        rows = []
        for rid, (m, wall, t) in sent.items():
            p, d = prod.get(rid, {}), cons.get(rid, {})
            if m != n or not all(k in p for k in ("open", "last_layer")) or not all(k in d for k in ("open", "complete")):
                continue
            w = wall * 1e6
            rows.append(
                [(d["open"] - w) / 1e3, (p["open"] - w) / 1e3, (p["last_layer"] - w) / 1e3, (d["complete"] - w) / 1e3, t * 1e3]
            )
        if not rows:
            print(f"| {n} | (no traced request) | | | | | |")
            continue
        med = [statistics.median(col) for col in zip(*rows)]
        print(f"| {n} | " + " | ".join(f"{x:.1f}" for x in med) + f" | {med[4] - med[3]:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
