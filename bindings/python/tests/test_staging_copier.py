"""`orbitkv.staging.StagingCopier` against the staged order written out byte
by byte (`orbitkv/staging.py`'s docstring), on CPU tensors of the KV shapes
vLLM uses on GPU: K and V as two planes of one `[2, blocks, ...]` tensor
(FlashAttention), K and V interleaved per block (`[blocks, 2, ...]`,
FlashInfer's HND), token-major blocks (one unit), a single plane (MLA), and
head slices (a TP head range). Every byte outside what a call names must stay
as it was."""

from __future__ import annotations

import ctypes
import random
from typing import Any

import pytest
import torch

from orbitkv.staging import StagingCopier

BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 12, 4, 4, 8, 3


def planes_of(t: torch.Tensor, kind: str) -> list[dict[str, int]]:
    es = t.element_size()
    if kind == "flash":  # [2, blocks, heads, block_size, head_dim]
        return [
            {"base": t[kv].data_ptr(), "block_stride": t.stride(1) * es, "block_bytes": t[kv][0].numel() * es}
            for kv in (0, 1)
        ]
    if kind == "flashinfer":  # [blocks, 2, heads, block_size, head_dim]
        return [
            {"base": t[:, kv].data_ptr(), "block_stride": t.stride(0) * es, "block_bytes": t[0, kv].numel() * es}
            for kv in (0, 1)
        ]
    # "mla": [blocks, block_size, dim], one plane
    return [{"base": t.data_ptr(), "block_stride": t.stride(0) * es, "block_bytes": t[0].numel() * es}]


SHAPES = {
    "flash": (2, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM),
    "flashinfer": (BLOCKS, 2, HEADS, BLOCK_SIZE, HEAD_DIM),
    "mla": (BLOCKS, BLOCK_SIZE, 24),
}


