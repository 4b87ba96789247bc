"""What route 1's exporter says about lookups: per chunk and per request, separately.

``kvtiers_stack_lookups_total`` counts chunks (a hit per chunk found, a miss for the chunk a
prefix scan stopped at); ``kvtiers_stack_request_lookups_total`` counts each finished
request once, as a hit when vLLM loaded any of its chunks from the stack. Both through
vLLM's own spec factory, for the direct manager (one cpu tier) and the composite's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtiers.integrations.vllm import KVTiersDirectManager
from kvtiers.testing.serve import scrape
from tests.test_vllm_contract import SLOT_BYTES, load, prefix, request, route1_config, store

REQUESTS = "kvtiers_stack_request_lookups_total"
CHUNKS = "kvtiers_stack_lookups_total"


def manager_with_metrics(tiers: list[dict[str, Any]]) -> Any:
    config = route1_config(tiers)
    stack = {"tiers": tiers, "metrics": {"port": 0, "refresh_s": 0}}
    config = dataclasses.replace(config, extra_config={**config.extra_config, "kvtiers": stack})
    return OffloadingSpecFactory.create_spec(config).get_manager()


def counts(scraped: dict[str, float], name: str) -> tuple[float, float]:
    return scraped[f'{name}{{result="hit"}}'], scraped[f'{name}{{result="miss"}}']


@pytest.mark.parametrize("lower", [False, True], ids=["direct", "composite"])
def test_requests_and_chunks_are_counted_in_their_own_series(lower: bool,
                                                             tmp_path: Path) -> None:
    tiers: list[dict[str, Any]] = [{"kind": "cpu", "capacity": 8 * SLOT_BYTES}]
    if lower:
        tiers.append({"kind": "file", "root": str(tmp_path / "kv"), "io": "posix"})
    manager = manager_with_metrics(tiers)
    try:
        assert isinstance(manager, KVTiersDirectManager) is not lower
        url = f"http://127.0.0.1:{manager.stack.metrics.port}/metrics"
        assert counts(scrape(url), REQUESTS) == (0, 0), "exported from the first scrape"

        keys = prefix(1, 3)
        store(manager, "writer", keys)  # loads nothing: a request-level miss
        load(manager, "reader", keys)  # three chunks found and loaded: one hit
        stranger = request(manager, "stranger", prefix(2, 2))
        assert manager.lookup(prefix(2, 1)[0], stranger) is vbase.LookupResult.MISS
        manager.on_request_finished(stranger)  # a scan that stopped at once: a miss
        manager.on_schedule_end(SimpleNamespace(new_req_ids=[], preempted_req_ids=[]))

        scraped = scrape(url)
        assert counts(scraped, REQUESTS) == (1, 2)
        assert counts(scraped, CHUNKS) == (3, 1)
    finally:
        manager.shutdown()


def test_an_idle_engines_scrape_reads_what_the_stack_holds(tmp_path: Path) -> None:
    """A step's end refreshes the exporter's snapshot at most every ``refresh_s`` (an
    hour here); when vLLM, with no request left, asks whether the connector has pending
    work before it stops stepping, the answer takes the last snapshot."""
    tiers: list[dict[str, Any]] = [
        {"kind": "cpu", "capacity": 8 * SLOT_BYTES},
        {"kind": "file", "root": str(tmp_path / "kv"), "io": "posix"},
    ]
    config = route1_config(tiers)
    stack = {"tiers": tiers, "metrics": {"port": 0, "refresh_s": 3600}}
    config = dataclasses.replace(config, extra_config={**config.extra_config, "kvtiers": stack})
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    try:
        url = f"http://127.0.0.1:{manager.stack.metrics.port}/metrics"
        chunks = 'kvtiers_tier_chunks{tier="cpu"}'
        store(manager, "writer", prefix(1, 3))
        manager.stack.manager.wait_idle()  # the cascades to the file tier ran...
        manager.on_schedule_end(SimpleNamespace(new_req_ids=[], preempted_req_ids=[]))
        # ...and this step took them in, but its end did not refresh within refresh_s.
        assert scrape(url)[chunks] == 0
        assert not manager.has_pending_work()
        scraped = scrape(url)
        assert scraped[chunks] == 3
        assert scraped['kvtiers_stack_cascades_total{outcome="done"}'] == 3
    finally:
        manager.shutdown()
