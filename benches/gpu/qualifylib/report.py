"""`results.json` and `results.md` from the runs' files (the `report` command)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from .harness import bytes_ok

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
    if check and step.get("stage_untouched") and step["stage_untouched"].get("bytes_modified"):
        s += " ✗staging"
    return s


def first_line(x: Any) -> str:
    return str(x or "").strip().splitlines()[0][:300] if x else ""


def check_text(k: dict[str, Any]) -> str:
    """The bytes + guard check of a KV step, in words (— if the step did not run)."""
    if k.get("status") != "ok":
        return "—"
    bc, ut = k["bytes_check"], k["untouched"]
    if bc.get("method") == "bytes":  # every byte compared; mismatched counts blocks
        what = f"{bc['compared']} bytes compared, {max(bc['mismatched'], 0)} (layer, plane, block) differing"
    else:  # older results: per-block checksums
        what = f"{bc['compared'] - max(bc['mismatched'], 0)}/{bc['compared']} blocks equal"
    what += f", {ut['blocks_touched']}/{ut['blocks_checked']} other blocks touched"
    su = k.get("stage_untouched")
    if su:
        what += f", {su['bytes_modified']}/{su['bytes_checked']} staging bytes outside the grant modified"
    if k.get("staging_problem"):
        what += f", {k['staging_problem']}"
    return f"{'PASS' if k.get('ok') else 'FAIL'}: {what}"


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    """Median GB/s of step `a` over step `b`, when both ran."""
    if not a or not b or a.get("status") != "ok" or b.get("status") != "ok":
        return None
    ga, gb = a.get("gbps_median"), b.get("gbps_median")
    return ga / gb if ga and gb else None


def ms(xs: list[float] | None) -> str:
    """The median of `xs` seconds in ms."""
    return fmt(statistics.median(xs) * 1e3, 2) if xs else "—"


def run_layers(c: dict[str, Any]) -> int:
    return int(c.get("geometry", {}).get("layers", 0))


def place(dev: Any, s: Any, d: Any) -> str:
    return f"GPU{s} → GPU{d}" if dev == "cuda" else "CPU → CPU"


def staged_table(md: list[str], goals: list[dict[str, Any]], steps: dict[str, Any], mc: dict[str, Any],
                 where: str, transport: str, per_block: dict[str, Any] | None) -> None:
    """The scattered KV cases through staging beside the direct ones, and
    their goal rows (staged ÷ raw one range per 64 KiB block >= 2, met only
    when both steps' bytes checked out)."""
    staged = [t for t in mc.get("tokens", []) if f"kv_{t}_scattered_staged" in steps]
    if not staged:
        if (mc.get("staging") or "off") == "off":
            md += ["", "Staging: not run (`--staging off`, or a run from before it)."]
        return
    md += ["", "Scattered KV through staging (`--staging on`, staging_min_ranges "
           f"{mc.get('staging_min_ranges')}): the producer gathers each layer into its source staging "
           + ("and hands the layer over with a CUDA event after the gather (`layers_ready_after`: its writer "
              "waits for the event, the host does not; gather ms is then the launches alone)"
              if mc.get("gather") == "event" and mc.get("device") == "cuda"
              else "and waits for the gather before its `layer_ready`")
           + ", the runtime writes it into the consumer's grant, the consumer scatters the grant into "
           "its pages; timed from before the first gather to the scatter done (synchronized). Ranges/layer: what "
           "the runtime submitted (producer's `write_ranges` ÷ layers). Ratios of medians.", ""]
    hdr = ("| prompt | bytes | ranges/layer direct → staged | layers staged | direct GB/s | staged GB/s | "
           "Mooncake, same ranges | staged ÷ Mooncake same ranges | staged ÷ direct | staged ÷ raw 1024 × 64 KiB | "
           "gather ms | scatter ms | bytes + guard check |")
    md += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for tokens in staged:
        sk = steps[f"kv_{tokens}_scattered_staged"]
        k = steps.get(f"kv_{tokens}_scattered") or {}
        rk = steps.get(f"rawkv_{tokens}_scattered")
        ok = sk.get("status") == "ok"
        size = f"{sk['bytes'] / 2**20:.0f} MiB" if sk.get("bytes") else "—"
        direct_r = k.get("ranges_per_layer_submitted", k.get("ranges_per_layer"))
        rng = f"{fmt(direct_r, 0)} → {fmt(sk['ranges_per_layer'], 0)}" if ok else "—"
        nl = run_layers(mc)
        ls = f"{sk.get('layers_staged')}/{nl}" if ok else "—"
        md.append(f"| {tokens} | {size} | {rng} | {ls} | "
                  f"{cell(k)} | {cell(sk)} | {cell(rk)} | {fmt(ratio(sk, rk), 2)} | {fmt(ratio(sk, k), 2)} | "
                  f"{fmt(ratio(sk, per_block), 2)} | {ms(sk.get('gather_s'))} | {ms(sk.get('scatter_s'))} | "
                  f"{check_text(sk)} |")
        if ok:
            nr = sk["ranges_per_layer"] * nl
            gl = {"where": where, "transport": transport, "tokens": tokens, "pattern": "scattered, staged",
                  "runtime_gbps": sk["gbps_median"], "us_per_range": sk["median_s"] / nr * 1e6 if nr else None,
                  "vs_mooncake_same_ranges": ratio(sk, rk), "vs_direct": ratio(sk, k)}
            if per_block and per_block.get("status") == "ok":
                gl["reference"] = "raw 1024 × 64 KiB, one range per block"
                gl["reference_gbps"] = per_block["gbps_median"]
                gl["ratio"] = sk["gbps_median"] / per_block["gbps_median"]
                gl["goal"] = ">= 2"
                gl["bytes_ok"] = bool(sk.get("ok")) and bytes_ok(sk) and bytes_ok(per_block)
                gl["met"] = gl["ratio"] >= 2.0 and gl["bytes_ok"]
            goals.append(gl)


def met_text(g: dict[str, Any]) -> str:
    if not g.get("bytes_ok", True):
        return "no (bytes not verified)"
    if g["met"] is None:
        return "—"
    return "yes" if g["met"] else "no"


def hetero_goals(goals: list[dict[str, Any]], mc: dict[str, Any], mcs: list[dict[str, Any]], where: str,
                 transport: str) -> None:
    """Issue 13's heterogeneous-TP goal: head slices, staged, at >= 0.5 x the
    same run's TP 1 -> 1 contiguous figure of the same layout and transport
    (met only when both steps' bytes checked out), for decode rank 0 alone.
    With both decode ranks in the request (--consumer-ranks both) the ratio
    is the whole TP 1 -> 2 request's against the TP 1 -> 1 one (the same
    bytes): reported beside the goal, not as it."""
    geo = mc.get("geometry") or {}
    whole = (geo.get("consumer_ranks") or 1) > 1
    ref = next((c for c in mcs if c.get("transport") == mc.get("transport")
                and (c.get("geometry") or {}).get("layout") == geo.get("layout")
                and ((c.get("geometry") or {}).get("consumer_tp") or 1) == 1
                and (c.get("runtime") or {}).get("notify_poll_ms") == (mc.get("runtime") or {}).get("notify_poll_ms")),
               None)
    if ref is None:
        return
    for tokens in mc.get("tokens", []):
        for pattern in ("contiguous", "scattered"):
            sk = mc["steps"].get(f"kv_{tokens}_{pattern}_staged")
            rk = ref["steps"].get(f"kv_{tokens}_contiguous")
            if not sk or sk.get("status") != "ok" or not rk or rk.get("status") != "ok":
                continue
            r = sk["gbps_median"] / rk["gbps_median"]
            ok = bool(sk.get("ok")) and bool(rk.get("ok"))
            goal = {"where": where, "transport": transport, "tokens": tokens,
                    "pattern": f"head slices, {pattern} blocks, staged into {sk.get('staged_into', 'grant')}",
                    "runtime_gbps": sk["gbps_median"],
                    "us_per_range": None, "reference": "TP 1 → 1 contiguous, same run",
                    "reference_gbps": rk["gbps_median"], "ratio": r, "goal": ">= 0.5", "bytes_ok": ok,
                    "met": r >= 0.5 and ok}
            if whole:
                goal.update(pattern=f"whole TP 1 → 2 request (both ranks), {pattern} blocks, staged into "
                                    f"{sk.get('staged_into', 'grant')}", goal="none (beside the goal)", met=None)
            goals.append(goal)


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
        # Every Mooncake configuration of the pair, NVLink first, in run
        # order; one that differs from the first of its transport in layout
        # or consumer TP is named by that (and compared with NIXL and torch
        # only when it has their layout).
        mcs = [c for c in configs if c.get("suite") == "mooncake" and c.get("src_gpu") == s
               and c.get("dst_gpu") == d and c.get("transport") in ("nvlink", "tcp")]
        mcs.sort(key=lambda c: c.get("transport") != "nvlink")
        for mc in mcs:
            transport = mc["transport"]
            steps = mc["steps"]
            geo = mc.get("geometry") or {}
            variant = ""
            if "HND" in str(geo.get("layout", "")):
                variant += ", HND blocks"
            if (geo.get("consumer_tp") or 1) > 1:
                variant += (f", to both decode ranks of TP {geo['consumer_tp']} (head slices, the whole request)"
                            if (geo.get("consumer_ranks") or 1) > 1
                            else f", to decode rank 0 of TP {geo['consumer_tp']} (head slices)")
            if (mc.get("runtime") or {}).get("notify_poll_ms") is not None:
                variant += f", notify_poll {mc['runtime']['notify_poll_ms']:g} ms"
            plain = (geo.get("consumer_tp") or 1) == 1
            nixl, tch = (o if o is not None and plain and (o.get("geometry") or {}).get("layout") == geo.get("layout")
                         else None for o in (find("nixl", None, s, d), find("torch", None, s, d)))
            label = {"nvlink": "Mooncake intra-node NVLink (MC_INTRANODE_NVLINK=1)",
                     "tcp": "Mooncake TCP (MC_FORCE_TCP=1)"}[transport] + variant
            transport = transport + variant
            md += ["", f"### {where}, {label}", ""]
            md.append(f"Status: {mc.get('status')}; {mc.get('elapsed_s')} s; started {mc.get('started')}.")
            mcenv = {k: v for k, v in (mc.get("env") or {}).items() if k.startswith("MC_")}
            if mcenv:
                md.append("Mooncake environment: " + ", ".join(f"`{k}={v}`" for k, v in mcenv.items()) + ".")
            reg = (steps.get("start_and_register") or {})
            for side in ("producer", "consumer", "consumer1"):
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
            show_nixl = nixl is not None and (mc["transport"] == "nvlink" or find("mooncake", "nvlink", s, d) is None)
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
                   "time from the first `layer_ready` to the consumer's `consumer_completed` (staged: from before the first "
                   "gather to the consumer's scatter done; GB/s, median):", ""]
            staging = mc.get("staging") or "off"
            hdr = "| prompt | block IDs | bytes | ranges/layer | OrbitKV `Runtime` | OrbitKV staged |" + \
                  " Mooncake, same ranges |" + \
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
                    if pattern != "scattered":
                        sg = "—"
                    elif staging == "off":
                        sg = "off"
                    else:
                        sk = steps.get(f"{key}_staged")
                        sg = cell(sk) + (f" ({fmt(sk['ranges_per_layer'], 0)} ranges/layer)"
                                         if sk and sk.get("status") == "ok" else "")
                    line = (f"| {tokens} | {pattern} | {size} | "
                            f"{k.get('ranges_per_layer', '—')} | {cell(k)} | {sg} | {cell(rk)} |")
                    if show_nixl and nixl is not None:
                        line += f" {cell(nixl['steps'].get(key))} |"
                    if tch:
                        line += f" {cell(tch['steps'].get(key), check=False)} |"
                    line += f" {check_text(k)} |"
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
            staged_table(md, goals, steps, mc, where, transport, per_block)
            if (geo.get("consumer_tp") or 1) > 1:
                hetero_goals(goals, mc, mcs, where, transport)
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
               "64 KiB block; scattered, staged: the same, gathers and scatter inside the time; met only when the "
               "bytes of both checked out). µs/range: the runtime's median time ÷ the ranges it wrote (direct: "
               "2 planes × runs × layers; staged: the ranges it submitted).",
               "", "| where | transport | prompt | block IDs | runtime GB/s | µs/range | reference | ref GB/s | "
               "ratio | goal | met |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for g in goals:
            if "ratio" in g:
                md.append(f"| {g['where']} | {g['transport']} | {g['tokens']} | {g['pattern']} | "
                          f"{fmt(g['runtime_gbps'], 2)} | {fmt(g['us_per_range'], 2)} | {g['reference']} | "
                          f"{fmt(g['reference_gbps'], 2)} | "
                          f"{fmt(g['ratio'], 2)} | {g['goal']} | "
                          f"{met_text(g)} |")
    merged["goals"] = goals
    Path(args.out_json).write_text(json.dumps(merged, indent=1, default=str))
    Path(args.out_md).write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0
