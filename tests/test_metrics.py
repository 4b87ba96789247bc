"""A stack with a ``metrics:`` section serves its stats by Prometheus conventions: names
pass prometheus-client's own parser and a naming check, stack-level and per-tier series
never share a name (so ``sum()`` does not double count), latencies are histograms, enums
are labels, and a failed start is one clear error that leaves nothing running."""

from __future__ import annotations

import re
import socket
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtiers.config.stack import DEFAULT_METRICS_PORT, load_stack_config
from kvtiers.core.manager import ScheduleEndContext
from kvtiers.engine.simulator import SimulatedEngine
from kvtiers.engine.workload import WorkloadSpec, conversation_requests
from kvtiers.errors import ConfigError
from kvtiers.stack.builder import load_stack
from kvtiers.stack.metrics_catalog import STACK, TIER
from kvtiers.tiers.file import io as file_io

MODEL = {"name": "m", "tokens_per_hash": 16, "blocks_per_chunk": 2,
         "groups": [{"tokens_per_block": 16, "num_layers": 1, "page_bytes": "4KiB"}]}
WORKLOAD = WorkloadSpec(conversations=3, system_prompts=1, turns=2, system_tokens=(256, 320))
# Well-known ports a kvtiers default must not take: Prometheus and its usual exporters,
# DCGM-exporter, vLLM's server.
TAKEN = {8000, 8080, 9090, 9091, 9093, 9100, 9400, 9464}


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text: str = response.read().decode()
    return text


def _families(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(families: dict[str, Any], sample_name: str, **labels: str) -> float:
    for family in families.values():
        for sample in family.samples:
            if sample.name == sample_name and sample.labels == labels:
                return float(sample.value)
    raise AssertionError(f"no sample {sample_name}{labels}")


def _run_workload(stack: Any) -> None:
    """The workload twice, the CPU tier emptied in between: the second pass promotes."""
    engine = SimulatedEngine(stack, num_gpu_blocks=128)
    for request in conversation_requests(WORKLOAD):
        engine.run_request(request.req_id, request.token_ids)
    stack.manager.reset_cache()
    for request in conversation_requests(WORKLOAD):
        engine.run_request(request.req_id, request.token_ids)
    stack.manager.wait_idle()
    stack.manager.refresh_stats_snapshot()
    engine.shutdown()


@pytest.fixture
def scraped(tmp_path: Path) -> tuple[dict[str, Any], dict[str, float], str]:
    stack = load_stack({
        "tiers": [{"kind": "cpu", "name": "hot", "capacity": "1MiB"},
                  {"kind": "file", "name": "disk", "root": str(tmp_path / "files")}],
        "model": MODEL,
        "metrics": {"port": 0, "refresh_s": 0},
    })
    try:
        assert stack.metrics is not None
        _run_workload(stack)
        text = _scrape(stack.metrics.port)
        stats = dict(stack.manager.get_stats())
    finally:
        stack.shutdown()
    return _families(text), stats, text


def test_names_follow_prometheus_conventions(scraped: Any) -> None:
    families, _stats, text = scraped
    assert families, "nothing exported"
    for name, family in families.items():
        assert re.fullmatch(r"kvtiers_(stack|tier|promotion|cascade|worker|build)_[a-z0-9_]+",
                            name)
        assert family.documentation and family.documentation != name, f"{name}: no HELP"
        assert re.search(r" Unit: [a-z ()]+\.$", family.documentation), f"{name}: no unit"
        assert not re.search(r"_s(_|$)", name), f"{name}: unit must be _seconds"
        assert "_total" not in name, f"{name}: the parser strips _total from counter families"
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        for sample in family.samples:
            for label, value in sample.labels.items():
                assert re.fullmatch(r"[a-z_]+", label)
                assert not re.fullmatch(r"-?\d+(\.\d+)?", value) or label == "le", (
                    f"{sample.name}: label {label}={value!r} is a number, not an enum value")
    assert "# HELP kvtiers_tier_lookups_total Lookups this tier answered" in text


def test_sum_over_a_counter_does_not_double_count(scraped: Any) -> None:
    families, stats, _text = scraped
    lookups = families["kvtiers_stack_lookups"]
    assert {s.labels.get("tier") for s in lookups.samples} == {None}
    assert sum(s.value for s in lookups.samples if s.name.endswith("_total")) == (
        stats["hits"] + stats["misses"])
    tier_lookups = families["kvtiers_tier_lookups"]
    assert {s.labels["tier"] for s in tier_lookups.samples} == {"hot", "disk"}
    assert _value(families, "kvtiers_tier_lookups_total", tier="hot", result="hit") == (
        stats["hot.hits"])
    promoted = sum(s.value for s in families["kvtiers_tier_promoted_chunks"].samples
                   if s.name.endswith("_total"))
    assert promoted == _value(families, "kvtiers_stack_promotions_total", outcome="done") > 0


def test_enums_are_labels(scraped: Any) -> None:
    families, _stats, _text = scraped
    io = families["kvtiers_tier_io_info"]
    assert [(s.labels["tier"], s.labels["backend"], s.value) for s in io.samples] == [
        ("disk", "posix", 1.0)]


def test_latencies_are_histograms(scraped: Any) -> None:
    families, stats, _text = scraped
    promotion = families["kvtiers_promotion_latency_seconds"]
    assert promotion.type == "histogram"
    count = _value(families, "kvtiers_promotion_latency_seconds_count", tier="disk")
    assert count > 0
    assert _value(families, "kvtiers_promotion_latency_seconds_bucket", tier="disk",
                  le="+Inf") == count
    assert _value(families, "kvtiers_promotion_latency_seconds_sum", tier="disk") == (
        pytest.approx(stats["disk.promoted_s"]))
    assert _value(families, "kvtiers_cascade_latency_seconds_count", tier="disk") > 0
    assert _value(families, "kvtiers_worker_transfer_latency_seconds_count",
                  direction="store") > 0


def test_the_shipped_tiers_report_only_catalogued_stats(scraped: Any) -> None:
    _, stats, _text = scraped
    for name in stats:
        tier, _, stat = name.rpartition(".")
        assert stat in (TIER if tier else STACK), f"{name}: add it to metrics_catalog"


def test_io_backend_codes_match_the_file_tier() -> None:
    from kvtiers.stack.metrics_catalog import IO_BACKENDS

    assert IO_BACKENDS == {file_io.IO_POSIX: "posix", file_io.IO_POSIX_DIRECT: "posix_o_direct",
                           file_io.IO_KVIKIO: "kvikio"}


def test_the_default_port_is_clear_of_well_known_exporters() -> None:
    config = load_stack_config({"tiers": [{"kind": "cpu", "capacity": "1MiB"}], "metrics": {}})
    assert config.metrics is not None
    assert config.metrics.port == DEFAULT_METRICS_PORT
    assert DEFAULT_METRICS_PORT not in TAKEN and not 9100 <= DEFAULT_METRICS_PORT <= 9999
    assert config.metrics.addr == "127.0.0.1"


def test_a_taken_port_is_one_clear_error_and_shuts_the_tiers_down(tmp_path: Path) -> None:
    """The port taken after the start-time checks passed (a race they cannot close): the
    exporter's own error, and every tier built is released. (The checks' own report of a
    port taken already is in tests/test_cli_check.py.)"""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    managers: list[Any] = []
    import kvtiers.stack.builder as builder

    real = builder.TieredManager

    def recording(tiers: Any, **options: Any) -> Any:
        managers.append(real(tiers, **options))
        return managers[-1]

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(builder, "TieredManager", recording)
            patch.setattr(builder, "check_before_build", lambda config, identity: None)
            with pytest.raises(ConfigError, match=rf"metrics\.port: the metrics exporter cannot "
                               rf"listen on 127\.0\.0\.1:{port}: .*choose another metrics\.port"):
                load_stack({"tiers": [{"kind": "cpu", "capacity": "1MiB"},
                                      {"kind": "file", "root": str(tmp_path / "f")}],
                            "model": MODEL, "metrics": {"port": port}})
    finally:
        holder.close()
    # The stack that was built has been shut down: every tier released.
    assert len(managers) == 1 and managers[0]._closed


def test_without_metrics_no_step_pays_for_a_stats_snapshot() -> None:
    stack = load_stack({"tiers": [{"kind": "cpu", "capacity": "1MiB"}], "model": MODEL})
    calls = []
    real = stack.manager.get_stats
    def counted() -> Mapping[str, float]:
        calls.append(1)
        return real()

    stack.manager.get_stats = counted  # type: ignore[method-assign]
    stack.manager.on_schedule_end(ScheduleEndContext())
    # (The stop summary may read the stats once; no step does.)
    assert calls == [] and stack.manager.stats_snapshot == {}
    assert stack.manager.latency is None
    stack.shutdown()


def test_a_missing_prometheus_client_is_named_before_anything_is_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "prometheus_client", None)
    with pytest.raises(ConfigError, match=r"pip install 'kvtiers\[metrics\]'") as info:
        load_stack({"tiers": [{"kind": "cpu", "capacity": "1MiB"},
                              {"kind": "file", "root": str(tmp_path / "f")}],
                    "model": MODEL, "metrics": {"port": 0}})
    assert info.value.path == "metrics"
    assert not (tmp_path / "f").exists()


