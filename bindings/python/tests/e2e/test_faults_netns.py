"""Network faults between prefill and decode, through real vLLM servers.

The prefill server runs in a network namespace of its own, joined to this
one by two veth links (``orbitkv.testing.netns``): a *data* link that carries
Mooncake and the side channel, and a *control* link for the prefill's API.
The tests cut (a black hole: every packet dropped, no reset), throttle and
restore the data link only, and stop the prefill process. Each asserts:

* no engine exits, and neither logs a traceback;
* the request caught by the fault ends (an error for the client) within the
  connector's timeouts, never hangs;
* both instances hold no request and no KV block afterwards;
* once the fault is gone, P/D serves again, token for token equal to one
  engine, within a stated time (measured and printed).

The module needs root and iproute2 (network namespaces). Where the machine
cannot make a namespace the module is skipped with the reason, and
``ORBITKV_REQUIRE_NETNS=1`` turns that into a failure (CI sets it).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

import orbitkv.testing.cluster as tc
from orbitkv.testing import netns
from orbitkv.testing.cluster import Cluster, Completion, Metric, complete, prompt_source

# Prompts no other module shares a prefix with.
fresh_prompt = prompt_source(500000)

GEN = 16
# orbitkv.pd.timeout_s / handshake_timeout_s of both instances, and the
# prefill's write timeout: a request caught by a fault must end within
# FAULT_END_S of it.
PD_TIMEOUT_S = 12.0
WRITE_TIMEOUT_S = 6.0
# orbitkv.pd.quarantine_s of both: how long past its deadline decode keeps
# the blocks of a producer that never ended (and how long past the write
# timeout the prefill waits for Mooncake to end a late write).
QUARANTINE_S = 15.0
FAULT_END_S = PD_TIMEOUT_S + 15.0
# Service must be back (a P/D request correct end to end) this long after a
# fault ends.
RECOVER_S = 20.0
REQ_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def link() -> Iterator[netns.NetnsLink]:
    can, why = netns.available()
    if not can:
        if os.environ.get("ORBITKV_REQUIRE_NETNS") == "1":
            pytest.fail(f"ORBITKV_REQUIRE_NETNS=1 but no network namespace can be made here: {why}")
        pytest.skip(f"SKIPPED: no network namespace on this machine ({why}); the fault suite did not run")
    with netns.NetnsLink() as ns:
        yield ns


@pytest.fixture(scope="module")
def cluster(link: netns.NetnsLink, tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    run = tmp_path_factory.mktemp("pd-netns")
    timeouts = {
        "orbitkv.pd.handshake_timeout_s": PD_TIMEOUT_S,
        "orbitkv.pd.write_timeout_s": WRITE_TIMEOUT_S,
        "orbitkv.pd.quarantine_s": QUARANTINE_S,
    }
    c = Cluster(
        tiny_model,
        run,
        timeout_s=PD_TIMEOUT_S,
        prefill_config=timeouts,
        decode_config={"orbitkv.pd.quarantine_s": QUARANTINE_S},
        prefill_env={"ORBITKV_TESTING_WRITE_DELAY": str(run / "write-delay")},
        vllm_args=["--max-num-batched-tokens", "600"],
        kv_load_failure_policy="fail",
        prefill_netns=link,
    )
    with c:  # started here, stopped after the module
        yield c
    print(f"\ncluster logs: {run}")


def m(cluster: Cluster, name: str) -> dict[str, float]:
    return cluster.metrics(name)


def baseline(cluster: Cluster, prompt: list[int]) -> list[int]:
    c = complete(cluster.prefill_url, prompt, GEN, timeout_s=REQ_TIMEOUT_S)
    assert c.status == 200 and len(c.token_ids) == GEN, f"single engine: {c.status} {c.error}"
    return c.token_ids


def recovers(cluster: Cluster, since: float, what: str) -> float:
    """Sends fresh P/D requests until one comes back correct; returns the
    seconds from ``since`` (the fault's end) to that answer. Fails past
    ``RECOVER_S``."""
    tries: list[str] = []
    while True:
        prompt = fresh_prompt(2 * tc.BLOCK + 30)
        want = baseline(cluster, prompt)
        got = complete(cluster.proxy_url, prompt, GEN, timeout_s=REQ_TIMEOUT_S)
        took = time.monotonic() - since
        if got.status == 200 and got.token_ids == want:
            print(f"{what}: P/D correct again {took:.1f}s after the fault ended ({len(tries)} failed tries)")
            return took
        tries.append(f"HTTP {got.status} {got.error!r:.120}" if got.status != 200 else "tokens differ")
        assert got.status != 200, f"{what}: P/D answered with tokens unequal to one engine"
        assert took < RECOVER_S, f"{what}: not serving {took:.1f}s after the fault ended: {tries}"
        time.sleep(0.5)


def no_tracebacks(cluster: Cluster) -> None:
    for name in ("prefill", "decode"):
        text = cluster.log(name).read_text(errors="replace")
        assert "Traceback (most recent call last)" not in text, f"{name} logged a traceback: {cluster.log(name)}"


def streamed_pd(cluster: Cluster, prompt: list[int], out: dict[str, object]) -> threading.Thread:
    def call() -> None:
        try:
            out["c"] = complete(cluster.proxy_url, prompt, GEN, stream=True, timeout_s=REQ_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - reported by the test
            out["c"] = e
        out["at"] = time.monotonic()

    t = threading.Thread(target=call)
    t.start()
    return t


def failed_in_time(t: threading.Thread, out: dict[str, object], t_fault: float, fault: str) -> float:
    """The request of ``streamed_pd`` caught by a fault at ``t_fault`` ended
    (not hung) and failed for the client within ``FAULT_END_S``: returns
    the seconds from the fault to its end."""
    t.join(FAULT_END_S + 5)
    assert not t.is_alive(), f"the request caught by {fault} did not end"
    c = out["c"]
    assert isinstance(c, Completion) and c.failed(GEN), f"the request did not fail: {c}"
    end_s = float(out["at"]) - t_fault  # type: ignore[arg-type]
    assert end_s <= FAULT_END_S, f"the request ended {end_s:.1f}s after {fault}"
    return end_s


def test_pd_crosses_the_data_link(cluster: Cluster, link: netns.NetnsLink) -> None:
    """The setup itself: prefill's KV reaches decode over the data link."""
    assert cluster.prefill_kv.startswith(link.data_inside)
    d0 = m(cluster, "decode")
    prompt = fresh_prompt(3 * tc.BLOCK + 7)
    got = complete(cluster.proxy_url, prompt, GEN, timeout_s=REQ_TIMEOUT_S)
    assert got.status == 200, got.error
    assert got.token_ids == baseline(cluster, prompt)
    assert m(cluster, "decode")[Metric.COMPLETED] == d0[Metric.COMPLETED] + 1
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)


