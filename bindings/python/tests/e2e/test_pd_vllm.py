"""P/D through real vLLM servers: correctness against one engine, corrupted
KV, aborts, and a prefill instance that dies.

One cluster (prefill + decode + proxy, see conftest.py) serves the module;
the tests run in file order and the last one kills the prefill instance.
The single-engine baseline is a plain request (no ``kv_transfer_params``) to
the prefill server, which then runs as a normal engine. Greedy decoding of
the fp32 tiny model is deterministic, so token ids must match exactly.
"""

from __future__ import annotations

import http.client
import json
import re
import secrets
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import orbitkv.testing.cluster as tc
from orbitkv.testing.cluster import Abandoned, Cluster, Completion, Metric, complete, prompt_source, wait_until
from orbitkv.vllm.params import mooncake_identity

# Prompts no other module shares a prefix with.
fresh_prompt = prompt_source(1000)

GEN = 16  # tokens generated per request
# conftest.PD_TIMEOUT_S: the prefill's claim deadline, how long a producer
# of the two-stage flow waits for a decode that never comes.
PD_CLAIM_TIMEOUT_S = 15.0


def ok(c: Completion, what: str) -> Completion:
    assert c.status == 200, f"{what}: HTTP {c.status}: {c.error}"
    assert len(c.token_ids) == GEN, f"{what}: {len(c.token_ids)} tokens: {c.body or c.text!r}"
    return c


def baseline(cluster: Cluster, prompt: list[int] | str) -> list[int]:
    return ok(complete(cluster.prefill_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S), "single engine").token_ids


def pd(cluster: Cluster, prompt: list[int] | str, stream: bool = False) -> Completion:
    return ok(complete(cluster.proxy_url, prompt, GEN, stream=stream, timeout_s=tc.REQ_TIMEOUT_S), "P/D")


def run_concurrently(cluster: Cluster, url: str, what: str, stream_every: int = 0) -> int:
    """Four P/D requests of 40 to 1500 tokens at once through ``url`` (every
    ``stream_every``-th streamed); each must equal one engine. Returns how
    many ran."""
    prompts = [fresh_prompt(n) for n in (40, 128, 700, 1500)]
    results: dict[int, Completion] = {}

    def run(i: int) -> None:
        stream = bool(stream_every) and i % stream_every == 0
        results[i] = complete(url, prompts[i], GEN, stream=stream, timeout_s=tc.REQ_TIMEOUT_S)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(tc.REQ_TIMEOUT_S + 10)
    assert sorted(results) == list(range(len(prompts)))
    for i, prompt in enumerate(prompts):
        assert ok(results[i], f"{what} #{i}").token_ids == baseline(cluster, prompt), f"request #{i}"
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    return len(prompts)


def snapshot(cluster: Cluster, name: str) -> dict[str, float]:
    return cluster.metrics(name)


def staged_by_hand(cluster: Cluster) -> bool:
    """This module's pair stages every request through grants (a staging
    size set by hand: conftest.STAGING_CONFIG, ORBITKV_TEST_STAGING=1); else
    it has the default layer pieces (in vLLM's KV cache, or beside it:
    test_staging_beside_vllm.py runs some of these tests on such a pair)."""
    return isinstance(cluster.prefill.extra_config.get("orbitkv.pd.staging_mb"), int)


def assert_serves_correctly(cluster: Cluster, n: int = 300) -> None:
    prompt = fresh_prompt(n)
    got = pd(cluster, prompt).token_ids
    assert got == baseline(cluster, prompt), "P/D after the event differs from one engine"
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)


# ---- (a) P/D output equals one engine, token for token ----------------------

LENGTHS = {
    "shorter-than-a-block": 5,
    "one-less-than-a-block": tc.BLOCK - 1,
    "exactly-a-block": tc.BLOCK,
    "a-block-plus-one": tc.BLOCK + 1,
    "many-blocks": 1000,
    "many-blocks-chunked": 3000,  # 5 prefill steps of 600 tokens
}


@pytest.mark.parametrize("n", list(LENGTHS.values()), ids=list(LENGTHS))
def test_pd_equals_single_engine(cluster: Cluster, n: int) -> None:
    before_p, before_d = snapshot(cluster, "prefill"), snapshot(cluster, "decode")
    # Cold on both instances: P/D first, then the single engine.
    cold = fresh_prompt(n)
    pd_cold = pd(cluster, cold).token_ids
    assert pd_cold == baseline(cluster, cold)
    # Single engine first: the prefill instance then has the prompt's full
    # blocks in its prefix cache and streams them without computing them.
    warm = fresh_prompt(n)
    want = baseline(cluster, warm)
    assert pd(cluster, warm).token_ids == want
    # Again: now decode has the full blocks in its own prefix cache too and
    # loads only the rest (the handshake's first_block > 0 when n > tc.BLOCK).
    assert pd(cluster, warm, stream=True).token_ids == want

    after_p, after_d = snapshot(cluster, "prefill"), snapshot(cluster, "decode")
    assert after_d[Metric.COMPLETED] - before_d[Metric.COMPLETED] == 3, "decode did not load KV for each P/D request"
    assert after_d[Metric.FAILED] == before_d[Metric.FAILED]
    assert after_p[Metric.BYTES] > before_p[Metric.BYTES]
    if staged_by_hand(cluster):
        # every request staged: gathered on prefill, scattered on decode
        granted, staged = "vllm:orbitkv_staging_granted_total", "vllm:orbitkv_layers_staged_total"
        assert after_d.get(granted, 0) - before_d.get(granted, 0) == 3, "a request was not given staging"
        assert after_p.get(staged, 0) > before_p.get(staged, 0), "no layer went through staging"
    else:
        # the defaults (orbitkv.pd.staging_mb "auto"): prefill gathers each
        # chunk in decode's block order and writes it into decode's pages,
        # when the prompt's layer pieces find room in the source staging (a
        # quarter of the 128 MiB KV cache: 32 MiB)
        to_pages = "vllm:orbitkv_layers_staged_to_pages_total"
        if n <= 1000:
            assert after_p.get(to_pages, 0) > before_p.get(to_pages, 0), "no layer went from staging into pages"
        assert after_d.get("vllm:orbitkv_staging_granted_total", 0) == 0, "decode granted staging by default"
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    assert_phases_timed(cluster, before_p, before_d, 3)


# The request phases timed once per P/D request (Prometheus histograms:
# docs/configuration.md#metrics), by the side that times them.
WRITTEN = "vllm:orbitkv_written_after_finish_seconds"
# timed with WRITTEN, per request written in full: the two parts of its tail
TAIL = (WRITTEN, "vllm:orbitkv_handshake_after_finish_seconds", "vllm:orbitkv_computed_after_finish_seconds",
        "vllm:orbitkv_sent_after_finish_seconds")
# timed by the prefill's vLLM worker itself, once per request finished
ENDED, REPORTED = "vllm:orbitkv_ended_after_finish_seconds", "vllm:orbitkv_reported_after_finish_seconds"
PHASES = {"prefill": (*TAIL, "vllm:orbitkv_pages_held_after_finish_seconds", ENDED, REPORTED),
          "decode": ("vllm:orbitkv_complete_to_taken_seconds",)}


