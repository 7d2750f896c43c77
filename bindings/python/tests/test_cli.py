"""The ``orbitkv`` command: ``doctor`` on this machine (with the real
Mooncake library), without the library, with a busy port and a bind host that
is not local; ``proxy`` as a subcommand."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def orbitkv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orbitkv.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_doctor_passes_here_and_moves_bytes() -> None:
    r = orbitkv("doctor", "--write-test")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Mooncake 0.3.13.post1 (the pin) loads" in r.stdout
    assert "4 MiB written between two engines on 127.0.0.1, bytes equal" in r.stdout
    assert "Mooncake's transport here: tcp (orbitkv.pd.max_inflight_ranges defaults to 768)" in r.stdout
    # The CPU wheel: the GPU-only redirect has nothing to patch, and says so.
    assert "this Mooncake has no CUDA: orbitkv.pd.mooncake_submit_wait has nothing to redirect" in r.stdout
    assert "nothing blocks P/D here" in r.stdout
    # what the default allow-list exposes, said plainly
    assert "decode's default orbitkv.pd.allowed_prefill: ports 17500-17507 on 127.0.0.1, localhost, ::1" in r.stdout
    # what the default staging takes, and that it lies inside vLLM's budget (beside it only when asked)
    assert "takes min(1024 MiB, 25 % of its KV cache) out of vLLM's own KV cache" in r.stdout
    assert ("(above 1024 MiB where 3 steps of max_num_batched_tokens' KV, every layer, are more: up to them, at most "
            "10 % of the KV cache" in r.stdout)
    assert ("(orbitkv.pd.staging_memory 'kv_cache', the default; the share: orbitkv.pd.staging_kv_share): inside "
            "gpu_memory_utilization") in r.stdout
    assert "start decode-only instances as kv_consumer" in r.stdout
    assert "until they have decoded 64 P/D requests and prefilled none, then give them back" in r.stdout
    assert "With orbitkv.pd.staging_memory 'beside' (or a staging_mb set by hand)" in r.stdout
    assert "beside gpu_memory_utilization, not inside it" in r.stdout


def test_doctor_states_the_staging_share_of_the_smallest_gpu() -> None:
    from orbitkv.cli import Report, _note_staging_reservation

    r = Report()
    _note_staging_reservation(r, [141 << 30, 80 << 30])
    assert "1024 MiB is 1.2 % of this machine's smallest GPU, 80 GiB" in r.lines[0], r.lines
    r = Report()
    _note_staging_reservation(r, [])
    assert "smallest GPU" not in r.lines[0] and r.problems == 0


def test_doctor_without_the_mooncake_library_names_the_fix() -> None:
    r = orbitkv("doctor", env={"ORBITKV_MOONCAKE_LIB": "/nonexistent/engine.so"})
    assert r.returncode == 1, r.stdout
    assert "FAIL  no Mooncake engine on 127.0.0.1: MooncakeLibraryError" in r.stdout
    assert "fix: install `mooncake-transfer-engine-non-cuda==0.3.13.post1`" in r.stdout
    assert "1 problem(s) block P/D" in r.stdout


def test_doctor_finds_a_busy_side_channel_port_and_a_foreign_bind_host() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = orbitkv("doctor", "--side-channel-port", str(port))
    assert r.returncode == 1, r.stdout
    assert f"FAIL  side-channel port 127.0.0.1:{port}" in r.stdout
    r = orbitkv("doctor", "--bind-host", "192.0.2.1")  # TEST-NET-1: never local
    assert r.returncode == 1, r.stdout
    assert "FAIL  bind host 192.0.2.1" in r.stdout and "fix: set orbitkv.pd.mooncake.bind_host" in r.stdout


@pytest.mark.parametrize("args", [["proxy", "--help"], ["--help"]])
def test_help(args: list[str]) -> None:
    r = orbitkv(*args)
    assert r.returncode == 0, r.stderr
    assert "--prefill" in r.stdout if args[0] == "proxy" else "doctor" in r.stdout
