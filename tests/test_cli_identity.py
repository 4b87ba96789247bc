"""``kvtiers identity`` and ``kvtiers diff`` over namespaces the demo (or a bare manifest) wrote."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtiers import cli
from kvtiers.config import load_stack_config
from kvtiers.engine.demo import run_demo
from kvtiers.engine.workload import WorkloadSpec
from kvtiers.filemapper import NamespaceIdentity, open_namespace
from kvtiers.testing.s3 import BUCKET, MotoServer
from kvtiers.tools.identity import identity_fields

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


def identity_lines(out: str) -> dict[str, str]:
    """``kvtiers identity``'s fields (after the namespace and digest lines) as written,
    a value wrapped onto continuation lines joined back with single spaces."""
    fields: dict[str, str] = {}
    name = ""
    for line in out.splitlines()[2:]:
        if line.startswith("   "):
            fields[name] += " " + line.strip()
        else:
            name, value = line.split(None, 1)
            fields[name] = value
    return fields


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
    assert (status, err) == (1, "")  # they differ: 1, as diff and cmp answer
    # A changed field's line is indented two columns; a long value continues on lines
    # indented further.
    changed = [line.split(":")[0].strip() for line in out.splitlines()
               if line.startswith("  ") and not line.startswith("   ")]
    assert changed == [field]
    assert "1 field differs:" in out.splitlines()


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
    assert status == 1
    assert '  model_revision: "r2" -> "r3"' in out.splitlines() or (
        '  model_revision: "r3" -> "r2"' in out.splitlines()
    )
    status, out, _ = run(capsys, "diff", url, names[0], names[0],
                         "--endpoint-url", s3_endpoint.endpoint_url)
    assert status == 0
    assert "the identities are identical" in out
    status, out, _ = run(capsys, "diff", "--json", url, *names,
                         "--endpoint-url", s3_endpoint.endpoint_url)
    assert status == 1
    document = json.loads(out)
    assert document["identical"] is False
    assert [d["field"] for d in document["differences"]] == ["model_revision"]
    assert {document["differences"][0]["a"], document["differences"][0]["b"]} == {"r2", "r3"}
    status, out, _ = run(capsys, "diff", "--json", url, names[0], names[0],
                         "--endpoint-url", s3_endpoint.endpoint_url)
    assert status == 0
    assert json.loads(out) == {"location": document["location"], "a": names[0],
                               "b": names[0], "identical": True, "differences": []}


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
    fields = identity_lines(out)
    assert fields["quantization"] == '"awq"'
    assert fields["model_revision"] == '"r2"'
    assert fields["groups[0].tokens_per_block"] == "16"
    status, out, err = run(capsys, "identity", "--json", str(path))
    assert (status, err) == (0, "")
    document = json.loads(out)
    assert document["namespace"] == written
    assert document["identity"]["quantization"] == "awq"
    assert document["identity"]["groups"][0]["tokens_per_block"] == 16
    assert len(document["digest"]) == 64


@pytest.mark.parametrize(
    "argv",
    [
        ["diff"],
        ["diff", "ROOT", "only-one"],
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


def write_namespace(root: Path, **changes: Any) -> str:
    """A namespace (its manifest only) of ``model(**changes)`` under ``root``."""
    section = load_stack_config({"tiers": [{"kind": "cpu", "capacity": "1MiB"}],
                                 "model": model(**changes)}).model
    assert section is not None
    identity = NamespaceIdentity.from_config(section.to_offloading_config())
    open_namespace(root, identity)
    return identity.namespace


def wide_group(layers: int, name: str = "model.layers.{}.self_attn") -> dict[str, Any]:
    return {"groups": [{"tokens_per_block": 16, "page_bytes": "1KiB",
                        "layer_names": [name.format(j) for j in range(layers)]}]}


def test_identity_of_a_many_layer_model_fits_80_columns_and_reads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {"tiers": [{"kind": "cpu", "capacity": "1MiB"}], "model": model(**wide_group(32))}
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    status, out, err = run(capsys, "identity", str(path))
    assert (status, err) == (0, "")
    assert max(len(line) for line in out.splitlines()) <= 80
    section = load_stack_config(config).model
    assert section is not None
    expected = identity_fields(NamespaceIdentity.from_config(section.to_offloading_config()))
    assert {name: json.loads(value) for name, value in identity_lines(out).items()} == {
        name: value for name, value in expected
    }


def test_diff_of_long_values_fits_80_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = write_namespace(tmp_path, **wide_group(32))
    second = write_namespace(tmp_path, **wide_group(32, "model.layers.{}.attn"))
    status, out, err = run(capsys, "diff", str(tmp_path), first, second)
    assert (status, err) == (1, "")
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "1 field differs:" in out.splitlines()
    assert ('"model.layers.31.self_attn"] -> ["model.layers.0.attn",'
            in " ".join(out.split()))


def test_diff_of_a_location_without_the_namespaces_fails_with_status_1(
    tmp_path: Path, s3_endpoint: MotoServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """As ``inspect`` and ``gc``: an empty root, an empty S3 prefix and a namespace that
    is not there are failures (status 1), not usage errors."""
    empty = tmp_path / "empty"
    empty.mkdir()
    present = write_namespace(tmp_path / "full")
    endpoint = ["--endpoint-url", s3_endpoint.endpoint_url]
    for argv in (["diff", str(empty), "a", "b"],
                 ["diff", f"s3://{BUCKET}/nothing-here", "a", "b", *endpoint],
                 ["diff", str(tmp_path / "full"), present, "absent"]):
        status, out, err = run(capsys, *argv)
        assert (status, out) == (1, ""), argv
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "no namespace 'absent'" in err
