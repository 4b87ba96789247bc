"""kvtiers' file and S3 tiers as secondary tiers of vLLM's own ``TieringOffloadingSpec``.

vLLM keeps its CPU tier (the primary) and hands each secondary tier a ``memoryview`` of
its chunk rows, ``shape (num_chunks, row_bytes)``; chunk ``c`` lives in row ``c``. A
:class:`KVTiersFileTier` / :class:`KVTiersS3Tier` wraps kvtiers' tier manager and mover
over that memory (:class:`MemoryviewRegion`), so vLLM users gain kvtiers' bounded,
checksummed, restart-safe file tier and its S3 tier without changing their primary.

What a chunk holds: vLLM's CPU chunk, i.e. every rank's bytes of the chunk side by side
(``worker_kv_bytes_per_block x copies x blocks_per_chunk``, the row's trailing alignment
padding left out), whatever its group. The identity records that layout (``kv_layout``
``<layout>+vllm-cpu-chunk``) so these chunks never share a namespace with chunks written
by :class:`~kvtiers.integrations.vllm.KVTiersOffloadingSpec`, and vLLM's canonical format
id when vLLM stores canonical pages (``canonical_layout``), so a canonical-layout engine
and a direct-layout engine never read each other's chunks.

Jobs: ``submit_store`` reserves the keys the tier does not hold yet (a tier that cannot
make room fails the job; keys already held succeed at once) and copies the rest from
their primary rows; ``submit_load`` pins the keys still held and copies them into the
rows vLLM allocated, a job with missing or corrupt chunks reporting the keys that did
arrive. A :class:`~kvtiers.tiers.jobs.JobDriver` (without a primary manager: the rows are
vLLM's) runs the copies and releases every reservation and pin. Results are collected in
``get_finished_jobs``; ``drain_jobs`` blocks until no copy touches the primary memory.

Events: only with the tier's ``enable_kv_events`` AND vLLM's global KV-events flag (off,
vLLM never drains ``take_events``, so the tier drops its own events every step); they
carry the configured ``locality`` (the tier kind's when none is configured), and the keys
of a failed store come back as a ``metadata_only`` removal. ``shutdown`` releases every
view of vLLM's primary memory, so vLLM can unmap it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, ClassVar

from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

from kvtiers.config import FileTierConfig, S3TierConfig, resolve_factory
from kvtiers.config.schema import parse_section
from kvtiers.config.tiers import TierConfig
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext, ScheduleEndContext
from kvtiers.core.mover import MoverResult
from kvtiers.errors import ConfigError
from kvtiers.integrations.vllm.engine import find_engine_configs, layout_name
from kvtiers.integrations.vllm.translate import (
    HAS_METADATA_ONLY,
    KeyMap,
    block_hash_algorithm,
    kvtiers_context,
    translate_config,
    vllm_event,
    vllm_request_context,
    warn_unstable_hashes,
)
from kvtiers.tiers.jobs import FinishedJob, JobDriver

CHUNK_LAYOUT_SUFFIX = "+vllm-cpu-chunk"


def canonical_format(config: Any) -> str:
    """vLLM's id of the canonical chunk byte format when ``canonical_layout`` is on (it
    couples the format version with the KV layout family), else ``""``."""
    if not config.canonical_layout:
        return ""
    if config.kv_cache_layout is None:
        raise ConfigError(
            "canonical_layout is on but vLLM reported no KV cache layout to name the "
            "canonical format after",
            path="kv_connector_extra_config.canonical_layout",
        )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
        canonical_format_id,
    )

    # vLLM's compatibility aliases (NHD, HND) name layouts canonical_format_id only knows
    # by their enum names.
    layout = layout_name(config.kv_cache_layout, path="cache_config.kv_cache_layout")
    return str(canonical_format_id(layout))


class MemoryviewRegion:
    """A :class:`~kvtiers.core.mover.HostRegion` over vLLM's 2-D primary memoryview."""

    def __init__(self, view: memoryview) -> None:
        if view.ndim != 2 or view.strides is None or view.readonly:
            raise ConfigError(
                f"expected a writable (num_chunks, row_bytes) memoryview of the primary "
                f"tier, got {view.ndim} dimensions (readonly={view.readonly})",
                path="primary_kv_view",
            )
        self._num_slots = view.shape[0] if view.shape else 0
        self._slot_bytes = view.strides[0]
        self._flat = view.cast("B")

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    def release(self) -> None:
        """Let go of vLLM's memory: after this no view of it is held here, so vLLM can
        unmap it. Views handed out earlier must be gone (every copy drained)."""
        self._flat.release()
        self._num_slots = 0

    def view(self, slot_id: int) -> memoryview:
        if not 0 <= slot_id < self._num_slots:
            raise IndexError(f"chunk {slot_id} outside [0, {self._num_slots})")
        start = slot_id * self._slot_bytes
        return self._flat[start : start + self._slot_bytes]


