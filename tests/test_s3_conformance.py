"""The shared manager conformance suite, run against the s3 tier on a moto server."""

from __future__ import annotations

import pytest

from kvtiers.testing.conformance import TierConformanceTests
from kvtiers.testing.objects import ObjectTierConformance
from kvtiers.testing.s3 import BUCKET, MotoServer
from kvtiers.tiers.s3.store import S3Store


class TestS3TierConformance(ObjectTierConformance, TierConformanceTests):
    @pytest.fixture(autouse=True)
    def _endpoint(self, s3_endpoint: MotoServer) -> None:
        self.endpoint = s3_endpoint

    def make_store(self) -> S3Store:
        return S3Store(BUCKET, region="us-east-1", endpoint_url=self.endpoint.endpoint_url)
