"""A prefill that stops or dies, through real vLLM servers: two prefill
instances and one decode (CPU, PdConnector, Mooncake TCP on loopback),
``orbitkv.proxy`` balancing over them, decode under vLLM's default KV-load
failure policy, ``recompute``.

* A stopped prefill (SIGSTOP past decode's deadline). The other e2e modules
  run decode with ``kv_load_failure_policy: fail``. With ``recompute`` a
  load that fails at decode's deadline is not the end of the request: decode
  recomputes the prompt into the same blocks and answers. The prefill may
  still write into those blocks (it was only stopped), so after the request
  ends decode must keep them until the prefill reports or the quarantine
  passes, not give them to the next request.
* The proxy in front of several instances. Requests spread over both
  prefills and equal one engine; when one prefill is killed (SIGKILL) while
  it runs requests, no client request hangs or fails: each request it held
  runs again on the other prefill (the proxy retries a request whose
  instance dropped it before any byte reached the client), later requests go
  to the live one, and decode holds nothing after the quarantine of the dead
  prefill's authorizations.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest

import orbitkv.testing.cluster as tc
from orbitkv.testing.cluster import Cluster, Completion, Metric, complete, http_get, prompt_source

# Prompts no other module shares a prefix with.
fresh_prompt = prompt_source(700000)

GEN = 16
PD_TIMEOUT_S = 12.0
QUARANTINE_S = 20.0


@pytest.fixture(scope="module")
def cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    run = tmp_path_factory.mktemp("pd-prefill-faults")
    c = Cluster(
        tiny_model,
        run,
        timeout_s=PD_TIMEOUT_S,
        prefill_config={"orbitkv.pd.handshake_timeout_s": PD_TIMEOUT_S, "orbitkv.pd.quarantine_s": QUARANTINE_S},
        decode_config={"orbitkv.pd.quarantine_s": QUARANTINE_S},
        # Prompts of 3000 tokens take 5 prefill steps: a stop or a kill lands
        # mid-request.
        vllm_args=["--max-num-batched-tokens", "600"],
        kv_load_failure_policy="recompute",
        more_prefills=1,
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
    want = complete(cluster.decode_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S)
    assert want.status == 200 and len(want.token_ids) == GEN
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    d0 = cluster.metrics("decode")
    out: dict[str, object] = {}

    def call() -> None:
        out["c"] = complete(cluster.proxy_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S)
        out["at"] = time.monotonic()

    t = threading.Thread(target=call)
    t.start()
    t_stop = cluster.stop_when_running("prefill")
    try:
        t.join(PD_TIMEOUT_S + 60)
        assert not t.is_alive(), "the request did not end with the prefill stopped"
        c = out["c"]
        assert isinstance(c, Completion) and c.status == 200, f"decode did not recompute: {c}"
        assert c.token_ids == want.token_ids, "the recomputed answer differs from one engine"
        end_s = float(out["at"]) - t_stop  # type: ignore[arg-type]
        assert end_s <= PD_TIMEOUT_S + 15, f"the request ended {end_s:.1f}s after the stop"
        assert cluster.metrics("decode")[Metric.FAILED] > d0[Metric.FAILED], "decode did not count the failed load"
        held = cluster.holds_blocks_of_failed_load(d0)
    finally:
        t_cont = cluster.resume("prefill")
    cluster.check_alive()
    cluster.wait_idle(timeout_s=QUARANTINE_S + tc.IDLE_TIMEOUT_S)
    print(
        f"recompute: decode answered (recomputed, equal to one engine) {end_s:.1f}s after SIGSTOP and "
        f"held the blocks ({held:.3f} of the cache) while the prefill was stopped; both idle "
        f"{time.monotonic() - t_cont:.1f}s after SIGCONT"
    )
    p = fresh_prompt(300)
    got = complete(cluster.proxy_url, p, GEN, timeout_s=tc.REQ_TIMEOUT_S)
    assert got.status == 200 and got.token_ids == complete(cluster.decode_url, p, GEN, timeout_s=tc.REQ_TIMEOUT_S).token_ids
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)


# ---- the proxy in front of two prefills ----------------------------------------------


def _concurrently(cluster: Cluster, prompts: list[list[int]]) -> tuple[list[Completion | None], list[threading.Thread]]:
    out: list[Completion | None] = [None] * len(prompts)

    def call(i: int) -> None:
        out[i] = complete(cluster.proxy_url, prompts[i], GEN, timeout_s=tc.REQ_TIMEOUT_S)

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return out, threads


def _join(threads: list[threading.Thread]) -> None:
    deadline = time.monotonic() + tc.REQ_TIMEOUT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = sum(t.is_alive() for t in threads)
    assert hung == 0, f"{hung} client requests still waiting after {tc.REQ_TIMEOUT_S} s"


def _equal_one_engine(cluster: Cluster, prompts: list[list[int]], got: list[Completion | None]) -> None:
    for i, (prompt, c) in enumerate(zip(prompts, got)):
        assert c is not None and c.status == 200, f"request {i}: {c}"
        want = complete(cluster.prefill_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S)
        assert want.status == 200, want
        assert c.token_ids == want.token_ids, f"request {i}: P/D differs from one engine"


def test_requests_spread_over_both_prefills_and_equal_one_engine(cluster: Cluster) -> None:
    # Both prefills in the proxy's rotation: the test before stops one and
    # resumes it, and the proxy leaves it out until it next checks it.
    cluster.wait_proxy_sees_healthy()
    released = {n: cluster.metrics(n)[Metric.RELEASED] for n in ("prefill", "prefill2")}
    completed = cluster.metrics("decode")[Metric.COMPLETED]
    prompts = [fresh_prompt(700) for _ in range(6)]
    got, threads = _concurrently(cluster, prompts)
    _join(threads)
    _equal_one_engine(cluster, prompts, got)
    for n, before in released.items():
        # A prefill counts its release when its worker next takes the
        # runtime's events, which may be after the client got its answer.
        deadline = time.monotonic() + 15
        while cluster.metrics(n)[Metric.RELEASED] <= before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cluster.metrics(n)[Metric.RELEASED] > before, f"{n} ran none of 6 concurrent requests"
    assert cluster.metrics("decode")[Metric.COMPLETED] - completed == 6, "decode did not load KV for each request"
    cluster.wait_idle(cluster.servers, timeout_s=tc.IDLE_TIMEOUT_S)


def test_a_prefill_killed_under_load_loses_no_request(cluster: Cluster) -> None:
    prompts = [fresh_prompt(3000) for _ in range(6)]
    got, threads = _concurrently(cluster, prompts)
    cluster.wait_running("prefill2", watch=cluster.servers)
    cluster.kill("prefill2")
    t_kill = time.monotonic()
    _join(threads)
    print(f"\nall 6 answered {time.monotonic() - t_kill:.1f} s after the kill")
    retried = cluster.log("proxy").read_text().count("unreachable (Server disconnected); trying other instances")
    assert retried >= 1, "no request was running on prefill2 when it died: the test did not test the failover"
    cluster.check_alive(["prefill", "decode", "proxy"])
    # The proxy left the dead one out (its /health names why).
    status, body = http_get(cluster.proxy_url, "/health")
    assert status == 200, body  # one prefill and the decode are enough
    health = json.loads(body)
    assert health[cluster.spec("prefill2").url]["health"] != 200, health
    assert health[cluster.prefill_url]["health"] == 200, health
    # Later requests: all to the live prefill.
    later = [fresh_prompt(300) for _ in range(4)]
    got_later, threads = _concurrently(cluster, later)
    _join(threads)
    _equal_one_engine(cluster, prompts + later, got + got_later)
    # Decode holds nothing once the dead prefill's authorizations passed
    # their deadline and quarantine.
    cluster.wait_idle(["prefill", "decode"], timeout_s=tc.IDLE_TIMEOUT_S)
