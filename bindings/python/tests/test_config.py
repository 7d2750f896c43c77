"""`kv_connector_extra_config` parsing (`orbitkv.vllm.config`): defaults,
the keys added for hostile networks (allow-list, deployment key), and the
error each bad value gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from orbitkv._native import RUNTIME_DEFAULTS, RUNTIME_SETTINGS
from orbitkv.vllm.config import KEY_ENV, ConfigError, PdConfig


def test_defaults_and_per_rank_helpers() -> None:
    c = PdConfig.from_extra_config({"orbitkv.pd.mooncake.rank_map": {"1": {"nic": "mlx5_1"}}})
    assert c.nics_for(0) == [] and c.nics_for(1) == ["mlx5_1"]
    assert c.side_channel_port_for(3) == 17503
    assert c.side_channel_key is None
    # Loopback's default side channel ports (a TP <= 8 prefill: one host's
    # GPUs), unless configured; nothing beyond (issue 44: 56 more ports of
    # this host used to receive decode's handshakes).
    assert c.prefill_allowed("127.0.0.1", 17500) and c.prefill_allowed("localhost", 17507)
    assert c.prefill_allowed("[::1]", 17500) and c.prefill_allowed("127.0.0.1", 17500, tp=8)
    assert not c.prefill_allowed("127.0.0.1", 17500, tp=9)  # rank 8 listens on 17508
    assert not c.prefill_allowed("localhost", 17508) and not c.prefill_allowed("127.0.0.1", 17563)
    assert not c.prefill_allowed("127.0.0.1", 1) and not c.prefill_allowed("localhost", 17499)
    assert not c.prefill_allowed("127.0.0.2", 17500) and not c.prefill_allowed("10.0.0.2", 17500)
    assert c.prefill_host_allowed("LOCALHOST") and not c.prefill_host_allowed("10.0.0.2")


def test_allowed_prefill_entries_name_endpoints() -> None:
    c = PdConfig.from_extra_config(
        {"orbitkv.pd.allowed_prefill": ["10.0.0.2:17500", "[fd00::1]:9000-9003", "P1.example:17600-17601"]}
    )
    assert c.prefill_allowed("10.0.0.2", 17500) and not c.prefill_allowed("10.0.0.2", 17501)
    assert not c.prefill_allowed("10.0.0.2", 17500, tp=2)  # rank 1's port is not declared
    assert c.prefill_allowed("fd00::1", 9000, tp=4) and c.prefill_allowed("[FD00::1]", 9003)
    assert not c.prefill_allowed("fd00::1", 8999) and not c.prefill_allowed("fd00::1", 9001, tp=4)
    assert c.prefill_allowed("p1.example", 17601) and not c.prefill_allowed("p1.example", 17602)
    assert not c.prefill_allowed("127.0.0.1", 17500)  # a list given replaces the loopback default
    assert c.prefill_host_allowed("p1.example") and not c.prefill_host_allowed("10.0.0.3")
    # A TP 2 prefill may be declared as two entries.
    two = PdConfig.from_extra_config({"orbitkv.pd.allowed_prefill": ["[::1]:17500", "[::1]:17501"]})
    assert two.prefill_allowed("::1", 17500, tp=2) and not two.prefill_allowed("::1", 17500, tp=3)
    # "*" allows every side channel (unsafe: trusts whoever reaches decode's API).
    for star in ("*", ["*"], ["10.0.0.2:1", "*"]):
        anyc = PdConfig.from_extra_config({"orbitkv.pd.allowed_prefill": star})
        assert anyc.prefill_allowed("10.9.9.9", 1, tp=1024) and anyc.prefill_host_allowed("10.9.9.9")
    # Ranges: inclusive, at most 1024 ports.
    wide = PdConfig.from_extra_config({"orbitkv.pd.allowed_prefill": ["h:1000-2023"]})
    assert wide.prefill_allowed("h", 1000, tp=1024) and not wide.prefill_allowed("h", 2024)


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("10.0.0.2", "names no port"),  # the old host-only form: every port of the host
        ("p1.example", "names no port"),
        ("[fd00::1]", "names no port"),
        ("fd00::2", "takes brackets and a port"),
        ("::1", "takes brackets and a port"),
        ("10.0.0.2:0", "ports must be in 1..65535"),
        ("10.0.0.2:65536", "ports must be in 1..65535"),
        ("h:x", "ports must be in 1..65535"),
        ("h:\u00b9", "ports must be in 1..65535"),  # a digit to isdigit(), not to int()
        ("h:", "ports must be in 1..65535"),
        ("h:1-", "ports must be in 1..65535"),
        ("h:-5", "ports must be in 1..65535"),
        ("h:1-2-3", "ports must be in 1..65535"),
        ("h:17505-17500", "first port is above its last"),
        ("h:1000-2024", "at most 1024 ports"),
        ("[::1", "entries are 'host:port'"),
        ("[::1]17500", "entries are 'host:port'"),
        ("[]:17500", "entries are 'host:port'"),
        (":17500", "entries are 'host:port'"),
        ("a/b:17500", "entries are 'host:port'"),
        ("*:17500", "entries are 'host:port'"),
        ("a b:1", "entries are 'host:port'"),
        ("", "entries are 'host:port'"),
        (7, "entries are 'host:port'"),
    ],
)
def test_a_bad_allowed_prefill_entry_is_refused_at_load(entry: object, why: str) -> None:
    with pytest.raises(ConfigError, match=r"orbitkv\.pd\.allowed_prefill") as e:
        PdConfig.from_extra_config({"orbitkv.pd.allowed_prefill": ["127.0.0.1:17500", entry]})
    assert why in str(e.value)


def test_a_host_only_entry_says_how_to_name_the_ports() -> None:
    with pytest.raises(ConfigError) as e:
        PdConfig.from_extra_config({"orbitkv.pd.allowed_prefill": ["10.0.0.2"]})
    msg = str(e.value)
    assert "'10.0.0.2' names no port" in msg and "'10.0.0.2:17500'" in msg and "'10.0.0.2:17500-17507'" in msg
    with pytest.raises(ConfigError, match="must be a list"):
        PdConfig.from_extra_config({"orbitkv.pd.allowed_prefill": {"h": 1}})


def test_deployment_key_from_file_or_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "key"
    f.write_bytes(b"  a-key-of-sixteen-bytes-or-more\n")
    assert PdConfig.from_extra_config({"orbitkv.pd.side_channel_key_file": str(f)}).side_channel_key == (
        b"a-key-of-sixteen-bytes-or-more"
    )
    assert "key" not in repr(PdConfig.from_extra_config({"orbitkv.pd.side_channel_key_file": str(f)})).split("(")[1]
    monkeypatch.setenv(KEY_ENV, "env-key-0123456789")
    assert PdConfig.from_extra_config({}).side_channel_key == b"env-key-0123456789"
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        PdConfig.from_extra_config({})
    with pytest.raises(ConfigError, match="cannot read"):
        PdConfig.from_extra_config({"orbitkv.pd.side_channel_key_file": str(tmp_path / "missing")})


def test_unknown_keys_are_errors() -> None:
    with pytest.raises(ConfigError, match="unknown OrbitKV setting"):
        PdConfig.from_extra_config({"orbitkv.pd.allowed_prefil": ["x"]})


def test_inline_submit_max_ranges() -> None:
    assert PdConfig.from_extra_config({"orbitkv.pd.inline_submit_max_ranges": 0}).inline_submit_max_ranges == 0
    assert PdConfig.from_extra_config({"orbitkv.pd.inline_submit_max_ranges": 8}).inline_submit_max_ranges == 8


def test_writer_lanes() -> None:
    assert PdConfig.from_extra_config({}).writer_lanes == 4
    assert PdConfig.from_extra_config({"orbitkv.pd.writer_lanes": 1}).writer_lanes == 1
    for bad in (0, 65, -1, True, "4", 2.0, None):
        with pytest.raises(ConfigError, match="writer_lanes"):
            PdConfig.from_extra_config({"orbitkv.pd.writer_lanes": bad})



def test_mooncake_submit_wait() -> None:
    assert PdConfig.from_extra_config({}).mooncake_submit_wait == "layer"
    for v in ("layer", "device"):
        assert PdConfig.from_extra_config({"orbitkv.pd.mooncake_submit_wait": v}).mooncake_submit_wait == v
    for bad in ("", "side", None, 1, True):
        with pytest.raises(ConfigError, match="mooncake_submit_wait"):
            PdConfig.from_extra_config({"orbitkv.pd.mooncake_submit_wait": bad})

def test_gpu_wait_parks_by_default_and_reaches_the_runtime() -> None:
    cfg = PdConfig.from_extra_config({})
    assert cfg.gpu_wait == "park"
    assert cfg.runtime_settings()["lanes_park_on_gpu"] is True
    block = PdConfig.from_extra_config({"orbitkv.pd.gpu_wait": "block"})
    assert block.runtime_settings()["lanes_park_on_gpu"] is False
    # the runtime takes the setting by that name
    assert "lanes_park_on_gpu" in RUNTIME_SETTINGS
    assert RUNTIME_DEFAULTS["lanes_park_on_gpu"] is True
    for bad in ("", "wait", None, 1, True):
        with pytest.raises(ConfigError, match="gpu_wait"):
            PdConfig.from_extra_config({"orbitkv.pd.gpu_wait": bad})


def test_staging_pieces_go_by_layer_by_default_and_reach_the_runtime() -> None:
    """``orbitkv.pd.staging_pieces``: ``layer`` by default (the runtime's
    ``pieces_whole_requests`` off), ``request`` turns it on; refused next to
    a ``staging_mb`` set by hand (no layer pieces to hand out there)."""
    cfg = PdConfig.from_extra_config({})
    assert cfg.staging_pieces == "layer"
    assert cfg.runtime_settings()["pieces_whole_requests"] is False
    assert RUNTIME_DEFAULTS["pieces_whole_requests"] is False
    assert "pieces_whole_requests" in RUNTIME_SETTINGS
    whole = PdConfig.from_extra_config({"orbitkv.pd.staging_pieces": "request"})
    assert whole.runtime_settings()["pieces_whole_requests"] is True
    assert whole.runtime_settings()["gather_in_writer"] is False
    # write: no piece at the layer's launch, the writer lanes gather
    write = PdConfig.from_extra_config({"orbitkv.pd.staging_pieces": "write"})
    assert write.runtime_settings()["gather_in_writer"] is True
    assert write.runtime_settings()["pieces_whole_requests"] is False
    assert cfg.runtime_settings()["gather_in_writer"] is False
    assert "gather_in_writer" in RUNTIME_SETTINGS and RUNTIME_DEFAULTS["gather_in_writer"] is False
    for bad in ("", "chunk", None, 1, True):
        with pytest.raises(ConfigError, match="staging_pieces"):
            PdConfig.from_extra_config({"orbitkv.pd.staging_pieces": bad})
    with pytest.raises(ConfigError, match=r"orbitkv\.pd\.staging_pieces: hands out the layer pieces"):
        PdConfig.from_extra_config({"orbitkv.pd.staging_pieces": "request", "orbitkv.pd.staging_mb": 512})
    # with staging off (0) too: nothing to hand out
    with pytest.raises(ConfigError, match="staging_pieces"):
        PdConfig.from_extra_config({"orbitkv.pd.staging_pieces": "layer", "orbitkv.pd.staging_mb": 0})


def test_dialects_are_off_by_default_and_only_known_ones_are_accepted() -> None:
    assert PdConfig.from_extra_config({}).dialects == ()
    assert PdConfig.from_extra_config({"orbitkv.pd.dialects": []}).dialects == ()
    assert PdConfig.from_extra_config({"orbitkv.pd.dialects": ["mooncake"]}).dialects == ("mooncake",)
    assert PdConfig.from_extra_config({"orbitkv.pd.dialects": ["mooncake", "mooncake"]}).dialects == ("mooncake",)
    for bad in ("mooncake", ["nixl"], ["Mooncake"], [1], [None], None, {"mooncake": True}, True):
        with pytest.raises(ConfigError, match=r"orbitkv\.pd\.dialects"):
            PdConfig.from_extra_config({"orbitkv.pd.dialects": bad})
    with pytest.raises(ConfigError, match=r"unknown dialect\(s\) \['offloading'\]; known: \['mooncake'\]"):
        PdConfig.from_extra_config({"orbitkv.pd.dialects": ["offloading"]})


def test_prefill_tp_and_the_advertised_side_channel() -> None:
    assert PdConfig.from_extra_config({}).prefill_tp is None
    assert PdConfig.from_extra_config({"orbitkv.pd.prefill_tp": 4}).prefill_tp == 4
    c = PdConfig.from_extra_config({"orbitkv.pd.side_channel_host": "10.0.0.2", "orbitkv.pd.side_channel_port": 17600})
    assert (c.advertised_side_channel(), c.advertised_side_channel(3)) == ("10.0.0.2:17600", "10.0.0.2:17603")
    # listening on every address: peers are told the bind host; IPv6 in brackets
    c = PdConfig.from_extra_config({"orbitkv.pd.side_channel_host": "::", "orbitkv.pd.mooncake.bind_host": "fd00::2"})
    assert c.advertised_side_channel(1) == "[fd00::2]:17501"


@pytest.mark.parametrize(
    "key", ["orbitkv.pd.timeout_s", "orbitkv.pd.handshake_timeout_s", "orbitkv.pd.write_timeout_s", "orbitkv.pd.quarantine_s"]
)
def test_durations(key: str) -> None:
    field = key.removeprefix("orbitkv.pd.")
    assert getattr(PdConfig.from_extra_config({key: 2.5}), field) == 2.5
    assert PdConfig.from_extra_config({}).quarantine_s == 60.0
    for bad in (0, -1, "5", None, True, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=field):
            PdConfig.from_extra_config({key: bad})


def test_the_connector_defaults_are_the_runtimes() -> None:
    """Each runtime default is written once, in Rust (`RuntimeConfig::default()`):
    the connector's configuration and `Runtime(...)` left without a setting
    both read it from `orbitkv._native.RUNTIME_DEFAULTS`."""
    from orbitkv._native import RUNTIME_DEFAULTS as rt

    c = PdConfig.from_extra_config({})
    assert (c.timeout_s, c.handshake_timeout_s, c.write_timeout_s, c.quarantine_s) == (
        rt["consumer_timeout_s"],
        rt["handshake_timeout_s"],
        rt["write_timeout_s"],
        rt["quarantine_s"],
    )
    assert c.max_inflight_mb << 20 == rt["max_bytes_in_flight_per_peer"]
    # The range cap's default is the transport's, chosen when the runtime
    # starts (test_runtime_bytes: 768 on TCP); none is written for it here.
    assert c.max_inflight_ranges is None and "max_ranges_in_flight_per_peer" not in rt
    assert (c.writer_lanes, c.inline_submit_max_ranges) == (
        rt["writer_lanes_per_peer"],
        rt["inline_submit_max_ranges"],
    )
    assert set(rt) >= {"notify_poll_ms", "max_parked", "max_parked_bytes", "publish_timeout_s"}
    assert all(isinstance(v, bool) or (isinstance(v, (int, float)) and v > 0) for v in rt.values())
    assert c.gpu_wait == ("park" if rt["lanes_park_on_gpu"] else "block")
    assert c.staging_pieces == ("request" if rt["pieces_whole_requests"] else "layer")


def test_every_setting_is_documented() -> None:
    """Each key the connector accepts has its row in docs/configuration.md."""
    from pathlib import Path

    from orbitkv.vllm.config import KEYS

    doc = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()
    missing = sorted(k for k in KEYS if f"`{k}`" not in doc)
    assert not missing, f"settings without a row in docs/configuration.md: {missing}"


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("orbitkv.pd.side_channel_port", 0),
        ("orbitkv.pd.decode_tp", 0),
        ("orbitkv.pd.decode_tp", "2"),
        ("orbitkv.pd.decode_tp", 2000),
        ("orbitkv.pd.prefill_tp", 0),
        ("orbitkv.pd.prefill_tp", "2"),
        ("orbitkv.pd.prefill_tp", True),
        ("orbitkv.pd.prefill_tp", 1025),
        ("orbitkv.pd.dialects", "mooncake"),
        ("orbitkv.pd.dialects", ["nixl"]),
        ("orbitkv.pd.side_channel_port", 65536),
        ("orbitkv.pd.side_channel_port", "17500"),
        ("orbitkv.pd.side_channel_port", True),
        ("orbitkv.pd.max_inflight_mb", 0),
        ("orbitkv.pd.max_inflight_ranges", 1.5),
        ("orbitkv.pd.max_inflight_ranges", 0),
        ("orbitkv.pd.max_inflight_ranges", "8192"),
        ("orbitkv.pd.max_inflight_ranges", True),
        ("orbitkv.pd.staging_mb", -1),
        ("orbitkv.pd.staging_mb", "64"),
        ("orbitkv.pd.staging_mb", 1.5),
        ("orbitkv.pd.staging_mb", None),
        ("orbitkv.pd.staging_mb", "AUTO"),
        ("orbitkv.pd.staging_mb", True),
        ("orbitkv.pd.staging_min_ranges", 0),
        ("orbitkv.pd.staging_min_ranges", True),
        ("orbitkv.pd.inline_submit_max_ranges", -1),
        ("orbitkv.pd.inline_submit_max_ranges", True),
        ("orbitkv.pd.inline_submit_max_ranges", 1.5),
        ("orbitkv.pd.mooncake.bind_host", ""),
        ("orbitkv.pd.mooncake.bind_host", "a host"),
        ("orbitkv.pd.mooncake.bind_host", None),
        ("orbitkv.pd.side_channel_host", 7),
        ("orbitkv.pd.mooncake.library", 3),
        ("orbitkv.pd.trace", ["x"]),
        ("orbitkv.pd.side_channel_key_file", ""),
        ("orbitkv.pd.mooncake.rank_map", ["mlx5_0"]),
        ("orbitkv.pd.mooncake.rank_map", {"x": {"nic": "mlx5_0"}}),
        ("orbitkv.pd.mooncake.rank_map", {"-1": {"nic": "mlx5_0"}}),
        ("orbitkv.pd.mooncake.rank_map", {"0": {"nic": ""}}),
        ("orbitkv.pd.mooncake.rank_map", {"0": {"nic": "mlx5_0", "port": 1}}),
        ("orbitkv.pd.claim_timeout_s", 0),
        ("orbitkv.pd.claim_timeout_s", float("inf")),
        ("orbitkv.pd.unclaimed_grace_s", -1),
        ("orbitkv.pd.unclaimed_grace_s", float("nan")),
        ("orbitkv.pd.unclaimed_grace_s", "2"),
        ("orbitkv.pd.unclaimed_grace_s", None),
        ("orbitkv.pd.unclaimed_kv_share", 0),
        ("orbitkv.pd.unclaimed_kv_share", 1.5),
        ("orbitkv.pd.unclaimed_max_requests", 0),
        ("orbitkv.pd.unclaimed_max_requests", True),
    ],
)
def test_every_key_is_strict_and_its_error_names_it(key: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        PdConfig.from_extra_config({key: bad})


def test_the_unclaimed_grace_may_be_zero() -> None:
    assert PdConfig.from_extra_config({}).unclaimed_grace_s == 2.0
    assert PdConfig.from_extra_config({"orbitkv.pd.unclaimed_grace_s": 0}).unclaimed_grace_s == 0.0


def test_other_connectors_keys_are_left_alone_and_the_keys_are_the_models() -> None:
    from orbitkv.vllm.config import KEYS, ExtraConfig

    c = PdConfig.from_extra_config({"some.other.connector": {"x": 1}, 7: "not even a string"})  # type: ignore[dict-item]
    assert c == PdConfig.from_extra_config({})
    assert {f.alias for f in ExtraConfig.model_fields.values()} == KEYS
    assert len(KEYS) == len(ExtraConfig.model_fields)


@pytest.mark.parametrize(("given", "want"), [({}, None), ({"orbitkv.pd.max_inflight_ranges": None}, None),
                                             ({"orbitkv.pd.max_inflight_ranges": 8192}, 8192),
                                             ({"orbitkv.pd.max_inflight_ranges": 1}, 1)])
def test_the_range_cap_left_out_or_null_is_the_transports_default(given: dict[str, object], want: int | None) -> None:
    """``orbitkv.pd.max_inflight_ranges`` left out, or ``null`` in JSON, is
    passed on as None: the runtime takes the transport's default when it
    starts (test_runtime: 768 on TCP); a number is passed on as it is."""
    assert PdConfig.from_extra_config(given).max_inflight_ranges == want


def test_staging_defaults_to_a_source_staging_on_prefill_only() -> None:
    from orbitkv.vllm.config import staging_parts

    assert PdConfig.from_extra_config({}).staging_mb == "auto"
    gib = 1 << 30
    # a quarter of the KV cache, at most 1 GiB, only where the rank may prefill
    assert staging_parts("auto", "kv_producer", 2 * gib) == (0, 512)
    assert staging_parts("auto", "kv_both", 2 * gib) == (0, 512)
    assert staging_parts("auto", "kv_producer", 4 * gib) == (0, 1024)
    assert staging_parts("auto", "kv_producer", 64 * gib) == (0, 1024)
    assert staging_parts("auto", "kv_consumer", 64 * gib) == (0, 0)
    assert staging_parts("auto", "kv_producer", 3 << 20) == (0, 0)
    # a size: split by role as before
    assert staging_parts(256, "kv_producer", gib) == (0, 256)
    assert staging_parts(256, "kv_consumer", gib) == (256, 0)
    assert staging_parts(256, "kv_both", gib) == (128, 128)
    assert staging_parts(0, "kv_both", gib) == (0, 0)


def test_the_auto_stagings_share_of_the_kv_cache_is_a_setting_for_auto_only() -> None:
    """``orbitkv.pd.staging_kv_share`` sizes ``staging_mb`` ``auto`` (a
    quarter by default, still at most 1 GiB); anything but a share in
    (0, 0.5], or a share beside a size set by hand (which it would not
    size), is refused by name."""
    from orbitkv.vllm.config import AUTO_STAGING_KV_SHARE, staging_parts

    assert PdConfig.from_extra_config({}).staging_kv_share == AUTO_STAGING_KV_SHARE == 0.25
    assert PdConfig.from_extra_config({"orbitkv.pd.staging_kv_share": 0.1}).staging_kv_share == 0.1
    gib = 1 << 30
    assert staging_parts("auto", "kv_producer", 2 * gib, 0.1) == (0, 204)
    assert staging_parts("auto", "kv_producer", 16 * gib, 0.1) == (0, 1024)  # the 1 GiB cap holds
    assert staging_parts("auto", "kv_consumer", 2 * gib, 0.1) == (0, 0)
    for bad in (0, -0.1, 0.6, 1, float("nan"), "a quarter", None):
        with pytest.raises(ConfigError, match=r"orbitkv\.pd\.staging_kv_share"):
            PdConfig.from_extra_config({"orbitkv.pd.staging_kv_share": bad})
    with pytest.raises(ConfigError, match=r"orbitkv\.pd\.staging_kv_share: sizes the staging of"):
        PdConfig.from_extra_config({"orbitkv.pd.staging_kv_share": 0.25, "orbitkv.pd.staging_mb": 512})


def test_the_auto_staging_grows_past_a_gib_to_three_steps_of_a_deep_model_within_a_tenth_of_the_cache() -> None:
    """A layer piece is held from its layer's launch to its write's end,
    about three scheduler steps under load: where three steps of
    ``max_num_batched_tokens`` (every layer) are more than 1 GiB the region
    may grow to them, but never past a tenth of the KV cache nor the share;
    where they are less, the rule is the quarter at most 1 GiB as before
    (the configurations measured on GPU keep their size)."""
    from orbitkv.vllm.config import auto_staging_mb, staging_parts

    gib, mib = 1 << 30, 1 << 20
    # Llama-3-8B, 32 layers at 128 KiB a token, 8192 tokens a step: 1 GiB a step
    step = 8192 * 128 * 1024
    assert auto_staging_mb(48 * gib, step_bytes=step) == 3 * 1024  # 6.25 % of the cache
    assert staging_parts("auto", "kv_producer", 48 * gib, step_bytes=step) == (0, 3072)
    assert staging_parts("auto", "kv_consumer", 48 * gib, step_bytes=step) == (0, 0)
    # a tenth of the cache bounds it (20 GiB: 2 GiB), and the share below that
    assert auto_staging_mb(20 * gib, step_bytes=step) == 2048
    assert auto_staging_mb(20 * gib, 0.05, step_bytes=step) == 1024
    # a cache whose tenth is under 1 GiB keeps the 1 GiB cap
    assert auto_staging_mb(8 * gib, step_bytes=step) == 1024
    # runs 44-45's prefill: 8 layers, 3 GiB, 256 MiB a step: three steps are the quarter, 768 MiB, as before
    assert auto_staging_mb(3 * gib, step_bytes=256 * mib) == auto_staging_mb(3 * gib) == 768
    # small steps never shrink it below the rule before
    assert auto_staging_mb(64 * gib, step_bytes=mib) == auto_staging_mb(64 * gib) == 1024
    assert auto_staging_mb(64 * gib, step_bytes=None) == auto_staging_mb(64 * gib, step_bytes=0) == 1024

