"""Geometry, block patterns, ranges and rates shared by every part."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

# Both halves of every benchmark request share this capability (a router
# gives each request its own).
BENCH_CAPABILITY = "0123456789abcdef" * 4


# ----------------------------------------------------------------------------
# geometry (Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16, block 16)

BLOCK_TOKENS = 16
KV_HEADS = 8
HEAD_DIM = 128
ELEM = 2  # bf16
BLOCK_BYTES = BLOCK_TOKENS * KV_HEADS * HEAD_DIM * ELEM  # 32 KiB per plane
GUARD = 0xA5  # destination fill
GUARD_BUF = 8 << 20  # guard-test buffers
MiB = 1 << 20
SEED = 20261129


def log(*a: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def num_blocks_for(max_tokens: int) -> int:
    n = max_tokens // BLOCK_TOKENS
    return n + max(16, n // 8)


def block_ids(tokens: int, pattern: str, nb: int) -> tuple[list[int], list[int]]:
    """Source (producer) and destination (consumer) block IDs of a request."""
    n = tokens // BLOCK_TOKENS
    if pattern == "contiguous":
        return list(range(n)), list(range(3, 3 + n))
    rng = random.Random(SEED + tokens)
    return rng.sample(range(nb), n), rng.sample(range(nb), n)


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_block, dst_block, count) runs where both sides are consecutive:
    what the runtime's planner coalesces into one range per plane."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def guard_ranges() -> list[tuple[int, int, int]]:
    """(src_off, dst_off, len): mixed and odd sizes, at odd offsets, each
    destination range with guard bytes on both sides (gaps of 1..61 bytes)."""
    lengths = [1, 2, 3, 7, 8, 15, 16, 17, 31, 64, 127, 255, 256, 511, 1000, 4095, 4096, 4097,
               65535, 65536, 65537, 131071, MiB, MiB + 13, 3 * MiB - 5]
    rng = random.Random(SEED)
    dst_cursor, out = 37, []
    for i, n in enumerate(lengths):
        out.append([0, dst_cursor, n])
        dst_cursor += n + 1 + (i * 7) % 61
    order = list(range(len(out)))
    rng.shuffle(order)
    src_cursor = 5
    for i in order:
        out[i][0] = src_cursor
        src_cursor += out[i][2] + 3
    assert dst_cursor < GUARD_BUF and src_cursor < GUARD_BUF
    return [tuple(r) for r in out]  # type: ignore[misc]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def summarize(nbytes: int, secs: list[float]) -> dict[str, Any]:
    return {
        "bytes": nbytes,
        "samples_s": [round(s, 6) for s in secs],
        "median_s": statistics.median(secs),
        "gbps_median": gbps(nbytes, statistics.median(secs)),
        "gbps_best": gbps(nbytes, min(secs)),
    }
