"""`--virtual-clock`: the benchmark as a discrete-event simulation, no sockets, no sleeps.

The same pass as runner.py (fleet, router, load; results.json and report.md), with time
simulated: the workload's arrivals and think times, the routers' `now` and every engine
step are events on one clock, so a 1,000-engine fleet or an hour of traffic costs only
the work it simulates. What runs is the code of a real run, called in-process:

- engines: loadtest.engine.virtual.VirtualFleet, the same EngineReplica (request parsing,
  EngineCore's step model, faults) that the HTTP simulator serves;
- router: filters.pool_router.make_router built from the sidecar config a real pass
  gets (policies.sidecar_config -> meshd.config.Config), driven as meshd/sidecar.py
  drives it: parse_inference_request, parse_routing_headers, block_hashes,
  PickRequest.build, then order / started / connect_failed / first_token / finished;
- load: the bench client's bodies and headers (client.request_body), its chains
  (render, think_s after completion, task deadlines), duration cap, drain, timeout and
  concurrency cap; outcomes are client.RequestOutcome and results.summarize makes the
  PolicyResult.

- the engine probe (meshd's policy, `routing.engine_metrics` on): each engine's /metrics
  page (EngineReplica.metrics_text) read every interval by filters/engine_probe.py's
  ProbeState and reported to the router, as meshd/engine_probe.py does live, so the picker
  learns each engine's KV capacity and usage (a pass without it routed on a guessed
  capacity: docs/routing-matrix.md, session 22).
- admission (meshd's policies): the sidecar's filters/admission.py, built from its config
  with the router's pool_wait, driven as the sidecar drives it: offer at arrival, queued
  requests dispatched on each release and on the reaper's 0.25 s tick, refused ones
  answered 429, a queued request's wait bounded by queue_timeout_s and its deadline, each
  successful step recorded for its task. The peers' rules run without it. A request
  with a deadline whose best route is predicted to end after it is answered 429 before
  any attempt, as Attempts._late does (filters/deadline.py).

Left out, so a real run differs by them: the network and the sidecar's own time (3-7 ms
per request here, tests/test_virtual_agreement.py), the rest of the sidecar's PoolGuard
(breaker, outlier ejection, slow start, throttling, and the flags it hands the router; at
default limits it changes nothing below 128 pending per endpoint), its retry budget and
mid-stream failover (a connect failure moves on to the next route, up to
upstream.max_attempts; an HTTP error or a reset ends the request), and the peers (Envoy,
sglang-router, vllm-router are other processes: skipped).

    python -m loadtest.bench.virtual --engines 100 --workload azure-conv \
        --policies round-robin,meshd --concurrency 100000 --no-plots
    python -m loadtest.bench.virtual scale [--quick]     # the wall-time table
"""

from __future__ import annotations

import argparse
import heapq
import ipaddress
import itertools
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from filters.admission import Admission, AdmissionItem, Queue, Reject
from filters.chars_per_token import CharsPerToken, pick_inputs, utf8_length
from filters.deadline import late_refusal
from filters.engine_probe import ProbeState
from filters.hotpath import block_hashes, parse_routing_headers
from filters.picker import PickRequest
from filters.pool_router import PoolRouter, Route, admission_item
from filters.request import parse_inference_request
from loadtest.bench.client import (
    CANCELLED,
    CONNECT,
    DEFAULT_MODEL,
    EMPTY,
    HTTP_PREFIX,
    TIMEOUT,
    TRUNCATED,
    ClientSettings,
    RequestOutcome,
    plan_starts,
    progress_bar,
    request_body,
    request_headers,
    task_key,
)
from loadtest.bench.fleet import FleetSpec
from loadtest.bench.fleet import engine_specs as fleet_engine_specs
from loadtest.bench.floor import ttft_floor
from loadtest.bench.policies import MESHD_BEST_POLICY, POLICIES, sidecar_config
from loadtest.bench.report import BenchReport, write_report
from loadtest.bench.results import PolicyResult, engine_results, skipped, summarize
from loadtest.bench.scrape import PREFIX_HITS, PREFIX_QUERIES, QueueSample
from loadtest.engine.config import EngineSpec
from loadtest.engine.core import SimRequest
from loadtest.engine.virtual import CONNECT_REFUSED, Accepted, VirtualEngine, VirtualFleet
from loadtest.workloads import Message, PlannedRequest, describe, render

# Bench policy name -> the sidecar's routing.policy it runs (peers are other processes).
VIRTUAL_POLICIES: dict[str, str] = {
    "round-robin": "round-robin",
    "least-request": "least-request",
    "meshd": MESHD_BEST_POLICY,
    "meshd-no-gpu": MESHD_BEST_POLICY,
    # sglang-router's and vllm-router's cache_aware rule, in-process (filters/cache_aware.py)
    "cache-aware": "cache-aware",
}
# At most this many queue samples per pass: 1,000 engines x 3 series each is memory.
MAX_SAMPLES = 600
# The sidecar reaper's period (meshd/sidecar.py _REAPER_PERIOD_S): admission expiry and pump.
ADMISSION_TICK_S = 0.25
# Where virtual engines "listen": a URL the sidecar config accepts, naming the engine.
VIRTUAL_PORT = 8000

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(f"[virtual] {message}", file=sys.stderr, flush=True)


