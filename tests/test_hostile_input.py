"""Hostile input: one test per misbehaviour seen with malformed stacks, manifests and
symlinks (each failed before the fix), checked through the public entry points.

The shared-memory cases live in ``tests/test_cpu_region.py``; fuzzing lives in
``tests/test_hostile_fuzz.py``.
"""

from __future__ import annotations

import io
import json
import os
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from kvtiers.cli import main
from kvtiers.config import load_stack_config
from kvtiers.core import chunkformat
from kvtiers.core.keys import make_offload_key
from kvtiers.core.publish import publish_bytes
from kvtiers.errors import (
    ConfigError,
    LocationError,
    NamespaceMismatchError,
    SymlinkEscapeError,
)
from kvtiers.filemapper import FileMapper, NamespaceIdentity, check_manifest, open_namespace
from kvtiers.filemapper.manifest import MAX_MANIFEST_BYTES
from kvtiers.testing.objects import offloading_config
from kvtiers.tiers.file.io import PosixBackend, PublishSettings
from kvtiers.tools.commands import GcRules, gc, inspect, verify
from kvtiers.tools.locations import Location, open_location

KEY = make_offload_key(bytes(range(16)), 0)
PAYLOAD = b"kv" * 4096


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


def _store(root: Path, model: str = "org/model") -> tuple[FileMapper, Path]:
    """A namespace under ``root`` holding one good chunk for :data:`KEY`."""
    identity = NamespaceIdentity.from_config(offloading_config(model=model))
    mapper = FileMapper(root, identity)
    open_namespace(root, identity)
    path = mapper.path(KEY)
    publish_bytes(path, [chunkformat.encode(identity.digest, KEY, PAYLOAD)], root=root)
    return mapper, path


