"""AWS manners of the s3 tier: the region from boto3's own resolution unless set, a named
profile, errors that name the endpoint requests really went to, credentials in endpoint
URLs redacted wherever they are shown, and botocore's retries held to the operation
deadline."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvtiers.config.stack import parse_stack
from kvtiers.config.tiers import S3TierConfig, redact_url
from kvtiers.errors import ConfigError
from kvtiers.testing.s3 import BUCKET, MotoServer
from kvtiers.tiers.object.retry import OperationDeadlineError, Retrier
from kvtiers.tiers.s3.store import S3Store, _DeadlineBoundRetries

SECRET_URL = "http://kvuser:hunter2@127.0.0.1:9"


def test_the_region_comes_from_boto3_unless_set(
    s3_endpoint: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert S3Store(BUCKET).client().meta.region_name == "eu-west-1"
    monkeypatch.setenv("AWS_REGION", "eu-west-2")
    assert S3Store(BUCKET).client().meta.region_name == "eu-west-2"
    assert S3Store(BUCKET, region="ap-south-1").client().meta.region_name == "ap-south-1"


def test_an_unknown_profile_is_a_config_error(s3_endpoint: MotoServer) -> None:
    with pytest.raises(ConfigError, match="profile 'no-such-profile'") as info:
        S3Store(BUCKET, profile="no-such-profile")
    assert info.value.path == "profile"


def test_errors_name_the_endpoint_from_the_environment(
    s3_endpoint: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.endpoint_url)
    with pytest.raises(ConfigError, match="does not exist") as info:
        S3Store("no-such-bucket").check_bucket()
    assert s3_endpoint.endpoint_url in str(info.value)
    assert "AWS S3" not in str(info.value)


def test_credentials_in_an_endpoint_url_are_redacted_everywhere(
    s3_endpoint: MotoServer,
) -> None:
    assert redact_url(SECRET_URL) == "http://***@127.0.0.1:9"
    assert redact_url("https://s3.example:9000/x") == "https://s3.example:9000/x"
    config = S3TierConfig(name="s3", bucket=BUCKET, endpoint_url=SECRET_URL)
    assert "hunter2" not in config.describe()
    stack = parse_stack({"tiers": [{"kind": "cpu", "capacity": 1 << 20},
                                   {"kind": "s3", "bucket": BUCKET, "endpoint_url": SECRET_URL}]})
    assert "hunter2" not in stack.summary()
    with pytest.raises(ConfigError) as info:
        parse_stack({"tiers": [{"kind": "cpu", "capacity": 1 << 20},
                               {"kind": "s3", "bucket": BUCKET,
                                "endpoint_url": "ftp://kvuser:hunter2@host"}]})
    assert "hunter2" not in str(info.value)
    store = S3Store(BUCKET, endpoint_url=SECRET_URL, max_attempts=1, timeout_s=1.0)
    with pytest.raises(ConfigError) as info:
        store.check_bucket()
    assert "hunter2" not in str(info.value) and "***@127.0.0.1:9" in str(info.value)


class FixedDelay:
    def __init__(self, delay_s: float | None) -> None:
        self.delay_s = delay_s

    def needs_retry(self, **_: Any) -> float | None:
        return self.delay_s


def test_botocore_back_off_is_capped_and_counted() -> None:
    counted: list[int] = []
    hook = _DeadlineBoundRetries(FixedDelay(8.0), 0.5, lambda: counted.append(1))
    assert hook(attempts=1) == 0.5
    assert _DeadlineBoundRetries(FixedDelay(None), 0.5, lambda: counted.append(1))() is None
    assert counted == [1]


def test_botocore_never_backs_off_past_the_operation_deadline() -> None:
    now = [100.0]
    retrier = Retrier(lambda e: False, deadline_s=2.0, clock=lambda: now[0])
    hook = _DeadlineBoundRetries(FixedDelay(1.5), 20.0, lambda: None)

    def request() -> None:
        assert hook(attempts=1) == 1.5  # 2 s left
        now[0] += 1.0
        hook(attempts=2, caught_exception=ConnectionResetError("reset"))  # 1 s left

    with pytest.raises(OperationDeadlineError, match="ConnectionResetError"):
        retrier.call(request)


def test_a_request_held_back_past_its_deadline_is_not_sent() -> None:
    now = [100.0]
    retrier = Retrier(lambda e: False, deadline_s=1.0, clock=lambda: now[0])
    store = S3Store(BUCKET, endpoint_url="http://127.0.0.1:9")
    request = SimpleNamespace(context={})

    def held_back() -> None:
        store._cap_read_timeout(request)
        assert request.context["read_timeout"] == 1.0
        now[0] += 1.5  # the rate limiter held it back this long
        store._cap_read_timeout(request)

    with pytest.raises(OperationDeadlineError, match="before the request could be sent"):
        retrier.call(held_back)
