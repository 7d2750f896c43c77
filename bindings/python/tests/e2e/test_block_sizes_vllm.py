"""Prefill and decode of different block sizes through real vLLM (CPU),
issue 47 (TP 1 here; a TP 2 -> 1 pair with 32 -> 128 runs in
test_tp_vllm.py): each pair runs one cluster whose prefill and decode are started
with another ``--block-size``; P/D output equals one engine (decode itself,
a plain request) token for token for prompts below, at and just past either
side's block, across a chunked-prefill boundary and long; decode received
every KV (OrbitKV's counters) and nothing failed; a local prefix-cache hit
on decode loads only the rest; a client that walks away mid-transfer
leaves no block held on either side.

The planner cuts the tokens decode loads where either side's block ends
and writes each piece row by row of vLLM's CPU token order (a head's K
transposed, then its V: ``cpu_kernel_parts``, checked against the kernel at
start). vLLM CPU takes block sizes in multiples of 16 (16 and 48 run its
``vec16`` kernels, 32, 64 and 128 its ``vec`` ones).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

import orbitkv.testing.cluster as tc
from orbitkv import producer_ranks
from orbitkv.testing.cluster import Cluster, Completion, Metric, complete, prompt_source
from orbitkv.testing.tiny_model import TinyModelSpec, make_tiny_model

# Prompts no other module shares a prefix with.
fresh_prompt = prompt_source(70000)

GEN = 8
PD_TIMEOUT_S = 15.0
SPEC = TinyModelSpec()
# Bytes of one token's KV in every layer (float32 K and V of each KV head):
# what prefill writes for each token decode loads, no more (the planner
# writes tokens, not whole blocks, when the sizes differ).
BYTES_PER_TOKEN = SPEC.num_layers * SPEC.num_kv_heads * 2 * SPEC.head_dim * 4
HITS = "vllm:prefix_cache_hits_total"
MAX_BATCHED_TOKENS = 600

# (prefill block size, decode block size, prefill TP, decode TP)
PAIRS = [(16, 64, 1, 1), (64, 16, 1, 1)]


@pytest.fixture(scope="module", params=PAIRS, ids=[f"prefill-{p}x-tp{pt}-decode-{d}x-tp{dt}" for p, d, pt, dt in PAIRS])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    pbs, dbs, ptp, dtp = request.param
    model = make_tiny_model(tmp_path_factory.mktemp("model-bs") / "tiny", SPEC)
    run = tmp_path_factory.mktemp(f"bs-{pbs}-{dbs}-{ptp}-{dtp}")
    c = Cluster(
        model,
        run,
        timeout_s=PD_TIMEOUT_S,
        prefill_tp=ptp,
        decode_tp=dtp,
        # A short quarantine, so a failed request's blocks come back within
        # the idle waits (docs/architecture.md, held failures).
        prefill_config={"orbitkv.pd.handshake_timeout_s": PD_TIMEOUT_S, "orbitkv.pd.quarantine_s": 5.0},
        decode_config={"orbitkv.pd.quarantine_s": 5.0},
        prefill_env={"ORBITKV_TESTING_WRITE_DELAY": str(run / "write-delay")},
        vllm_args=["--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)],
        prefill_args=["--block-size", str(pbs)],
        decode_args=["--block-size", str(dbs)],
        kv_load_failure_policy="fail",
    )
    c.block_sizes = (pbs, dbs)  # type: ignore[attr-defined]
    with c:  # started here, stopped after the module
        yield c
    print(f"\ncluster logs: {run}")


def ok(c: Completion, what: str) -> list[int]:
    assert c.status == 200, f"{what}: HTTP {c.status}: {c.error}"
    assert len(c.token_ids) == GEN, f"{what}: {c.token_ids}"
    return c.token_ids


def reference(cluster: Cluster, prompt: list[int], what: str) -> list[int]:
    """One engine: decode itself, a plain request under a cache salt of its
    own, so it recomputes the prompt (never reuses the KV under test)."""
    c = complete(cluster.decode_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S, cache_salt=f"ref-{uuid.uuid4().hex}")
    return ok(c, f"one engine {what}")


def sent_tokens(n: int, block_size: int) -> int:
    """Tokens prefill writes for a prompt of ``n`` (no hit): each once, and
    the block a chunked-prefill step ends inside of (steps of
    ``MAX_BATCHED_TOKENS``) once more, up to the prompt's end."""
    again = 0
    for end in range(MAX_BATCHED_TOKENS, n, MAX_BATCHED_TOKENS):
        if end % block_size:
            start = end // block_size * block_size
            again += min(start + block_size, n) - start
    return n + again


