"""What each stat of a stack becomes in Prometheus: name, type, labels and HELP text.

A stack's ``get_stats()`` holds the composite's own counters (``hits``, ``promotions`` …)
and each tier's (``<tier>.hits`` …). They map to two disjoint families of names, so no
``sum()`` over one metric adds a stack-level number to per-tier ones:

* ``kvtiers_stack_*`` — the composite: lookups as the scheduler sees them, promotions and
  cascades. No ``tier`` label.
* ``kvtiers_tier_*`` — one series per tier (label ``tier``): what that tier's manager did.

Prometheus conventions: base units in names (``_seconds_total``, ``_bytes_total``),
``_total`` on counters only, enums as label values (``result="hit"``, ``backend="posix"``,
``outcome="failed"``), never as numbers. A stat missing from the catalogue is still
exported (as a per-tier counter with a generic HELP); the tests require every stat the
shipped tiers report to be catalogued. This module imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

# The file tier reports its I/O path as a code (kvtiers.tiers.file.io's IO_* constants).
IO_BACKENDS: Mapping[int, str] = MappingProxyType({0: "posix", 1: "posix_o_direct",
                                                   2: "kvikio"})


@dataclass(frozen=True)
class MetricSpec:
    """One stat's Prometheus form: family ``name``, ``kind``, fixed ``labels`` and HELP."""

    name: str
    kind: Literal["counter", "gauge", "info"]
    help: str
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def family(self) -> str:
        """The family name as exposed: counters end in ``_total``, info in ``_info``."""
        suffix = {"counter": "_total", "gauge": "", "info": "_info"}[self.kind]
        return self.name + suffix


def _c(name: str, help_text: str, **labels: str) -> MetricSpec:
    return MetricSpec(name, "counter", help_text, MappingProxyType(labels))


def _g(name: str, help_text: str) -> MetricSpec:
    return MetricSpec(name, "gauge", help_text)


_LOOKUPS = ("Chunks looked up, by result: hit, a chunk found (ready or being promoted); "
            "miss, the chunk a prefix scan stopped at, not held (a scan asks no further, "
            "so there is at most one miss per scan). Requests are counted in "
            "kvtiers_stack_request_lookups_total.")
_REQUEST_LOOKUPS = ("Requests the engine finished, by whether kvtiers served part of their "
                    "prefix: hit, at least one chunk loaded from the stack; miss, none "
                    "(counted by the vLLM integration when the request finishes; "
                    "hit / (hit + miss) is the share of requests kvtiers served).")
_PROMOTIONS = ("Chunks copied up from a lower tier into the primary, by outcome (done, "
               "failed, refused: no primary slot free, so the lookup missed; abandoned: "
               "still in flight when the request's wait bound ran out, so the lookup "
               "missed and the late bytes were discarded).")
_CASCADES = ("Chunks written through from the primary to lower tiers, by outcome (done, "
             "failed, refused: a lower tier had no room or admission said never).")
_DEMOTIONS = ("Chunks evicted from a tier and written to the write-back tiers below it, by "
              "outcome (done, failed, refused: a lower tier had no room, dropped: no copy "
              "could be made before the chunk was gone).")

_HINTS = ("Retention hints (kv_hints) read from requests, by outcome (applied; "
          "ignored: malformed or unknown, warned about at most once a minute).")
_PINS = ("Pins asked for by hints or the admin endpoint, by outcome (done; refused: "
         "past retention.max_pinned_bytes).")

