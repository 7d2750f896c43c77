"""Which vLLM releases the PdConnector runs on, checked when it starts.

The one place that knows vLLM versions (the per-version behaviour the
connector adapts to is feature-detected where it is used: see
docs/vllm-connector-notes.md, "vLLM versions"). Tested releases:
0.26.0 (CI: the whole suite, `requirements/vllm.txt`) and 0.32.0 (CI: the
P/D end-to-end suite, `requirements/vllm-newest/requirements.txt`). A release between them starts
with a warning (not run here); one outside the range is refused at start-up
with this module's error, unless ``ORBITKV_ALLOW_UNTESTED_VLLM=1`` (then a
warning), because the connector API moved between releases and a connector
that loads but mis-handles a hook can lose or misplace KV.
"""

from __future__ import annotations

import os
import re

# The releases the e2e suite passed on (docs/vllm-connector-notes.md).
TESTED = ("0.26.0", "0.32.0")
# The range a release may be in without the override: (major, minor) bounds,
# any patch release of the bounds included.
OLDEST = (0, 26)
NEWEST = (0, 32)
ALLOW_ENV = "ORBITKV_ALLOW_UNTESTED_VLLM"

_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


class UnsupportedVllmError(RuntimeError):
    """This vLLM release is outside the range OrbitKV supports."""


class SleepModeError(ValueError):
    """The engine was started with sleep mode, which OrbitKV does not follow."""


def check_no_sleep_mode(vllm_config: object) -> None:
    """Refuses an engine started with ``--enable-sleep-mode``: sleeping frees
    the KV cache and waking maps new memory behind the same addresses, while
    the Mooncake registrations and the addresses decode gave its prefills
    still name the old pages, so a write in flight or after wake-up would
    land in memory nobody owns. vLLM 0.33 asks connectors
    (``supports_sleep_mode``, answered ``False``); earlier releases do not,
    so the connector checks itself."""
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "enable_sleep_mode", False) is True:
        raise SleepModeError(
            "OrbitKV's PdConnector does not support sleep mode (--enable-sleep-mode): the KV memory "
            "registered for P/D writes would be remapped under in-flight transfers. Start the engine "
            "without sleep mode"
        )


def _parse(version: str) -> tuple[int, int, int] | None:
    m = _VERSION.match(version)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def supported_range() -> str:
    return f"{OLDEST[0]}.{OLDEST[1]}.x to {NEWEST[0]}.{NEWEST[1]}.x (tested: {', '.join(TESTED)})"


def check_vllm_version(version: str, env: dict[str, str] | None = None) -> str | None:
    """``None`` for a tested release; a warning for one in the range that was
    not run here, or for any other release when ``ORBITKV_ALLOW_UNTESTED_VLLM=1``;
    raises :class:`UnsupportedVllmError` otherwise (the message names the
    range and the override)."""
    allow = (os.environ if env is None else env).get(ALLOW_ENV)
    release = version.split("+")[0].strip()
    if release in TESTED:
        return None
    parsed = _parse(release)
    if parsed is not None and OLDEST <= parsed[:2] <= NEWEST:
        return (
            f"vLLM {version} is inside OrbitKV's supported range {supported_range()} but was not run "
            "here; run the e2e tests against it (docs/vllm-connector-notes.md)"
        )
    if allow == "1":
        return f"vLLM {version} is outside OrbitKV's supported range {supported_range()}; {ALLOW_ENV}=1 allows it"
    raise UnsupportedVllmError(
        f"vLLM {version} is not supported by OrbitKV's PdConnector: supported {supported_range()}. "
        f"Install a supported vLLM, or set {ALLOW_ENV}=1 to start anyway (untested: the connector API "
        "differs between releases)"
    )


def installed_vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))
