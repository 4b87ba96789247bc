"""The vLLM version check: the integration loads only under a supported vLLM.

Runs in every test environment (vLLM 0.33.0 in ``.venv``, 0.34.0 in ``.venv-vllm34``, 0.32.0
in ``.venv-engine``): the
installed release passes; an out-of-range ``vllm.__version__`` makes loading
``kvtiers.integrations.vllm`` (what vLLM does for either route) fail with one line.
"""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
import vllm

import kvtiers.integrations
from kvtiers.errors import UnsupportedVersionError
from kvtiers.integrations.vllm.version import SUPPORTED_SPECIFIER, check_vllm_version, release


@pytest.fixture(autouse=True)
def checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate as users meet it (``make vllm-compat`` runs these tests unchecked)."""
    monkeypatch.delenv("KVTIERS_VLLM_UNCHECKED", raising=False)


def test_the_installed_vllm_is_supported() -> None:
    assert check_vllm_version() == vllm.__version__


@pytest.mark.parametrize(
    "version", ["0.32.0", "0.32.3", "0.33.0", "0.33.1.dev7+gabc123", "0.33", "0.34.0", "0.34.2"]
)
def test_supported_releases_pass(version: str) -> None:
    assert check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.30.0", "0.31.2", "0.35.0", "1.0.0", "unknown", ""])
def test_other_versions_get_one_line_naming_version_and_range(version: str) -> None:
    with pytest.raises(UnsupportedVersionError) as info:
        check_vllm_version(version)
    message = str(info.value)
    assert "\n" not in message
    assert f"vLLM {version}:" in message
    assert SUPPORTED_SPECIFIER in message
    assert "docs/vllm.md" in message
    assert "make vllm-compat VLLM=" in message


def test_an_unchecked_environment_loads_an_unsupported_release_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What ``make vllm-compat`` sets, so the class-level tests run on a newer release."""
    monkeypatch.setenv("KVTIERS_VLLM_UNCHECKED", "1")
    with caplog.at_level(logging.WARNING, logger="kvtiers.integrations.vllm.version"):
        assert check_vllm_version("0.35.0") == "0.35.0"
    assert [r.getMessage().count("\n") for r in caplog.records] == [0]
    assert "vLLM 0.35.0" in caplog.text and "never serving" in caplog.text
    monkeypatch.setenv("KVTIERS_VLLM_UNCHECKED", "yes")  # only "1" unlocks it
    with pytest.raises(UnsupportedVersionError):
        check_vllm_version("0.35.0")


def test_release_reads_the_leading_numbers() -> None:
    assert release("0.33.1.dev7+gabc123") == (0, 33, 1)
    assert release("0.32") == (0, 32, 0)
    assert release("v0.32.0") is None


def test_loading_the_integration_under_an_unsupported_vllm_fails_at_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.30.0")
    # A fresh import of the package, as vLLM's factories do; monkeypatch puts the loaded
    # module back afterwards.
    monkeypatch.delitem(sys.modules, "kvtiers.integrations.vllm")
    monkeypatch.delattr(kvtiers.integrations, "vllm")
    with pytest.raises(UnsupportedVersionError, match=r"this environment has vLLM 0\.30\.0"):
        importlib.import_module("kvtiers.integrations.vllm")
