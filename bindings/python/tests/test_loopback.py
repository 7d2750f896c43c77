"""Bytes moved by the real Mooncake engine between two engines on 127.0.0.1,
with numpy arrays as the registered memory."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from _util import addr

import orbitkv

GUARD = 0xAB


def test_write_moves_exact_bytes_and_leaves_guards_untouched(pair, register):
    a, b = pair
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, size=1 << 20, dtype=np.uint8)
    src_copy = src.copy()
    dst = np.full((1 << 20) + 4 * 4096, GUARD, dtype=np.uint8)
    assert register(a, src) == (addr(src), src.nbytes)
    assert register(b, dst) == (addr(dst), dst.nbytes)

    # Three ranges of different sizes into scattered places: 4 KiB guards
    # before, between and after them.
    plan = [(0, 4096, 300_000), (300_000, 308_192, 500_000), (800_000, 812_288, 248_576)]
    assert dst.nbytes == 812_288 + 248_576 + 4096
    ranges = [(addr(src) + s, addr(dst) + d, n) for s, d, n in plan]
    written = a.write(b.endpoint, ranges, timeout_s=30.0)

    assert written == sum(n for _, _, n in plan)
    expected = np.full_like(dst, GUARD)
    for s, d, n in plan:
        expected[d : d + n] = src[s : s + n]
    assert np.array_equal(dst, expected), "destination differs (moved bytes or guard bytes)"
    assert np.array_equal(src, src_copy), "the source changed"


def test_write_both_directions(pair, register):
    a, b = pair
    x = np.arange(64 * 1024, dtype=np.uint32)
    y = np.zeros_like(x)
    register(a, x)
    register(b, y)
    assert a.write(b.endpoint, [(addr(x), addr(y), x.nbytes)]) == x.nbytes
    assert np.array_equal(x, y)
    y[:] = 7
    assert b.write(a.endpoint, [(addr(y), addr(x), 4096)]) == 4096
    assert np.all(x[:1024] == 7) and np.array_equal(x[1024:], np.arange(1024, 64 * 1024, dtype=np.uint32))


def test_many_small_ranges_in_one_batch(pair, register):
    a, b = pair
    blocks, block = 1024, 4096
    src = np.random.default_rng(2).integers(0, 256, size=(blocks, block), dtype=np.uint8)
    dst = np.zeros((blocks + 1, block), dtype=np.uint8)
    register(a, src)
    register(b, dst)
    perm = np.random.default_rng(3).permutation(blocks)  # src block i -> dst block perm[i]
    ranges = [(addr(src) + i * block, addr(dst) + int(perm[i]) * block, block) for i in range(blocks)]
    assert a.write(b.endpoint, ranges) == blocks * block
    assert np.array_equal(dst[perm], src)
    assert not dst[blocks].any(), "the block nobody wrote was touched"


def test_submit_poll_wait(pair, regions):
    a, b = pair
    src, dst = regions(a, b, 8 << 20, 4)
    batch = a.submit_write(b.endpoint, [(addr(src), addr(dst), src.nbytes // 2), (addr(src) + src.nbytes // 2, addr(dst) + src.nbytes // 2, src.nbytes // 2)])
    assert (batch.peer, batch.tasks, batch.nbytes) == (b.endpoint, 2, src.nbytes)
    assert batch.poll() in ("in_flight", "completed")
    assert batch.wait(timeout_s=30.0) == src.nbytes
    assert batch.poll() == "completed"
    assert batch.wait() == src.nbytes, "a finished batch remembers its outcome"
    assert "completed" in repr(batch)
    assert np.array_equal(src, dst)


def test_register_forms_and_is_registered(pair, register):
    a, _ = pair
    arr = np.zeros(10_000, dtype=np.uint8)
    # An int address needs a length; a prefix of a buffer can be registered.
    assert register(a, addr(arr), length=4096) == (addr(arr), 4096)
    assert a.is_registered(addr(arr), 4096)
    assert not a.is_registered(addr(arr), 4097)
    a.unregister_memory(addr(arr))
    assert not a.is_registered(addr(arr), 1)
    assert register(a, arr, length=5000) == (addr(arr), 5000)
    a.unregister_memory(arr)
    ba = bytearray(8192)
    start, length = register(a, ba)
    assert length == 8192 and a.is_registered(start, 8192)


def test_registered_buffer_is_kept_alive_until_unregistered(pair):
    a, _ = pair
    arr = np.zeros(4096, dtype=np.uint8)
    ref = weakref.ref(arr)
    start, _ = a.register_memory(arr)
    del arr
    gc.collect()
    assert ref() is not None, "a registered array was freed while registered"
    a.unregister_memory(start)
    gc.collect()
    assert ref() is None, "unregister_memory did not release the array"


def test_close_releases_kept_objects():
    arr = np.zeros(4096, dtype=np.uint8)
    ref = weakref.ref(arr)
    with orbitkv.MooncakeTransferEngine() as e:
        e.register_memory(arr)
        del arr
        gc.collect()
        assert ref() is not None
    assert e.closed
    gc.collect()
    assert ref() is None


def test_registration_errors(pair, register):
    a, _ = pair
    arr = np.zeros(8192, dtype=np.uint8)
    register(a, arr)
    with pytest.raises(orbitkv.RegistrationError) as exc:
        a.register_memory(addr(arr) + 100, length=10)
    assert exc.value.kind == "Registration" and "overlaps" in str(exc.value)
    other = np.zeros(64, dtype=np.uint8)
    with pytest.raises(orbitkv.RegistrationError):
        a.unregister_memory(other)


@pytest.mark.parametrize(
    ("region", "kwargs", "error"),
    [
        (True, {}, TypeError),
        (object(), {}, TypeError),
        (12345, {}, orbitkv.InvalidArgumentError),  # address without length
        (-5, {"length": 10}, orbitkv.InvalidArgumentError),
        (b"read-only bytes", {}, orbitkv.InvalidArgumentError),
        (np.zeros((64, 64), dtype=np.uint8)[:, ::2], {}, orbitkv.InvalidArgumentError),  # not contiguous
        (np.zeros(0, dtype=np.uint8), {}, orbitkv.InvalidArgumentError),  # empty
        (np.zeros(16, dtype=np.uint8), {"length": 17}, orbitkv.InvalidArgumentError),
        (np.zeros(16, dtype=np.uint8), {"length": 0}, orbitkv.InvalidArgumentError),
    ],
)
def test_region_argument_errors(pair, region, kwargs, error):
    a, _ = pair
    with pytest.raises(error):
        a.register_memory(region, **kwargs)


def test_zero_address_is_a_registration_error(pair):
    a, _ = pair
    with pytest.raises(orbitkv.RegistrationError):
        a.register_memory(0, length=4096)
