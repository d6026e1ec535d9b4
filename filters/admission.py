"""Admission control and deadline-aware queueing: admit, queue or refuse each request by
tenant, priority, deadline and the sunk cost of its task, and hand queued requests out in
order as capacity frees. Sans-I/O: time comes in; every refusal carries its reason.

Order of service
----------------
1. Bands, strictly: band = 2 x priority + sunk, where priority (0..9, clamped to the
   tenant's `max_priority`) is the request's and sunk is 1 when its task already has
   `sunk_cost_min_steps` successful steps (and `sunk_cost_min_usd` spent), reported through
   `task_progress` / `record_step`, or when the driver knows the request continues a
   started task (`AdmissionItem.started`: a task step header past 0, or a prompt that
   extends one routed before). Step 3 of a task whose steps 1 and 2 succeeded goes before
   a new task's step 1 at the same priority, and a new task is shed before it.
2. Within a band, tenants share by weight: start-time fair queueing (Goyal, Vin, Cheng,
   "Start-Time Fair Queueing", SIGCOMM 1996) at the level of tenant flows. A backlogged
   tenant's flow has start tag S = max(V, F); dispatch takes the flow with the least S,
   sets V = S and F = S + cost / weight (cost: the item's `cost`, e.g. expected tokens).
   Over a backlogged period each tenant's share of dispatched cost converges to its weight
   share.
3. Within a tenant's flow: earliest deadline first (no deadline sorts last), then arrival.

The knee (`knee_wait_s`, with a `wait_source`: the router's least predicted queueing
delay over the pool's eligible endpoints, PoolRouter.pool_wait): once every engine has
more than knee_wait_s of work queued, sending more only lengthens the engines' queues,
where nothing can reorder them. So while the pool is past its knee a *new* task's request
(an even band) waits here even when slots are free, and a started task's (an odd band)
still goes at once: a new task is queued or refused before a started one suffers. When
the wait falls back under the knee, queued new work goes one request at a time: the next
is judged once the router has placed the previous one (`routed`; or it was released, or
a `tick` passed), so the wait it reads counts every request let through (no herd). One
queued past `knee_max_wait_s` (for whatever reason it queued) is refused ("overload",
Retry-After): under sustained overload the queue turns new tasks away instead of
starting them late. (A request requeued after its dispatch was admitted: it is kept.)

Refusals (OpenAI-style 429 with Retry-After; `Reject.code` names them):
- "deadline": the deadline minus the predicted TTFT has passed, or the queue ahead (a
  lower bound: queued requests in higher bands x the mean slot time / slots) already makes
  it late. Checked at offer and again for queued items at every `next`/`expire`, from the
  lowest band up, so the least important late work is refused first.
- "quota": the tenant already has `max_queued` requests queued.
- "overload": the queue holds `max_queued` requests; a newcomer of a higher band displaces
  the newest request of the lowest band (which is refused), otherwise the newcomer is; or
  a new task's request queued knee_max_wait_s (with the knee gate on).

Guarantee: every item offered is answered exactly once: Admit or Reject from `offer`, or
later exactly one of: returned by `next`, a Reject in `take_rejected()`, or `cancel` by
the driver. Nothing is dropped silently (tests/test_admission.py checks it by property).
Costs: offer, next, release O(log n) amortised (+ O(bands) = 20); memory bounded by
max_queued, max_in_flight, max_tasks and max_tenants.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

__all__ = [
    "ADMIT",
    "Admission",
    "AdmissionConfig",
    "AdmissionItem",
    "Admit",
    "Queue",
    "Reject",
    "TenantPolicy",
]

PRIORITY_MAX = 9
DEFAULT_PRIORITY = 5
BANDS = 2 * (PRIORITY_MAX + 1)
DEFAULT_TENANT = ""

RejectReason = Literal["deadline", "quota", "overload"]
_CODES: dict[str, str] = {
    "deadline": "deadline_unmeetable",
    "quota": "tenant_quota_exceeded",
    "overload": "overloaded",
}


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    weight: float = 1.0  # fair share relative to other tenants
    max_priority: int = PRIORITY_MAX  # the tenant's own priority class ceiling
    max_queued: int | None = None  # None: AdmissionConfig.max_queued_per_tenant
    max_in_flight: int | None = None  # None: no per-tenant cap

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"tenant weight must be > 0, got {self.weight}")


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_in_flight: int = 256  # dispatch slots; set_capacity() changes it at run time
    max_queued: int = 1024  # requests waiting, across tenants
    max_queued_per_tenant: int = 256
    tenants: Mapping[str, TenantPolicy] = field(default_factory=dict)
    default_tenant: TenantPolicy = TenantPolicy()
    sunk_cost_min_steps: int = 1
    sunk_cost_min_usd: float = 0.0
    max_tasks: int = 10_000  # LRU of task progress
    max_tenants: int = 10_000  # fair-queueing state kept for idle tenants
    residence_alpha: float = 0.1  # EWMA weight of a slot-time sample (dispatch to release)
    initial_residence_s: float | None = None  # None: no wait estimate until measured
    min_retry_after_s: float = 1.0
    max_retry_after_s: float = 60.0
    # After a requeue, no dispatch until a release or this long, whichever comes first
    # (with nothing in flight here, no release may ever come).
    requeue_backoff_s: float = 0.1
    # The pool's knee (module docstring): None, or seconds of predicted queueing delay
    # beyond which new tasks wait here; and how long one may wait so before a 429.
    knee_wait_s: float | None = None
    knee_max_wait_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or self.max_queued < 0 or self.max_queued_per_tenant < 0:
            raise ValueError("max_in_flight must be >= 1, queue bounds >= 0")
        if self.knee_wait_s is not None and not self.knee_wait_s >= 0:
            raise ValueError(f"knee_wait_s must be >= 0, got {self.knee_wait_s}")
        if not self.knee_max_wait_s > 0:
            raise ValueError(f"knee_max_wait_s must be > 0, got {self.knee_max_wait_s}")


class AdmissionItem(NamedTuple):
    """What admission is told of one request. A NamedTuple rather than a frozen dataclass:
    one is built per request on the way to the upstream send, and the frozen dataclass's
    __init__ (a setattr per field) cost ~22 us with cold caches against ~1 us for this
    (loadtest/admission_bench.py, CPython 3.11, the 2-core dev box)."""

    id: Hashable
    tenant: str | None = None
    priority: int | None = None  # 0..9, higher first; None: 5
    deadline: float | None = None  # absolute, on the `now` clock; None: no deadline
    predicted_ttft_s: float = 0.0  # the picker's estimate, so a deadline means first token
    cost: float = 1.0  # fair-share cost (expected tokens, or 1 per request)
    task_id: str | None = None
    started: bool = False  # continues a task already under way (the driver knows)


@dataclass(frozen=True, slots=True)
class Admit:
    """Dispatch now; call `release(item.id, now)` when it finishes."""


ADMIT = Admit()


@dataclass(frozen=True, slots=True)
class Queue:
    """Wait; `next()` will return the item, or `take_rejected()` will refuse it."""

    position: int  # requests ahead in its band and above
    expected_wait_s: float


@dataclass(frozen=True, slots=True)
class Reject:
    item: AdmissionItem
    reason: RejectReason
    message: str
    retry_after_s: float

    @property
    def code(self) -> str:
        return _CODES[self.reason]


Decision = Admit | Queue | Reject


@dataclass(slots=True, eq=False)
class _Entry:
    item: AdmissionItem
    tenant: str
    band: int
    seq: int
    latest_start: float  # deadline - predicted TTFT
    queued: bool = True
    knee_until: float = math.inf  # held at the knee: refused from then on


@dataclass(slots=True, eq=False)
class _Flow:
    """One tenant's requests in one band."""

    heap: list[tuple[float, int, _Entry]] = field(default_factory=list)  # EDF
    live: int = 0
    finish: float = 0.0  # F
    tag: float | None = None  # S while active (in the band's heap)


