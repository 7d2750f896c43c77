"""A 16 MB handshake through the side channel: the Rust server
(`orbitkv.SideChannel`) against the Python server it replaced
(`SideChannelServer`, `ThreadingHTTPServer`, taken from git at `--old-rev`).

For each server, with a deployment key: one handshake of just under 16 MiB
(2 million block IDs) admitted (`200`, parked for a request not yet open),
one refused after parsing (`403`, a forged capability for an open request),
and one refused before parsing (`401`, unsigned). The client is
another process (`urllib`, as the decode side), so it does not compete for
this process's GIL; meanwhile a thread here ticks every millisecond and
records the longest gap, i.e. how long the server held this process's GIL.

    PYTHONPATH=bindings/python/python python benches/side_channel_16mb.py

Prints one line per (server, case): the client's wall time and the longest
GIL stall. Times it once each (no repetitions): a rough comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import types

import orbitkv

CAP = "0123456789abcdef" * 4
STRANGER = "f" * 64
KEY = b"deployment-key-0123456789"
CLIENT = r"""
import hashlib, hmac, sys, time, urllib.request, urllib.error
addr, path, key = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
body = open(path, "rb").read()
headers = {"Content-Type": "application/json"}
if key:
    headers["X-OrbitKV-Signature"] = "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()
req = urllib.request.Request(f"http://{addr}/orbitkv/v1/handshake", data=body, method="POST", headers=headers)
t = time.perf_counter()
try:
    with urllib.request.urlopen(req, timeout=60) as r:
        status = r.status; r.read()
except urllib.error.HTTPError as e:
    status = e.code; e.read()
print(status, time.perf_counter() - t)
"""


def layout(base: int, blocks: int) -> str:
    return json.dumps(
        {
            "num_blocks": blocks,
            "block_size": 16,
            "total_kv_heads": 2,
            "tp_rank": 0,
            "tp_size": 1,
            "head_major": True,
            "layers": [{"planes": [{"base": base, "block_stride": 256, "block_bytes": 256}]}],
        }
    )


def old_server_class(rev: str) -> type:
    src = subprocess.run(
        ["git", "show", f"{rev}:bindings/python/python/orbitkv/vllm/side_channel.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    mod = types.ModuleType("old_side_channel")
    exec(compile(src, "old_side_channel.py", "exec"), mod.__dict__)
    return mod.SideChannelServer


class Ticker:
    """Records the longest gap between 1 ms sleeps of a thread of this process."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now

    def stop(self) -> float:
        self._stop.set()
        self._t.join()
        return self.longest


def post(addr: str, body_path: str, key: bytes) -> tuple[int, float, float]:
    ticker = Ticker()
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, addr, body_path, key.hex()], check=True, capture_output=True, text=True
    )
    stall = ticker.stop()
    status, secs = out.stdout.split()
    return int(status), float(secs), stall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-rev", default="f1d2420", help="git revision holding the Python server")
    ap.add_argument("--blocks", type=int, default=2_000_000)
    args = ap.parse_args()

    # The runtime alone (no HTTP): what parsing and checking cost.
    engines = [orbitkv.MooncakeTransferEngine() for _ in range(2)]
    consumer = orbitkv.Runtime(engines[0], layout(1 << 40, args.blocks))
    producer = orbitkv.Runtime(engines[1], layout(2 << 40, args.blocks))
    hs = consumer.consumer_open("direct", CAP, 0, list(range(args.blocks)), 1)
    t = time.perf_counter()
    producer.producer_handshake(hs)
    print(f"Runtime.producer_handshake alone (parse, check, park): {(time.perf_counter() - t) * 1e3:.1f} ms")
    t = time.perf_counter()
    json.loads(hs)
    print(f"Python's json.loads of the same text, for scale: {(time.perf_counter() - t) * 1e3:.1f} ms")
    producer.shutdown()
    consumer.shutdown()
    for e in engines:
        e.close()

    engines = [orbitkv.MooncakeTransferEngine() for _ in range(2)]
    consumer = orbitkv.Runtime(engines[0], layout(1 << 40, args.blocks))
    ids = list(range(args.blocks))
    bodies = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cap in (("admit", CAP), ("forbid", STRANGER), ("unsigned", CAP)):
            for server in ("rust", "python"):
                hs = consumer.consumer_open(f"{name}-{server}", cap, 0, ids, 1)
                path = os.path.join(tmp, f"{name}-{server}.json")
                with open(path, "w") as f:
                    f.write(hs)
                bodies[(name, server)] = path
        size = os.path.getsize(bodies[("admit", "rust")])
        assert size <= 16 << 20, f"{size} bytes: use fewer --blocks"
        print(f"handshake: {size} bytes ({size / (1 << 20):.2f} MiB), {args.blocks} block IDs")

        Old = old_server_class(args.old_rev)
        for server in ("rust", "python"):
            producer = orbitkv.Runtime(engines[1], layout(2 << 40, args.blocks))
            producer.producer_open(f"forbid-{server}", [0], CAP)  # open: a stranger is refused
            if server == "rust":
                sc = orbitkv.SideChannel(producer, "127.0.0.1", 0, key=KEY)
            else:
                sc = Old("127.0.0.1", 0, producer.producer_handshake, producer.producer_cancel, key=KEY)
            try:
                for name, expect in (("admit", 200), ("forbid", 403), ("unsigned", 401)):
                    key = b"" if name == "unsigned" else KEY
                    status, secs, stall = post(sc.address, bodies[(name, server)], key)
                    assert status == expect, (server, name, status)
                    print(
                        f"{server:6} server  {name:8} -> {status}: {secs * 1e3:7.1f} ms at the client, "
                        f"longest GIL stall in the server process {stall * 1e3:6.1f} ms"
                    )
            finally:
                sc.close()
                producer.shutdown()
    consumer.shutdown()
    for e in engines:
        e.close()


if __name__ == "__main__":
    main()
