"""The per-token KV digests of the test hook ``ORBITKV_TESTING_KV_DIGEST``
(``_testing.token_digests``): one token's bytes give one digest whatever the
block size and vLLM's block layout, and a changed byte changes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from orbitkv.vllm import _testing as hooks  # noqa: E402

T, H, D, LAYERS = 300, 2, 8, 3  # tokens, KV heads, head size, layers


def _kv(seed: int, dtype: torch.dtype = torch.bfloat16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(T, H, D, generator=g).to(dtype), torch.randn(T, H, D, generator=g).to(dtype))
        for _ in range(LAYERS)
    ]


def _blocks(bs: int, nb: int, seed: int) -> list[int]:
    """A request's blocks, scattered over the pool (never block 0)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(nb - 1, generator=g)[: -(-T // bs)] + 1).tolist()


def _cache(layout: str, k: torch.Tensor, v: torch.Tensor, bs: int, nb: int, ids: list[int]) -> torch.Tensor:
    """One layer's cache in ``layout`` with the request's tokens in ``ids``
    (other slots random: what other requests left there)."""
    packed = torch.randn(nb, bs, H, 2 * D).to(k.dtype)  # [blocks, slot, head, K|V]
    for t in range(T):
        b, s = ids[t // bs], t % bs
        packed[b, s, :, :D] = k[t]
        packed[b, s, :, D:] = v[t]
    if layout == "HND":  # [blocks, heads, block, K|V], contiguous
        return packed.permute(0, 2, 1, 3).contiguous()
    if layout == "NHD":  # the same logical shape, a permuted view of [blocks, block, heads, K|V]
        return packed.permute(0, 2, 1, 3)
    if layout == "kv-first":  # FlashAttention's [2, blocks, block, heads, head]
        return torch.stack([packed[..., :D], packed[..., D:]]).contiguous()
    if layout == "kv-second":  # [blocks, 2, block, heads, head]
        return torch.stack([packed[..., :D], packed[..., D:]], dim=1).contiguous()
    if layout == "cpu":  # vLLM's CPU kernels: per head K transposed, then V
        hnd = packed.permute(0, 2, 1, 3)  # [blocks, heads, block, K|V]
        kt = hnd[..., :D].transpose(-1, -2).reshape(nb, H, bs * D)
        vv = hnd[..., D:].reshape(nb, H, bs * D)
        return torch.cat([kt, vv], dim=-1).reshape(nb, H, bs, 2 * D).contiguous()
    raise AssertionError(layout)


def _digests(layout: str, bs: int, kv: list[tuple[torch.Tensor, torch.Tensor]], uint8: bool = False) -> list[int]:
    nb = 2 * -(-T // bs) + 3
    ids = _blocks(bs, nb, bs)
    caches = {}
    for i, (k, v) in enumerate(kv):
        c = _cache(layout, k, v, bs, nb, ids)
        caches[f"model.layers.{i}.self_attn.attn"] = c.view(torch.uint8) if uint8 else c
    # in another order than the layers': the digest takes layer order
    caches = dict(reversed(list(caches.items())))
    total, per_layer = hooks.token_digests(caches, nb, ids, T, cpu_order=layout == "cpu")
    assert total.shape == (T,) and len(per_layer) == LAYERS
    return total.tolist()


LAYOUTS = ["HND", "NHD", "kv-first", "kv-second", "cpu"]


def test_same_tokens_same_digests_across_block_sizes_and_layouts() -> None:
    kv = _kv(1)
    want = _digests("HND", 16, kv)
    assert len(set(want)) == T  # every token its own digest
    for layout in LAYOUTS:
        for bs in (16, 64):
            assert _digests(layout, bs, kv) == want, (layout, bs)


def test_fp8_bytes_as_uint8_or_fp8() -> None:
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no fp8 dtype in this torch")
    kv = _kv(2, torch.float8_e4m3fn)
    want = _digests("NHD", 16, kv)
    assert _digests("NHD", 64, kv, uint8=True) == want
    assert _digests("kv-first", 64, kv) == want


def test_mla_latent_plane_across_block_sizes() -> None:
    g = torch.Generator().manual_seed(3)
    lat = [torch.randn(T, 576, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]

    def digests(bs: int) -> list[int]:
        nb = 2 * -(-T // bs) + 3
        ids = _blocks(bs, nb, bs + 1)
        caches = {}
        for i, x in enumerate(lat):
            c = torch.randn(nb, bs, 576).to(torch.bfloat16)
            for t in range(T):
                c[ids[t // bs], t % bs] = x[t]
            caches[f"model.layers.{i}.self_attn.attn"] = c
        return hooks.token_digests(caches, nb, ids, T)[0].tolist()

    assert digests(16) == digests(64)


def test_one_changed_byte_changes_one_token() -> None:
    kv = _kv(4)
    want = _digests("HND", 16, kv)
    k, v = kv[1]
    bad = v.clone()
    raw = bad.view(torch.uint8)  # [T, H, 2 * D] bytes
    raw[137, 1, 5] ^= 1
    got = _digests("kv-first", 64, [kv[0], (k, bad), kv[2]])
    assert [i for i, (a, b) in enumerate(zip(want, got)) if a != b] == [137]


def test_the_hook_records_both_sides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Prefill (block 16) at release and decode (block 64, a prefix hit of
    one block) at load: the lines the driver compares, token for token."""
    monkeypatch.delenv(hooks.CORRUPT_ENV, raising=False)
    monkeypatch.delenv(hooks.WRITE_DELAY_ENV, raising=False)
    monkeypatch.setenv(hooks.KV_DIGEST_ENV, str(tmp_path))
    assert isinstance(hooks.faults_from_env(), hooks.TestingHooks)
    kv = _kv(5)

    def side(bs: int) -> tuple[dict[str, torch.Tensor], list[int], int]:
        nb = 2 * -(-T // bs) + 3
        ids = _blocks(bs, nb, bs + 7)
        # CPU tensors: the hook reads them in the CPU kernels' token order
        return {f"model.layers.{i}.attn": _cache("cpu", k, v, bs, nb, ids) for i, (k, v) in enumerate(kv)}, ids, nb

    pre = hooks.TestingHooks.from_env()
    dec = hooks.TestingHooks.from_env()
    assert pre is not None and dec is not None
    pc, pids, pnb = side(16)
    pre.producer_chunk("req-1", pids[:5])
    pre.producer_chunk("req-1", pids[5:])
    pre.before_send_done(pc, pnb, "req-1")
    dc, dids, dnb = side(64)
    dec.consumer_opened("req-1", 1, dids[1:], T)
    dec.after_load(dc, dnb, dids[1:], "req-1")
    lines = [json.loads(x) for f in tmp_path.glob("kvd-*.jsonl") for x in f.read_text().splitlines()]
    p = next(x for x in lines if x["side"] == "prefill")
    d = next(x for x in lines if x["side"] == "decode")
    assert (p["block_size"], p["first_token"], p["end_token"]) == (16, 0, 16 * len(pids))
    assert (d["block_size"], d["first_token"], d["end_token"]) == (64, 64, T)
    pd_ = hooks.decode_b64(p["digests"])
    dd = hooks.decode_b64(d["digests"])
    assert dd == pd_[64:T]


def test_a_corrupted_load_shows_in_decode_digests(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With ``ORBITKV_TESTING_CORRUPT_AFTER_LOAD`` too, decode's digests are
    of the corrupted block: its tokens differ from prefill's, the rest not."""
    monkeypatch.setenv(hooks.CORRUPT_ENV, "1")
    monkeypatch.delenv(hooks.WRITE_DELAY_ENV, raising=False)
    monkeypatch.setenv(hooks.KV_DIGEST_ENV, str(tmp_path))
    kv = _kv(6)
    bs, nb = 16, 2 * -(-T // 16) + 3
    ids = _blocks(bs, nb, 11)
    caches = {f"model.layers.{i}.attn": _cache("cpu", k, v, bs, nb, ids) for i, (k, v) in enumerate(kv)}
    want = hooks.token_digests(caches, nb, ids, T, cpu_order=True)[0].tolist()
    h = hooks.TestingHooks.from_env()
    assert h is not None
    h.consumer_opened("req-2", 0, ids, T)
    h.after_load(caches, nb, ids, "req-2")
    (line,) = [json.loads(x) for f in tmp_path.glob("kvd-*.jsonl") for x in f.read_text().splitlines()]
    got = hooks.decode_b64(line["digests"])
    assert [i for i, (a, b) in enumerate(zip(want, got)) if a != b] == list(range(bs))
