"""P/D through real vLLM servers with the prefill's source staging taken out
of vLLM's own KV cache (``orbitkv.pd.staging_memory`` ``kv_cache``): the
core of ``test_pd_vllm.py`` (P/D equal to one engine at block edges and
across chunked-prefill steps, with prefix hits; requests at once; a prefill
half that gives its pages back before its decode came; an abort during the
transfer; both instances back to 0 % KV usage after each) on a pair started
with it, and what it takes and uses, read from the prefill's log and
counters. CI runs it on the newest vLLM (0.32), where vLLM hands the
connector its block pool through ``bind_kv_cache_manager``."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
from test_pd_vllm import (  # the same checks, on this module's pair
    baseline,
    fresh_prompt,
    pd,
    snapshot,
    test_a_finished_prefill_gives_its_pages_back_before_its_decode_claims_it,
    test_abort_during_transfer,
    test_pd_concurrent_requests,
    test_pd_equals_single_engine,
)

import orbitkv.testing.cluster as tc
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
    """test_pd_vllm.py's pair (no routers) with the source staging in vLLM's KV cache."""
    yield from make_pd_cluster(tiny_model, tmp_path_factory, {"orbitkv.pd.staging_memory": "kv_cache"}, routers=False)


def test_the_source_staging_is_cut_out_of_vllms_kv_cache(cluster: Cluster) -> None:
    """The prefill's scheduler took a tenth of vLLM's blocks at most, its
    worker cut the layer pieces out of them at its first step, a chunked
    prompt's layers go from those pieces into decode's pages with one
    engine's answer, and idle, vLLM counts 0 % of its KV cache used (the
    taken blocks are out of its count)."""
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    before = snapshot(cluster, "prefill")
    prompt = fresh_prompt(1500)  # three chunked-prefill steps
    assert pd(cluster, prompt).token_ids == baseline(cluster, prompt)
    after = snapshot(cluster, "prefill")
    to_pages = "vllm:orbitkv_layers_staged_to_pages_total"
    assert after.get(to_pages, 0) > before.get(to_pages, 0), "no layer went from a piece into decode's pages"
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    log = cluster.log("prefill").read_text(errors="replace")
    took = re.search(r"OrbitKV: (\d+) of vLLM's (\d+) KV cache blocks \((\d+) MiB per rank\) taken", log)
    assert took, "the prefill's scheduler took no blocks for the source staging"
    taken, total = int(took[1]), int(took[2])
    assert 0 < taken <= total // 10 + 1, (taken, total)
    assert re.search(rf"source staging of \d+ MiB in {taken} KV blocks of vLLM's cache", log), (
        "the prefill's worker did not take the blocks"
    )
