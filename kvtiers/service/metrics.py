"""Prometheus export of ``kvtiers serve`` (``--metrics-port``): the pool, each namespace,
each attached engine, and the service's event counters.

A scrape asks the service's loop for a fresh :meth:`~kvtiers.service.server.Service.
state` (:meth:`Service.snapshot`, answered on the loop's thread within a bounded wait),
so the HTTP thread never reads the loop's tables. prometheus-client (the ``metrics``
extra) is imported only here.

Families: ``kvtiers_service_pool_slots{state}`` (total, used, ready, pinned, held,
leased; held: evicted or staged slots a lower tier's copy still reads),
``kvtiers_service_slot_bytes``, ``kvtiers_service_namespace_chunks{namespace}``,
``kvtiers_service_namespace_bytes{namespace}``, counters
``kvtiers_service_namespace_{hits,misses,stored}_total{namespace}``,
``kvtiers_service_namespace_adopted_chunks{namespace}`` (re-adopted at the last start),
``kvtiers_service_namespace_engines{namespace}`` (attached now), ``kvtiers_service_engines``,
``kvtiers_service_engine_{pins,leased_slots}{pid,engine}``, counters
``kvtiers_service_engine_{lookups,hits}_total{pid,engine}`` (as each engine reports
them with its step's end write) and ``kvtiers_service_engine_stored{,_bytes}_total
{pid,engine}`` (what it stored into the pool),
``kvtiers_service_tenant_{bytes,chunks}{tenant}`` (with a ``tenants:`` section: each
tenant's chunks in the pool, counted by their keys' tags, in whole slots),
``kvtiers_service_retention_pinned_bytes{tenant}`` (with a ``retention:`` section: the
bytes each tenant's pins hold in the pool now, every tenant listed; without a
``tenants:`` section one unlabelled series for the pool, as ``kvtiers status`` shows them)
and ``kvtiers_service_events_total{event}`` (attaches, detaches, connections, evictions,
refused_peers, bad_messages, slow_clients, duplicate_stores, adopted and the
adoption's torn, corrupt and foreign slots). With tiers below the pool, per namespace
and lower tier: ``kvtiers_service_lower_chunks{namespace,tier}`` (indexed),
``kvtiers_service_lower_index_complete{namespace,tier}`` (1 once the background index is
merged), counters ``kvtiers_service_lower_{cascaded,promoted,demoted}_chunks_total`` and
``…_bytes_total{namespace,tier}``; per namespace
``kvtiers_service_lower_{promotions,cascades}_total{namespace,outcome}`` (done, failed,
refused), ``kvtiers_service_lower_demotions_total{namespace,outcome}`` (done, failed,
refused, dropped: evicted from the pool before a demotion took it) and
``kvtiers_service_lower_corrupt_chunks_total{namespace}``. Engines look chunks up in the
mirror without a round trip, so a namespace's hits are counted at its pins, and an
engine's lookups are what it reports (the same counts as its own stack exporter's
``kind: service`` tier families, ``kvtiers_tier_*``, as of its last step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kvtiers.errors import ConfigError


class _Collector:
    def __init__(self, snapshot: Callable[[], dict[str, Any] | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        state = self._snapshot()
        if state is None:  # the loop did not answer in time: export nothing this time
            return
        slots = GaugeMetricFamily("kvtiers_service_pool_slots",
                                  "Slots of the pool by state (slots)", labels=["state"])
        for name, key in (("total", "num_slots"), ("used", "used_slots"),
                          ("ready", "ready_slots"), ("pinned", "pinned_slots"),
                          ("held", "held_slots"), ("leased", "leased_slots")):
            slots.add_metric([name], state[key])
        yield slots
        yield GaugeMetricFamily("kvtiers_service_slot_bytes", "Size of one slot (bytes)",
                                value=state["slot_bytes"])
        gauges = {
            "chunks": GaugeMetricFamily("kvtiers_service_namespace_chunks",
                                        "Chunks held per namespace (chunks)",
                                        labels=["namespace"]),
            "bytes": GaugeMetricFamily("kvtiers_service_namespace_bytes",
                                       "Bytes held per namespace (bytes)",
                                       labels=["namespace"]),
            "adopted": GaugeMetricFamily("kvtiers_service_namespace_adopted_chunks",
                                         "Chunks re-adopted at the service's start (chunks)",
                                         labels=["namespace"]),
        }
        counters = {
            name: CounterMetricFamily(f"kvtiers_service_namespace_{name}",
                                      f"Pins that {what} per namespace (keys)"
                                      if name != "stored" else
                                      "Chunks stored per namespace (chunks)",
                                      labels=["namespace"])
            for name, what in (("hits", "found the chunk"), ("misses", "did not"),
                               ("stored", ""))
        }
        attached = GaugeMetricFamily("kvtiers_service_namespace_engines",
                                     "Engines attached per namespace (engines)",
                                     labels=["namespace"])
        for ns in state["namespaces"]:
            for name, family in gauges.items():
                family.add_metric([ns["name"]], ns[name])
            for name, counter in counters.items():
                counter.add_metric([ns["name"]], ns[name])
            attached.add_metric([ns["name"]], sum(ns["index"] in engine["namespaces"]
                                                  for engine in state["engines"]))
        yield from gauges.values()
        yield attached
        yield from counters.values()
        yield GaugeMetricFamily("kvtiers_service_engines", "Attached engines (engines)",
                                value=len(state["engines"]))
        pins = GaugeMetricFamily("kvtiers_service_engine_pins",
                                 "Pins held per attached engine (pins)",
                                 labels=["pid", "engine"])
        leased = GaugeMetricFamily("kvtiers_service_engine_leased_slots",
                                   "Slots leased per attached engine (slots)",
                                   labels=["pid", "engine"])
        engine_counts = {
            name: CounterMetricFamily(f"kvtiers_service_engine_{name}", help_text,
                                      labels=["pid", "engine"])
            for name, help_text in (
                ("lookups", "Lookups the engine answered from the pool's mirror, as it "
                 "reports them (lookups)"),
                ("hits", "Of those, the chunks found in the pool (lookups)"),
                ("stored", "Chunks the engine stored into the pool (chunks)"),
                ("stored_bytes", "Bytes the engine stored into the pool (bytes)"))
        }
        for engine in state["engines"]:
            labels = [str(engine["pid"]), engine["engine"]]
            pins.add_metric(labels, engine["pins"])
            leased.add_metric(labels, engine["leased"])
            for name, counted in engine_counts.items():
                counted.add_metric(labels, engine[name])
        yield pins
        yield leased
        yield from engine_counts.values()
        tenant_bytes = GaugeMetricFamily("kvtiers_service_tenant_bytes",
                                         "Pool bytes held per tenant, in whole slots (bytes)",
                                         labels=["tenant"])
        tenant_chunks = GaugeMetricFamily("kvtiers_service_tenant_chunks",
                                          "Chunks held in the pool per tenant (chunks)",
                                          labels=["tenant"])
        for tenant in state.get("tenants", []):
            tenant_bytes.add_metric([tenant["name"]], tenant["bytes"])
            tenant_chunks.add_metric([tenant["name"]], tenant["chunks"])
        yield tenant_bytes
        yield tenant_chunks
        yield from _retention_families(state)
        yield from _lower_families(state)
        events = CounterMetricFamily("kvtiers_service_events",
                                     "Service events since its start (events)",
                                     labels=["event"])
        for name, value in sorted(state["counters"].items()):
            events.add_metric([name], value)
        yield events


def _retention_families(state: dict[str, Any]) -> Iterator[Any]:
    """``kvtiers_service_retention_pinned_bytes`` from the state's ``retention`` (see the
    module docstring); nothing without a ``retention:`` section. Its ``pins`` list one
    entry per tenant, or one of tenant ``None`` (the pool) without tenants."""
    from prometheus_client.core import GaugeMetricFamily

    retention = state.get("retention")
    if retention is None:
        return
    name = "kvtiers_service_retention_pinned_bytes"
    pins = retention["pins"]
    if [entry["tenant"] for entry in pins] == [None]:
        yield GaugeMetricFamily(name, "Bytes the retention pins hold in the pool (bytes)",
                                value=pins[0]["pinned_bytes"])
        return
    family = GaugeMetricFamily(name, "Bytes each tenant's retention pins hold in the pool "
                               "(bytes)", labels=["tenant"])
    for entry in pins:
        family.add_metric([entry["tenant"]], entry["pinned_bytes"])
    yield family


#: Per namespace: each family's outcomes and the composite's counter of each.
_OUTCOMES = {
    "promotions": (("done", "promotions"), ("failed", "promotion_failures"),
                   ("refused", "promotions_refused")),
    "cascades": (("done", "cascades"), ("failed", "cascade_failures"),
                 ("refused", "cascades_refused")),
    "demotions": (("done", "demotions"), ("failed", "demotion_failures"),
                  ("refused", "demotions_refused"), ("dropped", "demotions_dropped")),
}


def _lower_families(state: dict[str, Any]) -> Iterator[Any]:
    """The lower tiers' families (see the module docstring)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    names = {ns["index"]: ns["name"] for ns in state["namespaces"]}
    both = ["namespace", "tier"]
    chunks = GaugeMetricFamily("kvtiers_service_lower_chunks",
                               "Chunks indexed per lower tier (chunks)", labels=both)
    complete = GaugeMetricFamily("kvtiers_service_lower_index_complete",
                                 "Whether a lower tier's index is complete (1) or still "
                                 "being built (0)", labels=both)
    moved = {
        (name, unit): CounterMetricFamily(
            f"kvtiers_service_lower_{name}_{unit}",
            f"{what} per lower tier ({unit})", labels=both)
        for name, what in (("cascaded", "Written from the pool (write-behind)"),
                           ("promoted", "Read into the pool"),
                           ("demoted", "Written from the pool at its eviction"))
        for unit in ("chunks", "bytes")
    }
    outcomes = {
        kind: CounterMetricFamily(f"kvtiers_service_lower_{kind}",
                                  f"Chunks in {kind} below the pool by outcome (chunks)",
                                  labels=["namespace", "outcome"])
        for kind in _OUTCOMES
    }
    corrupt = CounterMetricFamily("kvtiers_service_lower_corrupt_chunks",
                                  "Chunks found corrupt below the pool (chunks)",
                                  labels=["namespace"])
    for entry in state.get("lower_tiers", []):
        namespace = names.get(entry["namespace"], str(entry["namespace"]))
        for tier in entry["tiers"]:
            labels = [namespace, tier["name"]]
            if tier["chunks"] is not None:
                chunks.add_metric(labels, tier["chunks"])
            complete.add_metric(labels, 1 if tier["indexed"] else 0)
            for (name, unit), family in moved.items():
                family.add_metric(labels, tier[name if unit == "chunks" else f"{name}_bytes"])
        for kind, pairs in _OUTCOMES.items():
            for outcome, counter in pairs:
                outcomes[kind].add_metric([namespace, outcome], entry[counter])
        corrupt.add_metric([namespace], entry["corrupt_chunks"])
    yield chunks
    yield complete
    yield from moved.values()
    yield from outcomes.values()
    yield corrupt


def start_exporter(snapshot: Callable[[], dict[str, Any] | None], *, port: int,
                   addr: str = "127.0.0.1", admin: Callable[[Any], Any] | None = None) -> Any:
    """Serve the service's metrics on ``addr:port``; returns the HTTP server (its
    ``shutdown`` stops it). A port that cannot be bound is a :class:`ConfigError`.
    ``admin``, given the metrics WSGI app, returns the app to serve instead (the
    retention admin endpoint, :func:`kvtiers.service.retention.service_admin`)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(_Collector(snapshot))
    try:
        if admin is None:
            server, _thread = start_http_server(port, addr=addr, registry=registry)
        else:
            from kvtiers.stack.metrics import _metrics_app, _serve_app

            server = _serve_app(admin(_metrics_app(registry)), addr, port)
    except OSError as exc:
        raise ConfigError(f"the service's metrics cannot listen on {addr}:{port}: "
                          f"{exc.strerror or exc}", path="metrics-port") from None
    return server
