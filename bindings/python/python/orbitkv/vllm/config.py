"""``kv_connector_extra_config`` keys of the PdConnector, their defaults and
their checks. Every bad value raises :class:`ConfigError` naming the key.
Imports nothing from vLLM. ``docs/configuration.md`` documents each key."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from orbitkv._native import RUNTIME_DEFAULTS as _RT

PREFIX = "orbitkv.pd."

KEYS = {
    "orbitkv.pd.mooncake.bind_host",
    "orbitkv.pd.mooncake.rank_map",
    "orbitkv.pd.mooncake.library",
    "orbitkv.pd.side_channel_host",
    "orbitkv.pd.side_channel_port",
    "orbitkv.pd.timeout_s",
    "orbitkv.pd.handshake_timeout_s",
    "orbitkv.pd.write_timeout_s",
    "orbitkv.pd.quarantine_s",
    "orbitkv.pd.max_inflight_mb",
    "orbitkv.pd.max_inflight_ranges",
    "orbitkv.pd.writer_lanes",
    "orbitkv.pd.mooncake_submit_wait",
    "orbitkv.pd.trace",
    "orbitkv.pd.allowed_prefill",
    "orbitkv.pd.side_channel_key_file",
}

# Where decode may send handshakes when `orbitkv.pd.allowed_prefill` is unset.
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# The deployment key, when it is not in a file (`side_channel_key_file`).
KEY_ENV = "ORBITKV_SIDE_CHANNEL_KEY"
MIN_KEY_BYTES = 16


# Where a prefill rank 0's side channel listens unless configured (rank r:
# this + r); the proxy assumes it for a prefill given without --prefill-kv.
DEFAULT_SIDE_CHANNEL_PORT = 17500


class ConfigError(ValueError):
    """A ``kv_connector_extra_config`` value OrbitKV cannot use."""


def _positive_float(cfg: Mapping[str, Any], key: str, default: float) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise ConfigError(f"{key} must be a positive, finite number of seconds, got {v!r}")
    return float(v)


def _port(cfg: Mapping[str, Any], key: str, default: int) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65535:
        raise ConfigError(f"{key} must be a TCP port in 1..65535, got {v!r}")
    return v


@dataclass(frozen=True)
class PdConfig:
    bind_host: str = "127.0.0.1"
    rank_nics: dict[int, list[str]] = field(default_factory=dict)
    library: str | None = None
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    # The runtime's settings default to the runtime's own defaults (Rust's
    # RuntimeConfig::default(), the one place they are written).
    timeout_s: float = float(_RT["consumer_timeout_s"])
    handshake_timeout_s: float = float(_RT["handshake_timeout_s"])
    write_timeout_s: float = float(_RT["write_timeout_s"])
    quarantine_s: float = float(_RT["quarantine_s"])
    max_inflight_mb: int = int(_RT["max_bytes_in_flight_per_peer"]) >> 20
    max_inflight_ranges: int = int(_RT["max_ranges_in_flight_per_peer"])
    writer_lanes: int = int(_RT["writer_lanes_per_peer"])
    # On CUDA, what a Mooncake submit waits for before its copies: "layer",
    # only the layer's own event, which OrbitKV waited for already (Mooncake's
    # wait on the caller's default stream redirected); "device", as Mooncake
    # does it: also everything queued on the legacy default stream.
    mooncake_submit_wait: str = "layer"
    trace: str | None = None
    # (host, port or None) pairs; ("*", None) allows any (trusts the network).
    allowed_prefill: tuple[tuple[str, int | None], ...] = tuple((h, None) for h in LOOPBACK)
    side_channel_key: bytes | None = field(default=None, repr=False)

    def prefill_allowed(self, host: str, port: int) -> bool:
        """Whether decode may send this request's handshake to the side
        channel ``host:port`` (a client names it in ``kv_transfer_params``)."""
        h = host.strip("[]").lower()
        return any(e == "*" or (e == h and p in (None, port)) for e, p in self.allowed_prefill)

    def nics_for(self, rank: int) -> list[str]:
        return list(self.rank_nics.get(rank, []))

    def side_channel_port_for(self, rank: int) -> int:
        return self.side_channel_port + rank

    @staticmethod
    def from_extra_config(extra: Mapping[str, Any] | None) -> PdConfig:
        cfg = dict(extra or {})
        unknown = sorted(k for k in cfg if k.startswith(PREFIX) and k not in KEYS)
        if unknown:
            raise ConfigError(f"unknown OrbitKV setting(s) {unknown}; known: {sorted(KEYS)}")
        default_host = os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
        bind_host = cfg.get("orbitkv.pd.mooncake.bind_host", default_host)
        if not isinstance(bind_host, str) or not bind_host or any(c.isspace() for c in bind_host):
            raise ConfigError(f"orbitkv.pd.mooncake.bind_host must be a host name or IP, got {bind_host!r}")
        rank_map = cfg.get("orbitkv.pd.mooncake.rank_map", {}) or {}
        if not isinstance(rank_map, Mapping):
            raise ConfigError(f"orbitkv.pd.mooncake.rank_map must map TP rank -> {{'nic': NAME}}, got {rank_map!r}")
        rank_nics: dict[int, list[str]] = {}
        for rank, entry in rank_map.items():
            try:
                r = int(rank)
            except (TypeError, ValueError):
                raise ConfigError(f"orbitkv.pd.mooncake.rank_map: rank {rank!r} is not an integer") from None
            if r < 0:
                raise ConfigError(f"orbitkv.pd.mooncake.rank_map: rank {r} is negative")
            if not isinstance(entry, Mapping) or set(entry) - {"nic"}:
                raise ConfigError(f"orbitkv.pd.mooncake.rank_map[{rank!r}] must be {{'nic': NAME}}, got {entry!r}")
            nic = entry.get("nic")
            nics = [nic] if isinstance(nic, str) else nic
            if not isinstance(nics, list) or not all(isinstance(n, str) and n for n in nics):
                raise ConfigError(f"orbitkv.pd.mooncake.rank_map[{rank!r}].nic must be a NIC name, got {nic!r}")
            rank_nics[r] = nics
        library = cfg.get("orbitkv.pd.mooncake.library")
        if library is not None and not isinstance(library, str):
            raise ConfigError(f"orbitkv.pd.mooncake.library must be a path, got {library!r}")
        sc_host = cfg.get("orbitkv.pd.side_channel_host", bind_host)
        if not isinstance(sc_host, str) or not sc_host:
            raise ConfigError(f"orbitkv.pd.side_channel_host must be a host, got {sc_host!r}")
        inflight = cfg.get("orbitkv.pd.max_inflight_mb", PdConfig.max_inflight_mb)
        if isinstance(inflight, bool) or not isinstance(inflight, int) or inflight < 1:
            raise ConfigError(f"orbitkv.pd.max_inflight_mb must be a positive integer, got {inflight!r}")
        ranges = cfg.get("orbitkv.pd.max_inflight_ranges", PdConfig.max_inflight_ranges)
        if isinstance(ranges, bool) or not isinstance(ranges, int) or ranges < 1:
            raise ConfigError(f"orbitkv.pd.max_inflight_ranges must be a positive integer, got {ranges!r}")
        lanes = cfg.get("orbitkv.pd.writer_lanes", PdConfig.writer_lanes)
        if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= 64:
            raise ConfigError(f"orbitkv.pd.writer_lanes must be an integer in 1..64, got {lanes!r}")
        submit_wait = cfg.get("orbitkv.pd.mooncake_submit_wait", PdConfig.mooncake_submit_wait)
        if submit_wait not in ("layer", "device"):
            raise ConfigError(f"orbitkv.pd.mooncake_submit_wait must be 'layer' or 'device', got {submit_wait!r}")
        trace = cfg.get("orbitkv.pd.trace")
        if trace is not None and not isinstance(trace, str):
            raise ConfigError(f"orbitkv.pd.trace must be a file path, got {trace!r}")
        allowed = cfg.get("orbitkv.pd.allowed_prefill", list(LOOPBACK))
        if isinstance(allowed, str):
            allowed = [allowed]
        if not isinstance(allowed, (list, tuple)):
            raise ConfigError(f"orbitkv.pd.allowed_prefill must be a list of 'host' or 'host:port', got {allowed!r}")
        allow = tuple(_allow_entry(a) for a in allowed)
        key = _side_channel_key(cfg.get("orbitkv.pd.side_channel_key_file"))
        return PdConfig(
            bind_host=bind_host,
            rank_nics=rank_nics,
            library=library,
            side_channel_host=sc_host,
            side_channel_port=_port(cfg, "orbitkv.pd.side_channel_port", PdConfig.side_channel_port),
            timeout_s=_positive_float(cfg, "orbitkv.pd.timeout_s", PdConfig.timeout_s),
            handshake_timeout_s=_positive_float(cfg, "orbitkv.pd.handshake_timeout_s", PdConfig.handshake_timeout_s),
            write_timeout_s=_positive_float(cfg, "orbitkv.pd.write_timeout_s", PdConfig.write_timeout_s),
            quarantine_s=_positive_float(cfg, "orbitkv.pd.quarantine_s", PdConfig.quarantine_s),
            max_inflight_mb=inflight,
            max_inflight_ranges=ranges,
            writer_lanes=lanes,
            mooncake_submit_wait=submit_wait,
            trace=trace,
            allowed_prefill=allow,
            side_channel_key=key,
        )


def _allow_entry(a: Any) -> tuple[str, int | None]:
    """``"*"``, ``"host"``, ``"host:port"``, ``"::1"`` or ``"[::1]:port"``."""
    bad = ConfigError(
        "orbitkv.pd.allowed_prefill entries are 'host' or 'host:port' (or '*' for any), " f"got {a!r}"
    )
    if not isinstance(a, str) or not a or any(c.isspace() for c in a):
        raise bad
    if a == "*":
        return ("*", None)
    if a.startswith("["):
        host, bracket, rest = a[1:].partition("]")
        if not bracket:
            raise bad
        port = rest[1:] if rest.startswith(":") else None
        if not host or (rest and port is None):
            raise bad
    elif a.count(":") == 1:
        host, _, port = a.partition(":")
    else:
        host, port = a, None  # a host name, or a bare IPv6 address
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise bad
    return (host.lower(), int(port) if port is not None else None)


def _side_channel_key(path: Any) -> bytes | None:
    """The deployment key: the file `side_channel_key_file` names, else the
    environment variable ORBITKV_SIDE_CHANNEL_KEY, else none."""
    if path is not None:
        if not isinstance(path, str) or not path:
            raise ConfigError(f"orbitkv.pd.side_channel_key_file must be a file path, got {path!r}")
        try:
            with open(path, "rb") as f:
                key = f.read().strip()
        except OSError as e:
            raise ConfigError(f"orbitkv.pd.side_channel_key_file: cannot read {path!r}: {e}") from None
    else:
        key = os.environ.get(KEY_ENV, "").strip().encode()
        if not key:
            return None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"the side channel key must be at least {MIN_KEY_BYTES} bytes, got {len(key)}")
    return key
