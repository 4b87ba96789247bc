"""The medium each tier announces (``event_medium``), through vLLM's event tracker,
``KVTiersConnector.take_events``, vLLM's ZMQ publisher and a subscriber: configured tiers
renamed, every other event (the GPU cache's, an unconfigured tier's) as vLLM wrote it."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtiers.config import load_stack_config
from kvtiers.errors import ConfigError
from kvtiers.integrations.vllm.connector import KVTiersConnector
from kvtiers.integrations.vllm.media import medium_names, renamed
from tests.e2e.events_run import Subscriber
from tests.test_vllm_spec import make_request, vllm_config

END = vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
#: How long the subscriber may take to join the publisher, and to receive a batch.
JOIN_TIMEOUT_S = 30.0


def stack(root: Path, cpu: str | None = "host", file: str | None = "shared_storage") -> Any:
    tiers: list[dict[str, Any]] = [
        {"kind": "cpu", "capacity": "16KiB"},
        {"kind": "file", "root": str(root), "io": "posix", "threads": 2},
    ]
    for tier, name in zip(tiers, (cpu, file), strict=True):
        if name is not None:
            tier["event_medium"] = name
    return {"tiers": tiers}


def test_medium_names_map_each_configured_tier(tmp_path: Path) -> None:
    config = load_stack_config(stack(tmp_path, cpu=None))
    assert medium_names(config) == {("STORAGE", "file"): "shared_storage"}
    gpu = BlockStored(block_hashes=[b"a"], parent_block_hash=None, token_ids=[],
                      block_size=16, lora_id=None, medium="GPU", lora_name=None)
    cpu = BlockRemoved(block_hashes=[b"b"], medium="CPU")
    file = BlockRemoved(block_hashes=[b"c"], medium="STORAGE", ownership="file")
    other = BlockRemoved(block_hashes=[b"d"], medium="STORAGE", ownership="s3")
    out = list(renamed([gpu, cpu, file, other], medium_names(config)))
    assert [e.medium for e in out] == ["GPU", "CPU", "shared_storage", "STORAGE"]
    assert out[2].block_hashes == [b"c"] and out[2].ownership == "file"


def test_a_malformed_medium_name_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="event_medium"):
        load_stack_config(stack(tmp_path, file="shared storage"))


def _connector(manager: Any, tracker: Any) -> KVTiersConnector:
    """A ``KVTiersConnector`` over route 1's ``manager`` with vLLM's event ``tracker``, as
    vLLM's scheduler side holds them (built without an engine)."""
    connector = KVTiersConnector.__new__(KVTiersConnector)
    connector.connector_scheduler = SimpleNamespace(
        manager=manager,
        take_events=lambda: tracker.take_events(list(manager.take_events())),
    )
    return connector


def _joined(publisher: ZmqEventPublisher, subscriber: Subscriber) -> None:
    """Publish empty batches until the subscriber receives one (a SUB socket drops what
    was published before it joined), then forget them."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not subscriber.messages:
        assert time.monotonic() < deadline, "the subscriber never joined the publisher"
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        subscriber.wait_for(1, 0.2)
    publisher.publish(KVEventBatch(ts=time.time(), events=[]))  # in order after the join
    assert subscriber.wait_for(len(subscriber.messages) + 1, JOIN_TIMEOUT_S)


def test_configured_media_reach_a_subscriber(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = vllm_config(tmp_path / "kv", kvtiers=stack(tmp_path / "kv"))
    with caplog.at_level(logging.WARNING, "kvtiers.integrations.vllm.spec"):
        manager = OffloadingSpecFactory.create_spec(config).get_manager()
    # Built outside KVTiersConnector (as vLLM's own connector builds it): said at start.
    assert any("KVTiersConnector, which alone renames them" in r.getMessage()
               for r in caplog.records)
    tracker = OffloadingEventsTracker(vbase.OffloadingKVEventsConfig(
        enable_kv_cache_events=True, self_describing_kv_events=True))
    connector = _connector(manager, tracker)
    subscriber = Subscriber()
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=subscriber.endpoint,
                                  topic="media")
    try:
        _joined(publisher, subscriber)
        start = len(subscriber.messages)
        req = make_request(1, first_block=0)
        keys = [req.keys[0][0], req.keys[1][0]]
        ctx = vbase.ReqContext(req_id="r")
        assert manager.prepare_store(keys, ctx) is not None
        manager.complete_store(keys, ctx)
        manager.stack.manager.wait_idle()  # the cascade to the file tier ended
        manager.on_schedule_end(END)
        events = list(connector.take_events())
        assert events, "nothing announced"
        publisher.publish(KVEventBatch(ts=time.time(), events=events))
        assert subscriber.wait_for(start + 1, JOIN_TIMEOUT_S)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        [frames] = subscriber.messages[start:start + 1]
        assert frames[0] == b"media"
        batch = decoder.decode(frames[2])
        seen = {(e.medium, e.ownership) for e in batch.events if isinstance(e, BlockStored)}
        assert seen == {("host", None), ("shared_storage", "file")}
    finally:
        publisher.shutdown()
        subscriber.close()
        manager.shutdown()
