"""OrbitKV's main job on one machine: real P/D with vLLM on loopback.

    python -m orbitkv.demo [--run-dir DIR] [--model-dir DIR]

Makes the tiny random-weight model locally (no hub), starts a prefill and a
decode vLLM server (CPU) with OrbitKV's ``PdConnector`` and ``orbitkv.proxy``
in front of them, sends a few greedy completions through the proxy after one
warm-up request (short and long prompts; streamed, so the time to the first
token is measured, and one not streamed), and prints for each: the completion, its time to first
token, whether the tokens equal those of one engine (the same prompt sent
plainly to the prefill server), and where its trace is. Each server's
OrbitKV worker writes a Chrome trace (``ORBITKV_TRACE``, see
``docs/tracing.md``): open it in https://ui.perfetto.dev and find the
request's lanes by its P/D id. Everything is stopped at the end; the logs and
traces stay in the run directory.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from orbitkv.testing.cluster import Cluster, ClusterError, Completion, complete

GEN = 24


def _prompts() -> list[tuple[str, str | list[int], bool]]:
    """(label, prompt, stream)."""
    long_text = " ".join(
        f"Layer {i} of the prefill writes its KV cache blocks straight into the decode pages." for i in range(120)
    )
    return [
        ("short, streamed", "The quick brown fox", True),
        ("exactly one block (128 token ids), streamed", list(range(3, 131)), True),
        ("long (~1.7k tokens), streamed", long_text, True),
        ("medium, not streamed", " ".join(["Prefill and decode on two instances."] * 30), False),
    ]


def _trace_ids(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _line(text: str, width: int = 100) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 3] + "..."


def run(run_dir: Path, model_dir: Path) -> int:
    from orbitkv.testing.tiny_model import make_tiny_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    print(f"orbitkv demo: run directory {run_dir}", flush=True)
    print(f"orbitkv demo: making the tiny model in {model_dir} (local, random weights)", flush=True)
    model = make_tiny_model(model_dir)
    cluster = Cluster(model, run_dir, trace=True)
    print(
        "orbitkv demo: starting prefill, decode (vLLM CPU, PdConnector) and the proxy on 127.0.0.1 "
        "(about a minute)...",
        flush=True,
    )
    with cluster:
        print(
            f"  prefill {cluster.prefill_url} (OrbitKV side channel {cluster.prefill_kv}), "
            f"decode {cluster.decode_url}, proxy {cluster.proxy_url}; up after {time.monotonic() - t0:.0f}s\n",
            flush=True,
        )
        # The first request of a vLLM server and of a P/D pair pays one-time
        # costs (allocator, first Mooncake connection): one of each, unreported.
        for url in (cluster.prefill_url, cluster.decode_url, cluster.proxy_url):
            complete(url, "warm-up", 2, timeout_s=300)
        results: list[tuple[str, Completion, bool, bool]] = []
        for label, prompt, stream in _prompts():
            r = complete(cluster.proxy_url, prompt, GEN, stream=stream, timeout_s=300)
            if r.status != 200:
                print(f"  [{label}] FAILED: HTTP {r.status}: {r.error}", flush=True)
                results.append((label, r, stream, False))
                continue
            one = complete(cluster.prefill_url, prompt, GEN, timeout_s=300)
            same = one.status == 200 and one.token_ids == r.token_ids
            results.append((label, r, stream, same))
            ttft = f"time to first token {r.ttft_s * 1000:.0f} ms" if r.ttft_s is not None else "not streamed"
            print(f"  [{label}] P/D request {r.request_id}", flush=True)
            print(f"    completion : {_line(r.text)!s}", flush=True)
            print(
                f"    {ttft}, total {r.total_s * 1000:.0f} ms; same {len(r.token_ids)} tokens as one engine: "
                f"{'yes' if same else 'NO'}",
                flush=True,
            )
        m = cluster.metrics("decode")
        done = m.get("vllm:orbitkv_transfers_completed_total", 0)
        secs = m.get("vllm:orbitkv_transfer_seconds_total", 0)
        sent = cluster.metrics("prefill").get("vllm:orbitkv_bytes_written_total", 0)
        print(
            f"\n  OrbitKV: {int(done)} KV transfers completed on decode, {sent / 2**20:.1f} MiB written by prefill, "
            f"mean {secs / done * 1000 if done else 0:.0f} ms from decode's authorization to complete KV "
            "(overlaps the prefill's compute)",
            flush=True,
        )
        ids = [r.request_id for _, r, _, _ in results if r.request_id]
        traces = [cluster.trace_path("prefill"), cluster.trace_path("decode")]
        if not cluster.wait_for_traces(ids):
            print("  (the traces do not name every request yet)", flush=True)
        print("orbitkv demo: stopping everything", flush=True)
    print("\nWhere each request's trace is (Chrome trace format; open in https://ui.perfetto.dev):")
    for t in traces:
        state = f"{t.stat().st_size} bytes" if t.exists() else "NOT WRITTEN"
        print(f"  {t}  ({state})")
    for label, r, _, _ in results:
        if not r.request_id:
            continue
        found = [t.name for t in traces if r.request_id in _trace_ids(t)]
        where = ", ".join(found) if found else "in no trace file"
        print(f"  [{label}] id {r.request_id}: lanes 'producer {r.request_id} …' / 'consumer {r.request_id} …' in {where}")
    print("Logs:", ", ".join(str(cluster.log(n)) for n in ("prefill", "decode", "proxy")))
    ok = all(r.status == 200 and same for _, r, _, same in results)
    print(f"orbitkv demo: {'OK' if ok else 'FAILED'} in {time.monotonic() - t0:.0f}s")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orbitkv.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, help="logs and traces (default: a new temporary directory)")
    p.add_argument(
        "--model-dir",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "orbitkv" / "tiny-model",
        help="where the tiny model is made (reused when already there)",
    )
    args = p.parse_args(argv)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="orbitkv-demo-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    # SIGTERM/SIGHUP stop the cluster like Ctrl-C does (the `with` block cleans up).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(130))
    try:
        return run(run_dir.resolve(), args.model_dir)
    except ClusterError as e:
        print(f"orbitkv demo: FAILED: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
