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
``get_finished_jobs``; a job's result comes once every copy of it ended (the mover
publishes a job after its last chunk; an S3 request that stalls fails inside its own copy
at the tier's ``op_deadline_s``), so vLLM never frees rows a copy may still write.
``drain_jobs`` blocks until no copy touches the primary memory.

Promotion deadline (``promotion_deadline_s``, vLLM 0.34 and later): a promotion still
copying that long after ``submit_load`` is reported failed at once, so vLLM recomputes its
tokens instead of holding the request until the slowest copy ends. Its copies may still
write the rows, so its result carries a ``deferred_release`` event: vLLM keeps those rows
out of its free pool until the event is set, which this tier does once every copy of the
job ended (when the job is next polled), and at the latest in ``drain_jobs`` (so the hold
is as bounded as the copies: a file read, or an S3 request within ``op_deadline_s``). Its
keys are then backed off like any failed load (a ``MISS`` for a while), so vLLM does not
start the same slow promotion again at once. vLLM 0.32 and 0.33 cannot defer a release,
so there the option is refused at start-up and a promotion always waits for its copies.

Events: only with the tier's ``enable_kv_events`` AND vLLM's global KV-events flag (off,
vLLM never drains ``take_events``, so the tier drops its own events every step); they
carry the configured ``locality`` (the tier kind's when none is configured), and the keys
of a failed store come back as a ``metadata_only`` removal. On vLLM 0.34 and later, the
event of a store a job made carries that job's ``req_context``, as vLLM's own tiers' do
(vLLM's event tracker builds a chunk's self-describing payload from it). ``shutdown``
releases every view of vLLM's primary memory, so vLLM can unmap it.

``touch``: vLLM 0.32 and 0.33 call it on every secondary tier; 0.34 removed it from the
interface and never calls it, so there a chunk's recency here comes from its stores and
loads only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

from kvtiers.config import FileTierConfig, S3TierConfig, resolve_factory
from kvtiers.config.schema import parse_section
from kvtiers.config.tiers import TierConfig
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext, ScheduleEndContext
from kvtiers.core.mover import MoverResult
from kvtiers.errors import ConfigError
from kvtiers.integrations.vllm import compat
from kvtiers.integrations.vllm.engine import find_engine_configs, layout_name
from kvtiers.integrations.vllm.translate import (
    KeyMap,
    block_hash_algorithm,
    kvtiers_context,
    translate_config,
    vllm_event,
    vllm_request_context,
    warn_unstable_hashes,
    with_request_contexts,
)
from kvtiers.tiers.jobs import FinishedJob, JobDriver

if TYPE_CHECKING:
    from kvtiers.core.config import OffloadingConfig
    from kvtiers.core.tier import BuiltTier

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


class _JobTag(NamedTuple):
    """What a job carries through the driver: its key pairs, and vLLM's request context
    of the job (its stores' events carry it)."""

    pairs: _KeyPairs
    req_context: Any


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
        promotion_deadline_s: float | None = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        where = f"secondary_tiers[type={tier_type}]"
        self._promotion_deadline_s = _promotion_deadline(
            promotion_deadline_s, f"{where}.promotion_deadline_s"
        )
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
        self.tier = self._build_tier(tier_config, offloading, region, where)
        assert self.tier.mover is not None
        self.manager = self.tier.manager
        self._mover = self.tier.mover
        self._keys = KeyMap([group.group_id for group in config.groups])
        # vLLM drains take_events only when its global KV-events flag is on; off, capture
        # stays inert (the tier's own events are dropped every step).
        self._events_enabled = enable_kv_events and bool(config.enable_kv_cache_events)
        # Bookkeeping-only removals (keys of failed stores) for take_events.
        self._failed_store_events: list[Any] = []
        # vLLM's request context of each key a store job landed since the last
        # take_events, for the stored events (kept only when they can carry it).
        self._store_contexts: dict[Any, Any] = {}
        self._jobs: JobDriver[_JobTag] = JobDriver(
            self.manager, self._mover, self._finished, ctx=ReqContext(req_id="kvtiers-vllm-tier")
        )
        self._results: list[JobResult] = []
        #: The clock of promotion deadlines (tests replace it).
        self.clock: Callable[[], float] = time.monotonic
        # Promotions in flight under a deadline, in submission order: start and key pairs.
        self._promotions: dict[int, tuple[float, _KeyPairs]] = {}
        # Promotions reported failed at their deadline while copies still ran: the
        # deferred_release event each sets once its copies ended.
        self._given_up: dict[int, threading.Event] = {}

    def _build_tier(self, tier_config: TierConfig, offloading: OffloadingConfig,
                    region: MemoryviewRegion, where: str) -> BuiltTier[Any]:
        """The kvtiers tier below vLLM's CPU tier: its manager, and its mover copying
        between ``region`` (vLLM's rows) and the tier's medium."""
        factory = resolve_factory(tier_config.kind, path=f"{where}.type")
        return factory(tier_config, offloading, primary_region=region, name=tier_config.name)

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
        tag = _JobTag(pairs, job_metadata.req_context)
        accepted = self._jobs.store(job_id, ours, ctx, tag, slots=slot_of)
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
        if self._promotion_deadline_s is not None:
            self._promotions[job_id] = (self.clock(), pairs)
        if not self._jobs.load_held(job_id, _JobTag(pairs, job_metadata.req_context)):
            self._promotions.pop(job_id, None)
            self._results.append(_load_result(job_id, pairs, MoverResult(job_id, ())))

    def _finished(self, job: FinishedJob[_JobTag]) -> None:
        """A job ended (the driver released its reservations and pins): queue its result,
        or, for a promotion already reported failed at its deadline, let vLLM release its
        rows."""
        result = job.result
        pairs = job.tag.pairs
        if job.load:
            self._promotions.pop(job.job_id, None)
            deferred = self._given_up.pop(job.job_id, None)
            if deferred is not None:
                deferred.set()
            else:
                self._results.append(_load_result(job.job_id, pairs, result))
            return
        if job.failed:
            failed = set(job.failed)
            self._store_failed([vkey for vkey, key in pairs if key in failed])
        if job.succeeded and self._events_enabled and compat.EVENT_CARRIES_REQ_CONTEXT:
            landed = set(job.succeeded)
            for vkey, key in pairs:
                if key in landed:
                    self._store_contexts[vkey] = job.tag.req_context
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
        if vllm_keys and self._events_enabled and compat.HAS_METADATA_ONLY:
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
        if self._promotions:
            self._give_up_late_promotions()
        results, self._results = self._results, []
        return results

    def _give_up_late_promotions(self) -> None:
        """Report each promotion past ``promotion_deadline_s`` failed, its rows' release
        deferred until its copies end (see the module docstring), and back its keys off."""
        deadline_s = self._promotion_deadline_s
        assert deadline_s is not None
        now = self.clock()
        for job_id, (started, pairs) in list(self._promotions.items()):
            if now - started < deadline_s:
                break  # started in order: the rest are younger
            del self._promotions[job_id]
            event = threading.Event()
            self._given_up[job_id] = event
            error = TimeoutError(
                f"promotion job {job_id} still copying after promotion_deadline_s "
                f"({deadline_s:g} s)"
            )
            for key in dict.fromkeys(key for _, key in pairs):
                self.manager.load_failed(key, f"promotion job {job_id}", error, lasting=False)
            # The field exists: the option is refused at start-up where it does not.
            deferral: dict[str, Any] = {"deferred_release": event}
            self._results.append(
                JobResult(job_id=job_id, success=False, successful_keys=[], **deferral)
            )

    def drain_jobs(self) -> None:
        """Block until no copy touches vLLM's memory; every job's result is then queued
        for ``get_finished_jobs`` and every ``deferred_release`` event is set."""
        self._jobs.drain()

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
        # Every store recorded here has its event among these: the manager queued it
        # when the job completed the keys, before the job's result was queued.
        contexts, self._store_contexts = self._store_contexts, {}
        out = [event for event in translated if event is not None]
        if contexts:
            out = [part for event in out for part in with_request_contexts(event, contexts)]
        return out + failed

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


def _promotion_deadline(value: Any, path: str) -> float | None:
    """``promotion_deadline_s`` checked: ``None`` (off) or positive seconds, and only where
    vLLM can defer a failed promotion's release."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"expected a positive number of seconds, got {value!r}", path=path)
    if not compat.JOB_RESULT_DEFERS_RELEASE:
        raise ConfigError(
            "needs vLLM 0.34 or later: this vLLM cannot hold a failed promotion's rows "
            "while its copies still run (JobResult.deferred_release)",
            path=path,
        )
    return float(value)


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
