"""Test-only fault hooks of the PdConnector worker, for the end-to-end tests.

Off unless the vLLM server runs with one of these environment variables
(read once, when the worker is built); ``docs/configuration.md`` lists them.
Never set them in production.

``ORBITKV_TESTING_CORRUPT_AFTER_LOAD`` (decode instance)
    ``1``: every KV load that completes gets one block corrupted. A path: the
    next load that completes while that file exists gets one block corrupted,
    and the file is removed (one shot). The corrupted block is the first
    block the request authorized: its bytes are changed (the sign bit of every
    element flipped, in every layer) after the consumer completed and before
    the request is reported to vLLM, so decode computes on KV that differs
    from the prefill's. It shows that decode really uses the transferred KV.

``ORBITKV_TESTING_WRITE_DELAY`` (prefill instance, CPU)
    A path. While that file exists and holds a number of seconds, each layer
    hand-over (``Runtime.layers_ready``) reaches the runtime that much later,
    from a background thread (a slow link, :class:`SlowLink`, put in front
    of the worker's runtime once, when it starts): prefill finishes
    computing before its KV has reached decode, which opens a window for
    "aborted during transfer". While the variable is set, hand-overs go
    through that thread whenever the file holds a positive delay or earlier
    ones are still queued, and a finish goes behind those still queued, so
    their order is kept. The worker's own dispatch has no branch for it.

``ORBITKV_TESTING_KV_DIGEST`` (prefill and decode)
    A directory. Each process appends one JSON line per request to
    ``<dir>/kvd-<pid>.jsonl``, keyed by the P/D request id both sides share:
    on decode right after the request's KV load completed (after any staging
    scatter and any corruption above, before vLLM is told), a digest per
    loaded token; on prefill right
    before the worker reports the request's sending finished (its blocks are
    then freed, and may be reused at once), a digest per token slot of its
    blocks. A token's digest (:func:`token_digests`) covers its bytes in every
    layer and does not depend on the block size or the block layout, so a
    prefill and a decode of other block sizes compare token for token. A
    freed block reused by another request before a check of the idle
    instances' KV (which such a check cannot tell from a transfer fault)
    does not touch these.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from orbitkv import OrbitKVError
from orbitkv.vllm.faults import CORRUPT_ENV, KV_DIGEST_ENV, WRITE_DELAY_ENV, Faults
from orbitkv.vllm.faults import faults_from_env as _faults_from_env

if TYPE_CHECKING:
    from orbitkv import Runtime

logger = logging.getLogger("orbitkv.vllm.testing")



def faults_from_env() -> Faults:
    """The test hooks the environment asks for, else the no-ops
    (``faults.faults_from_env``, which the worker calls)."""
    return _faults_from_env()


class SlowLink:
    """A slow link in front of a runtime (``ORBITKV_TESTING_WRITE_DELAY``):
    ``layers_ready`` reaches the runtime ``delay_s()`` seconds later, from a
    background thread, while the delay is positive or earlier calls are
    still queued there (then it answers that nothing was refused; the
    thread logs what the runtime refused); ``producer_finish`` goes behind
    the calls still queued; every other call goes straight through."""

    def __init__(self, runtime: Runtime, delay_s: Any) -> None:
        self._rt = runtime
        self._delay_s = delay_s
        self._q: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._t = threading.Thread(target=self._run, name="orbitkv-testing-slow-link", daemon=True)
        self._t.start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            delay, fn, args = item
            try:
                if delay > 0:
                    time.sleep(delay)
                refused = fn(*args)
                for pd_id, err in refused or ():
                    logger.debug("slow link: %s for %s refused: %s", fn.__name__, pd_id, err)
            except OrbitKVError as e:
                logger.debug("slow link: %s failed: %s", fn.__name__, e)
            except Exception:
                logger.exception("slow link: %s failed", fn.__name__)
            finally:
                with self._lock:
                    self._pending -= 1

    def _put(self, delay: float, fn: Any, *args: Any) -> None:
        with self._lock:
            self._pending += 1
        self._q.put((delay, fn, args))

    def _queued(self) -> int:
        with self._lock:
            return self._pending

    def layers_ready(self, layer: int, chunks: list[tuple[str, int, int]]) -> list[tuple[str, Exception]]:
        delay = self._delay_s()
        if delay <= 0 and self._queued() == 0:
            return self._rt.layers_ready(layer, chunks)
        self._put(delay, self._rt.layers_ready, layer, chunks)
        return []

    def producer_finish(self, pd_id: str) -> None:
        if self._queued() == 0:
            self._rt.producer_finish(pd_id)
        else:
            self._put(0.0, self._rt.producer_finish, pd_id)

    def shutdown(self) -> None:
        self._q.put(None)
        self._t.join(timeout=10)
        self._rt.shutdown()


@dataclass
class TestingHooks(Faults):
    corrupt: str | None = None  # "1" (always) or a path (one shot while it exists)
    write_delay_file: str | None = None
    kv_digest_dir: str | None = None  # ORBITKV_TESTING_KV_DIGEST
    # per P/D id: a producer's blocks so far; a consumer's (first block, blocks, tokens)
    _sent_blocks: dict[str, list[int]] = field(default_factory=dict)
    _loads: dict[str, tuple[int, list[int], int]] = field(default_factory=dict)

    @staticmethod
    def from_env() -> TestingHooks | None:
        corrupt = os.environ.get(CORRUPT_ENV) or None
        delay = os.environ.get(WRITE_DELAY_ENV) or None
        digest = os.environ.get(KV_DIGEST_ENV) or None
        if corrupt is None and delay is None and digest is None:
            return None
        logger.warning(
            "OrbitKV TEST HOOKS ENABLED (%s=%r, %s=%r, %s=%r): not for production",
            CORRUPT_ENV,
            corrupt,
            WRITE_DELAY_ENV,
            delay,
            KV_DIGEST_ENV,
            digest,
        )
        return TestingHooks(corrupt, delay, digest)

    def take_corruption(self) -> bool:
        """Whether to corrupt the load that just completed (consumes a one-shot)."""
        if self.corrupt is None:
            return False
        if self.corrupt == "1":
            return True
        try:
            os.remove(self.corrupt)
        except FileNotFoundError:
            return False
        except OSError as e:
            logger.warning("corruption hook: cannot remove %s: %s", self.corrupt, e)
            return False
        return True

    def write_delay_s(self) -> float:
        if self.write_delay_file is None:
            return 0.0
        try:
            with open(self.write_delay_file) as f:
                return max(0.0, float(f.read().strip() or 0))
        except (OSError, ValueError):
            return 0.0

    def wrap_runtime(self, runtime: Runtime) -> Runtime:
        if self.write_delay_file is None:
            return runtime
        return cast("Runtime", SlowLink(runtime, self.write_delay_s))

    def after_load(
        self, kv_caches: dict[str, torch.Tensor], num_blocks: int, blocks: list[int] | None, pd_id: str | None = None
    ) -> None:
        # Decode must compute on changed KV: the first block the request
        # authorized. A one-shot is consumed even when there is no block.
        if self.take_corruption() and blocks:
            corrupt_block(kv_caches, num_blocks, blocks[0])
        # The digest of what decode computes on (a corruption above shows).
        load = self._loads.pop(pd_id, None) if pd_id is not None else None
        if self.kv_digest_dir is not None and load is not None:
            first_block, ids, tokens = load
            self._record("decode", pd_id or "", kv_caches, num_blocks, ids, first_block, tokens)

    def consumer_opened(self, pd_id: str, first_block: int, block_ids: list[int], tokens: int) -> None:
        if self.kv_digest_dir is not None and all(isinstance(b, int) for b in block_ids):
            self._loads[pd_id] = (first_block, list(block_ids), tokens)

    def producer_chunk(self, pd_id: str, new_block_ids: list[int]) -> None:
        if self.kv_digest_dir is not None and all(isinstance(b, int) for b in new_block_ids):
            self._sent_blocks.setdefault(pd_id, []).extend(new_block_ids)

    def before_send_done(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, pd_id: str) -> None:
        ids = self._sent_blocks.pop(pd_id, None)
        if self.kv_digest_dir is not None and ids:
            self._record("prefill", pd_id, kv_caches, num_blocks, ids, 0, None)

    def _record(
        self,
        side: str,
        pd_id: str,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
        block_ids: list[int],
        first_block: int,
        tokens: int | None,
    ) -> None:
        """One JSON line: the per-token digests (all layers, and per layer)
        of a request's tokens ``[first_block * block_size, tokens)`` held in
        ``block_ids`` (``tokens`` None: every slot of the blocks)."""
        assert self.kv_digest_dir is not None
        try:
            bs = token_block_size(next(iter(kv_caches.values())), num_blocks)
            first = first_block * bs
            end = first + len(block_ids) * bs if tokens is None else tokens
            total, per_layer = token_digests(
                kv_caches, num_blocks, block_ids, end - first, cpu_order=not _on_cuda(kv_caches)
            )
            line = {
                "side": side,
                "pd": pd_id,
                "pid": os.getpid(),
                "t": time.time(),
                "block_size": bs,
                "first_token": first,
                "end_token": end,
                "blocks": block_ids,
                "layers": len(per_layer),
                "digests": _b64(total),
                "per_layer": [_b64(x) for x in per_layer],
            }
            os.makedirs(self.kv_digest_dir, exist_ok=True)
            with open(os.path.join(self.kv_digest_dir, f"kvd-{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")
        except Exception:
            logger.exception("KV digest hook: %s %s not recorded", side, pd_id)


def corrupt_block(kv_caches: dict[str, torch.Tensor], num_blocks: int, block_id: int) -> None:
    """Flips the sign bit of every element of ``block_id`` in every layer."""
    with torch.no_grad():
        for t in kv_caches.values():
            if t.shape[0] == num_blocks:
                view = t[block_id]
            else:  # [2, num_blocks, ...]
                view = t[:, block_id]
            view.neg_()
    with contextlib.suppress(Exception):
        logger.warning("TEST HOOK: corrupted block %d in %d layers", block_id, len(kv_caches))


# ---- per-token KV digests (ORBITKV_TESTING_KV_DIGEST) ------------------------------------------

DIGEST_SEED = 20261204  # benches/gpu/e2e/kv_digest.py's


def _on_cuda(kv_caches: dict[str, torch.Tensor]) -> bool:
    return any(t.is_cuda for t in kv_caches.values())


def _b64(x: torch.Tensor) -> str:
    return base64.b64encode(x.cpu().numpy().astype("<i8").tobytes()).decode()


def _coefficients(width: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device="cpu")
    g.manual_seed(DIGEST_SEED + width)
    c = torch.randint(-(1 << 62), 1 << 62, (width,), generator=g, dtype=torch.int64) | 1
    return c.to(device)


def _dims(t: torch.Tensor, num_blocks: int) -> tuple[int, int, list[int]]:
    """(block dim, token dim, the other dims in canonical order: heads, K/V,
    content) of one layer's KV tensor, by vLLM 0.26's logical shapes
    (``layout.py``): ``[blocks, heads, block, content]`` (K and V packed in
    the content), ``[2, blocks, block, heads, head]``, ``[blocks, 2, block,
    heads, head]``, ``[blocks, block, content]`` (MLA)."""
    kv: int | None
    if t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks and num_blocks != 2:
        bdim, kv = 1, 0
    elif t.shape[0] == num_blocks:
        bdim, kv = 0, (1 if t.dim() == 5 and t.shape[1] == 2 else None)
    else:
        raise ValueError(f"KV tensor of shape {tuple(t.shape)}: no dimension of {num_blocks} blocks")
    inner = [d for d in range(t.dim()) if d not in (bdim, kv)]
    if len(inner) == 3:
        tokens, heads = (inner[1], inner[0]) if kv is None else (inner[0], inner[1])
        rest = [heads] + ([kv] if kv is not None else []) + [d for d in inner if d not in (tokens, heads)]
    elif len(inner) == 2:
        tokens = inner[0]
        rest = ([kv] if kv is not None else []) + [inner[1]]
    else:
        raise ValueError(f"KV tensor of shape {tuple(t.shape)}: no token dimension")
    return bdim, tokens, rest


def token_block_size(t: torch.Tensor, num_blocks: int) -> int:
    """Tokens per block of a layer's KV tensor (its token dim)."""
    return int(t.shape[_dims(t, num_blocks)[1]])


