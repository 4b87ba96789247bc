"""Route 1's manager for a stack of one cpu tier: the tier answers vLLM itself.

A stack of one ``cpu`` tier, every KV-cache group offloaded (vLLM's keys are kvtiers'
keys), no cost model and no ``tenants:`` section (whose keys are scoped per request)
has nothing to translate, nowhere to promote from and no cascade:
the composite adds only its door. ``KVTiersOffloadingSpec.get_manager`` then builds
:class:`KVTiersDirectManager`, which calls the primary for every call that looks up,
loads, stores and finishes, with the door's work done here: keys are checked once per
batch by the stack's :class:`~kvtiers.core.keys.KeyFormat`, the contexts are the
adapter's own, and a shut-down stack refuses every call (:class:`~kvtiers.errors.
ClosedError`) as the composite's door would.

* The primary is core's :class:`~kvtiers.core.primary.DirectPrimary` (the cpu tier is one);
  the per-key calls go to it with nothing in between.
* ``lookup`` is the primary's one-call lookup (``DirectPrimary.lookup_as``): it answers
  in vLLM's own result values, keeps the keys it finds on the request's ``found`` list
  (moved into ``ctx.keep`` before a store reads it, as the composite keeps them) and
  answers ``MISS`` unchecked for a key it does not hold: every key is checked where it
  enters, at ``prepare_store`` and ``prepare_load``.
* When vLLM publishes no KV events the primary builds none: it forwards the keys it
  removes (``DirectPrimary.forward_removals``), and ``prepare_store`` reports them as
  evicted from that list. With events, stores and events go through the composite.
* A sharded engine (a shard ledger) keeps the one-call lookup and the composite's other
  calls, which check every rank's shard before publishing.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from vllm.v1.kv_offload import base as vbase

from kvtiers.core.keys import OffloadKey
from kvtiers.core.primary import DirectPrimary
from kvtiers.errors import ClosedError
from kvtiers.integrations.vllm.manager import (
    KVTiersManager,
    keep_found,
    tail_first,
)
from kvtiers.integrations.vllm.translate import KeyMap, kvtiers_context
from kvtiers.integrations.vllm.worker import KVTiersLoadStoreSpec
from kvtiers.stack.builder import Stack
from kvtiers.tiers.cpu.shards import ShardLedger

#: The batch a call without keys checks (a list: the key format's fast path).
_NO_KEYS: list[OffloadKey] = []


def direct_eligible(stack: Stack, keys: KeyMap) -> bool:
    """Whether ``stack`` may be called directly (see the module docstring)."""
    tiered = stack.manager
    return (
        keys.identity and len(tiered.tiers) == 1
        and isinstance(tiered.tiers[0].manager, DirectPrimary) and tiered.cost is None
        and stack.tenants is None
        and tiered.retention is None  # the composite's lookup answers expired chunks
    )


class KVTiersDirectManager(KVTiersManager):
    """vLLM's manager API answered by a one-tier stack's primary itself (see the module
    docstring). Build it only for a stack :func:`direct_eligible` accepts."""

    def __init__(
        self,
        stack: Stack,
        keys: KeyMap,
        *,
        events_enabled: bool,
        reset_grace_steps: int,
        ledger: ShardLedger | None = None,
    ) -> None:
        super().__init__(
            stack, keys, events_enabled=events_enabled, reset_grace_steps=reset_grace_steps,
            ledger=ledger,
        )
        primary = self._primary
        assert isinstance(primary, DirectPrimary) and keys.identity
        # The contract's extra calls; the manager's own go to self._primary (the same
        # object).
        self._direct: DirectPrimary = primary
        self._check_keys = stack.manager.key_format.check_all
        # Each announced request's found list, by request id (the one-call lookup's).
        self._found: dict[str, list[OffloadKey]] = {}
        # The per-key hot path of a waiting request: the primary's closure itself (a
        # method wrapping it would cost as much as a miss's lookup does).
        self.lookup = primary.lookup_as(  # type: ignore[method-assign, assignment]
            vbase.LookupResult.HIT,
            vbase.LookupResult.MISS,
            vbase.LookupResult.HIT_PENDING,
            keys=stack.manager.key_format,
            found=self._found,
        )
        # The keys the primary removed, forwarded instead of events (when vLLM publishes
        # none), or None.
        self._removed: list[OffloadKey] | None = (
            None if events_enabled or ledger is not None else primary.forward_removals()
        )
        primary.on_shutdown(self._close)

    def _close(self) -> None:
        """The primary was shut down: every later call is refused."""
        self._check_keys = _refuse_closed

    def on_new_request(self, req_context: Any) -> Any:
        context = super().on_new_request(req_context)
        self._found[req_context.req_id] = self._requests[req_context.req_id].found
        return context

    def on_schedule_end(self, context: Any) -> None:
        # A request that waits is looked up again next step: its list holds one step's
        # finds at most, the set keeps each key once.
        for request in self._requests.values():
            if request.found:
                keep_found(request)
        super().on_schedule_end(context)

    def prepare_load(self, keys: Collection[Any], req_context: Any) -> KVTiersLoadStoreSpec:
        if self._ledger is not None:
            return super().prepare_load(keys, req_context)
        request = self._requests.get(req_context.req_id)
        ctx = request.ctx if request is not None else kvtiers_context(req_context)
        self._check_keys(keys, "prepare_load")
        if self._num_groups == 1:
            spec = KVTiersLoadStoreSpec((self._direct.prepare_load_spec(keys, ctx),))
        else:
            self._primary.prepare_load(keys, ctx)
            spec = self._spec(keys)
        # Pinned now: the request's prefix no longer needs protecting by name.
        ctx.keep.clear()
        if request is not None:
            request.found.clear()
            request.loaded = True
        return spec

    def complete_load(self, keys: Collection[Any], req_context: Any) -> None:
        if self._ledger is not None:
            super().complete_load(keys, req_context)
            return
        request = self._requests.get(req_context.req_id)
        ctx = request.ctx if request is not None else kvtiers_context(req_context)
        self._check_keys(keys, "complete_load")
        primary = self._primary
        primary.complete_load(keys, ctx, generation=primary.generation)

    def prepare_store(self, keys: Collection[Any], req_context: Any) -> Any:
        removed = self._removed
        if removed is None:  # events to publish, or a sharded engine: the composite's way
            return super().prepare_store(keys, req_context)
        request = self._requests.get(req_context.req_id)
        if request is None:
            ctx = kvtiers_context(req_context)
        else:
            ctx = request.ctx
            if request.found:  # the store must not evict what the request's lookups found
                keep_found(request)
        self._check_keys(keys, "prepare_store")
        # Removals before this call (a reset's) may name keys it stores again.
        earlier = len(removed)
        accepted = self._primary.prepare_store(keys, ctx)
        if accepted is None:
            return None
        evicted: list[OffloadKey] = []
        if removed:
            if earlier:
                stored = set(accepted)
                evicted = [key for key in removed[:earlier] if key not in stored]
                evicted += removed[earlier:]
            else:
                evicted = removed[:]
            removed.clear()
        return vbase.PrepareStoreOutput(
            keys_to_store=accepted, store_spec=self._spec(accepted), evicted_keys=evicted
        )

    def complete_store(self, keys: Collection[Any], req_context: Any, success: bool = True) -> None:
        if self._ledger is not None:
            super().complete_store(keys, req_context, success)
            return
        ordered = tail_first(keys, req_context)
        if self._describe and success:
            self._contexts.update(dict.fromkeys(ordered, req_context))
        request = self._requests.get(req_context.req_id)
        ctx = request.ctx if request is not None else kvtiers_context(req_context)
        self._check_keys(ordered, "complete_store")
        primary = self._primary
        # vLLM completes no job from before a reset: this one is of the current generation.
        primary.complete_store(ordered, ctx, success, generation=primary.generation)

    def on_request_finished(self, req_context: Any) -> None:
        if self._ledger is not None:
            super().on_request_finished(req_context)
            self._found.pop(req_context.req_id, None)
            return
        self._check_keys(_NO_KEYS, "on_request_finished")
        req_id = req_context.req_id
        request = self._requests.get(req_id)
        ctx = request.ctx if request is not None else kvtiers_context(req_context)
        ctx.keep.clear()
        self._primary.on_request_finished(ctx)
        self._count_finished(self._requests.pop(req_id, None))
        self._found.pop(req_id, None)

    def take_events(self) -> Iterable[Any]:
        if self._removed is not None:
            return []  # the primary builds no events: it forwards its removals
        return super().take_events()


def _refuse_closed(keys: object, where: str) -> None:
    """The key check of a shut-down direct manager: refuses every call."""
    raise ClosedError(f"{where}: this stack was shut down; build a new one")
