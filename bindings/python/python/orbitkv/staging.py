"""The device copies of staging (``src/staging``): gather a request's blocks
into source staging on prefill, scatter a staging grant into the pages on
decode. The runtime plans and checks every remote write; this module only
copies inside one rank's own memory, with torch (kernels on the current CUDA
stream on a GPU, memcpy on CPU).

Staged order (the core's ``staging`` module, read through
``Runtime.staged_layout``): unit ``u`` of request block ``i`` of
(layer ``l``, plane ``p``) is at ``offset(l, p) + (u * capacity + i) *
unit_bytes(l, p)``; a unit is one KV head of a head-major layout, else the
whole block.

How a layer is copied: every plane of the layer (K and V) is seen as rows of
``r`` bytes, ``r`` the largest size that divides every unit, block stride and
plane offset of the layer (one unit is usually one row), so that the layer's
whole gather (or scatter) is one ``index_select`` into a temporary and one
``index_copy_`` out of it: two kernels a layer, whatever the number of
planes, heads and blocks. The row indices depend on the blocks, not on the
layer: they are computed on the host (numpy) once per `BlockIndex` and
shape, and copied to the device once, so a step's gathers of every layer, or
a request's scatter, share them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_WIDE = (torch.int64, torch.int32, torch.int16, torch.uint8)


@dataclass(frozen=True)
class _LayerRows:
    """One layer's planes as rows of ``row`` bytes, anchored at the lowest
    plane base ``anchor``: plane ``p`` starts ``rel[p]`` rows in, has a block
    stride of ``stride[p]`` rows and units of ``unit[p]`` rows."""

    anchor: int
    span: int
    row: int
    rel: tuple[int, ...]
    stride: tuple[int, ...]
    unit: tuple[int, ...]


class BlockIndex:
    """The block IDs of one gather (one step of one request) or one scatter,
    with the row indices computed for them (by what and shape)."""

    def __init__(self, blocks: Sequence[int], device: torch.device) -> None:
        self.ids = np.asarray(list(blocks), dtype=np.int64)
        self.device = device
        self.rows: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.ids)


class StagingCopier:
    """Gathers and scatters one rank's KV blocks, given its OrbitKV layout
    (the dict ``kv_layout_of`` builds) and the tensors whose storage holds
    the KV planes and the staging memory."""

    def __init__(self, layout: dict[str, Any], units: int, tensors: Iterable[torch.Tensor]):
        self.layout = layout
        self.units = units
        self._storages: list[tuple[int, int, Any, torch.device]] = []
        seen: set[int] = set()
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            self._storages.append((st.data_ptr(), st.nbytes(), st, t.device))
        planes = [p for layer in layout["layers"] for p in layer["planes"]]
        numbers = [p["base"] for p in planes] + [p["block_stride"] for p in planes]
        numbers += [p["block_bytes"] // max(units, 1) for p in planes]
        self.dtype = next(d for d in _WIDE if all(n % _size(d) == 0 for n in numbers))
        self._es = _size(self.dtype)
        self.device = self._storages[0][3] if self._storages else torch.device("cpu")
        n = layout["num_blocks"]
        self._layers = [self._layer_rows(layer["planes"], n) for layer in layout["layers"]]
        self._kv = [self._rows(g.anchor, g.span, g.row) for g in self._layers]

    def _layer_rows(self, planes: Sequence[dict[str, int]], num_blocks: int) -> _LayerRows:
        anchor = min(p["base"] for p in planes)
        end = max(p["base"] + (num_blocks - 1) * p["block_stride"] + p["block_bytes"] for p in planes)
        ubs = [p["block_bytes"] // self.units for p in planes]
        row = 0
        for p, ub in zip(planes, ubs):
            # Staged offsets are sums of units * capacity * unit bytes, so a
            # row that divides every unit divides them too.
            row = math.gcd(row, ub, p["block_stride"], p["base"] - anchor)
        return _LayerRows(
            anchor=anchor,
            span=end - anchor,
            row=row,
            rel=tuple((p["base"] - anchor) // row for p in planes),
            stride=tuple(p["block_stride"] // row for p in planes),
            unit=tuple(ub // row for ub in ubs),
        )

    def _words(self, addr: int, nbytes: int) -> torch.Tensor:
        """A 1-D view of ``nbytes`` at ``addr`` in ``self.dtype`` elements."""
        es = self._es
        for base, size, st, dev in self._storages:
            if base <= addr and addr + nbytes <= base + size:
                if (addr - base) % es or nbytes % es:
                    raise ValueError(f"{nbytes} bytes at {addr:#x} are not {es}-byte aligned")
                t = torch.empty(0, dtype=self.dtype, device=dev)
                return t.set_(st, (addr - base) // es, (nbytes // es,), (1,))
        raise ValueError(f"{nbytes} bytes at {addr:#x} are in no registered tensor")

    def _rows(self, addr: int, nbytes: int, row: int) -> torch.Tensor:
        """``nbytes`` at ``addr`` (a whole number of rows) as ``(rows, row bytes)``."""
        if nbytes % row:
            raise ValueError(f"{nbytes} bytes at {addr:#x} are not whole {row}-byte rows")
        return self._words(addr, nbytes).view(-1, row // self._es)

    def index(self, blocks: Sequence[int]) -> BlockIndex:
        """Block IDs, for `gather` (the source blocks of one step of one
        request: make it once per step, use it for every layer) or `scatter`."""
        return BlockIndex(blocks, self.device)

    def _staged_rows(self, g: _LayerRows, slots: Sequence[Sequence[int]], capacity: int) -> tuple[int, tuple[int, ...]]:
        """Where a layer's staged planes start (bytes from the staging base,
        the lowest one) and each plane's start in rows from there."""
        first = min(off for off, _ in slots)
        for off, ub in slots:
            if ub % g.row or (off - first) % g.row:
                raise ValueError(f"staged plane at {off} ({ub}-byte units) is not in {g.row}-byte rows")
        return first, tuple((off - first) // g.row for off, _ in slots)

    def _pair(
        self,
        what: str,
        g: _LayerRows,
        staged: tuple[int, ...],
        blocks: BlockIndex,
        start: int,
        capacity: int,
        units: Sequence[tuple[int, int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row indices of the pages (``blocks``) and of the staging (request
        blocks ``start ..``, ``capacity`` per unit) for the ``units`` ranges
        of every plane, in one order, on the device: (page rows, staged rows)."""
        key = (what, g.rel, g.stride, g.unit, staged, start, capacity, tuple(units))
        hit = blocks.rows.get(key)
        if hit is not None:
            return hit
        m = len(blocks)
        pages, stage = [], []
        i = np.arange(m, dtype=np.int64).reshape(1, m, 1)
        b = blocks.ids.reshape(1, m, 1)
        for rel, stride, unit, srel in zip(g.rel, g.stride, g.unit, staged):
            j = np.arange(unit, dtype=np.int64).reshape(1, 1, unit)
            for a, z in units:
                u = np.arange(a, z, dtype=np.int64).reshape(-1, 1, 1)
                pages.append((rel + b * stride + u * unit + j).reshape(-1))
                stage.append((srel + (u * capacity + start + i) * unit + j).reshape(-1))
        both = torch.from_numpy(np.stack([np.concatenate(pages), np.concatenate(stage)])).to(blocks.device)
        out = (both[0], both[1])
        blocks.rows[key] = out
        return out

    def gather(
        self,
        layer: int,
        src_blocks: BlockIndex,
        start: int,
        base: int,
        capacity: int,
        slots: Sequence[Sequence[Sequence[int]]],
    ) -> None:
        """Copies request blocks ``start .. start + len(src_blocks)`` of
        ``layer`` (their block IDs in ``src_blocks``) into the source staging
        at ``base`` of ``capacity`` blocks (``slots``: ``staged_layout``'s)."""
        end = start + len(src_blocks)
        if end > capacity:
            raise ValueError(f"request blocks up to {end} do not fit a staging of {capacity}")
        g = self._layers[layer]
        first, staged = self._staged_rows(g, slots[layer], capacity)
        page_rows, stage_rows = self._pair("gather", g, staged, src_blocks, start, capacity, [(0, self.units)])
        span = sum(self.units * capacity * ub for _, ub in slots[layer])
        dst = self._rows(base + first, span, g.row)
        dst.index_copy_(0, stage_rows, self._kv[layer].index_select(0, page_rows))

    def scatter(
        self,
        dst_blocks: BlockIndex,
        base: int,
        units: Sequence[tuple[int, int]],
        slots: Sequence[Sequence[Sequence[int]]],
    ) -> None:
        """Copies ``units`` of every authorized block from the staging grant
        at ``base`` (``len(dst_blocks)`` blocks, ``slots`` for that many) into
        the pages ``dst_blocks``, every layer and plane."""
        n = len(dst_blocks)
        if not units or n == 0:
            return
        for layer, g in enumerate(self._layers):
            first, staged = self._staged_rows(g, slots[layer], n)
            page_rows, stage_rows = self._pair("scatter", g, staged, dst_blocks, 0, n, units)
            span = sum(self.units * n * ub for _, ub in slots[layer])
            src = self._rows(base + first, span, g.row)
            self._kv[layer].index_copy_(0, page_rows, src.index_select(0, stage_rows))


def _size(dtype: torch.dtype) -> int:
    return int(torch.empty(0, dtype=dtype).element_size())
