"""The shared manager conformance suite, run against the s3 tier on moto and on SeaweedFS
(one process, and a cluster of separate processes)."""

from __future__ import annotations

import pytest

from kvtiers.testing.conformance import TierConformanceTests
from kvtiers.testing.objects import ObjectTierConformance
from kvtiers.testing.s3 import BUCKET, S3Server
from kvtiers.tiers.s3.store import S3Store


class TestS3TierConformance(ObjectTierConformance, TierConformanceTests):
    @pytest.fixture(autouse=True)
    def _endpoint(self, any_s3: S3Server) -> None:
        self.endpoint = any_s3

    def make_store(self) -> S3Store:
        return S3Store(BUCKET, region="us-east-1", endpoint_url=self.endpoint.endpoint_url)
