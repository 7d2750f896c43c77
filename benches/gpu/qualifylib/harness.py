"""The orchestrating process: a child per side, and a run's steps saved as
they end."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from .common import BLOCK_BYTES, BLOCK_TOKENS, HEAD_DIM, KV_HEADS, log, num_blocks_for
from .sides import child_main

# ----------------------------------------------------------------------------
# the orchestrating process


class ChildDied(Exception):
    pass


class Child:
    def __init__(self, ctx: Any, kind: str, role: str, opts: dict[str, Any], name: str | None = None) -> None:
        self.role = name or role
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=child_main, args=(kind, role, theirs, opts), daemon=True, name=self.role)
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
                         "num_blocks": num_blocks_for(max(args.tokens)),
                         "layout": "[2, num_blocks, 8, 16, 128] (head-major, HND)" if getattr(args, "head_major", False)
                         else "[2, num_blocks, 16, 8, 128]",
                         "consumer_tp": getattr(args, "consumer_tp", 1),
                         # decode ranks taking part: 1 (rank 0 alone) or all of consumer_tp
                         "consumer_ranks": getattr(args, "consumer_tp", 1)
                         if getattr(args, "consumer_ranks", "0") == "both" else 1},
            "tokens": args.tokens,
            "raw_mib": args.raw_mib,
            "runtime": {"notify_poll_ms": getattr(args, "notify_poll_ms", None),
                        "max_bytes_in_flight_per_peer": args.max_in_flight,
                        "max_ranges_in_flight_per_peer": args.max_ranges_in_flight,
                        "writer_lanes_per_peer": args.writer_lanes},
            "busy": args.busy,
            "busy_in": getattr(args, "busy_in", "producer"),
            "staging": getattr(args, "staging", "off") if args.suite == "mooncake" else None,
            "staging_min_ranges": getattr(args, "staging_min_ranges", None),
            "gather": getattr(args, "gather", None),
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
