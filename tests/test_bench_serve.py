"""``benchmarks/bench_serve.py`` without a server: its trace, its statistics (targets paired
within rounds, outputs against the baseline, the break-even table), the py-spy sample
categories and the report; and :func:`kvtiers.testing.serve.scrape` on a real HTTP
endpoint. The servers themselves run in ``make bench-serve``.
"""

from __future__ import annotations

import http.server
import importlib.util
import itertools
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvtiers.testing.serve import kv_transfer_config, scrape

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"


def _load() -> ModuleType:
    # The script imports its sibling (machine) as a script run does.
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("bench_serve", BENCHMARKS / "bench_serve.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = module
    spec.loader.exec_module(module)
    return module


bench = _load()

GROUPS = {
    "prefix-2048": {"first": [True, False, True, False], "lengths": [2048] * 4},
    "ladder": {"first": [True, True, True], "lengths": [64, 256, 2048]},
    "multiturn": {"first": [False, False], "lengths": [1216, 1472]},
}


def _record(side: str, phase: str, r: int, first: float, rest: float, ladder: list[float],
            tpot: float, texts: str = "same") -> dict[str, Any]:
    def group(ttft: list[float], n: int) -> dict[str, Any]:
        return {"ttft": [t / 1000 for t in ttft], "tpot": [tpot / 1000] * n,
                "texts": [f"{texts}-{i}" for i in range(n)], "request_throughput": 1.0}

    return {"side": side, "phase": phase, "round": r, "wall_s": 1.0,
            "groups": {"prefix-2048": group([first, rest, first, rest], 4),
                       "ladder": group(ladder, 3), "multiturn": group([500, 500], 2)},
            "counters": {}, "cpu_s": {"EngineCore": 1.0, "Worker": 2.0}}


def _results() -> dict[str, Any]:
    records = []
    for r, scale in ((0, 1.0), (1, 2.0)):
        records += [
            _record("baseline", "cold", r, 2000 * scale, 400, [100, 500, 2000], 40),
            _record("baseline", "warm", r, 100 * scale, 100, [30, 30, 30], 40),
            _record("baseline", "restart", r, 2000 * scale, 400, [100, 500, 2000], 40),
            _record("kvtiers", "cold", r, 2000 * scale, 400, [100, 500, 2000], 44 * scale),
            _record("kvtiers", "restart", r, 200 * scale, 100, [150, 200, 300], 40,
                    texts="same" if r == 0 else "other"),
            _record("kvtiers", "second-seaweedfs", r, 600 * scale, 100, [300, 600, 500], 40),
        ]
    return {"groups": GROUPS, "records": records}


def test_multiturn_trace_repeats_each_conversation_so_far(tmp_path: Path) -> None:
    plan = bench.QUICK
    path = tmp_path / "trace.jsonl"
    bench.multiturn_trace(path, plan)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == plan.conversations * plan.turns
    assert [line["timestamp"] for line in lines] == sorted(line["timestamp"] for line in lines)
    by_start: dict[float, list[dict[str, Any]]] = {}
    for line in lines:
        assert line["input_length"] == 64 * len(line["hash_ids"])
        assert line["hash_ids"][:16] == list(range(16)), "every turn starts with the system"
        by_start.setdefault(line["timestamp"] % 4.0, []).append(line)
    for turns in by_start.values():
        for before, after in itertools.pairwise(turns):
            # The next turn repeats the whole conversation: the prompt and its answer.
            assert after["hash_ids"][: len(before["hash_ids"])] == before["hash_ids"]
            assert len(after["hash_ids"]) == len(before["hash_ids"]) + 4


def test_rounds_alternate_which_side_goes_first() -> None:
    order: list[tuple[str, int]] = []
    finished: list[int] = []

    def side(name: str) -> Any:
        def run(r: int) -> list[dict[str, Any]]:
            order.append((name, r))
            return [{"phase": name}]
        return run

    records: list[dict[str, Any]] = []
    bench.alternating_rounds(3, side("ours"), side("base"), records, finished.append)
    assert order == [("ours", 0), ("base", 0), ("base", 1), ("ours", 1), ("ours", 2),
                     ("base", 2)]
    assert [(r["phase"], r["round"]) for r in records] == order
    assert finished == [0, 1, 2]


def test_targets_pair_the_sides_within_each_round() -> None:
    summary = bench.summarize(_results())
    targets = {t["what"]: t["ratio"] for t in summary["targets"]}
    # Round 0: 200/2000, round 1: 400/4000 - the same ratio, paired within the round.
    assert targets["prefix-2048: restart vs recompute"] == pytest.approx((0.1, 0.1, 0.1))
    assert targets["prefix-2048: restart vs vLLM's local prefix-cache hit"] == pytest.approx(
        (2.0, 2.0, 2.0))
    assert targets["prefix-2048: second server through SeaweedFS vs recompute"] == \
        pytest.approx((0.3, 0.3, 0.3))
    tpot = targets["multiturn: TPOT while stores cascade (cold) vs no offloading"]
    assert tpot == pytest.approx((1.65, 1.1, 2.2))
    assert not any("moto" in what for what in targets), "no phase, no target row"


def test_outputs_are_compared_with_the_same_rounds_baseline() -> None:
    identical = bench.summarize(_results())["identical"]
    assert identical["kvtiers/cold"] == (18, 18)
    assert identical["kvtiers/restart"] == (9, 18), "round 1's texts differ"


def test_break_even_is_where_loading_stays_faster() -> None:
    be = bench.summarize(_results())["break_even"]
    assert be["recompute"] == {64: 100, 256: 500, 2048: 2000}
    # Slower at 64, faster from 256 on.
    assert be["tiers"]["file"]["break_even"] == 256
    # Slower at 64 and at 256 (600 against 500), faster only at 2048.
    assert be["tiers"]["s3 (SeaweedFS)"]["break_even"] == 2048
    assert "cpu" not in be["tiers"], "no cpu phase ran"


def test_restore_rate_is_the_longest_prompts_kv_over_its_load_ttft() -> None:
    summary = bench.summarize(_results())
    rates = bench.restore_rates(summary, 16384)
    # file: 2,048 tokens x 16 KiB in 300 ms (median over rounds); SeaweedFS in 500 ms.
    assert rates["file"] == pytest.approx(2048 * 16384 / 0.3 / 1e9)
    assert rates["s3 (SeaweedFS)"] == pytest.approx(2048 * 16384 / 0.5 / 1e9)
    results = {**_results(), "plan": {**bench.QUICK.__dict__},
               "machine": {"cpu": "cpu", "cores": "2", "python": "3", "vllm": "0.32.0",
                           "torch": "2", "load": "1", "date": "now"},
               "model": "m", "command": "c", "runtime_s": 60}
    text = bench.render(results, summary)
    assert "| break-even | restore GB/s at 2,048 |" in text
    assert f"| file | 150 | 200 | 300 | 256 tokens | {rates['file']:.2f} |" in text


def test_the_curve_has_a_line_per_tier_and_needs_a_ladder(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    summary = bench.summarize(_results())
    assert bench.plot_curve(summary, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty: dict[str, Any] = {"break_even": {"recompute": {}, "tiers": {}}}
    assert not bench.plot_curve(empty, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_gil_categories_split_the_holders(tmp_path: Path) -> None:
    raw = tmp_path / "spy.txt"
    raw.write_text(
        "<module> (<string>:1);EngineCoreProc.run_busy_loop (vllm/v1/engine/core.py:1549) 70\n"
        "<module> (<string>:1);Scheduler.schedule (vllm/x.py:1);"
        "TieredManager.lookup (kvtiers/stack/composite.py:300) 5\n"
        "Thread._bootstrap (threading.py:1002);IOPool._run (kvtiers/tiers/iopool.py:69);"
        "BaseClient._make_api_call (botocore/client.py:1000) 20\n"
        "Thread._bootstrap (threading.py:1002);Socket.recv (zmq/x.py:1) 5\n"
        "not a sample line\n"
    )
    out = bench.gil_categories(raw)
    assert out["samples"] == {"vLLM's engine-core thread": 70,
                              "kvtiers on the scheduler thread": 5,
                              "kvtiers mover threads": 20, "other threads": 5}
    assert out["top_frames"][0] == ("BaseClient._make_api_call (botocore/client.py:1000)", 20)


def test_render_has_every_phase_and_says_which_targets_are_met() -> None:
    results = {**_results(), "plan": {**bench.QUICK.__dict__},
               "machine": {"cpu": "cpu", "cores": "2", "python": "3", "vllm": "0.32.0",
                           "torch": "2", "load": "1", "date": "now"},
               "model": "m", "command": "c", "runtime_s": 60}
    text = bench.render(results, bench.summarize(results))
    assert "| prefix-2048: restart vs recompute | 0.10 (0.10-0.10)x | <= 0.25x | met |" in text
    assert "vLLM's local prefix-cache hit | 2.00 (2.00-2.00)x | <= 1.25x | **missed** |" in text
    for phase in ("| baseline | warm |", "| kvtiers | second-seaweedfs |"):
        assert phase in text


def test_noreuse_trace_gives_every_prompt_blocks_of_its_own(tmp_path: Path) -> None:
    plan = bench.FULL
    path = tmp_path / "noreuse.jsonl"
    bench.noreuse_trace(path, plan)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == plan.noreuse_requests
    assert [line["timestamp"] for line in lines] == [
        i * plan.noreuse_gap_s for i in range(plan.noreuse_requests)]
    ids = [i for line in lines for i in line["hash_ids"]]
    assert len(ids) == len(set(ids)) == plan.noreuse_requests * plan.noreuse_tokens // 64
    bench.multiturn_trace(tmp_path / "multiturn.jsonl", plan)
    multiturn = {i for line in (tmp_path / "multiturn.jsonl").read_text().splitlines()
                 for i in json.loads(line)["hash_ids"]}
    assert not multiturn & set(ids)


def _noreuse() -> dict[str, Any]:
    groups = {"noreuse-ladder": {"first": [True, True], "lengths": [512, 2048]},
              "noreuse-trace": {"first": [True] * 2, "lengths": [1024, 1024]}}

    def record(side: str, r: int, ttft: float, tpot: float, rate: float) -> dict[str, Any]:
        group = {"ttft": [ttft / 1000] * 2, "tpot": [tpot / 1000] * 2,
                 "texts": ["a", "b"], "request_throughput": rate}
        return {"side": side, "phase": "noreuse", "round": r, "wall_s": 1.0,
                "groups": {name: group for name in groups},
                "counters": {}, "cpu_s": {"Worker": 10.0 if side == "kvtiers" else 8.0}}

    return {"groups": groups, "plan": {**bench.QUICK.__dict__}, "command": "c",
            "machine": {"date": "now", "load": "8.0, 8.0, 8.0", "load_end": "9.0, 9.0, 9.0"},
            "runtime_s": 600,
            "records": [record("baseline", 0, 1000, 100, 1.0),
                        record("kvtiers", 0, 1020, 110, 0.9),
                        record("baseline", 1, 2000, 200, 0.5),
                        record("kvtiers", 1, 2200, 200, 0.5)]}


def test_noreuse_ratios_pair_the_sides_within_each_round() -> None:
    summary = bench.summarize_noreuse(_noreuse())
    ratios = {(row["group"], row["metric"]): row for row in summary["ratios"]}
    ttft = ratios[("noreuse-ladder", "TTFT")]
    assert ttft["ratio"] == pytest.approx((1.06, 1.02, 1.10))
    assert ttft["met"] is False
    tpot = ratios[("noreuse-trace", "TPOT")]
    assert tpot["ratio"] == pytest.approx((1.05, 1.0, 1.1)) and tpot["met"] is True
    rate = ratios[("noreuse-trace", "req/s")]
    assert rate["ratio"] == pytest.approx((0.95, 0.9, 1.0)) and rate["met"] is True
    assert summary["cpu"]["kvtiers"]["Worker"] == (10.0, 10.0, 10.0)


def test_render_has_the_noreuse_section_with_its_load() -> None:
    results = {**_results(), "plan": {**bench.QUICK.__dict__},
               "machine": {"cpu": "cpu", "cores": "2", "python": "3", "vllm": "0.32.0",
                           "torch": "2", "load": "1", "date": "now"},
               "model": "m", "command": "c", "runtime_s": 60, "noreuse": _noreuse()}
    text = bench.render(results, bench.summarize(results))
    assert "## No reuse" in text
    assert "load average 8.0, 8.0, 8.0 at the start, 9.0, 9.0, 9.0 at the end" in text
    assert "| noreuse-ladder | TTFT | 1.06 (1.02-1.10)x | <= 1.05x | **missed** |" in text
    assert "| noreuse-trace | req/s | 0.95 (0.90-1.00)x | >= 0.95x | met |" in text


def _service() -> dict[str, Any]:
    groups = {"prefix-2048": {"first": [True, False], "lengths": [2048, 2048]}}

    def record(side: str, phase: str, r: int, first: float, texts: str = "same",
               hits: float = 0.0, tpot: float = 0.04) -> dict[str, Any]:
        group = {"ttft": [first / 1000, 0.1], "tpot": [tpot, tpot],
                 "texts": [f"{texts}-0", f"{texts}-1"], "request_throughput": 1.0}
        return {"side": side, "phase": phase, "round": r, "wall_s": 1.0,
                "groups": {"prefix-2048": group},
                "counters": {"external_hit_tokens": hits}, "cpu_s": {}}

    records = []
    # Round 1 is twice as slow throughout: paired ratios are the same in both rounds
    # where the sides scale together, and differ where they do not.
    for r, scale in ((0, 1.0), (1, 2.0)):
        records += [
            record("baseline", "cold", r, 4000 * scale),
            record("baseline", "warm", r, 100 * scale),
            record("baseline", "restart", r, 4000 * scale),
            record("service", "cold", r, 4400 * scale, tpot=0.04 * (1.0 if r == 0 else 1.1)),
            record("service", "engine-restart", r, 120 * scale, hits=2048),
            record("service", "second-engine", r, 100 * (1.0 if r == 0 else 3.0), hits=2048),
            record("service", "service-killed", r, 4000 * scale,
                   texts="same" if r == 0 else "other"),
            record("service", "service-restarted", r, 200 * scale, hits=2048),
            record("service", "second-server-seaweedfs", r, 1200 * scale, hits=2048),
        ]
    return {"groups": groups, "records": records, "pool": "2GiB", "command": "c",
            "machine": {"date": "now", "load": "3.0, 3.0, 3.0", "load_end": "4.0, 4.0, 4.0",
                        "start_s": "30-90"},
            "runtime_s": 1800, "step": ["- step line"], "notes": ["a note"]}


def test_service_ratios_pair_the_rounds_and_need_median_and_p90_within() -> None:
    summary = bench.summarize_service(_service())
    targets = {t["what"].removeprefix("prefix-2048: "): t for t in summary["targets"]}
    restart = targets["engine restart vs vLLM's local prefix-cache hit"]
    assert (restart["median"], restart["low"], restart["high"]) == pytest.approx((1.2, 1.2, 1.2))
    assert restart["met"] is True
    # 1.0x then 1.5x: the median (1.25x) is within the target, the p90 is not.
    second = targets["second engine on the node vs vLLM's local prefix-cache hit"]
    assert second["median"] == pytest.approx(1.25) and second["p90"] > 1.25
    assert second["met"] is False
    assert targets["service restarted (re-adopted pool) vs recompute"]["median"] == \
        pytest.approx(0.05)
    assert targets["service killed vs recompute"]["met"] is None
    other_node = targets["second server (its own service) through SeaweedFS vs recompute"]
    assert other_node["median"] == pytest.approx(0.3) and other_node["met"] is True
    # TPOT 1.0x then 1.1x: a ratio of the decode time, not of the first request's TTFT.
    tpot = targets["TPOT while stores cascade below the pool (cold) vs no offloading"]
    assert (tpot["low"], tpot["high"]) == pytest.approx((1.0, 1.1)) and tpot["met"] is False
    assert summary["identical"]["service/service-killed"] == (2, 4)
    assert summary["identical"]["service/engine-restart"] == (4, 4)
    assert summary["table"]["service/engine-restart/external_hit_tokens"] == (2048,) * 3
    assert summary["rounds"] == 2


def test_render_keeps_the_in_process_sections_beside_the_service_one() -> None:
    results = {**_results(), "plan": {**bench.QUICK.__dict__},
               "machine": {"cpu": "cpu", "cores": "2", "python": "3", "vllm": "0.32.0",
                           "torch": "2", "load": "1", "date": "now"},
               "model": "m", "command": "c", "runtime_s": 60, "noreuse": _noreuse(),
               "service": _service()}
    text = bench.render(results, bench.summarize(results))
    assert "| prefix-2048: restart vs recompute | 0.10 (0.10-0.10)x | <= 0.25x | met |" in text
    assert "## No reuse" in text
    service = text[text.index("## Through `kvtiers serve`"):]
    assert "load average 3.0, 3.0, 3.0 at the start, 4.0, 4.0, 4.0 at the end" in service
    assert ("| prefix-2048: engine restart vs vLLM's local prefix-cache hit | 1.20x | 1.20x "
            "| 1.20-1.20x | <= 1.25x | met |") in service
    assert "| prefix-2048: second engine on the node vs vLLM's local prefix-cache hit " \
           "| 1.25x |" in service and "| <= 1.25x | **missed** |" in service
    assert "| prefix-2048: service killed vs recompute | 1.00x | 1.00x | 1.00-1.00x |  |  |" \
        in service
    assert "| service | service-restarted | 150 (150-150) | " not in service
    assert "| service | service-restarted | 200 (150-250) | " in service
    assert "| service | service-killed |" in service and "| 2/4 |" in service
    assert service.index("- step line") < service.index("a note")


def test_step_targets_quote_bench_service_at_256(tmp_path: Path) -> None:
    assert bench.step_targets(tmp_path / "service.json") == []
    rows = [{"running": 256, "side": "route1", "step_p99_us": 2000.0, "per_key_us": 5.0},
            {"running": 256, "side": "service", "step_p99_us": 2500.0, "per_key_us": 15.0},
            {"running": 1, "side": "service", "step_p99_us": 1.0, "per_key_us": 1.0}]
    doc = bench.to_document("service", {"machine": bench.harness_machine_note(), "rows": rows},
                            tables=("rows",))
    (tmp_path / "service.json").write_text(json.dumps(doc))
    assert bench.step_targets(tmp_path / "service.json") == [
        "- scheduler's p99 added time per step at 256 running requests: 500 us "
        "(target <= 1000 us): met",
        "- time per key vs in-process route 1 at 256: 3.00x (target <= 2x): **missed**",
    ]


LADDER = [512, 4096, 16384]


def _ladder_run(date: str, cpu_ttft: list[float]) -> dict[str, Any]:
    """A ``--ladder-only`` run of two rounds: recomputing 300/2000/9000 ms (round 1
    twice that), the CPU tier ``cpu_ttft``, files 500/600/800 ms; round 1's file texts
    differ from its recompute's."""

    def record(side: str, phase: str, r: int, ttft: list[float], hits: float,
               texts: str = "same") -> dict[str, Any]:
        return {"side": side, "phase": phase, "round": r, "wall_s": 1.0,
                "groups": {"ladder": {"ttft": [t / 1000 for t in ttft], "tpot": [None] * 3,
                                      "texts": [f"{texts}-{i}" for i in range(3)],
                                      "request_throughput": 1.0}},
                "counters": {"external_hit_tokens": hits, "promotions": hits // 1024},
                "cpu_s": {"Worker": 1.0}}

    records = []
    for r, scale in ((0, 1.0), (1, 2.0)):
        records += [
            record("baseline", "restart", r, [300 * scale, 2000 * scale, 9000 * scale], 0),
            record("kvtiers", "cold", r, [300, 2000, 9000], 0),
            record("kvtiers", "cpu", r, cpu_ttft, 20480.0 * (r + 1)),
            record("kvtiers", "restart", r, [500, 600, 800], 20480.0,
                   texts="same" if r == 0 else "other"),
        ]
    return {"machine": {"date": date, "load": "9.0, 8.0, 7.0", "load_end": "6.0, 5.0, 4.0",
                        "start_s": "30-60", "cpu": "EPYC", "cores": 2, "vllm": "0.32.0",
                        "torch": "2.13.0"},
            "plan": {"rounds": 2, "ladder": LADDER, "ladder_each": 1},
            "command": "benchmarks/bench_serve.py --ladder-only",
            "groups": {"ladder": {"first": [True] * 3, "lengths": LADDER}},
            "records": records, "rounds_done": 2, "runtime_s": 1800}


def _full_run() -> dict[str, Any]:
    return {**_results(), "plan": {**bench.FULL.__dict__}, "model": "m", "command": "c",
            "machine": {"original": {"cpu": "cpu", "cores": "2", "python": "3",
                                     "vllm": "0.32.0", "torch": "2", "load": "1",
                                     "date": "full-run-date"}},
            "runtime_s": 60}


def test_a_ladder_run_replaces_the_full_runs_ladder_and_keeps_the_rest() -> None:
    full = _full_run()
    merged = bench.merge_ladder(full, _ladder_run("ladder-date", [250, 300, 350]))
    assert "ladder" not in merged["groups"]
    assert all("ladder" not in r["groups"] for r in merged["records"])
    assert len(merged["records"]) == len(full["records"])
    assert [r["groups"]["prefix-2048"] for r in merged["records"]] == [
        r["groups"]["prefix-2048"] for r in full["records"]], "the other groups keep theirs"
    summary = bench.summarize(merged)
    targets = {t["what"]: t["ratio"] for t in summary["targets"]}
    assert targets["prefix-2048: restart vs recompute"] == pytest.approx((0.1, 0.1, 0.1))
    be = summary["break_even"]
    # Medians over the ladder run's two rounds, not the full run's 64/256/2048 ladder.
    assert be["recompute"] == {512: 450, 4096: 3000, 16384: 13500}
    assert be["tiers"]["cpu"]["break_even"] == 512
    assert be["tiers"]["file"]["break_even"] == 4096, "500 ms is not under 450 at 512"
    rates = bench.restore_rates(summary, 16384)
    assert rates["file"] == pytest.approx(16384 * 16384 / 0.8 / 1e9)
    # Merging a later ladder run replaces the earlier one.
    again = bench.merge_ladder(merged, _ladder_run("later-date", [100, 200, 300]))
    assert bench.summarize(again)["break_even"]["tiers"]["cpu"]["load"] == {
        512: 100, 4096: 200, 16384: 300}


def test_render_gives_the_ladder_run_its_own_note_and_checks() -> None:
    merged = bench.merge_ladder(_full_run(), _ladder_run("ladder-date", [250, 300, 350]))
    text = bench.render(merged, bench.summarize(merged))
    assert "load average 1 at the start" in text.split("## Targets")[0], "the full run's note"
    section = text[text.index("## ladder"):text.index("## Break-even")]
    assert "`--ladder-only` (EPYC, 2 cores, vLLM 0.32.0, torch 2.13.0; ladder-date; " \
        "load average 9.0, 8.0, 7.0 at the start, " \
        "6.0, 5.0, 4.0 at the end" in section
    assert "2 rounds; 30 min" in section
    assert "Prompts of 512, 4096, 16384 tokens" in section
    assert "| baseline | restart | 0 (0-0) |  | 6/6 |" in section
    assert "| kvtiers | cpu | 30720 (20480-40960) | 30 (20-40) | 6/6 |" in section
    assert "| kvtiers | restart | 20480 (20480-20480) | 20 (20-20) | 3/6 |" in section
    assert "| recompute | 450 | 3000 | 13500 | | |" in text
    assert "| break-even | restore GB/s at 16,384 |" in text
    assert "| file | 500 | 600 | 800 | 4,096 tokens |" in text


def test_a_merged_ladder_run_is_written_as_a_result_document(tmp_path: Path) -> None:
    from harness import from_document, read_result

    bench.write(bench.merge_ladder(_full_run(), _ladder_run("d", [250, 300, 350])), tmp_path)
    back = from_document(read_result(tmp_path / "serve.json"))
    assert back["ladder_run"]["plan"]["ladder"] == LADDER
    assert "ladder" not in back["groups"]
    text = (tmp_path / "serve.md").read_text()
    assert "| cpu | 250 | 300 | 350 | every length (<= 512 tokens) |" in text


@pytest.fixture
def metrics_url() -> Iterator[str]:
    body = (b"# HELP x_total a counter\n# TYPE x_total counter\n"
            b'x_total{outcome="done"} 3.0\nx_total{outcome="failed"} 1.0\n'
            b"plain_gauge 7.5\nbroken_line nan-ish\n")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    thread.join()


def test_scrape_reads_labelled_and_summed_samples(metrics_url: str) -> None:
    samples = scrape(metrics_url)
    assert samples['x_total{outcome="done"}'] == 3.0
    assert samples["x_total"] == 4.0
    assert samples["plain_gauge"] == 7.5
    assert "broken_line" not in samples


def test_kv_transfer_config_is_route_one() -> None:
    config = json.loads(kv_transfer_config("/etc/stack.yaml", kvtiers_salt="s"))
    extra = config["kv_connector_extra_config"]
    assert config["kv_connector"] == "OffloadingConnector"
    assert extra["spec_name"] == "KVTiersOffloadingSpec"
    assert extra["kvtiers_config"] == "/etc/stack.yaml"
    assert extra["kvtiers_salt"] == "s"
