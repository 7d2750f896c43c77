"""`kv_layout_of` on the KV tensors vLLM 0.26 hands `register_kv_caches` on
GPU, rebuilt on CPU tensors the way vLLM's runners build them
(`_reshape_attention_kv_cache` in vllm/v1/worker/gpu/attn_utils.py, used by
Model Runner V2 and by the old runner alike): a raw int8 allocation viewed in
the physical (stride-ordered) shape, then permuted back to the backend's
logical shape.

Each case checks the planes, strides, block bytes and `head_major` against
values computed here from the geometry, and byte by byte that what is written
through vLLM's view into block b lies exactly in
[base + b*block_stride, +block_bytes) of the raw allocation, one equal slice
per head when the layout says head-major.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from math import prod
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import orbitkv
from orbitkv.vllm.layout import cpu_kernel_parts, kv_layout_of

DT = torch.bfloat16
ES = 2
BS = 16
NB = 6
LAYERS = 4
NHD = (0, 2, 1, 3)  # stride order of (nb, H, N, 2D) -> physical (nb, N, H, 2D)
HND = (0, 1, 2, 3)


def name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


Accepts = Callable[[dict[str, Any]], None]


@pytest.fixture
def accepts(pair: tuple[orbitkv.MooncakeTransferEngine, orbitkv.MooncakeTransferEngine]) -> Iterator[Accepts]:
    """Checks that the Rust runtime takes a layout (it validates it on start)."""

    def check(lay: dict[str, Any]) -> None:
        orbitkv.Runtime(pair[0], json.dumps(lay)).shutdown()

    yield check


def vllm_view(
    raw: torch.Tensor,
    shape: tuple[int, ...],
    stride_order: tuple[int, ...],
    packing: tuple[int, int] | None = None,
    page_elems: int | None = None,
) -> torch.Tensor:
    """What vLLM 0.26's `_reshape_attention_kv_cache` makes of `raw`: packed
    (cross-layer per-block packing), padded pages, or plain."""
    physical = tuple(shape[i] for i in stride_order)
    inv = [stride_order.index(i) for i in range(len(stride_order))]
    if packing is not None:
        offset, block_stride = packing
        page_bytes = prod(shape[1:]) * ES
        kv = raw.view(-1, block_stride)[:, offset : offset + page_bytes].view(DT).view(physical)
    elif page_elems is not None:
        strides = list(torch.empty(physical, device="meta").stride())
        strides[inv[0]] = page_elems
        kv = torch.as_strided(raw.view(DT), size=physical, stride=tuple(strides))
    else:
        kv = raw.view(DT).view(physical)
    return kv.permute(*inv)


@dataclass
class Backend:
    """A backend's logical shape and stride order (vLLM 0.26 source) and how
    to reach block b and its heads through the logical view."""

    shape: Callable[[int, int, int], tuple[int, ...]]  # (heads, head_size, blocks)
    order: dict[str, tuple[int, ...]]
    block: Callable[[torch.Tensor, int], torch.Tensor]
    heads_dim: int  # of the block view
    tokens_dim: int = 1  # of the block view


# get_kv_cache_shape / get_kv_cache_stride_order, vLLM 0.26:
# vllm/v1/attention/backends/{flash_attn,flashinfer,triton_attn}.py: (nb, H, N, 2D)
PACKED = Backend(lambda h, d, nb: (nb, h, BS, 2 * d), {"NHD": NHD, "HND": HND}, lambda t, b: t[b], 0)
# cpu_attn.py: (nb, H, N, 2D), no stride order
CPU = Backend(PACKED.shape, {"HND": HND}, lambda t, b: t[b], 0)
# rocm_attn.py: (2, nb, N, H, D), no stride order
ROCM = Backend(lambda h, d, nb: (2, nb, BS, h, d), {"NHD": (0, 1, 2, 3, 4)}, lambda t, b: t[:, b], 2)
# hpc_attn.py: (nb, 2, N, H, D), stride order identity
HPC = Backend(lambda h, d, nb: (nb, 2, BS, h, d), {"NHD": (0, 1, 2, 3, 4)}, lambda t, b: t[b], 2)

GEOMETRIES = [(2, 64), (8, 128)]  # total KV heads, head size
TPS = [(0, 1), (0, 2), (1, 2)]


def layout(
    caches: dict[str, torch.Tensor], heads: int, total: int, tp: tuple[int, int], accepts: Accepts
) -> dict[str, Any]:
    lay, names = kv_layout_of(
        caches, num_blocks=NB, local_heads=heads, total_heads=total, block_size=BS, tp_rank=tp[0], tp_size=tp[1]
    )
    assert names == [name(i) for i in range(LAYERS)]
    assert (lay["num_blocks"], lay["block_size"], lay["total_kv_heads"]) == (NB, BS, total)
    assert (lay["tp_rank"], lay["tp_size"]) == tp
    accepts(lay)
    return lay


def check_bytes(
    raw: torch.Tensor, kv: torch.Tensor, be: Backend, planes: list[dict[str, int]], head_major: bool, heads: int
) -> None:
    """Writes head h of block b as h+1 through vLLM's view and finds it in
    the planes' ranges of `raw`, and nowhere else."""
    flat = raw.view(DT)
    for b in (0, NB // 2, NB - 1):
        raw.zero_()
        blk = be.block(kv, b)
        for h in range(heads):
            blk.select(be.heads_dim, h).fill_(h + 1)
        ranges = []
        for p in planes:
            start = (p["base"] - raw.data_ptr() + b * p["block_stride"]) // ES
            ranges.append(flat[start : start + p["block_bytes"] // ES])
        assert all(bool((r != 0).all()) for r in ranges)
        assert int(flat.count_nonzero()) == sum(r.numel() for r in ranges) == blk.numel()
        per_head = [r.view(heads, -1) for r in ranges]
        slices_are_heads = all(bool((ph[h] == h + 1).all()) for ph in per_head for h in range(heads))
        assert slices_are_heads == head_major


def check_token_order(raw: torch.Tensor, kv: torch.Tensor, be: Backend, lay: dict[str, Any], layer: int = 0) -> None:
    """Writes token t of block b through vLLM's view and finds it exactly
    where the layout's ``token_order`` says (``src/layout.rs``'s
    ``TokenOrder``: units, parts of rows of tokens), in every plane, and
    nowhere else: what a peer of another block size is written by."""
    order = lay["token_order"]
    bs = lay["block_size"]
    unit = sum(p["rows"] * bs * p["token_bytes"] for p in order["parts"])
    flat = raw.view(torch.uint8)
    for b in (0, NB - 1):
        for t in (0, 5, bs - 1):
            raw.zero_()
            be.block(kv, b).select(be.tokens_dim, t).fill_(1.0)
            want = torch.zeros_like(flat, dtype=torch.bool)
            for p in lay["layers"][layer]["planes"]:
                start = p["base"] - raw.data_ptr() + b * p["block_stride"]
                for u in range(order["units"]):
                    at = start + u * unit
                    for part in order["parts"]:
                        tb = part["token_bytes"]
                        for r in range(part["rows"]):
                            off = at + (r * bs + t) * tb
                            want[off : off + tb] = True
                        at += part["rows"] * bs * tb
            # bf16 1.0 is 0x3f80: both bytes of every element are set.
            assert torch.equal(flat != 0, want), f"block {b} token {t}"


def llama(
    be: Backend, kv_layout: str, heads: int, head_size: int
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """One raw allocation per layer, as vLLM makes for a Llama (one
    KVCacheTensor per layer); the dict in reverse layer order."""
    shape = be.shape(heads, head_size, NB)
    raws = [torch.zeros(prod(shape) * ES, dtype=torch.int8) for _ in range(LAYERS)]
    caches = {name(i): vllm_view(raws[i], shape, be.order[kv_layout]) for i in reversed(range(LAYERS))}
    return raws, caches


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("total,head_size", GEOMETRIES)
@pytest.mark.parametrize("tp", TPS)
def test_packed_kv_backends(
    backend: str, kv_layout: str, total: int, head_size: int, tp: tuple[int, int], accepts: Accepts
) -> None:
    heads = total // tp[1]
    raws, caches = llama(PACKED, kv_layout, heads, head_size)
    if kv_layout == "NHD" and heads > 1:
        assert not caches[name(0)].is_contiguous()  # the view of issue 9
    lay = layout(caches, heads, total, tp, accepts)
    block_bytes = heads * BS * 2 * head_size * ES
    expect = [[{"base": r.data_ptr(), "block_stride": block_bytes, "block_bytes": block_bytes}] for r in raws]
    assert [layer["planes"] for layer in lay["layers"]] == expect
    assert lay["head_major"] == (kv_layout == "HND" or heads == 1)
    for i, raw in enumerate(raws):
        check_bytes(raw, caches[name(i)], PACKED, expect[i], lay["head_major"], heads)
    # HND: a unit a head, a token's K and V of one head a row; NHD: one
    # unit, a token's K and V of every head a row.
    hnd = kv_layout == "HND" or heads == 1
    row = 2 * head_size * ES * (1 if hnd else heads)
    assert lay["token_order"] == {"units": heads if hnd else 1, "parts": [{"rows": 1, "token_bytes": row}]}
    check_token_order(raws[1], caches[name(1)], PACKED, lay, 1)


@pytest.mark.parametrize("total,head_size", GEOMETRIES)
@pytest.mark.parametrize("tp", TPS)
def test_kv_first_planes(total: int, head_size: int, tp: tuple[int, int], accepts: Accepts) -> None:
    """ROCm attention's [2, nb, N, H, D]: K and V as two planes."""
    heads = total // tp[1]
    raws, caches = llama(ROCM, "NHD", heads, head_size)
    lay = layout(caches, heads, total, tp, accepts)
    block_bytes = BS * heads * head_size * ES
    expect = [
        [
            {"base": r.data_ptr(), "block_stride": block_bytes, "block_bytes": block_bytes},
            {"base": r.data_ptr() + NB * block_bytes, "block_stride": block_bytes, "block_bytes": block_bytes},
        ]
        for r in raws
    ]
    assert [layer["planes"] for layer in lay["layers"]] == expect
    assert lay["head_major"] == (heads == 1)
    for i, raw in enumerate(raws):
        check_bytes(raw, caches[name(i)], ROCM, expect[i], lay["head_major"], heads)
    check_token_order(raws[0], caches[name(0)], ROCM, lay)


@pytest.mark.parametrize("total,head_size", GEOMETRIES)
@pytest.mark.parametrize("tp", TPS)
def test_kv_inside_block_one_plane(total: int, head_size: int, tp: tuple[int, int], accepts: Accepts) -> None:
    """hpc_attn's [nb, 2, N, H, D]: K and V of a block adjacent, one plane."""
    heads = total // tp[1]
    raws, caches = llama(HPC, "NHD", heads, head_size)
    lay = layout(caches, heads, total, tp, accepts)
    block_bytes = 2 * BS * heads * head_size * ES
    expect = [[{"base": r.data_ptr(), "block_stride": block_bytes, "block_bytes": block_bytes}] for r in raws]
    assert [layer["planes"] for layer in lay["layers"]] == expect
    assert lay["head_major"] == (heads == 1)
    for i, raw in enumerate(raws):
        check_bytes(raw, caches[name(i)], HPC, expect[i], lay["head_major"], heads)
    assert lay["token_order"]["parts"][0]["rows"] == 2  # K's row, then V's
    check_token_order(raws[0], caches[name(0)], HPC, lay)


def test_kv_dim_outside_heads_is_one_plane(accepts: Accepts) -> None:
    """[nb, 2, H, N, D] in memory: one plane (K and V planes would interleave,
    which the runtime refuses), not head-major (K/V is outermost)."""
    heads, d = 4, 64
    raw = torch.zeros(NB * 2 * heads * BS * d * ES, dtype=torch.int8)
    t = raw.view(DT).view(NB, 2, heads, BS, d).permute(0, 1, 3, 2, 4)  # logical (nb, 2, N, H, D)
    lay, _ = kv_layout_of({name(0): t}, NB, heads, heads, BS, 0, 1)
    block_bytes = 2 * heads * BS * d * ES
    plane = {"base": raw.data_ptr(), "block_stride": block_bytes, "block_bytes": block_bytes}
    assert lay["layers"][0]["planes"] == [plane]
    assert not lay["head_major"]
    accepts(lay)
    check_bytes(raw, t, HPC, lay["layers"][0]["planes"], False, heads)
    check_token_order(raw, t, HPC, lay)


def test_hybrid_restrided_kv_first_is_one_plane(accepts: Accepts) -> None:
    """[2, nb, N, H, D] restrided so K and V of a block are adjacent (vLLM's
    `_update_hybrid_attention_layout` for hybrid models): one plane."""
    heads, d = 2, 64
    hidden = BS * heads * d
    raw = torch.zeros(NB * 2 * hidden * ES, dtype=torch.int8)
    t = torch.as_strided(raw.view(DT), (2, NB, BS, heads, d), (hidden, 2 * hidden, heads * d, d, 1))
    lay, _ = kv_layout_of({name(0): t}, NB, heads, heads, BS, 0, 1)
    assert lay["layers"][0]["planes"] == [
        {"base": raw.data_ptr(), "block_stride": 2 * hidden * ES, "block_bytes": 2 * hidden * ES}
    ]
    assert not lay["head_major"]
    accepts(lay)
    check_bytes(raw, t, ROCM, lay["layers"][0]["planes"], False, heads)
    check_token_order(raw, t, ROCM, lay)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_cross_layer_packed_blocks(kv_layout: str, accepts: Accepts) -> None:
    """Per-block packing of all layers in one backing (vLLM's packed KV cache
    config: DeepSeek-V4, or `enable_cross_layers_blocks` with several KV cache
    groups): block stride = all layers' pages. The planes are right, but the
    runtime refuses layers whose address spans interleave (src/layout.rs
    `validate`), so vLLM stops at start-up with a GeometryError."""
    heads, d = 2, 64
    shape = PACKED.shape(heads, d, NB)
    page = prod(shape[1:]) * ES
    stride = LAYERS * page
    raw = torch.zeros(NB * stride, dtype=torch.int8)
    order = PACKED.order[kv_layout]
    caches = {name(i): vllm_view(raw, shape, order, packing=(i * page, stride)) for i in range(LAYERS)}
    lay, _ = kv_layout_of(caches, NB, heads, heads, BS, 0, 1)
    with pytest.raises(orbitkv.GeometryError, match="overlaps"):
        accepts(lay)
    expect = [[{"base": raw.data_ptr() + i * page, "block_stride": stride, "block_bytes": page}] for i in range(LAYERS)]
    assert [layer["planes"] for layer in lay["layers"]] == expect
    assert lay["head_major"] == (kv_layout == "HND")
    for i in range(LAYERS):
        check_bytes(raw, caches[name(i)], PACKED, expect[i], lay["head_major"], heads)


def padded_layer(heads: int = 2, d: int = 64, pad: int = 512) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """One layer of pages padded past the block by ``pad`` elements (vLLM's
    `page_size_padded`): its raw allocation, vLLM's view, the layout."""
    shape = PACKED.shape(heads, d, NB)
    raw = torch.zeros(NB * (prod(shape[1:]) + pad) * ES, dtype=torch.int8)
    t = vllm_view(raw, shape, NHD, page_elems=prod(shape[1:]) + pad)
    lay, _ = kv_layout_of({name(0): t}, NB, heads, heads, BS, 0, 1)
    return raw, t, lay


def test_padded_pages(accepts: Accepts) -> None:
    """Pages padded past the block (vLLM's `page_size_padded`)."""
    heads, d, pad = 2, 64, 512
    shape = PACKED.shape(heads, d, NB)
    page_elems = prod(shape[1:]) + pad
    raw, t, lay = padded_layer(heads, d, pad)
    planes = lay["layers"][0]["planes"]
    assert planes == [{"base": raw.data_ptr(), "block_stride": page_elems * ES, "block_bytes": prod(shape[1:]) * ES}]
    accepts(lay)
    check_bytes(raw, t, PACKED, planes, False, heads)
    check_token_order(raw, t, PACKED, lay)


@pytest.mark.parametrize("total,head_size", GEOMETRIES)
@pytest.mark.parametrize("tp", TPS)
def test_cpu_layout_unchanged(total: int, head_size: int, tp: tuple[int, int], accepts: Accepts) -> None:
    """vLLM's CPU layout gives what the contiguity-based code gave, and the
    CPU kernels' token order where the worker found it (``cpu_parts``)."""
    heads = total // tp[1]
    raws, caches = llama(CPU, "HND", heads, head_size)
    assert all(t.is_contiguous() for t in caches.values())
    parts = [{"rows": head_size, "token_bytes": ES}, {"rows": 1, "token_bytes": head_size * ES}]
    lay, _ = kv_layout_of(caches, NB, heads, total, BS, tp[0], tp[1], cpu=True, cpu_parts=parts)
    accepts(lay)
    assert lay.pop("token_order") == {"units": heads, "parts": parts}
    unknown, _ = kv_layout_of(caches, NB, heads, total, BS, tp[0], tp[1], cpu=True, cpu_parts=None)
    assert "token_order" not in unknown
    block_bytes = heads * BS * 2 * head_size * ES
    assert lay == {
        "num_blocks": NB,
        "block_size": BS,
        "total_kv_heads": total,
        "tp_rank": tp[0],
        "tp_size": tp[1],
        "head_major": True,
        "layers": [
            {"planes": [{"base": r.data_ptr(), "block_stride": block_bytes, "block_bytes": block_bytes}]} for r in raws
        ],
    }


@pytest.mark.parametrize("dtype,block_size,head_size", [(torch.float32, 32, 64), (torch.bfloat16, 16, 64), (torch.float32, 128, 80)])
def test_cpu_kernel_parts_are_the_kernels_own(dtype: torch.dtype, block_size: int, head_size: int) -> None:
    """vLLM's CPU kernels (``vec`` and ``vec16``) keep a head's K
    transposed, then its V: found by writing through the kernel itself."""
    es = torch.empty((), dtype=dtype).element_size()
    assert cpu_kernel_parts(dtype, block_size, head_size) == [
        {"rows": head_size, "token_bytes": es},
        {"rows": 1, "token_bytes": head_size * es},
    ]


def test_cpu_kernel_parts_refuse_a_kernel_that_keeps_tokens_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that keeps K untransposed (another vLLM, another ISA) is not
    taken for the known order: no token order, so a peer of another block
    size is refused rather than written wrongly."""
    import vllm._custom_ops as ops

    def untransposed(key, value, kc, vc, slots, isa, **_):  # type: ignore[no-untyped-def]
        bs = kc.shape[2]
        for i, s in enumerate(slots.tolist()):
            kc[s // bs, :, s % bs] = key[i]
            vc[s // bs, :, s % bs] = value[i]

    monkeypatch.setattr(ops, "cpu_attn_reshape_and_cache", untransposed)
    assert cpu_kernel_parts(torch.float32, 32, 64) is None

    def broken(*_, **__):  # type: ignore[no-untyped-def]
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(ops, "cpu_attn_reshape_and_cache", broken)
    assert cpu_kernel_parts(torch.float32, 32, 64) is None


def test_recurrent_state_pages_share_the_attention_pages(accepts: Accepts) -> None:
    """vLLM 0.32's hybrid of Mamba / linear attention and attention: one
    backing, each group's layer on the same pages from byte 0; a state
    layer's tensor is ``[blocks, 1, 1, state_bytes]`` int8 at the page
    stride, the state at the page's start and padding after it. Its plane is
    the state only, on the attention plane's pages, in another group."""
    heads, d, state_bytes = 2, 64, 3000
    page = heads * BS * 2 * d * ES
    raw = torch.zeros(NB * page, dtype=torch.int8)
    attn = raw.view(DT).view(NB, heads, BS, 2 * d)
    state = torch.as_strided(raw, (NB, 1, 1, state_bytes), (page, state_bytes, state_bytes, 1))
    caches = {name(0): state, name(1): attn}
    lay, _ = kv_layout_of(
        caches, NB, heads, heads, BS, 0, 1, layer_group={name(0): 0, name(1): 1}, state_layers=frozenset({name(0)})
    )
    accepts(lay)
    base = raw.data_ptr()
    assert lay["layers"][0] == {"planes": [{"base": base, "block_stride": page, "block_bytes": state_bytes}]}
    assert lay["layers"][1] == {"planes": [{"base": base, "block_stride": page, "block_bytes": page}], "group": 1}
    assert not lay["head_major"] and "token_order" not in lay
    # The same two layers in one group overlap: refused by the runtime.
    same, _ = kv_layout_of(caches, NB, heads, heads, BS, 0, 1, state_layers=frozenset({name(0)}))
    with pytest.raises(orbitkv.GeometryError, match="overlaps"):
        accepts(same)
    # A state tensor whose blocks are not dense states: refused by name.
    holes = torch.as_strided(raw, (NB, 1, 1, state_bytes), (page, state_bytes, state_bytes, 2))
    with pytest.raises(ValueError, match="one dense state of a request a block"):
        kv_layout_of({name(0): holes}, NB, heads, heads, BS, 0, 1, state_layers=frozenset({name(0)}))


# ---- layouts that cannot be served -------------------------------------------


def unservable() -> dict[str, torch.Tensor]:
    heads, d = 2, 64
    return {
        # each token of a block in another place: N separate ranges
        "interleaved": torch.zeros(BS, NB, heads, 2 * d, dtype=DT).permute(1, 2, 0, 3),
        # each head of a block in another place: two ranges
        "split": torch.zeros(heads, NB, BS, 2 * d, dtype=DT).permute(1, 0, 2, 3),
        # padding after each token row
        "padded": torch.zeros(NB, heads, BS, 2 * d + 8, dtype=DT)[..., : 2 * d],
        # K and V of a block apart inside it: one plane is not dense, K and V
        # planes would interleave
        "kv_gap": torch.zeros(NB, 3, BS, heads, d, dtype=DT)[:, ::2],
    }


@pytest.mark.parametrize("case", ["interleaved", "split", "padded", "kv_gap"])
def test_unservable_layout_names_the_fix(case: str) -> None:
    t = unservable()[case]
    with pytest.raises(ValueError) as e:
        kv_layout_of({name(0): t}, NB, 2, 2, BS, 0, 1)
    msg = str(e.value)
    assert name(0) in msg and str(tuple(t.shape)) in msg and str(tuple(t.stride())) in msg
    assert "VLLM_KV_CACHE_LAYOUT=HND" in msg and "--attention-backend" in msg


def test_split_kernel_blocks_rejected() -> None:
    """A kernel block smaller than vLLM's block (e.g. FlashInfer's 64 under
    block size 128) would map block ids onto the wrong memory."""
    t = torch.zeros(NB, 2, BS, 128, dtype=DT)
    with pytest.raises(ValueError, match="tokens per block"):
        kv_layout_of({name(0): t}, NB, 2, 2, 2 * BS, 0, 1)


def test_no_block_dimension() -> None:
    t = torch.zeros(NB + 1, 2, BS, 128, dtype=DT)
    with pytest.raises(ValueError, match="block dimension"):
        kv_layout_of({name(0): t}, NB, 2, 2, BS, 0, 1)


# ---- against vLLM itself -------------------------------------------------------


@pytest.fixture
def kv_cache_layout() -> Any:
    """vLLM's layout override, reset afterwards."""
    utils = pytest.importorskip("vllm.v1.attention.backends.utils")
    yield utils.set_kv_cache_layout
    utils.set_kv_cache_layout(None)


@pytest.mark.parametrize(
    "module,cls",
    [
        ("flash_attn", "FlashAttentionBackend"),
        ("flashinfer", "FlashInferBackend"),
        ("triton_attn", "TritonAttentionBackend"),
        ("cpu_attn", "CPUAttentionBackend"),
    ],
)
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_views_match_vllm(module: str, cls: str, kv_layout: str, kv_cache_layout: Any) -> None:
    """The views above are those vLLM's own backend and runner code makes
    (skipped where the backend does not import on this machine, e.g.
    FlashInfer without the flashinfer package)."""
    try:
        backend = getattr(__import__(f"vllm.v1.attention.backends.{module}", fromlist=[cls]), cls)
    except ImportError as e:
        pytest.skip(f"{cls}: {e}")
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    kv_cache_layout(kv_layout)
    heads, d = 8, 128
    shape = backend.get_kv_cache_shape(NB, BS, heads, d)
    try:
        order = backend.get_kv_cache_stride_order()
    except (AttributeError, NotImplementedError):
        order = tuple(range(len(shape)))
    be = CPU if module == "cpu_attn" else PACKED
    assert shape == be.shape(heads, d, NB)
    assert order == be.order.get(kv_layout, HND)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=d, dtype=DT)
    raw = torch.zeros(NB * spec.page_size_bytes, dtype=torch.int8)
    theirs = _reshape_attention_kv_cache(raw, spec, shape, order, NB, None)
    ours = vllm_view(raw, shape, order)
    assert (theirs.shape, theirs.stride(), theirs.data_ptr()) == (ours.shape, ours.stride(), ours.data_ptr())


# ---- the layout PdConnector asks for -----------------------------------------------


def test_required_kvcache_layout(kv_cache_layout: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config import KVTransferConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    from orbitkv.vllm.pd import PdConnector

    def params(f: Any) -> list[tuple[str, Any]]:
        return [(p.name, p.kind) for p in inspect.signature(f).parameters.values()]

    assert params(PdConnector.get_required_kvcache_layout) == params(KVConnectorBase_V1.get_required_kvcache_layout)
    gqa = SimpleNamespace(model_config=SimpleNamespace(use_mla=False))
    assert PdConnector.get_required_kvcache_layout(gqa) == "HND"  # type: ignore[arg-type]
    mla = SimpleNamespace(model_config=SimpleNamespace(use_mla=True))
    assert PdConnector.get_required_kvcache_layout(mla) is None  # type: ignore[arg-type]
    assert PdConnector.get_required_kvcache_layout(SimpleNamespace(model_config=None)) is None  # type: ignore[arg-type]

    # vLLM picks it up through kv_connector_module_path, unless the
    # environment says otherwise.
    gqa.kv_transfer_config = KVTransferConfig(
        kv_connector="PdConnector", kv_connector_module_path="orbitkv.vllm.pd", kv_role="kv_both"
    )
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    with set_current_vllm_config(gqa):  # type: ignore[arg-type]
        kv_cache_layout(None)
        assert get_kv_cache_layout() == "HND"
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "NHD")
        kv_cache_layout(None)
        assert get_kv_cache_layout() == "NHD"