@dataclass(slots=True, eq=False)
class _Band:
    flows: dict[str, _Flow] = field(default_factory=dict)
    tags: list[tuple[float, int, str]] = field(default_factory=list)  # (S, seq, tenant)
    deadlines: list[tuple[float, int, _Entry]] = field(default_factory=list)
    newest: list[tuple[int, _Entry]] = field(default_factory=list)  # (-seq, entry)
    vtime: float = 0.0
    count: int = 0
    active: int = 0


@dataclass(slots=True)
class _Tenant:
    queued: int = 0
    in_flight: int = 0


# An admitted item, in `Admission._in_flight`: (dispatched at, tenant, item, band, seq,
# latest start, its _Entry if it was queued). A plain tuple, and an item admitted at once
# gets an _Entry only if it is requeued (rare): one object less per request on the way to
# the upstream send. (One that was queued keeps its own: stale heap entries point to it.)
_Dispatched = tuple[float, str, AdmissionItem, int, int, float, "_Entry | None"]


class Admission:
    """One per pool. Driver protocol::

        d = adm.offer(item, now)            # Admit: go; Queue: wait; Reject: 429
        ... when a request finishes: adm.release(item.id, now)
        ... after every offer, release and requeue, and on a timer (requeue_backoff_s):
            while (it := adm.next(now)) is not None: wake its waiter
        for r in adm.take_rejected(): answer r.item's waiter with 429 r.code, r.message,
                                      Retry-After r.retry_after_s
        a waiter that goes away: adm.cancel(item.id)
        an admitted request that the pool still cannot place: adm.requeue(item.id, now)

    With `knee_wait_s`, set `wait_source` (the router's PoolRouter.pool_wait(now,
    stop_below)) so the queue can tell when the pool is past its knee.

    Counters: `admitted` (at offer), `queued_total`, `dispatched` (from the queue),
    `rejected` (by reason), `cancelled`, `shed` (displaced by higher-band work),
    `knee_held` (new tasks' requests queued because the pool was past its knee).
    """

    def __init__(
        self,
        config: AdmissionConfig | None = None,
        *,
        wait_source: Callable[[float, float], float | None] | None = None,
    ) -> None:
        cfg = config or AdmissionConfig()
        self.config = cfg
        self.wait_source = wait_source
        # The knee gate: the queued new-task request that passed it and that the router
        # has not placed yet (`routed`); the next is judged after it.
        self._gate_item: Hashable | None = None
        self._knee: deque[_Entry] = deque()  # held at the knee, in arrival order
        self.knee_held = 0
        self._capacity = cfg.max_in_flight
        self._bands = [_Band() for _ in range(BANDS)]
        self._queued: dict[Hashable, _Entry] = {}
        # Every queued deadline, across bands: lets _expire return in O(1) when nothing
        # can be late yet (stale entries are dropped when they reach the top).
        self._deadlines: list[tuple[float, int, _Entry]] = []
        self._in_flight: dict[Hashable, _Dispatched] = {}
        self._tenants: dict[str, _Tenant] = {}
        self._tasks: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self._rejected: list[Reject] = []
        self._residence: float | None = cfg.initial_residence_s
        self._blocked_until = -math.inf
        self._seq = 0
        self.admitted = 0
        self.queued_total = 0
        self.dispatched = 0
        self.rejected: dict[str, int] = {"deadline": 0, "quota": 0, "overload": 0}
        self.cancelled = 0
        self.shed = 0

    # -- state -------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def queued(self) -> int:
        return len(self._queued)

    @property
    def capacity(self) -> int:
        return self._capacity

    def set_capacity(self, max_in_flight: int) -> None:
        """Dispatch slots now (e.g. from healthy endpoints x their limits)."""
        self._capacity = max(1, max_in_flight)

    def policy(self, tenant: str | None) -> TenantPolicy:
        if tenant is None:
            return self.config.default_tenant
        return self.config.tenants.get(tenant, self.config.default_tenant)

    def task_progress(self, task_id: str, spent_usd: float, steps_ok: int) -> None:
        """What a task has already spent and achieved (its successful steps)."""
        tasks = self._tasks
        tasks.pop(task_id, None)
        tasks[task_id] = (spent_usd, steps_ok)
        while len(tasks) > self.config.max_tasks:
            tasks.popitem(last=False)

    def record_step(self, task_id: str, spent_usd: float = 0.0) -> None:
        """One more step of the task succeeded, at this cost (adds to task_progress)."""
        spent, steps = self._tasks.get(task_id, (0.0, 0))
        self.task_progress(task_id, spent + spent_usd, steps + 1)

    def has_sunk_cost(self, task_id: str | None) -> bool:
        if task_id is None:
            return False
        p = self._tasks.get(task_id)
        if p is None:
            return False
        spent, steps = p
        cfg = self.config
        return steps >= cfg.sunk_cost_min_steps and spent >= cfg.sunk_cost_min_usd

    def band_of(self, item: AdmissionItem) -> int:
        p = DEFAULT_PRIORITY if item.priority is None else item.priority
        p = max(0, min(PRIORITY_MAX, p, self.policy(item.tenant).max_priority))
        return 2 * p + (1 if item.started or self.has_sunk_cost(item.task_id) else 0)

    def past_knee(self, now: float) -> bool:
        """Whether the pool's predicted queueing delay (wait_source) exceeds knee_wait_s."""
        knee = self.config.knee_wait_s
        if knee is None or self.wait_source is None:
            return False
        wait = self.wait_source(now, knee)  # (it may stop at the first endpoint under it)
        return wait is not None and wait > knee

    def expected_wait(self, band: int) -> float:
        """Estimated queueing time for a newcomer in `band`: every request queued in it or
        above goes first, at slots / mean slot time per second."""
        return self._wait_for(sum(b.count for b in self._bands[band:]))

    def _wait_for(self, ahead: int) -> float:
        r = self._residence
        return 0.0 if r is None or ahead <= 0 else ahead * r / self._capacity

    def _retry_after(self, ahead: int) -> float:
        cfg = self.config
        return min(cfg.max_retry_after_s, max(cfg.min_retry_after_s, self._wait_for(ahead)))

    # -- offer -------------------------------------------------------------------------------

    def offer(self, item: AdmissionItem, now: float) -> Decision:
        """Admit, queue or refuse `item` (module docstring)."""
        iid = item.id
        queued, in_flight = self._queued, self._in_flight
        if iid in queued or iid in in_flight:
            raise ValueError(f"item {iid!r} is already queued or in flight")
        knee: bool | None = None
        if not queued and len(in_flight) < self._capacity and now >= self._blocked_until:
            # The common case, in one frame (each call and object on the way to the
            # upstream send costs ~5 us with cold caches): nothing is queued, so nothing
            # can expire or be ahead, and a slot is free. The same decision as below.
            cfg = self.config
            name = item.tenant
            policy = (
                cfg.default_tenant if name is None else cfg.tenants.get(name, cfg.default_tenant)
            )
            deadline = item.deadline
            latest = math.inf if deadline is None else deadline - item.predicted_ttft_s
            if latest >= now:  # else refused below
                tenant = DEFAULT_TENANT if name is None else name
                t = self._tenants.get(tenant)
                cap = policy.max_in_flight
                if cap is None or t is None or t.in_flight < cap:
                    started = item.started
                    if not started and item.task_id is not None:
                        started = self.has_sunk_cost(item.task_id)
                    knee_s = cfg.knee_wait_s
                    if started or knee_s is None or self.wait_source is None:
                        knee = False
                    else:
                        wait = self.wait_source(now, knee_s)
                        knee = wait is not None and wait > knee_s
                    if not knee:
                        p = DEFAULT_PRIORITY if item.priority is None else item.priority
                        if p > policy.max_priority:
                            p = policy.max_priority
                        p = PRIORITY_MAX if p > PRIORITY_MAX else 0 if p < 0 else p
                        self._seq += 1
                        in_flight[iid] = (
                            now,
                            tenant,
                            item,
                            2 * p + started,
                            self._seq,
                            latest,
                            None,
                        )
                        if t is None:
                            t = self._tenants[tenant] = _Tenant()
                        t.in_flight += 1
                        self.admitted += 1
                        return ADMIT
        return self._offer(item, now, knee)

    def _offer(self, item: AdmissionItem, now: float, knee: bool | None) -> Decision:
        """offer's general path (`knee`: the knee's verdict, if the fast path judged it)."""
        self._expire(now)
        cfg = self.config
        policy = self.policy(item.tenant)
        tenant = DEFAULT_TENANT if item.tenant is None else item.tenant
        band = self.band_of(item)
        latest = math.inf if item.deadline is None else item.deadline - item.predicted_ttft_s
        if latest < now:
            left = latest + item.predicted_ttft_s - now
            return self._refuse(
                item,
                "deadline",
                f"the deadline is {_secs(left)} away "
                f"and the first token needs about {_secs(item.predicted_ttft_s)}",
                0,
            )
        t = self._tenants.get(tenant)
        queued_here = 0 if t is None else t.queued
        in_flight_here = 0 if t is None else t.in_flight
        if (
            knee is None
            and now >= self._blocked_until
            and len(self._in_flight) < self._capacity
            and (policy.max_in_flight is None or in_flight_here < policy.max_in_flight)
            # Nothing queued at all (the bands' counts sum to len(_queued)): no band scan.
            and (not self._queued or not any(b.count for b in self._bands[band:]))
            and not (knee := band % 2 == 0 and self.past_knee(now))
        ):
            self._seq += 1
            self._in_flight[item.id] = (now, tenant, item, band, self._seq, latest, None)
            self._tenant(tenant).in_flight += 1
            self.admitted += 1
            return ADMIT
        limit = cfg.max_queued_per_tenant if policy.max_queued is None else policy.max_queued
        if queued_here >= limit:
            return self._refuse(
                item,
                "quota",
                f"tenant {tenant or 'default'!r} already has {queued_here} requests queued "
                f"(its limit is {limit})",
                queued_here,
            )
        ahead_above = sum(b.count for b in self._bands[band + 1 :])
        wait_lb = self._wait_for(ahead_above)
        if latest < now + wait_lb:
            return self._refuse(
                item,
                "deadline",
                f"{ahead_above} higher-priority requests are queued ahead (about "
                f"{_secs(wait_lb)}) and the deadline leaves {_secs(latest - now)} before "
                "the first token is due",
                ahead_above,
            )
        if len(self._queued) >= cfg.max_queued:
            low = next((i for i, b in enumerate(self._bands) if b.count), None)
            if low is None or low >= band:
                return self._refuse(
                    item,
                    "overload",
                    f"the admission queue is full ({cfg.max_queued} requests, "
                    "admission.max_queued)",
                    len(self._queued),
                )
            self._shed(low)
        entry = _Entry(item, tenant, band, self._next_seq(), latest)
        if band % 2 == 0 and cfg.knee_wait_s is not None:
            # A new task's request waits at most knee_max_wait_s here, whatever queued it
            # (the gate may shut on it while it waits for a slot).
            entry.knee_until = now + cfg.knee_max_wait_s
            self._knee.append(entry)
            if knee is None:
                knee = self.past_knee(now)
            self.knee_held += knee
        self._enqueue(entry)
        self.queued_total += 1
        ahead = sum(b.count for b in self._bands[band:]) - 1
        return Queue(ahead, self._wait_for(ahead))

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _refuse(
        self, item: AdmissionItem, reason: RejectReason, message: str, ahead: int
    ) -> Reject:
        self.rejected[reason] += 1
        return Reject(item, reason, message, self._retry_after(ahead))

    # -- queue structure ---------------------------------------------------------------------

    def _enqueue(self, e: _Entry) -> None:
        b = self._bands[e.band]
        flow = b.flows.get(e.tenant)
        if flow is None:
            if len(b.flows) >= self.config.max_tenants:
                self._purge_flows(b)
            flow = b.flows[e.tenant] = _Flow()
        deadline = math.inf if e.item.deadline is None else e.item.deadline
        heapq.heappush(flow.heap, (deadline, e.seq, e))
        flow.live += 1
        if flow.tag is None:
            flow.tag = max(b.vtime, flow.finish)
            heapq.heappush(b.tags, (flow.tag, e.seq, e.tenant))
            b.active += 1
        if e.latest_start != math.inf:
            heapq.heappush(b.deadlines, (e.latest_start, e.seq, e))
            heapq.heappush(self._deadlines, (e.latest_start, e.seq, e))
            if len(self._deadlines) > 2 * len(self._queued) + 64:
                self._deadlines = [x for x in self._deadlines if x[2].queued]
                heapq.heapify(self._deadlines)
        heapq.heappush(b.newest, (-e.seq, e))
        b.count += 1
        self._queued[e.item.id] = e
        self._tenant(e.tenant).queued += 1

    def _tenant(self, name: str) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:
            t = self._tenants[name] = _Tenant()
        return t

    def _unqueue(self, e: _Entry) -> None:
        """Take a queued entry out of the counts; heap entries go stale (skipped later)."""
        e.queued = False
        e.knee_until = math.inf  # whatever happens next, it is no longer held at the knee
        del self._queued[e.item.id]
        b = self._bands[e.band]
        b.count -= 1
        flow = b.flows[e.tenant]
        flow.live -= 1
        if flow.live == 0:
            flow.heap.clear()
            if flow.tag is not None:
                flow.tag = None
                b.active -= 1
        elif len(flow.heap) > 2 * flow.live + 16:
            flow.heap = [x for x in flow.heap if x[2].queued]
            heapq.heapify(flow.heap)
        t = self._tenants[e.tenant]
        t.queued -= 1
        self._maybe_drop_tenant(e.tenant, t)
        self._compact(b)

    def _maybe_drop_tenant(self, name: str, t: _Tenant) -> None:
        # The default tenant's stays: most requests name none, and one made and dropped
        # per request costs ~5 us with cold caches.
        if t.queued == 0 and t.in_flight == 0 and name != DEFAULT_TENANT:
            del self._tenants[name]

    def _compact(self, b: _Band) -> None:
        if len(b.deadlines) > 2 * b.count + 32:
            b.deadlines = [x for x in b.deadlines if x[2].queued]
            heapq.heapify(b.deadlines)
        if len(b.newest) > 2 * b.count + 32:
            b.newest = [x for x in b.newest if x[1].queued]
            heapq.heapify(b.newest)
        if len(b.tags) > 2 * b.active + 32:
            b.tags = [
                x for x in b.tags if b.flows.get(x[2]) is not None and b.flows[x[2]].tag == x[0]
            ]
            heapq.heapify(b.tags)

    def _purge_flows(self, b: _Band) -> None:
        """Idle flows whose finish tag the band's virtual time has passed carry no
        fairness debt: forget them (amortised: runs once per max_tenants new flows)."""
        b.flows = {k: f for k, f in b.flows.items() if f.live or f.finish > b.vtime}

    def _shed(self, band: int) -> None:
        b = self._bands[band]
        while b.newest:
            _, e = heapq.heappop(b.newest)
            if e.queued:
                self._unqueue(e)
                self.shed += 1
                self._rejected.append(
                    self._refuse(
                        e.item,
                        "overload",
                        "the admission queue is full and this request was displaced by "
                        "higher-priority work",
                        len(self._queued),
                    )
                )
                return

    # -- dispatch ----------------------------------------------------------------------------

    def _dispatch(self, e: _Entry, now: float) -> None:
        self._in_flight[e.item.id] = (now, e.tenant, e.item, e.band, e.seq, e.latest_start, e)
        self._tenant(e.tenant).in_flight += 1

    def next(self, now: float) -> AdmissionItem | None:
        """The next queued item to dispatch now, or None (no free slot, nothing queued, or
        blocked after a requeue). Refusals found on the way go to take_rejected()."""
        if not self._queued:
            # Nothing to dispatch, and nothing _expire could refuse or let past the knee
            # (it would only drop stale heap entries, which wait for the next call): the
            # pump after every request's end, without the call.
            return None
        self._expire(now)
        if now < self._blocked_until or len(self._in_flight) >= self._capacity or not self._queued:
            return None
        shut: bool | None = None  # the knee gate for new tasks, judged once, if needed
        for band in range(BANDS - 1, -1, -1):
            b = self._bands[band]
            if not b.count:
                continue
            if band % 2 == 0 and self.config.knee_wait_s is not None:
                if shut is None:
                    shut = self._gate_item is not None or self.past_knee(now)
                if shut:
                    continue  # started tasks (odd bands) below may still go
            e = self._pop_held(b) if shut is False else None
            if e is None:
                e = self._pop_band(b)
            if e is not None:
                if band % 2 == 0 and shut is not None:
                    self._gate_item = e.item.id  # judged by the router before the next
                self._unqueue(e)
                self._dispatch(e, now)
                self.dispatched += 1
                return e.item
        return None

    def _pop_held(self, b: _Band) -> _Entry | None:
        """The newest request held at the knee in band `b` (None if the newest queued one
        is not held, or its tenant is at its in-flight cap): with a standing queue, one
        that waited long has likely spent its budget, the newest has not (adaptive LIFO,
        Maurer, "Fail at Scale", ACM Queue 2015). It passes over the tenants' fair
        shares within the band (their tags are not charged): a known gap."""
        newest = b.newest
        while newest:
            e = newest[0][1]
            if not e.queued:
                heapq.heappop(newest)
                continue
            if e.knee_until == math.inf:
                return None
            cap = self.policy(e.item.tenant).max_in_flight
            t = self._tenants.get(e.tenant)
            if cap is not None and t is not None and t.in_flight >= cap:
                return None
            heapq.heappop(newest)
            return e
        return None

    def _pop_band(self, b: _Band) -> _Entry | None:
        """SFQ: the active flow with the least start tag whose tenant may take a slot."""
        held: list[tuple[float, int, str]] = []
        chosen: _Entry | None = None
        while b.tags:
            tag, seq, tenant = heapq.heappop(b.tags)
            flow = b.flows.get(tenant)
            if flow is None or flow.tag != tag or not flow.live:
                continue  # stale
            cap = self.policy(tenant if tenant != DEFAULT_TENANT else None).max_in_flight
            t = self._tenants.get(tenant)
            if cap is not None and t is not None and t.in_flight >= cap:
                held.append((tag, seq, tenant))
                continue
            while flow.heap and not flow.heap[0][2].queued:
                heapq.heappop(flow.heap)
            _, _, chosen = heapq.heappop(flow.heap)
            b.vtime = tag
            flow.finish = tag + chosen.item.cost / self.policy(chosen.item.tenant).weight
            if flow.live > 1:
                flow.tag = flow.finish
                heapq.heappush(b.tags, (flow.tag, chosen.seq, tenant))
            break
        for h in held:
            heapq.heappush(b.tags, h)
        return chosen

    def release(self, item_id: Hashable, now: float) -> None:
        """A dispatched item finished (any outcome): its slot is free."""
        d = self._in_flight.pop(item_id, None)
        if d is None:
            return
        sample = now - d[0]
        if sample < 0.0:
            sample = 0.0
        r = self._residence
        self._residence = sample if r is None else r + self.config.residence_alpha * (sample - r)
        tenant = d[1]
        t = self._tenants[tenant]
        t.in_flight -= 1
        if t.queued == 0 and t.in_flight == 0 and tenant != DEFAULT_TENANT:
            del self._tenants[tenant]
        self._blocked_until = -math.inf
        if self._gate_item == item_id:
            self._gate_item = None

    def routed(self, item_id: Hashable) -> bool:
        """The router placed a dispatched item (its first attempt started): True when that
        item was the one let past the knee gate, which is now open for the next (the
        driver then calls `next` again)."""
        if self._gate_item is not None and self._gate_item == item_id:
            self._gate_item = None
            return True
        return False

    def _free(self, d: _Dispatched) -> None:
        t = self._tenants[d[1]]
        t.in_flight -= 1
        self._maybe_drop_tenant(d[1], t)

    def requeue(self, item_id: Hashable, now: float) -> None:
        """A dispatched item could not be placed after all (every endpoint said "queue"):
        back to the queue with its deadline and arrival order, and no dispatch until the
        next release or requeue_backoff_s (so the driver must also call `next` on a
        timer). It may exceed max_queued by the items requeued: an admitted item is never
        dropped. (Its tenant's fair-share tag was already charged for it.)"""
        d = self._in_flight.pop(item_id, None)
        if d is None:
            raise KeyError(item_id)
        self._free(d)
        _, tenant, item, band, seq, latest, e = d
        if e is None:
            e = _Entry(item, tenant, band, seq, latest)
        else:
            e.queued = True
        self._enqueue(e)
        self._blocked_until = now + self.config.requeue_backoff_s

    def cancel(self, item_id: Hashable) -> bool:
        """The waiter went away: drop a queued item (True), or False if it is not queued
        (an admitted item is released with `release`)."""
        e = self._queued.get(item_id)
        if e is None:
            return False
        self._unqueue(e)
        self.cancelled += 1
        return True

    # -- deadlines ---------------------------------------------------------------------------

    def expire(self, now: float) -> list[Reject]:
        """Refuse every queued item that can no longer meet its deadline, lowest band
        first; return them with any other pending refusals (same as take_rejected). On
        the driver's timer: it also lets one more held new task past the knee gate."""
        self._gate_item = None
        self._expire(now)
        return self.take_rejected()

    def take_rejected(self) -> list[Reject]:
        """Refusals of queued items since the last call. The driver MUST answer each."""
        out, self._rejected = self._rejected, []
        return out

    def _expire(self, now: float) -> None:
        knee = self._knee
        while knee:
            e = knee[0]
            if e.knee_until > now and e.knee_until != math.inf:
                break
            knee.popleft()
            if e.knee_until == math.inf:
                continue  # dispatched, cancelled or refused since: no longer held
            self._unqueue(e)
            self._rejected.append(
                self._refuse(
                    e.item,
                    "overload",
                    f"every engine of the pool has more than {_secs(self.config.knee_wait_s or 0)}"
                    f" of work queued and this new task waited "
                    f"{_secs(self.config.knee_max_wait_s)} for it to drain "
                    "(reliability.admission.knee_wait_s, knee_max_wait_s)",
                    len(self._queued),
                )
            )
        top = self._deadlines
        while top and not top[0][2].queued:
            heapq.heappop(top)
        # No band's horizon reaches beyond now + the wait behind everything queued.
        if not top or top[0][0] >= now + self._wait_for(len(self._queued)):
            return
        above = 0
        counts = [b.count for b in self._bands]
        total_above = [0] * BANDS
        for band in range(BANDS - 1, -1, -1):
            total_above[band] = above
            above += counts[band]
        for band in range(BANDS):
            b = self._bands[band]
            if not b.count or not b.deadlines:
                continue
            horizon = now + self._wait_for(total_above[band])
            while b.deadlines and b.deadlines[0][0] < horizon:
                latest, _, e = heapq.heappop(b.deadlines)
                if not e.queued:
                    continue
                self._unqueue(e)
                late = latest < now
                self._rejected.append(
                    self._refuse(
                        e.item,
                        "deadline",
                        "the deadline passed while the request was queued"
                        if late
                        else f"the deadline can no longer be met: about "
                        f"{_secs(horizon - now)} of higher-priority work is queued ahead",
                        total_above[band],
                    )
                )


def _secs(s: float) -> str:
    return f"{max(0.0, s):.2f} s"