STACK: Mapping[str, MetricSpec] = MappingProxyType({
    "hits": _c("kvtiers_stack_lookups", _LOOKUPS, result="hit"),
    "misses": _c("kvtiers_stack_lookups", _LOOKUPS, result="miss"),
    "promotions": _c("kvtiers_stack_promotions", _PROMOTIONS, outcome="done"),
    "promotion_failures": _c("kvtiers_stack_promotions", _PROMOTIONS, outcome="failed"),
    "promotions_refused": _c("kvtiers_stack_promotions", _PROMOTIONS, outcome="refused"),
    "promotions_abandoned": _c("kvtiers_stack_promotions", _PROMOTIONS, outcome="abandoned"),
    "promotion_waits_abandoned": _c(
        "kvtiers_stack_promotion_waits_abandoned",
        "Requests that waited their bound for promotions (recomputing their prefix, or "
        "their deadline when shorter) and recomputed what had not landed."),
    "promoted_bytes": _c("kvtiers_stack_promoted_bytes", "Bytes copied by promotions."),
    "promote_s": _c("kvtiers_stack_promotion_seconds",
                    "Seconds promotion jobs took, submission to completion, summed."),
    "cascades": _c("kvtiers_stack_cascades", _CASCADES, outcome="done"),
    "cascade_failures": _c("kvtiers_stack_cascades", _CASCADES, outcome="failed"),
    "cascades_refused": _c("kvtiers_stack_cascades", _CASCADES, outcome="refused"),
    "cascaded_bytes": _c("kvtiers_stack_cascaded_bytes", "Bytes written by cascades."),
    "cascade_s": _c("kvtiers_stack_cascade_seconds",
                    "Seconds cascade jobs took, submission to completion, summed."),
    "demotions": _c("kvtiers_stack_demotions", _DEMOTIONS, outcome="done"),
    "demotion_failures": _c("kvtiers_stack_demotions", _DEMOTIONS, outcome="failed"),
    "demotions_refused": _c("kvtiers_stack_demotions", _DEMOTIONS, outcome="refused"),
    "demotions_dropped": _c("kvtiers_stack_demotions", _DEMOTIONS, outcome="dropped"),
    "demoted_bytes": _c("kvtiers_stack_demoted_bytes", "Bytes written by demotions."),
    "demote_s": _c("kvtiers_stack_demotion_seconds",
                   "Seconds demotion jobs took, submission to completion, summed."),
    "corrupt_chunks": _c("kvtiers_stack_corrupt_chunks",
                         "Chunks a promotion found corrupt (each one a miss, never a hit)."),
    "torn_chunks": _c("kvtiers_stack_torn_chunks",
                      "Chunks stored with a rank's shard missing or stale: freed, never "
                      "published."),
    **{name: spec for name, spec in (
        ("retention_hints", _c("kvtiers_stack_retention_hints", _HINTS, outcome="applied")),
        ("retention_hints_ignored",
         _c("kvtiers_stack_retention_hints", _HINTS, outcome="ignored")),
        ("retention_pins", _c("kvtiers_stack_retention_pins", _PINS, outcome="done")),
        ("retention_pins_refused",
         _c("kvtiers_stack_retention_pins", _PINS, outcome="refused")),
        ("retention_pins_overridden", _c(
            "kvtiers_stack_retention_pins_overridden",
            "Pinned chunks evicted because nothing else could make the room a store "
            "needed (a pin never makes a store fail).")),
        ("retention_expired_misses", _c(
            "kvtiers_stack_retention_expired_misses",
            "Lookups of a chunk past its TTL, answered as misses.")),
        ("retention_pinned_bytes", _g(
            "kvtiers_stack_retention_pinned_bytes",
            "Bytes pinned now (retention.max_pinned_bytes caps it).")),
    )},
})
"""The composite's own stats (no ``tier.`` prefix)."""

ENGINE: Mapping[str, MetricSpec] = MappingProxyType({
    "request_hits": _c("kvtiers_stack_request_lookups", _REQUEST_LOOKUPS, result="hit"),
    "request_misses": _c("kvtiers_stack_request_lookups", _REQUEST_LOOKUPS, result="miss"),
})
"""Stats an engine integration counts beside the composite (no ``tier.`` prefix), exported
when it adds its counts to the exporter (:meth:`~kvtiers.stack.metrics.MetricsServer.
add_source`): from the first scrape, zero until counted."""

_TIER_LOOKUPS = "Lookups this tier answered, by result."
_LISTINGS = ("Background listings of a shared namespace, by outcome (complete; incomplete: "
             "stopped at list_max_chunks or by an error).")
_SUMMARIES = "Namespace summaries republished after a listing, by outcome (written, failed)."
_STORES = "Chunks this tier finished storing, by outcome (done, failed)."

