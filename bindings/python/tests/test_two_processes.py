"""A writer and a receiver in two processes (as prefill and decode workers are)."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
from _util import addr

import orbitkv

N = 4 << 20
GUARD = 4096
FILL = 0xAB


def pattern() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, size=N, dtype=np.uint8)


def receiver(conn) -> None:  # runs in the child process
    from _util import wait_for_notifications

    with orbitkv.MooncakeTransferEngine() as engine:
        buf = np.full(GUARD + N + GUARD, FILL, dtype=np.uint8)
        engine.register_memory(buf)
        conn.send((engine.endpoint, addr(buf) + GUARD))
        notes = wait_for_notifications(engine, 1, timeout_s=60.0)
        conn.send(
            {
                "notes": notes,
                "data_ok": bool(np.array_equal(buf[GUARD : GUARD + N], pattern())),
                "guards_ok": bool((buf[:GUARD] == FILL).all() and (buf[GUARD + N :] == FILL).all()),
                "later": engine.take_notifications(),
            }
        )


def test_write_and_notify_across_processes():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child,))
    proc.start()
    try:
        assert parent.poll(60), "the receiver did not start"
        peer, dst = parent.recv()
        src = pattern()
        with orbitkv.MooncakeTransferEngine() as engine:
            engine.register_memory(src)
            half = N // 2
            written = engine.write(peer, [(addr(src), dst, half), (addr(src) + half, dst + half, N - half)])
            assert written == N
            engine.send_notification(peer, "req-7", "kv ready")
            assert parent.poll(60), "the receiver did not report"
            report = parent.recv()
        assert report["notes"] == [("req-7", b"kv ready")]
        assert report["data_ok"], "bytes differ in the other process"
        assert report["guards_ok"], "guard bytes changed in the other process"
        assert report["later"] == [], "a notification was delivered twice"
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
