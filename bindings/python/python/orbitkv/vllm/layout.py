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


def _token_order(t: torch.Tensor, order: list[int], tokens: int | None, heads: int | None, es: int) -> dict[str, Any] | None:
    """How a block of ``t`` holds its tokens (``src/layout.rs``'s
    ``TokenOrder``), from the memory order of its dims: the dims outside the
    token dim are rows (one unit a head when heads are outermost), those
    inside it a token's bytes. ``None`` where the token dim is not known or
    not live (one token a block)."""
    if tokens is None or tokens not in order:
        return None
    at = order.index(tokens)
    rows = prod(t.shape[d] for d in order[:at])
    token_bytes = prod(t.shape[d] for d in order[at + 1 :]) * es
    units = t.shape[heads] if heads is not None and order[0] == heads else 1
    return {"units": units, "parts": [{"rows": rows // units, "token_bytes": token_bytes}]}


def _layer_planes(
    name: str, t: torch.Tensor, num_blocks: int, local_heads: int, block_size: int
) -> tuple[list[_Plane], bool, dict[str, Any] | None]:
    """A layer's planes, whether its blocks are head-major, and how they
    hold their tokens as the shape says (vLLM's GPU layouts)."""
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
        planes = [_Plane(t.data_ptr() + o * es, stride, block_bytes) for o in offsets]
        return planes, hm, _token_order(t, order, tokens, heads, es)
    raise ValueError(f"{where}: a block is not one dense range of memory, which OrbitKV needs; {FIX}")


def _state_plane(name: str, t: torch.Tensor, num_blocks: int) -> _Plane:
    """A recurrent-state layer's one plane: vLLM hands the connector its
    pages as ``[num_blocks, 1, 1, state_bytes]`` int8 (vLLM 0.32), a page a
    block at ``stride(0)``, the state (conv, then SSM) at the page's start
    and padding after it. Only the state is sent."""
    es = t.element_size()
    dense = t.dim() >= 2 and t.shape[0] == num_blocks and t[0].is_contiguous()
    if not dense or (num_blocks > 1 and t.stride(0) < t[0].numel()):
        raise ValueError(
            f"state cache {name!r} (shape {tuple(t.shape)}, strides {tuple(t.stride())}, {t.dtype}): OrbitKV "
            f"needs one dense state of a request a block ({num_blocks} blocks first)"
        )
    return _Plane(t.data_ptr(), t.stride(0) * es, t[0].numel() * es)


def kv_layout_of(
    kv_caches: dict[str, torch.Tensor],
    num_blocks: int,
    local_heads: int,
    total_heads: int,
    block_size: int,
    tp_rank: int,
    tp_size: int,
    layer_group: dict[str, int] | None = None,
    cpu: bool = False,
    cpu_parts: list[dict[str, int]] | None = None,
    state_layers: frozenset[str] = frozenset(),
) -> tuple[dict[str, Any], list[str]]:
    """The OrbitKV layout (as the JSON-ready dict the runtime takes) of a
    rank's KV tensors, and the layer names in layer order.

    Each layer gets one plane (K and V of a block together) where each block
    is one dense range, else two (K and V apart, e.g. ``[2, num_blocks, ...]``)
    where each of K's and V's blocks is. ``layer_group``: each layer's KV
    cache group under vLLM's hybrid manager (absent: group 0); layers of
    different groups share their tensors there, which the runtime accepts
    for exact copies of a plane in different groups. ``cpu``: the tensors
    are vLLM's CPU backend's, whose kernels keep a block's tokens in their
    own order, ``cpu_parts`` (:func:`cpu_kernel_parts`; ``None``: not
    known); otherwise the order is read from the shape. ``state_layers``:
    layers of recurrent state (vLLM's Mamba groups), each block one page
    holding a request's state (:func:`_state_plane`); such a layout says no
    token order. Raises ``ValueError`` naming the tensor and the fix when a
    layout cannot be served.
    """
    names = sorted(kv_caches, key=_layer_index)
    layers = []
    head_major = True
    orders = []
    for name in names:
        if name in state_layers:
            planes, hm, order = [_state_plane(name, kv_caches[name], num_blocks)], False, None
        else:
            planes, hm, order = _layer_planes(name, kv_caches[name], num_blocks, local_heads, block_size)
        head_major = head_major and hm
        orders.append(order)
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
    # How blocks hold their tokens (what serves a peer of another block
    # size): on vLLM's CPU backend the kernel's own order (``cpu_parts``, a
    # head a unit; ``None``: not known), else as the shape says, where every
    # layer agrees.
    if state_layers:
        order = None  # a state block holds no tokens
    elif cpu:
        order = {"units": local_heads, "parts": cpu_parts} if cpu_parts and head_major else None
    else:
        order = orders[0] if orders and all(o == orders[0] for o in orders) else None
    if order is not None:
        layout["token_order"] = order
    return layout, names


def cpu_kernel_parts(dtype: torch.dtype, block_size: int, head_size: int) -> list[dict[str, int]] | None:
    """How vLLM's CPU attention kernels keep a head's tokens in a block: K
    transposed (``head_size`` rows of one element a token), then V (one row
    of ``head_size`` elements a token), as ``TokenOrder`` parts. Checked by
    writing a known K and V through the kernel vLLM picks for this dtype,
    block size and head size (its ``_get_attn_isa``) into a scratch cache of
    two blocks; ``None`` when the kernel keeps them otherwise or cannot be
    asked (then a peer of another block size is refused)."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, head_size)
        heads, blocks, n = 2, 2, 2 * block_size
        cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype)
        kc, vc = cache.view(blocks, heads, 2 * block_size, head_size).chunk(2, dim=2)
        # Small integers, exact in every float dtype the kernels take.
        code = torch.arange(n * heads * head_size) % 251 + 1
        key = code.view(n, heads, head_size).to(dtype)
        value = (-code).view(n, heads, head_size).to(dtype)
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, torch.arange(n, dtype=torch.int64), isa)
        want = torch.empty_like(cache).view(blocks, heads, 2, -1)
        for b in range(blocks):
            tok = slice(b * block_size, (b + 1) * block_size)
            # [tokens, heads, head_size] -> per head: K [head_size, tokens], V [tokens, head_size]
            want[b, :, 0] = key[tok].permute(1, 2, 0).reshape(heads, -1)
            want[b, :, 1] = value[tok].permute(1, 0, 2).reshape(heads, -1)
        if not torch.equal(cache.view(blocks, heads, 2, -1), want):
            return None
    except Exception:  # noqa: BLE001 - any failure means: not known
        return None
    es = torch.empty((), dtype=dtype).element_size()
    return [{"rows": head_size, "token_bytes": es}, {"rows": 1, "token_bytes": head_size * es}]
