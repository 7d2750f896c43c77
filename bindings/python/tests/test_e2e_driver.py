"""The GPU end-to-end driver's pure parts (benches/gpu/e2e/driver.py): what
it takes from its command line and what it reads from MooncakeConnector's
log. The driver itself runs on the device (docs/gpu-e2e.md)."""

from __future__ import annotations

import argparse
import importlib.util
import json
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


def test_ab_more_adds_named_pairs_planned_after_the_first_group_and_compared_with_the_defaults_and_mc(
        tmp_path: Path) -> None:
    """--ab-more NAME=JSON (repeatable): one more OrbitKV pair each, the
    system orbit-NAME with those settings, so several A/Bs share one call's
    orbit and mc runs; each gets its ratio tables against the defaults and
    MooncakeConnector. A bad or repeated NAME is refused before anything
    runs."""
    from types import SimpleNamespace

    share = '{"orbitkv.pd.staging_kv_share": 0.25}'
    assert driver.ab_more(f"share25={share}") == ("share25", {"orbitkv.pd.staging_kv_share": 0.25})
    for bad in ("share25", "=" + share, f"Share={share}", f"control={share}", f"a-b={share}", "x={}",
                'x={"vllm.y": 1}', f"{'x' * 17}={share}"):
        with pytest.raises(argparse.ArgumentTypeError):
            driver.ab_more(bad)
    for argv in (["--ab-more", "x"], ["--ab-more", f"x={share}", "--ab-more", f"x={share}"]):
        with pytest.raises(SystemExit) as e:
            driver.main([*argv, "--device", "cpu", "--stages", "none", "--deadline-s", "5",
                         "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")])
        assert e.value.code == 2
        assert not (tmp_path / "o").exists()
    more = [("share25", {"orbitkv.pd.staging_kv_share": 0.25}), ("whole", {"orbitkv.pd.staging_pieces": "request"})]
    real = driver.gpu_total_gib
    try:
        driver.gpu_total_gib = lambda smi="": 79.65
        ctx = SimpleNamespace(args=_big_args(ab_more=more), cuda=True)
        assert driver.wanted_systems(ctx) == ["orbit", "orbit-control", "orbit-share25", "orbit-whole", "mc"]
        plan = driver.plan_big(ctx, driver.big_spec(ctx))
    finally:
        driver.gpu_total_gib = real
    assert plan["groups"][0] == ["orbit", "mc"]
    assert sorted(x for g in plan["groups"][1:] for x in g) == ["orbit-control", "orbit-share25", "orbit-whole"]
    assert plan["ab_more"] == dict(more)
    run = {"concurrency": 4, "p50_ttft_ms": 100.0, "p99_ttft_ms": 200.0, "output_throughput": 50.0}
    r = {"systems": {x: {"runs": {"c4": dict(run, p50_ttft_ms=v)}}
                     for x, v in (("orbit", 100.0), ("mc", 200.0), ("orbit-share25", 80.0),
                                  ("orbit-device-wait", 90.0))}}
    lines = driver.ratio_rows(r)
    # an --ab pair is no --ab-more pair
    assert not [x for x in lines if "device-wait (plan.json's ab_more)" in x]
    # a table: its title, a blank line, the header, the rule, a row a level
    row = lambda title: lines[next(i for i, x in enumerate(lines) if x.startswith(title)) + 4]  # noqa: E731
    assert row("OrbitKV with share25 (plan.json's ab_more) ÷ defaults").startswith("| 4 | 0.80 | 1.00 | 1.00 |")
    assert row("OrbitKV with share25 (plan.json's ab_more) ÷ MooncakeConnector").startswith("| 4 | 0.40 |")
    # no peaks sampled: the peak cells and the whole-cache ratio say so
    assert row("OrbitKV with share25 (plan.json's ab_more) ÷ defaults").endswith("| - | - | - / - |")


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


def _counters(**kv: float) -> dict[str, float]:
    return {f"vllm:orbitkv_{k}_total": v for k, v in kv.items()}


