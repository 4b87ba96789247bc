"""One prepared command that proves kvtiers' GPU paths on a CUDA machine and measures them.

Run from the repository root with the machine's own Python (it must hold torch with
CUDA): ``python benchmarks/gpu_check.py [--out DIR] [--quick]`` or ``make gpu-check``.
kvtiers is imported from this checkout (the repository root goes first on ``PYTHONPATH``);
nothing is resolved or downloaded. Wheels carried in ``.whl/`` (kvikio, see
docs/gpu-check.md) are installed with ``pip --no-index --no-deps --target`` into a private
folder that only this run's processes see.

Steps, each in a process of its own with its own time budget (a hung step is killed and
reported as timed out; the others still run; the budgets add up to 450 s, under 8
minutes):

``wheels``      install the carried wheels (skipped when there are none);
``cuda-tests``  the CUDA-only tests (``tests/test_cuda_paths.py``): the CPU worker's stream
                path with pinned, host-registered slot memory, per-group transfers at
                offsets, byte-exact both ways over several layouts and block sizes; the
                GDS primary worker on CUDA tensors through the POSIX backend;
``kvikio``      when kvikio imports and can do I/O: which path it takes (GPUDirect Storage
                or its compatibility mode), then the kvikio file-tier conformance, the GDS
                primary's round trips and the CUDA kvikio tests;
``vllm-worker`` a KV cache allocated as vLLM 0.34 allocates it by default (virtual memory
                reserved, physical memory committed in two steps); route 1's worker
                (``KVTiersOffloadingSpec.get_worker``) fed as the installed vLLM's
                connector feeds it (0.34: ``DevicePointers`` from vLLM's own
                ``resolve_device_pointers``; 0.32 / 0.33: ``GPULoadStoreSpec``), stores and
                loads byte-exact, a job outside the KV cache failed; kvikio registering
                that cache and moving bytes into and out of it (skipped parts: no vLLM, no
                kvikio);
``bench``       GPU → CPU and CPU → GPU throughput of the CPU tier's worker against a plain
                ``copy_(non_blocking=True)`` of the same bytes between the same buffers (the
                pinned region and the KV tensors), fresh and scattered slots (target ≥ 0.8x);
``demo``        the demo (``kvtiers.engine.demo.run_demo``, both phases, every loaded byte
                verified) with the simulated engine's KV cache in CUDA tensors, on the
                ``cpu-file`` example, and on ``file-gds`` when kvikio is usable.

Writes ``gpu.md`` (the results, with the machine note), ``gpu.json`` and
``gpu-check.log`` (every step's output) into ``--out``, else ``$OUT``, else
``benchmarks/results``. Exit status: 0 every step that ran passed (skips are listed with
their reason), 1 a step failed or timed out, 2 bad arguments, 3 no CUDA device (one line,
at once). ``--dry-run`` checks the arguments and every import the steps need, on any
machine, and runs nothing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# The benchmarks' harness (machine note, result schema), also when this file is loaded
# by path (the tests).
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

SCRIPT = Path(__file__).resolve()
DEFAULT_WHEELS = REPO / ".whl"
DEFAULT_RESULTS = REPO / "benchmarks" / "results"
REPORT_MD = "gpu.md"
REPORT_JSON = "gpu.json"
LOG_NAME = "gpu-check.log"
#: The log comes back from a device machine with the report: keep it well under its limits.
LOG_LIMIT_BYTES = 4 << 20

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_CUDA = 3

#: The whole run's budget in seconds: under 8 minutes with room for start-up and the report.
TOTAL_BUDGET_S = 450
#: A step is not started with less than this left of the run's budget.
MIN_STEP_S = 15
#: Seconds a killed step gets between SIGTERM and SIGKILL.
KILL_GRACE_S = 3
#: The kvikio step's first part: import kvikio and ask which I/O path it takes.
KVIKIO_INFO_BUDGET_S = 30
#: Per-test limit handed to pytest-timeout when it is installed.
TEST_TIMEOUT_S = 90
#: The ratio to the plain copy the worker is asked to reach.
TARGET_RATIO = 0.8

CUDA_TESTS = "tests/test_cuda_paths.py"
KVIKIO_TESTS = (CUDA_TESTS, "tests/test_file_conformance.py", "tests/test_file_gds.py")
#: pytest ``-k`` expressions: the kvikio tests are the kvikio step's, the rest the CUDA step's.
CUDA_KEYWORD = "not kvikio"
KVIKIO_KEYWORD = "kvikio or test_file_gds"


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: int
    what: str


STEPS = (
    Step("wheels", 30, "install the carried wheels into a private folder"),
    Step("cuda-tests", 110, "CUDA-only tests: CPU worker stream path, GDS worker on CUDA"),
    Step("kvikio", 80, "kvikio I/O path, kvikio conformance, GDS primary round trips"),
    Step("vllm-worker", 55, "route 1's worker fed as vLLM's connector feeds it, kvikio, "
         "on a KV cache in virtual memory as vLLM 0.34 allocates it"),
    Step("bench", 100, "worker vs copy_(non_blocking=True) throughput, both directions"),
    Step("demo", 75, "the demo with CUDA tensors as the simulated engine's KV cache"),
)
STEP_NAMES = tuple(step.name for step in STEPS)
#: What the steps import: ``--dry-run`` imports each, so a broken checkout shows at once.
STEP_IMPORTS = (
    "numpy",
    "torch",
    "pytest",
    "kvtiers",
    "kvtiers.core.geometry",
    "kvtiers.core.specs",
    "kvtiers.core.worker",
    "kvtiers.tiers.cpu.region",
    "kvtiers.tiers.cpu.worker",
    "kvtiers.tiers.file.gds_worker",
    "kvtiers.tiers.file.io",
    "kvtiers.engine.demo",
    "kvtiers.engine.simulator",
    "kvtiers.stack.builder",
)
#: Throughput geometries: (label, layers, page KiB, blocks per chunk, job MiB).
#: ``8B-like``: 32 layers of 64 KiB pages (16 tokens x 8 KV heads x 128 x K+V x 2 bytes),
#: chunks of 16 blocks; ``small pages``: 16 KiB pages, chunks of 4 blocks.
GEOMETRIES = (("8B-like", 32, 64, 16, 256), ("small pages", 32, 16, 4, 256))
#: Worker staging batch sizes measured: the default, and a large one to show its effect.
BATCHES = (None, 16 << 20)


@dataclass
class StepResult:
    """One step's outcome. ``status``: passed, failed, skipped or timed out."""

    name: str
    status: str
    summary: str
    seconds: float = 0.0
    budget_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