def assert_phases_timed(cluster: Cluster, before_p: dict[str, float], before_d: dict[str, float], n: int) -> None:
    """Each of `n` P/D requests since the snapshots was timed once in every
    phase's histogram, each duration within the request's timeout. vLLM
    takes a step's stats right after the releases it reports, and each
    phase is timed before its release: none waits for a later step. But a
    request whose prefill pages went back before its writes ended (the
    defaults' early give-back) is released by vLLM first and timed written
    when its last write ends, which an idle prefill reports at its next
    step: that count may move by as many requests as gave their pages back."""
    before = {"prefill": before_p, "decode": before_d}

    def counts() -> dict[str, float]:
        got = {}
        for side, names in PHASES.items():
            now = snapshot(cluster, side)
            for name in names:
                got[name] = now.get(f"{name}_count", 0) - before[side].get(f"{name}_count", 0)
                assert now.get(f"{name}_sum", 0) - before[side].get(f"{name}_sum", 0) <= n * 120, name
        return got

    early = snapshot(cluster, "prefill").get(PAGES_BACK, 0)  # every early give-back so far
    wait_until(lambda: all(c >= n - (early if k in TAIL else 0) for k, c in counts().items()), 10,
               lambda: f"every phase timed {n} times: {counts()}")
    got = counts()
    assert all(c == n for k, c in got.items() if k not in TAIL), got
    assert all(abs(got[k] - n) <= early for k in TAIL), got
    # the tail's parts are timed together: one each per request written
    assert len({got[k] for k in TAIL}) == 1, got
    # a request is reported sent only once vLLM ended it: never sooner
    now = snapshot(cluster, "prefill")
    total = {k: now.get(f"{k}_sum", 0) - before_p.get(f"{k}_sum", 0) for k in (ENDED, REPORTED)}
    assert total[REPORTED] >= total[ENDED] > 0, total


def test_pd_text_prompts_and_streaming(cluster: Cluster) -> None:
    """Text prompts (tokenized by vLLM, with BOS), streamed and not."""
    prompts = [
        "The quick brown fox",
        " ".join(["prefill decode cache block layer transfer"] * 40),
    ]
    for text in prompts:
        want = baseline(cluster, text)
        streamed = pd(cluster, text, stream=True)
        assert streamed.token_ids == want
        assert streamed.ttft_s is not None and streamed.ttft_s <= streamed.total_s
        assert pd(cluster, text).token_ids == want
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)


def test_pd_concurrent_requests(cluster: Cluster) -> None:
    """Several P/D requests at once (batched on both instances)."""
    run_concurrently(cluster, cluster.proxy_url, "concurrent")


PAGES_BACK = "vllm:orbitkv_producer_pages_given_back_total"


def test_a_finished_prefill_gives_its_pages_back_before_its_decode_claims_it(cluster: Cluster) -> None:
    """The defaults (layer pieces): a prefill half sent alone (vLLM's
    two-stage flow) whose every layer is in a layer piece gives its KV
    pages back to vLLM once it finished, before its decode half even
    arrives (this prefill has seen a decode that takes pieces); the decode
    half sent afterwards gets the KV from the pieces and answers as one
    engine does."""
    if staged_by_hand(cluster):
        pytest.skip("a staging size set by hand (this module's run on vLLM 0.26) keeps whole stagings, "
                    "which hold the pages; CI's run on the newest vLLM has the defaults")
    warm = fresh_prompt(200)
    assert pd(cluster, warm).token_ids == baseline(cluster, warm)  # a decode that takes pieces
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    before_p, before_d = snapshot(cluster, "prefill"), snapshot(cluster, "decode")
    prompt = fresh_prompt(600)  # two chunks: a block shared by both
    half = complete(cluster.prefill_url, prompt, 1, timeout_s=tc.REQ_TIMEOUT_S,
                    kv_transfer_params={"do_remote_decode": True})
    assert half.status == 200, half.error
    params = (half.body or {}).get("kv_transfer_params")
    assert params, f"the prefill half carried no kv_transfer_params: {half.body}"
    # no decode has claimed it: its blocks are back all the same
    wait_until(
        lambda: (lambda m: m.get(PAGES_BACK, 0) > before_p.get(PAGES_BACK, 0)
                 and m.get("vllm:kv_cache_usage_perc", 1) == 0)(snapshot(cluster, "prefill")),
        30, "the prefill to give its pages back before the decode half came", [cluster.procs["prefill"]])
    assert snapshot(cluster, "decode")[Metric.COMPLETED] == before_d[Metric.COMPLETED]
    c = complete(cluster.decode_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S, kv_transfer_params=params)
    assert ok(c, "the decode half").token_ids == baseline(cluster, prompt)
    assert snapshot(cluster, "decode")[Metric.COMPLETED] - before_d[Metric.COMPLETED] == 1, "a double prefill"
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)


def chunked_prompt_through_pieces(cluster: Cluster) -> str:
    """A prompt of three chunked-prefill steps equals one engine's answer
    and at least one of its layers went from a layer piece into decode's
    pages; both instances idle after. The prefill's log, for what it says
    of the staging."""
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    before = snapshot(cluster, "prefill")
    prompt = fresh_prompt(1500)
    assert pd(cluster, prompt).token_ids == baseline(cluster, prompt)
    after = snapshot(cluster, "prefill")
    to_pages = "vllm:orbitkv_layers_staged_to_pages_total"
    assert after.get(to_pages, 0) > before.get(to_pages, 0), "no layer went from a piece into decode's pages"
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    return cluster.log("prefill").read_text(errors="replace")


def test_the_default_source_staging_is_cut_out_of_vllms_kv_cache(cluster: Cluster) -> None:
    """The defaults (``orbitkv.pd.staging_memory`` ``kv_cache``): the
    prefill's scheduler took a quarter of vLLM's blocks at most, its worker
    cut the layer pieces out of them at its first step, a chunked prompt's
    layers go from those pieces into decode's pages with one engine's
    answer, and idle, vLLM counts 0 % of its KV cache used (the taken
    blocks are out of its count)."""
    if staged_by_hand(cluster):
        pytest.skip("a staging size set by hand (this module's run on vLLM 0.26) lies beside vLLM's KV cache; "
                    "CI's run on the newest vLLM has the defaults")
    log = chunked_prompt_through_pieces(cluster)
    took = re.search(r"OrbitKV: (\d+) of vLLM's (\d+) KV cache blocks \((\d+) MiB per rank\) taken", log)
    assert took, "the prefill's scheduler took no blocks for the source staging"
    taken, total = int(took[1]), int(took[2])
    assert 0 < taken <= total // 4 + 1, (taken, total)
    assert re.search(rf"source staging of \d+ MiB in {taken} KV blocks of vLLM's cache", log), (
        "the prefill's worker did not take the blocks"
    )


GIVEN_BACK = re.compile(r"the (\d+) KV cache blocks it took for a source staging only a prefill uses are given back")


def test_a_kv_both_decode_that_only_decodes_gives_its_staging_blocks_back_to_vllm(cluster: Cluster) -> None:
    """The defaults on a decode started as ``kv_both`` (the pair of this
    module): it took the source staging's blocks like a prefill, and once it
    has decoded 64 P/D requests and prefilled none, it gives them back to
    vLLM's pool (its log says how many, the same count it took) and its
    worker stages no more. vLLM hands unhashed freed blocks out first, so
    the P/D requests right after land in those blocks: they equal one
    engine, and decode is back to idle."""
    if staged_by_hand(cluster):
        pytest.skip("a staging size set by hand (this module's run on vLLM 0.26) takes no blocks out of vLLM's "
                    "KV cache; CI's run on the newest vLLM has the defaults")
    import orbitkv.vllm.scheduler as sm

    def decode_log() -> str:
        return Path(cluster.log("decode")).read_text(errors="replace")

    took = re.search(r"OrbitKV: (\d+) of vLLM's \d+ KV cache blocks \(\d+ MiB per rank\) taken", decode_log())
    assert took, "the kv_both decode took no blocks for a source staging"
    sent = 0
    while not GIVEN_BACK.search(decode_log()) and sent < sm.DECODE_ONLY_HINT_AFTER:
        prompt = fresh_prompt(40)
        assert ok(pd(cluster, prompt), "P/D to count decodes").token_ids == baseline(cluster, prompt)
        sent += 1
    back = GIVEN_BACK.search(decode_log())
    assert back, f"decode gave no blocks back after {sent} more P/D requests"
    assert int(back[1]) == int(took[1]), (back[1], took[1])
    assert "the source staging's KV blocks went back to vLLM" in decode_log(), "decode's worker was not told"
    for n in (40, 700, 2500):  # 1, 6 and 20 blocks: the freed ones first
        prompt = fresh_prompt(n)
        assert ok(pd(cluster, prompt), f"P/D after the give-back, {n} tokens").token_ids == baseline(cluster, prompt)
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)