# vLLM's keys paired with kvtiers' keys, in the order of vLLM's job.
_KeyPairs = list[tuple[Any, OffloadKey]]


class _KVTiersSecondaryTier(SecondaryTierManager):
    """A kvtiers lower tier under vLLM's tiering manager (see the module docstring)."""

    medium: ClassVar[Any] = vbase.Medium.STORAGE
    config_type: ClassVar[type[TierConfig]]

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        locality: str | None = None,
        enable_kv_events: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        where = f"secondary_tiers[type={tier_type}]"
        if locality is not None:
            try:
                self.locality = vbase.Locality(locality)
            except ValueError:
                raise ConfigError(
                    f"expected LOCAL or REMOTE, got {locality!r}", path=f"{where}.locality"
                ) from None
        config = offloading_spec.config
        region = MemoryviewRegion(primary_kv_view)
        self._region = region
        copies = 1 if getattr(offloading_spec, "replicated_layout", False) else (
            config.parallel.world_size
        )
        bytes_per_block = config.worker_kv_bytes_per_block * copies
        chunk_bytes = bytes_per_block * config.cache.blocks_per_chunk
        if not 0 < chunk_bytes <= region.slot_bytes:
            raise ConfigError(
                f"a chunk of {chunk_bytes} bytes does not fit the primary's rows of "
                f"{region.slot_bytes} bytes",
                path=f"{where}.primary_kv_view",
            )
        tier_config = parse_section(self.config_type, options, where, defaults={"name": tier_type})
        # Read while vLLM's connector is building its scheduler (see engine.py).
        engine = find_engine_configs()
        algorithm = block_hash_algorithm(config.extra_config, engine)
        warn_unstable_hashes(algorithm)
        offloading = translate_config(
            config,
            engine=engine,
            group_bytes_per_block=[bytes_per_block] * len(config.groups),
            hash_algorithm=algorithm,
            layout_agnostic=config.parallel.is_parallelism_agnostic or config.replicated_layout,
            # Every kvtiers secondary tier keeps its chunks beyond the process.
            persistent=True,
            kv_layout_suffix=CHUNK_LAYOUT_SUFFIX,
            canonical_format=canonical_format(config),
        )
        factory = resolve_factory(tier_config.kind, path=f"{where}.type")
        self.tier = factory(tier_config, offloading, primary_region=region, name=tier_config.name)
        assert self.tier.mover is not None
        self.manager = self.tier.manager
        self._mover = self.tier.mover
        self._keys = KeyMap([group.group_id for group in config.groups])
        # vLLM drains take_events only when its global KV-events flag is on; off, capture
        # stays inert (the tier's own events are dropped every step).
        self._events_enabled = enable_kv_events and bool(config.enable_kv_cache_events)
        # Bookkeeping-only removals (keys of failed stores) for take_events.
        self._failed_store_events: list[Any] = []
        self._jobs: JobDriver[_KeyPairs] = JobDriver(
            self.manager, self._mover, self._finished, ctx=ReqContext(req_id="kvtiers-vllm-tier")
        )
        self._results: list[JobResult] = []

    # -- lookups and requests ---------------------------------------------------------
    def lookup(self, key: Any, req_context: Any) -> Any:
        result = self.manager.lookup(self._keys.to_kvtiers(key), kvtiers_context(req_context))
        if result is LookupResult.HIT:
            return vbase.LookupResult.HIT
        if result is LookupResult.MISS:
            return vbase.LookupResult.MISS
        # Being written here, or an existence probe under way: ask again next step.
        return vbase.LookupResult.RETRY

    def touch(self, keys: Collection[Any], req_context: Any) -> None:
        self.manager.touch(self._keys.all_to_kvtiers(keys), kvtiers_context(req_context))

    def on_new_request(self, req_context: Any) -> Any:
        return vllm_request_context(self.manager.on_new_request(kvtiers_context(req_context)))

    def on_request_finished(self, req_context: Any) -> None:
        self.manager.on_request_finished(kvtiers_context(req_context))

    # -- jobs -------------------------------------------------------------------------
    def submit_store(self, job_metadata: Any) -> None:
        job_id = job_metadata.job_id
        ctx = kvtiers_context(job_metadata.req_context)
        pairs = [(key, self._keys.to_kvtiers(key)) for key in job_metadata.keys]
        ours = [k for _, k in pairs]
        slot_of = dict(zip(ours, (int(c) for c in job_metadata.chunk_ids), strict=True))
        accepted = self._jobs.store(job_id, ours, ctx, pairs, slots=slot_of)
        if accepted is None:
            self._store_failed([vkey for vkey, _ in pairs])
            self._results.append(JobResult(job_id=job_id, success=False))
        elif not accepted:
            self._results.append(JobResult(job_id=job_id, success=True))

    def submit_load(self, job_metadata: Any) -> None:
        job_id = job_metadata.job_id
        ctx = kvtiers_context(job_metadata.req_context)
        pairs = [(key, self._keys.to_kvtiers(key)) for key in job_metadata.keys]
        # One pin and one copy per occurrence: a key listed twice fills both of its rows.
        # A key evicted since vLLM's lookup (a store in the same step can evict it) is
        # skipped and reported missing.
        for (_, key), chunk in zip(pairs, job_metadata.chunk_ids, strict=True):
            self._jobs.hold_for_load(key, ctx, slot=int(chunk))
        if not self._jobs.load_held(job_id, pairs):
            self._results.append(_load_result(job_id, pairs, MoverResult(job_id, ())))

    def _finished(self, job: FinishedJob[_KeyPairs]) -> None:
        """A job ended (the driver released its reservations and pins): queue its result."""
        result = job.result
        if job.load:
            self._results.append(_load_result(job.job_id, job.tag, result))
            return
        if job.failed:
            failed = set(job.failed)
            self._store_failed([vkey for vkey, key in job.tag if key in failed])
        self._results.append(
            JobResult(
                job_id=job.job_id,
                success=not job.failed,
                transfer_time=result.transfer_s,
                transfer_bytes=result.transfer_bytes,
            )
        )

    def _store_failed(self, vllm_keys: list[Any]) -> None:
        """Queue a bookkeeping-only removal of keys a store did not land (vLLM's event
        tracker then drops what it recorded for them here)."""
        if vllm_keys and self._events_enabled and HAS_METADATA_ONLY:
            self._failed_store_events.append(
                vbase.OffloadingEvent(
                    keys=vllm_keys,
                    medium=self.medium,
                    removed=True,
                    locality=self.locality,
                    ownership=self.tier_type,
                    metadata_only=True,
                )
            )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._jobs.poll()
        results, self._results = self._results, []
        return results

    def drain_jobs(self) -> None:
        self._mover.drain()

    def has_pending_work(self) -> bool:
        return self._jobs.busy or self.manager.has_pending_work()

    # -- the rest ---------------------------------------------------------------------
    def take_events(self) -> Iterable[Any]:
        """The tier's events, with the configured ``locality`` (the kind's when none is
        configured), and a ``metadata_only`` removal for the keys of each failed store.
        Nothing when events are off (see ``__init__``)."""
        events = self.manager.take_events()
        if not self._events_enabled:
            return ()
        translated = [
            vllm_event(event, self._keys, self.tier_type, self.locality) for event in events
        ]
        failed, self._failed_store_events = self._failed_store_events, []
        return [event for event in translated if event is not None] + failed

    def on_schedule_end(self, context: Any) -> None:
        self.manager.on_schedule_end(
            ScheduleEndContext(
                new_req_ids=context.new_req_ids, preempted_req_ids=context.preempted_req_ids
            )
        )
        if not self._events_enabled:
            self.manager.take_events()

    def get_stats(self) -> None:
        """``None``: vLLM's stats type needs its full install (see ``manager.get_stats()``)."""
        return None

    def shutdown(self) -> None:
        """Stop the tier (its mover drained), then release every view of vLLM's memory so
        vLLM can unmap it."""
        self.tier.shutdown()
        self._region.release()


def _load_result(job_id: int, pairs: _KeyPairs, result: MoverResult) -> JobResult:
    """vLLM's result of a load job: a success when every listed key arrived, else the
    vLLM keys that did."""
    arrived = set(result.succeeded_keys)
    arrived_keys = [vkey for vkey, key in pairs if key in arrived]
    success = len(arrived_keys) == len(pairs)
    return JobResult(
        job_id=job_id,
        success=success,
        successful_keys=None if success else arrived_keys,
        transfer_time=result.transfer_s,
        transfer_bytes=result.transfer_bytes,
    )


class KVTiersFileTier(_KVTiersSecondaryTier):
    """kvtiers' file tier (``kind: file`` options: ``root``, ``capacity``, ``io``, …)."""

    config_type = FileTierConfig


class KVTiersS3Tier(_KVTiersSecondaryTier):
    """kvtiers' S3 tier (``kind: s3`` options: ``bucket``, ``prefix``, ``endpoint_url``, …)."""

    config_type = S3TierConfig
