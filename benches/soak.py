"""Soak: P/D through OrbitKV for a long while under the load two cores
sustain, with random client cancellations and one restart of decode and one
of prefill on the way (issue 32). Not a test: it records, and the figures go
to docs/qualification.md.

    .venv/bin/python benches/soak.py [--minutes 30] [--in-flight 4] [--out DIR]

Starts a prefill and a decode vLLM server (CPU, the tiny random-weight model,
``PdConnector``) and ``orbitkv.proxy`` on 127.0.0.1 (``orbitkv.testing.cluster``).
``--in-flight`` clients send streamed greedy requests of 200-1500 fresh
random tokens (no prefix-cache hit) back to back; half of them (``--cancel``)
are dropped by their client 0-400 ms after sending, the rest are read to
the end. After a third of the time decode is SIGKILLed and started again,
after two thirds prefill. Every ``--quiet-every`` minutes the clients pause
and the script waits until both servers hold no request and no KV block,
and records how long that took. Every 20 s it samples each server's threads
and resident memory (its whole process tree: the API server and the engine
core). It records every request's end (answered, failed, cancelled) and
whether it ended within the request timeout, and every engine exit that was
not one of the two restarts. Results: ``soak.json`` and ``summary.md`` in
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from orbitkv.testing.cluster import Abandoned, Cluster, complete
from orbitkv.testing.tiny_model import make_tiny_model

GEN = 32
REQ_TIMEOUT_S = 60.0


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _threads_rss(pid: int) -> tuple[int, int]:
    """Threads and resident KiB of `pid`'s process tree."""
    threads = rss = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("Threads:"):
                        threads += int(line.split()[1])
                    elif line.startswith("VmRSS:"):
                        rss += int(line.split()[1])
        except OSError:
            continue
    return threads, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--cancel", type=float, default=0.5, help="fraction of requests their client drops")
    ap.add_argument("--quiet-every", type=float, default=5.0, help="minutes between quiet periods")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=32)
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="orbitkv-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(out / "model")
    # The production deadlines scaled down so that a restart's stranded
    # requests end within the run: 20 s + 10 s quarantine.
    cfg = {"orbitkv.pd.handshake_timeout_s": 20.0, "orbitkv.pd.quarantine_s": 10.0}
    cluster = Cluster(model, out / "cluster", timeout_s=20.0, prefill_config=cfg, decode_config=dict(cfg))
    lock = threading.Lock()
    ends: list[dict[str, object]] = []
    samples: list[dict[str, object]] = []
    quiets: list[dict[str, object]] = []
    restarts: list[dict[str, object]] = []
    paused = threading.Event()
    stop = threading.Event()

    def client(k: int) -> None:
        r = random.Random(a.seed * 1000 + k)
        while not stop.is_set():
            if paused.is_set():
                time.sleep(0.05)
                continue
            # the tiny model's vocabulary: 1024 ids (orbitkv.testing.tiny_model)
            prompt = [r.randrange(3, 1024) for _ in range(r.randint(200, 1500))]
            t0 = time.monotonic()
            if r.random() < a.cancel:
                try:
                    req = Abandoned(cluster.proxy_url, prompt, GEN, stream=True)
                    time.sleep(r.uniform(0.0, 0.4))
                    req.drop()
                    kind, status = "cancelled", 0
                except OSError as e:
                    kind, status = "failed", -1
                    print(f"client {k}: {e}", file=sys.stderr)
            else:
                c = complete(cluster.proxy_url, prompt, GEN, stream=True, timeout_s=REQ_TIMEOUT_S)
                ok = c.status == 200 and len(c.token_ids) == GEN
                kind, status = ("answered" if ok else "failed"), c.status
            took = time.monotonic() - t0
            with lock:
                ends.append({"t": t0 - start, "kind": kind, "status": status, "s": round(took, 3),
                             "within_timeout": took <= REQ_TIMEOUT_S + 1.0})

    def sample() -> None:
        while not stop.wait(20.0):
            row: dict[str, object] = {"t": round(time.monotonic() - start, 1)}
            for name in ("prefill", "decode"):
                p = cluster.procs.get(name)
                if p is not None and p.alive():
                    row[name] = _threads_rss(p.pid)
            with lock:
                samples.append(row)

    def quiet(label: str) -> None:
        paused.set()
        time.sleep(1.0)  # let the requests in flight end
        t0 = time.monotonic()
        try:
            cluster.wait_idle(timeout_s=120.0)
            idle = round(time.monotonic() - t0, 2)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            idle = f"not idle: {e}"
        quiets.append({"t": round(t0 - start, 1), "at": label, "idle_after_s": idle})
        print(f"[{t0 - start:7.1f}s] quiet ({label}): idle after {idle}", flush=True)
        paused.clear()

    cluster.start()
    start = time.monotonic()
    end = start + a.minutes * 60
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(a.in_flight)]
    threads.append(threading.Thread(target=sample, daemon=True))
    for t in threads:
        t.start()
    plan = sorted(
        [(start + a.minutes * 60 / 3, "restart decode"), (start + a.minutes * 60 * 2 / 3, "restart prefill")]
        + [(start + m * 60, "quiet") for m in _frange(a.quiet_every, a.minutes, a.quiet_every)]
    )
    exits = 0
    try:
        for at, what in plan:
            while time.monotonic() < at:
                for name in ("prefill", "decode", "proxy"):
                    p = cluster.procs.get(name)
                    if p is not None and not p.alive():
                        exits += 1
                        print(f"{name} exited unexpectedly", file=sys.stderr)
                        if name != "proxy":
                            cluster.start_server(name)
                time.sleep(1.0)
            if what == "quiet":
                quiet(f"{(at - start) / 60:.0f} min")
            else:
                name = what.split()[1]
                t0 = time.monotonic()
                cluster.kill(name)
                cluster.start_server(name)
                cluster.wait_proxy_sees_healthy(timeout_s=120)
                restarts.append({"t": round(t0 - start, 1), "what": what, "back_after_s": round(time.monotonic() - t0, 1)})
                print(f"[{t0 - start:7.1f}s] {what}: back after {time.monotonic() - t0:.1f}s", flush=True)
        while time.monotonic() < end:
            time.sleep(1.0)
        quiet("end")
    finally:
        stop.set()
        for t in threads:
            t.join(REQ_TIMEOUT_S + 5)
        alive = {n: cluster.procs[n].alive() for n in ("prefill", "decode", "proxy") if n in cluster.procs}
        cluster.stop()
    kinds = {k: sum(1 for e in ends if e["kind"] == k) for k in ("answered", "failed", "cancelled")}
    late = sum(1 for e in ends if not e["within_timeout"])
    result = {
        "minutes": a.minutes, "in_flight": a.in_flight, "cancel_fraction": a.cancel, "requests": len(ends),
        "ends": kinds, "ended_past_timeout": late, "unexpected_exits": exits, "alive_at_end": alive,
        "restarts": restarts, "quiet_periods": quiets, "samples": samples, "requests_detail": ends,
    }
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Soak: {a.minutes:g} min, {a.in_flight} in flight, {a.cancel:.0%} cancelled by the client", "",
        f"- requests: {len(ends)} ({kinds['answered']} answered, {kinds['failed']} failed, "
        f"{kinds['cancelled']} cancelled); ended past their timeout: {late}",
        f"- unexpected engine exits: {exits}; alive at the end (before the script stopped them): {alive}",
        f"- restarts: {restarts}",
        "", "| quiet period at | both idle after (s) |", "|---|---|",
        *[f"| {q['at']} | {q['idle_after_s']} |" for q in quiets],
        "", "| t (s) | prefill threads | prefill RSS (MiB) | decode threads | decode RSS (MiB) |", "|---|---|---|---|---|",
    ]
    for s in samples:
        p, d = s.get("prefill", (0, 0)), s.get("decode", (0, 0))
        lines.append(f"| {s['t']} | {p[0]} | {p[1] // 1024} | {d[0]} | {d[1] // 1024} |")
    answered_s = sorted(float(e["s"]) for e in ends if e["kind"] == "answered")
    if answered_s:
        lines.append(
            f"\nanswered requests took median {statistics.median(answered_s):.2f}s, "
            f"p99 {answered_s[int(0.99 * (len(answered_s) - 1))]:.2f}s, max {answered_s[-1]:.2f}s"
        )
    failed_s = [e["s"] for e in ends if e["kind"] == "failed"]
    if failed_s:
        lines.append(f"\nfailed requests ended after median {statistics.median(failed_s):.2f}s, max {max(failed_s):.2f}s")
    if kinds["answered"] == 0:
        lines.append("\n**No request was answered: this run measured nothing (see the proxy's log).**")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results in {out}")


def _frange(a: float, b: float, step: float) -> list[float]:
    xs, x = [], a
    while x < b - 1e-9:
        xs.append(x)
        x += step
    return xs


if __name__ == "__main__":
    main()
