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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

_WIDE = (torch.int64, torch.int32, torch.int16, torch.uint8)


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
        self.device = self._storages[0][3] if self._storages else torch.device("cpu")
        self._planes = [[self._plane_view(p) for p in layer["planes"]] for layer in layout["layers"]]

    def _words(self, addr: int, nbytes: int) -> torch.Tensor:
        """A 1-D view of ``nbytes`` at ``addr`` in ``self.dtype`` elements."""
        es = _size(self.dtype)
        for base, size, st, dev in self._storages:
            if base <= addr and addr + nbytes <= base + size:
                if (addr - base) % es or nbytes % es:
                    raise ValueError(f"{nbytes} bytes at {addr:#x} are not {es}-byte aligned")
                t = torch.empty(0, dtype=self.dtype, device=dev)
                return t.set_(st, (addr - base) // es, (nbytes // es,), (1,))
        raise ValueError(f"{nbytes} bytes at {addr:#x} are in no registered tensor")

    def _plane_view(self, p: dict[str, int]) -> torch.Tensor:
        """Plane ``p`` as ``(num_blocks, units, unit elements)``."""
        es = _size(self.dtype)
        n = self.layout["num_blocks"]
        ub = p["block_bytes"] // self.units
        span = (n - 1) * p["block_stride"] + p["block_bytes"]
        flat = self._words(p["base"], span)
        return flat.as_strided((n, self.units, ub // es), (p["block_stride"] // es, ub // es, 1))

    def _staged(self, base: int, offset: int, unit_bytes: int, capacity: int) -> torch.Tensor:
        """The staged (layer, plane) at ``base + offset`` as ``(units, capacity, unit elements)``."""
        es = _size(self.dtype)
        flat = self._words(base + offset, self.units * capacity * unit_bytes)
        return flat.view(self.units, capacity, unit_bytes // es)

    def index(self, blocks: Sequence[int]) -> torch.Tensor:
        """Block IDs as an index tensor on this rank's device."""
        return torch.tensor(list(blocks), dtype=torch.long).to(self.device, non_blocking=True)

    def gather(
        self,
        layer: int,
        src_blocks: torch.Tensor,
        start: int,
        base: int,
        capacity: int,
        slots: Sequence[Sequence[Sequence[int]]],
    ) -> None:
        """Copies request blocks ``start .. start + len(src_blocks)`` of
        ``layer`` (their block IDs in ``src_blocks``) into the source staging
        at ``base`` of ``capacity`` blocks (``slots``: ``staged_layout``'s)."""
        end = start + src_blocks.numel()
        if end > capacity:
            raise ValueError(f"request blocks up to {end} do not fit a staging of {capacity}")
        for p, view in enumerate(self._planes[layer]):
            off, ub = slots[layer][p]
            dst = self._staged(base, off, ub, capacity)[:, start:end]
            dst.copy_(view.index_select(0, src_blocks).transpose(0, 1))

    def scatter(
        self,
        dst_blocks: torch.Tensor,
        base: int,
        units: Sequence[tuple[int, int]],
        slots: Sequence[Sequence[Sequence[int]]],
    ) -> None:
        """Copies ``units`` of every authorized block from the staging grant
        at ``base`` (``len(dst_blocks)`` blocks, ``slots`` for that many) into
        the pages ``dst_blocks``, every layer and plane."""
        n = dst_blocks.numel()
        for layer, planes in enumerate(self._planes):
            for p, view in enumerate(planes):
                off, ub = slots[layer][p]
                src = self._staged(base, off, ub, n)
                for a, b in units:
                    view[:, a:b].index_copy_(0, dst_blocks, src[a:b].transpose(0, 1))


def _size(dtype: torch.dtype) -> int:
    return int(torch.empty(0, dtype=dtype).element_size())