def test_link_cut_mid_transfer_then_restored(cluster: Cluster, link: netns.NetnsLink) -> None:
    """The data link is cut while the prefill's layer writes are still to
    come (slowed by the test hook), stays cut past every timeout, then
    comes back.

    Mooncake cannot cancel a transfer: the writes queued behind the cut link
    land when it heals. Before the quarantine (OrbitKV 2026-11-30), decode
    freed the failed request's blocks at its deadline and the prefill its
    source blocks at its write timeout, so those late writes landed in pages
    vLLM had given to later requests: the next P/D request decoded garbage
    (``test_throttled_link_still_serves_correctly``, which runs next, failed
    with unequal tokens). Now both sides hold the blocks until Mooncake ended
    the writes."""
    delay = cluster.run_dir / "write-delay"
    p0, d0 = m(cluster, "prefill"), m(cluster, "decode")
    out: dict[str, object] = {}
    delay.write_text("0.5")  # per layer: 4 layers -> 2 s of transfer
    try:
        t = streamed_pd(cluster, fresh_prompt(2 * tc.BLOCK + 50), out)
        cluster.wait_finished(p0)
        link.cut()
        t_cut = time.monotonic()
    finally:
        delay.unlink(missing_ok=True)
    try:
        end_s = failed_in_time(t, out, t_cut, "the cut")
        cluster.check_alive()
        d1 = m(cluster, "decode")
        assert d1[Metric.FAILED] > d0[Metric.FAILED], "decode did not count the failed transfer"
        assert d1[Metric.COMPLETED] == d0[Metric.COMPLETED], "decode completed a transfer across a cut link"
        # The failed request is over for the client, but the writes queued
        # behind the cut may still land: decode keeps its blocks.
        time.sleep(1.0)
        held = m(cluster, "decode").get("vllm:kv_cache_usage_perc", 0)
        assert held > 0, "decode gave back the blocks of a failed request while writes into them were queued"
        assert m(cluster, "decode").get("vllm:num_requests_running", 0) == 0
    finally:
        link.restore()
    t_back = time.monotonic()
    # Mooncake delivers (or fails) the queued writes, the prefill notices
    # decode, and both free their blocks.
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    idle_s = time.monotonic() - t_back
    assert m(cluster, "prefill")[Metric.RELEASED] > p0[Metric.RELEASED]
    print(
        f"link cut: request failed {end_s:.1f}s after the cut; decode held its blocks "
        f"({held:.3f} of the cache) until the link came back; both idle {idle_s:.1f}s after it did"
    )
    recovers(cluster, t_back, "link restored")
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    no_tracebacks(cluster)


