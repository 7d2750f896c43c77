"""The connector's test-only fault hooks (used by the end-to-end tests)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from orbitkv.vllm import _testing as hooks  # noqa: E402


def test_off_without_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hooks.CORRUPT_ENV, raising=False)
    monkeypatch.delenv(hooks.WRITE_DELAY_ENV, raising=False)
    monkeypatch.delenv(hooks.KV_DIGEST_ENV, raising=False)
    assert hooks.TestingHooks.from_env() is None


def test_the_kv_digest_variable_turns_the_hooks_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(hooks.CORRUPT_ENV, raising=False)
    monkeypatch.delenv(hooks.WRITE_DELAY_ENV, raising=False)
    monkeypatch.setenv(hooks.KV_DIGEST_ENV, str(tmp_path))
    h = hooks.faults_from_env()
    assert isinstance(h, hooks.TestingHooks) and h.kv_digest_dir == str(tmp_path)
    assert not h.take_corruption() and h.write_delay_s() == 0.0


def test_corruption_always_or_one_shot(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(hooks.CORRUPT_ENV, "1")
    monkeypatch.delenv(hooks.WRITE_DELAY_ENV, raising=False)
    h = hooks.TestingHooks.from_env()
    assert h is not None and h.take_corruption() and h.take_corruption()

    arm = tmp_path / "arm"
    monkeypatch.setenv(hooks.CORRUPT_ENV, str(arm))
    h = hooks.TestingHooks.from_env()
    assert h is not None and not h.take_corruption()
    arm.touch()
    assert h.take_corruption()
    assert not arm.exists()
    assert not h.take_corruption()


def test_write_delay_follows_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = tmp_path / "delay"
    monkeypatch.delenv(hooks.CORRUPT_ENV, raising=False)
    monkeypatch.setenv(hooks.WRITE_DELAY_ENV, str(f))
    h = hooks.TestingHooks.from_env()
    assert h is not None and h.write_delay_s() == 0.0
    f.write_text("0.25")
    assert h.write_delay_s() == 0.25
    f.write_text("not a number")
    assert h.write_delay_s() == 0.0
    f.unlink()
    assert h.write_delay_s() == 0.0


class _Recording:
    """Stands in for the runtime behind the slow link: records the calls
    that reached it, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def layers_ready(self, layer: int, chunks: list[tuple[str, int, int]]) -> list[tuple[str, Exception]]:
        self.calls.append(("layers_ready", layer, chunks))
        return []

    def producer_finish(self, pd_id: str) -> None:
        self.calls.append(("producer_finish", pd_id))

    def stats(self) -> dict[str, int]:
        return {"k": 1}

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))


def test_without_the_delay_the_runtime_is_not_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _Recording()
    assert hooks.Faults().wrap_runtime(rt) is rt  # type: ignore[arg-type]
    monkeypatch.setenv(hooks.CORRUPT_ENV, "1")
    monkeypatch.delenv(hooks.WRITE_DELAY_ENV, raising=False)
    h = hooks.TestingHooks.from_env()
    assert h is not None and h.wrap_runtime(rt) is rt  # type: ignore[arg-type]


def test_the_slow_link_delays_hand_overs_and_keeps_the_finish_behind_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    f = tmp_path / "delay"
    monkeypatch.delenv(hooks.CORRUPT_ENV, raising=False)
    monkeypatch.setenv(hooks.WRITE_DELAY_ENV, str(f))
    h = hooks.TestingHooks.from_env()
    assert h is not None
    rt = _Recording()
    link: Any = h.wrap_runtime(rt)  # type: ignore[arg-type]
    # No delay, nothing queued: straight through.
    assert link.layers_ready(0, [("a", 0, 1)]) == []
    link.producer_finish("a")
    assert rt.calls == [("layers_ready", 0, [("a", 0, 1)]), ("producer_finish", "a")]
    # A delay: the hand-over reaches the runtime later, and the finish, sent
    # meanwhile, after it; other calls go straight through.
    rt.calls.clear()
    f.write_text("0.3")
    t0 = time.monotonic()
    assert link.layers_ready(1, [("b", 0, 2)]) == []
    f.write_text("0")
    link.producer_finish("b")
    assert rt.calls == [] and link.stats() == {"k": 1}
    deadline = time.monotonic() + 10
    while len(rt.calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rt.calls == [("layers_ready", 1, [("b", 0, 2)]), ("producer_finish", "b")]
    assert time.monotonic() - t0 >= 0.3
    link.shutdown()
    assert rt.calls[-1] == ("shutdown",)


@pytest.mark.parametrize("shape", [(6, 2, 4, 8), (2, 6, 4, 2, 8)], ids=["cpu-layout", "kv-planes-first"])
def test_corrupt_block_changes_exactly_one_block(shape: tuple[int, ...]) -> None:
    num_blocks = 6
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(shape) for i in range(3)}
    before = {k: v.clone() for k, v in caches.items()}
    hooks.corrupt_block(caches, num_blocks, 4)
    for name, t in caches.items():
        b = before[name]
        if shape[0] == num_blocks:
            changed, same = (t[4], b[4]), (torch.cat([t[:4], t[5:]]), torch.cat([b[:4], b[5:]]))
        else:
            changed, same = (t[:, 4], b[:, 4]), (torch.cat([t[:, :4], t[:, 5:]], 1), torch.cat([b[:, :4], b[:, 5:]], 1))
        assert torch.equal(changed[0], -changed[1]), name
        assert torch.equal(same[0], same[1]), name


def test_a_production_worker_never_imports_the_test_hooks() -> None:
    """The worker reaches the hooks through ``faults.py``; ``_testing.py``
    is imported only when an ``ORBITKV_TESTING_*`` variable asks for a hook."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import orbitkv.vllm.worker\n"
        "from orbitkv.vllm.faults import Faults, faults_from_env\n"
        "assert type(faults_from_env()) is Faults\n"
        "print('_testing' if 'orbitkv.vllm._testing' in sys.modules else 'clean')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORBITKV_TESTING_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "clean", out.stdout


def test_a_server_that_lost_vllms_rendezvous_port_is_recognised(tmp_path: Path) -> None:
    """`Cluster` starts a vLLM server again only when its log says it lost its
    own torch.distributed rendezvous port (EADDRINUSE); any other failure is
    raised as it is."""
    from orbitkv.testing.cluster import _lost_rendezvous

    log = tmp_path / "decode.log"
    log.write_text("(Worker pid=1) torch.distributed.DistNetworkError: The server socket has failed to listen on any "
                   "local network address. port: 36851, useIpv6: false, code: -98, name: EADDRINUSE, message: address "
                   "already in use\n")
    assert _lost_rendezvous(log)
    log.write_text("RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert not _lost_rendezvous(log)
    assert not _lost_rendezvous(tmp_path / "missing.log")