def _write_stack(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    return path


def _one_line_usage_error(tmp_path: Path, text: str) -> str:
    status, _, err = _run("validate", str(_write_stack(tmp_path, text)))
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


# --- symlinks under a root ------------------------------------------------------------------


def test_a_write_never_follows_a_symlinked_fan_out_directory(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    mapper, _ = _store(root)
    other = make_offload_key(b"\xab\xcd" + bytes(14), 0)
    target = mapper.path(other)
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    target.parent.symlink_to(outside)
    header = chunkformat.encode_header(mapper.identity.digest, other, PAYLOAD)
    with pytest.raises(SymlinkEscapeError, match="is a symbolic link inside the store"):
        PosixBackend().write(target, header, PAYLOAD, PublishSettings(root=root))
    assert list(outside.iterdir()) == []


def test_a_symlinked_namespace_is_refused_at_open(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    identity = NamespaceIdentity.from_config(offloading_config())
    (root / identity.namespace).symlink_to(outside)
    with pytest.raises(SymlinkEscapeError, match="namespace must be a real directory"):
        open_namespace(root, identity)
    assert list(outside.iterdir()) == []


def test_gc_never_deletes_through_a_symlinked_namespace(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    _, victim = _store(elsewhere)
    (namespace,) = [p for p in elsewhere.iterdir()]
    (root / namespace.name).symlink_to(namespace)
    out = io.StringIO()
    # A linked namespace is not listed, so the root holds none: gc says so and removes nothing.
    for rules in (GcRules(older_than_days=0.0, temp_age_s=0.0),
                  GcRules(namespaces=(namespace.name,))):
        with pytest.raises(LocationError, match="holds no kvtiers namespace"):
            gc(open_location(str(root)), rules, out)
    assert victim.exists() and (namespace / "manifest.json").exists()


def test_a_directory_root_lists_its_namespaces_from_its_own_entries(tmp_path: Path) -> None:
    """A root's namespaces are its real directories with a regular manifest, found without
    reading below them: the same answer as listing every entry, for links, stray files
    and manifests that are not files."""
    root = tmp_path / "root"
    _store(root)
    (real,) = [p.name for p in root.iterdir()]
    (root / "no-manifest").mkdir()
    (root / "stray.txt").write_text("x")
    (root / "linked").symlink_to(root / real)
    (root / "manifest-link").mkdir()
    (root / "manifest-link" / "manifest.json").symlink_to(root / real / "manifest.json")
    (root / "manifest-dir" / "manifest.json").mkdir(parents=True)
    location = open_location(str(root))
    assert location.namespaces() == [real]
    assert location.namespaces() == Location.namespaces(location)
    # Nothing below a namespace is read: an unreadable directory inside one goes unnoticed.
    hidden = root / real / "unreadable"
    hidden.mkdir()
    with _forbidden_listing(hidden):
        assert location.namespaces() == [real]


@contextmanager
def _forbidden_listing(directory: Path) -> Iterator[None]:
    """``os.scandir`` of ``directory`` raises (a test runs as root, so no mode can
    forbid it)."""
    real_scandir = os.scandir

    def scandir(path: Any = ".") -> Any:
        if Path(path) == directory:
            raise PermissionError(13, "listing forbidden by the test", str(path))
        return real_scandir(path)

    os.scandir = scandir
    try:
        yield
    finally:
        os.scandir = real_scandir


def test_an_empty_location_is_refused_not_taken_as_the_current_directory() -> None:
    for command in ("inspect", "verify", "gc"):
        status, out, err = _run(command, "")
        assert status == 2, (command, out, err)
        assert err.strip().splitlines() == [
            "kvtiers: location: the location is empty; give a file tier's root, "
            "s3://bucket/prefix or an fsspec URL"], (command, err)


def test_verify_and_inspect_never_read_through_a_symlink(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _, chunk = _store(root)
    secret = tmp_path / "secret"
    secret.write_bytes(chunk.read_bytes())
    chunk.unlink()
    chunk.symlink_to(secret)
    (namespace,) = [p for p in root.iterdir()]
    manifest = namespace / "manifest.json"
    manifest.rename(tmp_path / "manifest.json")
    manifest.symlink_to(tmp_path / "manifest.json")
    status, out, err = _run("verify", str(root))
    assert (status, out) == (1, ""), "a namespace whose manifest is a link is not listed"
    assert "holds no kvtiers namespace" in err
    manifest.unlink()
    (tmp_path / "manifest.json").rename(manifest)
    status, out, _ = _run("verify", str(root))
    flat = " ".join(out.split())  # reports wrap at 80 columns
    assert status == 1 and "(a symbolic link, not a regular file;" in flat
    assert flat.endswith(f"{chunk.relative_to(root)}")
    assert secret.read_bytes()[:8] == chunkformat.MAGIC


# --- YAML -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "tiers: " + "[" * 500 + "]" * 500 + "\n",
        "tiers:\n" + "".join("  " * level + "- \n" for level in range(1, 500)),
        "tiers:\n  - kind: cpu\n    capacity: 1GiB\n    x: " + "{a: " * 500 + "1" + "}" * 500,
    ],
    ids=["flow", "block", "mapping"],
)
def test_deep_nesting_is_a_one_line_error(tmp_path: Path, text: str) -> None:
    err = _one_line_usage_error(tmp_path, text)
    assert "nesting deeper than 64 levels" in err and "stack.yaml:" in err


def test_an_alias_bomb_is_refused_early(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    tracemalloc.start()
    try:
        err = _one_line_usage_error(tmp_path, "\n".join([*lines, "tiers: *a8", ""]))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "expands to more than 10000 values" in err
    assert peak < 32 << 20, f"peak {peak / 2**20:.1f} MiB"


def test_an_alias_bomb_inside_storage_options_is_refused(tmp_path: Path) -> None:
    bomb = ["      a0: &a0 [x, x, x]"]
    bomb += [f"      a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 6)]
    text = (
        "tiers:\n  - kind: cpu\n    capacity: 1GiB\n  - kind: fsspec\n    url: memory://kv\n"
        "    storage_options:\n" + "\n".join(bomb) + "\n"
    )
    err = _one_line_usage_error(tmp_path, text)
    assert "tiers[1].storage_options:" in err


def test_a_control_character_is_a_one_line_error(tmp_path: Path) -> None:
    err = _one_line_usage_error(tmp_path, "tiers:\x1f\n")
    assert "invalid YAML: unacceptable character #x001f" in err


def test_an_oversized_stack_file_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    with open(path, "wb") as f:
        f.truncate(64 << 20)
    with pytest.raises(ConfigError, match="is larger than 1048576 bytes"):
        load_stack_config(path)


def test_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "stack.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_stack_config(fifo)


# --- manifests and tools --------------------------------------------------------------------


def test_inspect_reads_a_huge_manifest_only_up_to_its_limit(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _store(root)
    (namespace,) = [p for p in root.iterdir()]
    with open(namespace / "manifest.json", "r+b") as f:
        f.truncate(512 << 20)  # sparse: costs no disk
    tracemalloc.start()
    try:
        out = io.StringIO()
        assert inspect(open_location(str(root)), out) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "manifest: unreadable" in out.getvalue()
    assert peak < 4 * MAX_MANIFEST_BYTES, f"peak {peak / 2**20:.1f} MiB"


def test_verify_streams_a_huge_chunk_in_bounded_blocks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    mapper, chunk = _store(root)
    payload_bytes = 64 << 20
    header = chunkformat.encode_header(mapper.identity.digest, KEY, bytes(payload_bytes))
    with open(chunk, "wb") as f:
        f.write(header)
        f.truncate(chunkformat.HEADER_BYTES + payload_bytes)  # zeros, sparse
    tracemalloc.start()
    try:
        out = io.StringIO()
        assert verify(open_location(str(root)), out) == 0, out.getvalue()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "1 chunks ok, 0 corrupt" in out.getvalue()
    assert peak < payload_bytes // 2, f"peak {peak / 2**20:.1f} MiB: the payload was not streamed"


def _good_manifest(root: Path) -> dict[str, object]:
    (namespace,) = [p for p in root.iterdir()]
    document: dict[str, object] = json.loads((namespace / "manifest.json").read_bytes())
    return document


@pytest.mark.parametrize(
    "damage",
    [
        lambda m: m.update(identity=5),
        lambda m: m["identity"].update(groups=[5]),
        lambda m: m["identity"]["groups"][0].update(bytes_per_block="lots"),
        lambda m: m["identity"]["groups"][0].update(layer_names=None),
        lambda m: m["identity"].update(parallel=[1]),
        lambda m: m.update(digest="zz"),
        lambda m: m.update(digest=5),
        lambda m: m.update(identity=json.loads("[" * 200 + "]" * 200)),
    ],
    ids=["identity-int", "group-int", "bytes-text", "layers-null", "parallel-list", "digest-zz",
         "digest-int", "deep"],
)
def test_a_malformed_manifest_is_one_finding_not_a_traceback(
    tmp_path: Path, damage: object
) -> None:
    root = tmp_path / "root"
    _store(root)
    document = _good_manifest(root)
    assert callable(damage)
    damage(document)
    (namespace,) = [p for p in root.iterdir()]
    (namespace / "manifest.json").write_text(json.dumps(document))
    status, out, err = _run("inspect", str(root))
    assert (status, err) == (0, "")
    inspect_findings = [line for line in out.splitlines()
                        if "manifest: unreadable" in line or "manifest: malformed" in line]
    assert len(inspect_findings) <= 1
    # verify needs only the digest: it checks the chunks or says it cannot, in one line.
    status, out, err = _run("verify", str(root))
    assert err == "" and status in (0, 1)
    # One finding: one line, and any continuation of it (reports wrap at 80) indented.
    assert len([line for line in out.splitlines() if not line.startswith(" ")]) == 1
    assert ("1 chunks ok" in out) == (status == 0) and ("manifest unreadable" in out) == (
        status == 1
    )
    assert inspect_findings or status == 1, "the damage must be reported by one of them"
    with pytest.raises(NamespaceMismatchError):
        check_manifest((namespace / "manifest.json").read_bytes(),
                       NamespaceIdentity.from_config(offloading_config()), where="m")


def test_a_deeply_nested_manifest_is_a_mismatch_at_tier_open(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _store(root)
    (namespace,) = [p for p in root.iterdir()]
    (namespace / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    identity = NamespaceIdentity.from_config(offloading_config())
    with pytest.raises(NamespaceMismatchError, match="nests deeper than"):
        open_namespace(root, identity)


# --- validate does what the build would -----------------------------------------------------

_CPU = "tiers:\n  - kind: cpu\n    capacity: 1GiB\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tiers:\n  - kind: cpu\n    capacity: 99999999999999999999999\n",
         "tiers[0].capacity: 99999999999999999999999 is more than"),
        ("tiers:\n  - kind: cpu\n    capacity: 1" + "0" * 5000 + "\n",
         "tiers[0].capacity: cannot read"),
        (_CPU + "  - kind: s3\n    bucket: kv-cache\n    max_attempts: 99999999999999999999\n",
         "tiers[1].max_attempts: 1e+20 does not fit in 64 bits"),
        (_CPU + "  - kind: file\n    root: /srv/kvt/a\n  - kind: file\n    root: /srv/kvt/b/../a\n",
         "tiers[2].root: tiers[1] already stores chunks at /srv/kvt/a"),
        (_CPU + "  - kind: file\n    root: //srv/a\n  - kind: file\n    root: /srv/a\n",
         "tiers[2].root: tiers[1] already stores chunks at /srv/a"),
        (_CPU + "  - kind: file\n    root: /srv/a\n  - kind: fsspec\n    url: file:///srv/a\n",
         "tiers[2].url: tiers[1] already stores chunks at /srv/a"),
        (_CPU + "  - kind: file\n    root: /etc/passwd\n",
         "tiers[1].root: /etc/passwd exists and is not a directory"),
        (_CPU + "  - kind: file\n    root: /etc/passwd/kv\n",
         "tiers[1].root: /etc/passwd exists and is not a directory"),
        (_CPU + "  - kind: fsspec\n    url: nosuchproto://x\n",
         "tiers[1].url: fsspec knows no protocol 'nosuchproto'"),
        ("tiers:\n  - kind: cpu\n    capacity: 1GiB\n    policy: kvtiers_absent.mod:Cls\n",
         "tiers[0].policy: cannot import module 'kvtiers_absent.mod'"),
        ("tiers:\n  - kind: cpu\n    capacity: 1GiB\n    policy: kvtiers.policies.lru:Nope\n",
         "tiers[0].policy: module 'kvtiers.policies.lru' has no class 'Nope'"),
    ],
    ids=["capacity-65-bits", "capacity-5000-digits", "int-65-bits", "dotdot-root",
         "double-slash-root", "file-url", "root-is-a-file", "root-under-a-file",
         "unknown-protocol", "policy-missing", "policy-no-class"],
)
def test_validate_refuses_what_the_build_would(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in _one_line_usage_error(tmp_path, text)


def test_validate_names_the_package_a_protocol_needs(tmp_path: Path) -> None:
    from fsspec.registry import known_implementations

    missing = next(
        (proto for proto, impl in sorted(known_implementations.items())
         if __import__("importlib.util").util.find_spec(impl["class"].split(".")[0]) is None),
        None,
    )
    if missing is None:
        pytest.skip("every fsspec protocol's package is installed here")
    err = _one_line_usage_error(tmp_path, _CPU + f"  - kind: fsspec\n    url: {missing}://b/kv\n")
    assert f"tiers[1].url: the {missing!r} protocol needs the" in err


def test_a_policy_that_raises_on_import_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kvtiers_boom_policy.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = _one_line_usage_error(
        tmp_path, "tiers:\n  - kind: cpu\n    capacity: 1GiB\n    policy: kvtiers_boom_policy:P\n"
    )
    assert "tiers[0].policy: cannot import module 'kvtiers_boom_policy'" in err
    assert "RuntimeError: boom at import" in err


# --- long model names -----------------------------------------------------------------------


def test_a_long_model_name_is_cut_in_the_directory_name_only(tmp_path: Path) -> None:
    long_name = "org/" + "m" * 300
    mapper, chunk = _store(tmp_path, model=long_name)
    namespace = mapper.identity.namespace
    assert len(namespace) <= 145 and namespace.startswith("org__mmm")
    assert chunk.exists()
    manifest = json.loads((tmp_path / namespace / "manifest.json").read_bytes())
    assert manifest["identity"]["model_name"] == long_name
    other = NamespaceIdentity.from_config(offloading_config(model=long_name + "x"))
    assert other.namespace != namespace and other.namespace[:-16] == namespace[:-16]