# ---- (a2) the same P/D through vllm-router --------------------------------------
#
# vllm-router (pinned 0.1.17, --vllm-pd-disaggregation, its default `nixl`
# mode) in front of the same prefill and decode: it sends the prefill half
# with `do_remote_decode` and one output token, then the decode half with the
# `kv_transfer_params` the prefill's response carried. OrbitKV serves that
# two-stage flow: the prefill mints the request's identity and capability and
# holds its blocks; decode authorizes its blocks and handshakes; the prefill
# then writes every layer from the held blocks (the transfer follows the
# prefill instead of overlapping it: docs/routers.md).


def via_router(cluster: Cluster, prompt: list[int] | str, stream: bool = False) -> Completion:
    return ok(complete(cluster.router_url, prompt, GEN, stream=stream, timeout_s=tc.REQ_TIMEOUT_S), "vllm-router")


def assert_kv_moved(before_p: dict[str, float], before_d: dict[str, float], cluster: Cluster, n: int) -> None:
    """Each of ``n`` requests moved its KV: decode counted ``n`` more complete
    transfers, prefill ``n`` more released producers, and bytes moved."""
    p1, d1 = snapshot(cluster, "prefill"), snapshot(cluster, "decode")
    assert d1[Metric.COMPLETED] - before_d[Metric.COMPLETED] == n, "decode did not receive the KV: a double prefill"
    assert p1[Metric.RELEASED] - before_p[Metric.RELEASED] == n
    assert p1[Metric.BYTES] > before_p[Metric.BYTES]


@pytest.mark.parametrize("n", list(LENGTHS.values()), ids=list(LENGTHS))
def test_through_vllm_router_equals_single_engine(cluster: Cluster, n: int) -> None:
    before_p, before_d = snapshot(cluster, "prefill"), snapshot(cluster, "decode")
    prompt = fresh_prompt(n)
    got = via_router(cluster, prompt).token_ids
    assert_kv_moved(before_p, before_d, cluster, 1)
    assert got == baseline(cluster, prompt), f"{n} tokens through vllm-router differ from one engine"
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)


def test_through_vllm_router_streaming_and_concurrency(cluster: Cluster) -> None:
    before_p, before_d = snapshot(cluster, "prefill"), snapshot(cluster, "decode")
    n = run_concurrently(cluster, cluster.router_url, "through vllm-router", stream_every=2)
    assert_kv_moved(before_p, before_d, cluster, n)


def test_through_vllm_router_an_abort_leaves_both_instances_idle(cluster: Cluster) -> None:
    """The client goes away while the router waits for the prefill half; then
    while decode waits. Both instances hold nothing soon after (the prefill's
    producer is aborted, or waits for a decode that never comes only until
    the claim deadline; decode's consumer is fenced)."""
    for wait_s in (0.05, 0.6):
        req = Abandoned(cluster.router_url, fresh_prompt(2500), GEN, stream=True)
        time.sleep(wait_s)
        req.drop()
        t0 = time.monotonic()
        cluster.wait_idle(timeout_s=PD_CLAIM_TIMEOUT_S + 10)
        print(f"vllm-router abort after {wait_s}s: both instances idle {time.monotonic() - t0:.2f}s later")
    cluster.check_alive(("prefill", "decode", "vllm-router"))
    got = via_router(cluster, prompt := fresh_prompt(300)).token_ids
    assert got == baseline(cluster, prompt)


def test_a_flood_of_unclaimed_two_stage_halves_does_not_hold_the_prefill(cluster: Cluster) -> None:
    """Issue 44's two-stage pin: a stranger sends prefill halves of vLLM's
    two-stage flow (``do_remote_decode``) with long prompts straight to the
    prefill's API and never sends their decode halves. Their blocks once
    waited for a decode until the handshake timeout (here 60 s, 120 s by
    default): eight of 3800 tokens held 240 of the prefill's 256 blocks, and
    a real request that needed more than the rest waited for them. Now the
    finished requests no decode claimed hold at most
    ``orbitkv.pd.unclaimed_kv_share`` of the cache (a quarter), the oldest
    given up beyond it: real P/D requests through the proxy and vllm-router
    each finish within 10 s, equal to one engine."""
    metric = "vllm:orbitkv_producers_unclaimed_released_total"
    before = snapshot(cluster, "prefill").get(metric, 0)
    t0 = time.monotonic()
    for i in range(8):  # one after the other: the pins cost KV, not a queue of compute
        pin = complete(cluster.prefill_url, fresh_prompt(3800), 1, timeout_s=tc.REQ_TIMEOUT_S,
                       kv_transfer_params={"do_remote_decode": True})
        assert pin.status == 200, f"pin {i}: {pin.status} {pin.error}"
    print(f"8 unclaimed two-stage halves of 3800 tokens sent in {time.monotonic() - t0:.1f}s")
    took: dict[str, float] = {}
    for url, name in ((cluster.proxy_url, "proxy"), (cluster.router_url, "vllm-router")):
        prompt = fresh_prompt(2500)  # 20 blocks: more than eight pins would leave
        t1 = time.monotonic()
        got = ok(complete(url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S), f"P/D through the {name} after the flood")
        took[name] = time.monotonic() - t1
        assert got.token_ids == baseline(cluster, prompt), name
    print(f"real P/D requests after a flood of unclaimed two-stage halves: {took}")
    assert all(t <= 10.0 for t in took.values()), took
    # the pins beyond the cap were given up at once, and counted
    wait_until(lambda: snapshot(cluster, "prefill").get(metric, 0) - before >= 5, 30, "unclaimed halves given up")
    cluster.wait_idle(timeout_s=PD_CLAIM_TIMEOUT_S + 10)
    cluster.check_alive(("prefill", "decode", "vllm-router"))


def flood_cancels(side_channel: str, source: str, most: int) -> tuple[int, int]:
    """Cancels for random unknown requests, each on its own connection from
    ``source``, to ``side_channel`` until one is refused ``503`` (or
    ``most``): how many were remembered (``200``), and the last status."""
    host, port = side_channel.rsplit(":", 1)
    status = 0
    for sent in range(most):
        body = json.dumps({"version": 4, "request_id": f"stranger-{uuid.uuid4().hex}",
                           "capability": secrets.token_hex(16), "reason": "x"})
        conn = http.client.HTTPConnection(host, int(port), timeout=10, source_address=(source, 0))
        try:
            conn.request("POST", "/orbitkv/v1/cancel", body, {"Content-Type": "application/json"})
            status = conn.getresponse().status
        finally:
            conn.close()
        if status != 200:
            return sent, status
    return most, status


