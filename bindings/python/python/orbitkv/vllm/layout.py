"""Where each block of a rank's vLLM KV cache lives: the OrbitKV layout (the
JSON-ready dict ``src/layout.rs`` takes), read from the tensors' shapes and
strides rather than from their contiguity.

vLLM hands ``register_kv_caches`` one tensor per layer, often a permuted view
of its allocation. Logical shapes (vLLM 0.26):

* ``[num_blocks, heads, block_size, content]``: CPU, FlashAttention,
  FlashInfer, Triton (and most others); K and V packed in ``content``. Under
  ``HND`` the view is contiguous; under ``NHD`` (vLLM's GPU default) it is a
  permuted view whose memory order is ``[num_blocks, block_size, heads,
  content]``: each block is still one dense range, with tokens outermost.
* ``[2, num_blocks, block_size, heads, head_size]`` (ROCm attention, older
  vLLM) and ``[num_blocks, 2, block_size, heads, head_size]``: a K/V dim.
* ``[num_blocks, block_size, head_size]``: MLA.

Any of them is served when, per layer and per plane, each block is one dense
range of memory; the heads are a contiguous equal slice each (``head_major``)
when heads are the outermost dim of the block in memory order.

vLLM is imported lazily (only to order layer names).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

import torch

FIX = (
    "start both instances with VLLM_KV_CACHE_LAYOUT=HND (PdConnector asks vLLM for HND unless the "
    "variable or the attention backend sets another layout), or choose an attention backend whose "
    "blocks are dense (--attention-backend FLASH_ATTN, FLASHINFER or TRITON_ATTN)"
)


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


@dataclass(frozen=True)
class _Plane:
    """One array of blocks of a layer, in bytes."""

    base: int
    block_stride: int
    block_bytes: int

    def as_dict(self) -> dict[str, int]:
        return {"base": self.base, "block_stride": self.block_stride, "block_bytes": self.block_bytes}


def _memory_order(t: torch.Tensor, dims: list[int]) -> list[int] | None:
    """``dims`` (those of size > 1) from outermost to innermost in memory, when
    their elements form one dense range; ``None`` when they do not."""
    live = sorted((d for d in dims if t.shape[d] > 1), key=lambda d: t.stride(d))
    expected = 1
    for d in live:
        if t.stride(d) != expected:
            return None
        expected *= t.shape[d]
    return live[::-1]


def _block_and_kv_dims(t: torch.Tensor, num_blocks: int) -> tuple[int, int | None]:
    """The block dim and the K/V dim (``None`` when K and V are packed in the
    content dim) of a layer's tensor."""
    if t.dim() >= 2 and t.shape[0] == num_blocks:
        return 0, (1 if t.dim() == 5 and t.shape[1] == 2 else None)
    if t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return 1, 0
    raise ValueError("no block dimension")


def _layer_planes(
    name: str, t: torch.Tensor, num_blocks: int, local_heads: int, block_size: int
) -> tuple[list[_Plane], bool]:
    """A layer's planes and whether its blocks are head-major."""
    es = t.element_size()
    where = f"KV cache {name!r} (shape {tuple(t.shape)}, strides {tuple(t.stride())}, {t.dtype})"
    try:
        bdim, kv = _block_and_kv_dims(t, num_blocks)
    except ValueError:
        raise ValueError(
            f"{where}: OrbitKV needs the block dimension ({num_blocks} blocks) first, "
            f"or after a K/V dimension of 2"
        ) from None
    inner = [d for d in range(t.dim()) if d not in (bdim, kv)]
    # Token and head dims by vLLM's logical shapes (see the module docstring).
    tokens: int | None = None
    heads: int | None = None
    if len(inner) == 3:
        tokens, heads = (inner[1], inner[0]) if kv is None else (inner[0], inner[1])
    elif len(inner) == 2:
        tokens = inner[0]
    if tokens is not None and t.shape[tokens] != block_size:
        raise ValueError(
            f"{where}: {t.shape[tokens]} tokens per block, vLLM's block size is {block_size} "
            "(the attention kernel splits blocks); OrbitKV needs a block size the backend "
            "serves unsplit"
        )
    if heads is not None and t.shape[heads] != local_heads:
        heads = None
    stride = t.stride(bdim) * es
    # K and V of a block as one plane where they are one dense range, else as
    # two planes, K's blocks all before V's (the runtime refuses planes that
    # interleave).
    candidates = [(inner, [0])] if kv is None else [(inner + [kv], [0]), (inner, [0, t.stride(kv)])]
    for dims, offsets in candidates:
        order = _memory_order(t, dims)
        block_bytes = prod(t.shape[d] for d in dims) * es
        if order is None or (num_blocks > 1 and stride < block_bytes):
            continue
        if len(offsets) > 1 and offsets[1] * es < (num_blocks - 1) * stride + block_bytes:
            continue
        hm = heads is not None and (t.shape[heads] == 1 or order[0] == heads)
        return [_Plane(t.data_ptr() + o * es, stride, block_bytes) for o in offsets], hm
    raise ValueError(f"{where}: a block is not one dense range of memory, which OrbitKV needs; {FIX}")


def kv_layout_of(
    kv_caches: dict[str, torch.Tensor],
    num_blocks: int,
    local_heads: int,
    total_heads: int,
    block_size: int,
    tp_rank: int,
    tp_size: int,
    layer_group: dict[str, int] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The OrbitKV layout (as the JSON-ready dict the runtime takes) of a
    rank's KV tensors, and the layer names in layer order.

    Each layer gets one plane (K and V of a block together) where each block
    is one dense range, else two (K and V apart, e.g. ``[2, num_blocks, ...]``)
    where each of K's and V's blocks is. ``layer_group``: each layer's KV
    cache group under vLLM's hybrid manager (absent: group 0); layers of
    different groups share their tensors there, which the runtime accepts
    for exact copies of a plane in different groups. Raises ``ValueError``
    naming the tensor and the fix when a layout cannot be served.
    """
    names = sorted(kv_caches, key=_layer_index)
    layers = []
    head_major = True
    for name in names:
        planes, hm = _layer_planes(name, kv_caches[name], num_blocks, local_heads, block_size)
        head_major = head_major and hm
        layer: dict[str, Any] = {"planes": [p.as_dict() for p in planes]}
        group = (layer_group or {}).get(name, 0)
        if group:
            layer["group"] = group
        layers.append(layer)
    layout = {
        "num_blocks": num_blocks,
        "block_size": block_size,
        "total_kv_heads": total_heads,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "head_major": head_major,
        "layers": layers,
    }
    return layout, names
