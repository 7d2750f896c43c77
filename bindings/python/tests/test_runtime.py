"""`orbitkv.Runtime` from Python, against real Mooncake on 127.0.0.1: a
producer rank streams layers of torch KV tensors into a consumer rank's
authorized blocks; bytes are checked, unauthorized blocks untouched, and each
runtime error surfaces as its own exception class."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import torch
from _util import wait_event

import orbitkv

LAYERS, BLOCKS, HEADS, BLOCK, HEAD_DIM = 3, 16, 2, 16, 8
GUARD = -7.0
# The capability both halves of every test request share (a router gives
# each request its own).
CAP = "0123456789abcdef" * 4


def layout_json(caches: list[torch.Tensor]) -> str:
    es = caches[0].element_size()
    return json.dumps(
        {
            "num_blocks": BLOCKS,
            "block_size": BLOCK,
            "total_kv_heads": HEADS,
            "tp_rank": 0,
            "tp_size": 1,
            "head_major": True,
            "layers": [
                {
                    "planes": [
                        {
                            "base": t.data_ptr(),
                            "block_stride": t.stride(0) * es,
                            "block_bytes": t[0].numel() * es,
                        }
                    ]
                }
                for t in caches
            ],
        }
    )


class Rank:
    """A rank with vLLM-CPU-shaped KV tensors [blocks, heads, block, 2*head_dim]."""

    def __init__(self, fill: float | None) -> None:
        self.engine = orbitkv.MooncakeTransferEngine()
        if fill is None:
            self.caches = [torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM) for _ in range(LAYERS)]
        else:
            self.caches = [torch.full((BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM), fill) for _ in range(LAYERS)]
        for t in self.caches:
            self.engine.register_memory(t)
        self.layout_json = layout_json(self.caches)
        self.runtime = orbitkv.Runtime(self.engine, self.layout_json, consumer_timeout_s=20.0)

    def close(self) -> None:
        self.runtime.shutdown()
        self.engine.close()


@pytest.fixture
def ranks() -> Iterator[tuple[Rank, Rank]]:
    p, c = Rank(None), Rank(GUARD)
    yield p, c
    p.close()
    c.close()


def test_layers_stream_into_authorized_blocks(ranks: tuple[Rank, Rank]) -> None:
    p, c = ranks
    src, dst = [0, 1, 2, 9], [4, 5, 6, 11]
    hs = c.runtime.consumer_open("req-py", CAP, 0, dst, 1)
    p.runtime.producer_open("req-py", src[:2], CAP)
    p.runtime.layer_ready("req-py", 0, 0, 2)  # before the handshake: written on arrival
    assert not p.runtime.producer_claimed("req-py") and not p.runtime.producer_claimed("nobody")
    p.runtime.producer_handshake(hs)
    # the producer's actor takes the handshake after the directory answered
    deadline = time.monotonic() + 10
    while not p.runtime.producer_claimed("req-py"):
        assert time.monotonic() < deadline, "the handshake never reached the producer"
        time.sleep(0.001)
    p.runtime.producer_add_blocks("req-py", src[2:])
    p.runtime.layer_ready("req-py", 0, 2, 4)
    for layer in range(1, LAYERS):
        p.runtime.layer_ready("req-py", layer, 0, 4)
    p.runtime.producer_finish("req-py")

    done = wait_event(p.runtime, {"producer_released"})
    assert (done.outcome, done.request_id) == ("done", "req-py")
    assert not p.runtime.producer_claimed("req-py"), "released: no live producer"
    ev = wait_event(c.runtime, {"consumer_completed", "consumer_failed"})
    assert ev.kind == "consumer_completed", ev
    assert ev.bytes == LAYERS * len(src) * c.caches[0][0].numel() * 4
    for layer in range(LAYERS):
        for s, d in zip(src, dst):
            assert torch.equal(c.caches[layer][d], p.caches[layer][s]), (layer, d)
        untouched = [b for b in range(BLOCKS) if b not in dst]
        assert bool((c.caches[layer][untouched] == GUARD).all()), f"layer {layer}: unauthorized block written"

    c.runtime.consumer_release("req-py")
    assert wait_event(c.runtime, {"consumer_released"}).request_id == "req-py"
    assert c.runtime.live_requests() == (0, 0)
    assert p.runtime.live_requests() == (0, 0)
    assert p.runtime.stats()["bytes_written"] == ev.bytes


def test_layers_ready_admits_every_open_request_in_one_call(ranks: tuple[Rank, Rank]) -> None:
    # The CPU worker's call: one per layer for every request of the step. A
    # request that is not open comes back with its error; the others are
    # written (bytes equal, nothing outside the authorization touched).
    p, c = ranks
    src, dst = [3, 7], [8, 13]
    hs = c.runtime.consumer_open("req-batch", CAP, 0, dst, 1)
    p.runtime.producer_open("req-batch", src, CAP)
    p.runtime.producer_handshake(hs)
    for layer in range(LAYERS):
        refused = p.runtime.layers_ready(layer, [("nobody", 0, 1), ("req-batch", 0, 2)])
        assert [pd for pd, _ in refused] == ["nobody"]
        assert isinstance(refused[0][1], orbitkv.UnknownRequestError)
    with pytest.raises(orbitkv.GeometryError):
        p.runtime.layers_ready(LAYERS, [("req-batch", 0, 2)])
    with pytest.raises(orbitkv.InvalidArgumentError):
        p.runtime.layers_ready(0, [("req-batch", 2, 1)])
    p.runtime.producer_finish("req-batch")
    assert wait_event(p.runtime, {"producer_released"}).outcome == "done"
    assert wait_event(c.runtime, {"consumer_completed", "consumer_failed"}).kind == "consumer_completed"
    for layer in range(LAYERS):
        for s, d in zip(src, dst):
            assert torch.equal(c.caches[layer][d], p.caches[layer][s]), (layer, d)
        untouched = [b for b in range(BLOCKS) if b not in dst]
        assert bool((c.caches[layer][untouched] == GUARD).all()), f"layer {layer}: unauthorized block written"
    c.runtime.consumer_release("req-batch")
    wait_event(c.runtime, {"consumer_released"})
    assert (p.runtime.live_requests(), c.runtime.live_requests()) == ((0, 0), (0, 0))


def test_runtime_errors_are_typed_and_change_nothing(ranks: tuple[Rank, Rank]) -> None:
    p, c = ranks
    with pytest.raises(orbitkv.UnknownRequestError):
        p.runtime.layer_ready("nobody", 0, 0, 1)
    with pytest.raises(orbitkv.UnknownRequestError):
        c.runtime.consumer_release("nobody")
    with pytest.raises(orbitkv.HandshakeError):
        p.runtime.producer_handshake('{"version": 4}')  # this version, fields missing
    with pytest.raises(orbitkv.HandshakeError):
        p.runtime.producer_handshake("not json")
    with pytest.raises(orbitkv.GeometryError):
        c.runtime.consumer_open("r", CAP, 0, [BLOCKS], 1)  # outside the region
    with pytest.raises(orbitkv.GeometryError):
        c.runtime.consumer_open("r", CAP, 0, [1, 1], 1)  # listed twice
    hs = json.loads(c.runtime.consumer_open("r", CAP, 0, [1, 2], 1))
    with pytest.raises(orbitkv.DuplicateRequestError):
        c.runtime.consumer_open("r", CAP, 0, [3], 1)
    hs["layout"]["layers"].pop()  # wrong geometry: one layer fewer
    with pytest.raises(orbitkv.GeometryError):
        p.runtime.producer_handshake(json.dumps(hs))
    with pytest.raises(orbitkv.InvalidArgumentError):
        p.runtime.layer_ready("r", 0, 2, 1)
    assert p.runtime.stats()["bytes_written"] == 0
    assert bool(all((t == GUARD).all() for t in c.caches))


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"writer_lanes": 2}, "writer_lanes"),  # not a runtime setting (the connector's name)
        ({"max_parked": "5"}, "max_parked"),
        ({"max_parked": 1.5}, "max_parked"),
        ({"max_parked": -1}, "max_parked"),
        ({"max_parked": True}, "max_parked"),
        ({"consumer_timeout_s": "1"}, "consumer_timeout_s"),
        ({"staging_region": (1,)}, "staging_region"),
        ({"staging_region": "x"}, "staging_region"),
        ({"side_channel_key": "not bytes"}, "side_channel_key"),
        ({"lanes_park_on_gpu": "yes"}, "lanes_park_on_gpu"),
        ({"lanes_park_on_gpu": 1}, "lanes_park_on_gpu"),
        ({"pieces_whole_requests": "request"}, "pieces_whole_requests"),
        ({"pieces_whole_requests": 0}, "pieces_whole_requests"),
    ],
)
def test_a_setting_the_core_does_not_take_is_refused_by_name(
    ranks: tuple[Rank, Rank], settings: dict, named: str
) -> None:
    """`Runtime(...)` passes its keywords to the core's one settings object
    by name: an unknown name, or a value of the wrong kind, is refused
    naming the setting, and nothing starts."""
    p, _ = ranks
    with pytest.raises(orbitkv.InvalidArgumentError, match=named):
        orbitkv.Runtime(p.engine, p.layout_json, **settings)


def test_the_connectors_settings_and_the_stub_name_every_runtime_setting(ranks: tuple[Rank, Rank]) -> None:
    """One list of runtime settings (the core's `RuntimeSettings`,
    `RUNTIME_SETTINGS`): the stub's keywords are exactly those, what the
    connector passes (`PdConfig.runtime_settings`) is among them, and a
    runtime starts with them (None: the default)."""
    import ast
    from pathlib import Path

    from orbitkv import _native
    from orbitkv.vllm.config import PdConfig

    stub = ast.parse(Path(_native.__file__).with_name("_native.pyi").read_text())
    (td,) = [n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == "_RuntimeSettings"]
    typed = {n.target.id for n in td.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert typed == set(_native.RUNTIME_SETTINGS)
    assert set(_native.RUNTIME_DEFAULTS) <= set(_native.RUNTIME_SETTINGS)
    cfg = PdConfig.from_extra_config({"orbitkv.pd.writer_lanes": 3})
    given = cfg.runtime_settings()
    assert set(given) <= set(_native.RUNTIME_SETTINGS)
    assert given["writer_lanes_per_peer"] == 3
    p, _ = ranks
    rt = orbitkv.Runtime(p.engine, p.layout_json, **given, max_parked=None)
    assert rt.max_ranges_in_flight_per_peer == 768  # left out: TCP's default
    rt.shutdown()


@pytest.mark.parametrize("key", ["notify_poll_ms", "peer_idle_reclaim_s"])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_notify_poll_is_refused_before_anything_starts(ranks: tuple[Rank, Rank], bad: float, key: str) -> None:
    # the notification poll's pace (250 µs by default, below 1 ms on a thread
    # of the router's own), and how long an idle peer keeps its writer lanes:
    # refused with its name, the rank's own runtime untouched
    p, c = ranks
    with pytest.raises(orbitkv.InvalidArgumentError, match=key):
        orbitkv.Runtime(p.engine, p.layout_json, **{key: bad})
    hs = c.runtime.consumer_open("after", CAP, 0, [1], 1)
    p.runtime.producer_open("after", [0], CAP)
    p.runtime.producer_handshake(hs)
    assert p.runtime.live_requests()[1] == 1


@pytest.mark.parametrize(
    "call",
    ["consumer_release", "producer_open", "layer_ready", "producer_finish", "producer_abort", "live_requests"],
)
def test_a_call_that_waits_for_the_directory_releases_the_gil(ranks: tuple[Rank, Rank], call: str) -> None:
    """Issue 35: every binding call that waits for the runtime's request
    directory waits with the GIL released, so vLLM's other Python threads
    (the model runner, the API server) keep running meanwhile. The directory
    is kept busy for 0.4 s; while a call waits behind it, another Python
    thread counts. A call that held the GIL would let it count nothing."""
    import threading
    import time

    p, c = ranks
    rt = p.runtime if call != "consumer_release" else c.runtime
    if not hasattr(rt, "_stall_directory"):
        pytest.fail(
            "this orbitkv build has no test hooks: install the development build "
            "(MATURIN_PEP517_ARGS='--features testing' pip install -e bindings/python; scripts/setup.sh does)"
        )
    args = {
        "consumer_release": ("nobody",),
        "producer_open": ("gil-open", [0], CAP, 1),
        "layer_ready": ("nobody", 0, 0, 1),
        "producer_finish": ("nobody",),
        "producer_abort": ("nobody", "x"),
        "live_requests": (),
    }[call]
    counted = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal counted
        while not stop.is_set():
            counted += 1
            time.sleep(0.001)

    t = threading.Thread(target=count)
    t.start()
    time.sleep(0.05)
    rt._stall_directory(0.4)
    before, t0 = counted, time.monotonic()
    try:
        getattr(rt, call)(*args)
    except orbitkv.OrbitKVError:
        pass  # an unknown request's refusal: what matters is how it waited
    waited = time.monotonic() - t0
    during = counted - before
    stop.set()
    t.join()
    assert waited >= 0.3, f"{call} did not wait for the stalled directory ({waited:.3f}s)"
    assert during >= 20, f"{call} held the GIL while it waited: the other thread ran {during} times in {waited:.2f}s"


def test_shutdown_is_idempotent_and_later_calls_raise(ranks: tuple[Rank, Rank]) -> None:
    p, _ = ranks
    p.runtime.shutdown()
    p.runtime.shutdown()
    with pytest.raises(orbitkv.RuntimeStoppedError):
        p.runtime.producer_open("x", [0], CAP)


def test_gpu_layer_gate_without_a_cuda_driver_is_a_typed_error(ranks: tuple[Rank, Rank]) -> None:
    """`layers_ready_after` (the GPU path: a CUDA event, waited for in Rust)
    on a machine without a CUDA driver: `CudaError`, nothing admitted, and
    the request can still be served the CPU way; bad arguments are refused
    before any CUDA call."""
    p, c = ranks
    dst = [3, 4]
    hs = c.runtime.consumer_open("req-gate", CAP, 0, dst, 1)
    p.runtime.producer_open("req-gate", [0, 1], CAP)
    p.runtime.producer_handshake(hs)
    with pytest.raises(orbitkv.GeometryError):
        p.runtime.layers_ready_after(0, LAYERS, [("req-gate", 0, 2)])
    with pytest.raises(orbitkv.InvalidArgumentError):
        p.runtime.layers_ready_after(0, 0, [("req-gate", 2, 1)])
    with pytest.raises(orbitkv.errors.CudaError) as ei:
        p.runtime.layers_ready_after(0, 0, [("req-gate", 0, 2)])
    assert "libcuda.so.1" in str(ei.value)
    assert p.runtime.stats()["bytes_written"] == 0
    assert bool(all((t == GUARD).all() for t in c.caches))
    # No gate was started: producer_finish_after is producer_finish now.
    for layer in range(LAYERS):
        p.runtime.layer_ready("req-gate", layer, 0, 2)
    p.runtime.producer_finish_after("req-gate")
    assert wait_event(c.runtime, {"consumer_completed", "consumer_failed"}).kind == "consumer_completed"
    assert wait_event(p.runtime, {"producer_released"}).outcome == "done"
    c.runtime.consumer_release("req-gate")


WARN_PROBE = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["TESTS_DIR"])
import test_runtime as t
r = t.Rank(t.GUARD)
# Nothing listens on port 1: the runtime's publisher fails the rank and warns.
r.runtime.consumer_open("req-warn", t.CAP, 0, [1], 1, [("127.0.0.1:1", 0)])
ev = t.wait_event(r.runtime, {"consumer_failed", "consumer_completed"})
print("EVENT", ev.kind, flush=True)
r.close()
"""