def test_the_counters_table_shows_the_submit_per_range_and_staging(tmp_path: Path) -> None:
    """The summary's counters row: Mooncake's submit call per range (µs),
    and staging's layers / grants / full; "-" for a wheel without them."""
    pre = _counters(ready_layers=10, ready_lag_seconds=1.0, write_batches=4, write_ranges=1000,
                    bytes_written=1000 * 1024 * 100, writes_grouped=2, write_submit_seconds=0.03,
                    write_batch_seconds=0.2, layer_writes=8, layer_write_seconds=0.8,
                    write_queue_seconds=0.4, write_gpu_wait_seconds=1.5, group_stops_budget=1,
                    group_stops_gpu=3, writes_ahead_of_gpu=2, layers_staged=6, source_staging_full=7,
                    source_pieces_given_up=4, producer_pages_given_back=9)
    dec = _counters(transfers_completed=2, transfer_seconds=3.0, staging_granted=5, staging_exhausted=1)
    old = {k: v for k, v in pre.items()
           if not any(x in k for x in ("staged", "stops", "ahead", "source_", "pages_given"))}
    between = {k: v for k, v in pre.items() if "ahead" not in k and "given_up" not in k}
    stage = {
        "config": {"input_len": 1, "input_range": 0, "output_len": 1},
        "systems": {
            "orbit-staging": {"metrics_delta": {"big-orbitab-prefill": pre, "big-orbitab-decode": dec}},
            "orbit": {"metrics_delta": {"big-orbit-prefill": old, "big-orbit-decode": dec}},
            "orbit-control": {"metrics_delta": {"big-orbitctl-prefill": between, "big-orbitctl-decode": dec}},
        },
    }
    (tmp_path / "b-default.json").write_text(json.dumps(stage))
    lines = driver.report(tmp_path).splitlines()
    rows = {line.split(" | ")[0]: line.split(" | ") for line in lines if line.startswith("| orbit")}
    header = next(line for line in lines if line.startswith("| system | layers"))
    col = {name: i for i, name in enumerate(header.split(" | "))}
    staged = rows["| orbit-staging"]
    assert staged[col["submit per range, µs"]] == "30.0"  # 0.03 s over 1000 ranges
    assert staged[col["staging: layers / grants / full"]] == "6 / 5 / 1"
    assert staged[col["stops: budget / GPU / ahead"]] == "1 / 3 / 2"
    assert staged[col["pieces: no room / given up / pages back"]] == "7 / 4 / 9"
    # a wheel from before source_pieces_given_up (staging_pieces)
    assert rows["| orbit-control"][col["pieces: no room / given up / pages back"]] == "7 / - / 9"
    assert rows["| orbit"][col["pieces: no room / given up / pages back"]] == "-"
    # a wheel from before writes_ahead_of_gpu
    assert rows["| orbit-control"][col["stops: budget / GPU / ahead"]] == "1 / 3 / -"
    assert rows["| orbit"][col["staging: layers / grants / full"]] == "-"
    assert rows["| orbit"][col["stops: budget / GPU / ahead"]] == "-"
    assert len(staged) == len(header.split(" | "))


def test_cells_of_the_mla_and_fp8_stages() -> None:
    """--mla-backends is BACKEND[:KV_DTYPE[:MODES]], --kv-cache-dtypes
    KV_DTYPE[:BACKEND[:MODES]]; auto or nothing: vLLM's pick; no modes: the stage's."""
    def cells(text: str, first: str) -> list[tuple[str | None, str | None, list[str] | None]]:
        return [(c.backend, c.dtype, c.modes) for c in driver.parse_cells(text, first)]

    assert cells("FLASH_ATTN_MLA, FLASHMLA:fp8,auto", "backend") == [
        ("FLASH_ATTN_MLA", None, None), ("FLASHMLA", "fp8", None), (None, None, None)]
    assert cells("fp8,fp8_e5m2:TRITON_ATTN:direct,fp8_e4m3::direct+staging,", "dtype") == [
        (None, "fp8", None), ("TRITON_ATTN", "fp8_e5m2", ["direct"]), (None, "fp8_e4m3", ["direct", "staging"])]
    assert driver.cell_key(None, "fp8") == "auto+fp8"
    assert driver.cell_key("FLASHMLA", None) == "FLASHMLA"
    assert driver.backend_used(None) is None


