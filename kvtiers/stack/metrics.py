"""Prometheus export of a manager's stats (``metrics: {port: …}`` in a stack file).

Each stat ``<tier>.<name>`` becomes the metric ``kvtiers_<name>`` with label
``tier="<tier>"``; the composite's own counters carry ``tier="stack"``. Gauges (sizes,
chunk counts) keep their name; everything else is a counter and gets ``_total``. A scrape
reads the composite's ``stats_snapshot``, taken on the scheduler thread at the end of
each step, so the HTTP thread never touches tier state. prometheus-client is imported
only here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from kvtiers.stack.composite import TieredManager

GAUGES = frozenset({"chunks", "usage_bytes", "capacity_bytes", "capacity_chunks",
                    "pinned_chunks", "io_backend", "backing_off"})


class _StatsCollector:
    def __init__(self, manager: TieredManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        by_name: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for full_name, value in self.manager.stats_snapshot.items():
            tier, _, name = full_name.rpartition(".")
            by_name[name].append((tier or "stack", float(value)))
        for name, samples in sorted(by_name.items()):
            family: GaugeMetricFamily | CounterMetricFamily
            if name in GAUGES:
                family = GaugeMetricFamily(f"kvtiers_{name}", f"kvtiers {name}", labels=["tier"])
            else:
                family = CounterMetricFamily(f"kvtiers_{name}", f"kvtiers {name}", labels=["tier"])
            for tier, value in samples:
                family.add_metric([tier], value)
            yield family


class MetricsServer:
    """A running exporter; :meth:`close` stops it."""

    def __init__(self, server: Any, port: int) -> None:
        self._server = server
        self.port = port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(manager: TieredManager, addr: str, port: int) -> MetricsServer:
    """Serve ``manager``'s stats on ``http://addr:port/metrics`` (port 0: any free port)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(_StatsCollector(manager))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server, server.server_address[1])