def test_early_aborts_after_a_strangers_cancel_flood_free_decode_at_once(cluster: Cluster) -> None:
    """Issue 44's pre-open fill: a stranger floods the prefill's side channel
    with cancels for random unknown requests (each remembered against a
    later open). Once that filled the whole table, genuine early cancels
    (decode's fences for requests the busy prefill had not opened yet) were
    refused, and decode held their blocks until its deadline and quarantine
    (here 20 s, 181 s by default). Now one source address may hold a quarter
    of the table: the flood from 127.0.0.2 is refused at its share, decode's
    fences from 127.0.0.1 are remembered and answered ``fenced``, and decode
    is idle within 10 s of the aborts."""
    remembered, status = flood_cancels(cluster.prefill_kv, "127.0.0.2", 6000)
    print(f"the stranger's cancels: {remembered} remembered, then HTTP {status}")
    assert status == 503 and remembered <= 1024, (remembered, status)
    # The prefill busy with long plain requests: the P/D halves queue there
    # while decode authorizes at once, so decode's fences find them unopened.
    busy = [Abandoned(cluster.prefill_url, fresh_prompt(3800), 1, stream=False) for _ in range(2)]
    aborted = [Abandoned(cluster.proxy_url, fresh_prompt(1500), GEN) for _ in range(4)]
    time.sleep(0.5)
    for a in aborted:
        a.drop()
    t0 = time.monotonic()
    cluster.wait_idle(names=("decode",), timeout_s=10)
    print(f"decode idle {time.monotonic() - t0:.2f}s after 4 early aborts that followed the cancel flood")
    for b in busy:
        b.drop()
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    prompt = fresh_prompt(300)
    assert pd(cluster, prompt).token_ids == baseline(cluster, prompt)


def test_through_vllm_router_a_clients_params_steer_nothing(cluster: Cluster) -> None:
    """vllm-router drops a client's own kv_transfer_params: hostile OrbitKV
    keys sent through it change nothing, and the request is served as P/D."""
    before_p, before_d = snapshot(cluster, "prefill"), snapshot(cluster, "decode")
    for name, params in _bad_params(cluster.prefill_kv).items():
        prompt = fresh_prompt(200)
        c = complete(cluster.router_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S, kv_transfer_params=params)
        assert ok(c, name).token_ids == baseline(cluster, prompt), name
    assert_kv_moved(before_p, before_d, cluster, len(_bad_params(cluster.prefill_kv)))
    cluster.check_alive(("prefill", "decode", "vllm-router"))


def test_a_dialect_orbitkv_does_not_serve_is_counted_not_silently_recomputed(cluster: Cluster) -> None:
    """A decode half in vLLM's own fields that no OrbitKV prefill answered
    (`do_remote_prefill` without OrbitKV's keys), and llm-d's `offloading`
    dialect: each served plainly, logged, and counted in
    `vllm:orbitkv_params_refused`. (The `mooncake` dialect is on in this
    cluster: its refusals are below.)"""
    refused = "vllm:orbitkv_params_refused_total"
    before = snapshot(cluster, "decode").get(refused, 0)
    shapes = [
        {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1], "remote_host": "127.0.0.1"},
        {"do_remote_prefill": True, "do_remote_decode": False,
         "remote_prefiller": {"kv_request_id": "x", "remote_host": "127.0.0.1", "remote_port": 1}},
    ]
    for params in shapes:
        prompt = fresh_prompt(150)
        c = complete(cluster.decode_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S, kv_transfer_params=params)
        assert ok(c, "foreign dialect").token_ids == baseline(cluster, prompt)
    wait_until(
        lambda: snapshot(cluster, "decode").get(refused, 0) - before >= len(shapes),
        30,
        "decode to count the refused dialects",
        [cluster.procs["decode"]],
    )
    assert "dialect OrbitKV does not serve" in cluster.log("decode").read_text(errors="replace")


# ---- (a3) the mooncake dialect: vllm-router / llm-d --kv-connector mooncake -------
#
# The cluster's instances run with orbitkv.pd.dialects ["mooncake"]: the
# prefill's side channel (rank 0) answers GET /query as a Mooncake bootstrap
# server, and both halves of a request derive one OrbitKV identity and
# capability from the router's transfer_id. llm-d's sidecar sends both
# halves at once (connector_mooncake.go): the prefill streams each layer as
# it computes it while decode waits. vllm-router 0.1.17 sends decode only
# after the prefill answered: the prefill's producer then holds the blocks
# until decode's handshake, as in the two-stage flow.

MC_SOURCES = ("local_compute", "external_kv_transfer")


def prompt_tokens_by_source(cluster: Cluster, name: str) -> dict[str, float]:
    """vLLM's `vllm:prompt_tokens_by_source` per source (empty where this
    vLLM has no such series)."""
    status, body = tc.http_get(cluster.url_of(name), "/metrics")
    assert status == 200
    out = {s: 0.0 for s in MC_SOURCES}
    seen = False
    for line in body.decode().splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            m = re.search(r'source="([a-z_]+)"', line)
            if m and m.group(1) in out:
                out[m.group(1)] += float(line.rsplit(" ", 1)[1])
                seen = True
    return out if seen else {}


def mooncake_query(cluster: Cluster) -> dict:
    """What a router in its mooncake mode reads from the prefill's bootstrap
    port (here: the prefill's side channel, rank 0)."""
    status, body = tc.http_get(f"http://{cluster.prefill_kv}", "/query")
    assert status == 200, body
    return json.loads(body)


def mooncake_halves(cluster: Cluster, engine_id: str) -> tuple[dict, dict]:
    """The two halves' kv_transfer_params, exactly as llm-d's sidecar and
    vllm-router build them, under a fresh transfer_id."""
    t = f"xfer-{uuid.uuid4()}"
    prefill = {"do_remote_prefill": False, "do_remote_decode": True, "transfer_id": t}
    decode = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": t,
              "remote_bootstrap_addr": f"http://{cluster.prefill_kv}", "remote_engine_id": engine_id}
    return prefill, decode


def prefill_trace_times(cluster: Cluster, rid: str) -> tuple[list[float], list[float]]:
    """From the prefill worker's trace: when request ``rid``'s layer writes
    ended and when vLLM finished computing it (waits for the worker to have
    written both to its trace file)."""
    times: dict[str, list[float]] = {}

    def read() -> bool:
        try:
            events = json.loads(cluster.trace_path("prefill").read_text(errors="replace"))["traceEvents"]
        except (OSError, ValueError, KeyError):
            return False
        times.clear()
        for e in events:
            if (e.get("args") or {}).get("request") == rid:
                times.setdefault(e.get("name", ""), []).append(e["ts"])
        return bool(times.get("LayerWritten")) and bool(times.get("FinishRequest"))

    wait_until(read, 30, f"the prefill's trace to hold {rid}'s writes and finish", [cluster.procs["prefill"]],
               every_s=0.5)
    return times["LayerWritten"], times["FinishRequest"]


