"""vLLM's KV cache groups (its hybrid KV cache manager) as OrbitKV sees them.

With the hybrid manager on (``SupportsHMA``), a model whose layers differ
(sliding-window and full attention, say) has one KV cache *group* per kind,
each layer takes its blocks from its group's block table, and every group
draws from one block pool. A request then has one block table per group;
OrbitKV hands the runtime one list, group-major (``groups`` equal segments:
``src/layout.rs``), with vLLM's null block (id 0: a sliding-window block
outside the window, freed or never allocated) as :data:`HOLE`, never read
or written.

A model of one group (every dense model) has one segment: the tables are
vLLM's own lists, as before the hybrid manager.

Groups of recurrent state (Mamba, linear attention) are served in vLLM's
``align`` cache mode, where a group's table follows the token blocks and the
block at each position holds the state after its tokens: they are groups
like the others (``state_groups``), whose layers vLLM saves no layer at a
time, and whose decode half loads all but the prompt's last token.

The connector serves the hybrid manager only where vLLM can take a failed
load of a request of several groups (``FAILED_RECVING``: vLLM >= 0.32,
``KVConnectorTransferResults.failed_recving``). vLLM 0.26 maps failed loads
to requests by block id over one group, and raises with several; with no
way to have such a request recomputed, the connector does not claim
``SupportsHMA`` there, and vLLM turns its hybrid manager off (sliding-window
layers then keep full-length KV, as before).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import base as _vllm_base

# vLLM >= 0.32: a failed load reported per request (failed_recving); the
# class that carries it, or None (vLLM 0.26..0.31).
TRANSFER_RESULTS: Any = getattr(_vllm_base, "KVConnectorTransferResults", None)
FAILED_RECVING = TRANSFER_RESULTS is not None

# In a block table: a block the rank does not hold (the runtime's HOLE).
HOLE = 2**32 - 1
# vLLM's null block (BlockPool pops it first; it is never allocated).
NULL_BLOCK = 0


class GroupsError(ValueError):
    """The model's KV cache groups are not ones OrbitKV can serve."""


@dataclass(frozen=True)
class KvGroups:
    """The KV cache groups of a model: each layer's group, and the block size."""

    count: int
    block_size: int
    # layer name -> group index (empty: one group)
    layer_group: dict[str, int] = field(default_factory=dict)
    # Groups of recurrent state (Mamba, linear attention): a block of theirs
    # is one request's state after the tokens of its position, not tokens.
    state_groups: frozenset[int] = frozenset()

    @property
    def has_state(self) -> bool:
        """Some layers keep recurrent state (a Mamba or linear-attention
        hybrid): decode then loads all but the prompt's last token (it
        recomputes that one on the state after the others), and prefill
        computes no more."""
        return bool(self.state_groups)

    @property
    def state_layers(self) -> frozenset[str]:
        """The layers of state groups (vLLM calls no per-layer save for them)."""
        return frozenset(n for n, g in self.layer_group.items() if g in self.state_groups)

    def table(self, per_group: Sequence[Sequence[int]], start: int = 0) -> list[int]:
        """One block table, group-major, of each group's blocks from request
        block ``start`` on, the null block as :data:`HOLE`. Raises
        :class:`GroupsError` when the groups have different numbers of
        blocks (the runtime needs equal segments)."""
        if len(per_group) != self.count:
            raise GroupsError(f"{len(per_group)} block lists for {self.count} KV cache groups")
        lists = [list(g[start:]) for g in per_group]
        if len({len(g) for g in lists}) > 1:
            raise GroupsError(
                "KV cache groups with different numbers of blocks for one request "
                f"({[len(g) for g in lists]}): only groups of one block size are served"
            )
        if self.count == 1:
            return lists[0]
        return [HOLE if b == NULL_BLOCK else b for g in lists for b in g]

    def new_blocks(self, per_group: Sequence[Sequence[int]] | None) -> list[int]:
        """A step's new blocks (``new_block_ids``: a list per group, or
        ``None``) as one table."""
        return self.table(per_group) if per_group else []


def blocks_of(table: Iterable[int]) -> list[int]:
    """The block ids of a table that are blocks (its holes left out)."""
    return [b for b in table if b != HOLE]


def kv_groups_of(kv_cache_config: Any, default_block_size: int) -> KvGroups:
    """The groups of ``kv_cache_config`` (``None``, or one group: the model
    of one group). Raises :class:`GroupsError` for groups OrbitKV does not
    serve yet: recurrent state outside vLLM's ``align`` mode or with
    speculative blocks, or groups of different block sizes."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) <= 1:
        size = getattr(getattr(groups[0], "kv_cache_spec", None), "block_size", None) if groups else None
        return KvGroups(1, int(size or default_block_size))
    sizes = set()
    layer_group: dict[str, int] = {}
    state: set[int] = set()
    for g, grp in enumerate(groups):
        spec = grp.kv_cache_spec
        kind = type(spec).__name__
        if "Mamba" in kind:
            _check_state_group(g, spec)
            state.add(g)
        elif not hasattr(spec, "num_kv_heads"):
            raise GroupsError(
                f"KV cache group {g} is {kind}: OrbitKV serves attention KV blocks (full attention, "
                "sliding window) and Mamba / linear-attention state, not this"
            )
        sizes.add(int(spec.block_size))
        for name in grp.layer_names:
            layer_group[name] = g
    if len(sizes) != 1:
        raise GroupsError(
            f"KV cache groups of block sizes {sorted(sizes)}: OrbitKV needs one block size for all groups"
        )
    return KvGroups(len(groups), sizes.pop(), layer_group, frozenset(state))


def _check_state_group(g: int, spec: Any) -> None:
    """A Mamba / linear-attention group OrbitKV serves: vLLM's ``align``
    cache mode (the default for hybrid models, with prefix caching on),
    where the group's table follows the request's token blocks and the
    block at each position holds the state after that block's tokens; no
    speculative state blocks."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        raise GroupsError(
            f"KV cache group {g} keeps recurrent state in vLLM's {mode!r} cache mode (one state block a "
            "request): OrbitKV serves the 'align' mode, vLLM's default for hybrid models with prefix "
            "caching on (do not pass --no-enable-prefix-caching, or set --mamba-cache-mode align)"
        )
    if int(getattr(spec, "num_speculative_blocks", 0) or 0):
        raise GroupsError(
            f"KV cache group {g} keeps speculative state blocks (speculative decoding): not served with "
            "recurrent state"
        )
