"""The producer and consumer processes: one `Side` per suite and role, driven
through a pipe by `child_main`."""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time
import traceback
from typing import Any

from .common import (
    BENCH_CAPABILITY,
    BLOCK_BYTES,
    BLOCK_TOKENS,
    GUARD,
    GUARD_BUF,
    HEAD_DIM,
    KV_HEADS,
    SEED,
    MiB,
    runs,
    summarize,
)

# ----------------------------------------------------------------------------
# the worker processes


class Side:
    """One process: its device, its KV cache (one tensor per layer, FlashAttention
    layout [2, num_blocks, 16, 8, 128] bf16, or head-major [2, num_blocks, 8, 16,
    128] with --head-major), a raw buffer and a guard buffer. With --consumer-tp
    2 a consumer is TP rank ``opts["tp_rank"]`` (0 unless --consumer-ranks
    both starts a second one) of 2: heads 0-3 or 4-7, head-major blocks of 16
    KiB, the first or second half of each producer block, so every write is a
    head slice."""

    def __init__(self, role: str, opts: dict[str, Any]) -> None:
        import torch

        self.torch = torch
        self.role, self.opts = role, opts
        self.cuda = opts["device"] == "cuda"
        if self.cuda:
            self.gpu = opts["src_gpu"] if role in ("producer", "torch") else opts["dst_gpu"]
            torch.cuda.set_device(self.gpu)
            torch.cuda.init()
            self.dev = torch.device("cuda", self.gpu)
        else:
            self.gpu = 0
            self.dev = torch.device("cpu")
        self.layers = opts["layers"]
        self.nb = opts["num_blocks"]
        self.head_major = bool(opts.get("head_major"))
        self.tp_size = opts.get("consumer_tp", 1) if role == "consumer" else 1
        self.tp_rank = opts.get("tp_rank", 0) if role == "consumer" else 0
        self.heads = KV_HEADS // self.tp_size
        self.block_bytes = BLOCK_BYTES // self.tp_size
        shape = (2, self.nb, self.heads, BLOCK_TOKENS, HEAD_DIM) if self.head_major else \
            (2, self.nb, BLOCK_TOKENS, self.heads, HEAD_DIM)
        t0 = time.monotonic()
        self.kv = [torch.empty(shape, dtype=torch.bfloat16, device=self.dev) for _ in range(self.layers)]
        self.raw = torch.empty(opts["raw_mib"] * MiB, dtype=torch.uint8, device=self.dev)
        self.guard = torch.empty(GUARD_BUF, dtype=torch.uint8, device=self.dev)
        gen = torch.Generator(device=self.dev)
        gen.manual_seed(SEED + (1 if role == "producer" else 2))
        if role in ("producer", "torch"):
            for t in self.kv:
                t.view(torch.uint8).random_(0, 256, generator=gen)
            self.raw.random_(0, 256, generator=gen)
            self.guard.copy_(self.pattern(GUARD_BUF))
        else:
            for t in self.kv:
                t.view(torch.uint8).fill_(GUARD)
            self.raw.fill_(GUARD)
            self.guard.fill_(GUARD)
        # The consumer regenerates the producer's KV (the same generator,
        # seed and calls, on the same kind of device): what every written
        # block must equal, byte for byte (kv_equal), with no data moved
        # between the processes for the check.
        self.ref: list[Any] = []
        if role == "consumer":
            ref_gen = torch.Generator(device=self.dev)
            ref_gen.manual_seed(SEED + 1)
            for _ in self.kv:
                r = torch.empty((2, self.nb, BLOCK_BYTES), dtype=torch.uint8, device=self.dev)
                r.random_(0, 256, generator=ref_gen)
                # rank k of 2, head-major: heads 4k..4k+3 are each block's k-th half
                lo = self.tp_rank * self.block_bytes
                self.ref.append(r[:, :, lo:lo + self.block_bytes].contiguous() if self.tp_size > 1 else r)
        self.sync()
        self.alloc_s = time.monotonic() - t0
        w = (torch.arange(1, 32769, dtype=torch.int64) * 2654435761) % 2147483647 + 1
        self.w = w.to(self.dev)
        self.busy_iters = 0
        if self.cuda and role == opts.get("busy_in", "producer") and opts.get("busy", "none") != "none":
            self.start_busy(opts["busy"])

    def start_busy(self, where: str) -> None:
        """Keeps this process's GPU computing (the producer's by default, as a
        prefill's forward does; ``--busy-in consumer``: the consumer's, as a
        decode beside it on one GPU does):
        bf16 4096x4096 matmuls, ~16 queued at a time, on the legacy default
        stream or on a non-blocking side stream. Mooncake's NVLink transport
        waits, before each submit, for an event on the writer's
        cudaStreamPerThread, which is ordered after the legacy default stream's
        queued work; this shows what that costs a layer write, and what
        ``--submit-wait layer`` saves."""
        import threading

        torch = self.torch
        a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=self.dev)
        b = torch.randn(4096, 4096, dtype=torch.bfloat16, device=self.dev)
        stream = torch.cuda.default_stream(self.dev) if where == "default" else torch.cuda.Stream(self.dev)

        def loop() -> None:
            torch.cuda.set_device(self.gpu)
            with torch.cuda.stream(stream):
                while True:
                    for _ in range(16):
                        torch.matmul(a, b)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    for _ in range(16):
                        torch.matmul(a, b)
                    ev.synchronize()  # at most ~32 queued, never fewer than 16
                    self.busy_iters += 32

        threading.Thread(target=loop, name="busy-gpu", daemon=True).start()

    def cmd_hello(self) -> dict[str, Any]:
        raise NotImplementedError

    # -- helpers ---------------------------------------------------------------

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    def buffers(self) -> list[Any]:
        return [*self.kv, self.raw, self.guard]

    def alloc_bases(self) -> dict[str, Any]:
        """Whether every buffer starts a CUDA allocation (Mooncake's intra-node
        NVLink transport shares memory by cudaIpcGetMemHandle, which names the
        whole allocation: a buffer inside one would be mapped at the wrong offset)."""
        if not self.cuda:
            return {"checked": False}
        segs = {s["address"] for s in self.torch.cuda.memory_snapshot() if s.get("device") == self.gpu}
        bad = [i for i, t in enumerate(self.buffers()) if t.data_ptr() not in segs]
        return {"checked": True, "all_allocation_bases": not bad, "not_bases": bad}

    def pattern(self, n: int) -> Any:
        torch = self.torch
        x = torch.arange(n, dtype=torch.int64, device=self.dev)
        x = (x * 2654435761 + SEED) & 0xFFFFFFFF
        x = x ^ (x >> 13)
        x = (x * 0x5BD1E995) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        return (x & 0xFF).to(torch.uint8)

    def row_sums(self, rows: Any) -> Any:
        """Position-weighted sums of int16 rows (int64, no overflow for rows of
        up to 32768 halfwords)."""
        torch = self.torch
        n, width = rows.shape
        out = torch.empty(n, dtype=torch.int64, device=self.dev)
        step = max(1, (8 << 20) // width)
        w = self.w[:width]
        for i in range(0, n, step):
            out[i:i + step] = (rows[i:i + step].to(torch.int64) * w).sum(dim=1)
        return out

    def plane_bases(self) -> list[list[int]]:
        return [[t.data_ptr(), t.data_ptr() + self.nb * self.block_bytes] for t in self.kv]

    def layout_json(self) -> str:
        return json.dumps({
            "num_blocks": self.nb,
            "block_size": BLOCK_TOKENS,
            "total_kv_heads": KV_HEADS,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            # FlashAttention blocks are [16 tokens, 8 heads, 128]: token-major
            # (vLLM's HND layout: [8 heads, 16 tokens, 128], head-major)
            "head_major": self.head_major,
            "layers": [{"planes": [{"base": k, "block_stride": self.block_bytes, "block_bytes": self.block_bytes},
                                   {"base": v, "block_stride": self.block_bytes, "block_bytes": self.block_bytes}]}
                       for k, v in self.plane_bases()],
        })

    def kv_ranges(self, peer_bases: list[list[int]], src: list[int], dst: list[int]) -> list[list[tuple[int, int, int]]]:
        """Per layer, the coalesced (src_addr, dst_addr, len) ranges of both planes."""
        rr = runs(src, dst)
        out = []
        for mine, theirs in zip(self.plane_bases(), peer_bases):
            layer = []
            for p in range(2):
                for s, d, c in rr:
                    layer.append((mine[p] + s * BLOCK_BYTES, theirs[p] + d * BLOCK_BYTES, c * BLOCK_BYTES))
            out.append(layer)
        return out

    # -- commands shared by every role ---------------------------------------

    def cmd_kv_reset(self) -> dict[str, Any]:
        for t in self.kv:
            t.view(self.torch.uint8).fill_(GUARD)
        self.sync()
        return {}

    def cmd_kv_equal(self, src: list[int], dst: list[int]) -> dict[str, Any]:
        """Consumer: every byte of destination blocks `dst` (every layer and
        plane) against the producer's source blocks `src`, regenerated here.
        Counts the (layer, plane, block) triples that differ in any byte."""
        torch = self.torch
        assert self.ref, "kv_equal runs on the consumer"
        si = torch.tensor(src, dtype=torch.int64, device=self.dev)
        di = torch.tensor(dst, dtype=torch.int64, device=self.dev)
        bad = compared = 0
        for got_t, want_t in zip(self.kv, self.ref, strict=True):
            got = got_t.view(torch.uint8).reshape(2, self.nb, self.block_bytes)
            want = want_t.view(torch.uint8).reshape(2, self.nb, self.block_bytes)
            for i in range(0, len(dst), 512):
                a = got.index_select(1, di[i:i + 512])
                b = want.index_select(1, si[i:i + 512])
                bad += int((a != b).any(dim=2).sum())
                compared += a.numel()
        return {"method": "bytes", "compared": compared, "mismatched": bad, "ok": bad == 0}

    def cmd_kv_untouched(self, ids: list[int]) -> dict[str, Any]:
        """Blocks outside `ids` that are no longer all guard bytes."""
        torch = self.torch
        others = sorted(set(range(self.nb)) - set(ids))
        idx = torch.tensor(others, dtype=torch.int64, device=self.dev)
        bad = 0
        for t in self.kv:
            v = t.view(torch.uint8).reshape(2, self.nb, self.block_bytes)
            for p in range(2):
                for i in range(0, len(others), 512):
                    sel = v[p].index_select(0, idx[i:i + 512])
                    bad += int((sel != GUARD).any(dim=1).sum())
        return {"blocks_checked": len(others) * 2 * self.layers, "blocks_touched": bad}

    def cmd_raw_sums(self, rows: list[int], row_bytes: int) -> Any:
        torch = self.torch
        v = self.raw.view(torch.int16).reshape(-1, row_bytes // 2)
        idx = torch.tensor(rows, dtype=torch.int64, device=self.dev)
        return self.row_sums(v.index_select(0, idx)).cpu().numpy()

    def cmd_raw_reset(self) -> dict[str, Any]:
        self.raw.fill_(GUARD)
        self.sync()
        return {}

    def cmd_guard_check(self, ranges: list[tuple[int, int, int]]) -> dict[str, Any]:
        """Exact byte check of the guard buffer against the expected image."""
        torch = self.torch
        src = self.pattern(GUARD_BUF)
        expected = torch.full((GUARD_BUF,), GUARD, dtype=torch.uint8, device=self.dev)
        inside = torch.zeros(GUARD_BUF, dtype=torch.bool, device=self.dev)
        for s, d, n in ranges:
            expected[d:d + n] = src[s:s + n]
            inside[d:d + n] = True
        diff = self.guard != expected
        bad_data = int((diff & inside).sum())
        bad_guard = int((diff & ~inside).sum())
        # the bytes right before and after every range, named explicitly
        edges = sorted({d - 1 for _, d, _ in ranges} | {d + n for _, d, n in ranges})
        e = torch.tensor(edges, dtype=torch.int64, device=self.dev)
        edges_ok = bool((self.guard.index_select(0, e) == GUARD).all())
        return {
            "ranges": len(ranges),
            "bytes_in_ranges": int(inside.sum()),
            "guard_bytes_checked": int((~inside).sum()),
            "mismatched_data_bytes": bad_data,
            "modified_guard_bytes": bad_guard,
            "edge_bytes_intact": edges_ok,
            "ok": bad_data == 0 and bad_guard == 0 and edges_ok,
        }

    def cmd_corrupt(self, what: str, ranges: list[tuple[int, int, int]] | None = None,
                    ids: list[int] | None = None, rows: list[int] | None = None) -> dict[str, Any]:
        """Self-test of the checks (--corrupt): damages what was just written
        (one byte) and one byte that must stay untouched; the checks that
        follow must then fail."""
        torch = self.torch
        if what == "guard":
            assert ranges is not None
            (_, d0, n0), (_, d1, _) = ranges[0], ranges[1]
            self.guard[d0 + n0] ^= 0xFF  # the guard byte right after range 0
            self.guard[d1] ^= 0x01  # the first data byte of range 1
        elif what == "kv":
            assert ids is not None
            v0 = self.kv[0].view(torch.uint8).reshape(2, self.nb, self.block_bytes)
            v0[0, ids[0], 100] ^= 0x01
            other = min(set(range(self.nb)) - set(ids))
            vl = self.kv[-1].view(torch.uint8).reshape(2, self.nb, self.block_bytes)
            vl[1, other, 7] = GUARD ^ 0xFF
        elif what == "raw":
            assert rows is not None
            self.raw.view(-1, 64 << 10)[rows[0], 12345] ^= 0x01
        self.sync()
        return {}

    def cmd_guard_reset(self) -> dict[str, Any]:
        self.guard.fill_(GUARD)
        self.sync()
        return {}

    def close(self) -> None:
        pass


# What a request changed of the producer's counters (`Runtime.stats()`).
STAT_DELTAS = ("write_ranges", "write_batches", "layers_written", "layers_staged", "layers_staged_to_pages", "bytes_written")
STAGE_SLACK = 64 << 10  # staging beyond the largest request: alignment, and bytes no grant covers


def mooncake_says(start: Any) -> tuple[list[str], Any]:
    """Runs ``start`` (which loads Mooncake and starts an engine) with
    Mooncake's INFO log on and this process's stderr going to a file for the
    while, and returns the lines where Mooncake says which transport it
    installed ("Using Intra-Node NVLink transport ...", "Using TCP transport
    ...", "IntraNodeNvlinkTransport: using cudaMemcpyBatchAsync ...") and
    what ``start`` returned. Mooncake reads GLOG_minloglevel when it is
    loaded, so this must be the process's first engine."""
    import re
    import tempfile

    os.environ["GLOG_minloglevel"] = "0"
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            value = start()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        text = f.read().decode(errors="replace")
    sys.stderr.write(text)  # still in the run's log
    said = [re.sub(r"^[IWE]\d{4} [\d:.]+ +\d+ \S+\] ", "", line) for line in text.splitlines()
            if re.search(r"[Uu]sing .*transport|transport only|IntraNodeNvlinkTransport: using", line)]
    return said, value


class MooncakeSide(Side):
    def __init__(self, role: str, opts: dict[str, Any]) -> None:
        super().__init__(role, opts)
        import orbitkv

        self.orbitkv = orbitkv
        # Staging memory (--staging on): the producer's source staging, the
        # consumer's staging region for grants, each sized for the largest
        # request's KV (its staged copy is as large) plus alignment slack.
        self.stage: Any = None
        self.grants: dict[str, dict[str, int] | None] = {}
        stage_blocks = opts.get("staging_blocks", 0)
        if stage_blocks:
            nbytes = self.layers * 2 * stage_blocks * BLOCK_BYTES + STAGE_SLACK
            if self.cuda:
                # its own cudaMalloc, not a piece of a cached one (alloc_bases)
                self.torch.cuda.empty_cache()
            self.stage = self.torch.full((nbytes,), GUARD, dtype=self.torch.uint8, device=self.dev)
            self.sync()
        t0 = time.monotonic()
        self.transport_log, self.engine = mooncake_says(lambda: orbitkv.MooncakeTransferEngine("127.0.0.1"))
        self.engine_s = time.monotonic() - t0
        # As the PdConnector does on CUDA (orbitkv.pd.mooncake_submit_wait).
        self.submit_wait_slots = (self.engine.redirect_submit_wait()
                                  if self.cuda and opts.get("submit_wait", "layer") == "layer" else None)
        self.reg_s = []
        for t in self.buffers():
            t1 = time.monotonic()
            self.engine.register_memory(t)
            self.reg_s.append(time.monotonic() - t1)
        self.registered_ok = all(self.engine.is_registered(t.data_ptr(), t.numel() * t.element_size())
                                 for t in self.buffers())
        if opts.get("trace"):
            # --trace: this process's actor trace (docs/tracing.md), one file
            # per process under $OUT/traces, written when the runtime shuts down
            where = os.path.join(os.environ.get("OUT", "."), "traces")
            os.makedirs(where, exist_ok=True)
            orbitkv.install_trace(os.path.join(where, f"{role}{self.tp_rank if role == 'consumer' else ''}-"
                                                     f"{os.getpid()}.json"), max_events=400_000)
        self.runtime = orbitkv.Runtime(
            self.engine, self.layout_json(),
            consumer_timeout_s=opts["step_timeout"],
            # --consumer-tp 2 with --consumer-ranks 0: only decode rank 0
            # exists; the producer's rank-1 half waits this long for a
            # handshake that never comes (after the timed part: the clock
            # stops at rank 0's completion; every handshake that comes is
            # admitted before the first layer)
            handshake_timeout_s=(1.0 if opts.get("consumer_ranks", 1) < opts.get("consumer_tp", 1)
                                 else opts["step_timeout"]),
            write_timeout_s=opts["step_timeout"],
            max_bytes_in_flight_per_peer=opts["max_in_flight"],
            max_ranges_in_flight_per_peer=opts["max_ranges_in_flight"],
            writer_lanes_per_peer=opts["writer_lanes"],
            notify_poll_ms=opts.get("notify_poll_ms"),
            staging_region=self.stage_region() if role == "consumer" else None,
            source_staging_region=self.stage_region() if role == "producer" else None,
            staging_min_ranges=opts.get("staging_min_ranges") if self.stage is not None else None,
        )
        if self.stage is not None:
            from orbitkv.staging import StagingCopier

            need = self.runtime.staged_layout(stage_blocks)["bytes"]
            if need + STAGE_SLACK > self.stage.numel():
                raise RuntimeError(f"staging of {self.stage.numel()} bytes is short of {need} + {STAGE_SLACK}")
            units = self.runtime.staged_layout(1)["units"]
            self.copier = StagingCopier(json.loads(self.layout_json()), units, [*self.kv, self.stage])
            self.arena = orbitkv.StagingArena(*self.stage_region())

    def stage_region(self) -> tuple[int, int] | None:
        """`(addr, bytes)` of the staging tensor, None without one."""
        if self.stage is None:
            return None
        return self.stage.data_ptr(), self.stage.numel()

    def buffers(self) -> list[Any]:
        return [*super().buffers(), *([] if getattr(self, "stage", None) is None else [self.stage])]

    def stream_sync(self) -> None:
        """Waits for the copies queued on the current CUDA stream (the
        gathers and scatters of `orbitkv.staging`)."""
        if self.cuda:
            self.torch.cuda.current_stream().synchronize()

    def cmd_kv_reset(self) -> dict[str, Any]:
        """Also puts guard bytes back into the staging memory, so a grant
        that was not written cannot hand an earlier repetition's bytes to
        the scatter."""
        if self.stage is not None:
            self.stage.fill_(GUARD)
        return super().cmd_kv_reset()

    def cmd_corrupt(self, what: str, ranges: list[tuple[int, int, int]] | None = None,
                    ids: list[int] | None = None, rows: list[int] | None = None) -> dict[str, Any]:
        """`stage`: damages the last byte of the staging region (outside
        every grant: the region has slack after the largest one)."""
        if what == "stage":
            self.stage[-1] ^= 0xFF
            self.sync()
            return {}
        return super().cmd_corrupt(what, ranges, ids, rows)

    def cmd_stage_untouched(self, req: str) -> dict[str, Any]:
        """Consumer: staging bytes outside `req`'s grant (all of them when
        it got none: a producer writing pages from its source staging) that
        are no longer guard bytes (nothing but the grant may be written)."""
        g = self.grants.get(req)
        if g is None:
            outside = [self.stage]
        else:
            off = g["base"] - self.stage.data_ptr()
            outside = [self.stage[:off], self.stage[off + g["len"]:]]
        step = 256 * MiB
        bad = sum(int((x[i:i + step] != GUARD).sum()) for x in outside for i in range(0, x.numel(), step))
        return {"bytes_checked": sum(x.numel() for x in outside), "bytes_modified": bad, "ok": bad == 0,
                "grant": None if g is None else dict(g)}

    def cmd_submit_wait(self) -> dict[str, Any]:
        redirected, passed = self.engine.submit_wait_counts()
        return {"requested": self.opts.get("submit_wait", "layer"), "import_slots": self.submit_wait_slots,
                "redirected": redirected, "passed": passed}

    def cmd_hello(self) -> dict[str, Any]:
        torch = self.torch
        return {
            "role": self.role,
            "tp_rank": self.tp_rank,
            "pid": os.getpid(),
            "endpoint": self.engine.endpoint,
            "orbitkv": self.orbitkv.__version__,
            "mooncake_version": self.engine.mooncake_version,
            "mooncake_library": self.engine.mooncake_library,
            "submit_wait": {"requested": self.opts.get("submit_wait", "layer"), "import_slots": self.submit_wait_slots,
                            "events": list(self.engine.submit_wait_counts())},
            # Which transport Mooncake installed, in its own words.
            "mooncake_transport": self.transport_log,
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(self.dev) if self.cuda else platform.processor() or "cpu",
            "gpu": self.gpu if self.cuda else None,
            "alloc_s": round(self.alloc_s, 3),
            "engine_start_s": round(self.engine_s, 3),
            "registration": {
                "regions": len(self.reg_s),
                "bytes": sum(t.numel() * t.element_size() for t in self.buffers()),
                "total_s": round(sum(self.reg_s), 4),
                "max_ms": round(max(self.reg_s) * 1e3, 3),
                "median_ms": round(statistics.median(self.reg_s) * 1e3, 3),
                "is_registered_all": self.registered_ok,
                "location": f"cuda:{self.gpu}" if self.cuda else "cpu:0",
                **self.alloc_bases(),
            },
            "plane_bases": self.plane_bases(),
            "raw_base": self.raw.data_ptr(),
            "guard_base": self.guard.data_ptr(),
        }

    # -- runtime ----------------------------------------------------------------

    def next_event(self, kinds: set[str], req: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ev = self.runtime.next_event(0.2)
            if ev is not None and ev.kind in kinds and ev.request_id == req:
                return ev
        raise TimeoutError(f"no {sorted(kinds)} event for {req} within {timeout}s")

    def cmd_consumer_open(self, req: str, dst: list[int]) -> str:
        hs = self.runtime.consumer_open(req, BENCH_CAPABILITY, 0, dst, 1)
        self.grants[req] = json.loads(hs).get("staging")
        return hs

    def cmd_consumer_wait(self, req: str, scatter: list[int] | None = None) -> dict[str, Any]:
        """Waits for `req`'s end. With `scatter` (its destination blocks) a
        staged arrival is scattered from the grant into the pages and the
        time taken when that is done (synchronized)."""
        ev = self.next_event({"consumer_completed", "consumer_failed"}, req, self.opts["step_timeout"])
        t = time.monotonic_ns()
        out = {"kind": ev.kind, "t_ns": t, "bytes": ev.bytes, "reason": ev.reason, "staged": None}
        if scatter is not None and ev.kind == "consumer_completed" and ev.staged is not None:
            base, n, units, group = ev.staged
            if n != len(scatter):
                raise RuntimeError(f"{req}: {n} blocks staged, {len(scatter)} authorized")
            self.copier.scatter(self.copier.index(scatter), base, units, self.runtime.staged_layout(n)["slots"],
                                group)
            self.stream_sync()
            out["t_ns"] = time.monotonic_ns()
            out["staged"] = {"base": base, "blocks": n, "units": [list(u) for u in units], "group": group,
                             "scatter_s": (out["t_ns"] - t) / 1e9}
        return out

    def cmd_consumer_release(self, req: str) -> dict[str, Any]:
        self.runtime.consumer_release(req)
        self.next_event({"consumer_released"}, req, self.opts["step_timeout"])
        self.grants.pop(req, None)
        return {"live": self.runtime.live_requests()}

    def cmd_producer_stream(self, req: str, src: list[int], handshakes: list[str],
                            staged: bool = False) -> dict[str, Any]:
        """Streams every layer of `req` to the consumers whose `handshakes`
        it admits (one per decode rank that takes part). `staged`: with a source staging from
        the arena, each layer gathered there (and the stream synchronized)
        before its `layer_ready`, inside the timing; the piece goes back on
        `producer_released`."""
        rt = self.runtime
        n = len(src)
        before = rt.stats()
        piece = slots = None
        group = 1
        if staged:
            sl = rt.staged_layout(n)
            piece, slots = self.arena.alloc(sl["bytes"]), sl["slots"]
            if piece is None:
                raise RuntimeError(f"no source staging of {sl['bytes']} bytes free: {self.arena.in_use()} in use")
            # zeros, not the last request's bytes: a layer not gathered is seen
            off = piece - self.stage.data_ptr()
            self.stage[off:off + sl["bytes"]].zero_()
            self.sync()
            group = rt.staging_group(self.opts.get("consumer_tp", 1))
            try:
                rt.producer_open(req, src, BENCH_CAPABILITY, self.opts.get("consumer_tp", 1),
                                 staging_base=piece, staging_blocks=n, staging_group=group)
            except BaseException:
                self.arena.free(piece)
                raise
        else:
            rt.producer_open(req, src, BENCH_CAPABILITY, self.opts.get("consumer_tp", 1))
        for hs in handshakes:
            rt.producer_handshake(hs)
        # --gather event (CUDA): as the connector does, each layer's gather is
        # queued on the stream and the layer handed over with a CUDA event
        # (`layers_ready_after`); its writer waits for the event, the host
        # never does. --gather sync: the host waits for each gather.
        stream = (self.torch.cuda.current_stream().cuda_stream
                  if staged and self.cuda and self.opts.get("gather", "event") == "event" else None)
        # --trace: when each layer's gather ran on the GPU (CUDA events, ms
        # after one recorded at t0), to lay beside the actor trace's writes
        marks: list[Any] | None = [] if self.opts.get("trace") and stream is not None else None
        t0 = time.monotonic_ns()
        t0_unix_ns = time.time_ns()
        if marks is not None:
            marks.append(self.torch.cuda.Event(enable_timing=True))
            marks[0].record()
        gather_ns = 0
        if staged:
            idx = self.copier.index(src)
            for layer in range(self.layers):
                g0 = time.monotonic_ns()
                self.copier.gather(layer, idx, 0, piece, n, slots, group)
                if marks is not None:
                    marks.append(self.torch.cuda.Event(enable_timing=True))
                    marks[-1].record()
                if stream is None:
                    self.stream_sync()
                    gather_ns += time.monotonic_ns() - g0
                    rt.layer_ready(req, layer, 0, n)
                else:
                    gather_ns += time.monotonic_ns() - g0  # the launch alone
                    rt.layers_ready_after(stream, layer, [(req, 0, n)])
        else:
            for layer in range(self.layers):
                rt.layer_ready(req, layer, 0, n)
        t1 = time.monotonic_ns()
        if stream is None:
            rt.producer_finish(req)
        else:
            rt.producer_finish_after(req)
        ev = self.next_event({"producer_released"}, req, self.opts["step_timeout"])
        t2 = time.monotonic_ns()
        if piece is not None:
            self.arena.free(piece)
        after = dict(rt.stats())
        delta = {k: after[k] - before.get(k, 0) for k in STAT_DELTAS}
        gpu = None
        if marks is not None:
            marks[-1].synchronize()
            gpu = {"t0_unix_ns": t0_unix_ns, "gather_done_ms": [round(marks[0].elapsed_time(m), 4) for m in marks[1:]]}
        return {"t0_ns": t0, "gpu_trace": gpu, "calls_s": (t1 - t0) / 1e9, "released_s": (t2 - t0) / 1e9,
                "gather_s": gather_ns / 1e9 if staged else None, "group": group,
                "outcome": ev.outcome, "reason": ev.reason, "stats": after, "delta": delta}

    # -- raw writes ---------------------------------------------------------------

    def timed(self, fn: Any, reps: int, warmup: int = 1) -> list[float]:
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(reps):
            t0 = time.monotonic()
            fn()
            out.append(time.monotonic() - t0)
        return out

    def cmd_write_ranges(self, peer: str, ranges: list[tuple[int, int, int]]) -> int:
        return self.engine.write(peer, ranges, self.opts["step_timeout"])

    def cmd_raw(self, peer: str, dst_base: int, kind: str, reps: int) -> dict[str, Any]:
        raw = self.raw.data_ptr()
        eng = self.engine
        timeout = self.opts["step_timeout"]
        if kind.startswith("one:"):
            n = int(kind[4:]) * MiB
            ranges = [(raw, dst_base, n)]
            secs = self.timed(lambda: eng.write(peer, ranges, timeout), reps)
            return summarize(n, secs)
        # 1024 ranges of 64 KiB: contiguous source, scattered destination slots
        count, size = 1024, 64 << 10
        slots = random.Random(SEED).sample(range(self.raw.numel() // size), count)
        ranges = [(raw + i * size, dst_base + s * size, size) for i, s in enumerate(slots)]
        if kind == "blocks:1":
            secs = self.timed(lambda: eng.write(peer, ranges, timeout), reps)
        elif kind.startswith("threads:"):
            # the same ranges split over N Python threads, each writing its
            # share with engine.write (the GIL is released while it waits)
            import threading

            nthr = int(kind.split(":")[1])
            per = count // nthr

            def go_threads() -> None:
                errs: list[BaseException] = []

                def one(i: int) -> None:
                    try:
                        eng.write(peer, ranges[i:i + per], timeout)
                    except BaseException as e:  # noqa: BLE001
                        errs.append(e)

                ts = [threading.Thread(target=one, args=(i,)) for i in range(0, count, per)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                if errs:
                    raise errs[0]

            secs = self.timed(go_threads, reps)
        else:
            nbat = int(kind.split(":")[1])
            per = count // nbat

            def go() -> None:
                bs = [eng.submit_write(peer, ranges[i:i + per]) for i in range(0, count, per)]
                for b in bs:
                    b.wait(timeout)

            secs = self.timed(go, reps)
        out = summarize(count * size, secs)
        out["slots"] = slots
        return out

    def cmd_raw_kv(self, peer: str, peer_bases: list[list[int]], src: list[int], dst: list[int],
                   reps: int) -> dict[str, Any]:
        """The runtime's ranges written directly: one batch per layer, all
        layers submitted, then all waited for."""
        eng = self.engine
        layers = self.kv_ranges(peer_bases, src, dst)
        timeout = self.opts["step_timeout"]

        def go() -> None:
            bs = [eng.submit_write(peer, r) for r in layers]
            for b in bs:
                b.wait(timeout)

        secs = self.timed(go, reps, warmup=0)
        nbytes = sum(n for layer in layers for _, _, n in layer)
        return summarize(nbytes, secs)

    def close(self) -> None:
        try:
            self.runtime.shutdown()
        finally:
            self.engine.close()


class NixlSide(Side):
    def __init__(self, role: str, opts: dict[str, Any]) -> None:
        super().__init__(role, opts)
        import nixl  # noqa: F401  (selects nixl_cu13 from the torch CUDA version)
        from nixl._api import nixl_agent, nixl_agent_config

        self.mem = "VRAM" if self.cuda else "DRAM"
        t0 = time.monotonic()
        self.agent = nixl_agent(f"okv-{role}", nixl_agent_config(backends=["UCX"]))
        self.agent_s = time.monotonic() - t0
        t0 = time.monotonic()
        self.reg = self.agent.register_memory(self.buffers())
        self.reg_s = time.monotonic() - t0
        self.peer: str | None = None

    def cmd_hello(self) -> dict[str, Any]:
        import importlib.metadata as md

        try:
            version = md.version("nixl-cu13")
        except md.PackageNotFoundError:
            version = None
        return {
            "role": self.role,
            "nixl_cu13": version,
            "plugins": self.agent.get_plugin_list(),
            "agent_start_s": round(self.agent_s, 3),
            "registration_s": round(self.reg_s, 4),
            "metadata": self.agent.get_agent_metadata(),
            "plane_bases": self.plane_bases(),
            "raw_base": self.raw.data_ptr(),
            "gpu": self.gpu,
        }

    def cmd_connect(self, metadata: bytes) -> dict[str, Any]:
        self.peer = self.agent.add_remote_agent(metadata)
        return {"peer": self.peer if isinstance(self.peer, str) else str(self.peer)}

    def xfer(self, batches: list[list[tuple[int, int, int]]], peer_gpu: int) -> tuple[float, float]:
        """Creates one transfer per batch, posts all, polls all until DONE.
        Returns (create+transfer seconds, transfer-only seconds)."""
        a = self.agent
        t0 = time.monotonic()
        handles = []
        for ranges in batches:
            local = a.get_xfer_descs([(s, n, self.gpu) for s, _, n in ranges], self.mem)
            remote = a.get_xfer_descs([(d, n, peer_gpu) for _, d, n in ranges], self.mem)
            handles.append(a.initialize_xfer("WRITE", local, remote, self.peer, b""))
        t1 = time.monotonic()
        for h in handles:
            if a.transfer(h) == "ERR":
                raise RuntimeError("NIXL transfer() returned ERR")
        deadline = time.monotonic() + self.opts["step_timeout"]
        pending = list(handles)
        while pending:
            still = []
            for h in pending:
                st = a.check_xfer_state(h)
                if st == "ERR":
                    raise RuntimeError("NIXL transfer ended in ERR")
                if st != "DONE":
                    still.append(h)
            pending = still
            if time.monotonic() > deadline:
                raise TimeoutError("NIXL transfer did not finish")
        t2 = time.monotonic()
        for h in handles:
            a.release_xfer_handle(h)
        return t2 - t0, t2 - t1

    def timed_xfer(self, batches: list[list[tuple[int, int, int]]], peer_gpu: int, reps: int,
                   warmup: int = 1) -> dict[str, Any]:
        for _ in range(warmup):
            self.xfer(batches, peer_gpu)
        tot, only = [], []
        for _ in range(reps):
            a, b = self.xfer(batches, peer_gpu)
            tot.append(a)
            only.append(b)
        nbytes = sum(n for r in batches for _, _, n in r)
        out = summarize(nbytes, only)
        out["with_create"] = summarize(nbytes, tot)
        return out

    def cmd_raw(self, dst_base: int, peer_gpu: int, kind: str, reps: int) -> dict[str, Any]:
        raw = self.raw.data_ptr()
        if kind.startswith("one:"):
            n = int(kind[4:]) * MiB
            return self.timed_xfer([[(raw, dst_base, n)]], peer_gpu, reps)
        count, size = 1024, 64 << 10
        slots = random.Random(SEED).sample(range(self.raw.numel() // size), count)
        ranges = [(raw + i * size, dst_base + s * size, size) for i, s in enumerate(slots)]
        out = self.timed_xfer([ranges], peer_gpu, reps)
        out["slots"] = slots
        return out

    def cmd_kv(self, peer_bases: list[list[int]], peer_gpu: int, src: list[int], dst: list[int],
               reps: int) -> dict[str, Any]:
        return self.timed_xfer(self.kv_ranges(peer_bases, src, dst), peer_gpu, reps, warmup=0)

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self.reg)
        except Exception:  # noqa: BLE001 - best-effort cleanup of a benchmark side
            pass


class TorchSide(Side):
    """One process: copies from the source device to a destination device."""

    def __init__(self, role: str, opts: dict[str, Any]) -> None:
        super().__init__(role, opts)
        torch = self.torch
        self.dst_dev = torch.device("cuda", opts["dst_gpu"]) if self.cuda else self.dev
        self.dst_raw = torch.empty_like(self.raw, device=self.dst_dev)
        self.dst_kv = [torch.empty_like(t, device=self.dst_dev) for t in self.kv]

    def sync_both(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)
            self.torch.cuda.synchronize(self.dst_dev)

    def timed(self, fn: Any, reps: int, warmup: int = 1) -> list[float]:
        for _ in range(warmup):
            fn()
        self.sync_both()
        out = []
        for _ in range(reps):
            t0 = time.monotonic()
            fn()
            self.sync_both()
            out.append(time.monotonic() - t0)
        return out

    def cmd_hello(self) -> dict[str, Any]:
        torch = self.torch
        return {"role": self.role, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                "device": torch.cuda.get_device_name(self.dev) if self.cuda else "cpu",
                "src": str(self.dev), "dst": str(self.dst_dev),
                "peer_access": (torch.cuda.can_device_access_peer(self.dev.index, self.dst_dev.index)
                                if self.cuda and self.dev != self.dst_dev else None)}

    def cmd_raw(self, kind: str, reps: int) -> dict[str, Any]:
        src, dst = self.raw, self.dst_raw
        if kind.startswith("one:"):
            n = int(kind[4:]) * MiB
            secs = self.timed(lambda: dst[:n].copy_(src[:n], non_blocking=True), reps)
            out = summarize(n, secs)
            self.sync_both()
            ok = bool(self.torch.equal(dst[:n], src[:n].to(dst.device)))
            out["bytes_check"] = {"method": "bytes", "compared": n, "mismatched": 0 if ok else 1, "ok": ok}
            return out
        count, size = 1024, 64 << 10
        slots = random.Random(SEED).sample(range(src.numel() // size), count)

        def go() -> None:
            for i, s in enumerate(slots):
                dst[s * size:(s + 1) * size].copy_(src[i * size:(i + 1) * size], non_blocking=True)

        out = summarize(count * size, self.timed(go, reps))
        bad = sum(not self.torch.equal(dst[s * size:(s + 1) * size], src[i * size:(i + 1) * size].to(dst.device))
                  for i, s in enumerate(slots))
        out["bytes_check"] = {"method": "bytes", "compared": count * size, "mismatched": bad, "ok": bad == 0}
        return out

    def cmd_kv(self, src_ids: list[int], dst_ids: list[int], reps: int) -> dict[str, Any]:
        """Contiguous: one copy_ per layer and plane of the request's blocks.
        Scattered: gather (index_select) on the source device, copy, scatter
        (index_copy_) on the destination device, per layer."""
        torch = self.torch
        rr = runs(src_ids, dst_ids)
        n = len(src_ids)
        si = torch.tensor(src_ids, dtype=torch.int64, device=self.dev)
        di = torch.tensor(dst_ids, dtype=torch.int64, device=self.dst_dev)

        def go() -> None:
            for s, d in zip(self.kv, self.dst_kv):
                if len(rr) == 1:
                    a, b, c = rr[0]
                    d[:, b:b + c].copy_(s[:, a:a + c], non_blocking=True)
                else:
                    d.index_copy_(1, di, s.index_select(1, si).to(self.dst_dev, non_blocking=True))

        out = summarize(self.layers * 2 * n * BLOCK_BYTES, self.timed(go, reps))
        self.sync_both()
        bad = 0
        for s, d in zip(self.kv, self.dst_kv, strict=True):
            a = d.view(torch.uint8).reshape(2, self.nb, BLOCK_BYTES).index_select(1, di)
            b = s.view(torch.uint8).reshape(2, self.nb, BLOCK_BYTES).index_select(1, si).to(self.dst_dev)
            bad += int((a != b).any(dim=2).sum())
        out["bytes_check"] = {"method": "bytes", "compared": self.layers * 2 * n * BLOCK_BYTES,
                              "mismatched": bad, "ok": bad == 0}
        return out


ROLES = {"mooncake": MooncakeSide, "nixl": NixlSide, "torch": TorchSide}


def child_main(kind: str, role: str, conn: Any, opts: dict[str, Any]) -> None:
    side = None
    try:
        side = ROLES[kind](role, opts)
        conn.send(("ok", side.cmd_hello()))
    except BaseException as e:  # noqa: BLE001
        conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))
        return
    try:
        while True:
            cmd, kw = conn.recv()
            if cmd == "exit":
                break
            try:
                conn.send(("ok", getattr(side, "cmd_" + cmd)(**kw)))
            except Exception as e:  # noqa: BLE001
                conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        try:
            side.close()
        except Exception:  # noqa: BLE001 - best-effort cleanup of a benchmark side
            pass
