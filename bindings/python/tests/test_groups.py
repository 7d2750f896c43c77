"""vLLM's KV cache groups as the connector hands them to the runtime
(orbitkv.vllm.groups, issue 46): one table per request, group-major, the
null block a hole; recurrent state in vLLM's align mode is a state group;
groups OrbitKV does not serve are refused by name."""

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


def test_recurrent_state_in_vllms_align_mode_is_a_state_group() -> None:
    """A Mamba / linear-attention group in vLLM's ``align`` cache mode (its
    table follows the token blocks; the block at each position holds the
    state after its tokens) is served: its layers are state layers."""
    m = group("MambaSpec", ["m0", "m1"])
    m.kv_cache_spec.mamba_cache_mode = "align"
    m.kv_cache_spec.num_speculative_blocks = 0
    g = kv_groups_of(SimpleNamespace(kv_cache_groups=[m, group("FullAttentionSpec", ["a"])]), 16)
    assert (g.count, g.state_groups, g.has_state) == (2, frozenset({0}), True)
    assert g.state_layers == frozenset({"m0", "m1"})
    # The state group's table: holes but where a state is kept.
    assert g.table([[0, 0, 7], [3, 4, 5]]) == [HOLE, HOLE, 7, 3, 4, 5]
    dense = kv_groups_of(SimpleNamespace(kv_cache_groups=[group("FullAttentionSpec", ["a"])]), 16)
    assert not dense.has_state and dense.state_layers == frozenset()


def test_recurrent_state_outside_align_mode_and_mixed_block_sizes_are_refused_by_name() -> None:
    mamba = SimpleNamespace(kv_cache_groups=[group("FullAttentionSpec", ["a"]), group("MambaSpec", ["m"])])
    with pytest.raises(GroupsError, match=r"'none' cache mode.*serves the 'align' mode"):
        kv_groups_of(mamba, 16)
    spec = group("MambaSpec", ["m"])
    spec.kv_cache_spec.mamba_cache_mode = "align"
    spec.kv_cache_spec.num_speculative_blocks = 2
    with pytest.raises(GroupsError, match="speculative"):
        kv_groups_of(SimpleNamespace(kv_cache_groups=[group("FullAttentionSpec", ["a"]), spec]), 16)
    other = SimpleNamespace(kv_cache_groups=[group("FullAttentionSpec", ["a"]), group("CrossAttentionSpec", ["x"])])
    other.kv_cache_groups[1].kv_cache_spec.__dict__.pop("num_kv_heads")
    with pytest.raises(GroupsError, match="CrossAttentionSpec"):
        kv_groups_of(other, 16)
    mixed = SimpleNamespace(
        kv_cache_groups=[group("FullAttentionSpec", ["a"], 16), group("SlidingWindowSpec", ["b"], 64)]
    )
    with pytest.raises(GroupsError, match=r"block sizes \[16, 64\]"):
        kv_groups_of(mixed, 16)
