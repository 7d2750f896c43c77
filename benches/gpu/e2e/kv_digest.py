"""A vLLM worker extension for the GPU end-to-end driver: digests of every
token slot of the instance's KV cache, so that the driver can check, byte for
byte, that what decode holds is what prefill computed.

vLLM loads it with ``--worker-extension-cls kv_digest.KvDigest`` (this folder
on the server's ``PYTHONPATH``); the driver calls it through vLLM's dev-mode
endpoint ``POST /collective_rpc {"method": "orbitkv_kv_digest"}``
(``VLLM_SERVER_DEV_MODE=1``) once both instances are idle.

A slot's digest is a 64-bit hash of its bytes in every layer (the same
seeded coefficients on every instance, so equal bytes give equal digests on
prefill and decode). vLLM zero-fills its KV cache when it allocates it, so a
slot that is zero in every layer was never written and is left out; so is
block 0 (vLLM's null block, where padded slots of CUDA-graph runs land).
Freed blocks keep their bytes until vLLM hands them out again, which a pool
much larger than a stage's prompts does not do.
"""

from __future__ import annotations

import base64
from typing import Any

SEED = 20261204
CHUNK_ROWS = 1 << 15


def _coefficients(width: int, device: Any) -> Any:
    import torch

    g = torch.Generator(device="cpu")
    g.manual_seed(SEED + width)
    c = torch.randint(-(1 << 62), 1 << 62, (width,), generator=g, dtype=torch.int64) | 1
    return c.to(device)


def _layout(t: Any, num_blocks: int | None, block_size: int) -> tuple[int, int | None, int]:
    """(block dim, slot dim or None, kernel block size) of one layer's KV tensor:
    the block dim is the first whose size is the pool's block count (or a
    multiple of it: kernel blocks smaller than vLLM's blocks); the slot dim the
    first after it whose size is the kernel block size."""
    shape = list(t.shape)
    bd = None
    if num_blocks:
        for i, n in enumerate(shape):
            if n >= num_blocks and n % num_blocks == 0 and block_size % (n // num_blocks) == 0:
                bd = i
                break
    if bd is None:
        bd = 1 if (len(shape) >= 4 and shape[0] == 2) else 0
    per = shape[bd] // num_blocks if num_blocks else 1
    kbs = block_size // per if per else block_size
    sd = next((i for i in range(bd + 1, len(shape)) if shape[i] == kbs), None)
    return bd, sd, kbs


class KvDigest:
    """Mixed into vLLM's worker (``--worker-extension-cls``)."""

    def orbitkv_kv_digest(self, with_index: str = "", slots: str = "") -> dict[str, Any]:
        """``with_index``: also each digest's slot; ``slots``: a JSON list of
        slots whose per-layer digests to return ("0" where the layer's bytes
        of the slot are all zero)."""
        import json

        import numpy as np
        import torch

        runner = self.model_runner  # type: ignore[attr-defined]
        caches = [t for t in getattr(runner, "kv_caches", []) if isinstance(t, torch.Tensor)]
        cc = self.cache_config  # type: ignore[attr-defined]
        num_blocks = getattr(cc, "num_gpu_blocks", None) or getattr(cc, "num_cpu_blocks", None)
        block_size = int(cc.block_size)
        out: dict[str, Any] = {"layers": len(caches), "num_blocks": num_blocks, "block_size": block_size,
                               "cache_dtype": str(getattr(cc, "cache_dtype", "?"))}
        if not caches:
            out["error"] = "no KV cache tensors on model_runner.kv_caches"
            return out
        out["shape"] = list(caches[0].shape)
        out["dtype"] = str(caches[0].dtype)
        total = None
        nonzero = None
        seen: set[int] = set()
        rows = None
        want = None
        per_layer: dict[str, list[str]] = {}
        if slots:
            want = torch.tensor(json.loads(slots) or [0], dtype=torch.int64, device=caches[0].device)
        for layer, t in enumerate(caches):
            if t.data_ptr() in seen:
                continue  # a tensor shared by layers: once
            seen.add(t.data_ptr())
            bd, sd, kbs = _layout(t, num_blocks, block_size)
            x = t.movedim(bd, 0)
            if sd is not None:
                x = x.movedim(sd if sd > bd else sd + 1, 1)
                n_rows = x.shape[0] * x.shape[1]
            else:
                n_rows = x.shape[0]
            out.setdefault("slot_granularity", "token" if sd is not None else "block")
            out.setdefault("kernel_block_size", kbs if sd is not None else None)
            x = x.reshape(n_rows, -1)
            if rows is None:
                rows = n_rows
                total = torch.zeros(rows, dtype=torch.int64, device=t.device)
                nonzero = torch.zeros(rows, dtype=torch.bool, device=t.device)
            elif n_rows != rows:
                out["error"] = f"layer {layer}: {n_rows} slots, layer 0 had {rows}"
                return out
            for r0 in range(0, rows, CHUNK_ROWS):
                part = x[r0:r0 + CHUNK_ROWS].contiguous().view(torch.uint8)
                pad = (-part.shape[1]) % 8
                if pad:
                    part = torch.cat([part, part.new_zeros(part.shape[0], pad)], dim=1)
                words = part.view(torch.int64)
                c = _coefficients(words.shape[1], t.device)
                h = (words * c).sum(dim=1)
                total[r0:r0 + CHUNK_ROWS] = total[r0:r0 + CHUNK_ROWS] * 1000003 + h
                nonzero[r0:r0 + CHUNK_ROWS] |= (words != 0).any(dim=1)
            if want is not None:
                # per-layer digests of the asked slots (and whether the slot is zero there)
                sel_rows = want[want < n_rows]
                xs = x[sel_rows].contiguous().view(torch.uint8)
                pad = (-xs.shape[1]) % 8
                if pad:
                    xs = torch.cat([xs, xs.new_zeros(xs.shape[0], pad)], dim=1)
                w = xs.view(torch.int64)
                hl = (w * _coefficients(w.shape[1], t.device)).sum(dim=1).cpu().tolist()
                zl = (w == 0).all(dim=1).cpu().tolist()
                for r, h, z in zip(sel_rows.cpu().tolist(), hl, zl):
                    per_layer.setdefault(str(r), []).append("0" if z else format(h & ((1 << 64) - 1), "x"))
        assert total is not None and nonzero is not None and rows is not None
        null = max(1, rows // num_blocks) if num_blocks else 1  # the slots of vLLM's block 0
        nonzero[:null] = False  # block 0: vLLM's null block
        sel = total[nonzero].cpu().numpy().astype(np.int64)
        out["slots"] = int(rows)
        out["slots_per_block"] = int(rows // num_blocks) if num_blocks else None
        out["written"] = int(sel.size)
        out["digests"] = base64.b64encode(sel.tobytes()).decode()
        if slots:
            out["per_layer"] = per_layer
        if with_index:
            # each digest's slot (block * slots_per_block + slot in block)
            idx = torch.nonzero(nonzero).flatten().cpu().numpy().astype(np.int64)
            out["index"] = base64.b64encode(idx.tobytes()).decode()
        return out


def decode_digests(result: dict[str, Any], key: str = "digests") -> list[int]:
    """The digests (or, key "index", their slots) of one instance's answer, as ints."""
    import numpy as np

    raw = base64.b64decode(result.get(key, ""))
    return np.frombuffer(raw, dtype=np.int64).tolist()