class Side:
    """One rank's KV tensors (random bytes) and a staging tensor (guard bytes)."""

    def __init__(self, kind: str, units: int, dtype: torch.dtype, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv = [
            torch.randint(0, 255, SHAPES[kind], generator=g, dtype=torch.uint8).view(dtype) for _ in range(LAYERS)
        ]
        self.stage = torch.full((1 << 16,), 0xA5, dtype=torch.uint8)
        self.units = units
        self.layout: dict[str, Any] = {
            "num_blocks": BLOCKS,
            "layers": [{"planes": planes_of(t, kind)} for t in self.kv],
        }
        self.copier = StagingCopier(self.layout, units, [*self.kv, self.stage])

    def slots(self, capacity: int) -> list[list[list[int]]]:
        """The staged layout: planes one after another, layer by layer."""
        out, off = [], 0
        for layer in self.layout["layers"]:
            row = []
            for p in layer["planes"]:
                ub = p["block_bytes"] // self.units
                row.append([off, ub])
                off += self.units * capacity * ub
            out.append(row)
        return out

    def page(self, layer: int, plane: int, block: int, unit: int) -> bytes:
        p = self.layout["layers"][layer]["planes"][plane]
        ub = p["block_bytes"] // self.units
        return read(p["base"] + block * p["block_stride"] + unit * ub, ub)


def read(addr: int, n: int) -> bytes:
    return ctypes.string_at(addr, n)


def snapshot(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


CASES = [("flash", HEADS, torch.float16), ("flash", 1, torch.float32), ("flashinfer", HEADS, torch.bfloat16),
         ("flashinfer", 2, torch.float16), ("mla", 1, torch.float16)]


@pytest.mark.parametrize(("kind", "units", "dtype"), CASES)
def test_gather_writes_the_staged_order_and_nothing_else(kind: str, units: int, dtype: torch.dtype) -> None:
    s = Side(kind, units, dtype, 1)
    rng = random.Random(7)
    capacity, start = 9, 3
    blocks = rng.sample(range(BLOCKS), 5)
    slots = s.slots(capacity)
    base = s.stage.data_ptr() + 256
    kv_before = [snapshot(t) for t in s.kv]
    for layer in range(LAYERS):
        s.copier.gather(layer, s.copier.index(blocks), start, base, capacity, slots)
    # every byte not staged keeps its guard
    expect = bytearray([0xA5]) * s.stage.numel()
    for layer in range(LAYERS):
        for p, (off, ub) in enumerate(slots[layer]):
            for u in range(units):
                for i, b in enumerate(blocks):
                    at = 256 + off + (u * capacity + start + i) * ub
                    expect[at : at + ub] = s.page(layer, p, b, u)
    assert snapshot(s.stage) == bytes(expect)
    assert [snapshot(t) for t in s.kv] == kv_before, "a gather changed the pages"


@pytest.mark.parametrize(("kind", "units", "dtype"), CASES)
def test_scatter_writes_the_named_units_of_the_named_blocks_only(kind: str, units: int, dtype: torch.dtype) -> None:
    p, c = Side(kind, units, dtype, 1), Side(kind, units, dtype, 2)
    src, dst = [4, 0, 7, 11], [2, 9, 5, 6]
    n = len(src)
    slots = p.slots(n)
    base_p, base_c = p.stage.data_ptr() + 512, c.stage.data_ptr() + 512
    for layer in range(LAYERS):
        p.copier.gather(layer, p.copier.index(src), 0, base_p, n, slots)
    # the staged bytes as Mooncake would have moved them
    c.stage.copy_(p.stage)
    ranges = [(0, units)] if units == 1 else [(0, 1), (units - 1, units)]
    before = {(k, q, b, u): c.page(k, q, b, u) for k in range(LAYERS) for q in range(len(slots[k]))
              for b in range(BLOCKS) for u in range(units)}
    c.copier.scatter(c.copier.index(dst), base_c, ranges, slots)
    named = {u for a, z in ranges for u in range(a, z)}
    for (layer, q, b, u), was in before.items():
        now = c.page(layer, q, b, u)
        if b in dst and u in named:
            assert now == p.page(layer, q, src[dst.index(b)], u), (layer, q, b, u)
        else:
            assert now == was, f"layer {layer} plane {q} block {b} unit {u} written without being named"


def test_one_request_per_blocks_tensor_and_memo_is_per_tensor() -> None:
    """Two requests gathered layer by layer in turn (two staged requests in
    one step) each get their own blocks' rows."""
    s = Side("flash", HEADS, torch.float16, 3)
    a, b = [1, 2, 3], [8, 5, 10]
    ia, ib = s.copier.index(a), s.copier.index(b)
    slots = s.slots(3)
    base_a, base_b = s.stage.data_ptr(), s.stage.data_ptr() + (1 << 15)
    for layer in range(LAYERS):
        s.copier.gather(layer, ia, 0, base_a, 3, slots)
        s.copier.gather(layer, ib, 0, base_b, 3, slots)
    for base, blocks in ((0, a), (1 << 15, b)):
        for layer in range(LAYERS):
            for q, (off, ub) in enumerate(slots[layer]):
                for u in range(HEADS):
                    for i, blk in enumerate(blocks):
                        at = base + off + (u * 3 + i) * ub
                        assert snapshot(s.stage)[at : at + ub] == s.page(layer, q, blk, u)


def test_a_gather_past_the_capacity_is_refused_before_any_copy() -> None:
    s = Side("flash", HEADS, torch.float16, 4)
    before = snapshot(s.stage)
    with pytest.raises(ValueError, match="do not fit"):
        s.copier.gather(0, s.copier.index([1, 2, 3]), 2, s.stage.data_ptr(), 4, s.slots(4))
    assert snapshot(s.stage) == before


def gapped(slots: list[list[list[int]]], gap: int) -> list[list[list[int]]]:
    """`slots` with `gap` more bytes before every layer after the first: the
    layers' staged copies no longer evenly spaced (the copier's per-layer
    views, not its one view of all layers)."""
    return [[[off + (gap * layer * (layer + 1)) // 2, ub] for off, ub in row] for layer, row in enumerate(slots)]


@pytest.mark.parametrize("gap", [0, 64])
def test_views_kept_per_region_follow_the_slots_given(gap: int) -> None:
    """A region's views are built once and kept; a call with other slots for
    the same base and capacity gets views of those slots, not the kept ones,
    and unevenly spaced layers are copied as exactly as evenly spaced ones."""
    s = Side("flashinfer", 2, torch.float16, 5)
    capacity, blocks = 4, [3, 1, 10, 6]
    base = s.stage.data_ptr() + 128
    for slots in (s.slots(capacity), gapped(s.slots(capacity), gap), gapped(s.slots(capacity), gap + 32)):
        s.stage.fill_(0xA5)
        idx = s.copier.index(blocks)
        for layer in range(LAYERS):
            s.copier.gather(layer, idx, 0, base, capacity, slots)
        expect = bytearray([0xA5]) * s.stage.numel()
        for layer in range(LAYERS):
            for p, (off, ub) in enumerate(slots[layer]):
                for u in range(2):
                    for i, b in enumerate(blocks):
                        at = 128 + off + (u * capacity + i) * ub
                        expect[at : at + ub] = s.page(layer, p, b, u)
        assert snapshot(s.stage) == bytes(expect), slots


def test_scatter_from_unevenly_spaced_layers_and_equal_slots_rebuilt() -> None:
    """Scatter out of a grant laid out with gaps between layers, given slots
    equal to (not the same object as) the ones of the gathers."""
    p, c = Side("flash", HEADS, torch.float32, 6), Side("flash", HEADS, torch.float32, 7)
    src, dst = [0, 5, 9], [11, 4, 2]
    slots = gapped(p.slots(3), 16)
    for layer in range(LAYERS):
        p.copier.gather(layer, p.copier.index(src), 0, p.stage.data_ptr(), 3, slots)
    c.stage.copy_(p.stage)
    c.copier.scatter(c.copier.index(dst), c.stage.data_ptr(), [(1, 3)], [[list(x) for x in row] for row in slots])
    for layer in range(LAYERS):
        for q in range(2):
            for i, b in enumerate(dst):
                for u in range(HEADS):
                    want = p.page(layer, q, src[i], u) if 1 <= u < 3 else None
                    if want is not None:
                        assert c.page(layer, q, b, u) == want, (layer, q, b, u)


def test_scatter_of_units_outside_a_block_is_refused_before_any_copy() -> None:
    s = Side("flash", HEADS, torch.float16, 8)
    before = [snapshot(t) for t in s.kv]
    with pytest.raises(ValueError, match="not within"):
        s.copier.scatter(s.copier.index([1, 2]), s.stage.data_ptr(), [(0, 1), (2, HEADS + 1)], s.slots(2))
    assert [snapshot(t) for t in s.kv] == before


def test_slots_of_another_number_of_layers_are_refused() -> None:
    s = Side("flash", HEADS, torch.float16, 9)
    with pytest.raises(ValueError, match="layers"):
        s.copier.gather(0, s.copier.index([1]), 0, s.stage.data_ptr(), 1, s.slots(1)[:-1])


GROUPED = [("flash", HEADS, 2, torch.float16), ("flash", HEADS, HEADS, torch.bfloat16),
           ("flashinfer", HEADS, 2, torch.float32), ("flashinfer", 2, 2, torch.float16)]


@pytest.mark.parametrize(("kind", "units", "group", "dtype"), GROUPED)
def test_grouped_gather_lays_each_group_out_block_by_block(kind: str, units: int, group: int,
                                                           dtype: torch.dtype) -> None:
    """Grouped by ``group`` units: unit ``u`` of block ``i`` at ``((u // G *
    capacity + i) * G + u % G) * unit_bytes`` (the layout a decode rank of
    ``G`` heads has in its pages), and nothing else written."""
    s = Side(kind, units, dtype, 3)
    capacity, start = 7, 2
    blocks = [9, 1, 4, 10, 0]
    slots = s.slots(capacity)
    base = s.stage.data_ptr() + 128
    for layer in range(LAYERS):
        s.copier.gather(layer, s.copier.index(blocks), start, base, capacity, slots, group)
    expect = bytearray([0xA5]) * s.stage.numel()
    for layer in range(LAYERS):
        for p, (off, ub) in enumerate(slots[layer]):
            for u in range(units):
                for i, b in enumerate(blocks):
                    at = 128 + off + ((u // group * capacity + start + i) * group + u % group) * ub
                    expect[at : at + ub] = s.page(layer, p, b, u)
    assert snapshot(s.stage) == bytes(expect)
    # one group of consecutive blocks is the decode rank's pages, in order
    off, ub = slots[0][0]
    g1 = 128 + off + ((units // group - 1) * capacity + start) * group * ub
    run = bytes(snapshot(s.stage)[g1 : g1 + len(blocks) * group * ub])
    want = b"".join(s.page(0, 0, b, u) for b in blocks for u in range(units - group, units))
    assert run == want


@pytest.mark.parametrize(("kind", "units", "group", "dtype"), GROUPED)
def test_grouped_scatter_copies_whole_groups_and_refuses_part_of_one(kind: str, units: int, group: int,
                                                                     dtype: torch.dtype) -> None:
    p, c = Side(kind, units, dtype, 4), Side(kind, units, dtype, 5)
    src, dst = [3, 8, 0, 6], [11, 2, 7, 5]
    n = len(src)
    slots = p.slots(n)
    base = p.stage.data_ptr() + 64
    for layer in range(LAYERS):
        p.copier.gather(layer, p.copier.index(src), 0, base, n, slots, group)
    c.stage.copy_(p.stage)
    before = [snapshot(t) for t in c.kv]
    with pytest.raises(ValueError, match="whole groups"):
        c.copier.scatter(c.copier.index(dst), c.stage.data_ptr() + 64, [(0, group), (1, 2)], slots, group)
    assert [snapshot(t) for t in c.kv] == before, "a refused scatter copied something"
    named = range(units - group, units)
    c.copier.scatter(c.copier.index(dst), c.stage.data_ptr() + 64, [(units - group, units)], slots, group)
    for layer in range(LAYERS):
        for q in range(len(slots[layer])):
            for b in range(BLOCKS):
                for u in range(units):
                    now = c.page(layer, q, b, u)
                    if b in dst and u in named:
                        assert now == p.page(layer, q, src[dst.index(b)], u), (layer, q, b, u)
                    else:  # outside the named units and blocks: as before
                        plane = c.layout["layers"][layer]["planes"][q]
                        ub = plane["block_bytes"] // units
                        at = plane["base"] + b * plane["block_stride"] + u * ub - c.kv[layer].data_ptr()
                        assert now == before[layer][at : at + ub], (layer, q, b, u)
    with pytest.raises(ValueError, match="grouped by 3"):
        c.copier.gather(0, c.copier.index(src), 0, c.stage.data_ptr(), n, slots, 3)


PIECES = [(*c[:2], 1, c[2]) for c in CASES] + GROUPED


@pytest.mark.parametrize(("kind", "units", "group", "dtype"), PIECES)
def test_a_layer_piece_holds_one_layer_of_one_chunk_and_nothing_else(kind: str, units: int, group: int,
                                                                     dtype: torch.dtype) -> None:
    """``gather_piece`` (staged by layer): the chunk's blocks, in the order
    given, at slots ``0..n`` of the layer's planes laid out one after the
    other for ``n`` blocks (``producer_stage_layer``'s slots), grouped by
    ``group`` units; every other byte keeps its guard, the pages are
    untouched, and one layer's piece never reaches another's."""
    s = Side(kind, units, dtype, 5)
    blocks = [10, 3, 7, 0, 5]
    n = len(blocks)
    kv_before = [snapshot(t) for t in s.kv]
    expect = bytearray([0xA5]) * s.stage.numel()
    at = 512
    for layer in range(LAYERS):
        planes = s.layout["layers"][layer]["planes"]
        slots, off = [], 0
        for p in planes:
            slots.append((off, p["block_bytes"] // units))
            off += p["block_bytes"] * n
        s.copier.gather_piece(layer, s.copier.index(blocks), s.stage.data_ptr() + at, slots, group)
        for p, (po, ub) in enumerate(slots):
            for u in range(units):
                for k, b in enumerate(blocks):
                    o = at + po + ((u // group * n + k) * group + u % group) * ub
                    expect[o : o + ub] = s.page(layer, p, b, u)
        at += off + 256  # the next layer's piece elsewhere, a gap between
    assert snapshot(s.stage) == bytes(expect)
    assert [snapshot(t) for t in s.kv] == kv_before, "a gather changed the pages"
    with pytest.raises(ValueError):
        s.copier.gather_piece(LAYERS, s.copier.index(blocks), s.stage.data_ptr(), slots, group)
    with pytest.raises(ValueError):
        # a piece past the registered memory
        s.copier.gather_piece(0, s.copier.index(blocks), s.stage.data_ptr() + s.stage.numel() - 8, slots, group)
