#!/usr/bin/env python3
"""Mooncake's own Python binding as the sender side of `benches/transport.rs`.

Driven by the Rust benchmark over stdin/stdout (one command per line), so both
bindings send the same bytes in the same batch shapes to the same receiver
process, interleaved in time:

    READY <endpoint>                          (printed once at start)
    RUN <target> <dst_base> <count> <size> <iters>
        -> RESULT <seconds> <seconds> ...     (one per iteration)
    EXIT

The sender is `mooncake.engine.TransferEngine` initialised as upstream
documents it for P2P: initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""),
a registered numpy source buffer, and `batch_transfer_sync_write(target,
buffers, peer_buffer_addresses, lengths)` timed around the call only (the
address lists are built before the clock starts).
"""

import sys
import time

import numpy as np
from mooncake.engine import TransferEngine


def main() -> int:
    src_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 64 << 20
    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        print(f"ERR initialize returned {rc}", flush=True)
        return 2
    endpoint = f"127.0.0.1:{engine.get_rpc_port()}"
    # Touched (ones), so no first-touch page faults during timing.
    src = np.ones(src_bytes, dtype=np.uint8)
    src_addr = src.ctypes.data
    rc = engine.register_memory(src_addr, src.nbytes)
    if rc != 0:
        print(f"ERR register_memory returned {rc}", flush=True)
        return 2
    print(f"READY {endpoint}", flush=True)

    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "EXIT":
            break
        if words[0] != "RUN" or len(words) != 6:
            print(f"ERR bad command {line.strip()!r}", flush=True)
            continue
        target = words[1]
        dst_base, count, size, iters = (int(w) for w in words[2:])
        if count * size > src.nbytes:
            print(f"ERR {count}x{size} exceeds the {src.nbytes}-byte source", flush=True)
            continue
        buffers = [src_addr + i * size for i in range(count)]
        peers = [dst_base + i * size for i in range(count)]
        lengths = [size] * count
        times = []
        failed = None
        for _ in range(iters):
            t = time.perf_counter()
            rc = engine.batch_transfer_sync_write(target, buffers, peers, lengths)
            dt = time.perf_counter() - t
            if rc != 0:
                failed = rc
                break
            times.append(dt)
        if failed is not None:
            print(f"ERR batch_transfer_sync_write returned {failed}", flush=True)
        else:
            print("RESULT " + " ".join(f"{x:.9f}" for x in times), flush=True)

    engine.unregister_memory(src_addr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
