"""The source staging taken out of vLLM's KV cache (``orbitkv.pd.staging_memory``
``kv_cache``, ``orbitkv.vllm.kv_staging``): how many blocks, vLLM's own
block pool giving them up for good, and the bytes of those blocks in every
layout vLLM hands a GPU worker, rebuilt on CPU tensors as in
``test_gpu_layouts.py``: the segments must cover exactly the bytes vLLM's
own views of the taken blocks reach, each inside one layer's tensor."""

from __future__ import annotations

import pytest
import torch
from test_gpu_layouts import BS, DT, ES, HPC, NB, PACKED, ROCM, Backend, llama, name, padded_layer

from orbitkv.vllm.config import ConfigError, PdConfig
from orbitkv.vllm.kv_staging import give_blocks_back, reserved_blocks, runs, segments, take_blocks
from orbitkv.vllm.layout import kv_layout_of

GIB = 1 << 30


def test_reserved_blocks_are_a_quarter_of_the_cache_at_most_a_gib_and_leave_a_whole_request() -> None:
    # 10 GiB in 10240 blocks of 1 MiB: a quarter is over 1 GiB: 1024 blocks
    assert reserved_blocks(10 * GIB, 10_240, "kv_both", 0) == 1024
    assert reserved_blocks(10 * GIB, 10_240, "kv_producer", 0) == 1024
    # 2 GiB: a quarter, 512 blocks
    assert reserved_blocks(2 * GIB, 2_048, "kv_both", 0) == 512
    # 40 GiB in blocks of 4 MiB: capped at 1 GiB, 256 blocks
    assert reserved_blocks(40 * GIB, 10_240, "kv_both", 0) == 256
    # decode only takes none
    assert reserved_blocks(10 * GIB, 10_240, "kv_consumer", 0) == 0
    # a request of the model's length must still fit the rest (and the null block)
    assert reserved_blocks(10 * GIB, 10_240, "kv_both", 9_800) == 439
    assert reserved_blocks(10 * GIB, 10_240, "kv_both", 10_240) == 0
    # nothing to take from
    assert reserved_blocks(0, 10_000, "kv_both", 0) == reserved_blocks(GIB, 1, "kv_both", 0) == 0
    # orbitkv.pd.staging_kv_share: a tenth of 5 GiB in 1 MiB blocks, still capped at 1 GiB
    assert reserved_blocks(5 * GIB, 5_120, "kv_producer", 0, 0.1) == 512
    assert reserved_blocks(20 * GIB, 20_480, "kv_producer", 0, 0.1) == 1024
    assert reserved_blocks(5 * GIB, 5_120, "kv_consumer", 0, 0.1) == 0
    # a quarter of a small cache is less than a block: none
    assert reserved_blocks(3 << 20, 3, "kv_both", 0) == 0
    # steps of max_num_batched_tokens: 48 GiB in 24576 blocks of 2 MiB, 512 blocks a step (Llama-3-8B at
    # 8192 tokens): three steps, 1536 blocks (3 GiB, 6.25 %), not 512 (1 GiB)
    assert reserved_blocks(48 * GIB, 24_576, "kv_producer", 0, step_blocks=512) == 1536
    assert reserved_blocks(48 * GIB, 24_576, "kv_producer", 0) == 512
    assert reserved_blocks(48 * GIB, 24_576, "kv_consumer", 0, step_blocks=512) == 0
    # runs 44-45's prefill: 6144 blocks of 512 KiB (3 GiB), 512 blocks a step: the quarter, 1536, as before
    assert reserved_blocks(3 * GIB, 6_144, "kv_producer", 0, step_blocks=512) == 1536
    assert reserved_blocks(3 * GIB, 6_144, "kv_producer", 0) == 1536
    # still leaves a whole request to vLLM
    assert reserved_blocks(48 * GIB, 24_576, "kv_producer", 24_000, step_blocks=512) == 575


def test_runs_of_block_ids() -> None:
    assert runs([]) == []
    assert runs([5, 1, 2, 3, 7, 6, 2]) == [(1, 4), (5, 8)]


