"""The medium each tier announces in vLLM's KV events, as the stack file names it
(``event_medium`` on a tier; docs/retention.md, "Medium names for routers").

vLLM's event tracker writes a tier's medium as ``CPU`` or ``STORAGE`` (its ``Medium``
enum); routers score media by name and give a name they do not know no weight. A tier
with ``event_medium`` has its ``BlockStored`` / ``BlockRemoved`` events renamed on their
way to vLLM's publisher (:class:`~kvtiers.integrations.vllm.connector.KVTiersConnector`'s
``take_events``); everything else, the GPU cache's events included, passes unchanged. A
tier's events are told apart by what vLLM writes for them: the primary's by medium
``CPU`` and no ownership, a lower tier's by medium ``STORAGE`` and its name as ownership.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from kvtiers.config import StackConfig

#: (vLLM's medium string, ownership) of a tier's events → the medium announced instead.
MediumNames = Mapping[tuple[str, str | None], str]


def medium_names(config: StackConfig) -> dict[tuple[str, str | None], str]:
    """The renames ``config``'s tiers ask for (none: an empty mapping)."""
    names: dict[tuple[str, str | None], str] = {}
    for index, tier in enumerate(config.tiers):
        if tier.event_medium is None:
            continue
        source = ("CPU", None) if index == 0 else ("STORAGE", tier.name)
        names[source] = tier.event_medium
    return names


def renamed(events: Iterable[Any], names: MediumNames) -> Iterator[Any]:
    """``events`` (vLLM's ``KVCacheEvent``s) with each configured tier's medium renamed;
    an event of another tier, or without a medium, as it is."""
    import msgspec

    for event in events:
        medium = getattr(event, "medium", None)
        name = None if medium is None else names.get((medium, getattr(event, "ownership", None)))
        yield event if name is None else msgspec.structs.replace(event, medium=name)
