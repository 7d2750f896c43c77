"""The GPU end-to-end driver's pure parts (benches/gpu/e2e/driver.py): what
it takes from its command line and what it reads from MooncakeConnector's
log. The driver itself runs on the device (docs/gpu-e2e.md)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

DRIVER = Path(__file__).resolve().parents[3] / "benches" / "gpu" / "e2e" / "driver.py"


def _driver() -> ModuleType:
    spec = importlib.util.spec_from_file_location("orbitkv_e2e_driver", DRIVER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


driver = _driver()


def test_ab_config_takes_a_json_object_of_orbitkv_settings_only() -> None:
    cfg = driver.ab_config('{"orbitkv.pd.writer_lanes": 8, "orbitkv.pd.max_inflight_ranges": 4096}')
    assert cfg == {"orbitkv.pd.writer_lanes": 8, "orbitkv.pd.max_inflight_ranges": 4096}
    for bad, why in [("{", "not JSON"), ("[]", "non-empty JSON object"), ("{}", "non-empty JSON object"),
                     ('{"kv_role": "kv_both"}', "only orbitkv.pd.*")]:
        with pytest.raises(Exception, match=why):
            driver.ab_config(bad)


@pytest.mark.parametrize("argv", [["--ab", "custom"], ["--ab-config", '{"orbitkv.pd.writer_lanes": 8}'],
                                  ["--ab-config", '{"vllm.x": 1}', "--ab", "custom"]])
def test_ab_custom_and_its_config_go_together(argv: list[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        driver.main([*argv, "--device", "cpu", "--stages", "none", "--deadline-s", "5",
                     "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")])
    assert e.value.code == 2
    assert not (tmp_path / "o").exists()  # refused before anything ran


def test_e2e_driver_args_split_like_shell_words_so_a_json_with_spaces_stays_one() -> None:
    """run.sh passes E2E_DRIVER_ARGS on untouched; the driver splits it as a
    shell would (before, run.sh split it on spaces and cut a JSON with
    spaces into pieces)."""
    env = {"E2E_DRIVER_ARGS": """--one-gpu --ab custom --ab-config '{"orbitkv.pd.writer_lanes": 8}' --seed 3"""}
    argv = driver.command_line(["--device", "cuda"], env)
    assert argv == ["--device", "cuda", "--one-gpu", "--ab", "custom", "--ab-config",
                    '{"orbitkv.pd.writer_lanes": 8}', "--seed", "3"]
    assert driver.ab_config(argv[argv.index("--ab-config") + 1]) == {"orbitkv.pd.writer_lanes": 8}
    assert driver.command_line(["--x"], {}) == ["--x"]
    assert driver.command_line([], {"E2E_DRIVER_ARGS": "a $(touch /tmp/never) b"}) == ["a", "$(touch", "/tmp/never)", "b"]
    with pytest.raises(ValueError, match="E2E_DRIVER_ARGS is not shell words"):
        driver.command_line([], {"E2E_DRIVER_ARGS": "--ab-config '{\"a\": 1}"})


def _mc_line(hhmmss: str, n: int, ms: float, mb: float, descs: float) -> str:
    return (f"(APIServer pid=1) INFO 12-03 {hhmmss} [metrics.py:103] KV Transfer metrics: Num successful "
            f"transfers={n}, Avg xfer time (ms)={ms}, P90 xfer time (ms)=1.0, Avg MB per transfer={mb}, "
            f"Throughput (MB/s)=1.0, Avg number of descriptors={descs}, Num failed transfers=0, "
            "Num failed recvs=0, Num KV expired reqs=0")


def test_mc_transfer_metrics_weights_the_windows_of_the_run_by_transfers(tmp_path: Path) -> None:
    log = tmp_path / "mc-prefill.log"
    log.write_text("\n".join([
        _mc_line("07:11:50", 99, 1.0, 1.0, 1.0),       # before the run: left out
        _mc_line("07:12:14", 10, 20.0, 300.0, 1000.0),
        "INFO 12-03 07:12:20 [other.py:1] unrelated",
        _mc_line("07:12:24", 30, 100.0, 300.0, 5000.0),
        _mc_line("07:12:48", 5, 10.0, 100.0, 100.0),    # within 10 s after the end: its window overlaps the run
        _mc_line("07:13:30", 77, 1.0, 1.0, 1.0),       # later: another stage
    ]))
    t = lambda hms: time.mktime(time.strptime(f"{time.localtime().tm_year}-12-03 {hms}", "%Y-%m-%d %H:%M:%S"))  # noqa: E731
    m = driver.mc_transfer_metrics(log, t("07:11:58"), t("07:12:40"))
    assert m is not None
    assert m["transfers"] == 45
    assert m["ms_per_transfer"] == pytest.approx((10 * 20 + 30 * 100 + 5 * 10) / 45, abs=0.05)
    assert m["descriptors_per_transfer"] == pytest.approx((10 * 1000 + 30 * 5000 + 5 * 100) / 45, abs=0.05)
    assert m["kb_per_descriptor"] == pytest.approx(1e3 * (10 * 300 + 30 * 300 + 5 * 100) / 160500, abs=0.05)
    assert driver.mc_transfer_metrics(log, t("08:00:00"), t("08:01:00")) is None
    assert driver.mc_transfer_metrics(None, 0, 1) is None
    assert driver.mc_transfer_metrics(tmp_path / "missing.log", 0, 1) is None