@pytest.mark.parametrize("argv", [["--cell-modes", "direct,stagin"], ["--kv-cache-dtypes", "fp8::drect"]])
def test_cell_modes_are_checked_before_anything_runs(argv: list[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        driver.main([*argv, "--device", "cpu", "--stages", "m-mla", "--deadline-s", "5",
                     "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")])
    assert e.value.code == 2
    assert not (tmp_path / "o").exists()


def _kv_digest() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kv_digest", DRIVER.parent / "kv_digest.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kv_digest_finds_the_token_slots_of_vllm_layouts_and_equal_bytes_give_equal_digests() -> None:
    torch = pytest.importorskip("torch")
    kd = _kv_digest()
    # (block dim, slot dim, kernel block size) of the layouts of vLLM 0.26 on CUDA
    assert kd._layout(torch.empty(10, 16, 576), 10, 16) == (0, 1, 16)           # MLA
    assert kd._layout(torch.empty(2, 10, 16, 8, 128), 10, 16) == (1, 2, 16)     # FlashAttention
    assert kd._layout(torch.empty(10, 2, 16, 8, 128), 10, 16) == (0, 2, 16)     # FlashInfer / Triton
    assert kd._layout(torch.empty(40, 16, 576), 10, 64) == (0, 1, 16)           # kernel blocks of 16 in blocks of 64

    class Worker(kd.KvDigest):
        def __init__(self, caches: list, num_blocks: int, block_size: int) -> None:
            self.model_runner = type("R", (), {"kv_caches": caches})()
            self.cache_config = type("C", (), {"num_gpu_blocks": num_blocks, "block_size": block_size,
                                               "cache_dtype": "auto"})()

    g = torch.Generator().manual_seed(1)
    a = [torch.zeros(6, 4, 24, dtype=torch.bfloat16) for _ in range(2)]
    for t in a:
        t[2, :3] = torch.randn(3, 24, generator=g).to(torch.bfloat16)  # a prompt of 3 tokens in block 2
        t[0, 0] = 1  # block 0, vLLM's null block: left out
    b = [torch.zeros_like(t) for t in a]
    for s, d in zip(a, b):
        d[5, :3] = s[2, :3]  # the same bytes in another block
    b[1][5, 3] = 7  # and one more token
    ra, rb = Worker(a, 6, 4).orbitkv_kv_digest("index"), Worker(b, 6, 4).orbitkv_kv_digest("index")
    assert ra["written"] == 3 and rb["written"] == 4 and ra["slot_granularity"] == "token"
    assert kd.decode_digests(ra, "index") == [8, 9, 10]
    assert set(kd.decode_digests(ra)) < set(kd.decode_digests(rb))
    b[1][5, 1, 0] += 1  # one element of one layer
    rc = Worker(b, 6, 4).orbitkv_kv_digest()
    assert len(set(kd.decode_digests(ra)) - set(kd.decode_digests(rc))) == 1


def test_each_level_gets_its_phase_quantiles_from_the_sampled_buckets(tmp_path: Path) -> None:
    """OrbitKV's phase histograms, sampled from /metrics during a load run:
    a level's requests are the bucket counts' growth from the sample before
    its start to the last one within a second after its end; p50 / p90 as
    Prometheus's histogram_quantile gives them (linear inside a bucket)."""
    name = "vllm:orbitkv_written_after_finish_seconds_bucket"

    def sample(counts: dict[str, float]) -> dict[str, float]:
        return {f'{name}{{le="{le}"}}': c for le, c in counts.items()} | {name: sum(counts.values())}

    assert driver.phase_buckets({"vllm:num_requests_running": 1.0}) == {}
    s = driver.Sampler([])
    s.phase_samples = [
        (10.0, "big-orbit-prefill", driver.phase_buckets(sample({"0.1": 2, "0.2": 2, "+Inf": 2}))),
        # the level (11 .. 20): 10 requests, 4 below 100 ms, 10 below 200 ms
        (20.5, "big-orbit-prefill", driver.phase_buckets(sample({"0.1": 6, "0.2": 12, "+Inf": 12}))),
        # after the grace: the next level's
        (30.0, "big-orbit-prefill", driver.phase_buckets(sample({"0.1": 6, "0.2": 112, "+Inf": 112}))),
    ]
    got = s.phases(11.0, 20.0)["written_after_finish"]
    assert got["n"] == 10
    assert got["p50_ms"] == pytest.approx(100 + 100 * (5 - 4) / 6, abs=0.1)
    assert got["p90_ms"] == pytest.approx(100 + 100 * (9 - 4) / 6, abs=0.1)
    assert driver.bucket_quantile({0.1: 0, float("inf"): 0}, 0.5) is None
    assert driver.bucket_quantile({0.1: 1, float("inf"): 5}, 0.9) == 0.1, "in +Inf: the highest finite bound"
    stage = {
        "config": {"input_len": 1, "input_range": 0, "output_len": 1},
        "systems": {"orbit": {"runs": {"c32": {"concurrency": 32, "orbit_phases": {"written_after_finish": got}}}}},
    }
    (tmp_path / "b-default.json").write_text(json.dumps(stage))
    lines = driver.report(tmp_path).splitlines()
    header = lines.index("| system | in flight | handshake after finish | last layer computed after finish | last write "
                         "sent after finish | written after finish | vLLM ended after finish | reported sent after "
                         "finish | pages held after finish | complete → taken |")
    row = lines[header + 2]
    assert row == "| orbit | 32 | - | - | - | 117 / 183 (10) | - | - | - | - |"
    # the two parts of the tail (a wheel that has them) are sampled too
    assert set(driver.phase_buckets({f'vllm:orbitkv_{ph}_seconds_bucket{{le="0.1"}}': 1.0 for ph in driver.PHASES})) \
        == {"written_after_finish", "pages_held_after_finish", "complete_to_taken", "handshake_after_finish",
            "sent_after_finish", "computed_after_finish", "ended_after_finish", "reported_after_finish"}


def _big_args(**kw: object) -> object:
    from types import SimpleNamespace

    a = dict(instance_overhead_gib=4.75, gpu_gib=0.0, gpu_reserve_gib=2.0, bench_runs="c4:4:48:12,c32:32:256:15",
             ttft_lengths=[1024, 8192, 32768], ttft_gen=1, min_kv_gib=4, one_gpu=True, big_kv_gib=3.0,
             big_kv_cap_gib=40.0, big_decode_kv_gib=5.5, bench_input_len=4609, bench_output_len=64, ab="control",
             ab_config=None, single=False, router=False, router_mc=False, mc=True, nixl="auto", big_layers=8,
             orbit_roles="split", ab_more=[], big_orbit_block_sizes=None)
    a.update(kw)
    return SimpleNamespace(**a)


def test_the_big_plan_reads_the_gpus_memory_and_runs_what_does_not_fit_in_a_later_group(tmp_path: Path) -> None:
    """Run 41 (one H100): the plan took an H200's 139 GiB and started six
    instances on 80 GB; MooncakeConnector's ran out of memory. The plan now
    reads the GPU's memory (nvidia-smi, no CUDA context) and puts a system
    that would not get the KV asked for in a later group."""
    from types import SimpleNamespace

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 81559\n")
    smi.chmod(0o755)
    assert driver.gpu_total_gib(str(smi)) == 79.65
    assert driver.gpu_total_gib(str(tmp_path / "absent")) is None
    bad = tmp_path / "bad-smi"
    bad.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    bad.chmod(0o755)
    assert driver.gpu_total_gib(str(bad)) is None

    real = driver.gpu_total_gib
    try:
        driver.gpu_total_gib = lambda smi="": 79.65
        ctx = SimpleNamespace(args=_big_args(), cuda=True)
        spec = driver.big_spec(ctx)
        plan = driver.plan_big(ctx, spec)
        assert plan["gpu_gib"] == 79.65 and plan["gpu_gib_source"] == "nvidia-smi"
        # OrbitKV and MC fit together (four instances); the A/A pair runs after them
        assert plan["groups"] == [["orbit", "mc"], ["orbit-control"]]
        # an H200's memory (given): all three together, as in run 40
        ctx = SimpleNamespace(args=_big_args(gpu_gib=139.0, big_layers=16, big_kv_gib=6.5, big_decode_kv_gib=12.0),
                              cuda=True)
        plan = driver.plan_big(ctx, driver.big_spec(ctx))
        assert plan["groups"] == [["orbit", "mc", "orbit-control"]] and plan["gpu_gib_source"] == "--gpu-gib"
        # nothing detected: an H200's, said so
        driver.gpu_total_gib = lambda smi="": None
        ctx = SimpleNamespace(args=_big_args(), cuda=True)
        plan = driver.plan_big(ctx, driver.big_spec(ctx))
        assert plan["gpu_gib"] == 139.0 and "nothing detected" in plan["gpu_gib_source"]
    finally:
        driver.gpu_total_gib = real


def test_the_kv_cache_cell_mode_is_known_and_its_pair_is_checked_from_the_prefills_log(tmp_path: Path) -> None:
    """``--cell-modes kv-cache``: both instances with
    ``orbitkv.pd.staging_memory`` ``kv_cache``; the pair passes only if the
    prefill's log shows the scheduler's blocks taken and a worker's pieces
    cut out of them (the lines as vLLM CPU 0.26 printed them)."""
    assert "kv-cache" in driver.CELL_MODES and driver.CELL_MODE_SUFFIX["kv-cache"] == "-kv"
    log = tmp_path / "prefill.log"
    taken = ("(EngineCore pid=9002) INFO 12-05 15:56:19 [scheduler.py:399] OrbitKV: 24 of vLLM's 256 KV cache "
             "blocks (12 MiB per rank) taken for the source staging (orbitkv.pd.staging_memory kv_cache); vLLM "
             "serves requests from the other 232\n")
    cut = ("(Worker pid=9046) INFO 12-05 15:56:26 [worker.py:375] OrbitKV rank 0: source staging of 12 MiB in 24 KV "
           "blocks of vLLM's cache (4 segments)\n")
    log.write_text(taken)
    assert driver.kv_cache_staging(log) == {"taken": True, "cut": False}
    log.write_text(taken + cut)
    assert driver.kv_cache_staging(log) == {"taken": True, "cut": True}
    assert driver.kv_cache_staging(tmp_path / "none.log") == driver.kv_cache_staging(None) == {
        "taken": False, "cut": False}


def test_a_pair_whose_staging_is_in_the_kv_cache_is_known_from_its_settings_the_default_included() -> None:
    """Since e642ecd the shipped default (``direct``) takes its staging out
    of vLLM's KV cache: the slot digest is skipped for such a pair (its
    taken blocks hold layer pieces, which the slot digest would count as
    prefill slots missing on decode, as run 42's ``direct`` MLA pairs
    did) and the pair must show the blocks taken and cut; ``beside`` and a
    ``staging_mb`` set by hand keep the staging beside the cache."""
    from types import SimpleNamespace

    assert "beside" in driver.CELL_MODES and driver.CELL_MODE_SUFFIX["beside"] == "-bs"
    # the writer's gather: its region is the default's, in the KV cache
    assert "write" in driver.CELL_MODES and driver.CELL_MODE_SUFFIX["write"] == "-wr"
    for cfg, want in (({}, True), ({"orbitkv.pd.staging_pieces": "write"}, True), ({"orbitkv.pd.staging_memory": "kv_cache"}, True),
                      ({"orbitkv.pd.staging_memory": "beside"}, False),
                      ({"orbitkv.pd.staging_mb": 1024, "orbitkv.pd.staging_min_ranges": 1}, False),
                      ({"orbitkv.pd.staging_mb": 0}, False)):
        assert driver.in_kv_cache(SimpleNamespace(orbit_cfg=cfg)) is want, cfg


def test_a_kv_cache_pairs_prefill_peak_is_also_given_over_the_whole_cache(tmp_path: Path) -> None:
    """vLLM's usage gauge counts only the blocks it serves from once some
    were taken for the staging; the load table then also gives the peak over
    the whole cache with every taken block counted in use."""
    log = tmp_path / "prefill.log"
    log.write_text("(EngineCore pid=1) INFO [scheduler.py:399] OrbitKV: 100 of vLLM's 1001 KV cache blocks "
                   "(100 MiB per rank) taken for the source staging (orbitkv.pd.staging_memory kv_cache); vLLM "
                   "serves requests from the other 901\n")
    assert driver.kv_taken(log) == (100, 1001)
    assert driver.kv_taken(tmp_path / "none.log") is None and driver.kv_taken(None) is None
    peaks = {"kv_usage_peak": 0.5, "running_peak": 3.0}
    driver.whole_cache_peak(peaks, driver.kv_taken(log))
    # 450 of vLLM's 900 usable blocks: 45 % of the 1000 in request pages, 55 % with the 100 taken
    assert peaks["kv_usage_peak_pages"] == 0.45 and peaks["kv_usage_peak_whole"] == 0.55
    assert peaks["kv_taken"] == [100, 1001]
    assert driver.peak_cell(peaks) == "50.0% (of the whole cache: 45.0% in request pages, 55.0% with the taken blocks)"
    untouched = {"kv_usage_peak": 0.5}
    driver.whole_cache_peak(untouched, None)
    driver.whole_cache_peak(None, (1, 2))
    assert untouched == {"kv_usage_peak": 0.5} and driver.peak_cell(untouched) == "50.0%"
    # against a pair that took nothing (its gauge is over the whole cache): 0.45 / 0.5, 0.55 / 0.5;
    # the gauge's own 0.5 / 0.5 would hide both
    orbit = {"servers": {"big-orbit-prefill": peaks, "big-orbit-decode": {"kv_usage_peak": 0.9}}}
    mc = {"servers": {"big-mc-prefill": {"kv_usage_peak": 0.5}}}
    assert driver.whole_cache_ratio(orbit, mc) == "0.90 / 1.10"
    assert driver.whole_cache_ratio(mc, mc) == "1.00 / 1.00"
    # a stage file from before kv_usage_peak_pages: derived from its kv_taken
    old = {"servers": {"big-orbit-prefill": {"kv_usage_peak": 0.5, "kv_usage_peak_whole": 0.55, "kv_taken": [100, 1001]}}}
    assert driver.whole_cache_ratio(old, mc) == "0.90 / 1.10"
    assert driver.peak_cell(old["servers"]["big-orbit-prefill"]) == driver.peak_cell(peaks)
    assert driver.whole_cache_ratio(orbit, {"servers": {}}) == "- / -"
    assert driver.whole_cache_ratio(orbit, {"servers": {"p-prefill": {"kv_usage_peak": -1}}}) == "- / -"


def test_an_orbitkv_pair_runs_as_producer_and_consumer_unless_told_both(tmp_path: Path) -> None:
    """Up to run 42 both instances of every OrbitKV pair ran ``kv_both``, so
    each decode gave a tenth of its KV cache to a source staging it never
    used, while MooncakeConnector's decode (``kv_consumer``) kept its whole
    cache: at 32 in flight that decode was full (99.8 %). A pair now runs
    as docs/configuration.md advises, the prefill ``kv_producer`` and the
    decode ``kv_consumer``; ``--orbit-roles both`` keeps the old roles."""
    import json
    from types import SimpleNamespace

    spec = driver.ModelSpec("small-float32", 2, 256, 4, 2, 64, 512, 2048, 4096, "float32", True)
    for roles, want in (("split", ("kv_producer", "kv_consumer")), ("both", ("kv_both", "kv_both"))):
        ctx = SimpleNamespace(args=SimpleNamespace(orbit_roles=roles), cuda=False)
        pre = driver.Server("p", "m", spec, 0, "orbit", True, 1 << 30, 256, 1, 2)
        dec = driver.Server("d", "m", spec, 1, "orbit", True, 1 << 30, 256, 3, 4)
        driver.allow_prefill(ctx, pre, dec)
        assert (pre.orbit_role, dec.orbit_role) == want
        assert dec.orbit_cfg["orbitkv.pd.allowed_prefill"] == [f"{driver.HOST}:2"]
        argv = driver.server_argv(SimpleNamespace(args=SimpleNamespace(python="python3"), cuda=False), dec)
        cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert cfg["kv_role"] == want[1] and cfg["kv_connector"] == "PdConnector"


def test_the_load_kv_digest_compares_every_request_of_the_load_runs_and_names_the_early_gives(tmp_path: Path) -> None:
    """--load-kv-digest: after a system's load runs, decode's per-token
    digests as loaded are compared with prefill's as released (or given
    back early), over every request the runs completed; one differing
    token, or fewer records than requests, fails the check, and the report
    shows the table with the pages given back early."""
    import base64
    import json
    from types import SimpleNamespace

    import numpy as np

    def b64(xs: list[int]) -> str:
        return base64.b64encode(np.asarray(xs, dtype="<i8").tobytes()).decode()

    ctx = SimpleNamespace(work=tmp_path, log=lambda *_: None)
    spec = driver.ModelSpec("small-float32", 2, 256, 4, 2, 64, 512, 2048, 4096, "float32", True)
    pre = driver.Server("big-orbit-prefill", "m", spec, 0, "orbit", True, 1 << 30, 256, 1, 2)
    dec = driver.Server("big-orbit-decode", "m", spec, 1, "orbit", True, 1 << 30, 256, 3, 4)

    def write(s: driver.Server, recs: list[dict[str, object]]) -> None:
        d = driver.release_dir(ctx, s)  # type: ignore[arg-type]
        d.mkdir(parents=True, exist_ok=True)
        (d / "kvd-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))

    prompt = [11, 12, 13, 14, 15, 16]
    write(pre, [{"pd": f"r{i}", "digests": b64(prompt), "first_token": 0, "end_token": 6, "block_size": 4,
                 "blocks": [1, 2]} for i in range(3)])
    loaded = [{"pd": f"r{i}", "digests": b64(prompt[:5]), "first_token": 0, "end_token": 5, "block_size": 4,
               "blocks": [7, 8]} for i in range(3)]
    write(dec, loaded)
    sysres = {"runs": {"warmup": {"completed": 1}, "c1": {"completed": 2}},
              "metrics_delta": {pre.name: {"vllm:orbitkv_producer_pages_given_back_total": 2.0}}}
    ok = driver.load_digest_check(ctx, pre, dec, sysres)  # type: ignore[arg-type]
    assert (ok["ok"], ok["requests_compared"], ok["tokens_compared"], ok["pages_given_back"]) == (True, 3, 15, 2.0)
    # one request more than the records: not ok
    sysres["runs"]["c4"] = {"completed": 1}
    assert driver.load_digest_check(ctx, pre, dec, sysres)["ok"] is False  # type: ignore[arg-type]
    del sysres["runs"]["c4"]
    # one token differs in one request
    loaded[1]["digests"] = b64([11, 12, 99, 14, 15])
    write(dec, loaded)
    bad = driver.load_digest_check(ctx, pre, dec, sysres)  # type: ignore[arg-type]
    assert (bad["ok"], bad["tokens_mismatched"], bad["requests_mismatched"]) == (False, 1, 1)
    # the report's table
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "b-default.json").write_text(json.dumps({"stage": "b-default", "config": {
        "input_len": 200, "input_range": 0.5, "output_len": 8}, "systems": {
        "orbit": {"runs": {}, "kv_release": ok}, "orbit-control": {"runs": {}, "kv_release": bad}}}))
    text = driver.report(tmp_path / "out")
    assert "| orbit | 3 of 3 | 15 | 0 | 0 | 2 | yes |" in text
    assert "| orbit-control | 3 of 3 | 15 | 1 | 1 | 2 | **no** |" in text


def test_big_orbit_block_sizes_give_orbitkvs_prefill_and_decode_their_own_block_size(tmp_path: Path) -> None:
    """``--big-orbit-block-sizes 16:64``: the untimed case of the writer's
    gather (prefill blocks smaller than decode's, which the defaults write
    page to page) under load. Every OrbitKV prefill gets ``--block-size
    16`` and every OrbitKV decode ``64``, A/B pairs included; MC and the
    single engine keep vLLM's default; a pair that is not two powers of two
    is refused before anything runs."""
    from types import SimpleNamespace

    spec = driver.ModelSpec("small-float32", 2, 256, 4, 2, 64, 512, 2048, 4096, "float32", True)
    mk = lambda name, conn: driver.Server(name, "m", spec, 0, conn, True, 1 << 30, 256, 1, 2)  # noqa: E731
    servers = [mk("big-orbit-prefill", "orbit"), mk("big-orbit-decode", "orbit"),
               mk("big-g2-orbitw6-prefill", "orbit"), mk("big-g2-orbitw6-decode", "orbit"),
               mk("big-mc-prefill", "mc"), mk("big-mc-decode", "mc"), mk("big-single", "none")]
    driver.orbit_block_sizes(servers, driver.block_size_pair("16:64"))
    ctx = SimpleNamespace(args=SimpleNamespace(python="python3"), cuda=False)
    got = {}
    for s in servers:
        argv = driver.server_argv(ctx, s) if s.connector != "mc" else s.extra_args
        got[s.name] = argv[argv.index("--block-size") + 1] if "--block-size" in argv else None
    assert got == {"big-orbit-prefill": "16", "big-orbit-decode": "64", "big-g2-orbitw6-prefill": "16",
                   "big-g2-orbitw6-decode": "64", "big-mc-prefill": None, "big-mc-decode": None, "big-single": None}
    for bad in ("16", "16:48", "0:16", "16:2048", "a:b", "16:64:1"):
        with pytest.raises(argparse.ArgumentTypeError):
            driver.block_size_pair(bad)
    with pytest.raises(SystemExit) as e:
        driver.main(["--big-orbit-block-sizes", "16:48", "--device", "cpu", "--stages", "none", "--deadline-s", "5",
                     "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")])
    assert e.value.code == 2
    assert not (tmp_path / "o").exists()  # refused before anything ran


