"""Runs vLLM's own serving benchmark (``vllm bench serve``, i.e.
``vllm.benchmarks.serve``) several times in one process against one endpoint,
so that vLLM is imported once, and records when each run started and ended.

    python bench_client.py --base-url http://127.0.0.1:8000 --model NAME --tokenizer DIR \
        --out DIR --label orbitkv --runs warmup:4:8:1000,c1:1:12:11,c4:4:32:12 \
        [--input-len 4609 --input-range 0.7777 --output-len 64]

Each run ``TAG:CONCURRENCY:PROMPTS:SEED[:RATE]`` is exactly
``vllm bench serve --backend vllm --endpoint /v1/completions --dataset-name random
--random-input-len L --random-range-ratio '{"input": R, "output": 0}'
--random-output-len O --ignore-eos --request-rate RATE --max-concurrency C
--num-prompts N --seed S --num-warmups 0 --ready-check-timeout-sec 0
--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99
--save-result`` (the ready check is off because it sends the first prompt once
before the run, which makes that prompt a prefix-cache hit). Writes
``OUT/LABEL-TAG.json`` (vLLM's result file) and ``OUT/LABEL-runs.json`` (tag,
start and end wall-clock times, the exit status of each run).

RATE left out is ``inf``: a closed loop of CONCURRENCY clients, each sending
its next request when its last one ended (requests/s x mean request time =
CONCURRENCY, so where the prefill is saturated a shorter hand-off only moves
time into its queue). A RATE in requests per second is an open loop: Poisson
arrivals at that rate (vLLM's ``--burstiness`` 1), CONCURRENCY only a cap, so
TTFT shows what each request waits for at a load the connector does not set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from typing import NamedTuple


class Run(NamedTuple):
    """One ``TAG:CONCURRENCY:PROMPTS:SEED[:RATE]``; ``rate`` None: ``inf``."""

    tag: str
    concurrency: int
    prompts: int
    seed: int
    rate: float | None

    @property
    def rate_arg(self) -> str:
        return "inf" if self.rate is None else f"{self.rate:g}"


def parse_run(spec: str) -> Run:
    """A run of ``--runs``; ValueError naming the spec when it is not one."""
    parts = spec.split(":")
    if len(parts) not in (4, 5) or not parts[0]:
        raise ValueError(f"{spec!r}: a run is TAG:CONCURRENCY:PROMPTS:SEED[:RATE]")
    try:
        conc, n, seed = (int(x) for x in parts[1:4])
        rate = None if len(parts) == 4 or parts[4] == "inf" else float(parts[4])
    except ValueError:
        raise ValueError(f"{spec!r}: CONCURRENCY, PROMPTS and SEED are integers, RATE requests/s or inf") from None
    if conc < 1 or n < 1 or seed < 0 or (rate is not None and not (math.isfinite(rate) and rate > 0)):
        raise ValueError(f"{spec!r}: CONCURRENCY and PROMPTS at least 1, SEED not negative, RATE above 0")
    return Run(parts[0], conc, n, seed, rate)


def parse_runs(text: str) -> list[Run]:
    """A comma-separated list of runs (empty items left out); tags unique."""
    runs = [parse_run(s) for s in text.split(",") if s]
    tags = [r.tag for r in runs]
    if len(set(tags)) != len(tags):
        raise ValueError(f"{text!r}: a TAG given twice")
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--label", required=True)
    p.add_argument("--runs", required=True)
    p.add_argument("--input-len", type=int, default=4609)
    p.add_argument("--input-range", type=float, default=0.7777)
    p.add_argument("--output-len", type=int, default=64)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layouts
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]

    log = []
    for run in parse_runs(a.runs):
        tag, conc, n, seed = run.tag, str(run.concurrency), str(run.prompts), str(run.seed)
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        argv_run = [
            "--backend", "vllm",
            "--base-url", a.base_url,
            "--endpoint", "/v1/completions",
            "--model", a.model,
            "--tokenizer", a.tokenizer,
            "--dataset-name", "random",
            "--random-input-len", str(a.input_len),
            "--random-range-ratio", json.dumps({"input": a.input_range, "output": 0.0}),
            "--random-output-len", str(a.output_len),
            "--ignore-eos",
            "--request-rate", run.rate_arg,
            "--max-concurrency", conc,
            "--num-prompts", n,
            "--seed", seed,
            "--num-warmups", "0",
            "--ready-check-timeout-sec", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99",
            "--save-result",
            "--save-detailed",
            "--result-dir", a.out,
            "--result-filename", f"{a.label}-{tag}.json",
            "--disable-tqdm",
        ]
        args = parser.parse_args(argv_run)
        entry = {"tag": tag, "concurrency": run.concurrency, "num_prompts": run.prompts, "seed": run.seed,
                 "request_rate": run.rate_arg, "argv": argv_run, "start": time.time()}
        print(f"[bench_client] {a.label} {tag}: {' '.join(argv_run)}", flush=True)
        try:
            res = bench_main(args)
            entry["status"] = "ok"
            entry["summary"] = {k: v for k, v in (res or {}).items() if isinstance(v, (int, float, str))}
        except BaseException as e:
            entry["status"] = f"error: {type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()
            print(entry["traceback"], flush=True)
            if isinstance(e, KeyboardInterrupt):
                raise
        entry["end"] = time.time()
        log.append(entry)
        with open(os.path.join(a.out, f"{a.label}-runs.json"), "w") as f:
            json.dump(log, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