def _token_rows(t: torch.Tensor, num_blocks: int, block_ids: list[int], cpu_order: bool) -> torch.Tensor:
    """``[len(block_ids) * block_size, token bytes]`` uint8: the blocks'
    tokens in order, each token's bytes in canonical order (heads, K/V,
    content). ``cpu_order``: vLLM's CPU kernels keep a head's K transposed
    (``head`` rows of one element a token) and then its V in a block
    (``layout.cpu_kernel_parts``), under the logical ``[blocks, heads,
    block, 2 * head]``."""
    bdim, tdim, rest = _dims(t, num_blocks)
    idx = torch.tensor(block_ids, dtype=torch.int64, device=t.device)
    sel = t.index_select(bdim, idx)
    if cpu_order:
        n, heads, bs, content = sel.shape
        hs = content // 2
        flat = sel.contiguous().reshape(n, heads, 2, bs * hs)
        k = flat[:, :, 0].reshape(n, heads, hs, bs).transpose(-1, -2)
        v = flat[:, :, 1].reshape(n, heads, bs, hs)
        sel = torch.cat([k, v], dim=-1)
    x = sel.permute(bdim, tdim, *rest).contiguous()
    rows = x.reshape(x.shape[0] * x.shape[1], -1)
    return rows if rows.dtype == torch.uint8 else rows.view(torch.uint8)


