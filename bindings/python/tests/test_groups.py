"""vLLM's KV cache groups as the connector hands them to the runtime
(orbitkv.vllm.groups, issue 46): one table per request, group-major, the
null block a hole; groups OrbitKV does not serve are refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from orbitkv.vllm.groups import HOLE, GroupsError, KvGroups, blocks_of, kv_groups_of


def group(kind: str, names: list[str], block_size: int = 32) -> SimpleNamespace:
    spec_cls = type(kind, (), {})
    spec = spec_cls()
    spec.block_size = block_size
    if "Mamba" not in kind:
        spec.num_kv_heads = 2
    return SimpleNamespace(kv_cache_spec=spec, layer_names=names)


def test_a_dense_model_is_one_group_and_its_tables_are_vllms_lists() -> None:
    g = kv_groups_of(SimpleNamespace(kv_cache_groups=[group("FullAttentionSpec", ["l0", "l1"], 16)]), 99)
    assert (g.count, g.block_size, g.layer_group) == (1, 16, {})
    assert g.table([[0, 5, 7]], 1) == [5, 7]  # one group: untouched (vLLM never lends block 0)
    assert kv_groups_of(None, 16) == KvGroups(1, 16)


def test_hybrid_tables_are_group_major_with_the_null_block_a_hole() -> None:
    cfg = SimpleNamespace(
        kv_cache_groups=[group("SlidingWindowSpec", ["l0", "l2"]), group("FullAttentionSpec", ["l1", "l3"])]
    )
    g = kv_groups_of(cfg, 16)
    assert (g.count, g.block_size) == (2, 32)
    assert g.layer_group == {"l0": 0, "l2": 0, "l1": 1, "l3": 1}
    # Request blocks 1.. of each group; the window's first is vLLM's null block.
    t = g.table([[9, 0, 4, 5], [9, 6, 7, 8]], 1)
    assert t == [HOLE, 4, 5, 6, 7, 8]
    assert blocks_of(t) == [4, 5, 6, 7, 8]
    assert g.new_blocks(None) == [] and g.new_blocks(([], [])) == []
    with pytest.raises(GroupsError, match="different numbers of blocks"):
        g.table([[1, 2], [3]])
    with pytest.raises(GroupsError, match="3 block lists for 2"):
        g.table([[1], [2], [3]])


def test_recurrent_state_and_mixed_block_sizes_are_refused_by_name() -> None:
    mamba = SimpleNamespace(kv_cache_groups=[group("FullAttentionSpec", ["a"]), group("MambaSpec", ["m"])])
    with pytest.raises(GroupsError, match=r"MambaSpec.*not recurrent state yet"):
        kv_groups_of(mamba, 16)
    mixed = SimpleNamespace(
        kv_cache_groups=[group("FullAttentionSpec", ["a"], 16), group("SlidingWindowSpec", ["b"], 64)]
    )
    with pytest.raises(GroupsError, match=r"block sizes \[16, 64\]"):
        kv_groups_of(mixed, 16)