# -- arguments -------------------------------------------------------------------------
def step_list(text: str) -> tuple[str, ...]:
    """A comma-separated list of step names, checked (``argparse`` type)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in STEP_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown step {', '.join(unknown) or repr(text)}; steps are {', '.join(STEP_NAMES)}"
        )
    return names


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_check.py",
        description="Prove and measure kvtiers' GPU paths in one run (see the module "
        "docstring and docs/gpu-check.md).",
    )
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help=f"where {REPORT_MD}, {REPORT_JSON} and {LOG_NAME} go (default: "
                             "$OUT, else benchmarks/results)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the arguments and every import the steps need; run nothing")
    parser.add_argument("--quick", action="store_true",
                        help="smaller throughput jobs and fewer repeats")
    parser.add_argument("--only", type=step_list, metavar="STEP[,STEP]",
                        help=f"run only these steps ({', '.join(STEP_NAMES)})")
    parser.add_argument("--skip", type=step_list, default=(), metavar="STEP[,STEP]",
                        help="leave these steps out")
    parser.add_argument("--wheels", type=Path, metavar="DIR",
                        help="wheels to install for the run (default: .whl when it exists)")
    parser.add_argument("--budget-s", type=int, default=TOTAL_BUDGET_S, metavar="SECONDS",
                        help=f"the whole run's time budget (default: {TOTAL_BUDGET_S})")
    parser.add_argument("--child", choices=("kvikio-info", "vllm-worker", "bench", "demo"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.budget_s < MIN_STEP_S:
        parser.error(f"--budget-s must be at least {MIN_STEP_S} seconds, got {args.budget_s}")
    if args.child and args.result is None:
        parser.error("--child needs --result")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a directory")
    if args.wheels is not None and not args.wheels.is_dir():
        parser.error(f"--wheels {args.wheels} is not a directory")
    return args


def chosen_steps(args: argparse.Namespace) -> list[Step]:
    wanted = set(args.only or STEP_NAMES) - set(args.skip)
    return [step for step in STEPS if step.name in wanted]


def out_dir(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return Path(args.out)
    env = os.environ.get("OUT")
    return Path(env) if env else DEFAULT_RESULTS


def wheels_dir(args: argparse.Namespace) -> Path | None:
    if args.wheels is not None:
        return Path(args.wheels)
    return DEFAULT_WHEELS if DEFAULT_WHEELS.is_dir() else None


# -- the environment -------------------------------------------------------------------
def cuda_state() -> tuple[bool, str]:
    """(whether a CUDA device is usable, one line saying what torch sees)."""
    try:
        import torch
    except ImportError as exc:
        return False, f"torch does not import ({exc})"
    built = torch.version.cuda
    if built is None:
        return False, f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} (CUDA {built}) finds no CUDA device"
    return True, f"torch {torch.__version__} (CUDA {built}), {torch.cuda.get_device_name(0)}"


def machine_note() -> dict[str, Any]:
    """What the results were measured on: the shared note with memory, GPU, driver,
    torch and cuFile."""
    note = harness.machine_note(memory=_memory_total())
    try:
        import torch

        note["torch"] = torch.__version__
        note["cuda"] = str(torch.version.cuda)
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            note["gpu"] = props.name
            note["gpu_memory"] = f"{props.total_memory / 2**30:.1f} GiB"
            note["capability"] = f"{props.major}.{props.minor}"
            note["gpus"] = str(torch.cuda.device_count())
    except ImportError as exc:
        note["torch"] = f"does not import ({exc})"
    note["driver"] = _nvidia_smi("driver_version")
    note["cufile"] = _cufile_note()
    return note


def _memory_total() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return "unknown"


def _nvidia_smi(query: str) -> str:
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found"
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=15, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed ({exc})"
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else "unknown"


def _cufile_note() -> str:
    """Where libcufile comes from, if anywhere (nvidia-cufile's wheel, or the system)."""
    try:
        from importlib.metadata import version

        return f"nvidia-cufile {version('nvidia-cufile')}"
    except Exception:  # PackageNotFoundError, or a broken distribution's metadata
        pass
    import ctypes.util

    found = ctypes.util.find_library("cufile")
    return f"system {found}" if found else "not found"


def child_env(site: Path | None) -> dict[str, str]:
    """The steps' environment: this checkout first on the path, then the carried wheels."""
    env = dict(os.environ)
    paths = [str(REPO)] + ([str(site)] if site is not None else [])
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# -- running a step --------------------------------------------------------------------
@dataclass(frozen=True)
class Finished:
    returncode: int | None
    timed_out: bool
    seconds: float


def run_bounded(command: Sequence[str], budget_s: float, env: dict[str, str], log: Path,
                title: str) -> Finished:
    """Run ``command`` from the repository root, output appended to ``log``; past
    ``budget_s`` its whole process group gets SIGTERM, then SIGKILL."""
    start = time.monotonic()
    with log.open("a") as sink:
        sink.write(f"\n===== {title}: {' '.join(command)} (budget {budget_s:.0f} s)\n")
        sink.flush()
        process = subprocess.Popen(
            list(command), cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            code: int | None = process.wait(timeout=budget_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(process)
            code = None
        seconds = time.monotonic() - start
        sink.write(f"===== {title}: "
                   f"{'timed out' if timed_out else f'exit status {code}'} after {seconds:.1f} s\n")
    return Finished(code, timed_out, seconds)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(name: str, budget_s: float, env: dict[str, str], log: Path, work: Path,
              quick: bool) -> tuple[Finished, dict[str, Any] | None]:
    """This script as ``--child name``; its JSON result, or ``None`` when it wrote none."""
    result = work / f"{name}.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, str(SCRIPT), "--child", name, "--result", str(result)]
    if quick:
        command.append("--quick")
    finished = run_bounded(command, budget_s, env, log, name)
    data = json.loads(result.read_text()) if result.exists() else None
    return finished, data


def pytest_command(paths: Sequence[str], keyword: str, junit: Path, basetemp: Path) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
               "--basetemp", str(basetemp), "--junitxml", str(junit), "-k", keyword]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command += ["--timeout", str(TEST_TIMEOUT_S)]
    return [*command, *paths]


def junit_counts(junit: Path) -> dict[str, Any]:
    """Counts and names from a JUnit XML file: passed, failed (failures and errors),
    skipped with their reasons."""
    root = ElementTree.parse(junit).getroot()
    failed: list[str] = []
    skipped: dict[str, int] = {}
    passed = 0
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")),
                       None)
        if outcome is None:
            passed += 1
        elif outcome.tag == "skipped":
            reason = _skip_reason(outcome)
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            failed.append(name)
    return {"passed": passed, "failed": failed, "skipped": skipped}


def _skip_reason(element: ElementTree.Element) -> str:
    """A skip's reason; a module skipped whole says only "collection skipped" in its
    message and puts ``(path, line, 'Skipped: reason')`` in its text."""
    message = (element.get("message") or "").strip()
    text = element.text or ""
    if message == "collection skipped" and "Skipped: " in text:
        reason = text.split("Skipped: ", 1)[1].strip()
        return reason[:-2] if reason.endswith(("')", '")')) else reason
    return message or "no reason given"


def pytest_step(name: str, paths: Sequence[str], keyword: str, budget_s: float,
                env: dict[str, str], log: Path, work: Path) -> StepResult:
    junit = work / f"{name}.xml"
    junit.unlink(missing_ok=True)
    basetemp = work / f"{name}-tmp"
    finished = run_bounded(pytest_command(paths, keyword, junit, basetemp), budget_s, env,
                           log, name)
    return judge_pytest(name, finished, junit if junit.exists() else None, budget_s)


def judge_pytest(name: str, finished: Finished, junit: Path | None,
                 budget_s: float) -> StepResult:
    """A pytest run's verdict: it fails on a failed test, a timeout, no report, or when
    every test skipped (on a CUDA machine these tests must run)."""
    counts = junit_counts(junit) if junit is not None else {}
    result = StepResult(name, "failed", "", finished.seconds, budget_s, counts)
    skipped = counts.get("skipped", {})
    skips = "; ".join(f"{n} skipped: {reason}" for reason, n in skipped.items())
    if finished.timed_out:
        result.status = "timed out"
        result.summary = f"killed after {budget_s:.0f} s (see {LOG_NAME})"
    elif not counts:
        result.summary = f"pytest wrote no report (exit status {finished.returncode})"
    elif counts["failed"]:
        result.summary = (f"{len(counts['failed'])} failed: {', '.join(counts['failed'][:5])}"
                          f"{' …' if len(counts['failed']) > 5 else ''}")
    elif counts["passed"] == 0:
        result.summary = f"no test ran ({skips or 'none collected'})"
    elif finished.returncode not in (0, None):
        result.summary = f"pytest exit status {finished.returncode} (see {LOG_NAME})"
    else:
        result.status = "passed"
        result.summary = f"{counts['passed']} passed" + (f"; {skips}" if skips else "")
    return result


# -- the steps, in the parent ----------------------------------------------------------
def step_wheels(wheels: Path | None, budget_s: float, log: Path, work: Path,
                env: dict[str, str]) -> tuple[StepResult, Path | None]:
    """Install ``wheels/*.whl`` with pip, no index, no dependencies, into ``work/site``."""
    found = sorted(wheels.glob("*.whl")) if wheels is not None else []
    if not found:
        where = wheels if wheels is not None else DEFAULT_WHEELS.relative_to(REPO)
        return StepResult("wheels", "skipped", f"skipped: no wheels in {where} "
                          "(docs/gpu-check.md says how to carry kvikio)", 0.0, budget_s), None
    site = work / "site"
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--no-compile", "--no-cache-dir", "--disable-pip-version-check", "--target",
               str(site), *map(str, found)]
    finished = run_bounded(command, budget_s, env, log, "wheels")
    names = [wheel.name.split("-")[0] for wheel in found]
    details = {"wheels": [wheel.name for wheel in found]}
    if finished.timed_out or finished.returncode != 0:
        what = "timed out" if finished.timed_out else f"pip exit status {finished.returncode}"
        return StepResult("wheels", "failed", f"installing {', '.join(names)}: {what}",
                          finished.seconds, budget_s, details), None
    return StepResult("wheels", "passed", f"installed {', '.join(names)}", finished.seconds,
                      budget_s, details), site


