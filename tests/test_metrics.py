"""A stack with a ``metrics:`` section serves its stats in Prometheus text format."""

from __future__ import annotations

import urllib.request

from kvtiers.core.manager import ScheduleEndContext
from kvtiers.engine.simulator import SimulatedEngine
from kvtiers.engine.workload import WorkloadSpec, conversation_requests
from kvtiers.stack.builder import load_stack


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_stats_are_exported_per_tier() -> None:
    stack = load_stack({
        "tiers": [{"kind": "cpu", "name": "hot", "capacity": "1MiB"}],
        "model": {"name": "m", "groups": [{"tokens_per_block": 16, "num_layers": 1,
                                           "page_bytes": "4KiB"}]},
        "metrics": {"port": 0, "refresh_s": 0},
    })
    try:
        assert stack.metrics is not None
        before = _scrape(stack.metrics.port)
        assert before['kvtiers_stores_total{tier="hot"}'] == 0
        engine = SimulatedEngine(stack, num_gpu_blocks=64)
        spec = WorkloadSpec(conversations=2, system_prompts=1, turns=1, system_tokens=(64, 64))
        for request in conversation_requests(spec):
            engine.run_request(request.req_id, request.token_ids)
        engine.shutdown()
        after = _scrape(stack.metrics.port)
        stats = stack.manager.get_stats()
        assert after['kvtiers_stores_total{tier="hot"}'] == stats["hot.stores"] > 0
        assert after['kvtiers_hits_total{tier="stack"}'] == stats["hits"] > 0
        assert after['kvtiers_capacity_bytes{tier="hot"}'] == 1 << 20
    finally:
        stack.shutdown()
    stack.shutdown()


def test_without_metrics_no_step_pays_for_a_stats_snapshot() -> None:
    stack = load_stack({
        "tiers": [{"kind": "cpu", "capacity": "1MiB"}],
        "model": {"name": "m", "groups": [{"tokens_per_block": 16, "num_layers": 1,
                                           "page_bytes": "4KiB"}]},
    })
    calls = []
    real = stack.manager.get_stats
    stack.manager.get_stats = lambda: calls.append(1) or real()  # type: ignore[method-assign]
    stack.manager.on_schedule_end(ScheduleEndContext())
    stack.shutdown()
    assert calls == [] and stack.manager.stats_snapshot == {}
