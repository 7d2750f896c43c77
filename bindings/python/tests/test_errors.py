"""Each exception where it should be raised.

Mooncake is loaded once per process, so the library and version errors are
checked in fresh interpreters (`run_python`).
"""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
from _util import addr, run_python

import orbitkv
from orbitkv import errors

# --- transfers ----------------------------------------------------------------


@pytest.mark.parametrize("peer", ["no-port", "127.0.0.1", ":80", "host:0", "host:99999", "a b:1"])
def test_malformed_endpoint(pair, register, peer):
    a, _ = pair
    src = np.zeros(4096, dtype=np.uint8)
    register(a, src)
    with pytest.raises(orbitkv.BadEndpointError) as exc:
        a.write(peer, [(addr(src), 0x1000, 16)])
    assert exc.value.kind == "BadEndpoint" and exc.value.endpoint == peer
    with pytest.raises(orbitkv.BadEndpointError):
        a.submit_write(peer, [(addr(src), 0x1000, 16)])


def test_unreachable_endpoint(pair, register):
    a, _ = pair
    src = np.zeros(4096, dtype=np.uint8)
    register(a, src)
    with pytest.raises(orbitkv.BadEndpointError, match=r"127\.0\.0\.1:1"):
        a.write("127.0.0.1:1", [(addr(src), 0x1000, 16)])


def test_unregistered_local_source(pair, register):
    a, b = pair
    src = np.ones(4096, dtype=np.uint8)  # never registered
    dst = np.zeros(4096, dtype=np.uint8)
    register(b, dst)
    with pytest.raises(orbitkv.UnregisteredMemoryError) as exc:
        a.write(b.endpoint, [(addr(src), addr(dst), 4096)])
    assert exc.value.kind == "UnregisteredLocal"
    assert exc.value.side == "local" and exc.value.addr == addr(src) and exc.value.length == 4096
    assert not dst.any()


def test_partly_registered_local_source(pair, register):
    a, b = pair
    src = np.ones(8192, dtype=np.uint8)
    dst = np.zeros(8192, dtype=np.uint8)
    register(a, src, length=4096)
    register(b, dst)
    with pytest.raises(orbitkv.UnregisteredMemoryError):
        a.write(b.endpoint, [(addr(src), addr(dst), 4096), (addr(src) + 4000, addr(dst), 200)])
    assert not dst.any(), "a batch with an unregistered range must not move any byte"


def test_write_into_peer_range_never_registered(pair, register):
    a, b = pair
    src = np.ones(4096, dtype=np.uint8)
    register(a, src)
    never_registered = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(orbitkv.TransferError) as exc:
        a.write(b.endpoint, [(addr(src), addr(never_registered), 4096)], timeout_s=30.0)
    assert exc.value.peer == b.endpoint
    assert not never_registered.any()
    # The engines are still usable afterwards.
    dst = np.zeros(4096, dtype=np.uint8)
    register(b, dst)
    assert a.write(b.endpoint, [(addr(src), addr(dst), 4096)]) == 4096 and dst.all()


def test_failed_batch_raises_from_poll_and_wait(pair, register):
    a, b = pair
    src = np.ones(4096, dtype=np.uint8)
    register(a, src)
    nowhere = np.zeros(4096, dtype=np.uint8)
    batch = a.submit_write(b.endpoint, [(addr(src), addr(nowhere), 4096)])
    with pytest.raises(orbitkv.TransferError):
        batch.wait(timeout_s=30.0)
    with pytest.raises(orbitkv.TransferError):
        batch.poll()  # the outcome is remembered
    assert "failed" in repr(batch)


def test_timeout_leaves_the_batch_pending(pair, regions):
    a, b = pair
    src, dst = regions(a, b, 64 << 20, 5)
    batch = a.submit_write(b.endpoint, [(addr(src), addr(dst), src.nbytes)])
    with pytest.raises(orbitkv.TransferTimeoutError) as exc:
        batch.wait(timeout_s=0.0)
    assert isinstance(exc.value, TimeoutError) and isinstance(exc.value, orbitkv.TransferError)
    assert exc.value.kind == "Timeout" and exc.value.timeout_s == 0.0
    assert batch.wait(timeout_s=60.0) == src.nbytes
    assert np.array_equal(src, dst)


@pytest.mark.parametrize(
    "case",
    ["empty", "zero_length", "negative", "pair", "string", "timeout_negative", "timeout_nan", "timeout_inf"],
)
def test_invalid_arguments(pair, register, case):
    a, b = pair
    src = np.zeros(4096, dtype=np.uint8)
    register(a, src)
    good = (addr(src), 0x1000, 16)
    ranges, timeout_s = {
        "empty": ([], 1.0),
        "zero_length": ([(addr(src), 0x1000, 0)], 1.0),
        "negative": ([(addr(src), -1, 16)], 1.0),
        "pair": ([(addr(src), 0x1000)], 1.0),
        "string": (["abc"], 1.0),
        "timeout_negative": ([good], -1.0),
        "timeout_nan": ([good], math.nan),
        "timeout_inf": ([good], math.inf),
    }[case]
    with pytest.raises(orbitkv.InvalidArgumentError) as exc:
        a.write(b.endpoint, ranges, timeout_s=timeout_s)
    assert isinstance(exc.value, ValueError) and exc.value.kind == "InvalidArgument"


