"""kvtiers' records in the engine's log at the engine's level; start and stop lines."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtiers.logs import ROOT, join_engine_log
from kvtiers.stack.builder import load_stack

MODEL = {"name": "logs/model",
         "groups": [{"tokens_per_block": 16, "num_layers": 2, "page_bytes": "2KiB"}]}

#: Under vLLM: configure logging as vLLM's processes do, load kvtiers' vLLM package (as
#: vLLM does), build and stop a stack, and log a DEBUG and a WARNING record of kvtiers.
UNDER_VLLM = f"""
import logging, sys, tempfile
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())  # what vLLM's processes do first
import kvtiers.integrations.vllm
from kvtiers.stack.builder import load_stack
root = tempfile.mkdtemp()
with load_stack({{"tiers": [{{"kind": "cpu", "capacity": "1MiB"}},
                            {{"kind": "file", "root": root}}], "model": {MODEL!r}}}):
    pass
logging.getLogger("kvtiers.some.module").debug("a debug record")
logging.getLogger("kvtiers.some.module").warning("a warning record")
"""


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.fixture
def clean_kvtiers_logger() -> Iterator[logging.Logger]:
    """The ``kvtiers`` logger as this test found it, restored afterwards."""
    ours = logging.getLogger(ROOT)
    saved = (list(ours.handlers), ours.level, ours.propagate)
    for handler in saved[0]:
        ours.removeHandler(handler)
    yield ours
    for handler in list(ours.handlers):
        ours.removeHandler(handler)
    for handler in saved[0]:
        ours.addHandler(handler)
    ours.setLevel(saved[1])
    ours.propagate = saved[2]


@pytest.mark.skipif(not _vllm_installed(), reason="vLLM is not installed here")
@pytest.mark.parametrize("level", ["INFO", "WARNING"])
def test_records_reach_vllms_log_at_its_level(level: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", UNDER_VLLM], capture_output=True, text=True, timeout=300,
        env={**os.environ, "VLLM_LOGGING_LEVEL": level, "VLLM_CONFIGURE_LOGGING": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    started = [line for line in lines if "kvtiers: tier 1 file started: file " in line]
    stopped = [line for line in lines if "kvtiers: tier file stopped: chunks stored 0" in line]
    warned = [line for line in lines if line.endswith("a warning record")]
    debugged = [line for line in lines if line.endswith("a debug record")]
    # Formatted by vLLM's handler: its level name and the source file precede the message.
    assert len(warned) == 1 and " WARNING " in warned[0] and "[<string>:" in warned[0]
    if level == "WARNING":
        assert (started, stopped, debugged) == ([], [], [])
        return
    assert len(started) == 1 and " INFO " in started[0], lines
    assert "; namespace logs__model-" in started[0]
    assert len(stopped) == 1 and "failed 0, corrupt 0" in stopped[0]
    assert any("kvtiers: stack stopped: hits 0, misses 0" in line for line in lines)
    assert debugged == []
    # Once, in vLLM's format, never a second time through the root logger.
    assert "a warning record" not in result.stderr


def test_sglangs_root_configuration_gets_the_lines_at_its_level(
    tmp_path: Path, clean_kvtiers_logger: logging.Logger,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("sglang")
    from sglang.srt.utils.common import configure_logger

    root_logger = logging.getLogger()
    saved = (list(root_logger.handlers), root_logger.level)
    try:
        for level, expected in (("info", 2), ("warning", 0)):
            configure_logger(SimpleNamespace(log_level=level))
            # SGLang's own logger has no handler: joining it changes nothing.
            assert join_engine_log("sglang") is False
            caplog.clear()
            root_logger.addHandler(caplog.handler)
            with load_stack({"tiers": [{"kind": "cpu", "capacity": "1MiB"},
                                       {"kind": "file", "root": str(tmp_path / level)}],
                             "model": MODEL}):
                pass
            lines = [r.getMessage() for r in caplog.records
                     if r.getMessage().startswith("kvtiers: tier ")
                     and (" started: " in r.getMessage() or " stopped: " in r.getMessage())
                     and "file" in r.getMessage()]
            assert len(lines) == expected, lines
            root_logger.removeHandler(caplog.handler)
    finally:
        logging.basicConfig(force=True)
        for handler in list(root_logger.handlers):
            root_logger.removeHandler(handler)
        for handler in saved[0]:
            root_logger.addHandler(handler)
        root_logger.setLevel(saved[1])


def test_an_application_configuration_is_kept(clean_kvtiers_logger: logging.Logger) -> None:
    engine = logging.getLogger("an-engine")
    engine.addHandler(logging.NullHandler())
    try:
        mine = logging.NullHandler()
        clean_kvtiers_logger.addHandler(mine)
        assert join_engine_log("an-engine") is False
        assert clean_kvtiers_logger.handlers == [mine]
        clean_kvtiers_logger.removeHandler(mine)
        # Joined once; a second call is a no-op.
        assert join_engine_log("an-engine") is True
        assert join_engine_log("an-engine") is False
        assert len(clean_kvtiers_logger.handlers) == 1
    finally:
        engine.handlers.clear()


def test_the_stop_summary_counts_each_tier(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvtiers.engine.simulator import SimulatedEngine
    from kvtiers.engine.workload import WorkloadSpec, conversation_requests

    caplog.set_level(logging.INFO, logger=ROOT)
    stack = load_stack({"tiers": [{"kind": "cpu", "capacity": "2MiB"},
                                  {"kind": "file", "root": str(tmp_path)}],
                        "model": MODEL})
    engine = SimulatedEngine(stack, num_gpu_blocks=64)
    spec = WorkloadSpec(conversations=2, system_prompts=1, turns=1, system_tokens=(200, 260))
    for request in conversation_requests(spec):
        engine.run_request(request.req_id, request.token_ids)
    engine.shutdown()
    stack.shutdown()
    stats = stack.manager.get_stats()
    stack.shutdown()  # idempotent: no second summary
    messages = [r.getMessage() for r in caplog.records]
    (file_line,) = [m for m in messages if m.startswith("kvtiers: tier file stopped")]
    assert stats["file.stores"] > 0
    assert file_line == (f"kvtiers: tier file stopped: chunks stored {int(stats['file.stores']):,}"
                         f", loaded {int(stats['file.loads']):,}, failed 0, corrupt 0")
    assert sum(m.startswith("kvtiers: stack stopped") for m in messages) == 1
