"""A dead-looking prefill under vLLM's default KV-load failure policy,
``recompute``, through real vLLM servers.

The other e2e modules run decode with ``kv_load_failure_policy: fail``. With
``recompute`` (vLLM's default) a load that fails at decode's deadline is not
the end of the request: decode recomputes the prompt into the same blocks
and answers. The prefill may still write into those blocks (it was only
stopped), so after the request ends decode must keep them until the prefill
reports or the quarantine passes, not give them to the next request.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from orbitkv.testing.cluster import (
    COMPLETED,
    FAILED,
    Cluster,
    Completion,
    complete,
    prompt_source,
    wait_until,
)

pytestmark = pytest.mark.e2e

# Prompts no other module shares a prefix with.
fresh_prompt = prompt_source(700000)

GEN = 16
PD_TIMEOUT_S = 12.0
QUARANTINE_S = 20.0
IDLE_TIMEOUT_S = 45.0
REQ_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    run = tmp_path_factory.mktemp("pd-recompute")
    c = Cluster(
        tiny_model,
        run,
        timeout_s=PD_TIMEOUT_S,
        prefill_config={"orbitkv.pd.handshake_timeout_s": PD_TIMEOUT_S, "orbitkv.pd.quarantine_s": QUARANTINE_S},
        decode_config={"orbitkv.pd.quarantine_s": QUARANTINE_S},
        vllm_args=["--max-num-batched-tokens", "600"],
        kv_load_failure_policy="recompute",
    )
    with c:  # started here, stopped after the module
        yield c
    print(f"\ncluster logs: {run}")


def test_stopped_prefill_recomputed_on_decode_and_its_blocks_held(cluster: Cluster) -> None:
    """SIGSTOP to the prefill while it computes a P/D request, past decode's
    deadline: decode recomputes and answers correctly, on time, and keeps
    the request's blocks after it ended while the stopped prefill may still
    write; SIGCONT: the prefill reports, both are idle, P/D works again.

    The baseline runs on decode first, so decode has the prompt's full
    blocks in its prefix cache: the P/D request then waits for (and on
    failure recomputes) only the last, partial block, while the prefill
    computes all of it, which leaves time to stop it mid-compute."""
    prompt = fresh_prompt(3000)
    want = complete(cluster.decode_url, prompt, GEN, timeout_s=REQ_TIMEOUT_S)
    assert want.status == 200 and len(want.token_ids) == GEN
    cluster.wait_idle(timeout_s=IDLE_TIMEOUT_S)
    d0 = cluster.metrics("decode")
    out: dict[str, object] = {}

    def call() -> None:
        out["c"] = complete(cluster.proxy_url, prompt, GEN, timeout_s=REQ_TIMEOUT_S)
        out["at"] = time.monotonic()

    proc = cluster.procs["prefill"]
    t = threading.Thread(target=call)
    t.start()
    try:
        wait_until(
            lambda: cluster.metrics("prefill").get("vllm:num_requests_running", 0) >= 1,
            60,
            "the prefill instance to run the request",
            [proc],
            every_s=0.01,
        )
    finally:
        os.killpg(proc.pgid, signal.SIGSTOP)
        t_stop = time.monotonic()
    try:
        t.join(PD_TIMEOUT_S + 60)
        assert not t.is_alive(), "the request did not end with the prefill stopped"
        c = out["c"]
        assert isinstance(c, Completion) and c.status == 200, f"decode did not recompute: {c}"
        assert c.token_ids == want.token_ids, "the recomputed answer differs from one engine"
        end_s = float(out["at"]) - t_stop  # type: ignore[arg-type]
        assert end_s <= PD_TIMEOUT_S + 15, f"the request ended {end_s:.1f}s after the stop"
        d1 = cluster.metrics("decode")
        assert d1[FAILED] > d0[FAILED] and d1[COMPLETED] == d0[COMPLETED]
        assert d1.get("vllm:num_requests_running", 0) == 0
        held = d1.get("vllm:kv_cache_usage_perc", 0)
        assert held > 0, "decode gave the blocks of a recomputed request back while its stopped prefill may write"
    finally:
        os.killpg(proc.pgid, signal.SIGCONT)
    t_cont = time.monotonic()
    cluster.check_alive()
    cluster.wait_idle(timeout_s=QUARANTINE_S + IDLE_TIMEOUT_S)
    print(
        f"recompute: decode answered (recomputed, equal to one engine) {end_s:.1f}s after SIGSTOP and "
        f"held the blocks ({held:.3f} of the cache) while the prefill was stopped; both idle "
        f"{time.monotonic() - t_cont:.1f}s after SIGCONT"
    )
    p = fresh_prompt(300)
    got = complete(cluster.proxy_url, p, GEN, timeout_s=REQ_TIMEOUT_S)
    assert got.status == 200 and got.token_ids == complete(cluster.decode_url, p, GEN, timeout_s=REQ_TIMEOUT_S).token_ids
    cluster.wait_idle(timeout_s=IDLE_TIMEOUT_S)