def test_ranges_must_be_iterable(pair):
    a, b = pair
    with pytest.raises(TypeError):
        a.write(b.endpoint, 42)


# --- engine life cycle --------------------------------------------------------


def test_engine_init_error():
    with pytest.raises(orbitkv.EngineInitError) as exc:
        orbitkv.MooncakeTransferEngine(bind_host="")
    assert exc.value.kind == "EngineInit"


def test_closed_engine_and_its_batches():
    src = np.ones(1 << 20, dtype=np.uint8)
    with orbitkv.MooncakeTransferEngine() as e, orbitkv.MooncakeTransferEngine() as peer:
        dst = np.zeros_like(src)
        e.register_memory(src)
        peer.register_memory(dst)
        done = e.submit_write(peer.endpoint, [(addr(src), addr(dst), src.nbytes)])
        assert done.wait() == src.nbytes
        pending = e.submit_write(peer.endpoint, [(addr(src), addr(dst), 4096)])
        pending_peer = peer.endpoint
    assert e.closed and "closed" in repr(e)
    e.close()  # idempotent
    for call in (
        lambda: e.register_memory(np.zeros(16, dtype=np.uint8)),
        lambda: e.unregister_memory(addr(src)),
        lambda: e.write(pending_peer, [(addr(src), addr(dst), 16)]),
        lambda: e.submit_write(pending_peer, [(addr(src), addr(dst), 16)]),
        lambda: e.send_notification(pending_peer, "x", b"y"),
        e.take_notifications,
        lambda: e.is_registered(addr(src), 1),
    ):
        with pytest.raises(orbitkv.EngineClosedError):
            call()
    assert done.wait() == src.nbytes, "a finished batch keeps its outcome after close"
    # A batch that was still pending at close reports the closed engine
    # (or its completion, if Mooncake finished it before close).
    try:
        assert pending.wait(timeout_s=5.0) == 4096
    except orbitkv.EngineClosedError as exc:
        assert isinstance(exc, RuntimeError)


def test_errors_pickle_with_kind_and_details():
    e = errors.TransferTimeoutError("timed out", kind="Timeout", peer="127.0.0.1:1", timeout_s=1.5)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is errors.TransferTimeoutError
    assert (str(back), back.kind, back.peer, back.timeout_s) == ("timed out", "Timeout", "127.0.0.1:1", 1.5)
    with pytest.raises(AttributeError):
        _ = back.no_such_detail


def test_hierarchy():
    classes = [getattr(errors, n) for n in errors.__all__]
    assert all(issubclass(c, errors.OrbitKVError) for c in classes)
    assert issubclass(errors.TransferTimeoutError, (errors.TransferError))
    assert issubclass(errors.TransferTimeoutError, TimeoutError)
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.EngineClosedError, RuntimeError)
    assert issubclass(errors.GeometryError, ValueError)
    assert issubclass(errors.UnknownRequestError, KeyError)
    assert issubclass(errors.ForbiddenError, PermissionError)
    assert issubclass(errors.SideChannelError, OSError)
    assert issubclass(errors.HandshakeRejected, RuntimeError)
    assert len(set(classes)) == len(classes) == 24


# --- loading Mooncake (fresh interpreters) ------------------------------------

PROBE = r"""
import json, os
import numpy as np
import orbitkv
kwargs = json.loads(os.environ["PROBE_KWARGS"])
try:
    with orbitkv.MooncakeTransferEngine(**kwargs) as e, orbitkv.MooncakeTransferEngine(**kwargs) as peer:
        src = np.arange(4096, dtype=np.uint8)
        dst = np.zeros(4096, dtype=np.uint8)
        e.register_memory(src)
        peer.register_memory(dst)
        moved = e.write(peer.endpoint, [(src.ctypes.data, dst.ctypes.data, 4096)])
        out = {"ok": True, "version": e.mooncake_version, "library": e.mooncake_library,
               "moved": moved, "equal": bool((src == dst).all())}
except orbitkv.OrbitKVError as exc:
    out = {"ok": False, "class": type(exc).__name__, "kind": exc.kind, "details": exc.details,
           "message": str(exc), "mro": [c.__name__ for c in type(exc).__mro__]}
print(json.dumps(out))
"""


def probe(kwargs: dict | None = None, env: dict[str, str | None] | None = None) -> dict:
    """Starts two engines with `kwargs` in a fresh interpreter and writes 4 KiB
    between them; returns what happened. Library settings from the calling
    environment are cleared unless `env` sets them."""
    full_env: dict[str, str | None] = {
        "ORBITKV_MOONCAKE_LIB": None,
        "ORBITKV_MOONCAKE_ALLOW_VERSION": None,
        "PROBE_KWARGS": json.dumps(kwargs or {}),
    }
    full_env.update(env or {})
    return run_python(PROBE, env=full_env)


