"""The per-key load back-off of lower tiers (kvtiers/tiers/backoff.py) on a fake clock."""

from __future__ import annotations

import errno
import logging

import pytest

from kvtiers.testing.conformance import conformance_key
from kvtiers.tiers.backoff import LoadBackoff, lasting_os_error

EIO = OSError(errno.EIO, "Input/output error")
EISDIR = OSError(errno.EISDIR, "Is a directory")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def book(**changes: object) -> tuple[LoadBackoff, Clock]:
    clock = Clock()
    args: dict[str, object] = {"tier": "tier", "base_s": 1.0, "max_s": 8.0, "clock": clock}
    args.update(changes)
    return LoadBackoff(**args), clock  # type: ignore[arg-type]


def test_each_failure_doubles_the_back_off_up_to_the_maximum() -> None:
    backoff, clock = book()
    key = conformance_key(0)
    assert not backoff.blocked(key)
    ends = []
    for _ in range(5):
        assert backoff.failed(key, "p", EIO, lasting=False) is False
        start = clock.now
        while backoff.blocked(key):
            clock.now += 0.5
        ends.append(clock.now - start)
    assert ends == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert backoff.failures == 5 and backoff.forgotten == 0
    assert not backoff.blocked(conformance_key(1))


def test_lasting_failures_in_a_row_forget_the_key_and_keep_it_a_miss() -> None:
    backoff, clock = book(forget_after=2)
    key = conformance_key(0)
    assert backoff.failed(key, "p", EISDIR, lasting=True) is False
    clock.now += 100
    assert backoff.failed(key, "p", EIO, lasting=False) is False  # breaks the run
    clock.now += 100
    assert backoff.failed(key, "p", EISDIR, lasting=True) is False
    clock.now += 100
    assert backoff.failed(key, "p", EISDIR, lasting=True) is True
    assert backoff.forgotten == 1
    clock.now += 7.9
    assert backoff.blocked(key)  # for max_s
    clock.now += 0.2
    assert not backoff.blocked(key)


def test_a_key_reported_gone_starts_afresh() -> None:
    backoff, _ = book()
    key = conformance_key(0)
    backoff.failed(key, "p", EIO, lasting=False)
    backoff.clear(key)
    assert not backoff.blocked(key) and len(backoff) == 0


def test_quiet_records_are_pruned() -> None:
    backoff, clock = book(prune_at=2)
    for i in range(3):
        backoff.failed(conformance_key(i), "p", EIO, lasting=False)
    assert len(backoff) == 3  # none quiet yet
    clock.now += 100
    backoff.failed(conformance_key(9), "p", EIO, lasting=False)
    assert len(backoff) == 1


def test_warnings_are_aggregated(caplog: pytest.LogCaptureFixture) -> None:
    backoff, clock = book(summary_s=60.0)
    with caplog.at_level(logging.WARNING):
        for i in range(10):
            backoff.failed(conformance_key(i), f"path{i}", EIO, lasting=False)
        assert len(caplog.records) == 1
        assert "path0" in caplog.text and "Input/output error" in caplog.text
        clock.now += 61
        backoff.failed(conformance_key(10), "path10", EIO, lasting=False)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3
    assert "9 more chunk load(s) failed" in messages[1] and "path9" in messages[1]
    assert "path10" in messages[2]


def test_which_errors_are_lasting() -> None:
    assert lasting_os_error(EISDIR)
    assert lasting_os_error(OSError(errno.ELOOP, "loop"))
    assert lasting_os_error(PermissionError(errno.EACCES, "denied"))
    assert not lasting_os_error(EIO)
    assert not lasting_os_error(OSError(errno.ESTALE, "stale"))
    assert not lasting_os_error(TimeoutError())


@pytest.mark.parametrize(("base_s", "max_s", "forget_after"), [(0, 1, 1), (2, 1, 1), (1, 1, 0)])
def test_bad_settings_are_refused(base_s: float, max_s: float, forget_after: int) -> None:
    with pytest.raises(ValueError, match="tier"):
        LoadBackoff(tier="tier", base_s=base_s, max_s=max_s, forget_after=forget_after)


def test_the_yaml_keys_are_checked() -> None:
    from kvtiers.config.tiers import FileTierConfig, FsspecTierConfig, S3TierConfig
    from kvtiers.errors import ConfigError

    for config, args in ((FileTierConfig, {"root": "/tmp/x"}),
                         (S3TierConfig, {"bucket": "kv-cache"}),
                         (FsspecTierConfig, {"url": "memory://kv"})):
        assert config(name="t", **args).load_backoff_s == 1.0  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="load_backoff_max_s 1 is below"):
            config(name="t", load_backoff_s=2.0, load_backoff_max_s=1.0,  # type: ignore[arg-type]
                   **args)