def step_kvikio(budget_s: float, env: dict[str, str], log: Path, work: Path) -> StepResult:
    start = time.monotonic()
    finished, info = run_child("kvikio-info", min(KVIKIO_INFO_BUDGET_S, budget_s), env, log,
                               work, quick=False)
    if info is None:
        what = "timed out" if finished.timed_out else f"exit status {finished.returncode}"
        return StepResult("kvikio", "failed", f"asking kvikio for its I/O path: {what}",
                          finished.seconds, budget_s)
    if info.get("unusable"):
        return StepResult("kvikio", "skipped", f"skipped: {info['unusable']}",
                          finished.seconds, budget_s, info)
    left = budget_s - (time.monotonic() - start)
    tests = pytest_step("kvikio", KVIKIO_TESTS, KVIKIO_KEYWORD, left, env, log, work)
    tests.details["kvikio"] = info
    tests.seconds = time.monotonic() - start
    tests.budget_s = budget_s
    tests.summary = f"I/O path: {info['io_path']}; {tests.summary}"
    return tests


def step_child(name: str, budget_s: float, env: dict[str, str], log: Path, work: Path,
               quick: bool, judge: Callable[[dict[str, Any]], StepResult]) -> StepResult:
    finished, data = run_child(name, budget_s, env, log, work, quick)
    if finished.timed_out:
        result = StepResult(name, "timed out", f"killed after {budget_s:.0f} s (see {LOG_NAME})")
    elif data is None:
        result = StepResult(name, "failed",
                            f"exit status {finished.returncode}, no result (see {LOG_NAME})")
    else:
        result = judge(data)
    result.seconds, result.budget_s = finished.seconds, budget_s
    return result


def judge_bench(data: dict[str, Any]) -> StepResult:
    """Failed when a row moved wrong bytes; a ratio under the target is reported, not
    failed: it is a finding about speed, not a broken path."""
    if data.get("error"):
        return StepResult("bench", "failed", data["error"], details=data)
    rows = data.get("rows", [])
    if not rows:
        return StepResult("bench", "failed", "no rows measured", details=data)
    wrong = [row for row in rows if not row["verified"]]
    if wrong:
        return StepResult("bench", "failed", f"{len(wrong)} of {len(rows)} rows moved wrong "
                          "bytes", details=data)
    default = [row for row in rows if row["batch"] == "default"]
    worst = min(default, key=lambda row: row["ratio"])
    below = sum(row["ratio"] < TARGET_RATIO for row in default)
    summary = (f"{len(rows)} rows, bytes verified; default batch: worst {worst['ratio']:.2f}x "
               f"({worst['geometry']}, {worst['slots']}, {worst['direction']}), "
               f"{below} of {len(default)} below {TARGET_RATIO}x")
    return StepResult("bench", "passed", summary, details=data)


def judge_demo(data: dict[str, Any]) -> StepResult:
    if data.get("error"):
        return StepResult("demo", "failed", data["error"], details=data)
    runs = data.get("runs", [])
    failed = [run for run in runs if run["status"] == "failed"]
    ran = [run for run in runs if run["status"] == "passed"]
    parts = [f"{run['config']}: {run['summary']}" for run in runs]
    if failed or not ran:
        return StepResult("demo", "failed", "; ".join(parts) or "nothing ran", details=data)
    return StepResult("demo", "passed", "; ".join(parts), details=data)


# -- the children ----------------------------------------------------------------------
def child_kvikio_info(work: Path) -> dict[str, Any]:
    """kvikio's version, whether GDS is available and which path CuFile takes, and
    kvtiers' own usability probe in ``work``."""
    from kvtiers.tiers.file.io import kvikio_status

    info: dict[str, Any] = {"io_path": "none"}
    try:
        kvikio = importlib.import_module("kvikio")
    except Exception as exc:  # ImportError, or an OSError from its native library
        info["unusable"] = f"kvikio does not import ({type(exc).__name__}: {exc})"
        return info
    info["version"] = getattr(kvikio, "__version__", "unknown")
    info.update(_kvikio_settings(kvikio))
    reason = kvikio_status(work)
    if reason is not None:
        info["unusable"] = reason
        return info
    info["io_path"] = io_path(info)
    return info


def io_path(info: dict[str, Any]) -> str:
    """Which path kvikio's ``CuFile`` takes, from its answers: compatibility mode when it
    prefers it (``KVIKIO_COMPAT_MODE=ON``, or ``AUTO`` without libcufile), or when cuFile
    loads but reports GDS unavailable (kvikio then falls back per file)."""
    preferred, gds = info.get("compat_mode_preferred"), info.get("gds_available")
    if preferred is True:
        return "kvikio compatibility mode (POSIX through bounce buffers)"
    if preferred is False and gds is True:
        return "GPUDirect Storage (cuFile)"
    if preferred is False and gds is False:
        return ("kvikio compatibility mode (libcufile loads, but cuFile reports GDS "
                "unavailable)")
    return "undetermined (see the kvikio answers below)"


def _kvikio_settings(kvikio: Any) -> dict[str, Any]:
    """What kvikio says about its I/O path; each question is optional across versions."""
    out: dict[str, Any] = {}

    def module(name: str) -> Any:
        return importlib.import_module(f"{kvikio.__name__}.{name}")

    questions: dict[str, Callable[[], Any]] = {
        "compat_mode": lambda: str(module("defaults").get("compat_mode")),
        "compat_mode_preferred": lambda: bool(module("defaults").is_compat_mode_preferred()),
        "gds_available": lambda: bool(module("cufile_driver").get("is_gds_available")),
        "libcufile": lambda: ".".join(map(str, module("cufile_driver").libcufile_version())),
    }
    for key, ask in questions.items():
        try:
            out[key] = ask()
        except Exception as exc:  # an older kvikio without this question, or no cuFile
            out[f"{key}_error"] = f"{type(exc).__name__}: {exc}"
    return out