def _layer_key(name: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def token_digests(
    kv_caches: dict[str, torch.Tensor], num_blocks: int, block_ids: list[int], tokens: int, cpu_order: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per token of the first ``tokens`` tokens held in ``block_ids`` (in
    request order): a 64-bit digest over every layer (in layer order), and
    one per layer. The same token bytes give the same digests whatever the
    block size, the block layout (HND or NHD, a leading K/V dim of 2, K and V
    packed, one MLA latent plane) or the element type's view (fp8 as uint8),
    as long as a token's bytes are in the same order per head."""
    total: torch.Tensor | None = None
    per_layer: list[torch.Tensor] = []
    seen: set[int] = set()
    with torch.no_grad():
        for name in sorted(kv_caches, key=_layer_key):
            t = kv_caches[name]
            if t.data_ptr() in seen:
                continue  # a tensor shared by layers: once
            seen.add(t.data_ptr())
            rows = _token_rows(t, num_blocks, block_ids, cpu_order)[:tokens]
            pad = (-rows.shape[1]) % 8
            if pad:
                rows = torch.cat([rows, rows.new_zeros(rows.shape[0], pad)], dim=1)
            words = rows.contiguous().view(torch.int64)
            h = (words * _coefficients(words.shape[1], words.device)).sum(dim=1)
            per_layer.append(h.cpu())
            total = h if total is None else total * 1000003 + h
    assert total is not None, "no KV tensor"
    return total.cpu(), per_layer


def decode_b64(text: str) -> list[int]:
    """A digest list as the hook wrote it (base64 of little-endian int64)."""
    import numpy as np

    return [int(x) for x in np.frombuffer(base64.b64decode(text), dtype="<i8")]
