"""Latency histograms for the metrics exporter, kept without prometheus-client.

:class:`LatencyHistograms` counts job latencies into the fixed buckets of
:data:`~kvtiers.stack.metrics_catalog.HISTOGRAM_BUCKETS_S`, per job kind and label value
(a tier's name, or a worker direction). Writers are the scheduler thread (promotion and
cascade jobs, from the composite) and the engine thread that collects worker results
(:class:`TimedWorker`); the exporter's HTTP thread reads a consistent copy with
:meth:`LatencyHistograms.snapshot`. One lock guards the counts; an observation is a
bisect and three additions under it.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvtiers.core.specs import GroupTransfer
from kvtiers.core.worker import OffloadingWorker, TransferResult
from kvtiers.stack.metrics_catalog import HISTOGRAM_BUCKETS_S


@dataclass(frozen=True)
class HistogramCounts:
    """One histogram: per-bucket counts (not cumulative; the last is ``+Inf``), count, sum."""

    buckets: tuple[int, ...]
    count: int
    sum_s: float

    def cumulative(self) -> list[int]:
        """Counts of observations ``<=`` each bound, ``+Inf`` last."""
        total, out = 0, []
        for value in self.buckets:
            total += value
            out.append(total)
        return out


class LatencyHistograms:
    """Latency histograms keyed by ``(kind, label value)``; thread-safe."""

    def __init__(self, bounds: Sequence[float] = HISTOGRAM_BUCKETS_S) -> None:
        self.bounds = tuple(bounds)
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str], list[int]] = {}
        self._sums: dict[tuple[str, str], float] = {}

    def observe(self, kind: str, label: str, seconds: float) -> None:
        """Count one job of ``kind`` (``promote``, ``cascade``, ``load``, ``store``)."""
        index = bisect.bisect_left(self.bounds, seconds)
        key = (kind, label)
        with self._lock:
            buckets = self._buckets.get(key)
            if buckets is None:
                buckets = self._buckets[key] = [0] * (len(self.bounds) + 1)
                self._sums[key] = 0.0
            buckets[index] += 1
            self._sums[key] += seconds

    def declare(self, kind: str, label: str) -> None:
        """Export the histogram ``(kind, label)`` with zero counts until its first
        observation, so a scraper sees every series from the start (``absent()`` and
        ``rate()`` need one)."""
        with self._lock:
            if (kind, label) not in self._buckets:
                self._buckets[(kind, label)] = [0] * (len(self.bounds) + 1)
                self._sums[(kind, label)] = 0.0

    def snapshot(self) -> dict[tuple[str, str], HistogramCounts]:
        """A copy of every histogram, taken under the lock."""
        with self._lock:
            return {key: HistogramCounts(tuple(b), sum(b), self._sums[key])
                    for key, b in self._buckets.items()}


class TimedWorker(OffloadingWorker):
    """A worker that counts each finished job's ``transfer_s`` by direction; everything
    else is forwarded unchanged."""

    def __init__(self, inner: OffloadingWorker, histograms: LatencyHistograms) -> None:
        self.inner = inner
        self.histograms = histograms
        self._directions: dict[int, str] = {}

    def submit_store(self, job_id: int, groups: Sequence[GroupTransfer]) -> bool:
        accepted = self.inner.submit_store(job_id, groups)
        if accepted:
            self._directions[job_id] = "store"
        return accepted

    def submit_load(self, job_id: int, groups: Sequence[GroupTransfer]) -> bool:
        accepted = self.inner.submit_load(job_id, groups)
        if accepted:
            self._directions[job_id] = "load"
        return accepted

    def get_finished(self) -> list[TransferResult]:
        results = self.inner.get_finished()
        for result in results:
            direction = self._directions.pop(result.job_id, None)
            if direction is not None:
                self.histograms.observe(direction, direction, result.transfer_s)
        return results

    def wait(self, job_ids: Collection[int]) -> None:
        self.inner.wait(job_ids)

    def shutdown(self) -> None:
        self.inner.shutdown()