def child_bench(quick: bool) -> dict[str, Any]:
    import torch

    repeats = 3 if quick else 5
    rows: list[dict[str, Any]] = []
    for label, layers, page_kib, per_chunk, job_mib in GEOMETRIES:
        job = (job_mib // 4 if quick else job_mib) << 20
        rows += bench_geometry(label, layers, page_kib << 10, per_chunk, job, repeats)
        torch.cuda.empty_cache()
    return {"rows": rows, "repeats": repeats, "quick": quick}


def bench_geometry(label: str, layers: int, page: int, per_chunk: int, job_bytes: int,
                   repeats: int) -> list[dict[str, Any]]:
    """Worker store and load vs the plain copy, fresh and scattered slots, per batch size.

    GPU blocks are drawn at random (as an engine's free list hands them out); stores read
    the first half of the drawn blocks and loads write the second half, so each round trip
    is checked on the GPU: the loaded blocks must equal the stored ones."""
    import numpy as np
    import torch

    from kvtiers.core.geometry import ChunkGeometry
    from kvtiers.core.specs import CPULoadStoreSpec, GPULoadStoreSpec, GroupTransfer
    from kvtiers.core.worker import KVCacheTensors, KVTensorRef
    from kvtiers.tiers.cpu.region import SlotRegion
    from kvtiers.tiers.cpu.worker import CpuWorker

    blocks = max(per_chunk, job_bytes // (layers * page))
    blocks -= blocks % per_chunk
    chunks = blocks // per_chunk
    moved = blocks * layers * page
    device = torch.device("cuda", 0)
    tensors = [torch.randint(0, 256, (2 * blocks, page), dtype=torch.uint8, device=device)
               for _ in range(layers)]
    kv = KVCacheTensors(tensors, [[KVTensorRef(i, page) for i in range(layers)]])
    geometry = ChunkGeometry(per_chunk, (layers * page,))
    region = SlotRegion(2 * chunks, geometry.slot_bytes)
    rows: list[dict[str, Any]] = []
    try:
        if not region.pinned:
            raise RuntimeError("the slot region was not host-registered (pinned)")
        host = region.tensor()
        host.fill_(1)  # fault every page in before timing
        rng = np.random.default_rng(0)
        order = rng.permutation(2 * blocks)
        store_ids, load_ids = order[:blocks], order[blocks:]
        spans = [host[i * blocks * page : (i + 1) * blocks * page] for i in range(layers)]

        def copy(store: bool) -> None:
            for tensor, span in zip(tensors, spans, strict=True):
                rows_view = tensor[:blocks].view(-1) if store else tensor[blocks:].view(-1)
                if store:
                    span.copy_(rows_view, non_blocking=True)
                else:
                    rows_view.copy_(span, non_blocking=True)
            torch.cuda.synchronize(device)

        for slots_kind in ("fresh", "scattered"):
            slots = (np.arange(chunks) if slots_kind == "fresh"
                     else rng.permutation(2 * chunks)[:chunks])
            spec = CPULoadStoreSpec(slots)
            store = [GroupTransfer(GPULoadStoreSpec(store_ids), spec)]
            load = [GroupTransfer(GPULoadStoreSpec(load_ids), spec)]
            for batch in BATCHES:
                options: dict[str, Any] = {} if batch is None else {"batch_bytes": batch}
                worker = CpuWorker(kv, region, geometry, **options)
                try:
                    rows += _bench_worker(worker, store, load, copy, moved, repeats, tensors,
                                          store_ids, load_ids, label, slots_kind, batch, page,
                                          per_chunk, layers)
                finally:
                    worker.shutdown()
    finally:
        region.close()
    return rows


def _bench_worker(worker: Any, store: list[Any], load: list[Any],
                  copy: Callable[[bool], None], moved: int, repeats: int, tensors: list[Any],
                  store_ids: Any, load_ids: Any, label: str, slots_kind: str,
                  batch: int | None, page: int, per_chunk: int, layers: int,
                  ) -> list[dict[str, Any]]:
    import torch

    jobs = iter(range(1 << 30))

    def run(is_store: bool) -> float:
        job = next(jobs)
        start = time.perf_counter()
        submit = worker.submit_store if is_store else worker.submit_load
        if not submit(job, store if is_store else load):
            raise RuntimeError(f"job {job} was refused")
        worker.wait([job])
        seconds = time.perf_counter() - start
        if not all(result.success for result in worker.get_finished()):
            raise RuntimeError(f"job {job} failed (see the log)")
        return seconds

    # Warm-up, and the check: loaded blocks equal the stored ones, every layer.
    for tensor in tensors:
        tensor[torch.as_tensor(load_ids, device=tensor.device)] = 0
    run(True)
    run(False)
    torch.cuda.synchronize()
    verified = all(
        torch.equal(tensor[torch.as_tensor(load_ids, device=tensor.device)],
                    tensor[torch.as_tensor(store_ids, device=tensor.device)])
        for tensor in tensors
    )
    copy(True)
    copy(False)
    rows = []
    for is_store in (True, False):
        worker_s, copy_s = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            copy(is_store)
            copy_s.append(time.perf_counter() - start)
            worker_s.append(run(is_store))
        worker_gbps = moved / statistics.median(worker_s) / 1e9
        copy_gbps = moved / statistics.median(copy_s) / 1e9
        rows.append({
            "geometry": label, "layers": layers, "page_bytes": page,
            "blocks_per_chunk": per_chunk, "slots": slots_kind,
            "direction": "GPU->CPU" if is_store else "CPU->GPU",
            "batch": "default" if batch is None else f"{batch >> 20} MiB",
            "mib": moved >> 20, "copy_gbps": round(copy_gbps, 2),
            "worker_gbps": round(worker_gbps, 2), "ratio": round(worker_gbps / copy_gbps, 3),
            "verified": verified,
        })
    return rows


def child_demo(work: Path, device: str = "cuda:0", quick: bool = False) -> dict[str, Any]:
    """``run_demo`` on the ``cpu-file`` example (and ``file-gds`` when kvikio is usable)
    with the simulated engine's KV tensors on ``device``. The CLI has no device option, so
    the engine class the demo builds is swapped for one that puts them there."""
    from kvtiers.engine import demo, simulator

    devices: set[str] = set()
    base = simulator.SimulatedEngine

    class DeviceEngine(base):  # type: ignore[valid-type, misc]
        def __init__(self, stack: Any, **options: Any) -> None:
            super().__init__(stack, device=device, **options)
            devices.update(str(tensor.device) for tensor in self.tensors)

    simulator.SimulatedEngine = DeviceEngine  # type: ignore[misc]
    try:
        return {"runs": _demo_runs(demo, work, devices, device, quick)}
    finally:
        simulator.SimulatedEngine = base  # type: ignore[misc]


def _demo_runs(demo: Any, work: Path, devices: set[str], device: str,
               quick: bool) -> list[dict[str, Any]]:
    from kvtiers.engine.workload import WorkloadSpec
    from kvtiers.tiers.file.io import kvikio_status

    runs: list[dict[str, Any]] = []
    workload = WorkloadSpec(conversations=4, turns=2) if quick else WorkloadSpec()
    kvikio_reason = kvikio_status(work)
    for config in ("cpu-file", "file-gds"):
        if config == "file-gds" and kvikio_reason is not None:
            runs.append({"config": config, "status": "skipped",
                         "summary": f"skipped: kvikio unusable ({kvikio_reason})"})
            continue
        devices.clear()
        printed = io.StringIO()
        try:
            phases = demo.run_demo(config, out_dir=work / f"demo-{config}", plot=None,
                                   out=printed, show_progress=False, workload=workload)
        except Exception as exc:
            lines = printed.getvalue().strip().splitlines()
            runs.append({"config": config, "status": "failed",
                         "summary": f"{type(exc).__name__}: {exc}",
                         "verdict": lines[-1] if lines else ""})
            continue
        lines = printed.getvalue().strip().splitlines()
        if devices != {device}:
            runs.append({"config": config, "status": "failed",
                         "summary": f"the engine's tensors were on {sorted(devices)}"})
            continue
        loaded = sum(r.loaded_bytes for phase in phases for r in phase.reports)
        load_s = sum(r.load_s for phase in phases for r in phase.reports)
        reused = [phase.reused_tokens for phase in phases]
        runs.append({
            "config": config, "status": "passed", "verdict": lines[-1] if lines else "",
            "summary": (f"verified, {sum(phase.verification_failures for phase in phases)} "
                        f"wrong bytes; reused tokens per phase {reused}; loads "
                        f"{loaded / load_s / 1e9 if load_s else 0:.2f} GB/s"),
            "phases": [{"name": phase.name, "prompt_tokens": phase.prompt_tokens,
                        "reused_tokens": phase.reused_tokens, "seconds": round(phase.seconds, 2),
                        "verification_failures": phase.verification_failures}
                       for phase in phases],
            "output": printed.getvalue()[-4000:],
        })
    return runs


# -- route 1's worker as vLLM's connector drives it, on a KV cache as vLLM allocates it --
#: The KV cache of the ``vllm-worker`` child: layers (one tensor each, shared by both KV
#: groups as vLLM's hybrid allocator shares them), blocks, and a page per block and layer
#: (on CUDA: 64 blocks of 64 KiB, 4 MiB per layer, two 2 MiB granules committed apart).
VLLM_LAYERS = 4
VLLM_BLOCKS = 64
VLLM_PAGE_BYTES = {"cuda": 64 << 10, "cpu": 256}
#: Two KV groups of different block sizes (vLLM group ids 0 and 2), two blocks a chunk.
VLLM_TOKENS_PER_BLOCK = (16, 32)
VLLM_GROUP_IDS = (0, 2)
VLLM_BLOCKS_PER_CHUNK = 2
VLLM_TOKENS_PER_HASH = 16
VLLM_TOKENS = 256  # group 0: 16 blocks in 8 chunks; group 1: 8 blocks in 4 chunks
#: The first logical block each group's load starts from: group 0 mid-chunk.
VLLM_LOAD_FROM = (3, 2)


def part(status: str, summary: str, **details: Any) -> dict[str, Any]:
    """One part of a child's result: passed, failed or skipped, with one line."""
    return {"status": status, "summary": summary, **details}


class VirtualKVCache:
    """Device memory laid out as vLLM 0.34 lays out its KV cache by default: one virtual
    address range reserved for every layer's blocks (``cuMemAddressReserve``), physical
    memory created (``cuMemCreate``) and mapped into it in two commits, as vLLM commits a
    prefix for warmup and the rest once it has sized the cache, so one layer's blocks span
    two physical allocations. Uses the CUDA driver API through ctypes; the memory lives
    until :meth:`close`."""

    _PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
    _DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
    _READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    def __init__(self, layer_bytes: int, layers: int, device_index: int) -> None:
        import ctypes

        class Location(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

        class AllocFlags(ctypes.Structure):
            _fields_ = [("compression", ctypes.c_ubyte), ("rdma", ctypes.c_ubyte),
                        ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]

        class Prop(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int),
                        ("location", Location), ("win32", ctypes.c_void_p),
                        ("flags", AllocFlags)]

        class Access(ctypes.Structure):
            _fields_ = [("location", Location), ("flags", ctypes.c_int)]

        self._ctypes = ctypes
        self._cuda = ctypes.CDLL("libcuda.so.1")
        self._prop = Prop(type=self._PINNED, location=Location(self._DEVICE, device_index))
        self._access = Access(location=Location(self._DEVICE, device_index),
                              flags=self._READ_WRITE)
        granularity = ctypes.c_size_t()
        self._call("cuMemGetAllocationGranularity", ctypes.byref(granularity),
                   ctypes.byref(self._prop), 0)
        self.granularity = granularity.value
        self.layer_bytes = layer_bytes
        # Each layer's segment starts on a granule, as vLLM's per-layer segments do.
        self.stride = -(-layer_bytes // self.granularity) * self.granularity
        self.size = self.stride * layers
        self.layers = layers
        self._handles: list[tuple[int, int]] = []  # (address, size) mapped, with handles
        self._physical: list[int] = []
        base = ctypes.c_uint64()
        self._call("cuMemAddressReserve", ctypes.byref(base), ctypes.c_size_t(self.size),
                   ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0))
        self.base = base.value
        try:
            for first in (True, False):  # the warmup prefix of every layer, then the rest
                for layer in range(layers):
                    half = self.stride // 2 // self.granularity * self.granularity
                    start, end = (0, half) if first else (half, self.stride)
                    if end > start:
                        self._commit(self.base + layer * self.stride + start, end - start)
        except BaseException:
            self.close()
            raise

    def _call(self, name: str, *args: Any) -> None:
        status = getattr(self._cuda, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name} failed with CUresult {status}")

    def _commit(self, address: int, size: int) -> None:
        ctypes = self._ctypes
        handle = ctypes.c_uint64()
        self._call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size),
                   ctypes.byref(self._prop), ctypes.c_uint64(0))
        self._physical.append(handle.value)
        self._call("cuMemMap", ctypes.c_uint64(address), ctypes.c_size_t(size),
                   ctypes.c_size_t(0), ctypes.c_uint64(handle.value), ctypes.c_uint64(0))
        self._handles.append((address, size))
        self._call("cuMemSetAccess", ctypes.c_uint64(address), ctypes.c_size_t(size),
                   ctypes.byref(self._access), ctypes.c_size_t(1))

    def layer(self, index: int, device: Any) -> Any:
        """Layer ``index``'s bytes as a uint8 tensor on ``device``, aliasing the mapped
        memory (valid until :meth:`close`)."""
        import torch

        interface = {"shape": (self.layer_bytes,), "typestr": "|u1", "version": 3,
                     "data": (self.base + index * self.stride, False), "strides": None}
        array = type("MappedLayer", (), {"__cuda_array_interface__": interface})()
        return torch.as_tensor(array, device=device)

    def close(self) -> None:
        """Unmap and release the physical memory, then free the reservation (idempotent)."""
        ctypes = self._ctypes
        for address, size in self._handles:
            self._cuda.cuMemUnmap(ctypes.c_uint64(address), ctypes.c_size_t(size))
        for handle in self._physical:
            self._cuda.cuMemRelease(ctypes.c_uint64(handle))
        self._handles, self._physical = [], []
        if getattr(self, "base", 0):
            self._cuda.cuMemAddressFree(ctypes.c_uint64(self.base), ctypes.c_size_t(self.size))
            self.base = 0