TIER: Mapping[str, MetricSpec] = MappingProxyType({
    "hits": _c("kvtiers_tier_lookups", _TIER_LOOKUPS, result="hit"),
    "misses": _c("kvtiers_tier_lookups", _TIER_LOOKUPS, result="miss"),
    "stores": _c("kvtiers_tier_stores", _STORES, outcome="done"),
    "store_failures": _c("kvtiers_tier_stores", _STORES, outcome="failed"),
    "loads": _c("kvtiers_tier_loads", "Chunks pinned for loading (to the GPU or a promotion)."),
    "evictions": _c("kvtiers_tier_evictions", "Chunks evicted to make room."),
    "corrupt_chunks": _c("kvtiers_tier_corrupt_chunks",
                         "Chunks that failed verification on load (quarantined or removed)."),
    "vanished_chunks": _c("kvtiers_tier_vanished_chunks",
                          "Indexed chunks whose file had gone when read (removed elsewhere)."),
    "probes": _c("kvtiers_tier_probes",
                 "Existence probes for index misses (shared: true tiers; the service tier: "
                 "keys it asked the service to look for below its pool)."),
    "probe_hits": _c("kvtiers_tier_probe_hits",
                     "Probes that found a chunk another engine wrote."),
    "stat_dropped": _c("kvtiers_tier_stat_dropped",
                       "Index entries the file tier's start-up stat pass dropped: named like "
                       "chunks, but gone, not regular files or larger than any chunk."),
    "retries": _c("kvtiers_tier_retries",
                  "Requests retried after throttling, a 5xx answer or a timeout."),
    "forgotten": _c("kvtiers_tier_forgotten",
                    "Index entries dropped because the object was gone when read."),
    "load_failures": _c("kvtiers_tier_load_failures",
                        "Chunk loads that failed for a reason other than corruption."),
    "unreadable_chunks": _c("kvtiers_tier_unreadable_chunks",
                            "Chunks forgotten from the index after lasting load failures."),
    "backing_off": _g("kvtiers_tier_backing_off",
                      "Keys with a failed load on record (a miss while backing off)."),
    "promoted": _c("kvtiers_tier_promoted_chunks", "Chunks this tier served to promotions."),
    "promoted_bytes": _c("kvtiers_tier_promoted_bytes",
                         "Bytes this tier served to promotions."),
    "promoted_s": _c("kvtiers_tier_promotion_seconds",
                     "Seconds of promotion jobs this tier served, summed."),
    "cascaded": _c("kvtiers_tier_cascaded_chunks", "Chunks cascaded into this tier."),
    "cascaded_bytes": _c("kvtiers_tier_cascaded_bytes", "Bytes cascaded into this tier."),
    "cascaded_s": _c("kvtiers_tier_cascade_seconds",
                     "Seconds of cascade jobs into this tier, summed."),
    "demoted": _c("kvtiers_tier_demoted_chunks",
                  "Chunks written into this tier when the primary evicted them."),
    "demoted_bytes": _c("kvtiers_tier_demoted_bytes", "Bytes demoted into this tier."),
    "demoted_s": _c("kvtiers_tier_demotion_seconds",
                    "Seconds of demotion jobs into this tier, summed."),
    "chunks": _g("kvtiers_tier_chunks", "Chunks held now."),
    "pinned_chunks": _g("kvtiers_tier_pinned_chunks", "Chunks pinned now by loads or cascades."),
    "held_slots": _g("kvtiers_tier_held_slots",
                     "Slots of evicted chunks held while their demotion copies them."),
    "fenced_slots": _g("kvtiers_tier_fenced_slots",
                       "Slots held for jobs from before a reset until their completion or the "
                       "engine's flush."),
    "usage_bytes": _g("kvtiers_tier_usage_bytes", "Bytes held now."),
    "capacity_bytes": _g("kvtiers_tier_capacity_bytes",
                         "Configured capacity in bytes (0: bounded only by the medium)."),
    "capacity_chunks": _g("kvtiers_tier_capacity_chunks", "Capacity in chunks."),
    "listings": _c("kvtiers_tier_listings", _LISTINGS, outcome="complete"),
    "listings_incomplete": _c("kvtiers_tier_listings", _LISTINGS, outcome="incomplete"),
    "listed_chunks": _g("kvtiers_tier_listed_chunks",
                        "Chunks the last background listing of the namespace found."),
    "listing_s": _g("kvtiers_tier_listing_seconds",
                    "Seconds the last background listing of the namespace took."),
    "announced_chunks": _g("kvtiers_tier_announced_chunks",
                           "Chunks other servers published that listings announced (live)."),
    "summaries": _c("kvtiers_tier_summaries", _SUMMARIES, outcome="written"),
    "summary_failures": _c("kvtiers_tier_summaries", _SUMMARIES, outcome="failed"),
    "io_backend": MetricSpec("kvtiers_tier_io", "info",
                             "The I/O path the file tier uses (label backend)."),
    # The service tier's (kind: service, kvtiers.service.tier): its hits are
    # kvtiers_tier_lookups_total{result="hit"}, its misses are not counted apart.
    "lookups": _c("kvtiers_tier_lookup_calls",
                  "Lookups asked of the service tier, whatever the answer (hit, miss, "
                  "retry)."),
    "down_lookups": _c("kvtiers_tier_service_down_lookups",
                       "Lookups answered miss because the service was down."),
    "round_trips": _c("kvtiers_tier_service_round_trips",
                      "Calls to the service whose answer the engine waited for."),
    "owed_waits": _c("kvtiers_tier_service_owed_waits",
                     "Steps that waited for the service's oldest owed replies."),
    "lost_loads": _c("kvtiers_tier_lost_loads",
                     "Chunks a load found gone from the pool (recomputed)."),
    "pins_missed": _c("kvtiers_tier_pins_missed",
                      "Pins the service could not take: the chunk had left its slot."),
    "duplicate_stores": _c("kvtiers_tier_duplicate_stores",
                           "Chunks another engine had committed first (the slot is reused)."),
    "probes_given_up": _c("kvtiers_tier_probes_given_up",
                          "Probes unanswered within probe_steps steps (a miss)."),
    "retention_hints_sent": _c("kvtiers_tier_service_retention_hints_sent",
                               "Retention hints sent to the service (one per hint and step)."),
    "retention_hints_unsent": _c("kvtiers_tier_service_retention_hints_unsent",
                                 "Retention hints dropped: the service does not read them."),
    "service_up": _g("kvtiers_tier_service_up",
                     "Whether the service answers now (1) or not (0)."),
    "service_downs": _c("kvtiers_tier_service_downs",
                        "Outages of the service this tier noticed."),
    "service_reattaches": _c("kvtiers_tier_service_reattaches",
                             "Reattaches to a restarted service (each a new session)."),
})
"""Each tier's stats (``<tier>.<stat>``)."""


