"""How many Mooncake ranges one layer of a P/D request takes, and why: a model
of vLLM's block allocation on a prefill and a decode instance under
closed-loop load, counting the ranges of each way OrbitKV can write a layer.

    .venv/bin/python benches/fragmentation.py [--json out.json] [--vllm-queue]

Not a timed test and not a measurement of a GPU: it replays the block IDs
two vLLM instances would hand one request, with the free-queue rules of vLLM
0.26 (``vllm/v1/core/block_pool.py::free_blocks``,
``single_type_kv_cache_manager.py::free``): a finished request's blocks are
freed in reverse; those with a hash (full blocks, prefix caching on, the
default) go to the queue's tail, those without (a final partial block) to
its head; new blocks are taken from the head. So a block pool that has been
cycled hands a request the blocks of earlier requests *in the reverse of
the order they were used*: the direction of a run flips with every reuse,
and on two instances that cycle at different rates a request's prefill
blocks and decode blocks run in opposite directions about half the time.
Where they do, no two blocks of a layer are one range (a range copies
contiguous bytes to contiguous bytes; it cannot reverse the block order).

``--vllm-queue`` replays the same schedule on vLLM's own
``FreeKVCacheBlockQueue`` and ``KVCacheBlock`` (from the installed vLLM)
and checks that every request gets the same block IDs as in the model.

The load model (assumptions, stated so they can be argued with): fresh
prompts of 1024-8192 tokens (uniform), 64 output tokens, ``C`` requests in
flight (a new one as each ends); block size 16; the prefill schedules FIFO
with chunked prefill under an 8192-token budget per step (vLLM allocates a
request's blocks chunk by chunk, interleaved with the other requests of the
step), a step taking 5 ms + 15 us per token; the prefill frees a request's
blocks ``--lag-ms`` after its last chunk (its writes ending); the decode
allocates the whole prompt when it authorizes the request (before the
prefill computes it: OrbitKV's flow), then one block per 16 generated
tokens, and frees after 64 tokens at 20 ms each. Pool sizes default to the
GPU runs 37-38 of docs/qualification.md (Llama-3-8B shape cut to 16 layers,
bf16: 1 MiB a block over all layers; 6.5 GiB of KV on the prefill, 12 GiB
on the decode). The first quarter of each run (pools not yet cycled) is left
out.

Ranges per (layer, plane) of one request, for each way of writing a layer:
- ``direct``: page to page (``KvLayout::plan_write``): one range per run of
  blocks consecutive on both sides in the same direction, per chunk;
- ``staged, request order -> pages``: prefill gathers a chunk's blocks in
  request order into a contiguous staging, written into decode's pages:
  one range per ascending run of decode's IDs;
- ``staged, sorted per chunk -> pages``: the gather puts a chunk's blocks in
  the order of decode's block IDs: one range per set of consecutive decode
  IDs, whatever their direction;
- ``grant``: both sides staged (decode's staging grant, then a scatter):
  one range per chunk.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import random
import statistics
from typing import Any


class ModelPool:
    """vLLM 0.26's free queue, as a deque of block IDs (0 is the null block)."""

    def __init__(self, n: int) -> None:
        self.q = collections.deque(range(1, n))
        self.hashed: set[int] = set()

    def get(self, n: int) -> list[int]:
        if n > len(self.q):
            raise MemoryError
        out = [self.q.popleft() for _ in range(n)]
        self.hashed.difference_update(out)
        return out

    def free(self, blocks: list[int], full: int) -> None:
        """Free a request's ``blocks`` (token order); the first ``full`` are
        full blocks, hashed under prefix caching."""
        self.hashed.update(blocks[:full])
        ordered = list(reversed(blocks))
        self.q.extendleft(reversed([b for b in ordered if b not in self.hashed]))
        self.q.extend(b for b in ordered if b in self.hashed)


class VllmPool:
    """The same, on vLLM's own FreeKVCacheBlockQueue (for ``--vllm-queue``)."""

    def __init__(self, n: int) -> None:
        from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

        self.blocks = [KVCacheBlock(i) for i in range(n)]
        self.queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.hashed: set[int] = set()

    def get(self, n: int) -> list[int]:
        if n > self.queue.num_free_blocks:
            raise MemoryError
        out = [b.block_id for b in self.queue.popleft_n(n)]
        self.hashed.difference_update(out)
        return out

    def free(self, blocks: list[int], full: int) -> None:
        # block_pool.free_blocks(reversed(blocks)): without hash prepended, with hash appended
        self.hashed.update(blocks[:full])
        ordered = [self.blocks[b] for b in reversed(blocks)]
        self.queue.prepend_n([b for b in ordered if b.block_id not in self.hashed])
        self.queue.append_n([b for b in ordered if b.block_id in self.hashed])