def test_every_series_is_there_from_the_start_with_build_info(tmp_path: Path) -> None:
    """Before any request: every stack series, every tier's, and every latency histogram
    a stack can fill are exported (zero), so absent() and increase() alerts hold."""
    stack = load_stack({"tiers": [{"kind": "cpu", "capacity": "1MiB"},
                                  {"kind": "file", "root": str(tmp_path / "f")}],
                        "model": MODEL, "metrics": {"port": 0}})
    try:
        assert stack.metrics is not None
        text = _scrape(stack.metrics.port)
    finally:
        stack.shutdown()
    families = _families(text)
    from kvtiers import __version__
    from kvtiers.stack.metrics_catalog import STACK

    for spec in STACK.values():
        samples = families[spec.name].samples
        assert any(s.labels.items() >= spec.labels.items() for s in samples), spec
    (info,) = families["kvtiers_build_info"].samples
    assert (info.labels["version"], info.value) == (__version__, 1.0)
    for name, label, values in (("kvtiers_promotion_latency_seconds", "tier", {"file"}),
                                ("kvtiers_cascade_latency_seconds", "tier", {"file"}),
                                ("kvtiers_worker_transfer_latency_seconds", "direction",
                                 {"load", "store"})):
        counts = [s for s in families[name].samples if s.name == f"{name}_count"]
        assert {s.labels[label] for s in counts} == values, name
        assert all(s.value == 0 for s in counts)
    stores = {(s.labels["tier"], s.labels["outcome"]): s.value
              for s in families["kvtiers_tier_stores"].samples if s.name.endswith("_total")}
    assert stores == {("cpu", "done"): 0, ("cpu", "failed"): 0,
                      ("file", "done"): 0, ("file", "failed"): 0}
