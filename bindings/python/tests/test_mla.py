"""MLA (DeepSeek-style latent KV) on CPU tensors: vLLM 0.26's MLA backends
hand ``register_kv_caches`` one ``[num_blocks, block_size, head_size]``
tensor per layer (one latent "head", the same on every TP rank: vLLM's
``get_total_num_kv_heads`` is 1 under MLA). OrbitKV treats it as the
replicated-head case: whole blocks, one sender per decode rank (prefill
rank 0), the other prefill ranks released at once.

vLLM CPU cannot run an MLA model here, so this is the layout math and the
transfer through real Mooncake on CPU tensors, not vLLM end to end
(docs/configuration.md, "Tensor parallelism")."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from _util import wait_event

import orbitkv
from orbitkv.vllm.layout import kv_layout_of

DT = torch.bfloat16
LATENT = 576  # kv_lora_rank 512 + rope dim 64 (DeepSeek-V2/V3)
BS = 16
NB = 12
LAYERS = 3
GUARD = -7.0
CAP = "fedcba9876543210" * 4


def name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def mla_caches(fill: float | None, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        # FlashMLA / Triton MLA: (num_blocks, block_size, head_size), identity stride order.
        t = torch.empty(NB, BS, LATENT, dtype=DT)
        if fill is None:
            t.copy_(torch.randn(NB, BS, LATENT, generator=g))
        else:
            t.fill_(fill)
        out[name(i)] = t
    return out


def mla_layout(caches: dict[str, torch.Tensor], tp: tuple[int, int]) -> dict:
    lay, names = kv_layout_of(caches, num_blocks=NB, local_heads=1, total_heads=1, block_size=BS,
                              tp_rank=tp[0], tp_size=tp[1])
    assert names == [name(i) for i in range(LAYERS)]
    return lay


@pytest.mark.parametrize("tp", [(0, 1), (0, 2), (1, 2)])
def test_an_mla_layer_is_one_plane_of_whole_blocks(tp: tuple[int, int]) -> None:
    caches = mla_caches(0.0)
    lay = mla_layout(caches, tp)
    assert (lay["total_kv_heads"], lay["tp_rank"], lay["tp_size"]) == (1, *tp)
    for i, layer in enumerate(lay["layers"]):
        t = caches[name(i)]
        assert layer["planes"] == [
            {"base": t.data_ptr(), "block_stride": BS * LATENT * 2, "block_bytes": BS * LATENT * 2}
        ]
    # The Rust runtime takes it (it validates every layout on start).
    e = orbitkv.MooncakeTransferEngine("127.0.0.1")
    try:
        orbitkv.Runtime(e, json.dumps(lay)).shutdown()
    finally:
        e.close()


@pytest.mark.parametrize("prefill_tp", [1, 2, 4])
@pytest.mark.parametrize("decode_tp", [1, 2, 4])
def test_each_decode_rank_gets_the_latent_from_prefill_rank_0(prefill_tp: int, decode_tp: int) -> None:
    for c in range(decode_tp):
        assert orbitkv.producer_ranks(1, c, decode_tp, prefill_tp) == [0]


class Rank:
    def __init__(self, tp: tuple[int, int], fill: float | None) -> None:
        self.engine = orbitkv.MooncakeTransferEngine("127.0.0.1")
        self.caches = mla_caches(fill)  # the same seed on every prefill rank: replicas
        for t in self.caches.values():
            self.engine.register_memory(t)
        self.runtime = orbitkv.Runtime(self.engine, json.dumps(mla_layout(self.caches, tp)), consumer_timeout_s=20.0)

    def close(self) -> None:
        self.runtime.shutdown()
        self.engine.close()


@pytest.fixture
def tp2_to_tp1() -> Iterator[tuple[Rank, Rank, Rank]]:
    p0, p1, c = Rank((0, 2), None), Rank((1, 2), None), Rank((0, 1), GUARD)
    yield p0, p1, c
    for r in (p0, p1, c):
        r.close()


def test_mla_prefill_tp2_to_decode_tp1_moves_whole_blocks_from_rank_0(tp2_to_tp1: tuple[Rank, Rank, Rank]) -> None:
    p0, p1, c = tp2_to_tp1
    src, dst = [1, 2, 7], [3, 4, 10]
    hs = c.runtime.consumer_open("req-mla", CAP, 0, dst, 2)
    # Rank 1 holds only the replica: released at once, sends nothing.
    p1.runtime.producer_open("req-mla", src, CAP, 1)
    ev = wait_event(p1.runtime, {"producer_released"})
    assert (ev.request_id, ev.outcome) == ("req-mla", "done")
    # Rank 0 sends every layer's whole blocks.
    p0.runtime.producer_open("req-mla", src, CAP, 1)
    p0.runtime.producer_handshake(hs)
    for layer in range(LAYERS):
        p0.runtime.layer_ready("req-mla", layer, 0, len(src))
    p0.runtime.producer_finish("req-mla")
    assert wait_event(p0.runtime, {"producer_released"}).outcome == "done"
    ev = wait_event(c.runtime, {"consumer_completed", "consumer_failed"})
    assert ev.kind == "consumer_completed", ev
    assert ev.bytes == LAYERS * len(src) * BS * LATENT * 2
    for i in range(LAYERS):
        got, want = c.caches[name(i)], p0.caches[name(i)]
        for s, d in zip(src, dst):
            assert torch.equal(got[d], want[s]), (i, d)
        others = [b for b in range(NB) if b not in dst]
        assert bool((got[others] == GUARD).all()), f"layer {i}: a block outside the authorization was written"
    c.runtime.consumer_release("req-mla")
    wait_event(c.runtime, {"consumer_released"})
    assert p0.runtime.live_requests() == p1.runtime.live_requests() == c.runtime.live_requests() == (0, 0)
    assert p1.runtime.stats()["bytes_written"] == 0