def test_vllms_block_pool_gives_the_blocks_for_good_and_counts_only_the_rest() -> None:
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=101, enable_caching=True, hash_block_size=BS)
    taken = take_blocks(pool, 10)
    assert taken == list(range(1, 11)), "the lowest free IDs, never the null block"
    assert all(pool.blocks[b].ref_cnt == 1 for b in taken)
    assert (pool.num_gpu_blocks, pool.get_num_free_blocks()) == (91, 90)
    # vLLM sees a pool of 90 usable blocks: idle is 0 % used and its
    # prefix cache can be reset
    assert pool.get_usage() == 0.0
    assert pool.reset_prefix_cache()
    # what vLLM hands requests from now on is never a taken block
    got = pool.get_new_blocks(90)
    assert not {b.block_id for b in got} & set(taken)
    assert pool.get_usage() == 1.0
    pool.free_blocks(got)
    assert pool.get_usage() == 0.0 and pool.reset_prefix_cache()
    # more than it has, or nothing asked: nothing taken, nothing changed
    assert take_blocks(pool, 91) == [] and take_blocks(pool, 0) == []
    assert (pool.num_gpu_blocks, pool.get_num_free_blocks()) == (91, 90)
    # a pool without what this needs (another vLLM): nothing
    assert take_blocks(object(), 3) == []


def test_the_taken_blocks_go_back_to_vllms_pool_whole_or_not_at_all() -> None:
    """``give_blocks_back``: the staging's blocks back in vLLM's real pool,
    counted and free again, handed out before the rest (vLLM puts unhashed
    freed blocks first); nothing changes for a run past the pool, the null
    block, a block something else holds too (not the staging's alone), or
    a pool without what this needs."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=101, enable_caching=True, hash_block_size=BS)
    taken = runs(take_blocks(pool, 10))
    assert taken == [(1, 11)]
    for bad in ([(95, 102)], [(0, 2)], []):
        assert give_blocks_back(pool, bad) == 0
    pool.blocks[3].ref_cnt += 1  # held by something else as well
    assert give_blocks_back(pool, taken) == 0
    pool.blocks[3].ref_cnt -= 1
    assert give_blocks_back(object(), taken) == 0
    assert (pool.num_gpu_blocks, pool.get_num_free_blocks()) == (91, 90)
    assert give_blocks_back(pool, taken) == 10
    assert (pool.num_gpu_blocks, pool.get_num_free_blocks()) == (101, 100)
    assert pool.get_usage() == 0.0 and pool.reset_prefix_cache()
    assert sorted(b.block_id for b in pool.get_new_blocks(10)) == list(range(1, 11)), "the freed blocks first"


def covered(segs: list[tuple[int, int]], raws: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each raw allocation's bytes inside `segs`, as a mask; every segment
    must lie inside one of them."""
    masks = [torch.zeros(r.numel(), dtype=torch.bool) for r in raws]
    for a, n in segs:
        homes = [i for i, r in enumerate(raws) if r.data_ptr() <= a and a + n <= r.data_ptr() + r.numel()]
        assert len(homes) == 1, f"segment {a:#x}+{n} is not inside one layer's tensor"
        r = raws[homes[0]]
        masks[homes[0]][a - r.data_ptr() : a - r.data_ptr() + n] = True
    return masks


def reached(raws: list[torch.Tensor], caches: dict[str, torch.Tensor], be: Backend, blocks: list[int]) -> list[torch.Tensor]:
    """The bytes vLLM's own views of `blocks` reach, per raw allocation."""
    for r in raws:
        r.zero_()
    for kv in caches.values():
        for b in blocks:
            be.block(kv, b).fill_(1.0)  # bf16 1.0: both bytes set
    return [r != 0 for r in raws]


TAKEN = [(1, 3), (4, NB)]  # blocks 1, 2, 4, 5 of 6; 0 is vLLM's null block


@pytest.mark.parametrize(
    "backend,kv_layout,planes",
    [
        # FLASH_ATTN / FLASHINFER / TRITON_ATTN on vLLM 0.26 (K and V packed per block), both layouts
        (PACKED, "NHD", 1),
        (PACKED, "HND", 1),
        # K and V as two planes ([2, nb, ...]): a stripe each
        (ROCM, "NHD", 2),
        # K and V of a block side by side ([nb, 2, ...])
        (HPC, "NHD", 1),
    ],
)
def test_segments_cover_exactly_the_taken_blocks_of_each_layer(backend: Backend, kv_layout: str, planes: int) -> None:
    heads, d = 2, 64
    raws, caches = llama(backend, kv_layout, heads, d)
    lay, _ = kv_layout_of(caches, NB, heads, heads, BS, 0, 1)
    storages = [(r.data_ptr(), r.numel()) for r in raws]
    segs = segments(lay, TAKEN, storages)
    # one per layer, plane and run of consecutive IDs
    assert len(segs) == len(raws) * planes * len(TAKEN)
    want = reached(raws, caches, backend, [b for a, z in TAKEN for b in range(a, z)])
    for got, w in zip(covered(segs, raws), want):
        assert torch.equal(got, w)


