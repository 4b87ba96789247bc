"""Prometheus export of a stack's stats and latencies (``metrics:`` in a stack file).

Names, types, labels and HELP text come from :mod:`kvtiers.stack.metrics_catalog`: the
composite's counters are ``kvtiers_stack_*`` (no ``tier`` label), each tier's are
``kvtiers_tier_*{tier="<name>"}``, so summing one metric never mixes the two levels.
Promotion, cascade and (for a worker in this process) GPU transfer latencies are
histograms; ``kvtiers_build_info`` names the release. Every stack series, and every
latency histogram a stack can fill, is exported from the first scrape (zero until
counted), and every HELP text ends with the unit. A scrape reads the composite's
``stats_snapshot``, taken on the scheduler thread at most every ``refresh_s`` seconds,
and a locked copy of the histograms, so the HTTP thread never touches tier state.
prometheus-client is imported only here.

The exporter listens on ``addr`` (default ``127.0.0.1``: this host only; ``0.0.0.0`` for
a scraper on another host or pod) and ``port`` (default
:data:`~kvtiers.config.stack.DEFAULT_METRICS_PORT`, 8471).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from kvtiers.errors import ConfigError
from kvtiers.stack.composite import TieredManager
from kvtiers.stack.metrics_catalog import (
    ENGINE,
    HISTOGRAMS,
    IO_BACKENDS,
    STACK,
    TIER,
    MetricSpec,
    tier_fallback,
    with_unit,
)
from kvtiers.stack.metrics_latency import LatencyHistograms


def _family(spec: MetricSpec, labels: list[str]) -> Any:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        InfoMetricFamily,
    )

    help_text = with_unit(spec)
    if spec.kind == "counter":
        return CounterMetricFamily(spec.name, help_text, labels=labels)
    if spec.kind == "info":
        return InfoMetricFamily(spec.name, help_text, labels=labels)
    return GaugeMetricFamily(spec.name, help_text, labels=labels)


def _build_info() -> Any:
    """``kvtiers_build_info{version, python} 1``: which kvtiers a scrape came from."""
    import platform

    from prometheus_client.core import GaugeMetricFamily

    from kvtiers.release import __version__

    family = GaugeMetricFamily(
        "kvtiers_build_info",
        "The kvtiers release and Python version exporting these series; always 1. "
        "Unit: none (labels only).",
        labels=["version", "python"])
    family.add_metric([__version__, platform.python_version()], 1.0)
    return family


#: A source of stats beside the composite's: called on the exporter's thread at each
#: scrape, so it must only read numbers another thread writes (no tier state).
StatsSource = Callable[[], Mapping[str, float]]
#: A source of whole metric families (prometheus-client's), under the same rule.
FamiliesSource = Callable[[], Iterable[Any]]


class _StatsCollector:
    def __init__(self, manager: TieredManager, latency: LatencyHistograms | None) -> None:
        self.manager = manager
        self.latency = latency
        self.sources: list[StatsSource] = []
        self.families: list[FamiliesSource] = []
        #: The composite's stats a families source exports in a labelled form instead.
        self.replaced: set[str] = set()

    def collect(self) -> Iterator[Any]:
        # name → (spec, label names, samples of (label values, value))
        families: dict[str, tuple[MetricSpec, list[str], list[tuple[list[str], float]]]] = {}

        def add(spec: MetricSpec, labels: dict[str, str], value: float) -> None:
            names = sorted({**spec.labels, **labels})
            entry = families.setdefault(spec.name, (spec, names, []))
            merged = {**spec.labels, **labels}
            entry[2].append(([merged[n] for n in entry[1]], value))

        snapshot = dict(self.manager.stats_snapshot)
        for stat in STACK:
            # Every stack series from the first scrape, zero until counted.
            snapshot.setdefault(stat, 0.0)
        for source in self.sources:
            counts = dict(source())
            for stat in ENGINE:
                counts.setdefault(stat, 0.0)
            snapshot.update(counts)
        for full_name, value in snapshot.items():
            tier, _, stat = full_name.rpartition(".")
            if not tier and stat in self.replaced:
                continue
            if not tier:
                known = STACK.get(stat) or ENGINE.get(stat)
                add(known or tier_fallback(stat), {} if known else {"tier": "stack"},
                    float(value))
            elif stat == "io_backend":
                backend = IO_BACKENDS.get(int(value), f"code{int(value)}")
                add(TIER[stat], {"tier": tier, "backend": backend}, 1.0)
            else:
                add(TIER.get(stat) or tier_fallback(stat), {"tier": tier}, float(value))
        for spec, labels, samples in families.values():
            family = _family(spec, labels)
            for values, value in samples:
                if spec.kind == "info":
                    family.add_metric(values[:1], dict(zip(labels[1:], values[1:], strict=True)))
                else:
                    family.add_metric(values, value)
            yield family
        yield _build_info()
        for extra in self.families:
            yield from extra()
        if self.latency is not None:
            yield from self._histograms(self.latency)

    @staticmethod
    def _histograms(latency: LatencyHistograms) -> Iterator[Any]:
        from prometheus_client.core import HistogramMetricFamily

        grouped: dict[str, list[tuple[str, str, Any]]] = defaultdict(list)
        for (kind, label), counts in sorted(latency.snapshot().items()):
            grouped[HISTOGRAMS[kind][0]].append((kind, label, counts))
        bounds = [f"{b:g}" for b in latency.bounds] + ["+Inf"]
        for name in sorted({n for n, _ in HISTOGRAMS.values()}):
            kind_of = {n: (k, h) for k, (n, h) in HISTOGRAMS.items()}
            label = "direction" if kind_of[name][0] in ("load", "store") else "tier"
            family = HistogramMetricFamily(name, f"{kind_of[name][1]} Unit: seconds.",
                                           labels=[label])
            for _kind, value, counts in grouped.get(name, []):
                family.add_metric([value], list(zip(bounds, counts.cumulative(), strict=True)),
                                  counts.sum_s)
            yield family


class MetricsServer:
    """A running exporter; :meth:`close` stops it."""

    def __init__(self, server: Any, port: int, collector: _StatsCollector) -> None:
        self._server = server
        self.port = port
        self._collector = collector

    def add_source(self, source: StatsSource) -> None:
        """Export ``source()``'s stats beside the composite's at every scrape (an engine
        integration's counters, named in :data:`~kvtiers.stack.metrics_catalog.ENGINE`;
        those it does not return are exported as zero)."""
        self._collector.sources.append(source)

    def add_families(self, source: FamiliesSource, *, replaces: Iterable[str] = ()) -> None:
        """Export the metric families ``source()`` yields at every scrape (series with
        labels of their own, such as :mod:`kvtiers.stack.tenants`' per-tenant bytes).
        ``replaces``: the composite's stats (:data:`~kvtiers.stack.metrics_catalog.STACK`
        names) whose family ``source`` yields with labels of its own; their unlabelled
        series are no longer exported (a family never mixes the two)."""
        self._collector.families.append(source)
        self._collector.replaced.update(replaces)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(
    manager: TieredManager,
    addr: str,
    port: int,
    latency: LatencyHistograms | None = None,
    admin: Callable[[Any], Any] | None = None,
) -> MetricsServer:
    """Serve ``manager``'s stats on ``http://addr:port/metrics`` (port 0: any free port).
    ``admin``, given the metrics WSGI app, returns the app to serve instead (the
    retention admin endpoint, :mod:`kvtiers.stack.admin`, which hands other paths on).

    Raises :class:`ConfigError` (path ``metrics.port``) when the address cannot be bound."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    collector = _StatsCollector(manager, latency)
    registry.register(collector)
    try:
        if admin is None:
            server, _thread = start_http_server(port, addr=addr, registry=registry)
        else:
            server = _serve_app(admin(_metrics_app(registry)), addr, port)
    except OSError as exc:
        raise ConfigError(
            f"the metrics exporter cannot listen on {addr}:{port}: {exc.strerror or exc}; "
            "choose another metrics.port (0 picks a free one) or metrics.addr",
            path="metrics.port",
        ) from None
    return MetricsServer(server, server.server_address[1], collector)


def _metrics_app(registry: Any) -> Any:
    from prometheus_client import make_wsgi_app

    return make_wsgi_app(registry)


def _serve_app(app: Any, addr: str, port: int) -> Any:
    """Serve the WSGI ``app`` on ``addr:port`` from a daemon thread, a thread per request
    (as prometheus-client's own server does), logging nothing per request."""
    import socket
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            """Requests are not logged (a scrape every few seconds would flood logs)."""

    server = make_server(addr, port, app, Server, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, name="kvtiers-metrics",
                     daemon=True).start()
    return server
