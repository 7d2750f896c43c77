"""Heterogeneous tensor parallelism through real vLLM (CPU): prefill and
decode of different TP sizes, each TP rank a process of its own.

For each pair (prefill TP, decode TP) one cluster serves the tests of that
pair: P/D output equals one engine of the decode's TP token for token for
prompts below, at and above a block and across a chunked-prefill boundary;
every prefill rank that owns a slice of a decode rank's heads sent it
(OrbitKV's counters); a client that walks away mid-transfer leaves no KV held
on any rank; no request waits out a deadline. One pair runs a model with a
single KV head, which vLLM replicates on every rank of TP 2: exactly one
prefill rank sends it.

With ``ORBITKV_TEST_STAGING=1`` (``scripts/test.sh`` on vLLM 0.26) the TP 1
-> 2 pair stages: the prefill gathers each layer grouped by a decode rank's
heads and writes it from there straight into that rank's pages when its
blocks are one run, or into its staging grant (scattered on decode) when
they are not (``orbitkv.pd.staging_min_ranges`` 4: two runs and more); the
other pairs write pages directly.

The 2 -> 1 pair of two KV heads runs prefill with 32-token blocks and
decode with 128-token blocks (issue 47): each prefill rank writes its
heads' slices of each token piece into decode's blocks.

On the 2-core CI machine a TP 2 instance binds its ranks to cores 0 and 1
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``); the tiny model keeps it fast.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

import orbitkv.testing.cluster as tc
from orbitkv import producer_ranks
from orbitkv.testing.cluster import Cluster, Completion, Metric, complete, prompt_source
from orbitkv.testing.tiny_model import TinyModelSpec, make_tiny_model

# On the 2-core CI machine these stalled for 15-60 s per request until
# 2026-11-30, for two causes in vLLM 0.26.0, both handled by the test
# cluster's vLLM shim (orbitkv/testing/vllm_shims, applied to every
# instance): (1) a worker can miss its step wake-up (fixed upstream by
# vllm-project/vllm#45224: the idle wait is capped); (2) vLLM's readers
# busy-wait for a second after each read, and while decode waits for remote
# KV its engine steps every millisecond: decode's worker then spun at 100 %
# on the core a prefill TP rank is pinned to, and the prefill's step and both
# API servers got no CPU (top: decode's worker and the prefill ranks ~100 %,
# py-spy: all of them "waiting"). The shim turns the busy-wait off.
# Prompts no other module shares a prefix with.
fresh_prompt = prompt_source(50000)

GEN = 8
PD_TIMEOUT_S = 15.0
MAX_BATCHED_TOKENS = 600

# (prefill TP, decode TP, KV heads, (prefill, decode) block sizes or None:
# vLLM CPU's 128 on both). The 2 -> 1 pair of two KV heads also runs prefill
# and decode of different block sizes (issue 47: head slices cut by token,
# test_block_sizes_vllm.py has the same-TP pairs).
PAIRS = [(2, 1, 2, (32, 128)), (1, 2, 2, None), (2, 2, 2, None), (2, 1, 1, None)]
# The pair that stages under ORBITKV_TEST_STAGING=1 (module docstring).
STAGED_PAIR = (1, 2, 2)
STAGING = os.environ.get("ORBITKV_TEST_STAGING", "0") == "1"
STAGING_CONFIG = {"orbitkv.pd.staging_mb": 64, "orbitkv.pd.staging_min_ranges": 4}
LAYERS_STAGED = "vllm:orbitkv_layers_staged_total"


def _pair_id(p: int, d: int, h: int, sizes: tuple[int, int] | None) -> str:
    blocks = f"-blocks{sizes[0]}-{sizes[1]}" if sizes else ""
    return f"prefill-tp{p}-decode-tp{d}-kvheads{h}{blocks}"


@pytest.fixture(scope="module", params=PAIRS, ids=[_pair_id(*pair) for pair in PAIRS])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    ptp, dtp, heads, sizes = request.param
    staged = STAGING and request.param[:3] == STAGED_PAIR
    staging = STAGING_CONFIG if staged else {}
    model = make_tiny_model(tmp_path_factory.mktemp(f"model-kv{heads}") / "tiny", TinyModelSpec(num_kv_heads=heads))
    run = tmp_path_factory.mktemp(f"tp-{ptp}-{dtp}-{heads}")
    c = Cluster(
        model,
        run,
        timeout_s=PD_TIMEOUT_S,
        prefill_tp=ptp,
        decode_tp=dtp,
        # A short quarantine, so a failed request's blocks come back within
        # the idle waits (docs/architecture.md, held failures).
        prefill_config={"orbitkv.pd.handshake_timeout_s": PD_TIMEOUT_S, "orbitkv.pd.quarantine_s": 5.0, **staging},
        decode_config={"orbitkv.pd.quarantine_s": 5.0, **staging},
        prefill_env={"ORBITKV_TESTING_WRITE_DELAY": str(run / "write-delay")},
        vllm_args=["--max-num-batched-tokens", str(MAX_BATCHED_TOKENS), "--no-enable-prefix-caching"],
        prefill_args=["--block-size", str(sizes[0])] if sizes else [],
        decode_args=["--block-size", str(sizes[1])] if sizes else [],
        kv_load_failure_policy="fail",
    )
    c.kv_heads = heads  # type: ignore[attr-defined]
    c.staged = staged  # type: ignore[attr-defined]
    c.block_sizes = sizes  # type: ignore[attr-defined]
    with c:  # started here, stopped after the module
        yield c
    print(f"\ncluster logs: {run}")


def ok(c: Completion, what: str) -> list[int]:
    assert c.status == 200, f"{what}: HTTP {c.status}: {c.error}"
    assert len(c.token_ids) == GEN, f"{what}: {c.token_ids}"
    return c.token_ids


LENGTHS = {"below-a-block": 17, "a-block": tc.BLOCK, "a-block-plus-one": tc.BLOCK + 1, "chunked": 700}


def test_pd_equals_single_engine_of_the_decode_tp(cluster: Cluster) -> None:
    d0, p0 = cluster.metrics("decode"), cluster.metrics("prefill")
    for what, n in LENGTHS.items():
        prompt = fresh_prompt(n)
        t0 = time.monotonic()
        got = ok(complete(cluster.proxy_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S), f"P/D {what}")
        took = time.monotonic() - t0
        # Nothing waits out a deadline: each request is far below PD_TIMEOUT_S.
        assert took < PD_TIMEOUT_S / 2, f"{what}: {took:.1f}s"
        # One engine of the decode's TP: decode itself, a plain request. The
        # cluster runs without prefix caching, so this recomputes the prompt
        # rather than reusing the KV under test.
        want = ok(complete(cluster.decode_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S), f"one engine {what}")
        assert got == want, f"{what}: P/D {got} != one engine {want}"
    d1, p1 = cluster.metrics("decode"), cluster.metrics("prefill")
    # vLLM sums the ranks' counters: every decode rank received each
    # request's KV, and each (prefill rank, decode rank) pair the sender rule
    # names was released once (a prefill rank that holds only replicas sends
    # nothing; one that serves two decode ranks releases each one's part).
    assert d1[Metric.COMPLETED] - d0[Metric.COMPLETED] == len(LENGTHS) * cluster.decode.tp, "decode did not receive every KV"
    assert d1[Metric.FAILED] == d0[Metric.FAILED]
    pairs = sum(
        len(producer_ranks(_heads(cluster), c, cluster.decode.tp, cluster.prefill.tp)) for c in range(cluster.decode.tp)
    )
    assert p1[Metric.RELEASED] - p0[Metric.RELEASED] == len(LENGTHS) * pairs
    if cluster.staged:  # type: ignore[attr-defined]
        # every layer of every request went out of the source staging (into
        # pages or a grant); the output equality above checks its bytes
        assert p1.get(LAYERS_STAGED, 0) > p0.get(LAYERS_STAGED, 0), "no layer went through staging"
    elif cluster.block_sizes is None:  # type: ignore[attr-defined]
        # the defaults: each decode block is one group of prefill's staging
        # here (equal TP, decode's larger, or one head), so the layers went
        # from the source staging into decode's pages
        to_pages = "vllm:orbitkv_layers_staged_to_pages_total"
        assert p1.get(to_pages, 0) > p0.get(to_pages, 0), "no layer went from staging into pages"
    else:
        # prefill and decode of different block sizes: never staged
        assert p1.get(LAYERS_STAGED, 0) == p0.get(LAYERS_STAGED, 0)
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)


def test_the_proxy_learned_the_prefill_tp_from_its_side_channels(cluster: Cluster) -> None:
    """The cluster starts the proxy without ``--prefill-tp``: it asks every
    prefill rank's side channel (rank r at the base port + r)."""
    import json
    import urllib.request

    with urllib.request.urlopen(cluster.proxy_url + "/health", timeout=10) as r:
        health = json.loads(r.read())
    assert health == {"prefill": 200, "decode": 200}, health
    host, port = cluster.prefill_kv.rsplit(":", 1)
    for rank in range(cluster.prefill.tp):
        with urllib.request.urlopen(f"http://{host}:{int(port) + rank}/orbitkv/v1/health", timeout=10) as r:
            assert json.loads(r.read()) == {"ok": True, "tp_rank": rank, "tp_size": cluster.prefill.tp}


