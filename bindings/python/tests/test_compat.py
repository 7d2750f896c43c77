"""The supported vLLM range, checked when the PdConnector starts
(`orbitkv.vllm.compat`): tested releases start quietly, untested ones in the
range with a warning, others are refused with the range and the override in
the message, unless ORBITKV_ALLOW_UNTESTED_VLLM=1."""

from __future__ import annotations

import pytest

from orbitkv.vllm import compat


@pytest.mark.parametrize("version", ["0.26.0", "0.32.0", "0.32.0+cpu", "0.26.0+cu130"])
def test_tested_releases_start_quietly(version: str) -> None:
    assert compat.check_vllm_version(version, env={}) is None


@pytest.mark.parametrize("version", ["0.29.1", "0.26.1", "0.32.2", "0.30.0rc1.dev12+g1234"])
def test_untested_releases_in_the_range_start_with_a_warning(version: str) -> None:
    msg = compat.check_vllm_version(version, env={})
    assert msg is not None and version in msg and "not run" in msg


@pytest.mark.parametrize("version", ["0.25.2", "0.33.0", "1.0.0", "0.11.0", "unknown", ""])
def test_releases_outside_the_range_are_refused_with_the_range_and_the_override(version: str) -> None:
    with pytest.raises(compat.UnsupportedVllmError) as e:
        compat.check_vllm_version(version, env={})
    text = str(e.value)
    assert "0.26.x to 0.32.x" in text and compat.ALLOW_ENV in text


def test_the_override_turns_the_refusal_into_a_warning() -> None:
    msg = compat.check_vllm_version("0.33.0", env={compat.ALLOW_ENV: "1"})
    assert msg is not None and "outside" in msg
    with pytest.raises(compat.UnsupportedVllmError):
        compat.check_vllm_version("0.33.0", env={compat.ALLOW_ENV: "yes"})  # only "1" allows


def test_the_connector_refuses_an_unsupported_vllm_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through PdConnector's constructor: it checks before it reads its
    configuration or starts anything."""
    pytest.importorskip("vllm")
    from orbitkv.vllm import pd

    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.25.0")
    monkeypatch.delenv(compat.ALLOW_ENV, raising=False)
    monkeypatch.setattr(pd.KVConnectorBase_V1, "__init__", lambda self, *a, **k: None)
    with pytest.raises(compat.UnsupportedVllmError, match=r"0\.25\.0"):
        pd.PdConnector(object(), pd.KVConnectorRole.SCHEDULER)  # type: ignore[arg-type]


def test_the_installed_vllm_is_a_tested_release() -> None:
    """CI's pinned vLLM is one the connector starts quietly on."""
    pytest.importorskip("vllm")
    assert compat.check_vllm_version(compat.installed_vllm_version(), env={}) is None


def test_the_connector_refuses_sleep_mode_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sleep mode remaps the KV memory that Mooncake registered and decode
    handed out: refused with a clear error on every release (0.33 also asks
    ``supports_sleep_mode``, answered False); without it the check passes."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from orbitkv.vllm import pd

    assert pd.PdConnector.supports_sleep_mode(None) is False
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(pd.KVConnectorBase_V1, "__init__", lambda self, *a, **k: None)
    sleeping = SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True))
    with pytest.raises(compat.SleepModeError, match="sleep mode"):
        pd.PdConnector(sleeping, pd.KVConnectorRole.SCHEDULER)  # type: ignore[arg-type]
    compat.check_no_sleep_mode(SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=False)))
    compat.check_no_sleep_mode(SimpleNamespace(model_config=None))