def lengths(cluster: Cluster) -> dict[str, int]:
    small, big = sorted(cluster.block_sizes)  # type: ignore[attr-defined]
    return {
        "below-both-blocks": small - 3,
        "a-small-block": small,
        "a-small-block-plus-one": small + 1,
        "a-big-block-minus-one": big - 1,
        "a-big-block-plus-one": big + 1,
        "chunked": 700,
        "long": 1500,
    }


def test_each_side_started_with_its_block_size_and_the_kernels_token_order(cluster: Cluster) -> None:
    pbs, dbs = cluster.block_sizes  # type: ignore[attr-defined]
    for name, bs in (("prefill", pbs), ("decode", dbs)):
        log = cluster.log(name).read_text(errors="replace")
        assert f"blocks of {bs} tokens" in log, f"{name}: no block size {bs} in its log"
        assert "token order {'units'" in log, f"{name}: the CPU kernels' token order was not found"


def test_pd_equals_single_engine_and_every_kv_is_received(cluster: Cluster) -> None:
    d0, p0 = cluster.metrics("decode"), cluster.metrics("prefill")
    cases = lengths(cluster)
    for what, n in cases.items():
        prompt = fresh_prompt(n)
        t0 = time.monotonic()
        got = ok(complete(cluster.proxy_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S), f"P/D {what}")
        took = time.monotonic() - t0
        # not a speed check: a decode that waited for its KV past the
        # consumer timeout (and recomputed) takes at least PD_TIMEOUT_S; on
        # two busy cores the longest prompt took 7.8 s once (CI, 2026-12-06)
        assert took < PD_TIMEOUT_S, f"{what}: {took:.1f}s (the consumer timeout is {PD_TIMEOUT_S:g} s)"
        want = reference(cluster, prompt, what)
        assert got == want, f"{what}: P/D {got} != one engine {want}"
    d1, p1 = cluster.metrics("decode"), cluster.metrics("prefill")
    assert d1[Metric.COMPLETED] - d0[Metric.COMPLETED] == len(cases) * cluster.decode.tp, "decode missed a KV"
    assert d1[Metric.FAILED] == d0[Metric.FAILED]
    # Every prompt token's KV, once, and again only where a prefill step
    # ended inside one of prefill's blocks (prefill sends that block again
    # with the next step); prefill's ranks together.
    pbs = cluster.block_sizes[0]  # type: ignore[attr-defined]
    sent = sum(sent_tokens(n, pbs) for n in cases.values())
    assert p1[Metric.BYTES] - p0[Metric.BYTES] == sent * BYTES_PER_TOKEN
    pairs = sum(len(producer_ranks(2, c, cluster.decode.tp, cluster.prefill.tp)) for c in range(cluster.decode.tp))
    assert p1[Metric.RELEASED] - p0[Metric.RELEASED] == len(cases) * pairs
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)


def test_a_local_prefix_hit_on_decode_loads_the_rest(cluster: Cluster) -> None:
    """Decode holds the first blocks of a prompt from an earlier plain
    request (its own prefix cache): P/D loads exactly the rest, which starts
    inside one of prefill's blocks where prefill's blocks are larger, and
    equals one engine."""
    pbs, dbs = cluster.block_sizes  # type: ignore[attr-defined]
    prompt = fresh_prompt(3 * max(pbs, dbs) + 20)
    head = prompt[: 2 * dbs + 5]
    ok(complete(cluster.decode_url, head, GEN, timeout_s=tc.REQ_TIMEOUT_S), "decode's own request")
    d0, p0 = cluster.metrics("decode"), cluster.metrics("prefill")
    got = ok(complete(cluster.proxy_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S), "P/D after the hit")
    d1, p1 = cluster.metrics("decode"), cluster.metrics("prefill")
    hit = d1.get(HITS, 0) - d0.get(HITS, 0)
    assert hit == 2 * dbs, f"decode's prefix-cache hit: {hit} tokens"
    assert d1[Metric.COMPLETED] - d0[Metric.COMPLETED] == cluster.decode.tp
    assert d1[Metric.FAILED] == d0[Metric.FAILED]
    assert p1[Metric.BYTES] - p0[Metric.BYTES] == (len(prompt) - hit) * BYTES_PER_TOKEN
    assert got == reference(cluster, prompt, "after the hit")
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)


def test_abort_mid_transfer_leaves_nothing_held(cluster: Cluster) -> None:
    cluster.drop_mid_transfer(fresh_prompt(300), GEN)
    prompt = fresh_prompt(250)
    got = ok(complete(cluster.proxy_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S), "P/D after the abort")
    assert got == reference(cluster, prompt, "after the abort")
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
