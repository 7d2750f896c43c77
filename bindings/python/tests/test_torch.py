"""KV regions as torch CPU tensors (CUDA tensors take the same path).

torch is a hard requirement of this file (requirements/vllm.txt pins it):
these tests must run, not be skipped.
"""

from __future__ import annotations

import pytest
import torch

import orbitkv


def test_cpu_tensors_loopback(pair, register):
    a, b = pair
    src = torch.randn(256, 1024, dtype=torch.float32)
    dst = torch.zeros(256 + 2, 1024, dtype=torch.float32)  # one guard row each side
    dst[0] = 3.0
    dst[-1] = 3.0
    nbytes = src.numel() * src.element_size()
    assert register(a, src) == (src.data_ptr(), nbytes)
    assert register(b, dst) == (dst.data_ptr(), dst.numel() * dst.element_size())
    row = dst.stride(0) * dst.element_size()
    assert a.write(b.endpoint, [(src.data_ptr(), dst.data_ptr() + row, nbytes)]) == nbytes
    assert torch.equal(dst[1:-1], src)
    assert torch.equal(dst[0], torch.full((1024,), 3.0)) and torch.equal(dst[-1], torch.full((1024,), 3.0))


def test_layer_by_layer_kv_blocks_bf16(pair, register):
    """A [layers, blocks, block_elems] bf16 KV cache: each layer's blocks go to
    other block slots on the peer, one batch per layer, as the connector does."""
    a, b = pair
    layers, blocks, block_elems = 4, 32, 2048
    src = torch.randn(layers, blocks, block_elems).to(torch.bfloat16)
    dst = torch.zeros(layers, blocks * 2, block_elems, dtype=torch.bfloat16)
    register(a, src)
    register(b, dst)
    mapping = torch.randperm(blocks * 2)[:blocks]  # src block i -> dst block mapping[i]
    esz = src.element_size()
    block_bytes = block_elems * esz
    for layer in range(layers):
        ranges = [
            (
                src.data_ptr() + (layer * src.stride(0) + i * src.stride(1)) * esz,
                dst.data_ptr() + (layer * dst.stride(0) + int(mapping[i]) * dst.stride(1)) * esz,
                block_bytes,
            )
            for i in range(blocks)
        ]
        batch = a.submit_write(b.endpoint, ranges)
        assert batch.wait(timeout_s=30.0) == blocks * block_bytes
    assert torch.equal(dst[:, mapping], src)
    untouched = torch.ones(blocks * 2, dtype=torch.bool)
    untouched[mapping] = False
    assert not dst[:, untouched].any(), "blocks nobody wrote were touched"


def test_tensor_view_registers_its_own_bytes(pair, register):
    a, b = pair
    base = torch.zeros(4, 1024, dtype=torch.int32)
    view = base[1:3]  # contiguous, with a storage offset
    assert view.is_contiguous() and view.data_ptr() != base.data_ptr()
    src = torch.arange(2 * 1024, dtype=torch.int32).reshape(2, 1024)
    register(a, src)
    assert register(b, view) == (view.data_ptr(), 2 * 1024 * 4)
    assert a.write(b.endpoint, [(src.data_ptr(), view.data_ptr(), 2 * 1024 * 4)]) == 2 * 1024 * 4
    assert torch.equal(base[1:3], src)
    assert not base[0].any() and not base[3].any()


def test_unregister_by_tensor(pair):
    a, _ = pair
    t = torch.ones(1024)
    start, _ = a.register_memory(t)
    assert a.is_registered(start, 4096)
    a.unregister_memory(t)
    assert not a.is_registered(start, 1)


def test_non_contiguous_tensor_is_refused(pair):
    a, _ = pair
    t = torch.zeros(64, 64).t()
    assert not t.is_contiguous()
    with pytest.raises(orbitkv.InvalidArgumentError, match="contiguous"):
        a.register_memory(t)


def test_empty_tensor_is_refused(pair):
    a, _ = pair
    with pytest.raises(orbitkv.InvalidArgumentError, match="empty"):
        a.register_memory(torch.zeros(0))
