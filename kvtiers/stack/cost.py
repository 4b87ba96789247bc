"""Cost-aware promotion: promote a request's chunks from a lower tier only when loading
them finishes before recomputing them would.

Two parts (the formula is in docs/architecture.md, "Cost-aware promotion"):

* :class:`TransferEstimate` — one lower tier's running estimate of how long a promotion
  job takes, ``seconds(bytes) = latency_s + bytes / bytes_per_s``, fitted by exponentially
  weighted least squares over the tier's own completed jobs and seeded from the stack
  file (``load_latency_s``, ``load_bytes_per_s``) while there is no history.
* :class:`CostModel` — per request, a plan: the lookups of the step in which a request
  first meets a lower-tier hit record where each of its chunks is (primary, a lower tier,
  nowhere), at its place in the prompt (the end token the engine recorded for the key,
  ``ReqContext.key_position``; first-seen order per group from an engine that records
  none), and answer ``HIT_PENDING`` for lower-tier hits without starting a promotion;
  at its first lower-tier hit in a later scheduler step the model picks the usable
  prefix length (the *cut*, in tokens) that minimises time-to-first-token, and from then
  on a lower-tier hit is promoted only if its chunk starts before the cut (``MISS``
  otherwise). A chunk past the cut that was in no lower tier when the cut was made
  (stored or moved since) opens the plan again (at most :data:`MAX_REPLANS` times per
  request).

* The *wait bound* (:meth:`CostModel.wait_budget_s`): a request waits for promotions at
  most ``min(its deadline, prefix / prefill_tokens_per_s)``, the prefix being its cut (its
  found run of chunks before the plan is decided); the composite gives up what has not
  landed by then (docs/architecture.md, "Cost-aware promotion"). Jobs still in flight
  count too: a tier's prediction is never below the time its oldest promotion job in
  flight has taken so far (:meth:`CostModel.in_flight`), so an unseeded or mis-seeded tier
  whose first job is slow is not promoted from again while that job runs.

Invariants: the answer for a request is monotone — per group, every chunk before the cut
may be promoted and none after it, so the usable prefix never has a hole; the chosen cut
never predicts a slower first token than using the primary's chunks alone and recomputing
the rest (the empty promotion is always a candidate); a plan is decided in the step after it
opened, so a deferred ``HIT_PENDING`` resolves in one engine step, and a request plans at
most ``1 + MAX_REPLANS`` times (liveness).
Everything runs on the scheduler thread; nothing here sleeps or reads a clock.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtiers.core.keys import GROUP_INDEX_BYTES, OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext

log = logging.getLogger(__name__)

#: The ``kv_transfer_params`` key of a request's own deadline for its promotions, seconds:
#: no promotion whose predicted arrival is later is started for that request.
DEADLINE_PARAM = "kvtiers_promotion_deadline_s"

#: Plans held at most; beyond it the oldest is dropped (its request plans again: one step).
MAX_PLANS = 65536

#: How often a request's plan is made again because a chunk past its cut appeared in a
#: lower tier after the cut was made (each costs the request one engine step).
MAX_REPLANS = 4

# A fit's bytes must spread by at least this fraction of their mean before its slope is
# trusted; below it (jobs all of one size) only the level is refitted.
_MIN_SPREAD = 0.05


class TransferEstimate:
    """How long one lower tier takes to promote ``n`` bytes in one job.

    ``latency_s`` and ``bytes_per_s`` seed the estimate (``None``: not known). Each
    :meth:`observe` adds one completed job, weighted ``weight`` against the decayed history
    (an exponentially weighted least-squares line through (bytes, seconds)). While the jobs
    seen are all about one size the slope keeps its previous value (the seed's, or the last
    well-spread fit's) and only the level follows the data. With neither a seed nor a job
    the tier is :attr:`unknown` and predicts 0 s: promotions from it are not held back
    (the wait bound still gives them up). :attr:`floor_s` (set by :meth:`in_flight`) is the
    longest a job of this tier still in flight has taken so far: no prediction is below
    it."""

    def __init__(
        self, latency_s: float | None, bytes_per_s: float | None, *, weight: float = 0.2
    ) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        if latency_s is not None and latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        self.weight = weight
        self.latency_s = latency_s or 0.0
        self.s_per_byte = 0.0 if bytes_per_s is None else 1.0 / bytes_per_s
        self.unknown = latency_s is None and bytes_per_s is None
        self.jobs = 0
        self.floor_s = 0.0
        # Decayed sums of weight, x, y, x*x, x*y over the jobs seen.
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    @property
    def bytes_per_s(self) -> float:
        return math.inf if self.s_per_byte == 0 else 1.0 / self.s_per_byte

    def seconds(self, num_bytes: int) -> float:
        """Predicted seconds of one job moving ``num_bytes`` (0 for no bytes): the fitted
        line, or :attr:`floor_s` when that is longer."""
        if num_bytes <= 0:
            return 0.0
        return max(self.latency_s + num_bytes * self.s_per_byte, self.floor_s)

    def in_flight(self, seconds: float) -> None:
        """The oldest job of this tier still in flight has run ``seconds`` so far (0: none
        runs): a lower bound on what a job takes now, kept until the next call. A job that
        completes is then observed (:meth:`observe`) as usual."""
        self.floor_s = seconds if math.isfinite(seconds) and seconds > 0 else 0.0

    def observe(self, num_bytes: int, seconds: float) -> None:
        """Add a completed job of ``num_bytes`` that took ``seconds``."""
        if num_bytes <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        keep = 1.0 - self.weight
        x, y = float(num_bytes), float(seconds)
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + x
        self._y = self._y * keep + y
        self._xx = self._xx * keep + x * x
        self._xy = self._xy * keep + x * y
        self.jobs += 1
        self.unknown = False
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x > (_MIN_SPREAD * mean_x) ** 2:
            slope = (self._xy / self._w - mean_x * mean_y) / var_x
            if slope > 0:
                self.s_per_byte = slope
        latency = mean_y - self.s_per_byte * mean_x
        if latency < 0:
            # The data sit below the line's slope: all of their time is bandwidth.
            latency = 0.0
            self.s_per_byte = mean_y / mean_x
        self.latency_s = latency


@dataclass(frozen=True)
class ChunkShape:
    """One KV-cache group's chunk: the tokens it covers and the bytes it holds."""

    tokens: int
    bytes: int


@dataclass
class _Plan:
    """One request's lookups: each key's position in its group (its chunk's index in the
    request's prefix), where its chunk was found, when the plan opened, and, once decided,
    the cut in tokens. ``deadline_s``: the request's own deadline, read once."""

    deadline_s: float | None = None
    position: dict[OffloadKey, int] = field(default_factory=dict)
    # Per group, the next position in first-seen order (for keys the engine gave none).
    seen_per_group: dict[int, int] = field(default_factory=dict)
    # Key → the lower tier holding it, or None: in the primary (or arriving there).
    found: dict[OffloadKey, str | None] = field(default_factory=dict)
    cut_tokens: float | None = None
    replans: int = 0
    # The scheduler step in which the plan was (re)opened: it is decided at the first
    # lower-tier hit of a later step, when the whole prefix has been looked up.
    opened: int | None = None
    # The end, in tokens, of the furthest chunk found anywhere (the wait bound's prefix
    # while no cut is decided).
    reach_tokens: int = 0

    def found_at(self, key: OffloadKey, shapes: Sequence[ChunkShape]) -> None:
        """``key`` (placed) was found: extend :attr:`reach_tokens` to its chunk's end."""
        end = (self.position[key] + 1) * shapes[_group(key)].tokens
        if end > self.reach_tokens:
            self.reach_tokens = end

    def place(self, key: OffloadKey, ctx: ReqContext, shapes: Sequence[ChunkShape]) -> bool:
        """Record ``key``'s position: from the end token the engine recorded for it
        (``ctx.key_position``), or, from an engine that records none, the next in its
        group's first-seen order. False, placing nothing, for a key an engine that records
        positions gave none: its place in the prefix is unknown."""
        if key in self.position:
            return True
        group = _group(key)
        if ctx.key_position is not None:
            end = ctx.key_position(key)
            if type(end) is not int or end <= 0:
                return False
            # The chunk ending at token ``end`` (a partial tail ends inside its chunk).
            self.position[key] = -(-end // shapes[group].tokens) - 1
            return True
        position = self.seen_per_group.get(group, 0)
        self.position[key] = position
        self.seen_per_group[group] = position + 1
        return True


@dataclass(frozen=True)
class Decision:
    """A decided plan: the usable prefix in tokens (the cut), the predicted seconds of the
    promotions it needs, and the prefill seconds it saves net of them (``>= 0``)."""

    cut_tokens: float
    load_s: float
    saved_s: float


class CostModel:
    """Decides, per request, how much of the prefix to promote. See the module docstring.

    ``shapes[g]`` is group ``g``'s chunk; ``tiers`` names every lower tier's estimate.
    ``transfer_time``, when set, replaces a job's measured seconds (the simulator's model
    of the media: ``(tier, bytes) -> seconds``)."""

    def __init__(
        self,
        *,
        prefill_tokens_per_s: float,
        shapes: Sequence[ChunkShape],
        tiers: Mapping[str, TransferEstimate],
        transfer_time: Callable[[str, int], float] | None = None,
    ) -> None:
        if not prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {prefill_tokens_per_s}")
        if not shapes:
            raise ValueError("a cost model needs the chunk shape of at least one group")
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.shapes = tuple(shapes)
        self.tiers = dict(tiers)
        self.transfer_time = transfer_time
        self._plans: dict[str, _Plan] = {}
        self._step = 0
        self.decisions: dict[str, Decision] = {}
        self.stats: dict[str, int] = {"promotion_plans": 0, "promotions_declined": 0}

    # -- estimates ------------------------------------------------------------------
    def observe_load(self, tier: str, num_bytes: int, seconds: float) -> None:
        """A promotion job from ``tier`` moved ``num_bytes`` in ``seconds``."""
        estimate = self.tiers.get(tier)
        if estimate is None:
            return
        if self.transfer_time is not None:
            seconds = self.transfer_time(tier, num_bytes)
        estimate.observe(num_bytes, seconds)

    def in_flight(self, tier: str, seconds: float) -> None:
        """The oldest promotion job from ``tier`` still in flight has run ``seconds`` so far
        (0: none runs): no prediction for ``tier`` is below it until the next call. Ignored
        with a ``transfer_time`` (simulated time knows no wall-clock elapsed)."""
        estimate = self.tiers.get(tier)
        if estimate is not None and self.transfer_time is None:
            estimate.in_flight(seconds)

    def wait_budget_s(self, ctx: ReqContext) -> float:
        """How long the request may wait for promotions before what has not landed is
        given up: recomputing its prefix (its cut once decided, else the furthest chunk
        its lookups found) at ``prefill_tokens_per_s``, or its deadline when shorter."""
        plan = self._plan(ctx)
        tokens = plan.cut_tokens if plan.cut_tokens is not None else plan.reach_tokens
        budget = tokens / self.prefill_tokens_per_s
        if plan.deadline_s is not None and plan.deadline_s < budget:
            return plan.deadline_s
        return budget

    # -- the lookup hook --------------------------------------------------------------
    def hold(self, key: OffloadKey, tier: str, ctx: ReqContext) -> LookupResult | None:
        """``key`` is a hit in the lower tier ``tier``: ``None`` to promote it, else the
        answer instead (``HIT_PENDING`` while the plan is being formed, ``MISS`` when the
        chunk lies past the cut)."""
        plan = self._plan(ctx)
        if not plan.place(key, ctx, self.shapes):
            return None  # not in the plan: promoted, as without a cost model
        was = plan.found.get(key, _MISSING)
        plan.found[key] = tier
        plan.found_at(key, self.shapes)
        if plan.cut_tokens is None:
            if plan.opened is None:
                plan.opened = self._step
            if plan.opened == self._step:
                return LookupResult.HIT_PENDING
            # A later step: every chunk of the prefix has been looked up.
            self._decide(ctx, plan)
            was = tier
        start = plan.position[key] * self.shapes[_group(key)].tokens
        if start < plan.cut_tokens:  # type: ignore[operator]
            return None
        if (was is _MISSING or was is None) and plan.replans < MAX_REPLANS:
            # Past the cut, and not in a lower tier when the cut was made: the prefix
            # changed since (a chunk was stored or moved), so plan again, a few times.
            plan.replans += 1
            plan.cut_tokens = None
            plan.opened = self._step
            return LookupResult.HIT_PENDING
        self.stats["promotions_declined"] += 1
        return LookupResult.MISS

    def looked_up(self, key: OffloadKey, ctx: ReqContext, result: LookupResult) -> None:
        """Record the composite's answer for ``key``: its position, and where it is. A
        ``HIT`` is in the primary; a ``HIT_PENDING`` is where :meth:`hold` placed it (a
        lower tier), else arriving in the primary; ``MISS`` and ``RETRY`` are nowhere,
        unless the key is a lower-tier hit a decided cut declined."""
        plan = self._plan(ctx)
        if not plan.place(key, ctx, self.shapes):
            return
        if result is LookupResult.HIT:
            plan.found[key] = None
            plan.found_at(key, self.shapes)
        elif result is LookupResult.HIT_PENDING:
            plan.found.setdefault(key, None)
            plan.found_at(key, self.shapes)
        elif plan.cut_tokens is None:
            plan.found.pop(key, None)

    def end_step(self) -> None:
        """The scheduler step ended: plans opened in it are decided at their next
        lower-tier hit."""
        self._step += 1

    def forget(self, ctx: ReqContext) -> None:
        """The request finished: drop its plan."""
        self._plans.pop(ctx.req_id, None)
        self.decisions.pop(ctx.req_id, None)

    def reset(self) -> None:
        """Drop every plan (the stack's chunks changed wholesale)."""
        self._plans.clear()
        self.decisions.clear()

    # -- planning ---------------------------------------------------------------------
    def _plan(self, ctx: ReqContext) -> _Plan:
        plan = self._plans.get(ctx.req_id)
        if plan is None:
            if len(self._plans) >= MAX_PLANS:
                oldest = next(iter(self._plans))
                del self._plans[oldest]
                self.decisions.pop(oldest, None)
            plan = self._plans[ctx.req_id] = _Plan(deadline_s=_deadline(ctx))
        return plan

    def _decide(self, ctx: ReqContext, plan: _Plan) -> None:
        decision = self.decide(plan, deadline_s=plan.deadline_s)
        plan.cut_tokens = decision.cut_tokens
        self.decisions[ctx.req_id] = decision
        self.stats["promotion_plans"] += 1

    def decide(self, plan: _Plan, *, deadline_s: float | None = None) -> Decision:
        """The cut that minimises predicted time-to-first-token for ``plan``.

        Candidates are the ends of the request's found chunks, up to the shortest group's
        run of found chunks. A group's run starts at its first chunk looked up: the engine
        did not ask for the chunks before it (they are in its own prefix cache, or before a
        sliding window), so they cost nothing and limit nothing. A cut of ``P`` tokens
        needs, in every group, each chunk of its run that starts before ``P``; its
        promotions take the longest of the lower tiers' predicted job times for the bytes
        each must send (tiers copy in parallel), and it saves ``P / prefill_tokens_per_s``
        of prefill. The cut with the largest saving net of load time wins (ties: the
        shorter cut, fewer bytes moved); a cut whose load time exceeds ``deadline_s`` is
        not a candidate, nor is any longer one."""
        runs: dict[int, dict[int, object]] = {}
        for key, position in plan.position.items():
            runs.setdefault(_group(key), {})[position] = plan.found.get(key, _MISSING)
        # (start token, group, tier) of each chunk in every group's leading found run.
        chunks: list[tuple[int, int, str | None]] = []
        reach = math.inf
        for group, run in runs.items():
            tokens = self.shapes[group].tokens
            first = end = min(run)
            while run.get(end, _MISSING) is not _MISSING:
                end += 1
            reach = min(reach, end * tokens)
            for position in range(first, end):
                tier = run[position]
                assert tier is None or isinstance(tier, str)
                chunks.append((position * tokens, group, tier))
        if not chunks or reach == 0:
            return Decision(0.0, 0.0, 0.0)
        chunks.sort(key=lambda c: c[0])
        cuts = sorted({start + self.shapes[group].tokens for start, group, _ in chunks
                       if start + self.shapes[group].tokens <= reach} | {int(reach)})
        sent: dict[str, int] = {}
        best = Decision(0.0, 0.0, 0.0)
        index = 0
        for cut in cuts:
            while index < len(chunks) and chunks[index][0] < cut:
                _, group, tier = chunks[index]
                if tier is not None:
                    sent[tier] = sent.get(tier, 0) + self.shapes[group].bytes
                index += 1
            load = max((self._seconds(t, b) for t, b in sent.items()), default=0.0)
            if deadline_s is not None and load > deadline_s:
                break
            saved = cut / self.prefill_tokens_per_s - load
            if saved > best.saved_s:
                best = Decision(float(cut), load, saved)
        return best

    def _seconds(self, tier: str, num_bytes: int) -> float:
        estimate = self.tiers.get(tier)
        return 0.0 if estimate is None else estimate.seconds(num_bytes)


# A chunk not found (its lookup missed, or was never made).
_MISSING = object()


def _group(key: OffloadKey) -> int:
    return int.from_bytes(key[-GROUP_INDEX_BYTES:], "big")


def _deadline(ctx: ReqContext) -> float | None:
    """The request's ``kvtiers_promotion_deadline_s``: a finite number of seconds >= 0, or
    ``None`` (absent, or anything else: ignored with a warning naming the request)."""
    params = ctx.kv_transfer_params
    if not params or DEADLINE_PARAM not in params:
        return None
    value = params[DEADLINE_PARAM]
    seconds = math.nan
    if isinstance(value, int | float) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an integer beyond any float stays NaN
            seconds = float(value)
    if not 0 <= seconds < math.inf:
        log.warning("request %s: kv_transfer_params[%r] must be a finite number of seconds "
                    ">= 0, got %s; ignored", ctx.req_id, DEADLINE_PARAM, _shown(value))
        return None
    return seconds


def _shown(value: object) -> str:
    """``value``'s repr cut to 40 characters, for a warning; its type when it has none."""
    try:
        shown = repr(value)
    except Exception:  # an int of over 4,300 digits has no text; any __repr__ may raise
        return f"a value of type {type(value).__name__} that cannot be written out"
    return shown if len(shown) <= 40 else f"{shown[:37]}..."