def mooncake_package() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    assert spec is not None and spec.submodule_search_locations, "the mooncake package is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


def fake_site(tmp_path: Path, version: str) -> Path:
    """A site folder whose `mooncake` is the real engine.so (symlinked, with
    the libraries it loads from $ORIGIN) but whose wheel metadata claims `version`."""
    real = mooncake_package()
    site = tmp_path / "site"
    pkg = site / "mooncake"
    pkg.mkdir(parents=True)
    for name in ("engine.so", "libasio.so", "libetcd_wrapper.so"):
        if (real / name).exists():
            (pkg / name).symlink_to(real / name)
    for libs in real.parent.glob("mooncake_transfer_engine*.libs"):
        (site / libs.name).symlink_to(libs)
    dist = site / f"mooncake_transfer_engine_non_cuda-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: mooncake-transfer-engine-non-cuda\nVersion: {version}\n"
    )
    return pkg


def test_default_library_is_the_installed_package():
    out = probe()
    assert out["ok"] and out["moved"] == 4096 and out["equal"], out
    assert out["version"] == orbitkv.PINNED_MOONCAKE_VERSION
    assert Path(out["library"]).resolve() == (mooncake_package() / "engine.so").resolve()


def test_missing_library(tmp_path):
    out = probe({"library": "/nonexistent"})
    assert not out["ok"] and out["class"] == "MooncakeLibraryError", out
    assert out["kind"] == "LibraryNotFound" and "/nonexistent" in out["details"]["searched"]
    assert "ORBITKV_MOONCAKE_LIB" in out["message"]


def test_missing_library_from_environment(tmp_path):
    out = probe(env={"ORBITKV_MOONCAKE_LIB": str(tmp_path / "nothing-here")})
    assert not out["ok"] and out["class"] == "MooncakeLibraryError" and out["kind"] == "LibraryNotFound", out


def test_no_mooncake_in_this_python():
    code = """
import json, sys
import orbitkv
sys.path[:] = [p for p in sys.path if "site-packages" not in p]  # hide the mooncake package
try:
    orbitkv.MooncakeTransferEngine()
    out = {"ok": True}
except orbitkv.OrbitKVError as exc:
    out = {"ok": False, "class": type(exc).__name__, "kind": exc.kind, "details": exc.details}
print(json.dumps(out))
"""
    out = run_python(code, env={"ORBITKV_MOONCAKE_LIB": None})
    assert not out["ok"] and out["class"] == "MooncakeLibraryError" and out["kind"] == "LibraryNotFound", out
    assert "this Python" in out["details"]["searched"], out


def test_later_engines_reuse_the_loaded_library():
    code = """
import json, sys
import orbitkv
with orbitkv.MooncakeTransferEngine() as first:
    sys.path[:] = [p for p in sys.path if "site-packages" not in p]
    with orbitkv.MooncakeTransferEngine() as second:
        out = {"same": first.mooncake_library == second.mooncake_library}
print(json.dumps(out))
"""
    assert run_python(code, env={"ORBITKV_MOONCAKE_LIB": None}) == {"same": True}


def test_library_that_does_not_load(tmp_path):
    bad = tmp_path / "mooncake"
    bad.mkdir()
    (bad / "engine.so").write_text("not an ELF file\n")
    out = probe({"library": str(bad)})
    assert not out["ok"] and out["class"] == "MooncakeLibraryError" and out["kind"] == "LoadFailed", out


def test_version_mismatch(tmp_path):
    pkg = fake_site(tmp_path, "0.3.14")
    out = probe({"library": str(pkg)}, env={"ORBITKV_MOONCAKE_ALLOW_VERSION": None})
    assert not out["ok"] and out["class"] == "MooncakeVersionError", out
    assert out["kind"] == "VersionMismatch"
    assert out["details"]["found"] == "0.3.14" and out["details"]["pinned"] == orbitkv.PINNED_MOONCAKE_VERSION
    assert "OrbitKVError" in out["mro"]
    # allow_version naming another version does not help.
    out = probe({"library": str(pkg), "allow_version": "0.3.15"})
    assert not out["ok"] and out["class"] == "MooncakeVersionError", out


def test_allowed_version_loads(tmp_path):
    pkg = fake_site(tmp_path, "0.3.14")
    out = probe({"library": str(pkg), "allow_version": "0.3.14"})
    assert out["ok"] and out["version"] == "0.3.14", out
    assert out["moved"] == 4096 and out["equal"], out
    out = probe({"library": str(pkg)}, env={"ORBITKV_MOONCAKE_ALLOW_VERSION": "0.3.14"})
    assert out["ok"] and out["version"] == "0.3.14", out
