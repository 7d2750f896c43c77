"""P/D through real vLLM servers with the prefill's source staging in memory
of its own beside vLLM's KV cache (``orbitkv.pd.staging_memory``
``beside``, the default before e642ecd; the default now cuts it out of
vLLM's KV cache, which ``test_pd_vllm.py`` runs): the core of
``test_pd_vllm.py`` (P/D equal to one engine at block edges and across
chunked-prefill steps, with prefix hits; requests at once; a prefill half
that gives its pages back before its decode came; an abort during the
transfer; both instances back to 0 % KV usage after each) on a pair started
with it, and what it takes and uses, read from the prefill's log and
counters. The pair is also the deployment docs/configuration.md
recommends for instances of one role: the prefill started as
``kv_producer``, the decode as ``kv_consumer`` with the defaults (which
then takes no staging at all). CI runs it on both vLLM versions."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
from test_pd_vllm import (  # the same checks, on this module's pair
    chunked_prompt_through_pieces,
    test_a_finished_prefill_gives_its_pages_back_before_its_decode_claims_it,
    test_abort_during_transfer,
    test_pd_concurrent_requests,
    test_pd_equals_single_engine,
)

from orbitkv.testing.cluster import Cluster

__all__ = [
    "test_a_finished_prefill_gives_its_pages_back_before_its_decode_claims_it",
    "test_abort_during_transfer",
    "test_pd_concurrent_requests",
    "test_pd_equals_single_engine",
]


@pytest.fixture(scope="module")
def cluster(
    make_pd_cluster: Callable[..., Iterator[Cluster]], tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """test_pd_vllm.py's pair (no routers): a kv_producer prefill with the
    source staging beside vLLM's KV cache, a kv_consumer decode with the
    defaults."""
    yield from make_pd_cluster(tiny_model, tmp_path_factory, {"orbitkv.pd.staging_memory": "beside"}, routers=False,
                               decode_staging={}, kv_roles=("kv_producer", "kv_consumer"))


def test_the_source_staging_lies_beside_vllms_kv_cache(cluster: Cluster) -> None:
    """The prefill took no block out of vLLM's pool, its worker took a
    region of its own for sources, a chunked prompt's layers go from the
    pieces into decode's pages with one engine's answer, and idle, vLLM
    counts 0 % of its KV cache used. The kv_consumer decode, with the
    defaults, took no staging: no block out of its KV cache, no region."""
    log = chunked_prompt_through_pieces(cluster)
    assert "taken for the source staging" not in log, "the prefill took blocks out of vLLM's KV cache"
    assert "KV blocks of vLLM's cache" not in log
    took = re.search(r"OrbitKV rank 0: staging 0 MiB for grants, (\d+) MiB for sources", log)
    assert took and int(took[1]) > 0, "the prefill's worker took no region of its own"
    dlog = cluster.log("decode").read_text(errors="replace")
    assert "taken for the source staging" not in dlog, "the kv_consumer decode took blocks out of vLLM's KV cache"
    assert "source staging in KV blocks" not in dlog and "MiB for sources" not in dlog, "the decode took staging"
