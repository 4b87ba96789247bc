"""Stack files parse into checked frozen values; every mistake is a located ConfigError."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from kvtiers.config import (
    CPUTierConfig,
    FileTierConfig,
    FsspecTierConfig,
    ModelSection,
    S3TierConfig,
    Size,
    StackConfig,
    format_size,
    load_stack_config,
    parse_size,
    resolve_factory,
)
from kvtiers.config import kinds as kinds_module
from kvtiers.config.examples import EXAMPLES_DIR
from kvtiers.config.kinds import TierKind
from kvtiers.config.model import GroupSection
from kvtiers.config.schema import OctalMode
from kvtiers.errors import ConfigError

CONFIGS = EXAMPLES_DIR
MARK = "# <-"


# --- sizes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("512MiB", 512 * 2**20),
        ("8GiB", 8 * 2**30),
        ("8 GiB", 8 * 2**30),
        ("8gib", 8 * 2**30),
        ("1.5GiB", 3 * 2**29),
        ("10KB", 10_000),
        ("10MB", 10 * 10**6),
        ("10GB", 10 * 10**9),
        ("1TB", 10**12),
        ("2TiB", 2 * 2**40),
        ("3KiB", 3072),
        ("100B", 100),
        (2048.0, 2048),
    ],
)
def test_parse_size_accepts(value: object, expected: int) -> None:
    assert parse_size(value, path="x") == expected


@pytest.mark.parametrize(
    ("value", "phrase"),
    [
        ("lots", "expected a size like 8GiB"),
        (-1, "must be positive"),
        ("-1GiB", "expected a size like 8GiB"),
        (0, "must be positive"),
        ("0GiB", "must be positive"),
        (True, "expected a size like 8GiB"),
        (1.5, "not a whole number of bytes"),
        ("1.5B", "not a whole number of bytes"),
        ("8G", "unknown size unit 'G'"),
        ("8 parsecs", "unknown size unit 'parsecs'"),
        (None, "expected a size like 8GiB"),
        ([1], "expected a size like 8GiB"),
    ],
)
def test_parse_size_rejects(value: object, phrase: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(value, path="tiers[0].capacity")
    assert info.value.path == "tiers[0].capacity"
    assert phrase in info.value.message


def test_parse_size_names_the_bad_value() -> None:
    with pytest.raises(
        ConfigError, match=r"^tiers\[1\].capacity: expected a size like 8GiB.*'lots'"
    ):
        parse_size("lots", path="tiers[1].capacity")


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (512, "512 B"),
        (1536, "1.5 KiB"),
        (8 * 2**30, "8.0 GiB"),
        (500 * 2**30, "500.0 GiB"),
        (2**50, "1.0 PiB"),
        (2**60, "1024.0 PiB"),
    ],
)
def test_format_size(num_bytes: int, text: str) -> None:
    assert format_size(num_bytes) == text


# --- each kind, with its defaults ------------------------------------------------------------


def _single(tier: dict[str, object], *, first: dict[str, object] | None = None) -> object:
    """The last tier of a stack whose primary is ``first`` (a small cpu tier by default)."""
    primary = first if first is not None else {"kind": "cpu", "capacity": "1MiB"}
    tiers = [tier] if tier.get("kind") == "cpu" else [primary, tier]
    return load_stack_config({"tiers": tiers}).tiers[-1]


def test_cpu_defaults() -> None:
    assert _single({"kind": "cpu", "capacity": "8GiB"}) == CPUTierConfig(
        name="cpu",
        capacity=Size(8 * 2**30),
        policy="lru",
        shared_memory_name=None,
        admission="always",
    )


def test_file_defaults() -> None:
    assert _single({"kind": "file", "root": "/data/kv"}) == FileTierConfig(
        name="file",
        root="/data/kv",
        capacity=None,
        io="auto",
        threads=8,
        gds=False,
        shared=False,
        o_direct=False,
        file_mode=OctalMode(0o600),
        dir_mode=OctalMode(0o700),
        quarantine=True,
        admission="always",
    )


def test_s3_defaults() -> None:
    assert _single({"kind": "s3", "bucket": "kv-cache"}) == S3TierConfig(
        name="s3",
        bucket="kv-cache",
        prefix="",
        region=None,
        endpoint_url=None,
        threads=16,
        capacity=None,
        shared=False,
        profile=None,
        retry_mode="standard",
        max_attempts=5,
        backoff_base_s=0.05,
        backoff_max_s=20.0,
        timeout_s=30.0,
        delete_corrupt=True,
        conditional_writes=True,
        admission="always",
    )


def test_fsspec_defaults() -> None:
    tier = _single({"kind": "fsspec", "url": "memory://kv"})
    assert tier == FsspecTierConfig(
        name="fsspec",
        url="memory://kv",
        threads=16,
        capacity=None,
        shared=False,
        storage_options={},
        admission="always",
    )


def test_every_field_can_be_set() -> None:
    tier = _single(
        {
            "kind": "s3",
            "name": "remote",
            "admission": "never",
            "bucket": "b.k-1",
            "prefix": "prod/a",
            "region": "eu-west-1",
            "endpoint_url": "https://s3.example:9000",
            "threads": 4,
            "capacity": "1TB",
            "shared": True,
            "profile": "kv-prod",
            "retry_mode": "adaptive",
            "max_attempts": 2,
            "backoff_base_s": 1,
            "backoff_max_s": 1,
            "timeout_s": 0.5,
            "delete_corrupt": False,
            "conditional_writes": False,
        }
    )
    assert isinstance(tier, S3TierConfig)
    assert (tier.name, tier.admission, tier.capacity, tier.backoff_base_s) == (
        "remote",
        "never",
        10**12,
        1.0,
    )
    assert isinstance(tier.backoff_base_s, float)
    assert (tier.profile, tier.retry_mode, tier.conditional_writes) == (
        "kv-prod", "adaptive", False)


@pytest.mark.parametrize(
    ("written", "mode"), [("0640", 0o640), ("'0640'", 0o640), ("'0o750'", 0o750), ("'640'", 0o640)]
)
def test_file_mode_is_octal(tmp_path: Path, written: str, mode: int) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text(
        "tiers:\n  - {kind: cpu, capacity: 1MiB}\n"
        f"  - {{kind: file, root: /d, file_mode: {written}}}\n"
    )
    tier = load_stack_config(path).tiers[1]
    assert isinstance(tier, FileTierConfig)
    assert tier.file_mode == mode


def test_storage_options_are_read_only() -> None:
    tier = _single({"kind": "fsspec", "url": "memory://b/kv", "storage_options": {"token": "x"}})
    assert isinstance(tier, FsspecTierConfig)
    assert dict(tier.storage_options) == {"token": "x"}
    with pytest.raises(TypeError):
        tier.storage_options["token"] = "y"  # type: ignore[index]


def test_relative_root_resolves_against_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    tier = _single({"kind": "file", "root": "./out/files"})
    assert isinstance(tier, FileTierConfig)
    assert tier.root_path == tmp_path / "out" / "files"


def test_configs_are_frozen() -> None:
    tier = _single({"kind": "cpu", "capacity": "8GiB"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        tier.capacity = 1  # type: ignore[attr-defined]


def test_construction_in_code_is_checked_too() -> None:
    with pytest.raises(ConfigError) as info:
        CPUTierConfig(name="cpu0", capacity=Size(1 << 20), policy="nope")
    assert info.value.path == "policy"
    with pytest.raises(ConfigError, match="cpu tier can only be the first"):
        StackConfig(
            tiers=(
                CPUTierConfig(name="a", capacity=Size(1 << 20)),
                CPUTierConfig(name="b", capacity=Size(1 << 20)),
            )
        )


def test_a_filesystem_root_is_refused_however_the_tier_is_made(tmp_path: Path) -> None:
    """The build (and vLLM's route 2) constructs these sections too, so no tier is ever
    opened straight under a filesystem root; a directory below one is fine."""
    with pytest.raises(ConfigError, match="is the filesystem root") as info:
        FileTierConfig(name="file", root="/")
    assert info.value.path == "root"
    with pytest.raises(ConfigError, match="names no directory of its own") as info:
        FsspecTierConfig(name="fsspec", url="file:///")
    assert info.value.path == "url"
    assert FileTierConfig(name="file", root=str(tmp_path)).root_path == tmp_path
    assert FsspecTierConfig(name="fsspec", url="memory://kv/../kv2").url == "memory://kv/../kv2"


def test_third_party_policy_path_is_accepted() -> None:
    tier = _single({"kind": "cpu", "capacity": "8GiB", "policy": "kvtiers.policies.arc:ARCPolicy"})
    assert isinstance(tier, CPUTierConfig)
    assert tier.policy == "kvtiers.policies.arc:ARCPolicy"


# --- model section ----------------------------------------------------------------------------


def test_model_section_to_offloading_config() -> None:
    stack = load_stack_config(CONFIGS / "demo.yaml")
    assert stack.model is not None
    config = stack.model.to_offloading_config()
    assert config.model.name == "demo/tiny-llm"
    assert (config.model.revision, config.model.dtype, config.model.kv_layout) == (
        "main",
        "bfloat16",
        "NHD",
    )
    assert (config.tokens_per_hash, config.blocks_per_chunk) == (16, 2)
    assert config.cache.hash_algorithm == "xxh3_128"
    assert [g.tokens_per_block for g in config.groups] == [16, 32]
    assert config.groups[0].layer_names == tuple(f"g0.layer{j}" for j in range(4))
    assert config.groups[1].layer_names == ("g1.layer0", "g1.layer1")
    assert [g.bytes_per_block for g in config.groups] == [4 * 16 * 1024, 2 * 8 * 1024]
    assert config.parallel.world_size == 1


def test_model_layer_names_parallel_and_rank() -> None:
    model = load_stack_config(
        {
            "tiers": [{"kind": "cpu", "capacity": "1MiB"}],
            "model": {
                "name": "m",
                "salt": "s",
                "parallel": {"tp_size": 2},
                "groups": [
                    {"tokens_per_block": 16, "layer_names": ["a", "b", "c"], "page_bytes": 100}
                ],
            },
        }
    ).model
    assert model is not None
    config = model.to_offloading_config(rank=1)
    assert config.groups[0].layer_names == ("a", "b", "c")
    assert config.groups[0].bytes_per_block == 300
    assert (config.parallel.rank, config.parallel.world_size, config.salt) == (1, 2, "s")
    with pytest.raises(ConfigError, match="rank 2 is outside") as info:
        model.to_offloading_config(rank=2)
    assert info.value.path == "model.parallel"


def test_core_errors_are_relocated_to_the_yaml_path() -> None:
    section = ModelSection(
        name="m",
        groups=(
            GroupSection(
                tokens_per_block=16,
                layer_names=("a", "a"),
                page_bytes=Size(64),
            ),
        ),
    )
    with pytest.raises(ConfigError, match="repeat") as info:
        section.to_offloading_config()
    assert info.value.path == "model.groups[0].layer_names"


# --- malformed stacks -------------------------------------------------------------------------

CPU = "  - kind: cpu\n    capacity: 1GiB\n"
GROUP = "    - {tokens_per_block: 16, num_layers: 2, page_bytes: 4KiB}\n"

# (id, YAML text, error path, phrase of the message). The line marked `# <-` is the line
# the error must point at; with no mark the error names the file alone.
BAD_STACKS = [
    (
        "unknown-key",
        "tiers:\n  - kind: cpu\n    capacit: 1GiB  # <-\n",
        "tiers[0].capacit",
        "did you mean 'capacity'",
    ),
    (
        "unknown-key-lists-known",
        "tiers:\n  - kind: cpu\n    capacity: 1GiB\n    fast: 1  # <-\n",
        "tiers[0].fast",
        "known keys: kind, name, admission, event_medium, capacity, policy",
    ),
    (
        "write-policy-on-primary",
        "tiers:\n  - kind: file\n    root: /d\n    gds: true\n    write: back  # <-\n",
        "tiers[0].write",
        "write is one of a lower tier's write rules",
    ),
    (
        "write-policy-unknown",
        f"tiers:\n{CPU}  - kind: file\n    root: /d\n    write: behind  # <-\n",
        "tiers[1].write",
        "expected one of through, back, got 'behind'",
    ),
    (
        "write-after-hits-negative",
        f"tiers:\n{CPU}  - kind: file\n    root: /d\n    write_after_hits: -1  # <-\n",
        "tiers[1].write_after_hits",
        "expected a value of at least 0, got -1",
    ),
    (
        "wrong-type",
        f"tiers:\n{CPU}  - kind: file\n    root: /d\n    threads: eight  # <-\n",
        "tiers[1].threads",
        "expected an integer, got 'eight'",
    ),
    (
        "negative-size",
        "tiers:\n  - kind: cpu\n    capacity: -1024  # <-\n",
        "tiers[0].capacity",
        "must be positive",
    ),
    (
        "zero-capacity",
        "tiers:\n  - kind: cpu\n    capacity: 0  # <-\n",
        "tiers[0].capacity",
        "must be positive",
    ),
    (
        "not-a-size",
        "tiers:\n  - kind: cpu\n    capacity: lots  # <-\n",
        "tiers[0].capacity",
        "expected a size like 8GiB",
    ),
    (
        "fraction-of-a-byte",
        "tiers:\n  - kind: cpu\n    capacity: 1.5B  # <-\n",
        "tiers[0].capacity",
        "whole number of bytes",
    ),
    (
        "missing-required",
        "tiers:\n  - kind: cpu  # <-\n    policy: arc\n",
        "tiers[0].capacity",
        "missing required key 'capacity' for a cpu tier; add it, e.g. `capacity: 8GiB`",
    ),
    (
        "missing-kind",
        "tiers:\n  - capacity: 1GiB  # <-\n",
        "tiers[0].kind",
        "missing required key 'kind'",
    ),
    (
        "bad-yaml-syntax",
        "tiers:\n  - kind: cpu\n    capacity: 1GiB: 2  # <-\n",
        "",
        "invalid YAML: mapping values are not allowed here",
    ),
    ("yaml-tab-indent", "tiers:\n\t- kind: cpu  # <-\n", "", "cannot start any token"),
    (
        "bad-yaml-indentation",
        "tiers:\n  - kind: cpu\n   capacity: 1GiB  # <-\n",
        "",
        "invalid YAML",
    ),
    ("empty-file", "", "", "the file is empty"),
    ("only-comments", "# nothing here\n", "", "the file is empty"),
    ("two-documents", "tiers: []\n---  # <-\ntiers: []\n", "", "expected a single document"),
    (
        "duplicate-yaml-key",
        "tiers:\n  - kind: cpu\n    capacity: 1GiB\n    capacity: 2GiB  # <-\n",
        "tiers[0].capacity",
        "appears twice in this mapping (first on line 3)",
    ),
    ("duplicate-top-key", f"tiers:\n{CPU}tiers:  # <-\n{CPU}", "tiers", "appears twice"),
    (
        "duplicate-cpu-tier",
        f"tiers:\n{CPU}  - kind: cpu  # <-\n    capacity: 1GiB\n",
        "tiers[1].kind",
        "cpu tier can only be the first tier",
    ),
    (
        "cpu-not-first",
        "tiers:\n  - kind: file  # <-\n    root: /d\n" + CPU,
        "tiers[0].kind",
        "only with gds: true; add gds: true or put a cpu tier first",
    ),
    (
        "cpu-last-of-three",
        f"tiers:\n{CPU}  - {{kind: file, root: /d}}\n  - kind: cpu  # <-\n    capacity: 1GiB\n",
        "tiers[2].kind",
        "cpu tier can only be the first tier",
    ),
    (
        "object-store-first",
        "tiers:\n  - kind: s3  # <-\n    bucket: kv-cache\n",
        "tiers[0].kind",
        "an s3 tier cannot be one (primaries: cpu, file, service)",
    ),
    (
        "gds-not-first",
        f"tiers:\n{CPU}  - kind: file\n    root: /d\n    gds: true  # <-\n",
        "tiers[1].gds",
        "only allowed on the first tier",
    ),
    (
        "gds-primary-with-lower-tiers",
        "tiers:\n  - {kind: file, root: /a, gds: true}\n  - {kind: s3, bucket: kv-cache}  # <-\n",
        "tiers[1]",
        "they copy chunks through the primary's CPU memory",
    ),
    (
        "gds-with-posix-io",
        "tiers:\n  - kind: file\n    root: /a\n    gds: true\n    io: posix  # <-\n",
        "tiers[0].io",
        "gds: true needs the kvikio I/O backend",
    ),
    (
        "unknown-kind",
        "tiers:\n  - kind: nvme  # <-\n",
        "tiers[0].kind",
        "unknown tier kind 'nvme'; known kinds: cpu, file, s3, fsspec, service",
    ),
    ("kind-typo", "tiers:\n  - kind: cpux  # <-\n", "tiers[0].kind", "did you mean 'cpu'"),
    (
        "unknown-io-mode",
        f"tiers:\n{CPU}  - kind: file\n    root: /d\n    io: fast  # <-\n",
        "tiers[1].io",
        "expected one of auto, posix, kvikio, got 'fast'",
    ),
    (
        "bad-endpoint-url",
        f"tiers:\n{CPU}  - kind: s3\n    bucket: kvc\n    endpoint_url: ftp://host  # <-\n",
        "tiers[1].endpoint_url",
        "http:// or https:// URL",
    ),
    (
        "bad-endpoint-port",
        f"tiers:\n{CPU}  - kind: s3\n    bucket: kvc\n    endpoint_url: http://host:99999  # <-\n",
        "tiers[1].endpoint_url",
        "'embedded'",
    ),
    (
        "bad-bucket-name",
        f"tiers:\n{CPU}  - kind: s3\n    bucket: Kv_Cache  # <-\n",
        "tiers[1].bucket",
        "invalid bucket name 'Kv_Cache'",
    ),
    (
        "bucket-like-ip",
        f"tiers:\n{CPU}  - kind: s3\n    bucket: 192.168.1.1  # <-\n",
        "tiers[1].bucket",
        "must not look like an IP address",
    ),
    (
        "bucket-double-dot",
        f"tiers:\n{CPU}  - kind: s3\n    bucket: a..b  # <-\n",
        "tiers[1].bucket",
        "must not contain '..'",
    ),
    (
        "prefix-leading-slash",
        f"tiers:\n{CPU}  - kind: s3\n    bucket: kvc\n    prefix: /p  # <-\n",
        "tiers[1].prefix",
        "drop the '/'",
    ),
    (
        "threads-zero",
        f"tiers:\n{CPU}  - kind: file\n    root: /d\n    threads: 0  # <-\n",
        "tiers[1].threads",
        "expected a value from 1 to 256, got 0",
    ),
    (
        "threads-1000",
        f"tiers:\n{CPU}  - kind: s3\n    bucket: kvc\n    threads: 1000  # <-\n",
        "tiers[1].threads",
        "expected a value from 1 to 256, got 1000",
    ),
    (
        "backoff-max-below-base",
        f"tiers:\n{CPU}  - kind: s3\n    bucket: kvc\n"
        "    backoff_base_s: 1\n    backoff_max_s: 0.5  # <-\n",
        "tiers[1].backoff_max_s",
        "below backoff_base_s",
    ),
    (
        "timeout-zero",
        f"tiers:\n{CPU}  - kind: s3\n    bucket: kvc\n    timeout_s: 0  # <-\n",
        "tiers[1].timeout_s",
        "greater than 0",
    ),
    (
        "max-attempts-zero",
        f"tiers:\n{CPU}  - kind: s3\n    bucket: kvc\n    max_attempts: 0  # <-\n",
        "tiers[1].max_attempts",
        "at least 1",
    ),
    (
        "bad-policy-syntax",
        "tiers:\n  - kind: cpu\n    capacity: 1GiB\n    policy: my.policy  # <-\n",
        "tiers[0].policy",
        "'package.module:ClassName'",
    ),
    (
        "bad-shared-memory-name",
        "tiers:\n  - kind: cpu\n    capacity: 1GiB\n    shared_memory_name: a/b  # <-\n",
        "tiers[0].shared_memory_name",
        "a simple name",
    ),
    (
        "bad-tier-name",
        "tiers:\n  - kind: cpu\n    capacity: 1GiB\n    name: my tier  # <-\n",
        "tiers[0].name",
        "a simple name",
    ),
    (
        "two-file-tiers-one-root",
        f"tiers:\n{CPU}  - kind: file\n    root: /d\n  - kind: file\n    root: /d/  # <-\n",
        "tiers[2].root",
        "tiers[1] already stores chunks at /d",
    ),
    (
        "two-s3-tiers-one-prefix",
        f"tiers:\n{CPU}  - kind: s3\n    bucket: kv-cache\n    prefix: a\n"
        "  - kind: s3\n    bucket: kv-cache  # <-\n    prefix: a/\n",
        "tiers[2].bucket",
        "two tiers over one place evict each other's chunks",
    ),
    (
        "duplicate-tier-names",
        f"tiers:\n{CPU}  - kind: file\n    root: /d\n    name: cpu  # <-\n",
        "tiers[1].name",
        "'cpu' is already used by tiers[0]",
    ),
    (
        "string-for-bool",
        f"tiers:\n{CPU}  - kind: file\n    root: /d\n    shared: 'true'  # <-\n",
        "tiers[1].shared",
        "expected true or false",
    ),
    (
        "decimal-file-mode",
        f"tiers:\n{CPU}  - kind: file\n    root: /d\n    file_mode: 640  # <-\n",
        "tiers[1].file_mode",
        "write octal with a leading 0",
    ),
    (
        "unusable-file-mode",
        f"tiers:\n{CPU}  - kind: file\n    root: /d\n    file_mode: 0400  # <-\n",
        "tiers[1].file_mode",
        "owner read and write",
    ),
    (
        "fsspec-url-without-scheme",
        f"tiers:\n{CPU}  - kind: fsspec\n    url: /tmp/x  # <-\n",
        "tiers[1].url",
        "a URL like gcs://bucket/kv",
    ),
    (
        "storage-options-not-mapping",
        f"tiers:\n{CPU}  - kind: fsspec\n    url: memory://x\n    storage_options: [1]  # <-\n",
        "tiers[1].storage_options",
        "expected a mapping",
    ),
    (
        "non-string-key",
        "tiers:\n  - kind: cpu\n    1: x  # <-\n",
        "tiers[0]",
        "keys must be strings",
    ),
    (
        "bad-model-group",
        f"tiers:\n{CPU}model:\n  name: m\n  groups:\n"
        "    - {tokens_per_block: 8, num_layers: 2, page_bytes: 4KiB}  # <-\n",
        "model.groups[0].tokens_per_block",
        "does not end on a hash boundary",
    ),
    (
        "model-group-layers-twice",
        f"tiers:\n{CPU}model:\n  name: m\n  groups:\n"
        "    - {tokens_per_block: 16, num_layers: 2, layer_names: [a], page_bytes: 1KiB}  # <-\n",
        "model.groups[0].num_layers",
        "exactly one of num_layers",
    ),
    (
        "model-group-no-layers",
        f"tiers:\n{CPU}model:\n  name: m\n  groups:\n"
        "    - {tokens_per_block: 16, page_bytes: 1KiB}  # <-\n",
        "model.groups[0]",
        "exactly one of num_layers",
    ),
    (
        "model-group-key-typo",
        f"tiers:\n{CPU}model:\n  name: m\n  groups:\n"
        "    - tokens_per_block: 16\n      num_layer: 2  # <-\n      page_bytes: 1KiB\n",
        "model.groups[0].num_layer",
        "did you mean 'num_layers'",
    ),
    (
        "model-no-groups",
        f"tiers:\n{CPU}model:\n  name: m\n  groups: []  # <-\n",
        "model.groups",
        "at least one group is required",
    ),
    (
        "model-missing-name",
        f"tiers:\n{CPU}model:  # <-\n  groups:\n{GROUP}",
        "model.name",
        "missing required key 'name'",
    ),
    (
        "model-revision-not-string",
        f"tiers:\n{CPU}model:\n  name: m\n  revision: 2024  # <-\n  groups:\n{GROUP}",
        "model.revision",
        "quote it",
    ),
    (
        "model-bad-hash",
        f"tiers:\n{CPU}model:\n  name: m\n  hash_algorithm: md5  # <-\n  groups:\n{GROUP}",
        "model.hash_algorithm",
        "expected one of xxh3_128, sha256, got 'md5'",
    ),
    (
        "model-tp-zero",
        f"tiers:\n{CPU}model:\n  name: m\n  parallel: {{tp_size: 0}}  # <-\n  groups:\n{GROUP}",
        "model.parallel.tp_size",
        "at least 1",
    ),
    (
        "metrics-port",
        f"tiers:\n{CPU}metrics:\n  port: 70000  # <-\n",
        "metrics.port",
        "from 0 to 65535",
    ),
    (
        "non-mapping-top-level",
        "- kind: cpu  # <-\n  capacity: 1GiB\n",
        "",
        "the top level must be a mapping",
    ),
    (
        "listing-without-shared",
        f"tiers:\n{CPU}  - kind: s3\n    bucket: kv-cache\n    list_interval_s: 60  # <-\n",
        "tiers[1].list_interval_s",
        "set shared: true as well, or remove list_interval_s",
    ),
    (
        "summary-without-listing",
        f"tiers:\n{CPU}  - kind: file\n    root: /d\n    shared: true\n"
        "    summary_interval_s: 300  # <-\n",
        "tiers[1].summary_interval_s",
        "set list_interval_s as well",
    ),
    (
        "listing-too-often",
        f"tiers:\n{CPU}  - kind: fsspec\n    url: memory://kv\n    shared: true\n"
        "    list_interval_s: 0.1  # <-\n",
        "tiers[1].list_interval_s",
        "at least 1",
    ),
    ("scalar-top-level", "just words  # <-\n", "", "the top level must be a mapping"),
    ("unknown-top-level-key", f"teirs:  # <-\n{CPU}", "teirs", "did you mean 'tiers'"),
    ("missing-tiers", "model:  # <-\n  name: m\n", "tiers", "missing required key 'tiers'"),
    (
        "tiers-not-a-list",
        "tiers:  # <-\n  kind: cpu\n  capacity: 1GiB\n",
        "tiers",
        "expected a list of tiers",
    ),
    ("empty-tiers-list", "tiers: []  # <-\n", "tiers", "at least one tier is required"),
    ("tier-not-a-mapping", "tiers:\n  - cpu  # <-\n", "tiers[0]", "expected a tier mapping"),
    ("recursive-alias", "tiers: &t  # <-\n  - *t\n", "tiers[0]", "an alias refers to a value"),
    *[
        (f"file-root-{name}", f"tiers:\n{CPU}  - kind: file\n    root: '{root}'  # <-\n",
         "tiers[1].root", "is the filesystem root")
        for name, root in (("slash", "/"), ("slashes", "//"), ("dotdot", "/tmp/.."))
    ],
    *[
        (f"fsspec-url-{name}", f"tiers:\n{CPU}  - kind: fsspec\n    url: '{url}'  # <-\n",
         "tiers[1].url", "names no directory of its own")
        for name, url in (("file-root", "file:///"), ("file-dotdot", "file:///tmp/.."),
                          ("file-bare", "file://"), ("local-root", "local:///"),
                          ("memory-bare", "memory://"), ("memory-slash", "memory:///"),
                          ("memory-dotdot", "memory://kv/.."))
    ],
]


def _marked_line(text: str) -> int | None:
    for number, line in enumerate(text.splitlines(), start=1):
        if line.rstrip().endswith(MARK):
            return number
    return None


def test_there_are_enough_bad_stacks() -> None:
    assert len(BAD_STACKS) >= 20
    assert len({case[0] for case in BAD_STACKS}) == len(BAD_STACKS)


@pytest.mark.parametrize(
    ("text", "path", "phrase"), [case[1:] for case in BAD_STACKS], ids=[c[0] for c in BAD_STACKS]
)
def test_bad_stack_is_a_located_config_error(
    tmp_path: Path, text: str, path: str, phrase: str
) -> None:
    file = tmp_path / "stack.yaml"
    file.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_stack_config(file)
    error = info.value
    assert error.path == path, str(error)
    assert phrase in error.message, str(error)
    line = _marked_line(text)
    assert error.source == (f"{file}:{line}" if line is not None else str(file)), str(error)
    assert "\n" not in str(error)


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="no such file") as info:
        load_stack_config(missing)
    assert info.value.source == str(missing)


def test_directory_is_not_a_stack(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_stack_config(tmp_path)


def test_non_utf8_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("tiers: [{kind: cpu, capacity: 1GiB, name: caf\u00e9}]\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text") as info:
        load_stack_config(path)
    assert info.value.source == str(path)


def test_mapping_errors_carry_the_path_without_a_file() -> None:
    with pytest.raises(ConfigError) as info:
        load_stack_config({"tiers": [{"kind": "cpu", "capacity": "lots"}]})
    assert (info.value.path, info.value.source) == ("tiers[0].capacity", "")
    assert str(info.value).startswith("tiers[0].capacity: expected a size like 8GiB")


def test_merge_keys_may_be_overridden(tmp_path: Path) -> None:
    file = tmp_path / "stack.yaml"
    file.write_text(
        "tiers:\n  - &cpu {kind: cpu, capacity: 1GiB, policy: lru}\n"
        "  - kind: file\n    root: /d\n"
        "model:\n  name: m\n  groups:\n    - &g {tokens_per_block: 16, num_layers: 1, "
        "page_bytes: 1KiB}\n    - <<: *g\n      num_layers: 3\n"
    )
    model = load_stack_config(file).model
    assert model is not None
    assert [group.num_layers for group in model.groups] == [1, 3]


# --- summary and example files -----------------------------------------------------------


def test_summary_line() -> None:
    stack = load_stack_config(
        {
            "tiers": [
                {"kind": "cpu", "capacity": "8GiB", "policy": "arc"},
                {"kind": "file", "root": "/mnt/nvme/kvtiers", "capacity": "500GiB"},
            ]
        }
    )
    assert stack.summary() == (
        "2 tiers: cpu(cpu 8.0 GiB, arc) -> file(file /mnt/nvme/kvtiers, 500.0 GiB, io=auto)"
    )


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load(path: Path) -> None:
    stack = load_stack_config(path)
    assert stack.source == str(path)
    assert path.read_text().startswith("#"), "each example starts with a comment header"


def test_example_configs_are_the_promised_set() -> None:
    names = {path.name for path in CONFIGS.glob("*.yaml")}
    assert {"cpu.yaml", "cpu-file.yaml", "cpu-file-s3.yaml", "file-gds.yaml", "demo.yaml"} <= names


# --- tier kinds ---------------------------------------------------------------------------


def _fake_kinds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Kinds whose factory modules live in ``tmp_path``: good, broken, absent, incomplete."""
    (tmp_path / "kvt_good_factory.py").write_text("def build_tier(*a, **k):\n    return 'built'\n")
    (tmp_path / "kvt_needs_dep.py").write_text("import kvt_absent_dependency\n")
    (tmp_path / "kvt_no_attr.py").write_text("OTHER = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("kvt_good_factory", "kvt_needs_dep", "kvt_no_attr"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    kinds = {
        "good": TierKind("good", CPUTierConfig, "kvt_good_factory:build_tier", False, False),
        "needs": TierKind("needs", CPUTierConfig, "kvt_needs_dep:build_tier", False, False, "s3"),
        "absent": TierKind(
            "absent", CPUTierConfig, "kvt_not_there.factory:build_tier", False, False
        ),
        "noattr": TierKind("noattr", CPUTierConfig, "kvt_no_attr:build_tier", False, False),
    }
    monkeypatch.setattr(kinds_module, "TIER_KINDS", kinds)


def test_resolve_factory_imports_lazily(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_kinds(monkeypatch, tmp_path)
    assert "kvt_good_factory" not in sys.modules
    factory = resolve_factory("good")
    assert factory(None, None, primary_region=None, name="x") == "built"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "phrase"),
    [
        ("absent", "tier kind 'absent' is not installed: kvt_not_there.factory cannot be imported"),
        (
            "needs",
            "needs 'kvt_absent_dependency', which is not installed; install it with: "
            "pip install 'kvtiers[s3]'",
        ),
        ("noattr", "has no factory 'build_tier'"),
        ("warp", "unknown tier kind 'warp'; known kinds: good, needs, absent, noattr"),
    ],
)
def test_resolve_factory_failures_are_config_errors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str, phrase: str
) -> None:
    _fake_kinds(monkeypatch, tmp_path)
    with pytest.raises(ConfigError) as info:
        resolve_factory(kind, path="tiers[2].kind")
    assert info.value.path == "tiers[2].kind"
    assert phrase in info.value.message


