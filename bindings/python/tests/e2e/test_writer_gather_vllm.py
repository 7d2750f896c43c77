"""P/D through real vLLM servers with ``orbitkv.pd.staging_pieces`` ``write``:
no layer piece at the layer's launch; a writer lane about to send a layer
write whose prefill pages are scattered copies them into one piece of the
source staging in decode's order and writes one range per run of decode
bytes. The prefill's block pool hands out every other block
(``ORBITKV_TESTING_SCATTER_FREE_BLOCKS``, the test shim: a pool as
fragmented as under load), decode's is left as vLLM makes it, so the
gather pays on every request (blocks of 16 tokens); the staging lies beside vLLM's KV cache
(taking blocks out of the scattered pool would find no run of them). P/D
must equal one engine token for token (a chunked prompt, prompts at
once), the prefill must have gathered and saved ranges, an abort during
the transfer must leave both instances idle, and every piece goes back.
The prefill ``kv_producer``, the decode ``kv_consumer``."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest
from test_pd_vllm import baseline, fresh_prompt, pd, run_concurrently, test_abort_during_transfer

import orbitkv.testing.cluster as tc
from orbitkv.testing.cluster import Cluster

__all__ = ["test_abort_during_transfer"]

GATHERED = "vllm:orbitkv_writes_gathered_total"
SAVED = "vllm:orbitkv_gather_ranges_saved_total"
NO_ROOM = "vllm:orbitkv_gather_no_room_total"
FAILED = "vllm:orbitkv_gather_failures_total"


@pytest.fixture(scope="module")
def cluster(
    make_pd_cluster: Callable[..., Iterator[Cluster]], tiny_model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    yield from make_pd_cluster(
        tiny_model, tmp_path_factory,
        {"orbitkv.pd.staging_pieces": "write", "orbitkv.pd.staging_memory": "beside"},
        routers=False, decode_staging={}, kv_roles=("kv_producer", "kv_consumer"),
        prefill_env={"ORBITKV_TESTING_SCATTER_FREE_BLOCKS": "1"},
        # blocks of 16 tokens: a chunk of 600 spans some 36 whole blocks (of
        # 128, at most 5, and the CPU layout's partial blocks, a range per
        # row, are never copied: nothing would be saved)
        vllm_args=("--block-size", "16"),
    )


def counters(cluster: Cluster) -> dict[str, float]:
    m = cluster.metrics("prefill")
    return {k: m.get(k, 0.0) for k in (GATHERED, SAVED, NO_ROOM, FAILED)}


def test_a_chunked_prompt_over_scattered_pages_is_gathered_by_the_writer(cluster: Cluster) -> None:
    """A prompt of five chunked-prefill steps over scattered prefill pages:
    one engine's answer, its layer writes gathered (ranges saved, none
    without room, no copy failed), the prefill's log names the copy, and
    both instances idle after (every piece back: the staging holds no
    request)."""
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    before = counters(cluster)
    prompt = fresh_prompt(3000)
    assert pd(cluster, prompt).token_ids == baseline(cluster, prompt)
    after = counters(cluster)
    assert after[GATHERED] > before[GATHERED], "no layer write was gathered"
    assert after[SAVED] > before[SAVED]
    assert after[NO_ROOM] == before[NO_ROOM] and after[FAILED] == before[FAILED] == 0
    log = cluster.log("prefill").read_text(errors="replace")
    assert re.search(r"writer lanes gather scattered layer writes .* copies: memcpy", log), "no gather set up"
    assert "KV blocks of vLLM's cache" not in log, "the staging was to lie beside vLLM's KV cache"
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)


def test_prompts_at_once_over_scattered_pages_equal_one_engine(cluster: Cluster) -> None:
    """Four prompts of 40 to 1500 tokens at once (writes of several requests
    gathered in one lane's batches): each equals one engine, and some layer
    writes were gathered."""
    before = counters(cluster)
    run_concurrently(cluster, cluster.proxy_url, "P/D over scattered pages")
    assert counters(cluster)[GATHERED] > before[GATHERED]