def at_once(prompt: list[int], calls: dict[str, tuple[str, int, dict]]) -> dict[str, Completion]:
    """``prompt`` sent to each ``(url, max_tokens, kv_transfer_params)`` at
    the same time; the completions by key."""
    out: dict[str, Completion] = {}

    def call(key: str, url: str, n: int, params: dict) -> None:
        out[key] = complete(url, prompt, n, timeout_s=tc.REQ_TIMEOUT_S, kv_transfer_params=params)

    threads = [threading.Thread(target=call, args=(k, *v)) for k, v in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(tc.REQ_TIMEOUT_S + 10)
    assert sorted(out) == sorted(calls)
    return out


def test_mooncake_dialect_both_halves_at_once_equal_one_engine(cluster: Cluster) -> None:
    """A stand-in for llm-d's `--kv-connector mooncake`: GET /query on the
    prefill's bootstrap port (its side channel), then both halves POSTed at
    once. Decode's answer equals one engine's, its KV came over the
    connector (a transfer completed, none failed, the prompt not computed on
    decode), the transfer_id is not echoed, and both instances end idle."""
    q = mooncake_query(cluster)
    assert q == {"0": {"engine_id": "prefill", "worker_addr": {"0": {"0": cluster.prefill_kv}}}}, q
    engine_id = q["0"]["engine_id"]
    before_p, before_d = snapshot(cluster, "prefill"), snapshot(cluster, "decode")
    src_before = prompt_tokens_by_source(cluster, "decode")
    prompts = [fresh_prompt(300), fresh_prompt(3000)]  # 3000: five prefill steps, streamed while decode waits
    transfer_ids = []
    for prompt in prompts:
        p_params, d_params = mooncake_halves(cluster, engine_id)
        transfer_ids.append(p_params["transfer_id"])
        out = at_once(prompt, {"p": (cluster.prefill_url, 1, p_params), "d": (cluster.decode_url, GEN, d_params)})
        assert out["p"].status == 200, f"prefill half: HTTP {out['p'].status}: {out['p'].error}"
        got = ok(out["d"], "mooncake dialect")
        assert got.body is not None and got.body.get("kv_transfer_params") is None, "decode echoed params"
        assert got.token_ids == baseline(cluster, prompt), f"{len(prompt)} tokens in the mooncake dialect"
    assert_kv_moved(before_p, before_d, cluster, len(prompts))
    assert snapshot(cluster, "decode")[Metric.FAILED] == before_d[Metric.FAILED]
    # Streamed: the long prompt's first layer write ended before the prefill
    # finished computing it (decode's handshake came while it computed).
    rid, _ = mooncake_identity(transfer_ids[-1], None)  # the cluster has no deployment key
    written, finished = prefill_trace_times(cluster, rid)
    assert min(written) < min(finished), f"no layer of {rid} was written before its prefill finished"
    src = prompt_tokens_by_source(cluster, "decode")
    if src:  # decode computed (almost) none of the prompts: their KV came over
        computed = src["local_compute"] - src_before["local_compute"]
        loaded = src["external_kv_transfer"] - src_before["external_kv_transfer"]
        print(f"decode prompt tokens: {computed:.0f} computed, {loaded:.0f} loaded")
        assert loaded >= sum(len(p) for p in prompts) - len(prompts), (computed, loaded)
        assert computed <= len(prompts), (computed, loaded)
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)


@pytest.mark.parametrize("n", [LENGTHS["a-block-plus-one"], LENGTHS["many-blocks-chunked"]])
def test_through_vllm_router_mooncake_mode_equals_single_engine(cluster: Cluster, n: int) -> None:
    """The real vllm-router 0.1.17, `--kv-connector mooncake`, its prefill's
    bootstrap port the side channel port: it read the engine ID from GET
    /query at start, sends the prefill half, then decode's."""
    before_p, before_d = snapshot(cluster, "prefill"), snapshot(cluster, "decode")
    prompt = fresh_prompt(n)
    c = complete(cluster.mooncake_router_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S)
    got = ok(c, "vllm-router --kv-connector mooncake").token_ids
    assert_kv_moved(before_p, before_d, cluster, 1)
    assert snapshot(cluster, "decode")[Metric.FAILED] == before_d[Metric.FAILED]
    assert got == baseline(cluster, prompt), f"{n} tokens through vllm-router's mooncake mode differ from one engine"
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)