#: The unit a family counts, by the end of its name; any other family counts what its
#: HELP text names first (chunks, lookups, keys...) unless named here.
_UNITS: tuple[tuple[str, str], ...] = (("_bytes", "bytes"), ("_seconds", "seconds"))
_COUNTED: Mapping[str, str] = MappingProxyType({
    "kvtiers_tier_listings": "listings",
    "kvtiers_tier_summaries": "summaries",
    "kvtiers_tier_probes": "probes",
    "kvtiers_tier_vanished_chunks": "chunks",
    "kvtiers_tier_capacity_chunks": "chunks",
    "kvtiers_tier_load_failures": "chunks",
    "kvtiers_tier_forgotten": "index entries",
    "kvtiers_tier_stat_dropped": "index entries",
    "kvtiers_tier_lookup_calls": "lookups",
    "kvtiers_tier_service_down_lookups": "lookups",
    "kvtiers_tier_service_round_trips": "round trips",
    "kvtiers_tier_service_owed_waits": "steps",
    "kvtiers_tier_lost_loads": "chunks",
    "kvtiers_tier_pins_missed": "pins",
    "kvtiers_tier_probes_given_up": "probes",
    "kvtiers_tier_service_retention_hints_sent": "hints",
    "kvtiers_tier_service_retention_hints_unsent": "hints",
    "kvtiers_tier_service_up": "boolean",
    "kvtiers_tier_service_downs": "outages",
    "kvtiers_tier_service_reattaches": "reattaches",
})


def with_unit(spec: MetricSpec) -> str:
    """``spec``'s HELP text followed by its unit (``Unit: bytes.``)."""
    for suffix, unit in _UNITS:
        if spec.name.endswith(suffix):
            return f"{spec.help} Unit: {unit}."
    if spec.kind == "info":
        return f"{spec.help} Unit: none (labels only)."
    counted = _COUNTED.get(spec.name) or spec.help.split(" ", 1)[0].lower().rstrip(".,")
    return f"{spec.help} Unit: {counted}."


def tier_fallback(stat: str) -> MetricSpec:
    """The spec of a per-tier stat the catalogue does not know: a counter, unit-named."""
    name = stat[:-2] + "_seconds" if stat.endswith("_s") else stat
    return _c(f"kvtiers_tier_{name}", f"Tier stat {stat!r} (not described in the catalogue).")


HISTOGRAM_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
"""Upper bounds (seconds) of every latency histogram's buckets; ``+Inf`` is implied."""

HISTOGRAMS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "promote": ("kvtiers_promotion_latency_seconds",
                "Promotion jobs from a lower tier into the primary, submission to completion."),
    "cascade": ("kvtiers_cascade_latency_seconds",
                "Cascade jobs from the primary into a lower tier, submission to completion."),
    "load": ("kvtiers_worker_transfer_latency_seconds",
             "GPU <-> primary worker jobs, submission to completion, by direction (only "
             "for workers in the exporter's process)."),
    "store": ("kvtiers_worker_transfer_latency_seconds",
              "GPU <-> primary worker jobs, submission to completion, by direction (only "
              "for workers in the exporter's process)."),
})
"""Job kind → (histogram family, HELP). Promotions and cascades carry a ``tier`` label;
worker transfers a ``direction`` label (``load`` or ``store``)."""