def allocate_kv_cache(device: str, layers: int, blocks: int, page: int,
                      keep: list[Any]) -> tuple[list[Any], str]:
    """``layers`` int8 tensors of ``(blocks, page)`` on ``device``, random bytes, and how
    they were allocated. On CUDA as vLLM 0.34 allocates its KV cache by default: with
    vLLM's own ``ExtensibleTensor`` when vLLM 0.34 imports, else with
    :class:`VirtualKVCache`; both commit a prefix first and the rest after. What must
    stay alive with the tensors is appended to ``keep``."""
    import torch

    layer_bytes = blocks * page
    if not device.startswith("cuda"):
        tensors = [torch.randint(-128, 128, (blocks, page), dtype=torch.int8)
                   for _ in range(layers)]
        return tensors, f"torch tensors on {device}"
    index = torch.device(device).index or 0
    torch.cuda.init()
    torch.empty(1, device=device)  # the primary context, current for the driver calls
    try:
        views, how = _virtual_layers(device, index, layers, layer_bytes, keep)
    except RuntimeError as exc:  # no VMM support: vLLM 0.34 then allocates through torch
        views = [torch.empty(layer_bytes, dtype=torch.uint8, device=device)
                 for _ in range(layers)]
        how = f"torch tensors: virtual memory failed here ({exc}), where vLLM 0.34 does the same"
    tensors = [view.view(torch.int8).view(blocks, page) for view in views]
    generator = torch.Generator(device=device).manual_seed(0)
    for tensor in tensors:
        tensor.copy_(torch.randint(-128, 128, (blocks, page), dtype=torch.int8,
                                   device=device, generator=generator))
    return tensors, how