def test_registry_names_the_factories() -> None:
    assert {name: kind.factory for name, kind in kinds_module.TIER_KINDS.items()} == {
        "cpu": "kvtiers.tiers.cpu.factory:build_tier",
        "file": "kvtiers.tiers.file.factory:build_tier",
        "s3": "kvtiers.tiers.s3.factory:build_tier",
        "fsspec": "kvtiers.tiers.fsspec.factory:build_tier",
        "service": "kvtiers.service.tier:build_tier",
    }
    for name, kind in kinds_module.TIER_KINDS.items():
        assert kind.name == name
        assert kind.config_type.__dataclass_fields__["kind"].default == name


def test_tier_names_default_to_the_kind_and_number_repeats() -> None:
    stack = load_stack_config({"tiers": [
        {"kind": "cpu", "capacity": "1MiB"},
        {"kind": "file", "root": "/a"},
        {"kind": "file", "root": "/b"},
        {"kind": "s3", "bucket": "kv-cache"},
    ]})
    assert [tier.name for tier in stack.tiers] == ["cpu", "file1", "file2", "s3"]


def test_sglang_tier_list_refuses_a_repeated_name() -> None:
    """SGLang's tier list follows the stack's rule for names (one function holds it)."""
    from kvtiers.integrations.sglang.config import parse_tiers

    tiers = [{"kind": "file", "name": "a", "root": "/d1"}, {"kind": "file", "name": "a",
                                                            "root": "/d2"}]
    with pytest.raises(ConfigError, match=r"'a' is already used by tiers\[0\]") as info:
        parse_tiers({"tiers": tiers})
    assert info.value.path == "tiers[1].name"
