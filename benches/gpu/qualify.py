#!/usr/bin/env python3
"""OrbitKV GPU qualification: registration, byte correctness with guard bytes,
layer-by-layer KV streaming through `orbitkv.Runtime`, and side-by-side
reference transfers (raw Mooncake, torch copy, NIXL/UCX), producer and
consumer in two processes.

One invocation runs one *configuration* and writes one JSON file:

    qualify.py run --suite mooncake --transport nvlink --src-gpu 0 --dst-gpu 1 --out r.json
    qualify.py run --suite nixl     --src-gpu 0 --dst-gpu 1 --out n.json
    qualify.py run --suite torch    --src-gpu 0 --dst-gpu 1 --out t.json
    qualify.py report --dir DIR --out-json results.json --out-md results.md

`--device cpu` runs the same flow on CPU tensors (Mooncake over TCP, NIXL
over UCX with DRAM) at small sizes, so the whole script can be exercised on a
machine without a GPU:

    qualify.py run --device cpu --suite mooncake --transport tcp --tokens 1024 --layers 4 --out r.json

Suites:
  mooncake  two processes, one `orbitkv.MooncakeTransferEngine` each
            (MC_INTRANODE_NVLINK=1 for --transport nvlink, MC_FORCE_TCP=1 for
            tcp): (a) registration of every buffer, (b) a batch of mixed and
            odd-sized ranges checked byte for byte with guard bytes around
            every destination range, (c) vLLM-shaped KV streamed layer by
            layer through `orbitkv.Runtime` for each prompt size, contiguous
            and scattered block IDs, every written byte compared with the
            producer's source block (the consumer regenerates the producer's
            seeded random KV) after every repetition, and unauthorized blocks
            checked untouched, (d) raw `engine.write` anchors (1, 16, 256 MiB; 1024 x
            64 KiB in one batch and in 8 batches) and the runtime's own ranges
            written directly (one batch per layer, all submitted at once).
  nixl      two processes, one NIXL agent each (UCX backend): the same anchors
            and the same KV ranges, one transfer per layer, all posted at once.
  torch     one process: `dst.copy_(src)` from the source device to the
            destination device for the same patterns, each checked byte for
            byte after its timing.

Times: CLOCK_MONOTONIC (`time.monotonic_ns`), which is one clock for all
processes of a machine, so the producer's first `layer_ready` and the
consumer's `consumer_completed` event can be compared. GB/s = 10^9 bytes/s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# Both halves of every benchmark request share this capability (a router
# gives each request its own).
BENCH_CAPABILITY = "0123456789abcdef" * 4

# ----------------------------------------------------------------------------
# geometry (Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16, block 16)

BLOCK_TOKENS = 16
KV_HEADS = 8
HEAD_DIM = 128
ELEM = 2  # bf16
BLOCK_BYTES = BLOCK_TOKENS * KV_HEADS * HEAD_DIM * ELEM  # 32 KiB per plane
GUARD = 0xA5  # destination fill
GUARD_BUF = 8 << 20  # guard-test buffers
MiB = 1 << 20
SEED = 20261129


def log(*a: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def num_blocks_for(max_tokens: int) -> int:
    n = max_tokens // BLOCK_TOKENS
    return n + max(16, n // 8)


def block_ids(tokens: int, pattern: str, nb: int) -> tuple[list[int], list[int]]:
    """Source (producer) and destination (consumer) block IDs of a request."""
    n = tokens // BLOCK_TOKENS
    if pattern == "contiguous":
        return list(range(n)), list(range(3, 3 + n))
    rng = random.Random(SEED + tokens)
    return rng.sample(range(nb), n), rng.sample(range(nb), n)


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_block, dst_block, count) runs where both sides are consecutive:
    what the runtime's planner coalesces into one range per plane."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def guard_ranges() -> list[tuple[int, int, int]]:
    """(src_off, dst_off, len): mixed and odd sizes, at odd offsets, each
    destination range with guard bytes on both sides (gaps of 1..61 bytes)."""
    lengths = [1, 2, 3, 7, 8, 15, 16, 17, 31, 64, 127, 255, 256, 511, 1000, 4095, 4096, 4097,
               65535, 65536, 65537, 131071, MiB, MiB + 13, 3 * MiB - 5]
    rng = random.Random(SEED)
    dst_cursor, out = 37, []
    for i, n in enumerate(lengths):
        out.append([0, dst_cursor, n])
        dst_cursor += n + 1 + (i * 7) % 61
    order = list(range(len(out)))
    rng.shuffle(order)
    src_cursor = 5
    for i in order:
        out[i][0] = src_cursor
        src_cursor += out[i][2] + 3
    assert dst_cursor < GUARD_BUF and src_cursor < GUARD_BUF
    return [tuple(r) for r in out]  # type: ignore[misc]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def summarize(nbytes: int, secs: list[float]) -> dict[str, Any]:
    return {
        "bytes": nbytes,
        "samples_s": [round(s, 6) for s in secs],
        "median_s": statistics.median(secs),
        "gbps_median": gbps(nbytes, statistics.median(secs)),
        "gbps_best": gbps(nbytes, min(secs)),
    }


# ----------------------------------------------------------------------------
# the worker processes


class Side:
    """One process: its device, its KV cache (one tensor per layer, FlashAttention
    layout [2, num_blocks, 16, 8, 128] bf16), a raw buffer and a guard buffer."""

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
        t0 = time.monotonic()
        self.kv = [torch.empty((2, self.nb, BLOCK_TOKENS, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=self.dev)
                   for _ in range(self.layers)]
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
            for t in self.kv:
                r = torch.empty_like(t)
                r.view(torch.uint8).random_(0, 256, generator=ref_gen)
                self.ref.append(r)
        self.sync()
        self.alloc_s = time.monotonic() - t0
        w = (torch.arange(1, 32769, dtype=torch.int64) * 2654435761) % 2147483647 + 1
        self.w = w.to(self.dev)
        self.busy_iters = 0
        if self.cuda and role == "producer" and opts.get("busy", "none") != "none":
            self.start_busy(opts["busy"])

    def start_busy(self, where: str) -> None:
        """Keeps the producer's GPU computing, as a prefill's forward does:
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
        return [[t.data_ptr(), t.data_ptr() + self.nb * BLOCK_BYTES] for t in self.kv]

    def layout_json(self) -> str:
        return json.dumps({
            "num_blocks": self.nb,
            "block_size": BLOCK_TOKENS,
            "total_kv_heads": KV_HEADS,
            "tp_rank": 0,
            "tp_size": 1,
            # FlashAttention blocks are [16 tokens, 8 heads, 128]: token-major
            "head_major": False,
            "layers": [{"planes": [{"base": k, "block_stride": BLOCK_BYTES, "block_bytes": BLOCK_BYTES},
                                   {"base": v, "block_stride": BLOCK_BYTES, "block_bytes": BLOCK_BYTES}]}
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
            got = got_t.view(torch.uint8).reshape(2, self.nb, BLOCK_BYTES)
            want = want_t.view(torch.uint8).reshape(2, self.nb, BLOCK_BYTES)
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
            v = t.view(torch.uint8).reshape(2, self.nb, BLOCK_BYTES)
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
            v0 = self.kv[0].view(torch.uint8).reshape(2, self.nb, BLOCK_BYTES)
            v0[0, ids[0], 100] ^= 0x01
            other = min(set(range(self.nb)) - set(ids))
            vl = self.kv[-1].view(torch.uint8).reshape(2, self.nb, BLOCK_BYTES)
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
        self.runtime = orbitkv.Runtime(
            self.engine, self.layout_json(),
            consumer_timeout_s=opts["step_timeout"], handshake_timeout_s=opts["step_timeout"],
            write_timeout_s=opts["step_timeout"],
            max_bytes_in_flight_per_peer=opts["max_in_flight"],
            max_ranges_in_flight_per_peer=opts["max_ranges_in_flight"],
            writer_lanes_per_peer=opts["writer_lanes"],
        )

    def cmd_submit_wait(self) -> dict[str, Any]:
        redirected, passed = self.engine.submit_wait_counts()
        return {"requested": self.opts.get("submit_wait", "layer"), "import_slots": self.submit_wait_slots,
                "redirected": redirected, "passed": passed}

    def cmd_hello(self) -> dict[str, Any]:
        torch = self.torch
        return {
            "role": self.role,
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
        return self.runtime.consumer_open(req, BENCH_CAPABILITY, 0, dst, 1)

    def cmd_consumer_wait(self, req: str) -> dict[str, Any]:
        ev = self.next_event({"consumer_completed", "consumer_failed"}, req, self.opts["step_timeout"])
        t = time.monotonic_ns()
        return {"kind": ev.kind, "t_ns": t, "bytes": ev.bytes, "reason": ev.reason}

    def cmd_consumer_release(self, req: str) -> dict[str, Any]:
        self.runtime.consumer_release(req)
        self.next_event({"consumer_released"}, req, self.opts["step_timeout"])
        return {"live": self.runtime.live_requests()}

    def cmd_producer_stream(self, req: str, src: list[int], handshake: str) -> dict[str, Any]:
        rt = self.runtime
        rt.producer_open(req, src, BENCH_CAPABILITY, 1)
        rt.producer_handshake(handshake)
        n = len(src)
        t0 = time.monotonic_ns()
        for layer in range(self.layers):
            rt.layer_ready(req, layer, 0, n)
        t1 = time.monotonic_ns()
        rt.producer_finish(req)
        ev = self.next_event({"producer_released"}, req, self.opts["step_timeout"])
        t2 = time.monotonic_ns()
        return {"t0_ns": t0, "calls_s": (t1 - t0) / 1e9, "released_s": (t2 - t0) / 1e9,
                "outcome": ev.outcome, "reason": ev.reason, "stats": dict(self.runtime.stats())}

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


# ----------------------------------------------------------------------------
# the orchestrating process


class ChildDied(Exception):
    pass


class Child:
    def __init__(self, ctx: Any, kind: str, role: str, opts: dict[str, Any]) -> None:
        self.role = role
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=child_main, args=(kind, role, theirs, opts), daemon=True, name=role)
        self.proc.start()
        theirs.close()

    def send(self, cmd: str, **kw: Any) -> None:
        self.conn.send((cmd, kw))

    def recv(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise ChildDied(f"{self.role} process died (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise ChildDied(f"{self.role}: no answer within {timeout:.0f}s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise ChildDied(f"{self.role} closed its pipe") from None
        if status == "err":
            raise RuntimeError(f"{self.role}: {value}")
        return value

    def call(self, cmd: str, timeout: float, **kw: Any) -> Any:
        self.send(cmd, **kw)
        return self.recv(timeout)

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("exit", {}))
                self.proc.join(10)
        except Exception:  # noqa: BLE001 - the process may be gone already: killed below
            pass
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class Run:
    """Results of one configuration, saved after every step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.out = Path(args.out)
        self.data: dict[str, Any] = {
            "suite": args.suite,
            "transport": args.transport if args.suite == "mooncake" else ("ucx" if args.suite == "nixl" else "torch"),
            "device": args.device,
            "src_gpu": args.src_gpu,
            "dst_gpu": args.dst_gpu,
            "geometry": {"layers": args.layers, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bf16",
                         "block_tokens": BLOCK_TOKENS, "block_bytes_per_plane": BLOCK_BYTES,
                         "num_blocks": num_blocks_for(max(args.tokens)), "layout": "[2, num_blocks, 16, 8, 128]"},
            "tokens": args.tokens,
            "raw_mib": args.raw_mib,
            "runtime": {"max_bytes_in_flight_per_peer": args.max_in_flight,
                        "max_ranges_in_flight_per_peer": args.max_ranges_in_flight,
                        "writer_lanes_per_peer": args.writer_lanes},
            "busy": args.busy,
            "submit_wait": args.submit_wait,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "host": platform.node(),
            "python": sys.version.split()[0],
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith(("MC_", "ORBITKV_", "UCX_", "NIXL_", "GLOG_"))},
            "steps": {},
        }
        self.save()

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 2)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.out)

    def step(self, name: str, fn: Any, need_s: float = 5.0) -> Any:
        if self.left() < need_s:
            self.data["steps"][name] = {"status": "skipped", "reason": f"time budget ({self.args.budget_s:.0f}s) spent"}
            log(f"  {name}: skipped (budget)")
            self.save()
            return None
        t = time.monotonic()
        log(f"  {name} ...")
        res = None
        try:
            res = fn()
            rec = {"status": "ok", **(res or {})}
        except ChildDied as e:
            self.data["steps"][name] = {"status": "failed", "error": str(e), "s": round(time.monotonic() - t, 2)}
            self.save()
            log(f"  {name}: FAILED {e}")
            raise
        except Exception as e:  # noqa: BLE001
            rec = {"status": "failed", "error": f"{e}"[-4000:]}
        rec["s"] = round(time.monotonic() - t, 2)
        self.data["steps"][name] = rec
        self.save()
        brief = {k: v for k, v in rec.items() if k in ("status", "gbps_median", "ok", "s", "error")}
        log(f"  {name}: {json.dumps(brief, default=str)[:600]}")
        return res


def bytes_ok(step: dict[str, Any] | None) -> bool:
    """Whether a timed step's bytes were checked and matched (a goal counts
    only then)."""
    return bool(step) and bool((step.get("bytes_check") or {}).get("ok"))


def compare_sums(a: Any, b: Any) -> dict[str, Any]:
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    same = a.shape == b.shape
    bad = int((a != b).sum()) if same else -1
    return {"compared": int(a.size), "mismatched": bad, "ok": same and bad == 0}


def suite_mooncake(run: Run, ctx: Any, opts: dict[str, Any]) -> None:
    a = run.args
    st = a.step_timeout
    prod = Child(ctx, "mooncake", "producer", opts)
    cons = Child(ctx, "mooncake", "consumer", opts)
    try:
        hp = hc = None

        def hello() -> dict[str, Any]:
            nonlocal hp, hc
            hp, hc = prod.recv(a.start_timeout), cons.recv(a.start_timeout)
            return {"producer": dict(hp), "consumer": dict(hc)}

        run.step("start_and_register", hello)
        if hp is None or hc is None:
            raise ChildDied("a process did not start")
        for h in (run.data["steps"]["start_and_register"].get("producer"),
                  run.data["steps"]["start_and_register"].get("consumer")):
            h.pop("plane_bases", None)
        run.save()
        peer = hc["endpoint"]
        cbases = hc["plane_bases"]

        def guard() -> dict[str, Any]:
            ranges = guard_ranges()
            gb = hc["guard_base"]
            pb = hp["guard_base"]
            abs_ranges = [(pb + s, gb + d, n) for s, d, n in ranges]
            t0 = time.monotonic()
            wrote = prod.call("write_ranges", st, peer=peer, ranges=abs_ranges)
            if a.corrupt:
                cons.call("corrupt", st, what="guard", ranges=ranges)
            res = cons.call("guard_check", st, ranges=ranges)
            res["written"] = wrote
            res["s_write"] = round(time.monotonic() - t0, 4)
            return res

        run.step("guard_bytes", guard)

        # warm-up: one request over every layer (opens the peer's segment and,
        # on NVLink, maps every registered region of the consumer)
        seq = [0]

        def stream(src: list[int], dst: list[int]) -> dict[str, Any]:
            seq[0] += 1
            req = f"q{seq[0]}"
            hs = cons.call("consumer_open", st, req=req, dst=dst)
            cons.send("consumer_wait", req=req)
            prod.send("producer_stream", req=req, src=src, handshake=hs)
            p = prod.recv(st + 10)
            c = cons.recv(st + 10)
            return {"req": req, "p": p, "c": c}

        def warm() -> dict[str, Any]:
            s, d = block_ids(a.tokens[0], "contiguous", opts["num_blocks"])
            r = stream(s, d)
            cons.call("consumer_release", st, req=r["req"])
            cons.call("kv_reset", st)
            return {"consumer": r["c"]["kind"], "producer": r["p"]["outcome"]}

        run.step("warmup", warm)

        def raw(kind: str, reps: int) -> Any:
            def go() -> dict[str, Any]:
                res = prod.call("raw", st * 2, peer=peer, dst_base=hc["raw_base"], kind=kind, reps=reps)
                if kind in (f"one:{a.raw_mib}", "blocks:1"):
                    if kind.startswith("one:"):
                        rows = list(range(a.raw_mib * 16))
                        ps = prod.call("raw_sums", st, rows=rows, row_bytes=64 << 10)
                    else:
                        rows = res["slots"]
                        ps = prod.call("raw_sums", st, rows=list(range(1024)), row_bytes=64 << 10)
                    if a.corrupt:
                        cons.call("corrupt", st, what="raw", rows=rows)
                    if kind.startswith("one:"):
                        cs = cons.call("raw_sums", st, rows=rows, row_bytes=64 << 10)
                    else:
                        cs = cons.call("raw_sums", st, rows=res["slots"], row_bytes=64 << 10)
                    res["bytes_check"] = compare_sums(ps, cs)
                    cons.call("raw_reset", st)
                res.pop("slots", None)
                return res
            return go

        big = a.raw_reps
        for kind in ("one:1", "one:16", f"one:{a.raw_mib}", "blocks:1", "blocks:8", "threads:4"):
            run.step(f"raw_{kind.replace(':', '_')}", raw(kind, big if kind != "one:1" else big * 2))

        for tokens in a.tokens:
            for pattern in ("contiguous", "scattered"):
                src, dst = block_ids(tokens, pattern, opts["num_blocks"])
                nbytes = a.layers * 2 * len(src) * BLOCK_BYTES
                reps = a.kv_reps if tokens <= 8192 or a.transport != "tcp" else max(1, a.kv_reps // 2)
                est = nbytes / (1.0e9 if a.transport == "tcp" else 50e9) * (reps + 1) + 3

                def kv(src: list[int] = src, dst: list[int] = dst, reps: int = reps,
                       nbytes: int = nbytes) -> dict[str, Any]:
                    secs, prods, checks = [], [], []
                    # Every repetition writes into guard bytes and is checked
                    # on its own (a later one cannot hide an earlier one's
                    # wrong or stray bytes); the checks are outside the timing.
                    cons.call("kv_reset", st)
                    release: Any = None
                    for _ in range(reps):
                        r = stream(src, dst)
                        if r["c"]["kind"] != "consumer_completed":
                            try:
                                cons.call("consumer_release", 15, req=r["req"])
                            except Exception:  # noqa: BLE001
                                pass
                            raise RuntimeError(f"consumer: {r['c']}")
                        if r["c"]["bytes"] != nbytes:
                            raise RuntimeError(f"consumer got {r['c']['bytes']} bytes, expected {nbytes}")
                        secs.append((r["c"]["t_ns"] - r["p"]["t0_ns"]) / 1e9)
                        prods.append({k: r["p"][k] for k in ("calls_s", "released_s", "outcome")})
                        if a.corrupt:
                            cons.call("corrupt", st, what="kv", ids=dst)
                        bc = cons.call("kv_equal", st * 2, src=src, dst=dst)
                        ut = cons.call("kv_untouched", st * 2, ids=dst)
                        ut["ok"] = ut["blocks_touched"] == 0
                        checks.append({"bytes_check": bc, "untouched": ut})
                        release = cons.call("consumer_release", st, req=r["req"])
                        cons.call("kv_reset", st)
                    out = summarize(nbytes, secs)
                    out["producer"] = prods
                    out["stats"] = r["p"]["stats"]
                    # The worst repetition stands for the step.
                    out["bytes_check"] = max((c["bytes_check"] for c in checks),
                                             key=lambda b: (not b["ok"], b["mismatched"]))
                    out["untouched"] = max((c["untouched"] for c in checks),
                                           key=lambda u: (not u["ok"], u["blocks_touched"]))
                    out["checked_repetitions"] = len(checks)
                    out["ok"] = all(c["bytes_check"]["ok"] and c["untouched"]["ok"] for c in checks)
                    out["release"] = release
                    out["blocks"] = len(src)
                    out["ranges_per_layer"] = 2 * len(runs(src, dst))
                    return out

                run.step(f"kv_{tokens}_{pattern}", kv, need_s=min(est, 60))

                def rawkv(src: list[int] = src, dst: list[int] = dst, reps: int = reps) -> dict[str, Any]:
                    cons.call("kv_reset", st)
                    out = prod.call("raw_kv", st * 2, peer=peer, peer_bases=cbases, src=src, dst=dst, reps=reps)
                    out["bytes_check"] = cons.call("kv_equal", st * 2, src=src, dst=dst)
                    cons.call("kv_reset", st)
                    out["ranges_per_layer"] = 2 * len(runs(src, dst))
                    return out

                run.step(f"rawkv_{tokens}_{pattern}", rawkv, need_s=min(est, 60))
        # How many of Mooncake's submit-time events went to the idle stream.
        run.step("submit_wait", lambda: {"producer": prod.call("submit_wait", st)})
    finally:
        prod.stop()
        cons.stop()


def suite_nixl(run: Run, ctx: Any, opts: dict[str, Any]) -> None:
    a = run.args
    st = a.step_timeout
    prod = Child(ctx, "nixl", "producer", opts)
    cons = Child(ctx, "nixl", "consumer", opts)
    try:
        hp = hc = None

        def hello() -> dict[str, Any]:
            nonlocal hp, hc
            hp, hc = prod.recv(a.start_timeout), cons.recv(a.start_timeout)
            conn = prod.call("connect", st, metadata=hc["metadata"])
            strip = lambda h: {k: v for k, v in h.items() if k not in ("metadata", "plane_bases")}  # noqa: E731
            return {"producer": strip(hp), "consumer": strip(hc), "connect": conn}

        run.step("start_and_register", hello)
        if hp is None or hc is None or "connect" not in run.data["steps"]["start_and_register"]:
            raise ChildDied("a process did not start or connect")
        pgpu = hc["gpu"]

        def warm() -> dict[str, Any]:
            # As the Mooncake suite warms up before its first timed step: one
            # untimed KV transfer and one raw write (NIXL prepares its
            # descriptor lists and UCX its cuda_ipc mappings on first use).
            s_, d_ = block_ids(a.tokens[0], "contiguous", opts["num_blocks"])
            cons.call("kv_reset", st)
            prod.call("kv", st * 3, peer_bases=hc["plane_bases"], peer_gpu=pgpu, src=s_, dst=d_, reps=1)
            prod.call("raw", st * 2, dst_base=hc["raw_base"], peer_gpu=pgpu, kind="one:1", reps=1)
            cons.call("kv_reset", st)
            cons.call("raw_reset", st)
            return {"kv_blocks": len(s_), "raw": "one:1"}

        run.step("warmup", warm)

        def raw(kind: str, reps: int) -> Any:
            def go() -> dict[str, Any]:
                res = prod.call("raw", st * 2, dst_base=hc["raw_base"], peer_gpu=pgpu, kind=kind, reps=reps)
                if kind.startswith("one:") and int(kind[4:]) == a.raw_mib:
                    rows = list(range(a.raw_mib * 16))
                    res["bytes_check"] = compare_sums(prod.call("raw_sums", st, rows=rows, row_bytes=64 << 10),
                                                      cons.call("raw_sums", st, rows=rows, row_bytes=64 << 10))
                    cons.call("raw_reset", st)
                elif kind == "blocks:1":
                    res["bytes_check"] = compare_sums(
                        prod.call("raw_sums", st, rows=list(range(1024)), row_bytes=64 << 10),
                        cons.call("raw_sums", st, rows=res["slots"], row_bytes=64 << 10))
                    cons.call("raw_reset", st)
                res.pop("slots", None)
                return res
            return go

        for kind in ("one:1", "one:16", f"one:{a.raw_mib}", "blocks:1"):
            run.step(f"raw_{kind.replace(':', '_')}", raw(kind, a.raw_reps if kind != "one:1" else a.raw_reps * 2))

        for tokens in a.tokens:
            for pattern in ("contiguous", "scattered"):
                src, dst = block_ids(tokens, pattern, opts["num_blocks"])

                def kv(src: list[int] = src, dst: list[int] = dst) -> dict[str, Any]:
                    cons.call("kv_reset", st)
                    out = prod.call("kv", st * 3, peer_bases=hc["plane_bases"], peer_gpu=pgpu, src=src, dst=dst,
                                    reps=a.kv_reps)
                    out["bytes_check"] = cons.call("kv_equal", st * 2, src=src, dst=dst)
                    out["untouched"] = cons.call("kv_untouched", st * 2, ids=dst)
                    out["ok"] = out["bytes_check"]["ok"] and out["untouched"]["blocks_touched"] == 0
                    cons.call("kv_reset", st)
                    out["ranges_per_layer"] = 2 * len(runs(src, dst))
                    return out

                run.step(f"kv_{tokens}_{pattern}", kv)
    finally:
        prod.stop()
        cons.stop()


def suite_torch(run: Run, ctx: Any, opts: dict[str, Any]) -> None:
    a = run.args
    st = a.step_timeout
    one = Child(ctx, "torch", "torch", opts)
    try:
        run.step("start", lambda: {"hello": one.recv(a.start_timeout)})
        for kind in ("one:1", "one:16", f"one:{a.raw_mib}", "blocks:1"):
            run.step(f"raw_{kind.replace(':', '_')}",
                     lambda kind=kind: one.call("raw", st, kind=kind, reps=a.raw_reps * 2))
        for tokens in a.tokens:
            for pattern in ("contiguous", "scattered"):
                src, dst = block_ids(tokens, pattern, opts["num_blocks"])
                run.step(f"kv_{tokens}_{pattern}",
                         lambda src=src, dst=dst: one.call("kv", st, src_ids=src, dst_ids=dst, reps=a.kv_reps))
    finally:
        one.stop()


def cmd_run(args: argparse.Namespace) -> int:
    if args.device == "cpu" and args.suite == "mooncake" and args.transport == "nvlink":
        print("--device cpu needs --transport tcp", file=sys.stderr)
        return 2
    if args.suite == "mooncake":
        if args.transport == "nvlink":
            os.environ["MC_INTRANODE_NVLINK"] = "1"
            os.environ.pop("MC_FORCE_TCP", None)
        else:
            os.environ["MC_FORCE_TCP"] = "1"
            os.environ.pop("MC_INTRANODE_NVLINK", None)
            if args.tcp_queue:
                # Mooncake's TCP transport rejects slices beyond 1024 queued per
                # peer by default (tasks end FAILED: "TCP lane queue-full"); the
                # runtime's window holds more ranges than that for scattered blocks
                os.environ["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] = str(args.tcp_queue)
                os.environ["MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"] = str(args.tcp_queue)
    opts = {
        "device": args.device,
        "src_gpu": args.src_gpu,
        "dst_gpu": args.dst_gpu,
        "layers": args.layers,
        "num_blocks": num_blocks_for(max(args.tokens)),
        "raw_mib": args.raw_mib,
        "step_timeout": args.step_timeout,
        "max_in_flight": args.max_in_flight,
        "max_ranges_in_flight": args.max_ranges_in_flight,
        "writer_lanes": args.writer_lanes,
        "busy": args.busy,
        "submit_wait": args.submit_wait,
    }
    run = Run(args)

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(f"signal {signum}")

    import signal

    signal.signal(signal.SIGTERM, on_term)
    log(f"config {args.suite}/{run.data['transport']} {args.device} {args.src_gpu}->{args.dst_gpu}: "
        f"tokens {args.tokens}, {args.layers} layers, {opts['num_blocks']} blocks/side, budget {args.budget_s:.0f}s")
    ctx = mp.get_context("spawn")
    try:
        {"mooncake": suite_mooncake, "nixl": suite_nixl, "torch": suite_torch}[args.suite](run, ctx, opts)
        run.data["status"] = "done"
    except ChildDied as e:
        run.data["status"] = f"aborted: {e}"
    except Exception as e:  # noqa: BLE001
        run.data["status"] = f"aborted: {type(e).__name__}: {e}"
        traceback.print_exc()
    except SystemExit as e:
        run.data["status"] = f"killed ({e}): time limit"
    run.save()
    log(f"config done: {run.data['status']} in {run.data['elapsed_s']}s -> {run.out}")
    return 0


# ----------------------------------------------------------------------------
# report


def fmt(x: Any, nd: int = 1) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def cell(step: dict[str, Any] | None, check: bool = True) -> str:
    """`GB/s` of a step, with ✗ if its bytes did not check out, or the failure."""
    if not step:
        return "not run"
    if step.get("status") != "ok":
        return f"{step.get('status')} ({first_line(step.get('error', step.get('reason', '')))[:80]})".replace("|", "/")
    g = step.get("gbps_median")
    s = fmt(g, 2 if g is not None and g < 10 else 1)
    bc = step.get("bytes_check")
    if check and bc is not None and not bc.get("ok"):
        s += " ✗bytes"
    if check and step.get("untouched") and step["untouched"].get("blocks_touched"):
        s += " ✗guard"
    return s


def first_line(x: Any) -> str:
    return str(x or "").strip().splitlines()[0][:300] if x else ""


def run_layers(c: dict[str, Any]) -> int:
    return int(c.get("geometry", {}).get("layers", 0))


def place(dev: Any, s: Any, d: Any) -> str:
    return f"GPU{s} → GPU{d}" if dev == "cuda" else "CPU → CPU"


def cmd_report(args: argparse.Namespace) -> int:
    files = sorted(Path(args.dir).glob("*.json"))
    configs = []
    for f in files:
        try:
            configs.append(json.loads(f.read_text()))
        except Exception as e:  # noqa: BLE001
            configs.append({"file": f.name, "status": f"unreadable: {e}", "steps": {}})
    meta = {}
    if args.meta and Path(args.meta).exists():
        meta = json.loads(Path(args.meta).read_text())
    merged = {"generated": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "meta": meta, "configs": configs}

    def find(suite: str, transport: str | None, s: Any, d: Any) -> dict[str, Any] | None:
        for c in configs:
            if c.get("suite") == suite and (transport is None or c.get("transport") == transport) \
                    and c.get("src_gpu") == s and c.get("dst_gpu") == d:
                return c
        return None

    md: list[str] = []
    md.append(f"Generated {merged['generated']} by `benches/gpu/qualify.py report`.")
    if meta:
        md.append("")
        for k, v in meta.items():
            md.append(f"- {k}: {v}")
    pairs = sorted({(c.get("device"), c.get("src_gpu"), c.get("dst_gpu")) for c in configs if c.get("suite")},
                   key=lambda p: (p[1] == p[2], str(p)))
    goals: list[dict[str, Any]] = []
    for dev, s, d in pairs:
        where = place(dev, s, d)
        nixl = find("nixl", None, s, d)
        tch = find("torch", None, s, d)
        for transport in ("nvlink", "tcp"):
            mc = find("mooncake", transport, s, d)
            if not mc:
                continue
            steps = mc["steps"]
            label = {"nvlink": "Mooncake intra-node NVLink (MC_INTRANODE_NVLINK=1)",
                     "tcp": "Mooncake TCP (MC_FORCE_TCP=1)"}[transport]
            md += ["", f"### {where}, {label}", ""]
            md.append(f"Status: {mc.get('status')}; {mc.get('elapsed_s')} s; started {mc.get('started')}.")
            mcenv = {k: v for k, v in (mc.get("env") or {}).items() if k.startswith("MC_")}
            if mcenv:
                md.append("Mooncake environment: " + ", ".join(f"`{k}={v}`" for k, v in mcenv.items()) + ".")
            reg = (steps.get("start_and_register") or {})
            for side in ("producer", "consumer"):
                h = reg.get(side)
                if h:
                    r = h["registration"]
                    md.append(f"- {side}: {h.get('device')} ({h.get('pid')}), Mooncake {h.get('mooncake_version')}, "
                              f"orbitkv {h.get('orbitkv')}, torch {h.get('torch')} (CUDA {h.get('torch_cuda')}); "
                              f"registered {r['regions']} regions, {r['bytes'] / 2**30:.2f} GiB, "
                              f"location {r['location']}, in {r['total_s']} s (median {r['median_ms']} ms, max "
                              f"{r['max_ms']} ms), all registered: {r['is_registered_all']}, allocation bases: "
                              f"{r.get('all_allocation_bases', 'n/a')}; Mooncake says: "
                              + ("; ".join(f"“{x}”" for x in h.get("mooncake_transport") or []) or "nothing logged"))
            if reg.get("status") not in (None, "ok"):
                md.append(f"- start/registration: {reg.get('status')}: {first_line(reg.get('error'))}")
            g = steps.get("guard_bytes")
            if g:
                if g.get("status") == "ok":
                    md.append(f"- guard-byte test: {g['ranges']} ranges (1 B … 3 MiB, odd sizes and offsets), "
                              f"{g['bytes_in_ranges']} bytes written, {g['guard_bytes_checked']} guard bytes checked: "
                              f"{g['mismatched_data_bytes']} wrong data bytes, {g['modified_guard_bytes']} modified "
                              f"guard bytes, edge bytes intact {g['edge_bytes_intact']} → "
                              f"**{'PASS' if g['ok'] else 'FAIL'}**")
                else:
                    md.append(f"- guard-byte test: {g.get('status')}: {first_line(g.get('error'))}")
            # NIXL (UCX picks its own transport: cuda_ipc between GPUs) sits
            # beside the NVLink figures, or beside TCP where NVLink was not run
            show_nixl = nixl is not None and (transport == "nvlink" or find("mooncake", "nvlink", s, d) is None)
            md += ["", "Raw transfers (one batch; GB/s = 10^9 B/s, median):", ""]
            hdr = "| pattern | Mooncake `engine.write` |" + (" NIXL 1.5.1 UCX |" if show_nixl else "") + \
                  (" torch `copy_` |" if tch else "")
            md += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
            raw_mib = f"raw_one_{mc.get('raw_mib', 256)}"
            rows = [("one 1 MiB range", "raw_one_1"), ("one 16 MiB range", "raw_one_16"),
                    (f"one {raw_mib[8:]} MiB range", raw_mib)]
            rows += [("1024 × 64 KiB ranges, 1 batch", "raw_blocks_1"),
                     ("1024 × 64 KiB, 8 batches submitted at once", "raw_blocks_8"),
                     ("1024 × 64 KiB, 4 threads × 1 batch", "raw_threads_4")]
            for name, key in rows:
                line = f"| {name} | {cell(steps.get(key))} |"
                only_mc = key in ("raw_blocks_8", "raw_threads_4")
                if show_nixl and nixl is not None:
                    line += f" {cell(nixl['steps'].get(key)) if not only_mc else '—'} |"
                if tch:
                    line += f" {cell(tch['steps'].get(key)) if not only_mc else '—'} |"
                md.append(line)
            md += ["", "KV streaming, Llama-3-8B geometry (32 layers × K,V planes, 32 KiB per block and plane), "
                   "time from the first `layer_ready` to the consumer's `consumer_completed` (GB/s, median):", ""]
            hdr = "| prompt | block IDs | bytes | ranges/layer | OrbitKV `Runtime` | Mooncake, same ranges |" + \
                  (" NIXL, same ranges |" if show_nixl else "") + (" torch |" if tch else "") + \
                  " bytes + guard check |"
            md += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
            big = steps.get(raw_mib) if raw_mib else None
            per_block = steps.get("raw_blocks_1")
            for tokens in mc.get("tokens", []):
                for pattern in ("contiguous", "scattered"):
                    key = f"kv_{tokens}_{pattern}"
                    k = steps.get(key) or {}
                    rk = steps.get(f"rawkv_{tokens}_{pattern}")
                    size = f"{k['bytes'] / 2**20:.0f} MiB" if k.get("bytes") else "—"
                    line = (f"| {tokens} | {pattern} | {size} | "
                            f"{k.get('ranges_per_layer', '—')} | {cell(k)} | {cell(rk)} |")
                    if show_nixl and nixl is not None:
                        line += f" {cell(nixl['steps'].get(key))} |"
                    if tch:
                        line += f" {cell(tch['steps'].get(key), check=False)} |"
                    if k.get("status") == "ok":
                        bc, ut = k["bytes_check"], k["untouched"]
                        if bc.get("method") == "bytes":  # every byte compared; mismatched counts blocks
                            what = (f"{bc['compared']} bytes compared, {max(bc['mismatched'], 0)} (layer, plane, "
                                    "block) differing")
                        else:  # older results: per-block checksums
                            what = f"{bc['compared'] - max(bc['mismatched'], 0)}/{bc['compared']} blocks equal"
                        line += (f" {'PASS' if k.get('ok') else 'FAIL'}: {what}, {ut['blocks_touched']}/"
                                 f"{ut['blocks_checked']} other blocks touched |")
                    else:
                        line += " — |"
                    md.append(line)
                    if k.get("status") == "ok":
                        nr = k["ranges_per_layer"] * run_layers(mc)
                        gl = {"where": where, "transport": transport, "tokens": tokens, "pattern": pattern,
                              "runtime_gbps": k["gbps_median"],
                              "us_per_range": k["median_s"] / nr * 1e6 if nr else None}
                        if pattern == "contiguous" and big and big.get("status") == "ok":
                            gl["reference"] = f"raw one-range write ({raw_mib[8:]} MiB)"
                            gl["reference_gbps"] = big["gbps_median"]
                            gl["ratio"] = k["gbps_median"] / big["gbps_median"]
                            gl["goal"] = ">= 0.9"
                            gl["bytes_ok"] = bool(k.get("ok")) and bytes_ok(big)
                            gl["met"] = gl["ratio"] >= 0.9 and gl["bytes_ok"]
                        if pattern == "scattered" and per_block and per_block.get("status") == "ok":
                            gl["reference"] = "raw 1024 × 64 KiB, one range per block"
                            gl["reference_gbps"] = per_block["gbps_median"]
                            gl["ratio"] = k["gbps_median"] / per_block["gbps_median"]
                            gl["goal"] = ">= 2"
                            gl["bytes_ok"] = bool(k.get("ok")) and bytes_ok(per_block)
                            gl["met"] = gl["ratio"] >= 2.0 and gl["bytes_ok"]
                        goals.append(gl)
    for c in configs:
        if c.get("suite") in ("nixl", "torch"):
            bad = {k: v for k, v in c.get("steps", {}).items() if v.get("status") != "ok"}
            if bad or c.get("status") != "done":
                md.append("")
                md.append(f"{c['suite']} {place(c.get('device'), c.get('src_gpu'), c.get('dst_gpu'))}: "
                          f"status {c.get('status')}; "
                          + "; ".join(f"{k}: {v.get('status')} {first_line(v.get('error', v.get('reason', '')))[:200]}"
                                      for k, v in bad.items()))
            if c.get("suite") == "nixl":
                h = (c.get("steps", {}).get("start_and_register") or {}).get("producer")
                if h:
                    md.append("")
                    md.append(f"NIXL {place(c.get('device'), c.get('src_gpu'), c.get('dst_gpu'))}: "
                              f"nixl-cu13 {h.get('nixl_cu13')}, "
                              f"plugins {h.get('plugins')}; NIXL columns are transfer-only times (handles created "
                              f"before the clock starts; with creation: see results.json `with_create`).")
    if goals:
        md += ["", "Goals (contiguous: runtime ÷ raw one-range write; scattered: runtime ÷ raw one range per "
               "64 KiB block). µs/range: the runtime's median time ÷ the ranges it wrote (2 planes × runs × layers).",
               "", "| where | transport | prompt | block IDs | runtime GB/s | µs/range | reference | ref GB/s | "
               "ratio | goal | met |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for g in goals:
            if "ratio" in g:
                md.append(f"| {g['where']} | {g['transport']} | {g['tokens']} | {g['pattern']} | "
                          f"{fmt(g['runtime_gbps'], 2)} | {fmt(g['us_per_range'], 2)} | {g['reference']} | "
                          f"{fmt(g['reference_gbps'], 2)} | "
                          f"{fmt(g['ratio'], 2)} | {g['goal']} | "
                          f"{'yes' if g['met'] else ('no (bytes not verified)' if not g.get('bytes_ok', True) else 'no')} |")
    merged["goals"] = goals
    Path(args.out_json).write_text(json.dumps(merged, indent=1, default=str))
    Path(args.out_md).write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run one configuration")
    r.add_argument("--suite", choices=("mooncake", "nixl", "torch"), default="mooncake")
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    r.add_argument("--transport", choices=("nvlink", "tcp"), default="nvlink")
    r.add_argument("--src-gpu", type=int, default=0)
    r.add_argument("--dst-gpu", type=int, default=1)
    r.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 8192, 32768])
    r.add_argument("--layers", type=int, default=32)
    r.add_argument("--raw-mib", type=int, default=256, help="size of the raw buffers (largest one-range write)")
    r.add_argument("--raw-reps", type=int, default=5)
    r.add_argument("--kv-reps", type=int, default=3)
    r.add_argument("--max-in-flight", type=int, default=1 << 30, help="Runtime max_bytes_in_flight_per_peer")
    r.add_argument("--max-ranges-in-flight", type=int, default=768,
                   help="Runtime max_ranges_in_flight_per_peer (orbitkv.pd.max_inflight_ranges; default as there)")
    r.add_argument("--writer-lanes", type=int, default=4,
                   help="Runtime writer_lanes_per_peer (orbitkv.pd.writer_lanes; default as there)")
    r.add_argument("--busy", choices=("none", "default", "side"), default="none",
                   help="keep the producer GPU computing (matmuls) on the legacy default stream or a side stream")
    r.add_argument("--submit-wait", choices=("layer", "device"), default="layer",
                   help="CUDA: Mooncake's submit-time wait on the writer's default stream redirected (the "
                   "PdConnector's default, orbitkv.pd.mooncake_submit_wait) or kept; process-wide, so it applies "
                   "to the raw Mooncake steps too")
    r.add_argument("--step-timeout", type=float, default=60.0)
    r.add_argument("--start-timeout", type=float, default=120.0)
    r.add_argument("--budget-s", type=float, default=120.0, help="skip remaining steps after this")
    r.add_argument("--tcp-queue", type=int, default=65535,
                   help="MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER and MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER for "
                        "--transport tcp (Mooncake's default, 1024, fails scattered KV of >= 8k tokens); "
                        "0 keeps Mooncake's defaults")
    r.add_argument("--corrupt", action="store_true",
                   help="self-test of the checks: damage one written byte and one guard byte before every "
                        "check of the mooncake suite; every check must then report it")
    r.add_argument("--out", required=True)
    p = sub.add_parser("report", help="merge configuration JSONs into results.json and a markdown table")
    p.add_argument("--dir", required=True)
    p.add_argument("--meta", help="JSON object of machine facts to print on top")
    p.add_argument("--out-json", required=True)
    p.add_argument("--out-md", required=True)
    args = ap.parse_args()
    if args.cmd == "run":
        if args.device == "cpu":
            args.src_gpu = args.dst_gpu = None
        return cmd_run(args)
    return cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