def decode_never_connects(cluster: Cluster, params_for: Callable[[int], dict[str, Any]], what: str) -> int:
    """Sends decode a request whose params (``params_for(port)``) name a
    listener the test owns on loopback, on a port no deployment declared;
    asserts the answer equals one engine's (served plainly) and that nothing
    connects to the listener within 2 s. Returns the port."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        prompt = fresh_prompt(200)
        c = complete(cluster.decode_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S, kv_transfer_params=params_for(port))
        assert ok(c, what).token_ids == baseline(cluster, prompt)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.close()
            raise AssertionError(f"decode connected to 127.0.0.1:{port}, which no deployment declared")
    return port


def test_a_mooncake_half_whose_peer_never_comes_or_is_undeclared_steers_nothing(cluster: Cluster) -> None:
    """A decode half whose remote_bootstrap_addr names a port no deployment
    declared (a listener the sender owns on loopback) is served plainly,
    counted and logged, and nothing connects there. A prefill half whose
    decode never comes gives its blocks back at the claim deadline."""

    refused = "vllm:orbitkv_params_refused_total"
    before = snapshot(cluster, "decode").get(refused, 0)
    # the lone prefill half first: its claim deadline runs meanwhile
    lone, _ = mooncake_halves(cluster, "prefill")
    prompt = fresh_prompt(400)
    back = "vllm:orbitkv_producer_pages_given_back_total"
    back_before = snapshot(cluster, "prefill").get(back, 0)
    assert complete(cluster.prefill_url, prompt, 1, timeout_s=tc.REQ_TIMEOUT_S, kv_transfer_params=lone).status == 200
    t0 = time.monotonic()
    # held for decode: its blocks, or (staged by layer once a decode that
    # takes layer pieces was seen) its layer pieces, the blocks back at once
    p = snapshot(cluster, "prefill")
    assert p.get("vllm:kv_cache_usage_perc", 0) > 0 or p.get(back, 0) > back_before, (
        "the prefill held neither its blocks nor its layer pieces for decode"
    )
    _, params = mooncake_halves(cluster, "prefill")
    port = decode_never_connects(
        cluster, lambda port: {**params, "remote_bootstrap_addr": f"http://127.0.0.1:{port}"},
        "undeclared bootstrap address")
    wait_until(lambda: snapshot(cluster, "decode").get(refused, 0) > before, 30, "decode to count the refusal",
               [cluster.procs["decode"]])
    assert f"remote_bootstrap_addr 'http://127.0.0.1:{port}' is not an allowed prefill side channel" in (
        cluster.log("decode").read_text(errors="replace")
    )
    cluster.wait_idle(timeout_s=PD_CLAIM_TIMEOUT_S + 10)
    print(f"the lone prefill half's blocks went back {time.monotonic() - t0:.1f}s after it answered")


# ---- (b) a corrupted block changes decode's output ---------------------------


def test_corrupted_block_changes_output(cluster: Cluster) -> None:
    arm = cluster.run_dir / "corrupt-next-load"
    prompt = fresh_prompt(3 * tc.BLOCK + 44)
    want = baseline(cluster, prompt)
    arm.touch()
    try:
        got = pd(cluster, prompt).token_ids
        assert not arm.exists(), "the decode's corruption hook did not fire"
    finally:
        arm.unlink(missing_ok=True)
    assert got != want, "decode's output did not change with a corrupted KV block: is it using the transferred KV?"
    # The hook is one-shot: the next request is correct again.
    assert_serves_correctly(cluster)


SAVED_AT_WAIT = "vllm:orbitkv_layers_saved_at_wait_total"
TINY_LAYERS = 4  # orbitkv.testing.tiny_model's default


def test_layers_whose_save_hook_vllm_skips_are_sent_at_wait_for_save(cluster: Cluster) -> None:
    """Some vLLM model paths never call ``save_kv_layer`` (vllm-project/vllm#56762).
    Here the prefill's attention layers run without vLLM's per-layer connector
    hooks while a file exists (the cluster's vLLM shim). The connector must send
    those layers at ``wait_for_save``: output equal to one engine, the layers
    counted, and one warning in the log; never a request published with
    missing layers (the runtime's rule 7 would fail it instead)."""
    skip = cluster.run_dir / "skip-layer-hook"
    log = cluster.log("prefill")
    warning = "vLLM did not call save_kv_layer"
    # (prompt tokens, prefill steps of MAX_BATCHED_TOKENS=600)
    prompts = [(tc.BLOCK + 1, 1), (1500, 3)]
    before_p, before_d = snapshot(cluster, "prefill"), snapshot(cluster, "decode")
    skip.touch()
    try:
        for n, _ in prompts:
            prompt = fresh_prompt(n)
            got = pd(cluster, prompt).token_ids
            assert got == baseline(cluster, prompt), f"{n} tokens: P/D without the per-layer hook differs"
    finally:
        skip.unlink(missing_ok=True)
    after_p, after_d = snapshot(cluster, "prefill"), snapshot(cluster, "decode")
    sent_late = after_p.get(SAVED_AT_WAIT, 0) - before_p.get(SAVED_AT_WAIT, 0)
    assert sent_late == TINY_LAYERS * sum(steps for _, steps in prompts), (
        f"{sent_late} layers sent at wait_for_save: expected every layer of every prefill step"
    )
    assert after_d[Metric.COMPLETED] - before_d[Metric.COMPLETED] == len(prompts), "decode did not load KV for each request"
    assert after_d[Metric.FAILED] == before_d[Metric.FAILED]
    assert log.read_text(errors="replace").count(warning) == 1, "the fallback must be said once in the log"
    # With the hook back, layers go one by one again (nothing more counted).
    assert_serves_correctly(cluster)
    assert snapshot(cluster, "prefill").get(SAVED_AT_WAIT, 0) == after_p.get(SAVED_AT_WAIT, 0)


def _dashboard() -> Path:
    """docs/grafana/orbitkv-pd.json, found upward from this file (the wheel
    test in scripts/test.sh runs a copy of the tests with a copy of it)."""
    for d in Path(__file__).resolve().parents:
        f = d / "docs" / "grafana" / "orbitkv-pd.json"
        if f.is_file():
            return f
    raise AssertionError("docs/grafana/orbitkv-pd.json not found above the tests")


def test_every_series_the_grafana_dashboard_queries_exists_on_the_servers(cluster: Cluster) -> None:
    """The dashboard (docs/grafana) queries OrbitKV's and vLLM's series by
    name; after P/D traffic each must be on the prefill or the decode server's
    /metrics (a renamed vLLM metric breaks a panel silently otherwise)."""
    assert_serves_correctly(cluster)
    dash = json.loads(_dashboard().read_text())
    queried = {n for p in dash["panels"] for t in p.get("targets", []) for n in re.findall(r"vllm:[a-z_]+", t["expr"])}
    served = set(snapshot(cluster, "prefill")) | set(snapshot(cluster, "decode"))
    assert queried - served == set(), f"series the dashboard queries that no server exports: {sorted(queried - served)}"


def test_one_timeline_per_request_from_both_traces(cluster: Cluster, tmp_path: Path) -> None:
    """`orbitkv trace` merges the prefill's and the decode's worker traces
    into one timeline of a request: both processes, the request's producer
    and consumer lanes and the writes of its layers, on one clock."""
    got = pd(cluster, fresh_prompt(3 * tc.BLOCK + 5))
    rid = got.request_id
    assert rid, "the proxy names the request (X-Request-Id)"
    assert cluster.wait_for_traces([rid], timeout_s=30), "the traces do not name the request"
    out = tmp_path / "request.json"
    r = subprocess.run(
        [sys.executable, "-m", "orbitkv.cli", "trace", rid,
         str(cluster.trace_path("prefill")), str(cluster.trace_path("decode")), "-o", str(out)],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    events = json.loads(out.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(procs.values()) == ["trace.decode (trace.decode.json)", "trace.prefill (trace.prefill.json)"]
    lanes = [e["args"]["name"] for e in events if e.get("name") == "thread_name"]
    assert any(n.startswith("producer") and rid in n for n in lanes), lanes
    assert any(n.startswith("consumer") and rid in n for n in lanes), lanes
    writes = [e for e in events if e.get("name") == "write" and e.get("ph") in ("X", "b")]
    assert len(writes) >= 4, "the writes of the request's 4 layers"
    roots = {e["pid"]: e for e in events if e.get("name") == "request" and e.get("ph") == "X"}
    assert len(roots) == 2
    # One clock: the two halves of the request overlap in time.
    (a, b) = roots.values()
    assert a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"], "the two halves do not overlap"
    # A request nobody traced: exit status 1, a message.
    r = subprocess.run(
        [sys.executable, "-m", "orbitkv.cli", "trace", "no-such-request", str(cluster.trace_path("decode")),
         "-o", str(tmp_path / "none.json")],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 1 and "no event of request no-such-request" in r.stderr
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)


# ---- (c) aborts: both instances stay healthy and hold nothing -----------------


def _drop_when(cluster: Cluster, req: Abandoned, pred, what: str, timeout_s: float = 60.0) -> None:
    try:
        wait_until(pred, timeout_s, what, [cluster.procs[n] for n in ("prefill", "decode", "proxy")], every_s=0.01)
    finally:
        req.drop()


def test_abort_during_prefill(cluster: Cluster) -> None:
    """The client goes away while the prefill instance is still computing a
    long prompt (several chunked-prefill steps): the prefill request is
    aborted before it completes, the decode request while it waits for KV."""
    p0, d0 = snapshot(cluster, "prefill"), snapshot(cluster, "decode")
    req = Abandoned(cluster.proxy_url, fresh_prompt(4000), GEN, stream=True)
    _drop_when(
        cluster,
        req,
        lambda: snapshot(cluster, "prefill").get("vllm:num_requests_running", 0) >= 1,
        "the prefill instance to run the request",
    )
    t_drop = time.monotonic()
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    idle_s = time.monotonic() - t_drop
    p1, d1 = snapshot(cluster, "prefill"), snapshot(cluster, "decode")
    assert p1[Metric.SUCCESS] == p0[Metric.SUCCESS], "the prefill request completed: the abort did not land during prefill"
    assert d1[Metric.SUCCESS] == d0[Metric.SUCCESS]
    assert d1[Metric.COMPLETED] == d0[Metric.COMPLETED], "decode received the whole KV of an aborted prefill"
    print(f"abort during prefill: both instances idle {idle_s:.2f}s after the disconnect")
    cluster.check_alive()
    assert_serves_correctly(cluster)


def test_abort_during_transfer(cluster: Cluster) -> None:
    """The client goes away after the prefill instance finished computing
    but before its KV reached decode: the prefill's layer writes are slowed
    down by the test hook (``ORBITKV_TESTING_WRITE_DELAY``), so the decode
    request is aborted while writes into its pages are still to come."""
    delay = cluster.run_dir / "write-delay"
    p0, d0 = snapshot(cluster, "prefill"), snapshot(cluster, "decode")
    delay.write_text("0.75")  # per layer: 4 layers -> 3 s of transfer
    try:
        req = Abandoned(cluster.proxy_url, fresh_prompt(2 * tc.BLOCK + 50), GEN, stream=True)
        _drop_when(
            cluster,
            req,
            lambda: snapshot(cluster, "prefill")[Metric.SUCCESS] > p0[Metric.SUCCESS],
            "the prefill instance to finish the request",
        )
        t_drop = time.monotonic()
        at_drop = snapshot(cluster, "decode")
    finally:
        delay.unlink(missing_ok=True)
    assert at_drop[Metric.COMPLETED] == d0[Metric.COMPLETED], "the KV had already arrived: the abort was not during the transfer"
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    idle_s = time.monotonic() - t_drop
    p1, d1 = snapshot(cluster, "prefill"), snapshot(cluster, "decode")
    assert d1[Metric.SUCCESS] == d0[Metric.SUCCESS], "the decode request completed despite the disconnect"
    assert p1[Metric.RELEASED] > p0[Metric.RELEASED], "the prefill's source blocks were not released"
    print(f"abort during transfer: both instances idle {idle_s:.2f}s after the disconnect")
    cluster.check_alive()
    assert_serves_correctly(cluster)


STORM_REQUESTS = 16
STORM_IN_FLIGHT = 4  # what two cores carry with both engines busy
QUARANTINE_EXPIRED = "vllm:orbitkv_consumers_quarantine_expired_total"
FENCES_SENT = "vllm:orbitkv_fences_sent_total"


def test_a_storm_of_early_cancels_leaves_both_instances_idle_within_2s(cluster: Cluster) -> None:
    """Issue 32's reproduction: streamed requests of 300-1500 tokens, four in
    flight, each dropped by its client 0-300 ms after sending (some before
    prefill scheduled them, some while prefill computed, some while their KV
    moved, some after it arrived). Decode's consumers that vLLM released
    while their producers had not ended fence them (the cancel carries the
    generation; the prefill answers whether anything can still land), so
    both instances hold no request and no KV block within 2 s of the last
    cancel, not at timeout + quarantine (here 15 + 5 s; on b985850 decode
    held its blocks that long); every request was answered or cancelled; no
    quarantine expired; the next request equals one engine."""
    import random

    rng = random.Random(32)
    d0 = snapshot(cluster, "decode")
    lock = threading.Lock()
    drops: list[float] = []
    queue = list(range(STORM_REQUESTS))

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                queue.pop()
                wait_s = rng.uniform(0.0, 0.3)
                n = rng.randint(300, 1500)
            req = Abandoned(cluster.proxy_url, fresh_prompt(n), GEN, stream=True)
            time.sleep(max(0.0, req.sent + wait_s - time.monotonic()))
            req.drop()
            with lock:
                drops.append(time.monotonic())

    threads = [threading.Thread(target=client) for _ in range(STORM_IN_FLIGHT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(tc.REQ_TIMEOUT_S)
    assert len(drops) == STORM_REQUESTS, f"{len(drops)} of {STORM_REQUESTS} requests sent and dropped"
    last = max(drops)
    cluster.wait_idle(timeout_s=max(0.1, last + 2.0 - time.monotonic()))
    idle_s = time.monotonic() - last
    d1 = snapshot(cluster, "decode")
    print(
        f"cancel storm: {STORM_REQUESTS} requests, both instances idle {idle_s:.2f}s after the last cancel; "
        f"decode sent {d1.get(FENCES_SENT, 0) - d0.get(FENCES_SENT, 0):.0f} fences"
    )
    assert d1.get(QUARANTINE_EXPIRED, 0) == d0.get(QUARANTINE_EXPIRED, 0), "a consumer waited out its quarantine"
    cluster.check_alive()
    assert_serves_correctly(cluster)


def test_a_request_decode_rejects_before_admission_leaves_both_idle_at_once(cluster: Cluster) -> None:
    """An early end of issue 32's list: vLLM on decode refuses the request
    before admitting it (its prompt plus max_tokens exceed the model's 4096
    positions; the prefill half, with one output token, fits; vLLM 0.32
    clamps max_tokens instead, and the request completes, cut short). Decode never
    allocates a block; the proxy cancels the prefill half, whose producer
    (no handshake will come) is aborted and released. Both instances hold
    nothing within 2 s of the answer."""
    prompt = fresh_prompt(4096 - 4)
    c = complete(cluster.proxy_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S)
    answered = time.monotonic()
    if c.status == 200:
        # vLLM 0.32 clamps max_tokens to the room the model has left instead
        # of refusing: both halves run, and the answer is cut at the length
        assert 0 < len(c.token_ids) < GEN, f"neither refused nor clamped: {len(c.token_ids)} tokens"
    else:
        assert c.status == 400, f"decode answered HTTP {c.status}: {c.error}"
    cluster.wait_idle(timeout_s=2.0)
    print(f"decode rejected it: both instances idle {time.monotonic() - answered:.2f}s after the answer")
    cluster.check_alive()
    assert_serves_correctly(cluster)


# ---- (c2) hostile input and dead peers: no engine exits ----------------------


def _cap() -> str:
    return uuid.uuid4().hex + uuid.uuid4().hex


def _bad_params(prefill_kv: str) -> dict[str, dict[str, object]]:
    """kv_transfer_params a client can send straight to a server's API."""
    return {
        "bogus role": {"orbitkv_role": "bogus", "orbitkv_request": "x"},
        "no capability": {"orbitkv_role": "consumer", "orbitkv_request": "x", "orbitkv_prefill_kv": prefill_kv},
        "port not a number": {
            "orbitkv_role": "consumer",
            "orbitkv_request": "x",
            "orbitkv_capability": _cap(),
            "orbitkv_prefill_kv": "127.0.0.1:abc",
        },
        "prefill not allowed": {  # a loopback address outside the allow-list: no handshake leaves
            "orbitkv_role": "consumer",
            "orbitkv_request": "x",
            "orbitkv_capability": _cap(),
            "orbitkv_prefill_kv": "127.0.0.2:17500",
        },
        "undeclared port of an allowed host": {  # issue 31's SSRF: a listener the client owns
            "orbitkv_role": "consumer",
            "orbitkv_request": "x",
            "orbitkv_capability": _cap(),
            "orbitkv_prefill_kv": "127.0.0.1:9",
        },
        "role a number": {"orbitkv_role": 7, "orbitkv_request": "x", "orbitkv_capability": _cap()},
        "not a mapping": {"orbitkv_role": "producer", "orbitkv_request": {"a": 1}, "orbitkv_capability": _cap()},
    }


def test_hostile_params_fail_that_request_alone(cluster: Cluster) -> None:
    """The hardening issue's first critical reproduction: a request with
    malformed OrbitKV params sent straight to either server killed its
    engine. Now each is served as a plain request (same tokens as one
    engine), both engines live on, and P/D still works."""
    prompt = fresh_prompt(200)
    want = baseline(cluster, prompt)
    for what, params in _bad_params(cluster.prefill_kv).items():
        for server in ("decode", "prefill"):
            c = complete(cluster.url_of(server), prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S, kv_transfer_params=params)
            assert c.status == 200, f"{what} on {server}: HTTP {c.status}: {c.error}"
            assert c.token_ids == want, f"{what} on {server}: not served as a plain request"
            cluster.check_alive()
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    assert_serves_correctly(cluster)


def test_decode_posts_no_handshake_to_an_undeclared_port_of_an_allowed_host(cluster: Cluster) -> None:
    """Issue 31's SSRF: a client that reaches decode's API names a listener
    it owns on loopback (an allowed host) as the prefill side channel. On
    b985850 decode posted its whole handshake there (capability, generation,
    Mooncake endpoint, every layer's address). Now the allow-list names
    endpoints: the request is served plainly, counted, and nothing connects
    to the listener."""

    refused = "vllm:orbitkv_params_refused_total"
    before = snapshot(cluster, "decode").get(refused, 0)
    decode_never_connects(
        cluster, lambda port: {"orbitkv_role": "consumer", "orbitkv_request": "ssrf", "orbitkv_capability": _cap(),
                               "orbitkv_prefill_kv": f"127.0.0.1:{port}"},
        "undeclared side channel")
    wait_until(lambda: snapshot(cluster, "decode").get(refused, 0) > before, 30, "decode to count the refusal",
               [cluster.procs["decode"]])


def test_duplicate_request_ids_fail_alone(cluster: Cluster) -> None:
    """Two concurrent decode requests with the same orbitkv_request (decode
    died of this before): the first gets the KV from its prefill, the second
    is served plainly; both answer the right tokens."""
    prompt = fresh_prompt(300)
    want = baseline(cluster, prompt)
    pd_id, cap = f"dup-{uuid.uuid4().hex}", _cap()
    consumer = {
        "orbitkv_role": "consumer",
        "orbitkv_request": pd_id,
        "orbitkv_capability": cap,
        "orbitkv_prefill_kv": cluster.prefill_kv,
    }
    producer = {"orbitkv_role": "producer", "orbitkv_request": pd_id, "orbitkv_capability": cap}
    out: dict[str, Completion] = {}

    def call(key: str, url: str, n: int, params: dict) -> None:
        out[key] = complete(url, prompt, n, timeout_s=tc.REQ_TIMEOUT_S, kv_transfer_params=params)

    threads = [
        threading.Thread(target=call, args=("d1", cluster.decode_url, GEN, consumer)),
        threading.Thread(target=call, args=("d2", cluster.decode_url, GEN, consumer)),
        threading.Thread(target=call, args=("p", cluster.prefill_url, 1, producer)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(tc.REQ_TIMEOUT_S + 10)
    assert ok(out["d1"], "first").token_ids == want
    assert ok(out["d2"], "duplicate").token_ids == want
    cluster.check_alive()
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    assert_serves_correctly(cluster)


def test_a_producer_released_mid_prefill_does_not_kill_prefill(cluster: Cluster) -> None:
    """The second critical reproduction: the producer is released while vLLM
    still computes the prompt (here: decode's cancel, with the request's
    capability, lands between two chunked-prefill steps). vLLM's later
    per-layer saves find nothing to send; before the fix the first of them
    raised inside the forward and killed the engine."""
    from orbitkv import cancel_message
    from orbitkv.vllm.side_channel import post_cancel

    p0 = snapshot(cluster, "prefill")
    pd_id, cap = f"released-{uuid.uuid4().hex}", _cap()
    producer = {"orbitkv_role": "producer", "orbitkv_request": pd_id, "orbitkv_capability": cap}
    out: dict[str, object] = {}

    def call() -> None:
        out["p"] = complete(cluster.prefill_url, fresh_prompt(4000), 1, timeout_s=tc.REQ_TIMEOUT_S, kv_transfer_params=producer)

    t = threading.Thread(target=call)
    t.start()
    cluster.wait_running("prefill")
    post_cancel(cluster.prefill_kv, cancel_message(pd_id, cap, "test: decode gave up"))
    released_while_running = False
    while t.is_alive():
        released_while_running |= snapshot(cluster, "prefill")[Metric.RELEASED] > p0[Metric.RELEASED] and t.is_alive()
        time.sleep(0.01)
    t.join()
    c = out["p"]
    assert isinstance(c, Completion) and c.status == 200, c
    assert released_while_running, "the producer was not released while vLLM still computed the prompt"
    cluster.check_alive()
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    assert_serves_correctly(cluster)


def test_decode_killed_mid_transfer_then_restarted(cluster: Cluster) -> None:
    """Decode dies (SIGKILL) while prefill's layer writes into it are still
    to come: prefill fails or aborts the request within its write timeout,
    releases its blocks and stays up; decode restarted on the same port
    serves P/D again."""
    delay = cluster.run_dir / "write-delay"
    p0 = snapshot(cluster, "prefill")
    delay.write_text("0.75")  # per layer: 4 layers -> 3 s of transfer
    try:
        req = Abandoned(cluster.proxy_url, fresh_prompt(2 * tc.BLOCK + 50), GEN, stream=True)
        try:
            cluster.wait_finished(p0)
            cluster.kill("decode")
            t_kill = time.monotonic()
        finally:
            req.drop()
    finally:
        delay.unlink(missing_ok=True)
    cluster.check_alive(["prefill", "proxy"])
    cluster.wait_idle(["prefill"], timeout_s=tc.IDLE_TIMEOUT_S)
    released_s = time.monotonic() - t_kill
    assert snapshot(cluster, "prefill")[Metric.RELEASED] > p0[Metric.RELEASED], "prefill did not release the request"
    t_restart = time.monotonic()
    cluster.start_server("decode")
    print(f"decode killed: prefill idle {released_s:.1f}s later; decode back in {time.monotonic() - t_restart:.1f}s")
    cluster.check_alive()
    assert_serves_correctly(cluster)


# ---- (d) the prefill instance dies mid-request: runs last ---------------------


def test_prefill_killed_mid_request(cluster: Cluster) -> None:
    """SIGKILL of the prefill's process group while it computes. A decode
    request driven directly (its consumer half: nobody cancels it) fails
    within ``orbitkv.pd.timeout_s``; a request through the proxy gets an
    error; decode then serves plain requests and holds no block."""
    after_prompt = fresh_prompt(300)
    want_after = baseline(cluster, after_prompt)  # while the prefill is alive

    prompt = fresh_prompt(4000)
    pd_id = f"killtest-{uuid.uuid4().hex}"
    capability = uuid.uuid4().hex + uuid.uuid4().hex
    consumer = {
        "orbitkv_role": "consumer",
        "orbitkv_request": pd_id,
        "orbitkv_capability": capability,
        "orbitkv_prefill_kv": cluster.prefill_kv,
        "orbitkv_prefill_tp": 1,
    }
    producer = {"orbitkv_role": "producer", "orbitkv_request": pd_id, "orbitkv_capability": capability}
    out: dict[str, object] = {}

    def call(key: str, url: str, max_tokens: int, params: dict | None, stream: bool = False) -> None:
        try:
            extra = {"kv_transfer_params": params} if params else {}
            out[key] = complete(url, prompt, max_tokens, stream=stream, timeout_s=tc.REQ_TIMEOUT_S, **extra)
        except Exception as e:  # noqa: BLE001 - the prefill dies under this one: any error is the outcome
            out[key] = e
        out[key + "_at"] = time.monotonic()

    threads = [
        threading.Thread(target=call, args=("decode", cluster.decode_url, GEN, consumer)),
        threading.Thread(target=call, args=("prefill", cluster.prefill_url, 1, producer)),
        threading.Thread(target=call, args=("proxy", cluster.proxy_url, GEN, None, True)),
    ]
    for t in threads:
        t.start()
    try:
        cluster.wait_running("prefill")
    finally:
        cluster.kill("prefill")
        t_kill = time.monotonic()
    for t in threads:
        t.join(tc.REQ_TIMEOUT_S + 10)
    assert not any(t.is_alive() for t in threads), "a request did not end"

    dec = out["decode"]
    assert isinstance(dec, Completion), dec
    assert dec.status >= 500, f"decode answered {dec.status} without its KV: {dec.text!r}"
    timeout_s = cluster.timeout_s
    assert timeout_s is not None
    fail_s = float(out["decode_at"]) - t_kill
    assert fail_s <= timeout_s + 10, f"decode failed the request {fail_s:.1f}s after the kill"
    prx = out["proxy"]
    assert isinstance(prx, Completion) and prx.status != 200, f"the proxy request did not fail: {prx}"
    assert float(out["proxy_at"]) - t_kill <= timeout_s + 10
    print(f"prefill killed: decode failed its request after {fail_s:.1f}s; proxy answered {prx.status}")

    cluster.check_alive(["decode", "proxy"])
    cluster.wait_idle(["decode"], timeout_s=tc.IDLE_TIMEOUT_S)
    plain = ok(complete(cluster.decode_url, after_prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S), "decode alone")
    assert plain.token_ids == want_after
    cluster.wait_idle(["decode"], timeout_s=tc.IDLE_TIMEOUT_S)
    d = snapshot(cluster, "decode")
    assert d[Metric.FAILED] >= 1, "decode did not count the failed transfer"
    assert not Path(cluster.log("decode")).read_text(errors="replace").count("Traceback (most recent call last)"), (
        f"decode logged a traceback: {cluster.log('decode')}"
    )
