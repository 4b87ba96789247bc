"""``benchmarks/gpu_check.py`` where no GPU is: its arguments, its one-line exit without
CUDA, ``--dry-run``, the bounded runner that kills a hung step, the per-step and whole-run
budgets, pytest reports judged, the skip paths (no wheels, no kvikio) and the report it
writes. The demo child runs on CPU tensors here, so the engine swap it relies on is
checked too. What needs a GPU is in ``tests/test_cuda_paths.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


def _script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False, env=env)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(gpu_check, "cuda_state", lambda: (False, "no device here"))
    yield


# -- arguments and the two exits CI sees -------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--only", "nosuch"], "unknown step nosuch"),
        (["--skip", "bench,warp"], "unknown step warp"),
        (["--budget-s", "3"], "--budget-s must be at least"),
        (["--child", "bench"], "--child needs --result"),
        (["--wheels", "/no/such/dir"], "is not a directory"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(args)
    assert exit_info.value.code == gpu_check.EXIT_USAGE
    assert message in capsys.readouterr().err


def test_out_must_not_be_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--out", str(target)])
    assert "not a directory" in capsys.readouterr().err


def test_steps_chosen_in_order() -> None:
    args = gpu_check.parse_args(["--only", "demo,cuda-tests,bench", "--skip", "bench"])
    assert [s.name for s in gpu_check.chosen_steps(args)] == ["cuda-tests", "demo"]
    assert [s.name for s in gpu_check.chosen_steps(gpu_check.parse_args([]))] == list(
        gpu_check.STEP_NAMES)


def test_the_step_budgets_fit_in_eight_minutes() -> None:
    assert sum(step.budget_s for step in gpu_check.STEPS) <= gpu_check.TOTAL_BUDGET_S < 8 * 60


def test_out_dir_prefers_the_flag_then_out(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.setenv("OUT", str(tmp_path / "env"))
    assert gpu_check.out_dir(gpu_check.parse_args(["--out", str(tmp_path)])) == tmp_path
    assert gpu_check.out_dir(gpu_check.parse_args([])) == tmp_path / "env"
    monkeypatch.delenv("OUT")
    assert gpu_check.out_dir(gpu_check.parse_args([])) == gpu_check.DEFAULT_RESULTS


def test_without_cuda_it_exits_at_once_with_one_line(
    no_cuda: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert gpu_check.main(["--out", str(tmp_path)]) == gpu_check.EXIT_NO_CUDA
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "no device here" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_dry_run_passes_here_as_a_script(tmp_path: Path) -> None:
    """What CI runs: the script's own process, kvtiers from this checkout even without
    PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = _script("--dry-run", "--out", str(tmp_path), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dry run ok" in done.stdout
    assert f"kvtiers from {REPO / 'kvtiers'};" in done.stdout
    for step in gpu_check.STEP_NAMES:
        assert f"would run {step}" in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_dry_run_names_a_broken_import(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(gpu_check, "STEP_IMPORTS", ("json", "kvtiers.no_such_module"))
    assert gpu_check.main(["--dry-run"]) == gpu_check.EXIT_FAILED
    assert "problem: import kvtiers.no_such_module" in capsys.readouterr().out


# -- the bounded runner ----------------------------------------------------------------
def test_a_hung_step_is_killed_at_its_budget(tmp_path: Path) -> None:
    log = tmp_path / "log"
    finished = gpu_check.run_bounded(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(600)"],
        1.0, gpu_check.child_env(None), log, "hang")
    assert finished.timed_out and finished.returncode is None
    text = log.read_text()
    assert "started" in text and "hang: timed out" in text


def test_the_children_see_this_checkout_first(tmp_path: Path) -> None:
    log = tmp_path / "log"
    site = tmp_path / "site"
    finished = gpu_check.run_bounded(
        [sys.executable, "-c", "import kvtiers, sys; print(kvtiers.__file__); print(sys.path)"],
        60, gpu_check.child_env(site), log, "path")
    assert finished.returncode == 0
    text = log.read_text()
    assert str(REPO / "kvtiers" / "__init__.py") in text
    assert str(site) in text


def test_a_spent_run_budget_skips_the_remaining_steps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each step gets min(its budget, what is left); none starts on too little."""
    clock = [0.0]
    budgets: list[float] = []
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock[0])

    def fake_pytest_step(name: str, paths: Any, keyword: str, budget_s: float,
                         *rest: Any) -> Any:
        budgets.append(budget_s)
        clock[0] += 100.0
        return gpu_check.StepResult(name, "passed", "1 passed", 100.0, budget_s)

    monkeypatch.setattr(gpu_check, "pytest_step", fake_pytest_step)
    args = gpu_check.parse_args(["--only", "cuda-tests,bench,demo", "--budget-s", "110"])
    results = gpu_check.run_steps(args, gpu_check.chosen_steps(args), tmp_path,
                                  tmp_path / "log")
    assert budgets == [110.0]
    assert [(r.name, r.status) for r in results] == [
        ("cuda-tests", "passed"), ("bench", "skipped"), ("demo", "skipped")]
    assert "10 s of the run's budget left" in results[1].summary
    assert "bench: skipped" in capsys.readouterr().out


# -- judging pytest --------------------------------------------------------------------
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
{cases}
</testsuite></testsuites>
"""


def _junit(tmp_path: Path, *outcomes: str) -> Path:
    cases = []
    for i, outcome in enumerate(outcomes):
        body = {
            "pass": "",
            "fail": '<failure message="assert 0">trace</failure>',
            "error": '<error message="fixture broke">trace</error>',
            "skip": '<skipped type="pytest.skip" message="kvikio unusable: no driver"/>',
            "module-skip": '<skipped message="collection skipped">(\'tests/test_x.py\', 5, '
                           "'Skipped: needs a CUDA device')</skipped>",
        }[outcome]
        cases.append(f'<testcase classname="tests.test_x" name="test_{i}">{body}</testcase>')
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT.format(cases="\n".join(cases)))
    return path


def _finished(code: int | None = 0, timed_out: bool = False) -> Any:
    return gpu_check.Finished(code, timed_out, 1.0)


def test_pytest_passes_with_skips_listed(tmp_path: Path) -> None:
    result = gpu_check.judge_pytest("t", _finished(), _junit(tmp_path, "pass", "skip", "skip"),
                                    60)
    assert result.status == "passed"
    assert result.summary == "1 passed; 2 skipped: kvikio unusable: no driver"


@pytest.mark.parametrize(
    ("outcomes", "finished", "status", "words"),
    [
        (("pass", "fail", "error"), (1, False), "failed",
         "2 failed: tests.test_x::test_1, tests.test_x::test_2"),
        (("skip", "skip"), (0, False), "failed", "no test ran (2 skipped"),
        (("module-skip",), (5, False), "failed",
         "no test ran (1 skipped: needs a CUDA device)"),
        ((), (5, False), "failed", "no test ran (none collected)"),
        (("pass",), (None, True), "timed out", "killed after 60 s"),
        (("pass",), (3, False), "failed", "pytest exit status 3"),
    ],
    ids=["failures", "all-skipped", "module-skipped", "none-collected", "timed-out",
         "internal-error"],
)
def test_pytest_verdicts(tmp_path: Path, outcomes: tuple[str, ...],
                         finished: tuple[int | None, bool], status: str, words: str) -> None:
    result = gpu_check.judge_pytest("t", _finished(*finished), _junit(tmp_path, *outcomes), 60)
    assert result.status == status
    assert words in result.summary


def test_pytest_without_a_report_fails(tmp_path: Path) -> None:
    result = gpu_check.judge_pytest("t", _finished(4), None, 60)
    assert (result.status, result.summary) == ("failed", "pytest wrote no report (exit status 4)")


# -- the skip paths --------------------------------------------------------------------
def test_no_wheels_is_a_skip_line(tmp_path: Path) -> None:
    result, site = gpu_check.step_wheels(tmp_path, 30, tmp_path / "log", tmp_path,
                                         gpu_check.child_env(None))
    assert site is None
    assert result.status == "skipped" and result.summary.startswith("skipped: no wheels in")


def test_a_wheel_that_does_not_install_fails_the_step(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip file")
    result, site = gpu_check.step_wheels(wheels, 60, tmp_path / "log", tmp_path,
                                         gpu_check.child_env(None))
    assert site is None
    assert result.status == "failed" and "installing broken" in result.summary


def test_missing_kvikio_is_a_skip_line_not_a_crash(tmp_path: Path) -> None:
    from kvtiers.tiers.file.io import kvikio_status

    if kvikio_status(tmp_path) is None:
        pytest.skip("kvikio is usable on this machine")
    result = gpu_check.step_kvikio(60, gpu_check.child_env(None), tmp_path / "log", tmp_path)
    assert result.status == "skipped", result.summary
    assert result.summary.startswith("skipped: ")
    assert "kvikio" in result.summary or "libcuda" in result.summary


@pytest.mark.parametrize(
    ("answers", "path"),
    [
        ({"compat_mode_preferred": True, "gds_available": True}, "compatibility mode (POSIX"),
        ({"compat_mode_preferred": False, "gds_available": True}, "GPUDirect Storage"),
        ({"compat_mode_preferred": False, "gds_available": False}, "reports GDS unavailable"),
        ({"compat_mode_preferred": False, "gds_available_error": "RuntimeError"},
         "undetermined"),
    ],
)
def test_the_kvikio_io_path_named_from_its_answers(answers: dict[str, Any], path: str) -> None:
    assert path in gpu_check.io_path(answers)


def test_a_child_that_dies_without_a_result_fails_its_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(gpu_check, "SCRIPT", tmp_path / "no_such_script.py")
    result = gpu_check.step_child("bench", 60, gpu_check.child_env(None), tmp_path / "log",
                                  tmp_path, False, gpu_check.judge_bench)
    assert result.status == "failed" and "no result" in result.summary


def test_the_demo_child_runs_the_demo_on_the_engine_device_it_is_given(tmp_path: Path) -> None:
    """On CPU tensors here (cuda:0 on a GPU machine): the swapped engine class is the one
    run_demo builds, every byte verified; file-gds is a skip line without kvikio."""
    from kvtiers.engine import simulator

    engine = simulator.SimulatedEngine
    data = gpu_check.child_demo(tmp_path, device="cpu", quick=True)
    assert simulator.SimulatedEngine is engine, "the demo's engine class is put back"
    runs = {run["config"]: run for run in data["runs"]}
    assert runs["cpu-file"]["status"] == "passed", runs["cpu-file"]
    assert runs["cpu-file"]["verdict"].startswith("verdict: ok")
    assert "0 wrong bytes" in runs["cpu-file"]["summary"]
    assert runs["file-gds"]["status"] in ("passed", "skipped")
    assert gpu_check.judge_demo(data).status == "passed"


def test_a_failed_or_missing_demo_run_fails_the_step() -> None:
    passed = {"config": "cpu-file", "status": "passed", "summary": "verified"}
    failed = {"config": "file-gds", "status": "failed", "summary": "KVTiersError: 3 wrong"}
    skipped = {"config": "file-gds", "status": "skipped", "summary": "skipped: no kvikio"}
    assert gpu_check.judge_demo({"runs": [passed, skipped]}).status == "passed"
    result = gpu_check.judge_demo({"runs": [passed, failed]})
    assert result.status == "failed" and "file-gds: KVTiersError: 3 wrong" in result.summary
    assert gpu_check.judge_demo({"runs": [skipped]}).status == "failed"
    assert gpu_check.judge_demo({"error": "RuntimeError: boom"}).summary == "RuntimeError: boom"



# -- the vllm-worker step's verdict (its child: tests/test_vllm_gpu_check.py) ---------

@pytest.mark.parametrize(
    ("worker", "kvikio", "status"),
    [
        ("passed", "passed", "passed"),
        ("passed", "skipped", "passed"),
        ("skipped", "skipped", "skipped"),
        ("skipped", "failed", "failed"),
        ("failed", "passed", "failed"),
    ],
)
def test_the_vllm_worker_step_judged_on_its_parts(worker: str, kvikio: str,
                                                  status: str) -> None:
    data = {"allocation": "vLLM's ExtensibleTensor",
            "worker": {"status": worker, "summary": f"worker {worker}"},
            "kvikio": {"status": kvikio, "summary": f"kvikio {kvikio}"}}
    result = gpu_check.judge_vllm_worker(data)
    assert result.status == status
    assert result.summary == (f"allocation: vLLM's ExtensibleTensor; worker: worker {worker}; "
                              f"kvikio: kvikio {kvikio}")
    assert gpu_check.judge_vllm_worker({"error": "OSError: x"}).status == "failed"
    assert gpu_check.judge_vllm_worker({"allocation": "torch"}).status == "failed"


# -- the report ------------------------------------------------------------------------
def _row(**changes: Any) -> dict[str, Any]:
    row = {"geometry": "8B-like", "layers": 32, "page_bytes": 65536, "blocks_per_chunk": 16,
           "slots": "fresh", "direction": "GPU->CPU", "batch": "default", "mib": 256,
           "copy_gbps": 50.0, "worker_gbps": 45.0, "ratio": 0.9, "verified": True}
    row.update(changes)
    return row


def test_bench_judged_on_bytes_and_ratio_reported() -> None:
    rows = [_row(), _row(slots="scattered", worker_gbps=20.0, ratio=0.4),
            _row(batch="16 MiB", ratio=0.1)]
    result = gpu_check.judge_bench({"rows": rows})
    assert result.status == "passed"
    assert "worst 0.40x (8B-like, scattered, GPU->CPU), 1 of 2 below 0.8x" in result.summary
    assert gpu_check.judge_bench({"rows": [*rows, _row(verified=False)]}).status == "failed"
    assert gpu_check.judge_bench({"rows": []}).status == "failed"


def test_report_files_hold_the_machine_note_steps_and_tables(tmp_path: Path) -> None:
    log = tmp_path / "scratch.log"
    log.write_bytes(b"a" * 100 + b"b" * 100)
    note = {"gpu": "NVIDIA H200", "gpu_memory": "139.8 GiB", "capability": "9.0",
            "driver": "580.1", "torch": "2.11.0", "cuda": "13.0", "cufile": "not found",
            "cpu": "x86", "cores": 16, "memory": "125 GiB", "python": "3.12.3",
            "date": "2026-12-01 05:00 UTC", "load": "1.0, 1.0, 1.0", "kernel": "6.8"}
    results = [
        gpu_check.StepResult("wheels", "skipped", "skipped: no wheels in .whl", 0.0, 30),
        gpu_check.StepResult("cuda-tests", "passed", "40 passed", 20.0, 120),
        gpu_check.StepResult("kvikio", "skipped", "skipped: kvikio does not import (x|y)",
                             1.0, 90, {"io_path": "none", "unusable": "kvikio does not import"}),
        gpu_check.StepResult("vllm-worker", "passed", "ok", 9.0, 55, {
            "allocation": "vLLM's ExtensibleTensor: virtual memory reserved",
            "worker": {"status": "passed", "summary": "vLLM 0.34.0, DevicePointers: 10 chunks"},
            "kvikio": {"status": "failed", "summary": "GPUDirect Storage (cuFile): OSError"}}),
        gpu_check.StepResult("bench", "passed", "2 rows", 30.0, 110, {"rows": [_row()]}),
        gpu_check.StepResult("demo", "timed out", "killed after 90 s", 90.0, 90),
    ]
    out = tmp_path / "out"
    md, js = gpu_check.write_report(out, note, "python benchmarks/gpu_check.py", results, log)
    text = md.read_text()
    assert "Machine: NVIDIA H200 (139.8 GiB, compute capability 9.0, driver 580.1)" in text
    assert "Verdict: FAILED (3 passed, 2 skipped, 1 timed out): demo timed out" in text
    assert ("- allocation: vLLM's ExtensibleTensor: virtual memory reserved\n"
            "- worker: passed: vLLM 0.34.0, DevicePointers: 10 chunks\n"
            "- kvikio: failed: GPUDirect Storage (cuFile): OSError") in text
    assert "| kvikio | skipped | 1.0 | 90 | skipped: kvikio does not import (x/y) |" in text
    assert "| 8B-like | 64 KiB | 16 | 256 | fresh | GPU->CPU | default | 50.0 | 45.0 | 0.90x |" \
        in text
    assert "- unusable: kvikio does not import" in text
    data = json.loads(js.read_text())
    assert data["bench"] == "gpu_check" and data["parameters"]["command"].startswith("python")
    assert data["extra"]["passed"] is False
    assert [s["name"] for s in data["tables"]["steps"]][-1] == "demo"
    assert (out / gpu_check.LOG_NAME).read_bytes() == log.read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [gpu_check.REPORT_MD, gpu_check.REPORT_JSON, gpu_check.LOG_NAME])


def test_a_long_log_keeps_its_head_and_tail(tmp_path: Path) -> None:
    source, target = tmp_path / "in", tmp_path / "out"
    source.write_bytes(b"h" * 600 + b"m" * 600 + b"t" * 600)
    gpu_check.copy_trimmed(source, target, limit=1000)
    data = target.read_bytes()
    assert data.startswith(b"h" * 500) and data.endswith(b"t" * 500)
    assert b"[... 800 bytes left out ...]" in data


def test_a_passing_run_says_so() -> None:
    ok, line = gpu_check.verdict([gpu_check.StepResult("bench", "passed", ""),
                                  gpu_check.StepResult("kvikio", "skipped", "")])
    assert ok and line == "PASSED (1 passed, 1 skipped)"
