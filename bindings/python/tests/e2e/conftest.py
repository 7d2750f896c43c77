"""End-to-end fixtures: real vLLM (CPU) servers with the PdConnector, real
HTTP, real Mooncake (TCP on 127.0.0.1). The tiny model is made in a
temporary directory; nothing is downloaded.

Every test in this folder is marked ``e2e`` here
(``-m "not e2e"`` leaves them out of a quick local run; ``scripts/test.sh``
and CI run them)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# No hub access from anything started here (the servers get it too).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from orbitkv.testing.cluster import Cluster
from orbitkv.testing.tiny_model import make_tiny_model

# The connector's consumer timeout and the prefill's claim deadline in these
# tests (orbitkv.pd.timeout_s / claim_timeout_s): small, so a dead prefill
# fails the decode request quickly, and a prefill half whose decode never
# comes gives its blocks back soon.
PD_TIMEOUT_S = 15.0
# The prefill's handshake timeout in test_pd_vllm.py's cluster: longer than a
# flood of prefill halves takes to send there (its unclaimed-halves test),
# as it is by default (120 s); the claim deadline above ends the halves no
# decode claims.
PD_HANDSHAKE_TIMEOUT_S = 60.0
# orbitkv.pd.quarantine_s: how long past that deadline decode keeps the
# blocks of a producer that never ended (a killed prefill): small, so the
# tests that kill one see decode idle soon after.
QUARANTINE_S = 5.0
# Chunked prefill in steps of 600 tokens (not a multiple of the 128-token
# block): long prompts take several steps on the prefill, each ending inside
# a block, and an abort can land between two of them.
MAX_BATCHED_TOKENS = 600


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: end-to-end test with real vLLM servers (slow)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.e2e)


# ORBITKV_TEST_STAGING=1 (scripts/test.sh on vLLM 0.26): this module's P/D
# pair stages every request (orbitkv.pd.staging_mb, a threshold of one range
# per layer: the tiny model's fresh blocks are mostly contiguous), so the
# gather, the staged writes and the scatter run through real vLLM; the other
# e2e modules and the newest-vLLM run write pages directly.
STAGING = os.environ.get("ORBITKV_TEST_STAGING", "0") == "1"
STAGING_CONFIG: dict[str, object] = (
    {"orbitkv.pd.staging_mb": 128, "orbitkv.pd.staging_min_ranges": 1} if STAGING else {}
)


# The P/D pair also serves vllm-router's / llm-d's `mooncake` dialect
# (orbitkv.pd.dialects): the prefill's rank 0 side channel answers GET /query,
# and requests carrying a transfer_id are served as P/D (test_pd_vllm.py).
MOONCAKE_DIALECT = {"orbitkv.pd.dialects": ["mooncake"]}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Prefill + decode + proxy, with the test hooks wired to files in the
    run directory (inert until a test creates those files), and both
    vllm-router modes in front."""
    yield from pd_cluster(tiny_model, tmp_path_factory, STAGING_CONFIG)


@pytest.fixture(scope="session")
def make_pd_cluster() -> Callable[..., Iterator[Cluster]]:
    """:func:`pd_cluster`, for a module's own ``cluster`` fixture (another
    staging on the same pair: test_staging_beside_vllm.py)."""
    return pd_cluster


def pd_cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory, staging: dict[str, object],
               routers: bool = True, decode_staging: dict[str, object] | None = None,
               kv_roles: tuple[str, str] = ("kv_both", "kv_both"),
               prefill_env: dict[str, str] | None = None, vllm_args: tuple[str, ...] = ()) -> Iterator[Cluster]:
    """test_pd_vllm.py's pair with ``staging`` (orbitkv.pd.* settings) on
    both instances (on decode ``decode_staging`` instead, when given) and
    vLLM's ``kv_roles`` (prefill, decode); ``routers``: vllm-router in both
    its modes beside the proxy; ``prefill_env``: more of the prefill's
    environment (test hooks); ``vllm_args``: more arguments of both servers."""
    run = tmp_path_factory.mktemp("pd-cluster")
    c = Cluster(
        tiny_model,
        run,
        timeout_s=PD_TIMEOUT_S,
        prefill_config={
            "orbitkv.pd.handshake_timeout_s": PD_HANDSHAKE_TIMEOUT_S,
            "orbitkv.pd.claim_timeout_s": PD_TIMEOUT_S,
            "orbitkv.pd.quarantine_s": QUARANTINE_S,
            **MOONCAKE_DIALECT,
            **staging,
        },
        decode_config={"orbitkv.pd.quarantine_s": QUARANTINE_S, **MOONCAKE_DIALECT,
                       **(staging if decode_staging is None else decode_staging)},
        kv_roles=kv_roles,
        prefill_env={
            "ORBITKV_TESTING_WRITE_DELAY": str(run / "write-delay"),
            # vLLM shim (orbitkv/testing/vllm_shims): while this file exists
            # the attention layers skip vLLM's per-layer connector hooks.
            "ORBITKV_TESTING_SKIP_LAYER_HOOK": str(run / "skip-layer-hook"),
            **(prefill_env or {}),
        },
        decode_env={"ORBITKV_TESTING_CORRUPT_AFTER_LOAD": str(run / "corrupt-next-load")},
        vllm_args=["--max-num-batched-tokens", str(MAX_BATCHED_TOKENS), *vllm_args],
        kv_load_failure_policy="fail",
        trace=True,  # each worker's Chrome trace (orbitkv trace merges them)
        vllm_router=routers,  # vllm-router in front of the same pair, beside the proxy
        mooncake_router=routers,  # and another in its --kv-connector mooncake mode
    )
    with c:  # started here, stopped after the module
        yield c
    print(f"\ncluster logs: {run}")
