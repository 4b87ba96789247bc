"""The seam report (:mod:`kvtiers.integrations.vllm_seams`) and ``make vllm-compat``.

Most tests describe local stand-in classes (their ``__module__`` set to a ``vllm.``
module, which is what marks a class as vLLM's) and compare hand-written snapshots, so they
need no vLLM; the last ones read the installed vLLM against the packaged baseline.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple, Optional

import pytest

from kvtiers.integrations import vllm_seams as seams
from kvtiers.integrations.vllm_seams import MemberChange, SeamChange, Status

REPO = Path(__file__).resolve().parent.parent


# --- describing -----------------------------------------------------------------------


def test_signature_reads_the_same_for_string_and_object_annotations() -> None:
    def as_strings(job_id, spec=None, *, expedited=False):  # type: ignore[no-untyped-def]
        return True

    def as_objects(job_id, spec=None, *, expedited=False):  # type: ignore[no-untyped-def]
        return True

    as_strings.__annotations__ = {"job_id": "int", "spec": "Optional[LoadStoreSpec]",
                                  "expedited": "bool", "return": "bool"}
    load_store_spec = type("LoadStoreSpec", (), {"__module__": "vllm.v1.kv_offload.base"})
    as_objects.__annotations__ = {"job_id": int, "spec": Optional[load_store_spec],  # noqa: UP045
                                  "expedited": bool, "return": bool}
    expected = "(job_id: int, spec: Optional[LoadStoreSpec] = None, *, expedited: bool = False)"
    assert seams.signature(as_strings) == expected + " -> bool"
    assert seams.signature(as_objects) == expected + " -> bool"


class _Spec:
    __module__ = "vllm.v1.kv_offload.base"

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids
        self._private = 0


class _Worker(abc.ABC):
    __module__ = "vllm.v1.kv_offload.base"

    limit: int = 4

    @abc.abstractmethod
    def submit_store(self, job_id: int, spec: _Spec) -> bool: ...

    def shutdown(self) -> None:
        return

    @classmethod
    def keys(cls, extra: dict[str, Any]) -> tuple[str, ...]:
        return ()

    @property
    def busy(self) -> bool:
        return False

    @property
    @abc.abstractmethod
    def lock(self) -> object: ...

    def _internal(self) -> None:
        return


def test_a_class_is_described_by_its_bases_methods_abstractness_and_attributes() -> None:
    assert seams.describe(_Worker) == {
        "(bases)": "ABC",
        "busy": "property -> bool",
        "keys": "classmethod (cls, extra: dict[str, Any]) -> tuple[str, ...]",
        "limit": "attribute: int = 4",
        "lock": "abstract property -> object",
        "shutdown": "def (self) -> None",
        "submit_store": "abstract def (self, job_id: int, spec: _Spec) -> bool",
    }
    # The attributes __init__ sets are read from its source; private ones are not seams.
    assert seams.describe(_Spec) == {
        "(bases)": "object",
        "__init__": "def (self, block_ids: list[int]) -> None",
        "block_ids": "instance attribute",
    }


class _Policy(enum.Enum):
    __module__ = "vllm.v1.kv_offload.base"

    CHUNK = "chunk"
    REQUEST = "request"


@dataclasses.dataclass
class _Event:
    keys: list[bytes]
    removed: bool = False
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    _state: int = dataclasses.field(default=0, init=False)


class _Pair(NamedTuple):
    new: tuple[str, ...]
    preempted: tuple[str, ...] = ()


# Set once the class exists: the dataclass machinery looks its module up while building it.
_Event.__module__ = _Pair.__module__ = "vllm.v1.kv_offload.base"


def test_enums_dataclasses_and_named_tuples_are_described_by_their_fields() -> None:
    assert seams.describe(_Policy) == {
        "(bases)": "Enum", "CHUNK": "member = 'chunk'", "REQUEST": "member = 'request'",
    }
    # The dataclass's generated __init__ only repeats its fields: not listed.
    assert seams.describe(_Event) == {
        "(bases)": "object",
        "keys": "field: list[bytes]",
        "removed": "field: bool = False",
        "tags": "field: dict[str, str] = dict()",
    }
    assert seams.describe(_Pair) == {
        "(bases)": "tuple",
        "new": "field: tuple[str, ...]",
        "preempted": "field: tuple[str, ...] = ()",
    }


def test_a_config_records_only_the_fields_named_and_a_function_its_signature() -> None:
    assert seams.describe(_Event, ("removed", "missing")) == {"removed": "field: bool = False"}

    def resolve(caches: list[int], block_ids: list[int]) -> int:
        return 0

    assert seams.describe(resolve) == {"def": "(caches: list[int], block_ids: list[int]) -> int"}


def test_values_lose_memory_addresses_and_long_ones_are_cut() -> None:
    assert seams._value(object()) == "<object object>"
    long = seams._value("x" * 200)
    assert len(long) == seams.MAX_VALUE_CHARS and long.endswith("…")


# --- comparing and reporting --------------------------------------------------------------

BASELINE: dict[str, Any] = {
    "format": seams.FORMAT,
    "vllm": "0.34.0",
    "seams": {
        "vllm.a.Same": {"members": {"run": "def (self) -> None"}},
        "vllm.a.Worker": {"members": {
            "submit_store": "abstract def (self, job_id: int, device_ptrs: DevicePointers)",
            "touch": "def (self, keys)",
            "shutdown": "def (self) -> None",
        }},
        "vllm.a.Pointers": {"members": {"ptrs": "field: ndarray"}},
        "vllm.a.Later": {"absent": "no Later in vllm.a"},
        "vllm.b.Tier": {"members": {"lookup": "abstract def (self, key)"}},
    },
}
CURRENT: dict[str, Any] = {
    "format": seams.FORMAT,
    "vllm": "0.35.0",
    "seams": {
        "vllm.a.Same": {"members": {"run": "def (self) -> None"}},
        "vllm.a.Worker": {"members": {
            "submit_store": "abstract def (self, job_id: int, src_spec: GPULoadStoreSpec)",
            "shutdown": "def (self) -> None",
            "wait": "abstract def (self, job_ids: set[int]) -> None",
        }},
        "vllm.a.Pointers": {"absent": "no Pointers in vllm.a"},
        "vllm.a.Later": {"members": {"run": "def (self) -> None"}},
        "vllm.b.Tier": {"unreadable": "importing vllm.b: No module named 'aiohttp'"},
        "vllm.c.New": {"members": {}},
    },
}


def test_compare_gives_each_seam_its_status_and_each_moved_member() -> None:
    assert seams.compare(BASELINE, CURRENT) == [
        SeamChange("vllm.a.Same", Status.UNCHANGED),
        SeamChange("vllm.a.Worker", Status.CHANGED, (
            MemberChange("submit_store", Status.CHANGED,
                         "abstract def (self, job_id: int, device_ptrs: DevicePointers)",
                         "abstract def (self, job_id: int, src_spec: GPULoadStoreSpec)"),
            MemberChange("touch", Status.GONE, "def (self, keys)", None),
            MemberChange("wait", Status.ADDED, None,
                         "abstract def (self, job_ids: set[int]) -> None"),
        )),
        SeamChange("vllm.a.Pointers", Status.GONE, note="no Pointers in vllm.a"),
        SeamChange("vllm.a.Later", Status.ADDED),
        SeamChange("vllm.b.Tier", Status.UNREADABLE,
                   note="importing vllm.b: No module named 'aiohttp'"),
        SeamChange("vllm.c.New", Status.UNRECORDED),
    ]
    # A seam absent from both is unchanged; the same snapshot compares all unchanged.
    assert {c.status for c in seams.compare(CURRENT, CURRENT)} == {
        Status.UNCHANGED, Status.UNREADABLE}


def test_a_member_that_turns_abstract_is_a_change() -> None:
    old = {"format": 1, "vllm": "1", "seams": {"vllm.a.W": {"members": {"f": "def (self)"}}}}
    new = {"format": 1, "vllm": "2",
           "seams": {"vllm.a.W": {"members": {"f": "abstract def (self)"}}}}
    (change,) = seams.compare(old, new)
    assert change.members == (MemberChange("f", Status.CHANGED, "def (self)",
                                           "abstract def (self)"),)


def test_the_report_lists_every_seam_and_what_moved() -> None:
    report = seams.render(seams.compare(BASELINE, CURRENT), "0.34.0", "0.35.0")
    assert report == (
        "vLLM seam report: vLLM 0.35.0 against the baseline recorded on vLLM 0.34.0\n"
        "  (per member: + only in this release, - only in the baseline, "
        "~ baseline -> this release)\n"
        "  unchanged   vllm.a.Same\n"
        "  changed     vllm.a.Worker\n"
        "                ~ submit_store: abstract def (self, job_id: int, device_ptrs: "
        "DevicePointers)\n"
        "                                -> abstract def (self, job_id: int, src_spec: "
        "GPULoadStoreSpec)\n"
        "                - touch: def (self, keys)\n"
        "                + wait: abstract def (self, job_ids: set[int]) -> None\n"
        "  gone        vllm.a.Pointers (no Pointers in vllm.a)\n"
        "  added       vllm.a.Later\n"
        "  unreadable  vllm.b.Tier (importing vllm.b: No module named 'aiohttp')\n"
        "  unrecorded  vllm.c.New\n"
        "6 seams: 1 unchanged, 1 changed, 1 added, 1 gone, 1 unreadable, 1 unrecorded\n"
    )


def test_a_long_member_is_reported_by_the_words_that_moved() -> None:
    methods = [f"'method_{i}'" for i in range(30)]
    old = "field: Literal[" + ", ".join(methods) + "] | None = None"
    new = "field: Literal[" + ", ".join([*methods[1:], "'dflash'"]) + "] | str | None = None"
    assert seams.word_changes(old, new) == "-'method_0' +'dflash' +str"
    change = SeamChange("vllm.config.SpeculativeConfig", Status.CHANGED,
                        (MemberChange("method", Status.CHANGED, old, new),))
    lines = seams.render([change], "1", "2").splitlines()
    assert lines[3] == "                ~ method: words -'method_0' +'dflash' +str"


# --- snapshots on disk and the command line -------------------------------------------------


def test_a_snapshot_survives_the_json_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "snap.json"
    path.write_text(seams.dumps(BASELINE), encoding="utf-8")
    assert seams.load(path) == BASELINE


def test_load_refuses_what_is_not_a_snapshot_of_this_format(tmp_path: Path) -> None:
    path = tmp_path / "snap.json"
    path.write_text(json.dumps(BASELINE | {"format": seams.FORMAT + 1}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"snap\.json: seam snapshot format 2.*--write-baseline"):
        seams.load(path)
    path.write_text("[]", encoding="utf-8")
    with pytest.raises(ValueError, match=r"snap\.json: not a seam snapshot"):
        seams.load(path)
    path.write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match=r"snap\.json: not a seam snapshot"):
        seams.load(path)


def _saved(tmp_path: Path) -> tuple[Path, Path]:
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(seams.dumps(BASELINE), encoding="utf-8")
    new.write_text(seams.dumps(CURRENT | {"seams": {
        k: v for k, v in CURRENT["seams"].items() if "unreadable" not in v}}), encoding="utf-8")
    return old, new


def test_the_command_line_reports_on_saved_snapshots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old, new = _saved(tmp_path)
    assert seams.main(["--baseline", str(old), "--current", str(new)]) == 0
    out = capsys.readouterr().out
    assert out == seams.render(seams.compare(seams.load(old), seams.load(new)), "0.34.0", "0.35.0")
    assert seams.main(["--current", str(new), "--json"]) == 0
    assert capsys.readouterr().out == new.read_text(encoding="utf-8")


def test_an_unreadable_seam_is_exit_status_1_and_no_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    old = tmp_path / "old.json"
    old.write_text(seams.dumps(BASELINE), encoding="utf-8")
    monkeypatch.setattr(seams, "snapshot", lambda: CURRENT)
    assert seams.main(["--baseline", str(old)]) == 1
    assert "  unreadable  vllm.b.Tier" in capsys.readouterr().out
    written = tmp_path / "written.json"
    assert seams.main(["--write-baseline", "--baseline", str(written)]) == 1
    assert not written.exists()
    assert "vllm.b.Tier" in capsys.readouterr().err


def test_write_baseline_records_the_snapshot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seams, "snapshot", lambda: BASELINE)
    written = tmp_path / "written.json"
    assert seams.main(["--write-baseline", "--baseline", str(written)]) == 0
    assert seams.load(written) == BASELINE
    assert capsys.readouterr().out == (
        f"vllm_seams: wrote the baseline of vLLM 0.34.0 to {written}\n")


def test_without_vllm_the_command_says_so_in_one_line_with_status_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # None in sys.modules makes `import vllm` raise ImportError, as without vLLM.
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert seams.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("vllm_seams: vLLM is not installed in this environment")
    assert "make vllm-compat VLLM=<version>" in captured.err


def test_importing_the_report_does_not_import_vllm() -> None:
    code = "import sys, kvtiers.integrations.vllm_seams; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


# --- make vllm-compat ---------------------------------------------------------------------


def _make_dry_run(*args: str) -> subprocess.CompletedProcess[str]:
    # Under make (make test, make vllm-compat VLLM=…) the outer make's flags and its
    # command-line variables reach this make through the environment: the dry run starts
    # without them.
    outer = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "VLLM", "VLLM_EXTRA_DEPS", "COMPAT_VENV")
    env = {k: v for k, v in os.environ.items() if k not in outer}
    return subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, check=False)


def test_make_vllm_compat_builds_a_light_environment_per_release(tmp_path: Path) -> None:
    wheel = tmp_path / "vllm-0.35.0rc1-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")
    for release, venv, requirement in (
        ("0.35.0", ".venv-vllm-0.35.0", '"vllm==0.35.0"'),
        (str(wheel), ".venv-vllm-0.35.0rc1", f'"{wheel}"'),
    ):
        run = _make_dry_run("vllm-compat", f"VLLM={release}")
        assert run.returncode == 0, run.stderr
        assert f"{venv}/bin/python -m pip install -q --no-deps {requirement} " in run.stdout
        # Unchecked: the tests run on a release the version gate would refuse.
        assert (f"KVTIERS_VLLM_UNCHECKED=1 {venv}/bin/python -m pytest -q -p no:cacheprovider "
                "tests/test_vllm_*.py") in run.stdout
        assert f"{venv}/bin/python -m kvtiers.integrations.vllm_seams" in run.stdout
    missing = _make_dry_run("vllm-compat")
    assert missing.returncode != 0
    assert "make vllm-compat needs the release: VLLM=<version>" in missing.stderr


# --- the installed vLLM --------------------------------------------------------------------


def test_the_packaged_baseline_is_of_the_newest_supported_release() -> None:
    from kvtiers.integrations.vllm.version import SUPPORTED_HIGH, release

    baseline = seams.load(seams.BASELINE_PATH)
    recorded = release(baseline["vllm"])
    assert recorded is not None
    assert recorded[:2] == (SUPPORTED_HIGH[0], SUPPORTED_HIGH[1] - 1)
    assert list(baseline["seams"]) == [seam.path for seam in seams.SEAMS]


def test_the_installed_vllm_reads_every_seam_and_matches_a_baseline_of_its_release() -> None:
    baseline = seams.load(seams.BASELINE_PATH)
    current = seams.snapshot()
    changes = seams.compare(baseline, current)
    assert [c for c in changes if c.status in (Status.UNREADABLE, Status.UNRECORDED)] == []
    if current["vllm"] == baseline["vllm"]:
        assert [c for c in changes if c.status is not Status.UNCHANGED] == []
