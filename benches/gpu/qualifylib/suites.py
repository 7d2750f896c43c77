"""The steps of each suite, and the `run` command."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from typing import Any

from .common import BLOCK_BYTES, BLOCK_TOKENS, block_ids, guard_ranges, log, num_blocks_for, runs, summarize
from .harness import Child, ChildDied, Run, compare_sums


def suite_mooncake(run: Run, ctx: Any, opts: dict[str, Any]) -> None:
    a = run.args
    st = a.step_timeout
    prod = Child(ctx, "mooncake", "producer", opts)
    # --consumer-ranks both: decode ranks 0 and 1 of TP 2, a process each;
    # else rank 0 alone. `cons` (rank 0) also takes the raw writes.
    conss = [Child(ctx, "mooncake", "consumer", {**opts, "tp_rank": rank}, name=f"consumer{rank or ''}")
             for rank in range(opts.get("consumer_ranks", 1))]
    cons = conss[0]
    try:
        hp = hc = None

        def hello() -> dict[str, Any]:
            nonlocal hp, hc
            hp = prod.recv(a.start_timeout)
            hcs = [c.recv(a.start_timeout) for c in conss]
            hc = hcs[0]
            return {"producer": dict(hp), **{c.role: dict(h) for c, h in zip(conss, hcs)}}

        run.step("start_and_register", hello)
        if hp is None or hc is None:
            raise ChildDied("a process did not start")
        for h in run.data["steps"]["start_and_register"].values():
            if isinstance(h, dict):
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

        def stream(src: list[int], dst: list[int], staged: bool = False) -> dict[str, Any]:
            """One request to every consumer (each decode rank's blocks
            `dst` in its own memory): `cs` its end on each, in rank order;
            `s` from the producer's start to the later rank's end."""
            seq[0] += 1
            req = f"q{seq[0]}"
            hss = [c.call("consumer_open", st, req=req, dst=dst) for c in conss]
            for c in conss:
                c.send("consumer_wait", req=req, scatter=dst if staged else None)
            prod.send("producer_stream", req=req, src=src, handshakes=hss, staged=staged)
            p = prod.recv(st + 10)
            cs = [c.recv(st + 10) for c in conss]
            return {"req": req, "p": p, "cs": cs, "s": (max(c["t_ns"] for c in cs) - p["t0_ns"]) / 1e9,
                    "granted": [json.loads(hs).get("staging") is not None for hs in hss]}

        def warm() -> dict[str, Any]:
            """One untimed request direct and, with staging, one staged with
            contiguous and one with scattered blocks (pages and grant): the
            first of each pays for the staging views being built, the copy
            kernels' first launch and the pinned block IDs' first buffer,
            which no timed repetition should (the direct path's warm-up
            opens the peer's segment and maps its memory)."""
            kinds = [("contiguous", False)]
            if a.staging == "on":
                kinds += [("contiguous", True), ("scattered", True)]
            out: dict[str, Any] = {}
            for pattern, staged in kinds:
                s, d = block_ids(a.tokens[0], pattern, opts["num_blocks"])
                r = stream(s, d, staged)
                for c in conss:
                    c.call("consumer_release", st, req=r["req"])
                    c.call("kv_reset", st)
                out[f"{pattern}{' staged' if staged else ''}"] = {
                    "consumer": [c["kind"] for c in r["cs"]], "producer": r["p"]["outcome"],
                    "s": round(r["s"], 4)}
            return out

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
                # --consumer-tp 2: each consumer takes its head slice of each block
                per_rank = a.layers * 2 * len(src) * BLOCK_BYTES // a.consumer_tp
                nbytes = per_rank * len(conss)
                reps = a.kv_reps if tokens <= 8192 or a.transport != "tcp" else max(1, a.kv_reps // 2)
                est = nbytes / (1.0e9 if a.transport == "tcp" else 50e9) * (reps + 1) + 3

                def kv(src: list[int] = src, dst: list[int] = dst, reps: int = reps,
                       nbytes: int = nbytes, per_rank: int = per_rank, staged: bool = False) -> dict[str, Any]:
                    secs, prods, checks, scatters = [], [], [], []
                    modes: set[str] = set()
                    # Every repetition writes into guard bytes and is checked
                    # on its own (a later one cannot hide an earlier one's
                    # wrong or stray bytes); the checks are outside the timing.
                    # Staged: the clock runs from before the producer's first
                    # gather to the consumer's scatter done (synchronized).
                    # With both decode ranks: to the later rank's end, each
                    # rank checked.
                    for c in conss:
                        c.call("kv_reset", st)
                    release: Any = None
                    for _ in range(reps):
                        r = stream(src, dst, staged)
                        # staged: into the grant (the consumer scatters) or,
                        # without one, from source staging into the pages
                        bad = [(rank, c) for rank, c in enumerate(r["cs"])
                               if c["kind"] != "consumer_completed" or (staged and not c["staged"] and r["granted"][rank])]
                        if bad:
                            for c in conss:
                                try:
                                    c.call("consumer_release", 15, req=r["req"])
                                except Exception:  # noqa: BLE001
                                    pass
                            rank, c = bad[0]
                            why = "" if c["kind"] != "consumer_completed" else "not staged: "
                            raise RuntimeError(f"consumer (rank {rank}): {why}{c}; producer: {r['p']['delta']}")
                        for rank, c in enumerate(r["cs"]):
                            if c["bytes"] != per_rank:
                                raise RuntimeError(f"consumer (rank {rank}) got {c['bytes']} bytes, expected {per_rank}")
                        secs.append(r["s"])
                        prods.append({k: r["p"].get(k) for k in ("calls_s", "gather_s", "released_s", "outcome", "delta",
                                                                  "group", "gpu_trace", "t0_ns")})
                        prods[-1]["req"] = r["req"]
                        prods[-1]["done_ns"] = [c["t_ns"] for c in r["cs"]]
                        for rank, (cc, c) in enumerate(zip(conss, r["cs"])):
                            if a.corrupt:
                                cc.call("corrupt", st, what="kv", ids=dst)
                                if staged:
                                    cc.call("corrupt", st, what="stage")
                            bc = cc.call("kv_equal", st * 2, src=src, dst=dst)
                            ut = cc.call("kv_untouched", st * 2, ids=dst)
                            ut["ok"] = ut["blocks_touched"] == 0
                            checks.append({"rank": rank, "bytes_check": bc, "untouched": ut})
                            if staged:
                                checks[-1]["stage"] = cc.call("stage_untouched", st * 2, req=r["req"])
                                scatters.append(c["staged"]["scatter_s"] if c["staged"] else 0.0)
                                modes.add("grant" if c["staged"] else "pages")
                        releases = [cc.call("consumer_release", st, req=r["req"]) for cc in conss]
                        release = releases[0] if len(releases) == 1 else releases
                        for cc in conss:
                            cc.call("kv_reset", st)
                    out = summarize(nbytes, secs)
                    out["producer"] = prods
                    out["stats"] = r["p"]["stats"]
                    # The worst repetition stands for the step.
                    out["bytes_check"] = max((c["bytes_check"] for c in checks),
                                             key=lambda b: (not b["ok"], b["mismatched"]))
                    out["untouched"] = max((c["untouched"] for c in checks),
                                           key=lambda u: (not u["ok"], u["blocks_touched"]))
                    out["checked_repetitions"] = len(checks) // len(conss)
                    out["checked_ranks"] = len(conss)
                    out["ok"] = all(c["bytes_check"]["ok"] and c["untouched"]["ok"]
                                    and c.get("stage", {"ok": True})["ok"] for c in checks)
                    out["release"] = release
                    out["blocks"] = len(src)
                    # What the runtime submitted (producer counters), the most of
                    # any repetition; with both decode ranks, to both.
                    deltas = [p_["delta"] for p_ in prods]
                    out["ranges_per_layer_submitted"] = max(d["write_ranges"] for d in deltas) / a.layers
                    out["batches_per_layer_submitted"] = max(d["write_batches"] for d in deltas) / a.layers
                    out["layers_staged"] = min(d["layers_staged"] for d in deltas)
                    out["ranges_per_layer"] = 2 * len(runs(src, dst))
                    if staged:
                        out["staged"] = True
                        out["ranges_per_layer_direct"] = out["ranges_per_layer"]
                        out["ranges_per_layer"] = out["ranges_per_layer_submitted"]
                        out["gather_s"] = [round(p_["gather_s"], 6) for p_ in prods]
                        out["scatter_s"] = [round(x, 6) for x in scatters]
                        out["stage_untouched"] = max((c["stage"] for c in checks),
                                                     key=lambda u: (not u["ok"], u["bytes_modified"]))
                        out["grant"] = out["stage_untouched"].pop("grant")
                        # into the consumer's grant and scattered, or from
                        # source staging straight into its pages
                        out["staged_into"] = "/".join(sorted(modes))
                        out["source_group"] = max(p_["group"] for p_ in prods)
                        # a layer write per decode rank
                        if out["layers_staged"] != a.layers * len(conss):  # bytes right, but not all staged
                            out["ok"] = False
                            out["staging_problem"] = (f"{out['layers_staged']} of {a.layers * len(conss)} "
                                                      "layer writes staged")
                    return out

                run.step(f"kv_{tokens}_{pattern}", kv, need_s=min(est, 60))
                if a.staging == "on" and (pattern == "scattered" or a.consumer_tp > 1):
                    run.step(f"kv_{tokens}_{pattern}_staged", lambda kv=kv: kv(staged=True), need_s=min(est, 60))
                if a.consumer_tp > 1:
                    continue  # the raw writes below are of whole blocks

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
        for c in conss:
            c.stop()


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
        "busy_in": args.busy_in,
        "submit_wait": args.submit_wait,
        # staging sized for the largest request (its staged copy is as large as its KV)
        "staging_blocks": max(args.tokens) // BLOCK_TOKENS if args.suite == "mooncake" and args.staging == "on" else 0,
        "staging_min_ranges": args.staging_min_ranges,
        "head_major": args.head_major,
        "consumer_tp": args.consumer_tp,
        "consumer_ranks": args.consumer_tp if args.consumer_ranks == "both" else 1,
        "gather": args.gather,
        "trace": args.trace,
        "notify_poll_ms": args.notify_poll_ms,
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