def _virtual_layers(device: str, index: int, layers: int, layer_bytes: int,
                    keep: list[Any]) -> tuple[list[Any], str]:
    """Each layer's bytes in one virtual-memory reservation, committed a prefix first and
    then the rest; with vLLM's ``ExtensibleTensor`` where it imports."""
    try:
        from vllm.utils.extensible_tensor import ExtensibleTensor
        from vllm.utils.vmm_driver import vmm_unavailable_reason
    except ImportError as exc:
        own = VirtualKVCache(layer_bytes, layers, index)
        keep.append(own)
        return [own.layer(i, device) for i in range(layers)], (
            f"cuMemAddressReserve, then cuMemCreate + cuMemMap in two commits of "
            f"{own.granularity >> 20} MiB granules, as vLLM 0.34 allocates (its "
            f"ExtensibleTensor does not import here: {exc})")
    reason = vmm_unavailable_reason()  # vLLM's own test before it reserves the KV cache
    if reason is not None:
        raise RuntimeError(reason)
    reserved = ExtensibleTensor(layer_bytes * layers, device, num_segments=layers)
    keep.append(reserved)
    reserved.resize_per_segment_(layer_bytes // 2)
    reserved.resize_per_segment_(layer_bytes)
    return [reserved.segment_view(i) for i in range(layers)], (
        "vLLM's ExtensibleTensor: virtual memory reserved, a prefix then the rest committed "
        f"({reserved.physical_bytes >> 20} MiB mapped)")


def child_vllm_worker(work: Path, device: str = "cuda:0") -> dict[str, Any]:
    """The ``vllm-worker`` step: the KV cache allocated as vLLM 0.34 allocates it
    (:func:`allocate_kv_cache`), route 1's worker driven on it as the installed vLLM's
    connector drives it (:func:`route1_worker_part`), and kvikio on it
    (:func:`kvikio_vmm_part`). Each part is passed, failed or skipped with one line."""
    keep: list[Any] = []
    kind = "cuda" if device.startswith("cuda") else "cpu"
    page = VLLM_PAGE_BYTES[kind]
    try:
        tensors, allocation = allocate_kv_cache(device, VLLM_LAYERS, VLLM_BLOCKS, page, keep)
        return {
            "allocation": allocation,
            "worker": route1_worker_part(tensors, page),
            "kvikio": (kvikio_vmm_part(tensors, work) if kind == "cuda"
                       else part("skipped", f"skipped: the KV cache is on {device}")),
        }
    finally:
        for owner in keep:
            if isinstance(owner, VirtualKVCache):
                owner.close()


def route1_worker_part(tensors: list[Any], page: int) -> dict[str, Any]:
    """Store chunks and load them back through route 1's worker the way the installed
    vLLM's connector submits jobs: vLLM 0.34 resolves each ``GPULoadStoreSpec`` to
    ``DevicePointers`` with its own ``resolve_device_pointers`` over the canonical KV
    caches; 0.32 and 0.33 hand the spec itself. Two KV groups of different block sizes,
    stores from the second chunk on (a non-zero ``block_indices``), a load starting
    mid-chunk into other blocks, every byte compared per group, block and layer; between
    them a job addressing memory outside the KV cache, which must fail (``success=False``)
    and leave the worker working."""
    try:
        import vllm
        from vllm.v1.kv_offload import base as vbase

        from kvtiers.integrations.vllm.version import check_vllm_version

        version = check_vllm_version(str(vllm.__version__))
    except Exception as exc:  # not installed, a broken install, or an unsupported release
        return part("skipped", f"skipped: vLLM is not usable here ({type(exc).__name__}: "
                    f"{exc}); carry its wheel in .whl (docs/gpu-check.md)")
    resolve: Callable[[Any, Any], Any] | None
    try:
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

        resolve = resolve_device_pointers
    except ImportError:
        resolve = None
    interface = "DevicePointers" if resolve is not None else "GPULoadStoreSpec"
    try:
        checked = _drive_route1(vbase, tensors, page, resolve)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        return part("failed", f"vLLM {version}, {interface}: {type(exc).__name__}: {exc}",
                    vllm=version, interface=interface)
    return part("passed", f"vLLM {version}, {interface}: {checked}", vllm=version,
                interface=interface)


def _route1_config(vbase: Any, page: int, capacity: int) -> Any:
    import uuid

    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(tokens_per_block=tpb, layer_names=(f"l{gid}",),
                                  group_id=gid)
            for tpb, gid in zip(VLLM_TOKENS_PER_BLOCK, VLLM_GROUP_IDS, strict=True)
        ),
        worker_kv_bytes_per_block=VLLM_LAYERS * page,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "KVTiersOffloadingSpec",
            "spec_module_path": "kvtiers.integrations.vllm",
            "kvtiers": {"tiers": [{"kind": "cpu", "capacity": capacity}]},
            # Built without an engine: the identity holds what this config carries.
            "kvtiers_identity": "offloading-config-only",
        },
        engine_id=f"gpu-check-{uuid.uuid4().hex}",
        model=OffloadingModelConfig(name="gpu-check/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=VLLM_TOKENS_PER_HASH,
                                    blocks_per_chunk=VLLM_BLOCKS_PER_CHUNK),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def _drive_route1(vbase: Any, tensors: list[Any], page: int,
                  resolve: Callable[[Any, Any], Any] | None) -> str:
    """:func:`route1_worker_part`'s run; raises on anything that is not as it must be."""
    import numpy as np
    import torch
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    f = VLLM_BLOCKS_PER_CHUNK
    chunks = sum(VLLM_TOKENS // (tpb * f) for tpb in VLLM_TOKENS_PER_BLOCK)
    # Slots for every chunk, each the groups' pages of all layers, rounded up generously.
    config = _route1_config(vbase, page, capacity=2 * chunks * f * VLLM_LAYERS * page + (1 << 20))
    kv_caches = vbase.CanonicalKVCaches(
        tensors=[vbase.CanonicalKVCacheTensor(t, page) for t in tensors],
        group_data_refs=[[vbase.CanonicalKVCacheRef(i, page) for i in range(len(tensors))]
                         for _ in VLLM_GROUP_IDS],
    )
    # As in vLLM, the scheduler's spec and the worker's are separate instances.
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    worker = OffloadingSpecFactory.create_spec(config).get_worker(kv_caches)

    def device_side(block_ids: list[list[int]], first: Sequence[int]) -> Any:
        spec = vbase.GPULoadStoreSpec([b for ids in block_ids for b in ids],
                                      group_sizes=[len(ids) for ids in block_ids],
                                      block_indices=list(first))
        return spec if resolve is None else resolve(spec, kv_caches)

    def finish(job: int) -> Any:
        results = worker.get_finished()
        if not any(r.job_id == job for r in results):
            worker.wait({job})
            results += worker.get_finished()
        found = [r for r in results if r.job_id == job]
        if len(found) != 1:
            raise RuntimeError(f"job {job}: {len(found)} results")
        return found[0]

    try:
        rng = np.random.default_rng(0)
        hashes = [rng.bytes(16) for _ in range(VLLM_TOKENS // VLLM_TOKENS_PER_HASH)]
        free = [int(b) for b in rng.permutation(VLLM_BLOCKS)]  # as an engine's free list
        keys, blocks = [], []
        for tpb, gid in zip(VLLM_TOKENS_PER_BLOCK, VLLM_GROUP_IDS, strict=True):
            per_chunk = tpb * f // VLLM_TOKENS_PER_HASH
            keys.append([vbase.make_offload_key(hashes[(c + 1) * per_chunk - 1], gid)
                         for c in range(VLLM_TOKENS // (tpb * f))])
            blocks.append([free.pop() for _ in range(VLLM_TOKENS // tpb)])
        originals = [t.clone() for t in tensors]
        ctx = vbase.ReqContext(req_id="gpu-check")
        manager.on_new_request(ctx)

        # Store every chunk but each group's first: the blocks from logical block f on.
        stored = [k for group in keys for k in group[1:]]
        out = manager.prepare_store(stored, ctx)
        if out is None or list(out.keys_to_store) != stored:
            raise RuntimeError(f"prepare_store accepted {out and len(out.keys_to_store)} of "
                               f"{len(stored)} keys")
        if not worker.submit_store(1, device_side([b[f:] for b in blocks], (f, f)),
                                   out.store_spec):
            raise RuntimeError("the store was not accepted")
        result = finish(1)
        if not result.success:
            raise RuntimeError("the store failed")
        manager.complete_store(stored, ctx)

        # Load from VLLM_LOAD_FROM (group 0 mid-chunk) into blocks never stored from.
        wanted = [k for g, first in enumerate(VLLM_LOAD_FROM) for k in keys[g][first // f:]]
        src = manager.prepare_load(wanted, ctx)
        dst = [[free.pop() for _ in blocks[g][first:]] for g, first in enumerate(VLLM_LOAD_FROM)]
        for tensor in tensors:
            tensor[torch.as_tensor([b for ids in dst for b in ids], device=tensor.device)] = 0

        # A job that addresses memory outside the KV cache fails and breaks nothing.
        outside = torch.zeros((2, page), dtype=torch.int8, device=tensors[0].device)
        bad = device_side(dst, VLLM_LOAD_FROM)
        if hasattr(bad, "ptrs"):  # DevicePointers: one address outside every KV tensor
            bad.ptrs = bad.ptrs.copy()
            bad.ptrs[0] = outside.data_ptr()
        else:  # block ids: one past the KV cache's last block
            bad = device_side([[VLLM_BLOCKS, *ids[1:]] for ids in dst], VLLM_LOAD_FROM)
        if not worker.submit_load(2, src, bad):
            raise RuntimeError("the submission of a bad job was refused outright (vLLM "
                               "asserts it is accepted)")
        if finish(2).success:
            raise RuntimeError("a job addressing memory outside the KV cache succeeded")

        if not worker.submit_load(3, src, device_side(dst, VLLM_LOAD_FROM)):
            raise RuntimeError("the load was not accepted")
        if not finish(3).success:
            raise RuntimeError("the load failed")
        manager.complete_load(wanted, ctx)
        manager.on_request_finished(ctx)
        if tensors[0].is_cuda:
            torch.cuda.synchronize(tensors[0].device)
        wrong = [
            (g, s, d, layer)
            for g, first in enumerate(VLLM_LOAD_FROM)
            for s, d in zip(blocks[g][first:], dst[g], strict=True)
            for layer, (tensor, original) in enumerate(zip(tensors, originals, strict=True))
            if not torch.equal(tensor[d], original[s])
        ]
        if wrong:
            raise RuntimeError(f"{len(wrong)} loaded blocks differ from the stored ones "
                               f"(group, from, to, layer: {wrong[:4]})")
        if not torch.equal(outside, torch.zeros_like(outside)):
            raise RuntimeError("the refused job wrote outside the KV cache")
    finally:
        worker.shutdown()
        manager.shutdown()
    moved = sum(len(ids) for ids in dst) * VLLM_LAYERS * page
    return (f"{len(stored)} chunks stored from block {f} on, "
            f"{sum(len(ids) for ids in dst)} blocks loaded from blocks {list(VLLM_LOAD_FROM)} "
            f"({moved >> 10} KiB), every byte as stored; a job outside the KV cache failed")


def kvikio_vmm_part(tensors: list[Any], work: Path) -> dict[str, Any]:
    """kvikio on the virtual-memory KV cache: ``memory_register`` of a layer (cuFile
    registration where GDS is in use, a no-op in compatibility mode), then a layer written
    to a file and read back into another, and a span of blocks across the two commits'
    boundary written from and read into device memory at block offsets, byte-exact."""
    import torch

    from kvtiers.tiers.file.io import kvikio_status

    reason = kvikio_status(work)
    if reason is not None:
        return part("skipped", f"skipped: kvikio unusable ({reason})")
    kvikio = importlib.import_module("kvikio")
    settings = _kvikio_settings(kvikio)
    path = io_path(settings)
    registration = _kvikio_registration(kvikio)
    first, last = tensors[0], tensors[-1]
    nbytes = first.numel()
    notes: list[str] = []
    try:
        if registration is None:
            notes.append("this kvikio has no memory_register")
        else:
            register, deregister = registration
            register(first)
            deregister(first)
            notes.append("memory_register and memory_deregister of a layer succeeded")
        original = first.clone()
        target = work / "kvikio-vmm.bin"
        with kvikio.CuFile(str(target), "w") as f:
            written = f.pwrite(first).get()
        last.zero_()
        with kvikio.CuFile(str(target), "r") as f:
            read = f.pread(last).get()
        torch.cuda.synchronize(first.device)
        if written != nbytes or read != nbytes or not torch.equal(last, original):
            return part("failed", f"{path}: a layer round trip moved {written} / {read} of "
                        f"{nbytes} bytes or changed them", io_path=path, **settings)
        # Blocks around the middle, where the prefix commit ends.
        middle = first.shape[0] // 2
        span = slice(middle - 2, middle + 2)
        with kvikio.CuFile(str(target), "w") as f:
            written = f.pwrite(first[span], file_offset=4096).get()
        last[span] = 0
        with kvikio.CuFile(str(target), "r") as f:
            read = f.pread(last[span], file_offset=4096).get()
        torch.cuda.synchronize(first.device)
        span_bytes = last[span].numel()
        if written != span_bytes or read != span_bytes or not torch.equal(last[span],
                                                                          original[span]):
            return part("failed", f"{path}: blocks across the commit boundary: "
                        f"{written} / {read} of {span_bytes} bytes moved, or changed",
                        io_path=path, **settings)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        done = "".join(f"{note}; " for note in notes)
        return part("failed", f"{path}: {done}{type(exc).__name__}: {exc}", io_path=path,
                    **settings)
    notes.append(f"a layer ({nbytes >> 20} MiB) and 4 blocks across the commit boundary "
                 "written and read back byte-exact")
    return part("passed", f"{path}: " + "; ".join(notes), io_path=path, **settings)


def _kvikio_registration(kvikio: Any) -> tuple[Callable[[Any], None],
                                               Callable[[Any], None]] | None:
    """kvikio's ``memory_register`` and ``memory_deregister`` (``kvikio.buffer`` in recent
    releases, the package itself in older ones), or ``None``."""
    for name in (f"{kvikio.__name__}.buffer", kvikio.__name__):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        register = getattr(module, "memory_register", None)
        deregister = getattr(module, "memory_deregister", None)
        if register is not None and deregister is not None:
            return register, deregister
    return None


def judge_vllm_worker(data: dict[str, Any]) -> StepResult:
    """Failed when a part failed, skipped when every part skipped, else passed."""
    if data.get("error"):
        return StepResult("vllm-worker", "failed", data["error"], details=data)
    parts = {name: data[name] for name in ("worker", "kvikio") if name in data}
    summary = "; ".join(
        [f"allocation: {data.get('allocation', '?')}"]
        + [f"{name}: {p['summary']}" for name, p in parts.items()]
    )
    statuses = {p["status"] for p in parts.values()}
    if "failed" in statuses or not parts:
        status = "failed"
    elif statuses == {"skipped"}:
        status = "skipped"
    else:
        status = "passed"
    return StepResult("vllm-worker", status, summary, details=data)


def child_main(args: argparse.Namespace) -> int:
    """Run one child step and write its result as JSON (an exception is the result)."""
    work = Path(args.result).parent
    data: dict[str, Any]
    try:
        if args.child == "kvikio-info":
            data = child_kvikio_info(work)
        elif args.child == "vllm-worker":
            data = child_vllm_worker(work)
        elif args.child == "bench":
            data = child_bench(args.quick)
        else:
            data = child_demo(work, quick=args.quick)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        data = {"error": f"{type(exc).__name__}: {exc}"}
    Path(args.result).write_text(json.dumps(data, indent=2, default=str) + "\n")
    return EXIT_OK


# -- the report ------------------------------------------------------------------------
def verdict(results: Sequence[StepResult]) -> tuple[bool, str]:
    bad = [r for r in results if r.status in ("failed", "timed out")]
    counts = {status: sum(r.status == status for r in results)
              for status in ("passed", "skipped", "failed", "timed out")}
    tally = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    if bad:
        return False, f"FAILED ({tally}): " + "; ".join(f"{r.name} {r.status}" for r in bad)
    return True, f"PASSED ({tally})"


def render(note: dict[str, Any], command: str, results: Sequence[StepResult]) -> str:
    _, line = verdict(results)
    gpu = note.get("gpu", "no GPU")
    lines = [
        "# GPU check",
        "",
        f"Machine: {gpu} ({note.get('gpu_memory', '?')}, compute capability "
        f"{note.get('capability', '?')}, driver {note.get('driver', '?')}), torch "
        f"{note.get('torch', '?')} (CUDA {note.get('cuda', '?')}), cuFile: "
        f"{note.get('cufile', '?')}; CPU {note.get('cpu', '?')}, {note.get('cores', '?')} cores, "
        f"{note.get('memory', '?')} memory; Python {note.get('python', '?')}; {note.get('date')}.",
        f"Command: `{command}`",
        "",
        f"Verdict: {line}",
        "",
        "| step | status | seconds | budget | summary |",
        "|---|---|---:|---:|---|",
    ]
    for r in results:
        summary = r.summary.replace("|", "/")
        lines.append(f"| {r.name} | {r.status} | {r.seconds:.1f} | {r.budget_s:.0f} | {summary} |")
    by_name = {r.name: r for r in results}
    if "bench" in by_name and by_name["bench"].details.get("rows"):
        lines += ["", *render_bench(by_name["bench"].details["rows"])]
    kvikio = by_name.get("kvikio")
    if kvikio is not None:
        info = kvikio.details.get("kvikio", kvikio.details)
        lines += ["", "## kvikio", ""]
        lines += [f"- {key}: {value}" for key, value in info.items()
                  if key not in ("passed", "failed", "skipped")] or ["- nothing asked"]
    route1 = by_name.get("vllm-worker")
    if route1 is not None and route1.details.get("allocation"):
        lines += ["", "## Route 1's worker and kvikio on a KV cache allocated as vLLM's", "",
                  f"- allocation: {route1.details['allocation']}"]
        for name in ("worker", "kvikio"):
            found = route1.details.get(name)
            if found:
                lines.append(f"- {name}: {found['status']}: {found['summary']}")
    demo = by_name.get("demo")
    if demo is not None and demo.details.get("runs"):
        lines += ["", "## Demo with the KV cache in CUDA tensors", ""]
        for run in demo.details["runs"]:
            lines.append(f"- `{run['config']}`: {run['status']}: {run['summary']}")
            if run.get("verdict"):
                lines.append(f"  - {run['verdict']}")
    failures = [r for r in results if r.details.get("failed")]
    if failures:
        lines += ["", "## Failed tests", ""]
        for r in failures:
            lines += [f"- {r.name}: {name}" for name in r.details["failed"]]
    lines += ["", f"Every step's output is in `{LOG_NAME}` beside this file.", ""]
    return "\n".join(lines)


def render_bench(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        f"## Throughput: worker vs a plain copy_(non_blocking=True) (target >= {TARGET_RATIO}x)",
        "",
        "One group, GPU blocks drawn at random; `fresh`: consecutive slots, `scattered`: random "
        "slots. The plain copy moves the same bytes between the same KV tensors and the same "
        "pinned region, one contiguous copy per layer. Medians; the worker's time is submit to "
        "wait.",
        "",
        "| geometry | page | blocks/chunk | MiB | slots | direction | batch | copy GB/s | "
        "worker GB/s | ratio |",
        "|---|---:|---:|---:|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['geometry']} | {r['page_bytes'] >> 10} KiB | {r['blocks_per_chunk']} | "
            f"{r['mib']} | {r['slots']} | {r['direction']} | {r['batch']} | "
            f"{r['copy_gbps']:.1f} | {r['worker_gbps']:.1f} | {r['ratio']:.2f}x |"
        )
    return lines


def write_report(out: Path, note: dict[str, Any], command: str,
                 results: Sequence[StepResult], log: Path | None) -> tuple[Path, Path]:
    """``gpu.md``, ``gpu.json`` (the result schema: the steps a table, the verdict in
    ``extra``) and the trimmed log into ``out``."""
    ok, line = verdict(results)
    # Steps' details may hold paths and other objects JSON has no type for: as text.
    steps = json.loads(json.dumps([asdict(r) for r in results], default=str))
    doc = harness.result("gpu_check", note, parameters={"command": command},
                         tables={"steps": steps}, extra={"passed": ok, "verdict": line})
    js, md = harness.write_result(doc, out, Path(REPORT_JSON).stem,
                                  render(note, command, results))
    if log is not None and log.exists():
        copy_trimmed(log, out / LOG_NAME)
    return md, js


def copy_trimmed(source: Path, target: Path, limit: int = LOG_LIMIT_BYTES) -> None:
    """Copy ``source``; past ``limit`` bytes keep its first and last halves."""
    data = source.read_bytes()
    if len(data) > limit:
        half = limit // 2
        marker = f"\n[... {len(data) - limit} bytes left out ...]\n".encode()
        data = data[:half] + marker + data[-half:]
    target.write_bytes(data)


# -- main ------------------------------------------------------------------------------
def dry_run(args: argparse.Namespace, steps: Sequence[Step]) -> int:
    """Check imports and files; print what a run would do."""
    problems = []
    for module in STEP_IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as exc:
            problems.append(f"import {module}: {type(exc).__name__}: {exc}")
    for path in {*KVIKIO_TESTS, CUDA_TESTS}:
        if not (REPO / path).is_file():
            problems.append(f"{path} is missing")
    usable, state = cuda_state()
    wheels = wheels_dir(args)
    found = sorted(wheels.glob("*.whl")) if wheels is not None else []
    kvtiers = sys.modules.get("kvtiers")
    print(f"gpu_check: dry run; {state}; kvtiers from "
          f"{Path(kvtiers.__file__).parent if kvtiers and kvtiers.__file__ else 'nowhere'}; "
          f"results would go to {out_dir(args)}")
    print(f"gpu_check: wheels: {', '.join(w.name for w in found) or 'none'}")
    for step in steps:
        print(f"gpu_check: would run {step.name} (budget {step.budget_s} s): {step.what}")
    for problem in problems:
        print(f"gpu_check: problem: {problem}")
    if problems:
        return EXIT_FAILED
    print(f"gpu_check: dry run ok ({len(STEP_IMPORTS)} imports, "
          f"{'CUDA device present' if usable else 'no CUDA device'})")
    return EXIT_OK


def run_steps(args: argparse.Namespace, steps: Sequence[Step], work: Path,
              log: Path) -> list[StepResult]:
    deadline = time.monotonic() + args.budget_s
    env = child_env(None)
    results: list[StepResult] = []
    for step in steps:
        left = deadline - time.monotonic()
        budget = min(step.budget_s, left)
        if budget < MIN_STEP_S:
            result = StepResult(step.name, "skipped",
                                f"skipped: {left:.0f} s of the run's budget left", 0.0, 0.0)
        elif step.name == "wheels":
            result, site = step_wheels(wheels_dir(args), budget, log, work, env)
            env = child_env(site)
        elif step.name == "cuda-tests":
            result = pytest_step(step.name, (CUDA_TESTS,), CUDA_KEYWORD, budget, env, log, work)
        elif step.name == "kvikio":
            result = step_kvikio(budget, env, log, work)
        elif step.name == "vllm-worker":
            result = step_child("vllm-worker", budget, env, log, work, args.quick,
                                judge_vllm_worker)
        elif step.name == "bench":
            result = step_child("bench", budget, env, log, work, args.quick, judge_bench)
        else:
            result = step_child("demo", budget, env, log, work, args.quick, judge_demo)
        results.append(result)
        print(f"gpu_check: {result.name}: {result.status} ({result.seconds:.1f} s): "
              f"{result.summary}", flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # kvtiers comes from this checkout, whatever is installed (the children get the same
    # through PYTHONPATH).
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    if args.child:
        return child_main(args)
    steps = chosen_steps(args)
    if args.dry_run:
        return dry_run(args, steps)
    usable, state = cuda_state()
    if not usable:
        print(f"gpu_check: no CUDA device: {state}; nothing to check (--dry-run checks the "
              "script alone)")
        return EXIT_NO_CUDA
    command = " ".join(["python benchmarks/gpu_check.py", *(argv or sys.argv[1:])]).strip()
    note = machine_note()
    out = out_dir(args)
    with tempfile.TemporaryDirectory(prefix="kvtiers-gpu-check-") as scratch:
        work = Path(scratch)
        log = work / LOG_NAME
        log.write_text(f"gpu_check: {state}\n")
        results = run_steps(args, steps, work, log)
        md, _ = write_report(out, note, command, results, log)
    ok, line = verdict(results)
    print(f"gpu_check: {line}; report: {md}")
    return EXIT_OK if ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
