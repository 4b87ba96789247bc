"""Hypothesis fuzzing of everything that parses input other programs or people write: the
YAML stack loader, the namespace manifest reader, the chunk header decoder and the CLI's
argument paths.

Each property is the same: a bad input ends in the module's own one-line error (or a
clean result), never another exception, a hang or unbounded memory. Memory is measured
with ``tracemalloc`` over the whole run of examples, printed (run pytest with ``-s`` to
see it) and held under a bound. ``tracemalloc``'s peak is process-wide, so each fuzz test
runs again in a process of its own (threads other tests left behind would count against
it) and passes here when it passed there. Example counts are small enough for the default
run.
"""

from __future__ import annotations

import functools
import io
import json
import os
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout, suppress
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtiers.cli import main
from kvtiers.config import load_stack_config
from kvtiers.config.yamlfile import parse_yaml
from kvtiers.core import chunkformat
from kvtiers.core.keys import make_offload_key
from kvtiers.errors import ConfigError, CorruptChunkError, NamespaceMismatchError
from kvtiers.filemapper import NamespaceIdentity, check_manifest, manifest_bytes
from kvtiers.testing.objects import offloading_config

# Generous per-example deadline: it catches a hang or a blow-up, not a slow machine.
FUZZ = settings(
    max_examples=60,
    deadline=5000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
PEAK_BYTES = 64 << 20

IDENTITY = NamespaceIdentity.from_config(offloading_config())
KEY = make_offload_key(bytes(range(16)), 0)


#: Set in the process a fuzz test re-runs itself in.
_FRESH = "KVTIERS_FUZZ_FRESH_PROCESS"


def ran_in_fresh_process(request: pytest.FixtureRequest) -> bool:
    """Run the calling test in a new pytest process and assert it passed there; ``False``
    when this already is that process (the caller then runs its body)."""
    if os.environ.get(_FRESH):
        return False
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
         request.node.nodeid],
        cwd=request.config.rootpath, env={**os.environ, _FRESH: "1"},
        capture_output=True, text=True, check=False,
    )
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return True


