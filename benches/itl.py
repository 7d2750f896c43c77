"""Decode's inter-token latency on CPU: where a P/D decode's extra time per
token comes from, measured side by side in one run (a markdown table on
stdout, the raw per-request figures as JSON with ``--json``).

    .venv/bin/python benches/itl.py [--prompt 128] [--gen 64] [--reps 15] [--json out.json]

Three clusters of two vLLM CPU servers (tiny random-weight model, one core
each: "a" on core 0, "b" on core 1, as ``orbitkv.testing.cluster`` pins
them), one after the other:

1. without a connector: plain requests to "a" and to "b" (what the cores
   and the placement cost, no OrbitKV anywhere);
2. with a connector that does nothing (``benches/null_connector.py``) on
   both: plain requests to "a" and "b" (vLLM's connector machinery alone);
3. with the ``PdConnector`` on both ("a" = prefill, "b" = decode) and
   ``orbitkv.proxy``: plain requests to "a" and to "b" (the connector loaded,
   no transfer: its per-step hooks), and P/D requests through the proxy
   (the decode "b" computes every token after the first on KV that came
   over Mooncake).

The servers keep vLLM's own busy-wait after each step-ring read
(``ORBITKV_TESTING_SHM_SPIN_S=1``; the test cluster sets 0 to keep two cores
from starving, and a CPU worker then waits up to the cluster's 100 ms
re-check per step, which would be every token's latency).

Every request has a fresh random prompt (no prefix-cache hit), greedy,
``ignore_eos``, streamed; ITL = (last token's arrival - first token's) /
(tokens - 1), as the client sees it. Each request is checked to have
produced its ``--gen`` tokens. Not a timed test: nothing here asserts a
speed.
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

# vLLM's own busy-wait after each step-ring read (1 s), not the test
# cluster's 0: without it a CPU worker can miss its step wake-up and wait for
# the cluster's 100 ms re-check (vLLM 0.26.0), which would be every token's
# latency here. Set before the cluster module reads it.
os.environ.setdefault("ORBITKV_TESTING_SHM_SPIN_S", "1")

from orbitkv.testing.cluster import Cluster, InstanceSpec, complete
from orbitkv.testing.tiny_model import make_tiny_model

BENCHES = Path(__file__).resolve().parent


class NullCluster(Cluster):
    """Both servers with ``benches/null_connector.py``'s connector (no proxy)."""

    def start(self) -> Cluster:
        self.connector = True
        for name in self.servers:
            self.start_server(name, wait=False)
        self.wait_healthy(self.servers)
        return self

    def kv_transfer_config(self, spec: InstanceSpec) -> dict[str, object]:
        return {"kv_connector": "NullConnector", "kv_connector_module_path": "null_connector", "kv_role": "kv_both"}

    def server_env(self, spec: InstanceSpec) -> dict[str, str]:
        env = super().server_env(spec)
        env["PYTHONPATH"] = os.pathsep.join((str(BENCHES), env["PYTHONPATH"]))
        return env


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--gen", type=int, default=64, help="tokens generated per request")
    p.add_argument("--reps", type=int, default=15, help="requests per path")
    p.add_argument("--warmup", type=int, default=3, help="discarded requests per path first")
    p.add_argument("--run-dir", type=Path, help="logs (default: a new temporary directory)")
    p.add_argument("--json", type=Path, help="write the per-request figures here")
    p.add_argument("--seed", type=int, default=11)
    args = p.parse_args(argv)
    run_dir = (args.run_dir or Path(tempfile.mkdtemp(prefix="orbitkv-itl-"))).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = make_tiny_model(run_dir / "tiny-model")
    rng = random.Random(args.seed)

    def prompt() -> list[int]:
        return [rng.randrange(3, 1024) for _ in range(args.prompt)]

    def itl(url: str) -> float:
        r = complete(url, prompt(), args.gen, stream=True, timeout_s=300)
        if r.failed(args.gen) or len(r.token_times) < 2:
            raise RuntimeError(f"{url}: HTTP {r.status}, {len(r.token_ids)} tokens: {r.error}")
        return (r.token_times[-1] - r.token_times[0]) / (len(r.token_ids) - 1)

    def measure(paths: dict[str, str]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {k: [] for k in paths}
        for _ in range(args.warmup):
            for url in paths.values():
                itl(url)
        for rep in range(args.reps):
            names = list(paths) if rep % 2 == 0 else list(reversed(paths))
            for k in names:
                out[k].append(itl(paths[k]))
        return out

    results: dict[str, list[float]] = {}
    t0 = time.monotonic()
    with Cluster(model, run_dir / "plain", connector=False) as c:
        print(f"# plain cluster up in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
        got = measure({"no connector, core 0": c.prefill_url, "no connector, core 1": c.decode_url})
        results.update(got)
    t0 = time.monotonic()
    with NullCluster(model, run_dir / "null", connector=False) as c:
        print(f"# null-connector cluster up in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
        got = measure({"NullConnector, core 0": c.prefill_url, "NullConnector, core 1": c.decode_url})
        results.update(got)
    t0 = time.monotonic()
    with Cluster(model, run_dir / "pd") as c:
        print(f"# P/D cluster up in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
        got = measure(
            {
                "PdConnector loaded, plain, core 0 (prefill)": c.prefill_url,
                "PdConnector loaded, plain, core 1 (decode)": c.decode_url,
                "P/D through the proxy (decode on core 1)": c.proxy_url,
            }
        )
        results.update(got)

    import vllm

    import orbitkv

    ms = 1000.0
    print(
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.node()} "
        f"({os.cpu_count()} CPUs, {platform.machine()}, Linux {platform.release()}), "
        f"vLLM {vllm.__version__}, orbitkv {orbitkv.__version__}; {args.prompt}-token prompts, "
        f"{args.gen} tokens generated, {args.reps} requests per path after {args.warmup} warm-up rounds."
    )
    print()
    base = statistics.median(results["no connector, core 1"])
    print("| path | ITL median [p10 .. p90] | ÷ no connector, core 1 |")
    print("| --- | --- | --- |")
    for k, xs in results.items():
        m = statistics.median(xs)
        print(f"| {k} | {m * ms:.2f} ms [{_q(xs, 0.1) * ms:.2f} .. {_q(xs, 0.9) * ms:.2f}] | {m / base:.3f} |")
    if args.json:
        meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"args": meta, "run_dir": str(run_dir), "itl_s": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