def test_throttled_link_still_serves_correctly(cluster: Cluster, link: netns.NetnsLink) -> None:
    """The data link at 8 Mbit/s each way: requests are slower
    but complete, equal to one engine, and nothing is held afterwards."""
    prompt = fresh_prompt(4 * tc.BLOCK + 3)  # ~2 MB of KV: ~2 s at 8 Mbit/s
    want = baseline(cluster, prompt)
    d0 = m(cluster, "decode")
    link.throttle("8mbit")
    try:
        t0 = time.monotonic()
        got = complete(cluster.proxy_url, prompt, GEN, timeout_s=REQ_TIMEOUT_S)
        took = time.monotonic() - t0
    finally:
        link.restore()
    assert got.status == 200, f"throttled: HTTP {got.status}: {got.error}"
    assert got.token_ids == want
    assert m(cluster, "decode")[Metric.COMPLETED] == d0[Metric.COMPLETED] + 1
    print(f"throttled link (8 Mbit/s): P/D request took {took:.1f}s")
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    cluster.check_alive()


def test_prefill_stopped_past_the_timeout_then_resumed(cluster: Cluster) -> None:
    """SIGSTOP to the prefill's whole process group while it computes a
    request, held past every timeout, then SIGCONT. Decode fails the request
    at its deadline but keeps its blocks: the stopped prefill may have taken
    the handshake and may still write once it runs again. Decode frees them
    when the prefill, resumed, reports, or when the quarantine passes; the
    prefill releases its own; both serve again."""
    p0, d0 = m(cluster, "prefill"), m(cluster, "decode")
    out: dict[str, object] = {}
    t = streamed_pd(cluster, fresh_prompt(3000), out)
    t_stop = cluster.stop_when_running("prefill")
    try:
        end_s = failed_in_time(t, out, t_stop, "SIGSTOP")
        held = cluster.holds_blocks_of_failed_load(d0)
    finally:
        t_cont = cluster.resume("prefill")
    cluster.check_alive()
    # The quarantine ends at the latest QUARANTINE_S after decode's deadline.
    cluster.wait_idle(timeout_s=QUARANTINE_S + tc.IDLE_TIMEOUT_S)
    idle_s = time.monotonic() - t_cont
    p2, d2 = m(cluster, "prefill"), m(cluster, "decode")
    assert p2[Metric.RELEASED] > p0[Metric.RELEASED]
    expired = d2.get("vllm:orbitkv_consumers_quarantine_expired_total", 0) - d0.get(
        "vllm:orbitkv_consumers_quarantine_expired_total", 0
    )
    print(
        f"prefill stopped: request failed {end_s:.1f}s after SIGSTOP; decode held its blocks ({held:.3f} of "
        f"the cache) until {'the quarantine passed' if expired else 'the prefill reported'}; "
        f"both idle {idle_s:.1f}s after SIGCONT"
    )
    recovers(cluster, t_cont, "prefill resumed")
    cluster.wait_idle(timeout_s=tc.IDLE_TIMEOUT_S)
    no_tracebacks(cluster)