class PeakMemory:
    """The largest peak of traced Python allocations over the examples it wraps.

    Each example is traced on its own: what Hypothesis does between examples is not the
    code under test (on first use in a fresh checkout it builds its character tables,
    about 200 MiB once, while drawing text)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.peak = 0

    def traced(self, body: Callable[..., None]) -> Callable[..., None]:
        """``body``, traced (use under ``@given``)."""

        @functools.wraps(body)
        def run(*args: object, **kwargs: object) -> None:
            tracemalloc.start()
            try:
                body(*args, **kwargs)
            finally:
                self.peak = max(self.peak, tracemalloc.get_traced_memory()[1])
                tracemalloc.stop()

        return run

    def check(self) -> None:
        """Print the peak and hold it under :data:`PEAK_BYTES`."""
        print(f"{self.what}: peak traced memory {self.peak / 2**20:.1f} MiB")
        assert self.peak < PEAK_BYTES, f"{self.what}: peak {self.peak / 2**20:.1f} MiB"


# --- YAML -----------------------------------------------------------------------------------

_YAML_TOKENS = [
    "tiers:", "- kind: cpu", "- kind: file", "- kind: fsspec", "- kind: s3", "capacity: 8GiB",
    "capacity: 99999999999999999999999", "root: /etc/passwd", "root: /tmp/x/../x",
    "url: file:///tmp/x", "url: zz://q", "policy: a.b:C", "storage_options:", "&a [1, 2, 3]",
    "*a", "[*a, *a, *a]", "{", "}", "[", "]", "<<: *a", "model:", "groups:", "- ", "  ",
    "name: m", "tokens_per_block: 16", "!!python/object:os.system", "? complex", ": ", "|",
    ">", "'", '"', "#", "%YAML 1.1", "---", "...", "1e999", ".nan", "0o777", "2024-13-45",
    "\t", "\x00", "\ufeff", "x" * 300,
]

yaml_texts = st.one_of(
    st.text(max_size=400),
    st.lists(st.sampled_from(_YAML_TOKENS), max_size=40).map("\n".join),
    st.lists(st.sampled_from(_YAML_TOKENS), max_size=60).map(" ".join),
    st.integers(1, 300).map(lambda n: "tiers: " + "[" * n + "]" * n),
    st.integers(1, 300).map(lambda n: "tiers:\n" + "".join("  " * i + "-\n" for i in range(n))),
)


def test_fuzz_yaml_loader_ends_in_config_errors_only(request: pytest.FixtureRequest) -> None:
    if ran_in_fresh_process(request):
        return
    peak = PeakMemory("yaml loader")

    @FUZZ
    @given(yaml_texts)
    @peak.traced
    def check(text: str) -> None:
        try:
            document = parse_yaml(text, source="fuzz.yaml")
        except ConfigError as exc:
            assert "\n" not in str(exc).strip(), "errors are one line"
            return
        with suppress(ConfigError):
            load_stack_config(document.data if isinstance(document.data, dict) else {})

    check()
    peak.check()


# --- manifest -------------------------------------------------------------------------------


def _json_values() -> st.SearchStrategy[object]:
    leaves = st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
        st.text(max_size=20),
    )
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=30,
    )


def _mutated_manifests() -> st.SearchStrategy[bytes]:
    good = json.loads(manifest_bytes(IDENTITY))
    paths = [("identity",), ("digest",), ("identity", "groups"), ("identity", "model_name"),
             ("identity", "parallel"), ("format_version",), ("identity", "tokens_per_hash")]

    def mutate(path: tuple[str, ...], value: object) -> bytes:
        document = json.loads(json.dumps(good))
        target = document
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value
        return json.dumps(document).encode()

    return st.builds(mutate, st.sampled_from(paths), _json_values())


manifest_inputs = st.one_of(
    st.binary(max_size=300),
    _mutated_manifests(),
    st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 5000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
)


def test_fuzz_manifest_reader_ends_in_mismatch_errors_only(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if ran_in_fresh_process(request):
        return
    from kvtiers.tools.commands import inspect, verify
    from kvtiers.tools.locations import open_location

    root = tmp_path / "root"
    namespace = root / IDENTITY.namespace
    namespace.mkdir(parents=True)

    peak = PeakMemory("manifest reader")

    @FUZZ
    @given(manifest_inputs)
    @peak.traced
    def check(data: bytes) -> None:
        try:
            check_manifest(data, IDENTITY, where="fuzz")
        except NamespaceMismatchError as exc:
            assert "Traceback" not in str(exc)
        (namespace / "manifest.json").write_bytes(data)
        out = io.StringIO()
        assert inspect(open_location(str(root)), out) == 0
        assert verify(open_location(str(root)), out) in (0, 1)

    check()
    peak.check()


# --- chunk header ---------------------------------------------------------------------------


def _mutated_headers() -> st.SearchStrategy[bytes]:
    good = chunkformat.encode_header(IDENTITY.digest, KEY, b"payload")

    def flip(edits: list[tuple[int, int]]) -> bytes:
        header = bytearray(good)
        for offset, value in edits:
            header[offset % len(header)] = value
        return bytes(header)

    return st.lists(st.tuples(st.integers(0, 4095), st.integers(0, 255)), max_size=8).map(flip)


def _resealed_headers() -> st.SearchStrategy[bytes]:
    """Headers with hostile fields whose header checksum is made valid again, so the
    decoder's later checks see them."""
    good = chunkformat.encode_header(IDENTITY.digest, KEY, b"payload")

    def reseal(payload_bytes: int, key_len: int, algorithm: int) -> bytes:
        import xxhash

        header = bytearray(good)
        struct.pack_into("<Q", header, 16, payload_bytes)
        struct.pack_into("<H", header, 72, key_len)
        header[12] = algorithm
        header[88:96] = bytes(8)
        struct.pack_into("<Q", header, 88, xxhash.xxh3_64_intdigest(bytes(header)))
        return bytes(header)

    return st.builds(
        reseal, st.integers(0, 2**64 - 1), st.integers(0, 2**16 - 1), st.integers(0, 255)
    )