@pytest.mark.parametrize("log", [None, "off", "orbitkv=loud"])
def test_runtime_warnings_reach_stderr_without_a_trace(log: str | None, tmp_path) -> None:
    """OrbitKV's own warnings (here: a handshake nobody takes) are printed to
    stderr, so they land in the vLLM server's log without a trace;
    ``ORBITKV_LOG=off`` silences them; a malformed ``ORBITKV_LOG`` is named
    and the default kept."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("ORBITKV_TRACE", "ORBITKV_LOG")}
    env["TESTS_DIR"] = str(Path(__file__).parent)
    if log is not None:
        env["ORBITKV_LOG"] = log
    p = subprocess.run([sys.executable, "-c", WARN_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert "EVENT consumer_failed" in p.stdout, p.stdout + p.stderr
    warned = [line for line in p.stderr.splitlines() if " WARN " in line and "orbitkv" in line]
    if log == "off":
        assert warned == [], warned
    else:
        assert any("nothing listens at 127.0.0.1:1" in line for line in warned), p.stderr[-3000:]
    if log == "orbitkv=loud":
        assert "ORBITKV_LOG=\"orbitkv=loud\" ignored" in p.stderr, p.stderr[-3000:]


TRACE_PROBE = r"""
import json, os, sys
sys.path.insert(0, os.environ["TESTS_DIR"])
import orbitkv
import test_runtime as t
path = os.environ["TRACE_PATH"]
print("FIRST", orbitkv.install_trace(path), flush=True)
print("AGAIN", orbitkv.install_trace(path + ".other"), flush=True)
r = t.Rank(t.GUARD)  # its runtime keeps what the process installed
r.runtime.producer_open("req-traced", [0, 1], t.CAP)
r.runtime.producer_abort("req-traced", "test")
print("EVENT", t.wait_event(r.runtime, {"producer_released"}).kind, flush=True)
r.close()
"""


def test_install_trace_is_explicit_once_per_process_and_the_runtime_writes_it(tmp_path) -> None:
    """The library sets no subscriber of its own: `orbitkv.install_trace(path)`
    (what the connector's `orbitkv.pd.trace` calls) installs the Chrome trace,
    once per process (a second call keeps the first), even with
    `ORBITKV_TRACE` naming another file; the runtime's shutdown writes it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "explicit.json"
    env = {k: v for k, v in os.environ.items() if k != "ORBITKV_LOG"}
    env.update(TESTS_DIR=str(Path(__file__).parent), TRACE_PATH=str(path), ORBITKV_TRACE=str(tmp_path / "env.json"))
    p = subprocess.run([sys.executable, "-c", TRACE_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert f"FIRST {path}" in p.stdout and f"AGAIN {path}" in p.stdout, p.stdout
    assert "EVENT producer_released" in p.stdout, p.stdout
    assert not (tmp_path / "env.json").exists(), "ORBITKV_TRACE won over the explicit call"
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("ph") == "M" and "req-traced" in str(e.get("args", {}).get("name")) for e in events)


CAP_PROBE = r"""
import json, os, sys
sys.path.insert(0, os.environ["TESTS_DIR"])
import orbitkv
import test_runtime as t
e = orbitkv.MooncakeTransferEngine()
caches = [t.torch.zeros(t.BLOCKS, t.HEADS, t.BLOCK, 2 * t.HEAD_DIM) for _ in range(t.LAYERS)]
for c in caches:
    e.register_memory(c)
kw = json.loads(os.environ["CAP_KW"])
r = orbitkv.Runtime(e, t.layout_json(caches), **kw)
print("CAP", r.transport, r.max_ranges_in_flight_per_peer, flush=True)
r.shutdown()
e.close()
"""


@pytest.mark.parametrize(
    ("nvlink_env", "kw", "cap", "warns"),
    [
        (None, {}, 768, False),
        ("1", {}, 768, False),
        ("0", {}, 768, False),
        ("1", {"max_ranges_in_flight_per_peer": 4096}, 4096, True),
        (None, {"max_ranges_in_flight_per_peer": 1000}, 1000, False),
    ],
)
def test_tcp_keeps_its_range_cap_whatever_mc_intranode_nvlink_says(
    nvlink_env: str | None, kw: dict[str, int], cap: int, warns: bool
) -> None:
    """The range cap left out is the transport's default: the real Mooncake
    engine of these tests (the non-CUDA wheel) installs TCP whether or not
    ``MC_INTRANODE_NVLINK`` is set (only a CUDA build reads it), so the cap
    stays 768, under TCP's 1024 queued per peer. A cap set above that queue
    is kept, with a warning on stderr that names the limit."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("ORBITKV_TRACE", "ORBITKV_LOG", "MC_INTRANODE_NVLINK")}
    env["TESTS_DIR"] = str(Path(__file__).parent)
    env["CAP_KW"] = json.dumps(kw)
    if nvlink_env is not None:
        env["MC_INTRANODE_NVLINK"] = nvlink_env
    p = subprocess.run([sys.executable, "-c", CAP_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert f"CAP tcp {cap}" in p.stdout, p.stdout + p.stderr[-3000:]
    warned = [line for line in p.stderr.splitlines() if " WARN " in line and "queues per peer" in line]
    assert bool(warned) == warns, p.stderr[-3000:]
