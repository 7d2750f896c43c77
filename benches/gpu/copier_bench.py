"""Host and device time of orbitkv.staging.StagingCopier's gather and scatter
on CUDA tensors of the Llama-3-8B geometry (32 layers, HND blocks of 16
tokens, 8 KV heads of 128, bf16: K and V planes of [2, blocks, heads, 16, 128]
per layer), as the connector and qualify.py call them: one BlockIndex per
step, one gather per layer, one scatter per request. Byte-checked against
the staged order. Run on the GPU machine:
  PYTHONPATH=<unpacked wheel> python3 benches/gpu/copier_bench.py [--old LABEL=PATH ...] [--blocks 64 512 2048]
(--old: another staging.py to time side by side, e.g. an earlier commit's).
--busy-ms N: each run again with the stream kept busy N ms before the
gathers (torch.cuda._sleep), as vLLM's forward keeps it: a copier that makes
the host wait for the stream shows it in its gather host time.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time

import torch

from orbitkv.staging import StagingCopier

LAYERS, HEADS, BS, HD = 32, 8, 16, 128


def run(cls, blocks: int, reps: int, label: str, profile: bool = False, busy_ms: float = 0.0) -> dict:
    num_blocks = 4 * blocks
    kv = [torch.randn(2, num_blocks, HEADS, BS, HD, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    es = 2
    layout = {"num_blocks": num_blocks, "layers": [
        {"planes": [{"base": t[k].data_ptr(), "block_stride": t.stride(1) * es, "block_bytes": t[k][0].numel() * es}
                    for k in (0, 1)]} for t in kv]}
    ub = BS * HD * es
    slots, off = [], 0
    for _ in range(LAYERS):
        row = []
        for _ in range(2):
            row.append([off, ub])
            off += HEADS * blocks * ub
        slots.append(row)
    stage = torch.zeros(off // 2 + 4096, device="cuda", dtype=torch.bfloat16)
    c = cls(layout, HEADS, [*kv, stage])
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    src, dst = perm[:blocks], perm[blocks : 2 * blocks]
    base = stage.data_ptr()
    out = {"label": label, "blocks": blocks, "bytes": 2 * LAYERS * blocks * HEADS * ub, "busy_ms": busy_ms}
    gh, gt, sh, st = [], [], [], []
    for r in range(reps + 1):
        torch.cuda.synchronize()
        if busy_ms:
            # the stream busy with earlier work (vLLM's forward queued ahead):
            # a copier that waits for the stream shows it in its host time
            torch.cuda._sleep(int(busy_ms * 1.98e6))
        t0 = time.perf_counter()
        idx = c.index(src)
        for layer in range(LAYERS):
            c.gather(layer, idx, 0, base, blocks, slots)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        didx = c.index(dst)
        c.scatter(didx, base, [(0, HEADS)], slots)
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        if r:
            gh.append(t1 - t0)
            gt.append(t2 - t0)
            sh.append(t3 - t2)
            st.append(t4 - t2)
    med = lambda v: sorted(v)[len(v) // 2] * 1e3  # noqa: E731
    out.update(gather_host_ms=med(gh), gather_total_ms=med(gt), scatter_host_ms=med(sh), scatter_total_ms=med(st))
    if profile:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        idx = c.index(src)
        for layer in range(LAYERS):
            c.gather(layer, idx, 0, base, blocks, slots)
        c.scatter(c.index(dst), base, [(0, HEADS)], slots)
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)
    ok = all(torch.equal(kv[k][:, d], kv[k][:, s]) for k in range(LAYERS) for s, d in zip(src, dst))
    out["bytes_ok"] = ok
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", nargs="*", default=[], help="LABEL=PATH of another staging.py to compare")
    ap.add_argument("--blocks", type=int, nargs="+", default=[64, 512, 2048])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--busy-ms", type=float, default=20.0)
    a = ap.parse_args()
    impls = [("current", StagingCopier)]
    for other in a.old:
        label, path = other.split("=", 1)
        spec = importlib.util.spec_from_file_location(f"staging_{label}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
        impls.append((label, mod.StagingCopier))
    for busy in (0.0, a.busy_ms):
        for blocks in a.blocks:
            for label, cls in impls:
                print(json.dumps(run(cls, blocks, a.reps, label, a.profile and blocks == a.blocks[-1], busy)), flush=True)


if __name__ == "__main__":
    main()