def _heads(cluster: Cluster) -> int:
    return int(cluster.kv_heads)  # type: ignore[attr-defined]


def test_abort_mid_transfer_leaves_nothing_held(cluster: Cluster) -> None:
    cluster.drop_mid_transfer(fresh_prompt(2 * tc.BLOCK + 10), GEN)
    prompt = fresh_prompt(300)
    got = ok(complete(cluster.proxy_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S), "P/D after the abort")
    assert got == ok(complete(cluster.decode_url, prompt, GEN, timeout_s=tc.REQ_TIMEOUT_S), "one engine")
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)


def test_a_wrong_prefill_tp_fails_fast_with_its_reason(cluster: Cluster) -> None:
    """A request that names another prefill TP size than the prefill has
    (a router's configuration drift) fails within seconds with the reason in
    decode's log, never at the deadline."""
    import uuid

    pd_id, cap = f"wrong-tp-{uuid.uuid4().hex}", uuid.uuid4().hex * 2
    wrong = 2 if cluster.prefill.tp == 1 else 1
    if _heads(cluster) == 1 and wrong == 1:
        pytest.skip("with one replicated KV head every prefill TP has one sender: nothing is wrong")
    consumer = {
        "orbitkv_role": "consumer",
        "orbitkv_request": pd_id,
        "orbitkv_capability": cap,
        "orbitkv_prefill_kv": cluster.prefill_kv,
        "orbitkv_prefill_tp": wrong,
    }
    d0 = cluster.metrics("decode")
    t0 = time.monotonic()
    c = complete(cluster.decode_url, fresh_prompt(200), GEN, timeout_s=tc.REQ_TIMEOUT_S, kv_transfer_params=consumer)
    took = time.monotonic() - t0
    assert took < PD_TIMEOUT_S - 2, f"the request waited {took:.1f}s (deadline {PD_TIMEOUT_S}s)"
    log = cluster.log("decode").read_text(errors="replace")
    if wrong > cluster.prefill.tp:
        # A larger TP names side-channel ports of ranks the prefill does not
        # have, which no deployment declared (orbitkv.pd.allowed_prefill names
        # every rank's port): refused at admission, served plainly, no
        # handshake leaves.
        assert c.status == 200
        assert f"its {wrong} ranks" in log and "is not an allowed prefill side channel" in log
    else:
        assert c.status != 200 or cluster.metrics("decode")[Metric.FAILED] > d0[Metric.FAILED]
        assert "orbitkv_prefill_tp does not match" in log or "refused the handshake" in log
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