def simulate(in_flight: int, n_req: int, prefill_blocks: int, decode_blocks: int, lag_ms: float,
             seed: int, pool: type = ModelPool, bs: int = 16, budget: int = 8192,
             out_tokens: int = 64, decode_step_ms: float = 20.0) -> list[dict[str, Any]]:
    """Each finished request's prefill blocks, decode blocks (prompt part)
    and chunk ends (request block indices), in finishing order."""
    rnd = random.Random(seed)
    pre, dec = pool(prefill_blocks), pool(decode_blocks)
    reqs: dict[int, dict[str, Any]] = {}
    waiting: collections.deque[int] = collections.deque()
    running: list[int] = []
    events: list[tuple[float, str, int]] = []
    out: list[dict[str, Any]] = []
    t, next_id, ended = 0.0, 0, 0

    def arrive() -> None:
        nonlocal next_id
        n = rnd.randint(1024, 8192)
        reqs[next_id] = {"tokens": n, "done": 0, "p": [], "d": dec.get(-(-n // bs)), "cuts": []}
        waiting.append(next_id)
        next_id += 1

    for _ in range(in_flight):
        arrive()
    while ended < n_req:
        tokens, step = 0, []
        for rid in running + list(waiting):
            if tokens >= budget:
                break
            r = reqs[rid]
            n = min(r["tokens"] - r["done"], budget - tokens)
            need = -(-(r["done"] + n) // bs) - len(r["p"])
            try:
                r["p"] += pre.get(need)
            except MemoryError:
                break
            if rid in waiting:
                waiting.remove(rid)
                running.append(rid)
            r["done"] += n
            r["cuts"].append(-(-r["done"] // bs))
            tokens += n
            step.append(rid)
        t += 5.0 + 0.015 * tokens
        for rid in step:
            r = reqs[rid]
            if r["done"] == r["tokens"]:
                running.remove(rid)
                out.append({"p": r["p"][:], "d": r["d"][:], "cuts": r["cuts"][:]})
                heapq.heappush(events, (t + lag_ms, "prefill_free", rid))
                heapq.heappush(events, (t + lag_ms + out_tokens * decode_step_ms, "decode_free", rid))
        while events and events[0][0] <= t:
            _, kind, rid = heapq.heappop(events)
            r = reqs[rid]
            if kind == "prefill_free":
                pre.free(r["p"], r["tokens"] // bs)
            else:
                total = r["tokens"] + out_tokens
                r["d"] += dec.get(-(-total // bs) - len(r["d"]))
                dec.free(r["d"], total // bs)
                ended += 1
                if next_id < n_req + in_flight:
                    arrive()
    return out


def _chunks(cuts: list[int]) -> list[tuple[int, int]]:
    return list(zip([0] + cuts[:-1], cuts))


def direct_ranges(p: list[int], d: list[int], cuts: list[int]) -> int:
    n = 0
    for lo, hi in _chunks(cuts):
        n += 1 + sum(1 for i in range(lo + 1, hi)
                     if not (p[i] - p[i - 1] == d[i] - d[i - 1] and abs(p[i] - p[i - 1]) == 1))
    return n


def ascending_runs(ids: list[int]) -> int:
    return (1 if ids else 0) + sum(1 for a, b in zip(ids, ids[1:]) if b - a != 1)


def request_order_ranges(d: list[int], cuts: list[int]) -> int:
    return sum(ascending_runs(d[lo:hi]) for lo, hi in _chunks(cuts))


def sorted_ranges(d: list[int], cuts: list[int]) -> int:
    return sum(ascending_runs(sorted(d[lo:hi])) for lo, hi in _chunks(cuts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--in-flight", default="1,4,8,16,32")
    ap.add_argument("--prefill-blocks", type=int, default=6656)
    ap.add_argument("--decode-blocks", type=int, default=12288)
    ap.add_argument("--lag-ms", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=20261204)
    ap.add_argument("--vllm-queue", action="store_true", help="also replay on vLLM's own free queue and compare")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    rows = []
    print("| in flight | requests | blocks | direct | staged, request order -> pages | "
          "staged, sorted per chunk -> pages | grant | direct / sorted |")
    print("|---|---|---|---|---|---|---|---|")
    for c in (int(x) for x in a.in_flight.split(",")):
        n_req = 300 + 10 * c
        res = simulate(c, n_req, a.prefill_blocks, a.decode_blocks, a.lag_ms, a.seed + c)
        if a.vllm_queue:
            again = simulate(c, n_req, a.prefill_blocks, a.decode_blocks, a.lag_ms, a.seed + c, pool=VllmPool)
            assert [(x["p"], x["d"]) for x in again] == [(x["p"], x["d"]) for x in res], "model != vLLM's queue"
        res = res[len(res) // 4:]

        def mean(f: Any, res: list[dict[str, Any]] = res) -> float:
            return statistics.mean(f(x) for x in res)

        row = {
            "in_flight": c,
            "requests": len(res),
            "blocks": mean(lambda x: len(x["p"])),
            "direct": mean(lambda x: direct_ranges(x["p"], x["d"], x["cuts"])),
            "staged_request_order_to_pages": mean(lambda x: request_order_ranges(x["d"], x["cuts"])),
            "staged_sorted_per_chunk_to_pages": mean(lambda x: sorted_ranges(x["d"], x["cuts"])),
            "grant": mean(lambda x: len(x["cuts"])),
            "opposite_direction_share": mean(lambda x: sum(
                1 for i in range(1, len(x["p"]))
                if abs(x["p"][i] - x["p"][i - 1]) == 1 and x["d"][i] - x["d"][i - 1] == -(x["p"][i] - x["p"][i - 1])
            ) / max(1, len(x["p"]) - 1)),
            "vllm_queue_checked": a.vllm_queue,
        }
        rows.append(row)
        print(f"| {c} | {row['requests']} | {row['blocks']:.0f} | {row['direct']:.1f} | "
              f"{row['staged_request_order_to_pages']:.1f} | {row['staged_sorted_per_chunk_to_pages']:.1f} | "
              f"{row['grant']:.1f} | {row['direct'] / row['staged_sorted_per_chunk_to_pages']:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