def engine_specs(fleet: FleetSpec) -> list[EngineSpec]:
    """The EngineSpecs a real pass's fleet child starts for `fleet` (bench/fleet.py), at
    time scale 1: simulated seconds are the virtual clock's seconds."""
    return fleet_engine_specs(replace(fleet, time_scale=1.0))


def kv_capacity_tokens(engine: VirtualEngine) -> int:
    """The engine's KV cache in tokens (what a pass started on the fleet configures)."""
    profile = engine.replica.profile
    return profile.kv_blocks * profile.block_size


def engine_url(engine: VirtualEngine) -> str:
    return f"http://{engine.name}:{VIRTUAL_PORT}"


@dataclass(slots=True)
class SidecarModel:
    """What a sidecar pass would run, built from its config as meshd/sidecar.py does."""

    router: PoolRouter
    policy: str
    block_size_bytes: int
    cache_salt: str
    trusted: bool
    max_attempts: int
    # routing.learn_chars_per_token: the sidecar's learner, fed by each answer's usage.
    chars_per_token: CharsPerToken | None = None
    # reliability.admission, for meshd's policies (None: the peers', or disabled).
    admission: Admission | None = None
    queue_timeout_s: float = 30.0
    # reliability.admission.refuse_predicted_late, for meshd's policy (filters/deadline.py).
    refuse_late: bool = False
    # routing.engine_metrics (interval_s, max_backoff_s) where the sidecar would read each
    # engine's /metrics (meshd's policy, no control plane: meshd/engine_probe.py); else None.
    probe: tuple[float, float] | None = None
    # What each answer tells the sidecar (USAGE_MODES): "full", usage with the cached
    # tokens (this bench's client asks for usage, the simulator details it); "tokens", no
    # cached tokens (a real vLLM without --enable-prompt-tokens-details); "none", no usage
    # at all (a streaming client that did not ask for stream_options.include_usage: the
    # sidecar counts the stream's token events).
    usage: str = "full"


USAGE_MODES = ("full", "tokens", "none")