def test_a_load_run_is_a_closed_loop_by_default_and_an_open_loop_with_a_rate() -> None:
    """--bench-runs TAG:IN_FLIGHT:PROMPTS:SEED[:RATE]: without RATE (or with
    inf) vllm bench serve keeps IN_FLIGHT requests in flight, each client
    sending its next when its last ended; with RATE requests arrive at that
    rate (Poisson) and IN_FLIGHT only caps them. The summary names the level
    by what it was."""
    closed, open_, inf = driver.parse_runs("c32:32:256:105,r8:32:200:7:8.5,c1:1:16:101:inf")
    assert closed == ("c32", 32, 256, 105, None) and closed.rate_arg == "inf"
    assert open_ == ("r8", 32, 200, 7, 8.5) and open_.rate_arg == "8.5"
    assert inf.rate is None
    assert driver.level({"concurrency": 32, "request_rate": "inf"}) == "32"
    assert driver.level({"concurrency": 32}) == "32"  # a record from before the field
    assert driver.level({"concurrency": 32, "request_rate": "8.5"}) == "8.5/s (at most 32)"
    for bad, why in [("c1:1:16", "TAG:CONCURRENCY"), (":1:16:1", "TAG:CONCURRENCY"), ("c1:x:16:1", "integers"),
                     ("c1:1:16:1:fast", "integers"), ("c1:0:16:1", "at least 1"), ("c1:1:0:1", "at least 1"),
                     ("c1:1:16:-1", "not negative"), ("c1:1:16:1:0", "RATE above 0"),
                     ("c1:1:16:1:nan", "RATE above 0"), ("c1:1:16:1,c1:4:8:2", "TAG given twice")]:
        with pytest.raises(ValueError, match=why):
            driver.parse_runs(bad)


@pytest.mark.parametrize("opt", ["--bench-runs", "--bench-warmup"])
def test_a_malformed_load_run_is_refused_before_anything_runs(opt: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        driver.main([opt, "c1:1:16:1:0", "--device", "cpu", "--stages", "none", "--deadline-s", "5",
                     "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")])
    assert e.value.code == 2
    assert not (tmp_path / "o").exists()
