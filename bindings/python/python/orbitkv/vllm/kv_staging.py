"""The prefill's source staging taken out of vLLM's own KV cache
(``orbitkv.pd.staging_memory`` ``"kv_cache"``), so that it is inside
``gpu_memory_utilization`` instead of beside it.

The scheduler side takes ``R`` blocks from vLLM's block pool once, before any
request (``bind_gpu_block_pool``; vLLM's own ``get_new_blocks``: never freed,
never hashed, never handed to a request), shrinks the pool's count by as
many (vLLM's KV usage gauge and ``reset_prefix_cache`` then see the pool as
if vLLM had sized it ``R`` blocks smaller), and names the blocks in every
step's connector metadata. Each worker turns them into byte ranges of its
own KV tensors (:func:`segments`: a stripe of each layer and plane, merged
where the layout keeps a block's planes side by side) and hands them to the
runtime (``Runtime.add_source_staging``), which cuts the layer pieces out of
them exactly as out of a region of its own. Nothing but those pieces ever
touches the blocks: vLLM writes KV only into the blocks of its requests'
block tables (and padding into block 0, never taken).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from typing import Any

from orbitkv.vllm.config import AUTO_STAGING_KV_SHARE, staging_parts


def reserved_blocks(kv_bytes: int, num_blocks: int, role: str, min_free: int,
                    kv_share: float = AUTO_STAGING_KV_SHARE, step_blocks: int = 0) -> int:
    """How many blocks of a KV cache of ``num_blocks`` blocks (``kv_bytes``
    on each rank) the source staging takes: the bytes ``staging_parts``
    gives an ``auto`` staging on a rank of ``role`` (``kv_share`` of the KV
    cache, a quarter by default, at most 1 GiB or, where more,
    AUTO_STAGING_STEPS steps of ``step_blocks`` blocks, vLLM's
    ``max_num_batched_tokens``, up to a tenth of the cache; none on
    ``kv_consumer``), in whole blocks, leaving at least ``min_free`` blocks
    (a request of the model's whole length) to vLLM besides the null block.
    0: none."""
    if kv_bytes <= 0 or num_blocks <= 1:
        return 0
    per_block = -(-kv_bytes // num_blocks)
    step = step_blocks * per_block if step_blocks > 0 else None
    want = (staging_parts("auto", role, kv_bytes, kv_share, step)[1] << 20) // per_block
    return max(0, min(want, num_blocks - 1 - max(min_free, 0)))


def take_blocks(pool: Any, count: int) -> list[int]:
    """Takes ``count`` blocks out of vLLM's block pool for good (its
    ``get_new_blocks``, before any request: the lowest free IDs) and
    shrinks the pool's ``num_gpu_blocks`` by as many, so that its usage and
    its prefix-cache reset count only the blocks vLLM may use. Their IDs,
    sorted; ``[]`` when the pool lacks what this needs or has not the room
    (nothing taken then)."""
    if count <= 0 or not all(hasattr(pool, a) for a in ("get_new_blocks", "get_num_free_blocks", "num_gpu_blocks")):
        return []
    if pool.get_num_free_blocks() < count:
        return []
    blocks = pool.get_new_blocks(count)
    pool.num_gpu_blocks -= len(blocks)
    return sorted(int(b.block_id) for b in blocks)


def give_blocks_back(pool: Any, block_runs: Sequence[tuple[int, int]]) -> int:
    """Returns the blocks ``take_blocks`` took (as runs) to vLLM's block
    pool: each one's reference dropped (vLLM's ``free_blocks``, which puts
    an unhashed block at the front of the free queue) and the pool's
    ``num_gpu_blocks`` grown by as many, so its usage counts them again.
    How many went back; 0, with nothing changed, when the pool lacks what
    this needs or a block is not one held only by the staging."""
    if not block_runs or not all(hasattr(pool, a) for a in ("blocks", "free_blocks", "num_gpu_blocks")):
        return 0
    ids = [b for start, end in block_runs for b in range(start, end)]
    if any(not 0 < b < len(pool.blocks) for b in ids):
        return 0
    blocks = [pool.blocks[b] for b in ids]
    if any(getattr(b, "ref_cnt", None) != 1 or getattr(b, "block_hash", None) is not None for b in blocks):
        return 0
    pool.free_blocks(blocks)
    pool.num_gpu_blocks += len(blocks)
    return len(blocks)


def runs(block_ids: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted block IDs as runs ``[start, end)`` of consecutive IDs."""
    out: list[tuple[int, int]] = []
    for b in sorted(set(block_ids)):
        if out and out[-1][1] == b:
            out[-1] = (out[-1][0], b + 1)
        else:
            out.append((b, b + 1))
    return out


def segments(
    layout: dict[str, Any], block_runs: Sequence[tuple[int, int]], storages: Iterable[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The bytes of blocks ``block_runs`` in every layer and plane of
    ``layout`` (the OrbitKV layout dict, ``kv_layout_of``'s), as
    ``(address, bytes)`` segments: a plane's run of dense blocks is one
    range, and ranges that touch are merged only inside one of
    ``storages`` (``(address, bytes)`` of the tensors the layout's planes
    lie in: a piece of staging must lie in one tensor). Layers that share
    their memory give it once. Raises ``ValueError`` for a block outside
    ``1 .. num_blocks - 1`` (block 0 is vLLM's null block) or a plane
    outside ``storages``."""
    n = int(layout["num_blocks"])
    for a, z in block_runs:
        if not 1 <= a < z <= n:
            raise ValueError(f"blocks {a}..{z} are not within 1..{n} of the KV cache")
    spans: list[tuple[int, int]] = []
    for layer in layout["layers"]:
        for p in layer["planes"]:
            base, stride, nbytes = int(p["base"]), int(p["block_stride"]), int(p["block_bytes"])
            for a, z in block_runs:
                if stride == nbytes:
                    spans.append((base + a * stride, base + z * stride))
                else:
                    spans.extend((base + b * stride, base + b * stride + nbytes) for b in range(a, z))
    homes = sorted(storages)
    starts = [s for s, _ in homes]

    def home(addr: int, end: int) -> int:
        i = bisect_right(starts, addr) - 1
        if i < 0 or end > homes[i][0] + homes[i][1]:
            raise ValueError(f"KV bytes {addr:#x}..{end:#x} are in no registered tensor")
        return i

    merged: list[tuple[int, int, int]] = []
    for addr, end in sorted(spans):
        h = home(addr, end)
        if merged and merged[-1][2] == h and addr <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end), h)
        else:
            merged.append((addr, end, h))
    return [(a, e - a) for a, e, _ in merged]
