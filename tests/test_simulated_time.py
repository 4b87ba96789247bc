"""The simulator's time model, and the acceptance of cost-aware promotion on the demo's
traces: with a slow lower tier (200 ms, 50 MB/s) no request's simulated time to first
token is worse than recomputing its prompt, and the mean beats promoting everything."""

from __future__ import annotations

import dataclasses
import io
import statistics
from pathlib import Path

import pytest

from kvtiers.config import PromotionConfig, StackConfig, load_stack_config
from kvtiers.config.examples import example_path
from kvtiers.engine.demo import run_demo
from kvtiers.engine.simulator import RequestReport, SimulatedEngine, TierTime, TimeModel
from kvtiers.engine.workload import WorkloadSpec, conversation_requests
from kvtiers.errors import ConfigError
from kvtiers.stack.builder import load_stack

SLOW = {"load_latency_s": 0.2, "load_bytes_per_s": "50MB"}


def config(root: Path, rate: float | None) -> StackConfig:
    demo = example_path("demo")
    assert demo is not None
    stack = load_stack_config({"tiers": [
        {"kind": "cpu", "capacity": "16MiB", "policy": "arc"},
        {"kind": "file", "name": "s3", "root": str(root), **SLOW},
    ]})
    stack = dataclasses.replace(stack, model=load_stack_config(demo).model)
    if rate is not None:
        stack = dataclasses.replace(stack, promotion=PromotionConfig(prefill_tokens_per_s=rate))
    return stack


def replay(stack_config: StackConfig, time_model: TimeModel) -> list[RequestReport]:
    """The demo's trace, cold and then after a restart."""
    reports = []
    requests = conversation_requests(WorkloadSpec())
    for _ in range(2):
        with load_stack(stack_config) as stack:
            engine = SimulatedEngine(stack, num_gpu_blocks=1024, time_model=time_model)
            try:
                reports += [engine.run_request(r.req_id, r.token_ids) for r in requests]
            finally:
                engine.shutdown()
    assert sum(r.verification_failures for r in reports) == 0
    return reports


def test_tier_time_is_latency_plus_bytes_over_bandwidth() -> None:
    model = TimeModel(2000.0, {"s3": TierTime(0.2, 50e6)})
    assert model.transfer_s("s3", 5_000_000) == pytest.approx(0.3)
    assert model.transfer_s("s3", 0) == 0
    assert model.transfer_s("file", 5_000_000) == 0  # not modelled: instant
    assert model.prefill_s(1000) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="bytes_per_s"):
        TierTime(0.1, 0.0)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        TimeModel(0.0)


def test_the_time_model_comes_from_the_stack_file(tmp_path: Path) -> None:
    model = TimeModel.from_stack(config(tmp_path, 2000.0))
    assert model is not None
    assert model.prefill_tokens_per_s == 2000
    assert model.tiers == {"s3": TierTime(0.2, 50e6)}
    assert TimeModel.from_stack(config(tmp_path, None)) is None
    assert TimeModel.from_stack(config(tmp_path, None), 500.0) is not None


def test_cost_aware_promotion_never_loses_to_recompute_and_beats_promote_all(
    tmp_path: Path,
) -> None:
    # At 5000 tokens/s a chunk moves faster than it computes, but the 200 ms latency is
    # paid back only by long runs: promoting everything loses to recomputing often.
    rate = 5000.0
    time_model = TimeModel(rate, {"s3": TierTime(0.2, 50e6)})
    everything = replay(config(tmp_path / "all", None), time_model)
    cost = replay(config(tmp_path / "cost", rate), time_model)
    assert [r.req_id for r in cost] == [r.req_id for r in everything]
    assert any(r.ttft_s > r.recompute_s for r in everything)  # the case is not trivial
    assert all(r.ttft_s <= r.recompute_s for r in cost)
    assert statistics.mean(r.ttft_s for r in cost) < statistics.mean(
        r.ttft_s for r in everything)
    # Bytes per tier are reported: cascades into s3 when cold, promotions out of it.
    assert sum(r.written_bytes["s3"] for r in everything) > 0
    assert sum(r.promoted_bytes["s3"] for r in everything) > 0
    assert all(r.written_bytes["cpu"] == r.stored_bytes for r in cost)


def test_a_prefill_slow_enough_promotes_long_prefixes_from_the_slow_tier(
    tmp_path: Path,
) -> None:
    rate = 1000.0
    time_model = TimeModel(rate, {"s3": TierTime(0.2, 50e6)})
    cost = replay(config(tmp_path, rate), time_model)
    assert sum(r.promoted_bytes["s3"] for r in cost) > 0
    assert all(r.ttft_s <= r.recompute_s for r in cost)


def test_the_demo_reports_simulated_ttft_with_the_cost_model_on(tmp_path: Path) -> None:
    out = io.StringIO()
    stack = load_stack_config(example_path("cpu-slow-s3"))  # type: ignore[arg-type]
    assert stack.promotion is not None
    run_demo("cpu-slow-s3", out_dir=tmp_path / "demo", plot=None, out=out,
             show_progress=False,
             workload=WorkloadSpec(conversations=4, system_prompts=2, turns=2))
    text = out.getvalue()
    assert "promotion: cost-aware, prefill 2000 tokens/s" in text
    assert text.count("simulated TTFT s: mean") == 2
    assert "0 requests slower than recompute" in text


def test_promotion_section_and_load_seeds_are_checked() -> None:
    tiers: list[dict[str, object]] = [{"kind": "cpu", "capacity": "1MiB"}]
    with pytest.raises(ConfigError) as error:
        load_stack_config({"tiers": tiers, "promotion": {"prefill_tokens_per_s": 0}})
    assert error.value.path == "promotion.prefill_tokens_per_s"
    with pytest.raises(ConfigError) as error:
        load_stack_config({"tiers": tiers, "promotion": {}})
    assert error.value.path == "promotion.prefill_tokens_per_s"
    with pytest.raises(ConfigError, match="unknown key 'load_latency_s'") as error:
        load_stack_config({"tiers": [{**tiers[0], "load_latency_s": 0.1}]})
    assert error.value.path == "tiers[0].load_latency_s"
    with pytest.raises(ConfigError, match="primary is never promoted from") as error:
        load_stack_config({"tiers": [{"kind": "file", "root": "/tmp/x", "gds": True,
                                      "load_bytes_per_s": "1GB"}]})
    assert error.value.path == "tiers[0].load_bytes_per_s"
    with pytest.raises(ConfigError) as error:
        load_stack_config({"tiers": [*tiers, {"kind": "file", "root": "/tmp/x",
                                              "load_bytes_per_s": "fast"}]})
    assert error.value.path == "tiers[1].load_bytes_per_s"
