"""One interface over a pool's endpoint-choice policies, so a driver (the sidecar, the
ext_proc picker, the simulator) routes the same way whichever policy is configured:
`round-robin` and `least-request` (EndpointBalancer) or `meshd` (the prefix-aware Picker).

Sans-I/O. The driver's protocol, per request::

    routes = router.order(req, now)                 # primary first, then fallbacks
        (record=False: the meshd picker notes the request where an attempt starts,
        not as it picks; order_decode(req, now, lead_s=...): a split request's
        decode leg, by KV headroom, decode load and ITL)
    for r in routes: router.started(r, rid, req, now); ...connect
        on a connect failure: router.connect_failed(r, rid, now, reason); next route
    router.first_token(r, rid, now)                 # streams only
    (before the first try: router.predicted_end_s(routes[0], req): seconds to the
    answer's last token, None where the policy predicts nothing; filters/deadline.py)
    router.finished(r, rid, now, ok=..., cached_tokens=usage cached tokens or None,
                    completion_tokens=the stream's output tokens or None)

from the reliability filters (filters/guard.py's GuardEvents.flags), on every change and
while a slow-start ramp is in progress::

    router.set_flags(url, breaker_open=..., ejected_until=..., ramp=..., now=now)

so the policy itself keeps an open or ejected endpoint out of the order (the `meshd`
policy: ineligible; the balancer policies: behind every other endpoint) and gives a
ramping one less weight (`meshd`: its bounded-load capacity weight; `least-request`: its
outstanding-per-weight score; round robin has no weights and ignores the ramp); and,
from the control plane (meshd/control_feed.py), whenever it has news::

    router.report(url, reported_state_or_None, now, ttl_s=...)   # engine state; None: gone
    router.apply_digest(url, digest_or_None, now)                 # engine's cached blocks

A report stays in force for `ttl_s` after the call (the feed renews it while its control
plane is connected), then the router goes back to what it observes itself. Every policy
keeps an endpoint reported unhealthy or draining out of the order while the report is
fresh (behind every other endpoint, for the balancer policies, as a resting one); the
`meshd` policy also uses the rest of the report (load, KV usage, GPU, warm models) and
the digests: a request whose block hashes are in an engine's digest gets those blocks
as precise entries of the picker's PrefixIndex, which is how a digest steers it. That
needs the request's hashes and the engine's to be computed the same way (the engine's own
hashes: meshd/kv_events.py; text-block hashes match only a digest built from them).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

from filters.admission import AdmissionItem
from filters.balancer import EndpointBalancer
from filters.cache_aware import CacheAwareBalancer, CacheAwareConfig
from filters.deadline import EndPredictor
from filters.endpoint_state import BlockDigest, EndpointState, ReportedBlocks, ReportedState
from filters.picker import Choice, Picker, PickerConfig, PickRequest

Policy = Literal["round-robin", "least-request", "meshd", "cache-aware"]
POLICIES: tuple[Policy, ...] = ("meshd", "least-request", "round-robin", "cache-aware")
_new_tuple = tuple.__new__  # admission_item's AdmissionItem and order's Routes, built in C


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """What configuration says about an endpoint."""

    url: str
    weight: float = 1.0
    gpu: str | None = None
    kv_capacity_tokens: int | None = None


class Route(NamedTuple):
    """One endpoint of a request's order, and why. A NamedTuple, built by `order` with
    tuple.__new__: one a route a request on the way to the upstream send, ~12 us each
    with cold caches (two routes: 23-26 us) against ~22 us (43-45 us) for the frozen
    dataclass it was; `_replace` makes one with a field changed."""

    url: str
    reason: str
    predicted_ttft_s: float | None = None
    cached_tokens: float | None = None
    choice: Choice | None = None
    # On the primary: why the endpoint holding the request's prefix (its affinity holder)
    # was left ("deadline", "overloaded", "faster-elsewhere", "replicate"), else None.
    departure: str | None = None
    # Whether ordering already noted the request at this route (the meshd picker records
    # its primary as it picks); False: noted when an attempt starts there (`started`).
    recorded: bool = True


class PoolRouter(Protocol):
    policy: Policy

    def order(self, req: PickRequest, now: float, *, record: bool = True) -> list[Route]: ...
    def order_decode(self, req: PickRequest, now: float, *, lead_s: float = 0.0) -> list[Route]: ...
    def predicted_end_s(self, route: Route, req: PickRequest) -> float | None: ...
    def started(self, route: Route, rid: Hashable, req: PickRequest, now: float) -> None: ...
    def first_token(self, route: Route, rid: Hashable, now: float) -> None: ...
    def finished(
        self,
        route: Route,
        rid: Hashable,
        req: PickRequest,
        now: float,
        *,
        ok: bool,
        cached_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None: ...
    def connect_failed(self, route: Route, rid: Hashable, now: float, reason: str) -> None: ...
    def refused(self, route: Route, now: float, retry_after_s: float | None) -> None: ...
    def held_s(self, url: str, now: float) -> float: ...
    def kv_capacities(self, now: float) -> Mapping[str, int]: ...
    def pool_wait(self, now: float, stop_below: float = ...) -> float | None: ...
    def follow_up(self, req: PickRequest, now: float) -> bool: ...
    def snapshot(self, now: float) -> list[dict[str, object]]: ...
    def report(
        self, url: str, state: ReportedState | None, now: float, *, ttl_s: float
    ) -> bool: ...
    def apply_digest(self, url: str, digest: BlockDigest | None, now: float) -> bool: ...
    def engine_hits(self, url: str, queries: float, hits: float, now: float) -> float | None: ...
    def set_flags(
        self,
        url: str,
        *,
        breaker_open: bool,
        ejected_until: float | None,
        ramp: float = 1.0,
        now: float,
    ) -> bool: ...


def admission_item(
    item_id: Hashable,
    router: PoolRouter | None,
    req: PickRequest,
    step: int | None,
    tokens: int,
    now: float,
) -> AdmissionItem:
    """What admission is told of a request (the sidecar's _admit, and the virtual pass that
    models it): tenant, priority, deadline and task; its expected tokens as the fair-share
    cost; and whether it continues a task under way, which puts it in the band above a new
    task's: x-meshd-task-step past 0, or `router.follow_up` (a prompt extending one routed
    before; None: no router asked, as when admission is off)."""
    started = (step or 0) >= 1 or (router is not None and router.follow_up(req, now))
    # tuple.__new__ in C, not the NamedTuple's generated __new__ (a Python frame and its
    # keyword handling): ~9 us against ~21 us with cold caches, once a request on the way
    # to the upstream send (loadtest/admission_bench.py). The fields in their order.
    return _new_tuple(
        AdmissionItem,
        (
            item_id,
            req.tenant,
            req.priority,
            req.deadline_s,
            0.0,  # predicted_ttft_s
            float(tokens if tokens > 1 else 1),  # cost: max(1, tokens) without the call
            req.context_key,
            started,
        ),
    )


@dataclass(frozen=True, slots=True)
class _Flags:
    """What the reliability filters last said about an endpoint (balancer policies)."""

    breaker_open: bool
    ejected_until: float | None
    ramp: float

    def ineligible_reason(self, now: float) -> str | None:
        if self.breaker_open:
            return "breaker-open"
        if self.ejected_until is not None and now < self.ejected_until:
            return "ejected"
        return None


def _check_ramp(ramp: float) -> None:
    if not 0.0 < ramp <= 1.0:
        raise ValueError(f"ramp must be in (0, 1], got {ramp}")


@dataclass(slots=True)
class _Report:
    state: ReportedState
    at: float
    ttl_s: float

    def fresh(self, now: float) -> bool:
        return now - self.at < self.ttl_s

    def ineligible_reason(self, now: float) -> str | None:
        if not self.fresh(now):
            return None
        if not self.state.healthy:
            return "unhealthy"
        return "draining" if self.state.draining else None


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _report_view(state: ReportedState | None, at: float, ttl_s: float, now: float) -> object:
    if state is None:
        return None
    return {
        "age_s": round(now - at, 3),
        "fresh": now - at < ttl_s,
        "healthy": state.healthy,
        "draining": state.draining,
        "epoch": state.epoch,
        "requests_running": state.requests_running,
        "requests_waiting": state.requests_waiting,
        "kv_usage": state.kv_usage,
    }


class BalancerRouter:
    """Round robin or least outstanding requests, with passive health."""

    def __init__(
        self,
        endpoints: Sequence[EndpointSpec],
        policy: Literal["round-robin", "least-request"],
        *,
        unhealthy_after: int,
        cooldown_s: float,
    ) -> None:
        self.policy: Policy = policy
        self._balancer = EndpointBalancer(
            [(e.url, e.weight) for e in endpoints],
            policy=policy,
            unhealthy_after=unhealthy_after,
            cooldown_s=cooldown_s,
        )
        self._reports: dict[str, _Report] = {}
        self._flags: dict[str, _Flags] = {}  # only endpoints with a flag or a ramp

    def order(self, req: PickRequest, now: float, *, record: bool = True) -> list[Route]:
        """The policy's order (it records nothing: `record` is for the meshd policy)."""
        urls = self._balancer.order(now)
        if not self._reports and not self._flags:
            return [Route(url, self.policy) for url in urls]
        if self.policy == "least-request" and any(f.ramp < 1.0 for f in self._flags.values()):
            # The balancer's own key with the ramp in the weight (stable: ties keep the
            # balancer's rotation).
            b, flags = self._balancer, self._flags

            def score(u: str) -> tuple[bool, float]:
                load, f = b.load(u), flags.get(u)
                weight = load.weight * (f.ramp if f is not None else 1.0)
                return (not load.healthy(now), load.outstanding / weight)

            urls.sort(key=score)
        # Reported unhealthy or draining, breaker open or ejected: to the back (stable, so
        # the rest keep the order).
        reasons: dict[str, str | None] = {
            u: f.ineligible_reason(now) for u, f in self._flags.items()
        }
        for u, r in self._reports.items():
            reasons[u] = r.ineligible_reason(now) or reasons.get(u)
        urls.sort(key=lambda u: reasons.get(u) is not None)
        return [Route(url, reasons.get(url) or self.policy) for url in urls]

    def order_decode(self, req: PickRequest, now: float, *, lead_s: float = 0.0) -> list[Route]:
        """A split request's decode leg: the policy's own order (round robin's turn, or the
        least outstanding requests); the balancers predict nothing, so no lead applies."""
        return BalancerRouter.order(self, req, now)

    def predicted_end_s(self, route: Route, req: PickRequest) -> float | None:
        return None  # these policies predict nothing

    def set_flags(
        self,
        url: str,
        *,
        breaker_open: bool,
        ejected_until: float | None,
        ramp: float = 1.0,
        now: float,
    ) -> bool:
        if url not in self._balancer.endpoints:
            return False
        _check_ramp(ramp)
        if not breaker_open and ejected_until is None and ramp >= 1.0:
            self._flags.pop(url, None)
        else:
            self._flags[url] = _Flags(breaker_open, ejected_until, ramp)
        return True

    def engine_hits(self, url: str, queries: float, hits: float, now: float) -> float | None:
        """A balancer keeps no prefix index to check against the engine's counters."""
        return None

    def report(self, url: str, state: ReportedState | None, now: float, *, ttl_s: float) -> bool:
        if url not in self._balancer.endpoints:
            return False
        if state is None:
            self._reports.pop(url, None)
        else:
            self._reports[url] = _Report(state, now, ttl_s)
        return True

    def apply_digest(self, url: str, digest: BlockDigest | None, now: float) -> bool:
        return False  # these policies do not look at prefixes

    def started(self, route: Route, rid: Hashable, req: PickRequest, now: float) -> None:
        self._balancer.on_start(route.url)

    def first_token(self, route: Route, rid: Hashable, now: float) -> None:
        return None

    def finished(
        self,
        route: Route,
        rid: Hashable,
        req: PickRequest,
        now: float,
        *,
        ok: bool,
        cached_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        self._balancer.on_finish(route.url)
        if ok:
            self._balancer.on_success(route.url)

    def connect_failed(self, route: Route, rid: Hashable, now: float, reason: str) -> None:
        self._balancer.on_finish(route.url)
        self._balancer.on_connect_failure(route.url, now, reason)

    def kv_capacities(self, now: float) -> Mapping[str, int]:
        """The KV capacity each endpoint reported (the balancers route without it; the
        guard's token limits follow it all the same)."""
        return {
            url: cap
            for url, r in self._reports.items()
            if r.fresh(now) and (cap := r.state.kv_capacity_tokens)
        }

    def refused(self, route: Route, now: float, retry_after_s: float | None) -> None:
        """The balancers do not hold a refusing endpoint back (Envoy's and the peers' way):
        a 503 storm reaches their breaker and outlier detection only."""
        return None

    def held_s(self, url: str, now: float) -> float:
        return 0.0

    def pool_wait(self, now: float, stop_below: float = 0.0) -> float | None:
        """No prediction of queueing here: the admission knee gate stays open."""
        return None

    def follow_up(self, req: PickRequest, now: float) -> bool:
        return False

    def snapshot(self, now: float) -> list[dict[str, object]]:
        out = self._balancer.snapshot(now)
        for e in out:
            r = self._reports.get(str(e["url"]))
            why = None if r is None else r.ineligible_reason(now)
            if why is not None:
                e["healthy"], e["ineligible_reason"] = False, why
            e["reported"] = None if r is None else _report_view(r.state, r.at, r.ttl_s, now)
            f = self._flags.get(str(e["url"]))
            if f is not None and e.get("ineligible_reason") is None:
                why = f.ineligible_reason(now)
                if why is not None:
                    e["healthy"], e["ineligible_reason"] = False, why
            e["ramp"] = 1.0 if f is None else f.ramp
        return out


class CacheAwareRouter(BalancerRouter):
    """The peers' cache-aware rule (filters/cache_aware.py) as the primary, then the rest
    by least outstanding requests; passive health, reports and flags as the balancers
    have them (an endpoint resting or flagged is never the cache-aware primary)."""

    def __init__(
        self,
        endpoints: Sequence[EndpointSpec],
        *,
        unhealthy_after: int,
        cooldown_s: float,
        config: CacheAwareConfig | None = None,
    ) -> None:
        super().__init__(
            endpoints, "least-request", unhealthy_after=unhealthy_after, cooldown_s=cooldown_s
        )
        self.policy = "cache-aware"
        self.cache = CacheAwareBalancer([e.url for e in endpoints], config)

    def order(self, req: PickRequest, now: float, *, record: bool = True) -> list[Route]:
        routes = super().order(req, now)
        # Not flagged, reported out or resting: what the balancer's order names by policy.
        ok = [r.url for r in routes if r.reason == self.policy]
        ok = [u for u in ok if self._balancer.load(u).healthy(now)]
        if not ok:
            return routes
        # The candidates in configured order, so the tree's ties break as the peers' do,
        # with the balancer's count of outstanding requests.
        healthy = set(ok)
        b = self._balancer
        pick = self.cache.choose(
            req.block_hashes, {u: b.load(u).outstanding for u in b.endpoints if u in healthy}
        )
        rest = [r for r in routes if r.url != pick]
        return [Route(pick, "cache-aware"), *rest]


def cached_tokens(router: PoolRouter, req: PickRequest, now: float) -> dict[str, float]:
    """PickerRouter.cached_tokens for meshd's picker; {} for a router that keeps no prefix
    index (the balancers), where nothing is known to be cached."""
    return router.cached_tokens(req, now) if isinstance(router, PickerRouter) else {}


class PickerRouter:
    """meshd's prefix-aware, cost-and-latency picker over EndpointStates."""

    policy: Policy = "meshd"

    def __init__(
        self, endpoints: Sequence[EndpointSpec], config: PickerConfig | None = None
    ) -> None:
        self.states = [
            EndpointState(
                e.url,
                url=e.url,
                gpu=e.gpu or "unknown",
                kv_capacity_tokens=e.kv_capacity_tokens,
            )
            for e in endpoints
        ]
        self._by_url = {s.url: s for s in self.states}
        self._last_error: dict[str, str] = {}
        # track_blocks: a digest's removals find their blocks (PrefixIndex.remove).
        config = config or PickerConfig()
        self.picker = Picker(config, index=config.new_index(track_blocks=True))
        self._digests: dict[str, ReportedBlocks] = {}  # endpoint name -> its blocks
        self._digest_live: set[str] = set()  # names whose blocks are in the index now
        self.ends = EndPredictor()  # the pool's output fill, for predicted_end_s
        # kv_capacities' answer, kept while nothing it depends on changed: `kv_version`
        # moves when a report (report()) changes what an endpoint's capacity is, and the
        # answer holds until the first report behind it goes stale.
        self.kv_version = 0
        self._kv_cache: tuple[int, float, float, Mapping[str, int]] | None = None

    def order(self, req: PickRequest, now: float, *, record: bool = True) -> list[Route]:
        """The picker's order. `record` false: the primary is not noted in the prefix index
        and task map as it is picked, but when an attempt starts there (the prefill pool of
        a split request, whose decider may serve it elsewhere)."""
        if self._digests:
            self._materialize(req.block_hashes, now)
        picker = self.picker
        choices = picker.pick(req, self.states, now, record=record)
        if not choices:
            return self._anyway()
        # Route's fields in their order (url, reason, predicted_ttft_s, cached_tokens,
        # choice, departure: the primary's, recorded): tuple.__new__ in C, the Choice's
        # fields by index (endpoint, url, predicted_ttft_s, cost, cached_tokens, reason),
        # in a loop (a comprehension is one more function and frame a request).
        new, route = _new_tuple, Route
        routes: list[Route] = []
        departure = picker.last_departure
        for c in choices:
            routes.append(new(route, (c[1], c[5], c[2], c[4], c, departure, record)))
            departure = None
        return routes

    def order_decode(self, req: PickRequest, now: float, *, lead_s: float = 0.0) -> list[Route]:
        """A split request's decode leg (Picker.order_decode: KV headroom, then the stream's
        predicted decode time; `lead_s` the KV's way there, in each predicted TTFT). The
        request is noted where its attempt starts."""
        choices = self.picker.order_decode(req, self.states, now, lead_s=lead_s)
        routes = [
            Route(c.url, c.reason, c.predicted_ttft_s, c.cached_tokens, c, recorded=False)
            for c in choices
        ]
        return routes or self._anyway()

    def cached_tokens(self, req: PickRequest, now: float) -> dict[str, float]:
        """The prompt tokens each endpoint is expected to hold in its prefix cache (its
        prefix index's expected blocks x tokens per block, at most the prompt), by URL;
        endpoints holding none are left out. Nothing is recorded (a split request's decode
        leg prices its KV transfer by what the decode engine lacks: filters/disagg.py)."""
        if not req.block_hashes:
            return {}
        if self._digests:
            self._materialize(req.block_hashes, now)
        tpb = req.tokens_per_block or self.picker.config.tokens_per_block
        top = float(max(0, req.prompt_tokens))
        out: dict[str, float] = {}
        for name, (_, expected) in self.picker.index.match_detail(req.block_hashes, now).items():
            if name in self._by_url and expected > 0.0:
                out[name] = min(top, expected * tpb)
        return out

    def _anyway(self) -> list[Route]:
        """Every endpoint is ejected or draining: try them anyway, least failing first,
        rather than refusing outright (static stability)."""
        ranked = sorted(self.states, key=lambda s: (s.consecutive_failures, s.name))
        return [Route(s.url, "no-eligible-endpoint") for s in ranked]

    def predicted_end_s(self, route: Route, req: PickRequest) -> float | None:
        """Seconds from the pick to the answer's last token on `route`: the picker's TTFT,
        then the expected output (max_tokens x the pool's learnt fill) at the step of the
        batch it joins, calibrated to that engine (filters/deadline.py)."""
        c = route.choice
        if c is None:
            return None
        return self.ends.end_s(c.predicted_ttft_s, c.step_s * c.state.decode_ratio, req.max_tokens)

    def started(self, route: Route, rid: Hashable, req: PickRequest, now: float) -> None:
        self.ends.dispatched(rid, req.max_tokens)
        if route.choice is not None:
            self.picker.dispatch(route.choice, req, rid, now, recorded=route.recorded)
        else:
            self._by_url[route.url].start(rid, now, prompt_tokens=max(1, req.prompt_tokens))

    def first_token(self, route: Route, rid: Hashable, now: float) -> None:
        self._by_url[route.url].first_token(rid, now)

    def finished(
        self,
        route: Route,
        rid: Hashable,
        req: PickRequest,
        now: float,
        *,
        ok: bool,
        cached_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        self._by_url[route.url].finish(rid, now, ok=ok, output_tokens=completion_tokens)
        self.ends.finished(rid, ok, completion_tokens)
        # A decode leg's cached tokens are its transfer's, not the index's to learn from.
        if (
            ok
            and cached_tokens is not None
            and route.choice is not None
            and not route.reason.startswith("decode")
        ):
            self.picker.observe_cached(route.choice, req, cached_tokens, now)

    def connect_failed(self, route: Route, rid: Hashable, now: float, reason: str) -> None:
        state = self._by_url[route.url]
        state.finish(rid, now, ok=False)
        self.ends.finished(rid, False, None)
        state.connect_failure(now)
        self._last_error[route.url] = reason

    def kv_capacities(self, now: float) -> Mapping[str, int]:
        """Each endpoint's KV capacity where known (reported, else configured): the same
        mapping until `kv_version` moves or a report behind it goes stale,
        so the admission tick does not walk every endpoint each time (518 us a tick at
        1,000 endpoints)."""
        c = self._kv_cache
        if c is not None and c[0] == self.kv_version and c[1] <= now < c[2]:
            return c[3]
        caps: dict[str, int] = {}
        until = math.inf  # when the first fresh report giving a capacity goes stale
        for s in self.states:
            r = s.fresh_report(now)
            cap = r.kv_capacity_tokens if r is not None else None
            if cap is not None:
                until = min(until, s.reported_at + s.report_ttl_s)
            else:
                cap = s.kv_capacity_tokens
            if cap:
                caps[s.url] = cap
        self._kv_cache = (self.kv_version, now, until, caps)
        return caps

    def refused(self, route: Route, now: float, retry_after_s: float | None) -> None:
        """An overload refusal (429, or 503 before any byte): the picker counts the hold
        (EndpointState.refused) as queue there, so a refusing engine stops looking idle."""
        self._by_url[route.url].refused(now, retry_after_s)

    def held_s(self, url: str, now: float) -> float:
        """Seconds left of `url`'s refusal hold (0: none)."""
        s = self._by_url.get(url)
        return 0.0 if s is None else max(0.0, s.refused_until - now)

    def set_flags(
        self,
        url: str,
        *,
        breaker_open: bool,
        ejected_until: float | None,
        ramp: float = 1.0,
        now: float,
    ) -> bool:
        s = self._by_url.get(url)
        if s is None:
            return False
        _check_ramp(ramp)
        s.set_flags(
            breaker_open=breaker_open,
            outlier_ejected_until=float("-inf") if ejected_until is None else ejected_until,
            ramp=ramp,
        )
        return True

    # -- control plane ------------------------------------------------------------------

    def report(self, url: str, state: ReportedState | None, now: float, *, ttl_s: float) -> bool:
        """An engine's report (None: gone) for `url`'s endpoint, from the control feed.

        The reference for its common path's compiled twin (xds/_feed_c.pyx's
        _picker_common, which meshd/control_feed.py's loop takes for an exact PickerRouter
        when built): a known url, a report not the held one's object, the held one fresh,
        the same TTL and the same KV block size and capacity (ints or None) -> only
        s.report(state, now). A change here must be made there too
        (tests/test_pool_router_report_c.py compares the two)."""
        s = self._by_url.get(url)
        if s is None:
            return False
        before = s.reported
        if (
            state is before
            and state is not None
            and ttl_s == s.report_ttl_s
            and s.reported_at <= now
            and now - s.reported_at < ttl_s
        ):
            # The report it holds, renewed while fresh (the control feed's refresh each
            # second, an engine's unchanged state pushed again): only its freshness moves.
            # The picker's view of the endpoint stays as it is, nothing in it changed but
            # its deadline (the old staleness), which is rebuilt at the latest when that
            # passes; a report stored anew would send every endpoint's view (and the
            # kv_capacities answer) to be rebuilt once a second.
            s.reported_at = now
            return True
        if state is None or before is None:
            changed = state is not before
        else:
            changed = (
                now - s.reported_at >= s.report_ttl_s
                or before.kv_block_size != state.kv_block_size
                or before.kv_capacity_blocks != state.kv_capacity_blocks
            )
        if changed:
            # Gone, fresh again after going stale, or another capacity: kv_capacities
            # looks again (a report renewed with the same capacity keeps its answer).
            self.kv_version += 1
        if s.report_ttl_s != ttl_s:
            s.report_ttl_s = ttl_s
            self.kv_version += 1
        if state is None:
            s.forget_report()
        else:
            s.report(state, now)
        return True

    def engine_hits(self, url: str, queries: float, hits: float, now: float) -> float | None:
        """The engine's prefix-cache counters over its last scrape window (Picker.
        observe_engine_hits): the index's hit-rate error when a verdict was due, else None."""
        s = self._by_url.get(url)
        return None if s is None else self.picker.observe_engine_hits(s.name, queries, hits, now)

    def apply_digest(self, url: str, digest: BlockDigest | None, now: float) -> bool:
        s = self._by_url.get(url)
        if s is None:
            return False
        index = self.picker.index
        if digest is None:
            blocks = self._digests.pop(s.name, None)
            if blocks is not None and s.name in self._digest_live:
                index.remove(s.name, blocks.blocks, now)
            self._digest_live.discard(s.name)
            return True
        blocks = self._digests.setdefault(s.name, ReportedBlocks())
        epoch = blocks.epoch
        gone = blocks.apply(digest, now)
        if gone is None:
            return False
        if epoch is not None and epoch != digest.epoch:
            index.clear(s.name)  # a restarted engine holds nothing of the old epoch
        elif gone and s.name in self._digest_live:
            index.remove(s.name, gone, now)
        return True

    def _materialize(self, hashes: Sequence[int], now: float) -> None:
        """Give each engine, as precise entries, the leading blocks of this request that its
        digest holds (a digest is a set: the chain comes from the request). A digest whose
        engine report went stale (the control plane lost) is taken back out of the index
        until the report is fresh again: it may have been evicted since."""
        index = self.picker.index
        live = self._digest_live
        for s in self.states:
            blocks = self._digests.get(s.name)
            if blocks is None:
                continue
            if s.fresh_report(now) is None:
                if s.name in live:
                    live.discard(s.name)
                    index.remove(s.name, blocks.blocks, now)
                continue
            live.add(s.name)
            if hashes:
                k = blocks.prefix_blocks(hashes)
                if k:
                    index.store(s.name, hashes[:k], now)

    def pool_wait(self, now: float, stop_below: float = -math.inf) -> float | None:
        """The least predicted queueing delay over the pool's eligible endpoints
        (Picker.pool_wait): how far past its knee the pool is; the scan ends at the first
        endpoint under `stop_below`."""
        return self.picker.pool_wait(self.states, now, stop_below)

    def follow_up(self, req: PickRequest, now: float) -> bool:
        """Whether `req` continues a task under way (Picker.follow_up)."""
        return self.picker.follow_up(req, now)

    def snapshot(self, now: float) -> list[dict[str, object]]:
        return [
            {
                "url": s.url,
                "gpu": s.gpu_name(now),
                "healthy": s.ineligible_reason(now) is None,
                "ineligible_reason": s.ineligible_reason(now),
                "outstanding": s.outstanding,
                "tokens_in_flight": s.tokens_in_flight,
                "failures": s.failures,
                "consecutive_failures": s.consecutive_failures,
                "ramp": s.ramp,
                "ttft_calibration": round(s.ttft_ratio, 3),
                "decode_calibration": round(s.decode_ratio, 3),
                "kv_capacity_tokens": s.kv_capacity(now),
                "cached_blocks": self.picker.index.used_blocks(s.name),
                "index_capacity_scale": round(self.picker.index_capacity_scale(s.name), 3),
                "index_hit_error": _round(self.picker.hit_error.get(s.name)),
                "digest_blocks": len(d.blocks) if (d := self._digests.get(s.name)) else None,
                "reported": _report_view(s.reported, s.reported_at, s.report_ttl_s, now),
                "last_error": self._last_error.get(s.url),
            }
            for s in self.states
        ]


def make_router(
    policy: Policy,
    endpoints: Sequence[EndpointSpec],
    *,
    unhealthy_after: int = 3,
    cooldown_s: float = 10.0,
    picker: PickerConfig | None = None,
) -> PoolRouter:
    if policy == "meshd":
        return PickerRouter(endpoints, picker)
    if policy == "cache-aware":
        return CacheAwareRouter(endpoints, unhealthy_after=unhealthy_after, cooldown_s=cooldown_s)
    return BalancerRouter(endpoints, policy, unhealthy_after=unhealthy_after, cooldown_s=cooldown_s)