def test_segments_of_padded_pages_leave_the_padding_out() -> None:
    """Pages padded past the block (vLLM's `page_size_padded`): a segment
    per block, the padding between them in none."""
    raw, t, lay = padded_layer()
    segs = segments(lay, TAKEN, [(raw.data_ptr(), raw.numel())])
    assert len(segs) == 4
    want = reached([raw], {name(0): t}, PACKED, [1, 2, 4, 5])
    assert torch.equal(covered(segs, [raw])[0], want[0])


def test_segments_of_mla_blocks() -> None:
    """MLA's [nb, N, head_size]: one plane, one segment a run."""
    d = 576
    raws = [torch.zeros(NB * BS * d * ES, dtype=torch.int8) for _ in range(2)]
    caches = {name(i): r.view(DT).view(NB, BS, d) for i, r in enumerate(raws)}
    lay, _ = kv_layout_of(caches, NB, 1, 1, BS, 0, 1)
    segs = segments(lay, TAKEN, [(r.data_ptr(), r.numel()) for r in raws])
    assert len(segs) == 2 * len(TAKEN)
    mla = Backend(lambda h, dd, nb: (nb, BS, dd), {}, lambda t, b: t[b], 1)
    for got, w in zip(covered(segs, raws), reached(raws, caches, mla, [1, 2, 4, 5])):
        assert torch.equal(got, w)


def test_segments_that_touch_across_tensors_stay_apart_and_bad_blocks_are_refused() -> None:
    """Two layers' stripes that end and begin at one address but lie in two
    tensors are two segments (a piece must lie in one tensor); a layer's
    stripes that overlap another's (shared KV) are given once."""
    blk = 1024
    lay = {
        "num_blocks": 4,
        "layers": [
            {"planes": [{"base": 0x10000, "block_stride": blk, "block_bytes": blk}]},
            # blocks 1..4 of this one begin where the first's end
            {"planes": [{"base": 0x10000 + 3 * blk, "block_stride": blk, "block_bytes": blk}]},
            # the first layer again (shared memory)
            {"planes": [{"base": 0x10000, "block_stride": blk, "block_bytes": blk}]},
        ],
    }
    two = [(0x10000, 4 * blk), (0x10000 + 4 * blk, 3 * blk)]
    assert segments(lay, [(1, 4)], two) == [(0x10000 + blk, 3 * blk), (0x10000 + 4 * blk, 3 * blk)]
    # one tensor: one segment
    assert segments(lay, [(1, 4)], [(0x10000, 7 * blk)]) == [(0x10000 + blk, 6 * blk)]
    for bad in ([(0, 2)], [(2, 5)], [(3, 3)]):
        with pytest.raises(ValueError, match="not within"):
            segments(lay, bad, two)
    with pytest.raises(ValueError, match="no registered tensor"):
        segments(lay, [(1, 4)], [(0x10000, 4 * blk)])


def test_staging_memory_setting() -> None:
    # the default: the auto staging inside vLLM's KV cache
    assert PdConfig.from_extra_config({}).staging_memory == "kv_cache"
    assert PdConfig.from_extra_config({"orbitkv.pd.staging_memory": "kv_cache"}).staging_memory == "kv_cache"
    assert PdConfig.from_extra_config({"orbitkv.pd.staging_memory": "beside"}).staging_memory == "beside"
    # a size set by hand is memory beside the KV cache, unless kv_cache is asked for (refused below)
    assert PdConfig.from_extra_config({"orbitkv.pd.staging_mb": 512}).staging_memory == "beside"
    assert PdConfig.from_extra_config({"orbitkv.pd.staging_mb": 0}).staging_memory == "beside"
    with pytest.raises(ConfigError, match=r"orbitkv\.pd\.staging_memory"):
        PdConfig.from_extra_config({"orbitkv.pd.staging_memory": "gpu"})
    for bad in (1, True, None, ["kv_cache"]):
        with pytest.raises(ConfigError, match=r"orbitkv\.pd\.staging_memory"):
            PdConfig.from_extra_config({"orbitkv.pd.staging_memory": bad})
    with pytest.raises(ConfigError, match="a size set by hand"):
        PdConfig.from_extra_config({"orbitkv.pd.staging_memory": "kv_cache", "orbitkv.pd.staging_mb": 512})
