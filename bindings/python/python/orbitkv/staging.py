"""The device copies of staging (``src/staging``): gather a request's blocks
into source staging on prefill, scatter a staging grant into the pages on
decode. The runtime plans and checks every remote write; this module only
copies inside one rank's own memory, with torch (kernels on the current CUDA
stream on a GPU, memcpy on CPU).

Staged order (the core's ``staging`` module, read through
``Runtime.staged_layout``): unit ``u`` of request block ``i`` of
(layer ``l``, plane ``p``) is at ``offset(l, p) + (u * capacity + i) *
unit_bytes(l, p)``; a unit is one KV head of a head-major layout, else the
whole block. A staging may instead be *grouped* by ``G`` units (``group``;
1 is the order above): unit ``u`` of block ``i`` is then at ``offset(l, p) +
((u // G * capacity + i) * G + u % G) * unit_bytes(l, p)``, so that the
``G`` heads of one decode rank lie block by block as its pages do (written
straight into them, or scattered as whole blocks).

How a layer is copied: the planes of a layer (K and V) that share their
block stride and block size, at evenly spaced bases, are one strided view
``(planes, blocks, units, unit elements)``, and their staged copies another
``(planes, units, capacity, unit elements)``. A layer's gather is then one
``index_select`` over the blocks written straight into the staged view, and a
scatter one ``index_copy_`` per range of units: one kernel a layer, one pass
over the bytes, whatever the number of planes and heads. The block IDs go to
the device once per `BlockIndex` (one step of one request, or one scatter),
pinned and asynchronously.

Host time: the staged views of one staging region (a request's source
staging, a consumer's grant) are built once for every layer and kept (a
few, keyed by base and capacity), so a layer's gather is one slice and one
kernel launch, not a view built, checked and permuted per layer. When the
layers' staged copies are evenly spaced (every model whose layers are alike)
all layers' views are one ``as_strided`` of the region.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

_WIDE = (torch.int64, torch.int32, torch.int16, torch.uint8)


@dataclass(frozen=True)
class _Group:
    """Planes ``planes`` of a layer as one view ``(planes, blocks, units,
    unit elements)`` of the KV memory."""

    planes: tuple[int, ...]
    view: torch.Tensor


def _flat_units(v: torch.Tensor, group: int) -> torch.Tensor:
    """``(..., unit groups, group, unit elements)`` as ``(..., units, unit
    elements)`` when ``group`` is 1 (a view, no copy); else unchanged."""
    return v.select(-2, 0) if group == 1 else v


class _StagedRegion:
    """The staged views of one staging region (``base``, ``capacity``
    blocks, grouped by ``group`` units, laid out as ``slots`` says), for
    every layer: built once, checked once, used by every gather into it and
    every scatter out of it."""

    def __init__(self, slots: Sequence[Sequence[Sequence[int]]], group: int, staged: list[list[torch.Tensor]],
                 whole: list[torch.Tensor] | None) -> None:
        self.slots = slots
        self.group = group
        # staged[layer][plane group]: (planes, unit groups, group, capacity, unit elements)
        self.staged = staged
        # gather[layer][plane group]: the same as (planes, capacity, unit
        # groups, group, unit elements); with group 1 (planes, capacity,
        # units, unit elements)
        self.gather = [[_flat_units(v.permute(0, 3, 1, 2, 4), group) for v in row] for row in staged]
        # whole[plane group]: every layer's staged copy of it as one view
        # (layers, planes, unit groups, group, capacity, unit elements), when evenly spaced
        self.whole = whole
        # scatter sources per unit range: [layer][plane group], shaped as gather
        self.sources: dict[tuple[int, int], list[list[torch.Tensor]]] = {}

    def source(self, a: int, z: int) -> list[list[torch.Tensor]]:
        got = self.sources.get((a, z))
        if got is None:
            k = self.group
            if a % k or z % k:
                raise ValueError(f"units {a}..{z} are not whole groups of {k} in this staging")
            if self.whole is not None:
                per_group = [w[:, :, a // k : z // k].permute(0, 1, 4, 2, 3, 5).unbind(0) for w in self.whole]
                got = [[_flat_units(v, k) for v in row] for row in zip(*per_group)]
            else:
                got = [[_flat_units(v[:, a // k : z // k].permute(0, 3, 1, 2, 4), k) for v in row]
                       for row in self.staged]
            self.sources[(a, z)] = got
        return got


# Staging regions whose views a copier keeps (the source stagings of the
# requests in flight and recent grants); the oldest goes first.
_REGIONS_KEPT = 64


class BlockIndex:
    """The block IDs of one gather (one step of one request: make it once,
    use it for every layer) or one scatter, on the device."""

    def __init__(self, blocks: Sequence[int], device: torch.device) -> None:
        ids = torch.tensor(list(blocks), dtype=torch.long)
        if device.type == "cuda":
            # Pinned and asynchronous: a copy from pageable memory may make
            # the host wait for the kernels queued on the stream (vLLM's
            # forward). torch's pinned-memory allocator does not reuse the
            # block before the copy ran.
            ids = ids.pin_memory()
        self.tensor = ids.to(device, non_blocking=True)

    def __len__(self) -> int:
        return int(self.tensor.numel())


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
        # Each storage as one flat tensor of `dtype`, made once: every view of
        # the KV planes and of staging is one `as_strided` of these.
        self._flat = [
            (base, size - size % self._es, torch.empty(0, dtype=self.dtype, device=dev).set_(st, 0, (size // self._es,), (1,)))
            for base, size, st, dev in self._storages
        ]
        self.device = self._storages[0][3] if self._storages else torch.device("cpu")
        n = layout["num_blocks"]
        self._groups = [self._layer_groups(layer["planes"], n) for layer in layout["layers"]]
        self._regions: dict[tuple[int, int, int], _StagedRegion] = {}
        # KV views of a range of units, per (a, z, group): [layer][plane group]
        self._unit_views: dict[tuple[int, int, int], list[list[torch.Tensor]]] = {}
        # The first block the KV views hold (keep_out): 0, or past staging's.
        self._lo = 0

    def _layer_groups(self, planes: Sequence[dict[str, int]], num_blocks: int) -> list[_Group]:
        """All planes of the layer in one view when they share stride and
        size at evenly spaced bases (K and V always are), else one each."""
        order = sorted(range(len(planes)), key=lambda i: planes[i]["base"])
        first = planes[order[0]]
        delta = planes[order[1]]["base"] - first["base"] if len(order) > 1 else 0
        even = all(
            planes[i]["block_stride"] == first["block_stride"]
            and planes[i]["block_bytes"] == first["block_bytes"]
            and planes[i]["base"] == first["base"] + k * delta
            for k, i in enumerate(order)
        )
        parts = [order] if even else [[i] for i in order]
        return [self._group(tuple(part), [planes[i] for i in part], delta, num_blocks) for part in parts]

    def _group(self, which: tuple[int, ...], planes: list[dict[str, int]], delta: int, num_blocks: int) -> _Group:
        es, p0 = self._es, planes[0]
        ub = p0["block_bytes"] // self.units
        span = (len(planes) - 1) * delta + (num_blocks - 1) * p0["block_stride"] + p0["block_bytes"]
        shape = (len(planes), num_blocks, self.units, ub // es)
        view = self._view(p0["base"], span, shape, (delta // es, p0["block_stride"] // es, ub // es, 1))
        return _Group(which, view)

    def _view(self, addr: int, nbytes: int, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
        """The ``nbytes`` at ``addr`` (inside one registered tensor's storage)
        as a strided view of ``self.dtype`` elements."""
        es = self._es
        for base, total, flat in self._flat:
            if base <= addr and addr + nbytes <= base + total:
                if (addr - base) % es or nbytes % es:
                    raise ValueError(f"{nbytes} bytes at {addr:#x} are not {es}-byte aligned")
                return flat.as_strided(size, stride, (addr - base) // es)
        raise ValueError(f"{nbytes} bytes at {addr:#x} are in no registered tensor")

    def keep_out(self, below: int) -> None:
        """Blocks ``0 .. below`` are not a request's: they hold staging
        (the source staging taken out of vLLM's KV cache, whose IDs start
        after vLLM's null block 0). The KV views start at block ``below``
        from now on, so that torch, which refuses a copy between two views
        of one tensor whose memory spans overlap, sees a gather's source
        blocks and a piece in those blocks as the disjoint memory they are;
        :meth:`index` refuses a lower ID."""
        if not 0 <= below < self.layout["num_blocks"]:
            raise ValueError(f"blocks below {below} of a KV cache of {self.layout['num_blocks']}")
        self._lo = below
        self._unit_views.clear()

    def index(self, blocks: Sequence[int]) -> BlockIndex:
        """Block IDs, for `gather` (the source blocks of one step of one
        request: make it once per step, use it for every layer) or `scatter`."""
        lo = self._lo
        if lo:
            if any(b < lo for b in blocks):
                raise ValueError(f"block {min(blocks)} is below {lo}: staging, not a request's")
            blocks = [b - lo for b in blocks]
        return BlockIndex(blocks, self.device)

    def _staged_geometry(self, g: _Group, slots: Sequence[Sequence[int]]) -> tuple[int, int, int]:
        """Group ``g``'s staged planes in ``slots`` (one layer's): the first
        plane's offset, the planes' spacing and the unit bytes, checked
        against the layer's planes."""
        offs = [slots[p][0] for p in g.planes]
        ub = slots[g.planes[0]][1]
        delta = offs[1] - offs[0] if len(offs) > 1 else 0
        if ub != g.view.shape[3] * self._es or any(slots[p][1] != ub or off != offs[0] + k * delta
                                                    for k, (p, off) in enumerate(zip(g.planes, offs))):
            raise ValueError(f"staged planes {offs} ({ub}-byte units) do not match the layer's planes")
        return offs[0], delta, ub

    def _staged(self, g: _Group, base: int, slots: Sequence[Sequence[int]], capacity: int, k: int) -> torch.Tensor:
        """Group ``g``'s staged planes at ``base``, grouped by ``k`` units, as
        ``(planes, unit groups, k, capacity, unit elements)``."""
        es = self._es
        off, delta, ub = self._staged_geometry(g, slots)
        ue = g.view.shape[3]
        span = (len(g.planes) - 1) * delta + self.units * capacity * ub
        shape = (len(g.planes), self.units // k, k, capacity, ue)
        return self._view(base + off, span, shape, (delta // es, capacity * k * ue, ue, k * ue, 1))

    def _region(self, base: int, capacity: int, slots: Sequence[Sequence[Sequence[int]]],
                group: int = 1) -> _StagedRegion:
        """The staged views of the region at ``base`` (grouped by ``group``
        units): kept from an earlier call with the same slots, else built
        (and checked) for every layer."""
        key = (base, capacity, group)
        got = self._regions.get(key)
        if got is not None and (got.slots is slots or got.slots == slots):
            return got
        if group < 1 or self.units % group:
            raise ValueError(f"a staging grouped by {group} units for blocks of {self.units}")
        if len(slots) != len(self._groups):
            raise ValueError(f"staged layout of {len(slots)} layers for a KV of {len(self._groups)}")
        geo = [[self._staged_geometry(g, slots[layer]) for g in groups] for layer, groups in enumerate(self._groups)]
        whole = self._whole(base, capacity, geo, group)
        if whole is not None:
            staged = [list(row) for row in zip(*(w.unbind(0) for w in whole))]
        else:
            staged = [[self._staged(g, base, slots[layer], capacity, group) for g in groups]
                      for layer, groups in enumerate(self._groups)]
        got = _StagedRegion(slots, group, staged, whole)
        self._regions.pop(key, None)
        if len(self._regions) >= _REGIONS_KEPT:
            del self._regions[next(iter(self._regions))]
        self._regions[key] = got
        return got

    def _whole(self, base: int, capacity: int, geo: list[list[tuple[int, int, int]]],
               k: int) -> list[torch.Tensor] | None:
        """Every layer's staged copy of each plane group as one view
        ``(layers, planes, unit groups, k, capacity, unit elements)``, when
        the layers have the same groups and their staged copies are evenly
        spaced; else None."""
        es, layers = self._es, len(geo)
        if layers < 2 or any(len(row) != len(geo[0]) for row in geo):
            return None
        out = []
        for gi, g in enumerate(self._groups[0]):
            off, delta, ub = geo[0][gi]
            step = geo[1][gi][0] - off
            same = all(
                len(self._groups[layer][gi].planes) == len(g.planes)
                and geo[layer][gi] == (off + layer * step, delta, ub)
                for layer in range(layers)
            )
            if not same or step <= 0 or step % es or delta % es:
                return None
            ue = ub // es
            one = (len(g.planes) - 1) * delta + self.units * capacity * ub
            shape = (layers, len(g.planes), self.units // k, k, capacity, ue)
            stride = (step // es, delta // es, capacity * k * ue, ue, k * ue, 1)
            out.append(self._view(base + off, (layers - 1) * step + one, shape, stride))
        return out

    def _units_of(self, a: int, z: int, k: int = 1) -> list[list[torch.Tensor]]:
        """The KV views of units ``a .. z``: [layer][plane group], ``(planes,
        blocks, z - a, unit elements)``, or with ``k`` > 1 ``(planes, blocks,
        (z - a) // k, k, unit elements)``."""
        got = self._unit_views.get((a, z, k))
        if got is None:
            if not 0 <= a < z <= self.units:
                raise ValueError(f"units {a}..{z} are not within the {self.units} of a block")
            if (z - a) % k:
                raise ValueError(f"units {a}..{z} are not whole groups of {k}")
            lo = self._lo
            got = [[g.view[:, lo:, a:z] if k == 1 else g.view[:, lo:, a:z].unflatten(2, ((z - a) // k, k))
                    for g in groups] for groups in self._groups]
            self._unit_views[(a, z, k)] = got
        return got

    def gather(
        self,
        layer: int,
        src_blocks: BlockIndex,
        start: int,
        base: int,
        capacity: int,
        slots: Sequence[Sequence[Sequence[int]]],
        group: int = 1,
    ) -> None:
        """Copies request blocks ``start .. start + len(src_blocks)`` of
        ``layer`` (their block IDs in ``src_blocks``) into the source staging
        at ``base`` of ``capacity`` blocks (``slots``: ``staged_layout``'s),
        grouped by ``group`` units (``Runtime.staging_group``)."""
        end = start + len(src_blocks)
        if end > capacity:
            raise ValueError(f"request blocks up to {end} do not fit a staging of {capacity}")
        outs = self._region(base, capacity, slots, group).gather[layer]
        kv = self._units_of(0, self.units, group)[layer]
        part = start or end != capacity
        for src, out in zip(kv, outs):
            torch.index_select(src, 1, src_blocks.tensor, out=out[:, start:end] if part else out)

    def gather_piece(
        self,
        layer: int,
        src_blocks: BlockIndex,
        base: int,
        slots: Sequence[Sequence[int]],
        group: int = 1,
    ) -> None:
        """Copies ``layer`` of the blocks in ``src_blocks`` (one chunk, in the
        order of the piece's slots) into a piece of its own at ``base``: the
        layer's planes in the staged order of ``len(src_blocks)`` blocks,
        each plane's ``(offset, unit bytes)`` in ``slots``
        (``Runtime.producer_stage_layer``'s), grouped by ``group`` units."""
        if group < 1 or self.units % group:
            raise ValueError(f"a staging grouped by {group} units for blocks of {self.units}")
        if not 0 <= layer < len(self._groups):
            raise ValueError(f"layer {layer} of a KV of {len(self._groups)}")
        n = len(src_blocks)
        kv = self._units_of(0, self.units, group)[layer]
        for g, src in zip(self._groups[layer], kv):
            out = _flat_units(self._staged(g, base, slots, n, group).permute(0, 3, 1, 2, 4), group)
            torch.index_select(src, 1, src_blocks.tensor, out=out)

    def scatter(
        self,
        dst_blocks: BlockIndex,
        base: int,
        units: Sequence[tuple[int, int]],
        slots: Sequence[Sequence[Sequence[int]]],
        group: int = 1,
    ) -> None:
        """Copies ``units`` of every authorized block from the staging grant
        at ``base`` (``len(dst_blocks)`` blocks, ``slots`` for that many,
        grouped by ``group`` units: the ``RuntimeEvent``'s) into the pages
        ``dst_blocks``, every layer and plane."""
        region = self._region(base, len(dst_blocks), slots, group)
        # every range's views before the first copy: a bad range copies nothing
        pairs = [(self._units_of(a, z, group), region.source(a, z)) for a, z in units]
        for dst_rows, src_rows in pairs:
            for dst_row, src_row in zip(dst_rows, src_rows):
                for dst, src in zip(dst_row, src_row):
                    dst.index_copy_(1, dst_blocks.tensor, src)


def _size(dtype: torch.dtype) -> int:
    return int(torch.empty(0, dtype=dtype).element_size())
