"""``kvtiers identity`` and ``kvtiers diff`` over namespaces the demo wrote."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtiers import cli
from kvtiers.engine.demo import run_demo
from kvtiers.engine.workload import WorkloadSpec
from kvtiers.testing.s3 import BUCKET, MotoServer

WORKLOAD = WorkloadSpec(conversations=2, system_prompts=1, turns=1, system_tokens=(64, 96))


def model(**changes: Any) -> dict[str, Any]:
    return {"name": "demo/tiny", "revision": "r2", "tokens_per_hash": 16, "blocks_per_chunk": 2,
            "groups": [{"tokens_per_block": 16, "num_layers": 2, "page_bytes": "1KiB"}],
            **changes}


def demo(lower: dict[str, Any], **changes: Any) -> None:
    """One demo run (both phases) writing into ``lower`` under ``model(**changes)``."""
    config = {"tiers": [{"kind": "cpu", "capacity": "1MiB"}, lower], "model": model(**changes)}
    run_demo(config, workload=WORKLOAD, fresh=False, out=io.StringIO(), show_progress=False)


def namespaces(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        status = cli.main(list(argv))
    except SystemExit as exc:
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


# identity field -> the model: section change that touches only it
ONE_FIELD: dict[str, dict[str, Any]] = {
    "model_revision": {"revision": "r3"},
    "kv_dtype": {"dtype": "float16"},
    "quantization": {"quantization": "awq"},
    "model_overrides": {"overrides": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}},
    "groups[0].attention": {
        "groups": [{"tokens_per_block": 16, "num_layers": 2, "page_bytes": "1KiB",
                    "attention": "sliding_window:64"}]
    },
}


@pytest.mark.parametrize("field", sorted(ONE_FIELD))
def test_diff_names_exactly_the_field_that_changed(
    field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = {"kind": "file", "root": str(tmp_path)}
    demo(tier)
    (first,) = namespaces(tmp_path)
    demo(tier, **ONE_FIELD[field])
    (second,) = set(namespaces(tmp_path)) - {first}
    status, out, err = run(capsys, "diff", str(tmp_path), first, second)
    assert (status, err) == (0, "")
    changed = [line.strip().split(":")[0] for line in out.splitlines() if line.startswith("  ")]
    assert changed == [field]
    assert "1 field differ" in out


def test_diff_over_s3_and_on_identical_identities(
    s3_endpoint: MotoServer, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = {"kind": "s3", "bucket": BUCKET, "prefix": "p", "endpoint_url": s3_endpoint.endpoint_url}
    demo(tier)
    demo(tier, revision="r3")
    url = f"s3://{BUCKET}/p"
    status, out, _ = run(capsys, "inspect", url, "--endpoint-url", s3_endpoint.endpoint_url)
    assert status == 0
    names = sorted(line for line in out.splitlines() if line.startswith("demo__tiny-"))
    assert len(names) == 2
    status, out, _ = run(capsys, "diff", url, *names, "--endpoint-url", s3_endpoint.endpoint_url)
    assert status == 0
    assert '  model_revision: "r2" -> "r3"' in out.splitlines() or (
        '  model_revision: "r3" -> "r2"' in out.splitlines()
    )
    status, out, _ = run(capsys, "diff", url, names[0], names[0],
                         "--endpoint-url", s3_endpoint.endpoint_url)
    assert status == 0
    assert "the identities are identical" in out


def test_identity_prints_the_namespace_the_demo_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    config = {"tiers": [{"kind": "cpu", "capacity": "1MiB"},
                        {"kind": "file", "root": str(root)}],
              "model": model(quantization="awq")}
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    status, out, err = run(capsys, "identity", str(path))
    assert (status, err) == (0, "")
    demo({"kind": "file", "root": str(root)}, quantization="awq")
    (written,) = namespaces(root)
    assert out.splitlines()[0] == f"namespace  {written}"
    fields = {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines()[2:]}
    assert fields["quantization"] == '"awq"'
    assert fields["model_revision"] == '"r2"'
    assert fields["groups[0].tokens_per_block"] == "16"


@pytest.mark.parametrize(
    "argv",
    [
        ["diff"],
        ["diff", "ROOT", "only-one"],
        ["diff", "ROOT", "missing-a", "missing-b"],
        ["identity"],
        ["identity", "NOFILE"],
        ["identity", "NOMODEL"],
    ],
)
def test_bad_arguments_get_one_line_and_status_2(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    no_model = tmp_path / "no-model.yaml"
    no_model.write_text("tiers:\n  - kind: cpu\n    capacity: 1MiB\n")
    substitutes = {"ROOT": str(tmp_path), "NOFILE": str(tmp_path / "absent.yaml"),
                   "NOMODEL": str(no_model)}
    status, out, err = run(capsys, *[substitutes.get(arg, arg) for arg in argv])
    assert status == 2
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
