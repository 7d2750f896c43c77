"""Mooncake ranges per layer write through real vLLM (CPU), once vLLM's block
pools have cycled: page to page (``orbitkv.pd.staging_mb`` 0) against the
default (``auto``: prefill gathers each layer of each chunk in decode's
block order into a piece of the source region it holds until that layer's
write ended), and with ``--whole`` whole-prompt source stagings of the
same region size (the default before layer pieces), side by side in one run. Not a timed test and not a GPU figure: it counts
what the writer submits (the range count is what Mooncake's per-range
submit cost multiplies, docs/qualification.md runs 37-38), and checks
every P/D answer against the prefill engine's own.

    .venv/bin/python benches/ranges_cpu.py [--requests 64] [--in-flight 4] [--json out.json]

Two P/D clusters of two vLLM CPU servers (tiny random-weight model, 4 KiB
of KV a token; KV caches of 160 MiB on the prefill and 288 MiB on the
decode, 2560 and 4608 blocks of 16 tokens, in the ratio of the GPU runs
37-38, so the pools cycle at different rates after ~30 and ~55 prompts),
one after the other, the same fresh prompts
(300-1400 tokens, greedy, 8 tokens out; chunked prefill at 512 tokens a
step, so most prompts take 2-3 chunks) at ``--in-flight`` at once through
the proxy. The first ``--warmup`` requests (pools not yet cycled) are not
counted. Per cluster: the prefill's ``write_ranges`` and ``layers_written``
over the counted requests, ranges per layer write, and how many layers went
from staging into pages, and how many found no room (``source_staging_full``:
layers of a chunk under ``auto``, requests with a whole-prompt staging),
which are written page to page (16 MiB of sources here either way). And
the prefill's KV in use while the counted requests run (vLLM's
``kv_cache_usage_perc``, sampled every 20 ms: peak and mean), with the
requests whose pages went back to vLLM before their writes ended
(``producer_pages_given_back``: under ``auto``, every layer in a piece).
Through OrbitKV's proxy decode authorizes while the prefill runs, so the
writes mostly end with it; ``--via-router`` sends the requests through
vllm-router's two-stage flow instead (decode gets its half only after the
prefill answered), where the prefill's KV waits for decode.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("ORBITKV_TESTING_SHM_SPIN_S", "1")

from orbitkv.testing.cluster import Cluster, Metric, complete
from orbitkv.testing.tiny_model import make_tiny_model
from orbitkv.vllm.config import AUTO_STAGING_KV_SHARE
from orbitkv.vllm.stats import _PROM

COUNTERS = ("write_ranges", "layers_written", "layers_staged_to_pages", "chunks_reordered", "bytes_written",
            "source_staging_full", "producer_pages_given_back", "source_pieces_given_up")


class KvUse:
    """Samples the prefill's ``vllm:kv_cache_usage_perc`` every 20 ms on a
    thread until stopped: its peak and mean."""

    def __init__(self, c: Cluster) -> None:
        import threading

        self.samples: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(c,), daemon=True)
        self._t.start()

    def _run(self, c: Cluster) -> None:
        while not self._stop.wait(0.02):
            try:
                self.samples.append(c.metrics("prefill").get("vllm:kv_cache_usage_perc", 0.0))
            except Exception:  # noqa: BLE001 - a missed sample is not a result
                continue

    def stop(self) -> tuple[float, float]:
        self._stop.set()
        self._t.join()
        s = self.samples or [0.0]
        return max(s), sum(s) / len(s)


def counters(c: Cluster) -> dict[str, float]:
    m = c.metrics("prefill")
    return {k: m[f"{_PROM[k][0]}_total"] for k in COUNTERS}


def run(model: str, run_dir: Path, name: str, config: dict[str, Any], prompts: list[list[int]],
        a: argparse.Namespace, decode_config: dict[str, Any] | None = None) -> dict[str, Any]:
    in_flight, warmup, gen = a.in_flight, a.warmup, a.gen
    t0 = time.monotonic()
    with Cluster(model, run_dir / name, prefill_config=config,
                 decode_config=config if decode_config is None else decode_config,
                 vllm_args=["--max-num-batched-tokens", str(a.max_batched_tokens)],
                 prefill_args=["--kv-cache-memory-bytes", str(a.prefill_kv_mib << 20)],
                 decode_args=["--kv-cache-memory-bytes", str(a.decode_kv_mib << 20)],
                 vllm_router=a.via_router,
                 # a decode whose prefill gave its request up recomputes (counted)
                 kv_load_failure_policy="recompute") as c:
        print(f"# {name}: cluster up in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)

        def one(p: list[int]) -> list[int]:
            r = complete(c.router_url if a.via_router else c.proxy_url, p, gen, timeout_s=300)
            if r.failed(gen):
                raise RuntimeError(f"P/D: HTTP {r.status}: {r.error}")
            return r.token_ids

        with cf.ThreadPoolExecutor(in_flight) as ex:
            list(ex.map(one, prompts[:warmup]))
            c.wait_idle()
            before = counters(c)
            failed0 = c.metrics("decode")[Metric.FAILED]
            use = KvUse(c)
            got = list(ex.map(one, prompts[warmup:]))
            peak, mean = use.stop()
            c.wait_idle()
            after = counters(c)
            failed = c.metrics("decode")[Metric.FAILED] - failed0
        # every answer checked against the prefill engine alone (its own
        # prefix cache is salted per request by the fresh prompts)
        mismatches = 0
        for p, toks in zip(prompts[warmup:], got):
            r = complete(c.prefill_url, p, gen, timeout_s=300)
            mismatches += r.token_ids != toks
    d = {k: after[k] - before[k] for k in COUNTERS}
    return {
        "name": name,
        "config": config,
        "requests": len(prompts) - warmup,
        "mismatches": mismatches,
        **d,
        "ranges_per_layer_write": d["write_ranges"] / max(1.0, d["layers_written"]),
        "decode_loads_failed": failed,
        "prefill_kv_peak": peak,
        "prefill_kv_mean": mean,
        "kv_samples": len(use.samples),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--gen", type=int, default=8)
    # pools of different sizes cycle at different rates, as on the GPU runs
    # 37-38 (6.5 GiB prefill, 12 GiB decode); equal pools keep their runs
    # in step and understate what page to page costs
    # chunked prefill: prompts longer than this take several steps, whose
    # chunks share the block a step ended inside
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--prefill-kv-mib", type=int, default=160)
    p.add_argument("--decode-kv-mib", type=int, default=288)
    p.add_argument("--seed", type=int, default=20261204)
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--via-router", action="store_true",
                   help="through vllm-router (two-stage: decode gets its half after the prefill's answer) "
                        "instead of OrbitKV's proxy (both halves at once)")
    p.add_argument("--whole", action="store_true",
                   help="a third cluster: whole-prompt source stagings of the default's region size")
    p.add_argument("--pieces-whole", action="store_true",
                   help="a cluster more: the default with orbitkv.pd.staging_pieces 'request' (a request a layer of "
                        "which finds no room gives back its untaken pieces and takes no more)")
    p.add_argument("--no-page-to-page", action="store_true", help="leave out the page-to-page cluster")
    p.add_argument("--config", type=json.loads, default={},
                   help="orbitkv.pd.* settings (a JSON object) of the default cluster and --pieces-whole's, e.g. "
                        "'{\"orbitkv.pd.staging_kv_share\": 0.03}' for a short region")
    a = p.parse_args(argv)
    run_dir = (a.run_dir or Path(tempfile.mkdtemp(prefix="orbitkv-ranges-"))).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = make_tiny_model(run_dir / "tiny-model")
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(300, 1400))]
               for _ in range(a.warmup + a.requests)]
    # the default cluster's source region (its staging_kv_share of the prefill's KV)
    # as a whole-prompt staging each (a size set by hand: half of it for
    # sources under kv_both; decode 0, so no grant): the default before layer
    # pieces
    whole_mb = 2 * int(a.prefill_kv_mib * float(a.config.get("orbitkv.pd.staging_kv_share", AUTO_STAGING_KV_SHARE)))
    rows = [] if a.no_page_to_page else [
        run(model, run_dir, "page-to-page", {"orbitkv.pd.staging_mb": 0}, prompts, a)]
    rows.append(run(model, run_dir, "default", dict(a.config), prompts, a))
    if a.pieces_whole:
        rows.append(run(model, run_dir, "pieces-whole-requests", {**a.config, "orbitkv.pd.staging_pieces": "request"},
                        prompts, a))
    if a.whole:
        rows.append(run(model, run_dir, f"whole-prompt-{whole_mb // 2}MiB", {"orbitkv.pd.staging_mb": whole_mb},
                        prompts, a, decode_config={"orbitkv.pd.staging_mb": 0}))
    print("| writes | requests | P/D != prefill alone | layer writes | ranges | ranges per layer write "
          "| layers from staging into pages | chunks reordered | no room in the source region "
          "| pieces given up on a miss | pages back before the writes | prefill KV in use: peak / mean "
          "| decode loads failed (recomputed) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['requests']} | {r['mismatches']} | {r['layers_written']:.0f} | "
              f"{r['write_ranges']:.0f} | {r['ranges_per_layer_write']:.2f} | {r['layers_staged_to_pages']:.0f} | "
              f"{r['chunks_reordered']:.0f} | {r['source_staging_full']:.0f} | "
              f"{r['source_pieces_given_up']:.0f} | {r['producer_pages_given_back']:.0f} | {100 * r['prefill_kv_peak']:.1f} / "
              f"{100 * r['prefill_kv_mean']:.1f} % | {r['decode_loads_failed']:.0f} |")
    if not a.no_page_to_page:
        a0, b0 = rows[:2]
        print(f"\npage to page / default, ranges per layer write: "
              f"{a0['ranges_per_layer_write'] / max(1e-9, b0['ranges_per_layer_write']):.1f}")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows}, indent=1))
    return 0 if all(r["mismatches"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