header_inputs = st.one_of(
    st.binary(max_size=5000), _mutated_headers(), _resealed_headers()
)


def test_fuzz_chunk_header_decoder_ends_in_corrupt_chunk_errors_only(
    request: pytest.FixtureRequest,
) -> None:
    if ran_in_fresh_process(request):
        return
    peak = PeakMemory("chunk header decoder")

    @FUZZ
    @given(header_inputs, st.binary(max_size=64))
    @peak.traced
    def check(header: bytes, payload: bytes) -> None:
        try:
            decoded = chunkformat.decode_header(header, namespace_digest=IDENTITY.digest, key=KEY)
        except CorruptChunkError:
            return
        with suppress(CorruptChunkError):
            chunkformat.verify_payload(decoded, payload)

    check()
    peak.check()


# --- CLI arguments --------------------------------------------------------------------------

_ARG_TOKENS = [
    "inspect", "verify", "gc", "validate", "--fix", "--dry-run", "--namespace", "x", "..",
    "--older-than-days", "--stale-days", "--temp-age-s", "--max-bytes", "0", "-1", "nan",
    "inf", "1e308", "50GiB", "lots", "99999999999999999999999TiB", "--endpoint-url",
    "--region", "--help", "-h", "--version", "", "\x00", "ROOT", "STACK", "/etc/passwd",
    "/dev/null", "gs://b/x", "file:///tmp", "s3:/", "--", "-",
]


def test_fuzz_cli_arguments_end_in_an_exit_status(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if ran_in_fresh_process(request):
        return
    root = tmp_path / "root"
    root.mkdir()
    stack = tmp_path / "stack.yaml"
    stack.write_text("tiers:\n  - kind: cpu\n    capacity: 8GiB\n")
    substitute: dict[str, Callable[[], str]] = {"ROOT": lambda: str(root),
                                                 "STACK": lambda: str(stack)}

    peak = PeakMemory("cli arguments")

    @FUZZ
    @given(st.lists(st.sampled_from(_ARG_TOKENS), max_size=8))
    @peak.traced
    def check(tokens: list[str]) -> None:
        argv = [substitute[t]() if t in substitute else t for t in tokens]
        if any(arg.startswith("s3:") for arg in argv):
            return  # would try to reach a network endpoint
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            try:
                status = main(argv)
            except SystemExit as exc:  # argparse: usage errors, --help, --version
                status = exc.code if isinstance(exc.code, int) else 2
        assert status in (0, 1, 2), (argv, err.getvalue())
        assert "Traceback" not in err.getvalue()
        if status == 1:
            assert len(err.getvalue().strip().splitlines()) <= 1, err.getvalue()

    check()
    peak.check()


@pytest.mark.parametrize("command", ["inspect", "verify", "gc"])
def test_tools_on_a_root_full_of_junk_are_clean(tmp_path: Path, command: str) -> None:
    namespace = tmp_path / f"{IDENTITY.namespace}"
    (namespace / "ab" / "cd").mkdir(parents=True)
    (namespace / "manifest.json").write_bytes(manifest_bytes(IDENTITY))
    (namespace / "ab" / "cd" / ("ab" * 16 + "_g0.kvc")).write_bytes(b"\x00" * 10)
    (namespace / "ab" / "cd" / ("abcd" + "00" * 14 + "_g0.kvc")).write_bytes(b"KVTCHUNK" * 600)
    (namespace / "ab" / "cd" / "stray").write_bytes(b"?")
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = main([command, str(tmp_path)])
    assert err.getvalue() == "" and status in (0, 1)
    if command == "verify":
        assert status == 1 and "2 corrupt" in out.getvalue()