def sidecar_model(
    urls: Sequence[str],
    policy: str,
    gpus: Sequence[str] | None = None,
    kv_capacity_tokens: Sequence[int] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> SidecarModel:
    """The router of `routing.policy: policy` over `urls` (Sidecar.__init__'s recipe);
    `gpus` (and `kv_capacity_tokens`): each endpoint's GPU (and KV capacity) in the config,
    as a pass started on the fleet has them. `overrides`: config sections merged over the
    default (e.g. {"reliability": {"admission": {"knee_wait_s": None}}}), and under the
    key "picker_config" PickerConfig fields the config does not expose (an ablation)."""
    from meshd.config import Config, deep_merge
    from meshd.sidecar import build_routers, guard_config

    doc = sidecar_config(urls, policy)
    if gpus is not None:
        endpoints: list[dict[str, object]] = [
            {"url": u, "gpu": g} for u, g in zip(urls, gpus, strict=True)
        ]
        if kv_capacity_tokens is not None:
            for ep, kv in zip(endpoints, kv_capacity_tokens, strict=True):
                ep["kv_capacity_tokens"] = kv
        doc["pools"] = [{"name": "default", "endpoints": endpoints}]
    extra = dict(overrides or {})
    picker_overrides = extra.pop("picker_config", None)
    usage = extra.pop("usage", "full")
    if usage not in USAGE_MODES:
        raise ValueError(f"usage must be one of {', '.join(USAGE_MODES)}, not {usage!r}")
    doc = deep_merge(doc, extra)
    config = Config.model_validate(doc)
    routing = config.routing
    (router,) = build_routers(config, picker_overrides).values()
    loopback = ipaddress.ip_address("127.0.0.1")  # the bench client's address
    adm_config = guard_config(config, len(urls)).admission
    admission = None
    if adm_config is not None and routing.policy == "meshd":
        admission = Admission(adm_config, wait_source=router.pool_wait)
    adm = config.reliability.admission
    # Sidecar.start's rule: the engines' /metrics are read for meshd's policy when no control
    # plane reports them (a virtual pass never has one).
    metrics = routing.engine_metrics
    probing = (
        metrics.enabled and routing.policy == "meshd" and not config.control_plane.shard_list()
    )
    return SidecarModel(
        router=router,
        policy=routing.policy,
        block_size_bytes=routing.block_size_bytes,
        cache_salt=routing.cache_salt,
        trusted=any(loopback in net for net in config.trust.networks()),
        max_attempts=config.upstream.max_attempts,
        chars_per_token=CharsPerToken() if routing.learn_chars_per_token else None,
        admission=admission,
        queue_timeout_s=adm.queue_timeout_s,
        refuse_late=routing.policy == "meshd" and adm.enabled and adm.refuse_predicted_late,
        probe=(metrics.interval_s, metrics.max_backoff_s) if probing else None,
        usage=usage,
    )


# ---- one request in flight -------------------------------------------------------------

Done = Callable[["_Flight", RequestOutcome, str], None]


class _Flight:
    """One request the client sends: its measurements, and the router's attempt."""

    __slots__ = (
        "deadline_ms",
        "done",
        "driver",
        "engine",
        "first_at",
        "gaps",
        "item",
        "keep_text",
        "last_at",
        "on_done",
        "pick",
        "planned",
        "prompt",
        "queued_at",
        "req",
        "rid",
        "route",
        "seen",
        "sent",
        "started",
    )

    def __init__(
        self,
        driver: VirtualPass,
        planned: PlannedRequest,
        sent: str | tuple[Message, ...],
        deadline_ms: int | None,
        keep_text: bool,
        queued_at: float,
        on_done: Done,
    ) -> None:
        self.driver = driver
        self.planned = planned
        self.sent = sent
        self.deadline_ms = deadline_ms
        self.keep_text = keep_text
        self.queued_at = queued_at
        self.on_done = on_done
        self.started: float | None = None
        self.pick: PickRequest | None = None
        self.prompt: tuple[str, str] | None = None  # (model, prompt text) for the learner
        self.route: Route | None = None
        self.rid = 0
        self.engine: VirtualEngine | None = None
        self.req: SimRequest | None = None
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.seen = 0
        self.gaps: list[float] = []
        self.done = False
        self.item: AdmissionItem | None = None  # admitted or queued: released once

    # loadtest.engine.virtual.Stream
    def on_tokens(self, engine: VirtualEngine, req: SimRequest, now: float) -> None:
        self._tokens(req.num_output_tokens, now)
        if req.finished:
            self.driver.finish_ok(self, req, now)

    def on_reset(self, engine: VirtualEngine, req: SimRequest, delivered: int, now: float) -> None:
        self._tokens(delivered, now)
        self.driver.finish_error(self, TRUNCATED, 200, "the connection was reset", now)

    def _tokens(self, n: int, now: float) -> None:
        if n <= self.seen:
            return
        if self.first_at is None:
            self.first_at = now
            self.driver.first_token(self, now)
        elif self.last_at is not None:
            self.gaps.append(now - self.last_at)
        if n > self.seen + 1:
            # Tokens of one step reach the client in one chunk: zero gaps between them.
            self.gaps.extend([0.0] * (n - self.seen - 1))
        self.last_at = now
        self.seen = n


@dataclass(frozen=True, slots=True)
class VirtualRun:
    """What one pass saw (the client's LoadRun, plus queue samples) and what it cost."""

    outcomes: tuple[RequestOutcome, ...]
    not_sent: tuple[str, ...]
    sim_s: float
    wall_s: float
    samples: tuple[QueueSample, ...]
    steps: int
    # request id -> output text, for passes run with capture_text (tests compare them).
    texts: dict[str, str]


class VirtualPass:
    """One policy over one fleet on a virtual clock; `run(requests)` once per instance."""

    def __init__(
        self,
        fleet: VirtualFleet,
        sidecar: SidecarModel,
        settings: ClientSettings,
        *,
        sample_period_s: float = 1.0,
        capture_text: bool = False,
    ) -> None:
        self.fleet = fleet
        self.capture_text = capture_text
        self._texts: dict[str, str] = {}
        self.sidecar = sidecar
        self.settings = settings
        model = settings.model
        self.model = fleet[0].replica.spec.model if model == DEFAULT_MODEL else model
        self._by_url = {engine_url(e): e for e in fleet}
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self._rids = itertools.count()
        self._outcomes: list[RequestOutcome] = []
        self._not_sent: list[str] = []
        self._live: set[_Flight] = set()
        self._waiting: deque[_Flight] = deque()
        self._open = 0  # singles and chains not finished yet
        # Chains between steps (thinking): id(chain) -> the steps not sent yet.
        self._thinking: dict[int, list[PlannedRequest]] = {}
        self._samples: list[QueueSample] = []
        self._sample_period = sample_period_s
        self._progress: Any = None
        self._stopped = False
        self.now = 0.0
        # Admission (meshd's policies): queued flights by item id, the reaper's tick.
        self._items = itertools.count()
        self._held: dict[Hashable, _Flight] = {}
        self._ticking = False
        self._pumping = False

    def _at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    # ---- the event loop ------------------------------------------------------------
    def run(self, requests: Sequence[PlannedRequest]) -> VirtualRun:
        wall0 = time.perf_counter()
        starts, orphans = plan_starts(requests)
        self._not_sent.extend(orphans)
        horizon = 0.0
        for item in starts:
            first = item[0] if isinstance(item, list) else item
            if not self._may_send(first.at_s):
                self._not_sent.extend(r.request_id for r in _items(item))
                continue
            self._open += 1
            horizon = max(horizon, first.at_s)
            self._at(first.at_s, self._starter(item))
        cap = self.settings.duration_s
        if cap is not None:
            self._at(cap + self.settings.drain_s, self._stop)
        if horizon / self._sample_period > MAX_SAMPLES:
            self._sample_period = horizon / MAX_SAMPLES
        self._at(0.0, self._sample)
        self._start_probes()
        self._progress = progress_bar(
            len(requests) - len(self._not_sent), self.settings, "requests (virtual clock)"
        )
        fleet = self.fleet
        heap = self._heap
        try:
            while not self._stopped and (self._open > 0 or self._live):
                te = fleet.next_event_time()
                if te is not None and (not heap or te <= heap[0][0]):
                    self.now = max(self.now, te)
                    fleet.run_next()
                elif heap:
                    t, _, fn = heapq.heappop(heap)
                    self.now = max(self.now, t)
                    fn(self.now)
                else:
                    break
            if self._stopped:
                # Past the drain budget: what still runs is cancelled, as the client does.
                for flight in sorted(self._live | set(self._waiting), key=_sent_order):
                    if flight.engine is not None and flight.req is not None:
                        flight.engine.abort(flight.req, self.now)
                    self.finish_error(
                        flight,
                        CANCELLED,
                        200 if flight.req is not None else 0,
                        "still running when the run's time ran out",
                        self.now,
                    )
                for rest in self._thinking.values():
                    self._skip(rest)  # cancelled while thinking: never sent
                self._thinking.clear()
        finally:
            if self._progress is not None:
                self._progress.close()
        return VirtualRun(
            tuple(self._outcomes),
            tuple(self._not_sent),
            self.now,
            time.perf_counter() - wall0,
            tuple(self._samples),
            fleet.steps,
            self._texts,
        )

    def _starter(self, item: PlannedRequest | list[PlannedRequest]) -> Callable[[float], None]:
        if isinstance(item, list):
            return lambda t: self._chain_step(item, 0, t, None, "", t)
        return lambda t: self._send_single(item, t)

    def _stop(self, now: float) -> None:
        self._stopped = True

    def _sample(self, now: float) -> None:
        engines = self.fleet.engines
        self._samples.append(
            QueueSample(
                t_s=now,
                waiting=tuple(float(e.core.num_waiting) for e in engines),
                running=tuple(float(e.core.num_running) for e in engines),
                kv_usage=tuple(e.core.kv_usage() for e in engines),
            )
        )
        if self._progress is not None:
            self._progress.set_postfix_str(f"simulated {now:,.0f} s", refresh=False)
        if self._open > 0 or self._live:
            self._at(now + self._sample_period, self._sample)

    # ---- the sidecar's engine probes ---------------------------------------------------
    def _start_probes(self) -> None:
        """meshd/engine_probe.py on the virtual clock: each engine's /metrics page read every
        interval (the first reads spread over min(0.5, interval) s, seeded), parsed by the
        same ProbeState and reported to the router with its TTL, so the picker learns each
        engine's KV capacity and usage as a live sidecar does, and checks its prefix index
        against the engine's prefix-cache counters."""
        if self.sidecar.probe is None:
            return
        interval, backoff = self.sidecar.probe
        rng = random.Random(0)
        for url, engine in self._by_url.items():
            state = ProbeState(url, interval_s=interval, max_backoff_s=backoff)
            self._at(rng.uniform(0.0, min(0.5, interval)), self._prober(url, engine, state))

    def _prober(
        self, url: str, engine: VirtualEngine, state: ProbeState
    ) -> Callable[[float], None]:
        def scrape(now: float) -> None:
            rep = engine.replica
            # A loading engine that refuses connections answers no page either.
            down = rep.faults.refusing(now)
            text = None if down else rep.metrics_text(now)
            result = state.observed(text, now, error="connection refused" if down else None)
            if result.state is not None:
                self.sidecar.router.report(url, result.state, now, ttl_s=state.ttl_s())
            if result.prefix_window is not None:
                self.sidecar.router.engine_hits(url, *result.prefix_window, now)
            if self._open > 0 or self._live:
                self._at(now + result.next_in_s, scrape)

        return scrape

    # ---- the client ------------------------------------------------------------------
    def _may_send(self, at_s: float) -> bool:
        cap = self.settings.duration_s
        return cap is None or at_s <= cap

    def _send_single(self, r: PlannedRequest, now: float) -> None:
        def done(flight: _Flight, outcome: RequestOutcome, text: str) -> None:
            self._record(outcome)
            self._open -= 1

        self._queue(_Flight(self, r, render(r), r.deadline_ms, False, now, done))

    def _chain_step(
        self,
        chain: list[PlannedRequest],
        i: int,
        now: float,
        previous_sent: str | tuple[Message, ...] | None,
        previous_answer: str,
        task_started: float,
    ) -> None:
        """Step i of a chain, sent think_s after step i-1 completed (client._steps)."""
        r = chain[i]
        self._thinking.pop(id(chain), None)
        if i > 0 and not self._may_send(now):
            self._skip(chain[i:])
            self._open -= 1
            return
        sent = render(r, previous_sent, previous_answer) if i > 0 else render(r)
        deadline = r.deadline_ms
        if r.task_deadline_ms is not None:
            left = max(1, round(r.task_deadline_ms - (now - task_started) * 1000))
            deadline = left if deadline is None else min(deadline, left)

        def done(flight: _Flight, outcome: RequestOutcome, text: str) -> None:
            self._record(outcome)
            if not outcome.ok or i + 1 >= len(chain):
                self._skip(chain[i + 1 :])
                self._open -= 1
                return
            self._thinking[id(chain)] = chain[i + 1 :]
            self._at(
                self.now + chain[i + 1].think_s,
                lambda t: self._chain_step(chain, i + 1, t, sent, text, task_started),
            )

        self._queue(_Flight(self, r, sent, deadline, i + 1 < len(chain), now, done))

    def _skip(self, requests: Sequence[PlannedRequest]) -> None:
        for r in requests:
            self._not_sent.append(r.request_id)
        if self._progress is not None and requests:
            self._progress.update(len(requests))

    def _record(self, outcome: RequestOutcome) -> None:
        self._outcomes.append(outcome)
        if self._progress is not None:
            self._progress.update(1)

    def _queue(self, flight: _Flight) -> None:
        if len(self._live) < self.settings.max_concurrency:
            self._start(flight, self.now)
        else:
            self._waiting.append(flight)

    # ---- the sidecar -----------------------------------------------------------------
    def _start(self, flight: _Flight, now: float) -> None:
        """What meshd/sidecar.py does with a request: parse, pick, try routes in order."""
        self._live.add(flight)
        flight.started = now
        r = flight.planned
        sc = self.sidecar
        body = request_body(r, flight.sent, self.model, self.settings.ignore_eos)
        inference = parse_inference_request(r.kind, body)
        routing, _ = parse_routing_headers(
            list(request_headers(r, flight.deadline_ms, self.settings.context_headers).items()),
            sc.trusted,
        )
        hashes: Sequence[int] = ()
        if sc.policy in ("meshd", "cache-aware"):  # the prefix-aware policies
            hashes = block_hashes(
                inference.prompt_text, inference.model, sc.cache_salt, sc.block_size_bytes
            )
        # Text blocks, as the sidecar's own (no precise path here).
        cpt, tpb = pick_inputs(sc.chars_per_token, inference.model, sc.block_size_bytes, None)
        pick = PickRequest.build(
            inference, routing, now, block_hashes=hashes, tokens_per_block=tpb, chars_per_token=cpt
        )
        flight.pick = pick
        flight.prompt = (inference.model, inference.prompt_text)
        adm = sc.admission
        if adm is not None:
            # The sidecar's _admit (expected tokens: no breaker here to learn them).
            tokens = pick.prompt_tokens + pick.max_tokens
            item = admission_item(next(self._items), sc.router, pick, routing.step, tokens, now)
            flight.item = item
            decision = adm.offer(item, now)
            if isinstance(decision, Reject):
                self._too_many(flight, decision.message, now)
                return
            if isinstance(decision, Queue):
                self._held[item.id] = flight
                limit = sc.queue_timeout_s
                if pick.deadline_s is not None:
                    limit = min(limit, pick.deadline_s - now)
                self._at(now + max(0.0, limit), lambda t: self._queue_timeout(flight, t))
                self._tick_later(now)
                return
        self._route(flight, now, body)

    def _route(self, flight: _Flight, now: float, body: bytes | None = None) -> None:
        """The sidecar's attempts: pick, then try the routes in order."""
        r = flight.planned
        sc = self.sidecar
        pick = flight.pick
        assert pick is not None
        if body is None:
            body = request_body(r, flight.sent, self.model, self.settings.ignore_eos)
        router = sc.router
        why = "no endpoint"
        routes = router.order(pick, now)
        if sc.refuse_late and routes:
            # The sidecar's Attempts._late: a new task's request predicted late is refused
            # before any attempt.
            started = flight.item is not None and flight.item.started
            late = late_refusal(router, routes[0], pick, now, "default", started=started)
            if late is not None:
                self.finish_error(flight, f"{HTTP_PREFIX}429", 429, late, now)
                return
        for route in routes[: sc.max_attempts]:
            rid = next(self._rids)
            router.started(route, rid, pick, now)
            engine = self._by_url[route.url]
            result = engine.submit(r.kind, body, r.request_id, now, flight)
            flight.route, flight.rid = route, rid
            if isinstance(result, Accepted):
                flight.engine, flight.req = engine, result.req
                self._at(now + self.settings.timeout_s, lambda t: self._timeout(flight, t))
                return
            if result.status == CONNECT_REFUSED:
                router.connect_failed(route, rid, now, result.message)
                flight.route = None
                why = result.message
                continue
            self.finish_error(
                flight, f"{HTTP_PREFIX}{result.status}", result.status, result.message, now
            )
            return
        self.finish_error(flight, CONNECT, 0, why, now)

    # ---- the sidecar's admission queue ----------------------------------------------------
    def _pump(self, now: float) -> None:
        """Queued requests that may go now, and refused ones (the sidecar's _apply_guard)."""
        adm = self.sidecar.admission
        if adm is None or self._pumping:
            return
        self._pumping = True
        try:
            while True:
                item = adm.next(now)
                self._refuse(adm.take_rejected(), now)
                if item is None:
                    break
                f = self._held.pop(item.id, None)
                if f is None or f.done:
                    adm.release(item.id, now)
                else:
                    self._route(f, now)
                    adm.routed(item.id)
        finally:
            self._pumping = False

    def _tick_later(self, now: float) -> None:
        if not self._ticking:
            self._ticking = True
            self._at(now + ADMISSION_TICK_S, self._tick)

    def _tick(self, now: float) -> None:
        """The sidecar's reaper: expire late or long-held requests, then pump."""
        self._ticking = False
        adm = self.sidecar.admission
        if adm is None:
            return
        self._refuse(adm.expire(now), now)
        self._pump(now)
        if self._held:
            self._tick_later(now)

    def _refuse(self, refusals: Sequence[Reject], now: float) -> None:
        """Answer each queued request admission refused: 429, its reason."""
        for refused in refusals:
            f = self._held.pop(refused.item.id, None)
            if f is not None:
                self._too_many(f, refused.message, now)

    def _too_many(self, flight: _Flight, message: str, now: float) -> None:
        """The sidecar's 429 for a request admission did not take (nothing to release)."""
        flight.item = None
        self.finish_error(flight, f"{HTTP_PREFIX}429", 429, message, now)

    def _queue_timeout(self, flight: _Flight, now: float) -> None:
        """The sidecar's _wait_turn gave up: still queued past queue_timeout_s or the
        deadline."""
        adm = self.sidecar.admission
        if flight.done or adm is None or flight.item is None:
            return
        if self._held.pop(flight.item.id, None) is None:
            return  # dispatched
        adm.cancel(flight.item.id)
        self._too_many(flight, "queued past its deadline or queue_timeout_s", now)

    def _timeout(self, flight: _Flight, now: float) -> None:
        if flight.done:
            return
        if flight.engine is not None and flight.req is not None:
            flight.engine.abort(flight.req, now)
        limit = self.settings.timeout_s
        self.finish_error(flight, TIMEOUT, 200, f"no complete answer within {limit:g} s", now)

    def first_token(self, flight: _Flight, now: float) -> None:
        if flight.route is not None:
            self.sidecar.router.first_token(flight.route, flight.rid, now)

    def finish_ok(self, flight: _Flight, req: SimRequest, now: float) -> None:
        if flight.done:
            return
        n = req.num_output_tokens
        error = None if n > 0 else EMPTY
        learnt = self.sidecar.chars_per_token
        usage = self.sidecar.usage
        if learnt is not None and error is None and flight.prompt is not None and usage != "none":
            model, text = flight.prompt
            learnt.observe(model, len(text), utf8_length(text), req.num_prompt_tokens)
        cached = req.cached_tokens if usage == "full" else None
        self._settle(flight, now, ok=error is None, cached=cached, out=n)
        outcome = self._outcome(
            flight,
            now,
            error,
            200,
            "" if error is None else "the stream carried no token",
            n,
            req.num_prompt_tokens,
            req.cached_tokens,
        )
        text = req.output_text() if flight.keep_text or self.capture_text else ""
        if self.capture_text:
            self._texts[flight.planned.request_id] = text
        flight.on_done(flight, outcome, text)

    def finish_error(
        self, flight: _Flight, error: str, status: int, detail: str, now: float
    ) -> None:
        if flight.done:
            return
        self._settle(flight, now, ok=False, cached=None, out=None)
        outcome = self._outcome(flight, now, error, status, detail, flight.seen, None, None)
        flight.on_done(flight, outcome, "")

    def _settle(
        self, flight: _Flight, now: float, *, ok: bool, cached: int | None, out: int | None
    ) -> None:
        if flight.route is not None and flight.pick is not None:
            self.sidecar.router.finished(
                flight.route,
                flight.rid,
                flight.pick,
                now,
                ok=ok,
                cached_tokens=cached,
                completion_tokens=out,
            )
        adm = self.sidecar.admission
        item = flight.item
        if adm is not None and item is not None:
            flight.item = None
            if ok and item.task_id is not None:
                adm.record_step(item.task_id)
            if self._held.pop(item.id, None) is not None:
                adm.cancel(item.id)  # still queued (the run's end): never dispatched
            else:
                adm.release(item.id, now)
                self._at(now, self._pump)  # after this answer is recorded

    def _outcome(
        self,
        flight: _Flight,
        now: float,
        error: str | None,
        status: int,
        detail: str,
        output_tokens: int,
        prompt_tokens: int | None,
        cached_tokens: int | None,
    ) -> RequestOutcome:
        flight.done = True
        started = now if flight.started is None else flight.started
        if flight in self._live:
            self._live.discard(flight)
            while (
                self._waiting
                and not self._stopped
                and len(self._live) < self.settings.max_concurrency
            ):
                self._start(self._waiting.popleft(), now)
        r = flight.planned
        return RequestOutcome(
            request_id=r.request_id,
            workload=r.workload,
            tenant=r.tenant,
            task_key=task_key(r),
            step=r.step,
            planned_at_s=r.at_s,
            sent_at_s=started,
            queued_s=started - flight.queued_at,
            ok=error is None,
            error=error,
            status=status,
            ttft_s=None if flight.first_at is None else flight.first_at - started,
            e2e_s=now - started,
            output_tokens=output_tokens,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            detail=detail,
            itl_s=tuple(flight.gaps),
            endpoint="" if flight.route is None else flight.route.url,
        )


def _items(item: PlannedRequest | list[PlannedRequest]) -> list[PlannedRequest]:
    return item if isinstance(item, list) else [item]


def _sent_order(flight: _Flight) -> tuple[float, str]:
    return (flight.queued_at, flight.planned.request_id)


# ---- passes and the report ---------------------------------------------------------------


def run_virtual_policy(
    name: str,
    fleet_spec: FleetSpec,
    requests: Sequence[PlannedRequest],
    settings: ClientSettings,
    *,
    sample_period_s: float = 1.0,
    capture_text: bool = False,
    log: Log = _stderr,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[PolicyResult, VirtualRun | None]:
    """One pass of bench policy `name` on a fresh virtual fleet (cold caches);
    `overrides` as sidecar_model takes them (meshd's policies)."""
    policy = VIRTUAL_POLICIES.get(name)
    summary = POLICIES[name].summary if name in POLICIES else name
    if policy is None:
        reason = "a separate process; the virtual clock drives only meshd's own policies"
        log(f"{name}: skipped: {reason}")
        return skipped(name, summary, reason), None
    fleet = VirtualFleet(engine_specs(fleet_spec))
    # A policy started on the fleet (policies.FleetPolicySpec) has the GPUs in its config.
    on_fleet = getattr(POLICIES.get(name), "start_on_fleet", None) is not None
    gpus = [e.replica.profile.gpu for e in fleet] if on_fleet else None
    kv = [kv_capacity_tokens(e) for e in fleet] if on_fleet else None
    sidecar = sidecar_model([engine_url(e) for e in fleet], policy, gpus, kv, overrides)
    settings = replace(settings, progress_desc=settings.progress_desc or name)
    run = VirtualPass(
        fleet, sidecar, settings, sample_period_s=sample_period_s, capture_text=capture_text
    ).run(requests)
    log(
        f"{name}: {len(run.outcomes)} requests, {run.sim_s:.1f} simulated s "
        f"in {run.wall_s:.2f} wall s ({run.steps} engine steps)"
    )
    if sidecar.chars_per_token is not None and policy == "meshd":
        for model, r in sidecar.chars_per_token.snapshot().items():
            log(
                f"{name}: {model}: learnt {r['chars_per_token']} chars, {r['bytes_per_token']} "
                f"bytes per prompt token from {r['samples']} answers"
            )
    engines, basis = engine_results(
        [
            (e.name, engine_url(e), e.replica.profile.gpu, e.replica.profile.price_per_gpu_hour)
            for e in fleet
        ],
        [{} for _ in fleet],
        [
            {
                PREFIX_QUERIES: e.core.stats.prefix_cache_queries,
                PREFIX_HITS: e.core.stats.prefix_cache_hits,
            }
            for e in fleet
        ],
        [0.0 for _ in fleet],
        [e.core.busy_time_at(run.sim_s) for e in fleet],
        provisioned_s=run.sim_s,
    )
    result = summarize(
        name,
        f"{summary} [virtual clock]",
        requests,
        run.outcomes,
        len(run.not_sent),
        run.sim_s,
        engines,
        basis,
        run.samples,
    )
    return result, run


def run_virtual_bench(
    config: Any,
    requests: Sequence[PlannedRequest] | None = None,
    *,
    log: Log = _stderr,
) -> tuple[BenchReport, Path]:
    """runner.run_bench on a virtual clock: every policy of `config` (a BenchConfig) in
    turn, each on a fresh VirtualFleet; the same results.json and report.md."""
    from loadtest.bench.runner import build_workload, default_out_dir, gpu_summary

    if requests is None:
        requests = build_workload(config.workload, config.workload_args)
    out_dir = config.out_dir or default_out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    names = ", ".join(config.policies)
    log(f"workload {config.workload}: {len(requests)} requests; policies: {names}")
    results = []
    for name in dict.fromkeys(config.policies):
        result, _ = run_virtual_policy(
            name,
            config.fleet,
            requests,
            config.client,
            sample_period_s=config.sample_period_s,
            log=log,
        )
        results.append(result)
    n = len(config.fleet.gpus)
    fleet_doc = {
        **config.fleet.to_json(),
        "kind": "virtual",
        "engines": n,
        "gpu_summary": gpu_summary(config.fleet.gpus),
    }
    client_doc = asdict(config.client)
    client_doc.pop("progress", None)
    client_doc.pop("progress_desc", None)
    extra: dict[str, Any] = {}
    if "hit_bounds" in {f.name for f in fields(BenchReport)}:
        from loadtest.bench.runner import sent_hit_bound

        extra["hit_bounds"] = {r.policy: sent_hit_bound(requests, r) for r in results if r.ok}
    # The engines' own seconds: the virtual clock runs every fleet at time scale 1.
    floor = ttft_floor(requests, replace(config.fleet, kind="sim"), time_scale=1.0)
    if floor is not None:
        log(f"TTFT floor: p90 {floor.ttft.p90 * 1000:.1f} ms, computed in {floor.wall_s:.1f} s")
    report = BenchReport(
        title=f"{config.title} (virtual clock)",
        command=config.command,
        started_at=started,
        workload_name=config.workload,
        workload_args=dict(config.workload_args),
        workload=describe(requests, replicas=tuple(sorted({n, 4, 8, 16}))),
        fleet=fleet_doc,
        client=client_doc,
        results=tuple(results),
        baseline=config.baseline,
        notes=(
            *config.notes,
            "virtual clock: times are simulated seconds; no network or sidecar time, no "
            "PoolGuard (see loadtest/bench/virtual.py)",
        ),
        ttft_floor=floor,
        **extra,
    )
    return report, write_report(report, out_dir, plots=config.plots)


# ---- how fast the virtual clock runs ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScaleCase:
    """One row of the wall-time table: a fleet size, a policy and a trace replay."""

    engines: int
    policy: str = "round-robin"
    workload: str = "azure-conv"
    workload_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ScaleRow:
    case: ScaleCase
    sim_s: float
    requests: int
    succeeded: int
    wall_s: float
    cpu_s: float
    steps: int

    @property
    def speed(self) -> float:
        return self.sim_s / self.wall_s if self.wall_s > 0 else float("inf")


def default_scale_cases(quick: bool = False) -> list[ScaleCase]:
    """The Azure conversation trace (one production hour, 19,366 requests, 5.5 req/s):
    whole on 100 engines and on 1,000 (the same work on ten times the fleet: what fleet
    size alone costs), and replayed 10x faster on 1,000 engines (the 100-engine row's
    load per engine on ten times the fleet). --quick: the trace's first 2,000 requests."""
    cap: dict[str, Any] = {"cap": 2000} if quick else {}
    return [
        ScaleCase(100, "round-robin", "azure-conv", {**cap}),
        ScaleCase(100, "meshd", "azure-conv", {**cap}),
        ScaleCase(1000, "round-robin", "azure-conv", {**cap}),
        ScaleCase(1000, "round-robin", "azure-conv", {**cap, "time_scale": 10.0}),
        ScaleCase(1000, "meshd", "azure-conv", {**cap, "time_scale": 10.0}),
    ]


def measure_scale(
    cases: Sequence[ScaleCase],
    *,
    gpus: Sequence[str] = ("H100", "A100"),
    progress: bool = True,
    log: Log = _stderr,
) -> list[ScaleRow]:
    """Run each case on a fresh virtual fleet; wall time covers the pass (fleet built,
    workload sent, engines drained), not the trace's parsing."""
    from loadtest.bench.fleet import fleet_gpus
    from loadtest.bench.runner import build_workload

    rows = []
    settings = ClientSettings(timeout_s=900.0, max_concurrency=1 << 30, progress=progress)
    for case in cases:
        requests = build_workload(case.workload, case.workload_args)
        spec = FleetSpec(gpus=fleet_gpus(case.engines, list(gpus)))
        t0, c0 = time.perf_counter(), time.process_time()
        result, run = run_virtual_policy(
            case.policy,
            spec,
            requests,
            replace(settings, progress_desc=f"{case.engines} engines, {case.policy}"),
            log=log,
        )
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert run is not None
        rows.append(
            ScaleRow(case, run.sim_s, len(requests), result.succeeded, wall, cpu, run.steps)
        )
    return rows


def scale_table(rows: Sequence[ScaleRow]) -> str:
    header = (
        "| engines | policy | workload | simulated s | requests | ok | engine steps "
        "| wall s | CPU s | sim-s per wall-s |"
    )
    lines = [header, "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        args = ", ".join(f"{k}={v}" for k, v in r.case.workload_args.items())
        workload = r.case.workload + (f" ({args})" if args else "")
        lines.append(
            f"| {r.case.engines:,} | {r.case.policy} | {workload} | {r.sim_s:,.0f} "
            f"| {r.requests:,} | {r.succeeded:,} | {r.steps:,} | {r.wall_s:,.1f} "
            f"| {r.cpu_s:,.1f} | {r.speed:,.1f} |"
        )
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------


def _scale_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench.virtual scale",
        description="Wall time of virtual-clock passes at 100 and 1,000 engines.",
    )
    p.add_argument("--quick", action="store_true", help="the trace's first 2,000 requests")
    p.add_argument("--engines", help="comma-separated fleet sizes (default: 100,1000)")
    p.add_argument("--gpus", default="H100,A100", help="GPU generations, cycled")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    cases = default_scale_cases(args.quick)
    if args.engines:
        sizes = [int(x) for x in args.engines.split(",") if x.strip()]
        cases = [replace(c, engines=n) for n in sizes for c in cases[:2]]
    rows = measure_scale(
        cases, gpus=[g.strip() for g in args.gpus.split(",")], progress=not args.no_progress
    )
    print(scale_table(rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m loadtest.bench.virtual [meshd bench options]`, or `... scale [--quick]`."""
    from loadtest.bench.cli import add_bench_arguments, config_from_args, print_summary

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["scale"]:
        return _scale_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.virtual",
        description="meshd bench on a virtual clock: " + (__doc__ or "").splitlines()[0],
    )
    add_bench_arguments(parser)
    if "--virtual-clock" not in parser._option_string_actions:
        # What `meshd bench --virtual-clock` means; accepted here so one line works in both.
        parser.add_argument("--virtual-clock", action="store_true", help="always on here")
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args, argv)
    except ValueError as exc:
        print(f"virtual bench: {exc}", file=sys.stderr)
        return 2
    command = "python -m loadtest.bench.virtual " + " ".join(argv)
    config = replace(config, command=command.strip())
    try:
        report, path = run_virtual_bench(config)
    except ValueError as exc:
        print(f"virtual bench: {exc}", file=sys.stderr)
        return 2
    print_summary(report, path)
    return 0 if report.ran else 1


if __name__ == "__main__":
    sys.exit(main())
