"""Prefill/decode disaggregation at the sidecar's edge (issue #25; the protocol and the
decider are filters/disagg.py). A request for a pool of role `decode` first asks the
decider (`decide`), which orders the pool's prefill pool once, for the prefill leg alone
(the request with one output token: the picker's prefix hit and prefill TTFT/price), and
records nothing there until a step starts. When it splits, the prefill step runs on that
order (its guard and retry budget), then the decode pool is ordered once for the decode
leg (`order_decode`, Picker.order_decode: KV headroom, decode load and ITL; the transfer
in its predicted TTFT), and the request goes to the decode pool's attempts with the
prefill's `kv_transfer_params` in its body. When it does not split, or no prefill engine
answers, the decode pool is ordered as any pool and the request served whole there (its
engines can prefill too: vLLM's kv_both). Each pool is ordered once a request, so round
robin takes one turn a leg, and the prefix index notes the prompt only where a step or a
leg went.

Failures: a prefill step that fails is tried on the next prefill engine, within the prefill
pool's retry budget; then the request goes whole. A decode step refused before its first
byte is retried (attempts layer) and, when the refusal says the KV could not be fetched,
the retry is the whole request (a fresh prefill where it decodes). A decode that breaks
mid-stream is resumed like any stream (meshd's failover): the continuation carries no
transfer params. Both legs are attempts of the request: the trace, the access log and the
cost ledger see the prefill attempt (reason `prefill`) and the decode attempt, and the
prefill endpoint's guard counts its tokens in flight.

SGLang's protocol (`disaggregation.protocol: sglang`; the body is filters/disagg.py
`bootstrap_body`): every request is split (SGLang's decode engines serve nothing whole),
and no prefill step runs ahead: each try of the decode pool's attempts is a pair. Its
prefill leg (`open_leg`: the next prefill engine in the picker's order whose leg has not
failed for this request; its bootstrap port configured, else asked of the engine's
/server_info once and kept, else the pool's or 8998: `bootstrap_port`) and its decode leg
get the same body, with a fresh room, at once (`send_pair`); the decode engine's answer
goes to the client once its head came and the prefill leg ended well, as
sgl-model-gateway drains the prefill answer before it forwards the decode's; the prefill
answer is read and dropped. A prefill leg that fails before then fails the pair
(PrefillLegFailed): the decode engine is not blamed, and the pair is tried again, on
another prefill engine, within the decode pool's retry budget (and the prefill pool's, as
a prefill retry). A decode leg refused before its first byte is a
failed try as any: the next try is a new pair, a new room and a new prefill leg (the old
leg is dropped, so the prefill engine frees the KV). A stream that breaks mid-way resumes
as a pair too: the continuation goes to a prefill and a decode engine with a fresh room.
Each leg is an attempt, the prefill leg first (reason `prefill`), so the trace, the
access log and the cost ledger see both, and the prefill engine's guard counts it.

Behind an endpoint picker (Envoy's ext_proc: `meshd picker --prefill-endpoint`, or
llm-d's), this sidecar fronts a decode engine, and the picker has decided: a request from a
trusted peer that carries `x-gateway-destination-endpoint` (the picker's header, which
Envoy passes on) is split on the prefill engine(s) its prefill header names
(filters/disagg.py PREFILL_HEADERS; only endpoints of the prefill pool, in the order
named), or served whole when it names none (`_picker_named`); the decider is not asked.
The KV transfer is priced on what the decode engine lacks (its pool's prefix index).
Its answer tells a trusted peer what it did (`x-meshd-pd`, `served`: split on which
prefill engine, or whole and why), so the picker learns when it served whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgspec

from filters.disagg import (
    PREFILL_HEADERS,
    SGLANG_BOOTSTRAP_PORT,
    BootstrapPorts,
    PdServed,
    Split,
    aggregated_body,
    bootstrap_body,
    bootstrap_port_of,
    decide_split,
    decode_body,
    leg_answer,
    missing_tokens,
    named_prefill_endpoints,
    prefer_whole,
    prefill_body,
    price_decode_routes,
    transfer_params,
    transfer_seconds,
)
from filters.gpu import GpuTable
from filters.guard import OVERLOAD_STATUSES
from filters.pool_router import PickerRouter, cached_tokens
from meshd.context import Attempt, Plane, RequestContext
from meshd.http_message import Reply
from meshd.upstream import UpstreamConnectError, UpstreamError, UpstreamResponse

if TYPE_CHECKING:
    from filters.picker import PickRequest
    from filters.pool_router import Route
    from meshd.attempts import Attempts

log = logging.getLogger("meshd.disagg")

_encoder = msgspec.json.Encoder()
# An answer to the prefill step larger than this is not one (it is one token).
_MAX_PREFILL_ANSWER = 1 << 20
# SGLang's server info (ServerArgs as JSON; its disaggregation_bootstrap_port): /server_info
# since it was renamed, /get_server_info before (and still, as its deprecated alias).
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
# How long asking a prefill engine its bootstrap port may take (on its first pair's way).
BOOTSTRAP_ASK_TIMEOUT_S = 2.0


async def _read_prefill_answer(up: Any, url: str, what: str) -> bytes:
    """A prefill step's whole answer (at most _MAX_PREFILL_ANSWER bytes); the connection
    goes back to the pool once read, and is closed on any failure, a cancel included."""
    chunks = []
    size = 0
    try:
        while chunk := await up.read():
            chunks.append(chunk)
            size += len(chunk)
            if size > _MAX_PREFILL_ANSWER:
                raise UpstreamError(url, f"{what} is too large")
    except BaseException:
        up.close()
        raise
    up.release()
    return b"".join(chunks)


# The endpoint picker protocol's destination header (meshd/extproc_messages.py's; not
# imported from there, which loads Envoy's protobufs): Envoy passes it on to the endpoint,
# so its presence says an endpoint picker routed the request.
DESTINATION_HEADER = "x-gateway-destination-endpoint"


def host_port(url: str) -> str:
    """`host:port` of an endpoint URL, as the endpoint picker protocol names endpoints."""
    return url.split("://", 1)[-1].rstrip("/")


# The span attribute that names a pair's bootstrap room (SGLang logs it as bootstrap_room).
ATTR_BOOTSTRAP_ROOM = "meshd.pd.bootstrap_room"


class PrefillLegFailed(Exception):
    """A pair's prefill leg failed before its decode leg's answer went out: try both again."""


@dataclass(slots=True, eq=False)
class PairPlan:
    """A split request's prefill side: the prefill pool's routes (the picker's order,
    screened when it was decided), the prefill leg's pick (the request with one output
    token: a prefill engine is chosen by its prefill alone) and the routes whose step or
    leg failed. Under SGLang's protocol, ctx.pd_pair: the routes its pairs take."""

    source: str
    routes: list[Route]
    pick: PickRequest
    failed: set[str] = field(default_factory=set)


@dataclass(slots=True, eq=False)
class PrefillLeg:
    """One pair's prefill leg: its engine, attempt, the body both legs carry, its room."""

    route: Route
    attempt: Attempt
    body: bytes
    room: Any  # int, or a list of them for a batch
    task: asyncio.Task[str | None] | None = None  # its result: None, or why it failed


class Disaggregator:
    def __init__(self, plane: Plane, attempts: Attempts) -> None:
        self.plane = plane
        self.attempts = attempts
        config = plane.config
        self.pools = {p.name: p.disaggregation for p in config.pools if p.disaggregation}
        gpus = GpuTable()
        self._gpus = gpus
        # The configured GPU of each endpoint (an engine's report may name it later).
        self._gpu_of = {ep.url: ep.gpu for p in config.pools for ep in p.endpoints if ep.gpu}
        # The decider's r (filters/disagg.py): per decode pool, its seconds per prefilled
        # token at its GPUs' nominal speed, the mean over its configured endpoints.
        self.recompute_s: dict[str, float] = {}
        # SGLang's protocol: an endpoint's own bootstrap port (endpoints[].bootstrap_port),
        # and the ports learnt from the engines (filters/disagg.py BootstrapPorts).
        self.endpoint_ports: dict[str, int] = {}
        self.learnt_ports = BootstrapPorts()
        self._asking: dict[str, asyncio.Future[int | None]] = {}
        for name, cfg in self.pools.items():
            assert cfg is not None
            eps = config.pool(name).endpoints
            self.recompute_s[name] = sum(
                1.0 / gpus.get(ep.gpu).prefill_tokens_per_s for ep in eps
            ) / len(eps)
            if cfg.protocol != "sglang":
                continue
            for ep in config.pool(cfg.prefill_pool).endpoints:
                if ep.bootstrap_port is not None:
                    self.endpoint_ports[ep.url] = ep.bootstrap_port

    def applies(self, ctx: RequestContext) -> bool:
        return (
            ctx.pool in self.pools
            and ctx.inference is not None
            and ctx.inference.doc is not None
            and ctx.pd is None
        )

    def decide(self, ctx: RequestContext) -> PairPlan | Reply | None:
        """Order the prefill pool (once, recording nothing: the engine is noted when a step
        or leg starts there) and decide (ctx.pd). The plan of a split request (under
        SGLang's protocol also ctx.pd_pair: its tries are pairs), None for a request served
        whole, or, under SGLang's protocol with no prefill engine, the refusal."""
        cfg = self.pools[ctx.pool]
        assert cfg is not None and ctx.pick is not None
        plane = self.plane
        source = cfg.prefill_pool
        now = time.monotonic()
        sglang = cfg.protocol == "sglang"
        named = self._picker_named(ctx)
        if named == () and not sglang:  # an endpoint picker routed it here to be served whole
            self._whole(ctx, Split(False, "picker", 0, 0.0))
            return None
        pick = dataclasses.replace(ctx.pick, max_tokens=1)
        routes = plane.routers[source].order(pick, now, record=False)
        screened = self.attempts.screen(ctx, routes, pool=source).routes
        if named:
            # The endpoint picker chose the prefill engine(s): the decider is not asked
            # again; only endpoints of the prefill pool are ever sent to (no SSRF).
            by_addr = {host_port(r.url): r for r in screened}
            picked = [by_addr[a] for a in named if a in by_addr]
            if len(picked) < len(named):
                known = {host_port(ep.url) for ep in plane.config.pool(source).endpoints}
                if unknown := [a for a in named if a not in known]:
                    log.warning("prefill endpoints not in pool %r ignored: %s", source, unknown)
            if picked:
                screened = picked
            elif not sglang:
                self._whole(ctx, Split(False, "no-prefill-engine", 0, 0.0))
                return None
            else:  # SGLang's decode engines serve nothing whole: pair with our own choice
                named = None
        best = screened[0] if screened else None
        decode_cached = cached_tokens(plane.routers[ctx.pool], ctx.pick, now)
        split = decide_split(
            ctx.pick.prompt_tokens,
            best.cached_tokens if best is not None else None,
            min_prefill_tokens=cfg.min_prefill_tokens,
            kv_bytes_per_token=self.kv_bytes_per_token(ctx.pool, best, now),
            kv_link_gb_per_s=cfg.kv_link_gb_per_s,
            recompute_s_per_token=self.recompute_s[ctx.pool],
            prefill_available=best is not None,
            whole_allowed=not sglang,
            prefill_ttft_s=best.predicted_ttft_s if best is not None else None,
            decode_cached_tokens=max(decode_cached.values(), default=None),
        )
        if named and best is not None:
            split = dataclasses.replace(split, split=True, reason="picker")
        elif split.split and not sglang and cfg.faster_whole_margin_s is not None:
            split = self._faster_whole(ctx, split, now)
        if split.split and ctx.hold_refusal and split.decode_ttft_s is None:
            split = self._with_decode_leg(ctx, split, now)
        ctx.pd = split
        if sglang:
            return self._pair(ctx, source, screened, pick)
        if not split.split:
            self._whole(ctx, split)
            return None
        return PairPlan(source, screened, pick)

    def _with_decode_leg(self, ctx: RequestContext, split: Split, now: float) -> Split:
        """`split` with the decode leg's predicted TTFT and cost on the decode engine the
        leg would take now (the decode pool's order for it, recording nothing), so a
        request with a fallback pool is moved on by both legs, not by its prefill's alone.
        Only meshd's picker predicts; a balancer's order would take a turn."""
        if not isinstance(self.plane.routers[ctx.pool], PickerRouter):
            return split
        routes, _ = self._decode_order(ctx, split, split.transfer_s, now)
        best = routes[0] if routes else None
        if best is None or best.choice is None:
            return split
        return dataclasses.replace(
            split,
            decode_ttft_s=best.predicted_ttft_s,
            decode_cost_usd=best.choice.predicted_cost_usd,
        )

    def _faster_whole(self, ctx: RequestContext, split: Split, now: float) -> Split:
        """The decider's rule 4 (filters/disagg.py prefer_whole): the split's predicted TTFT,
        both legs (`_with_decode_leg`), against the request's on the engine of this pool it
        would take whole (its order, recording nothing, screened by the pool's guard as
        the attempts will screen it; skips are counted by the attempts, not here), and the
        streams decoding there."""
        cfg = self.pools[ctx.pool]
        router = self.plane.routers[ctx.pool]
        if cfg is None or split.prefill_ttft_s is None or not isinstance(router, PickerRouter):
            return split
        pick = ctx.pick
        assert pick is not None
        split = self._with_decode_leg(ctx, split, now)
        routes = router.order(pick, now, record=False)
        guard = self.plane.guards[ctx.pool]
        whole = guard.screen(routes, ctx.tokens, pick.priority, time.monotonic()).routes
        best = whole[0] if whole else None
        if best is None or best.choice is None:
            return split
        return prefer_whole(
            split,
            best.predicted_ttft_s,
            cfg.faster_whole_margin_s,
            streams=best.choice.state.running(now),
            stall_weight=cfg.faster_whole_stall_weight,
        )

    def _whole(self, ctx: RequestContext, split: Split) -> None:
        """The request is served whole on its decode pool (`split` says why)."""
        ctx.pd = split
        self.plane.metrics.pd_requests.labels(ctx.pool, "whole", split.reason).inc()
        ctx.trace.pd = f"whole:{split.reason}"

    @staticmethod
    def _picker_named(ctx: RequestContext) -> tuple[str, ...] | None:
        """What an endpoint picker (Envoy's ext_proc, `meshd picker` or llm-d's) decided for
        a request it routed here: the prefill endpoints it named (PREFILL_HEADERS), () for
        none (serve it whole), None when no picker routed it (a trusted peer's request
        without x-gateway-destination-endpoint, or any untrusted one: this sidecar
        decides). The prefill headers are consumed here: not passed on to an engine."""
        headers = ctx.upstream_headers
        names = {name.lower() for name, _ in headers}
        if not names.intersection(PREFILL_HEADERS) and DESTINATION_HEADER not in names:
            return None
        named = named_prefill_endpoints(headers)
        ctx.upstream_headers = [(k, v) for k, v in headers if k.lower() not in PREFILL_HEADERS]
        if not ctx.trusted or DESTINATION_HEADER not in names:
            return None
        return named

    def kv_bytes_per_token(self, pool: str, route: Route | None, now: float) -> int:
        """The KV bytes a token of the prompt moves: disaggregation.kv_bytes_per_token when
        set (the served model's), else the prefill engine's GPU profile's (filters/gpu.py:
        its reference model's, 131,072 for an engine whose GPU nobody named)."""
        cfg = self.pools[pool]
        if cfg is not None and cfg.kv_bytes_per_token is not None:
            return cfg.kv_bytes_per_token
        gpu = None
        if route is not None:
            choice = route.choice
            gpu = choice.state.gpu_name(now) if choice is not None else self._gpu_of.get(route.url)
        return self._gpus.get(gpu).kv_bytes_per_token

    async def prefill(self, ctx: RequestContext, plan: PairPlan) -> None:
        """vLLM's protocol: the prefill step of a split request on the plan's routes in turn
        (within the prefill pool's retry budget); on success the request's body becomes
        the decode step's (ctx.pd_params), else it is served whole."""
        assert ctx.inference is not None and ctx.inference.doc is not None
        doc = ctx.inference.doc
        plane = self.plane
        source = plan.source
        body = _encoder.encode(prefill_body(doc))
        budget = plane.retry_budgets[source]
        budget.deposit(time.monotonic())
        for made, route in enumerate(plan.routes[: plane.config.upstream.max_attempts]):
            if made and not budget.withdraw(time.monotonic(), made):
                plane.metrics.retry_budget_exhausted.labels(source).inc()
                break
            params = await self._prefill_on(ctx, plan, route, body)
            if params is not None:
                ctx.body = _encoder.encode(decode_body(doc, params))
                ctx.pd_params = params
                if ctx.pd is not None and route is not plan.routes[0]:
                    ctx.pd = dataclasses.replace(ctx.pd, prefill_ttft_s=route.predicted_ttft_s)
                reason = ctx.pd.reason if ctx.pd is not None else "split"
                plane.metrics.pd_requests.labels(ctx.pool, "split", reason).inc()
                ctx.trace.pd = "split"
                return
        plane.metrics.pd_requests.labels(ctx.pool, "whole", "prefill-failed").inc()
        ctx.trace.pd = "whole:prefill-failed"

    def order_decode(self, ctx: RequestContext, now: float) -> list[Route]:
        """The decode pool's order for a split request's decode leg (PoolRouter.order_decode),
        each route's predicted TTFT from when its attempt starts: the transfer, and under
        SGLang's protocol the prefill leg beside it, then the decode engine's wait."""
        split = ctx.pd
        assert split is not None and ctx.pick is not None
        lead = split.transfer_s
        if ctx.pd_pair is not None:
            lead += split.prefill_ttft_s or 0.0
        routes, held = self._decode_order(ctx, split, lead, now)
        cfg = self.pools[ctx.pool]
        if routes and held and cfg is not None:
            # Each engine's own transfer, for the attempt made there; the primary's is the
            # one the decode leg is predicted to wait.
            ctx.pd_transfers = {
                r.url: transfer_seconds(
                    missing_tokens(ctx.pick.prompt_tokens, held.get(r.url)),
                    split.kv_bytes_per_token,
                    cfg.kv_link_gb_per_s,
                )
                for r in routes
            }
            ctx.pd = dataclasses.replace(split, transfer_s=ctx.pd_transfers[routes[0].url])
        return routes

    def _decode_order(
        self, ctx: RequestContext, split: Split, lead_s: float, now: float
    ) -> tuple[list[Route], dict[str, float]]:
        """The decode pool's order for the decode leg (PoolRouter.order_decode, `lead_s`
        before each engine's wait), each engine priced the transfer of what its prefix
        cache lacks (filters/disagg.py price_decode_routes), and what each holds."""
        assert ctx.pick is not None
        router = self.plane.routers[ctx.pool]
        routes = router.order_decode(ctx.pick, now, lead_s=lead_s)
        cfg = self.pools[ctx.pool]
        if not routes or cfg is None or not split.kv_bytes_per_token:
            return routes, {}
        held = cached_tokens(router, ctx.pick, now)
        priced = price_decode_routes(
            routes,
            held,
            ctx.pick.prompt_tokens,
            kv_bytes_per_token=split.kv_bytes_per_token,
            kv_link_gb_per_s=cfg.kv_link_gb_per_s,
            transfer_s=split.transfer_s,
        )
        return priced, held

    def predicted_ttft_s(self, ctx: RequestContext, decode: Route | None) -> float | None:
        """A split request's predicted TTFT, its decode leg on `decode`: the prefill's, the
        transfer and the decode engine's wait (the decode route's prediction holds the
        transfer, and under SGLang's protocol the prefill too). None: not predicted."""
        split = ctx.pd
        if split is None or decode is None or decode.predicted_ttft_s is None:
            return None
        if ctx.pd_pair is not None:
            return decode.predicted_ttft_s
        if split.prefill_ttft_s is None:
            return None
        return split.prefill_ttft_s + decode.predicted_ttft_s

    # ---- SGLang's protocol -----------------------------------------------------------

    def _pair(
        self, ctx: RequestContext, source: str, screened: list[Route], pick: PickRequest
    ) -> PairPlan | Reply:
        """A request for an sglang decode pool: its tries will be pairs, or, with no prefill
        engine to take a leg, it is refused (SGLang's decode engines serve nothing whole;
        the pool's fallbacks may)."""
        plane = self.plane
        if not screened:
            plane.metrics.pd_requests.labels(ctx.pool, "refused", "no-prefill-engine").inc()
            ctx.trace.pd = "refused:no-prefill-engine"
            return self.attempts.acct.refuse(
                ctx,
                503,
                f"no engine of prefill pool {source!r} can take the prefill leg, and the "
                f"engines of pool {ctx.pool!r} (SGLang decode) serve nothing whole",
                "no_healthy_upstream",
                retry_after_s=1,
            )
        plane.retry_budgets[source].deposit(time.monotonic())
        plan = ctx.pd_pair = PairPlan(source, list(screened), pick)
        reason = ctx.pd.reason if ctx.pd is not None else "split"
        plane.metrics.pd_requests.labels(ctx.pool, "split", reason).inc()
        ctx.trace.pd = "split"
        return plan

    async def open_leg(self, ctx: RequestContext, doc: Mapping[str, Any]) -> PrefillLeg | str:
        """The prefill leg of the request's next pair, for the body `doc` (the request, or a
        resumed stream's continuation): its attempt begun, nothing sent yet. Or why there
        is none: no prefill engine left, or no retry budget for another leg."""
        plan = ctx.pd_pair
        assert plan is not None
        plane = self.plane
        candidates = [r for r in plan.routes if r.url not in plan.failed]
        if not candidates:
            return f"no engine of prefill pool {plan.source!r} is left for the prefill leg"
        if plan.failed and not plane.retry_budgets[plan.source].withdraw(
            time.monotonic(), len(plan.failed)
        ):
            plane.metrics.retry_budget_exhausted.labels(plan.source).inc()
            return f"no retry budget left in prefill pool {plan.source!r} for another leg"
        route = candidates[0]
        port = await self.bootstrap_port(ctx.pool, route.url)
        body = bootstrap_body(aggregated_body(doc), bootstrap_host(route.url), port, plane.rng)
        attempt = self.attempts.start(ctx, route, "prefill", pool=plan.source, pick=plan.pick)
        ctx.tried.discard(route.url)  # the decode pool may hold the same engine
        assert ctx.inference is not None
        if doc is not ctx.inference.doc:
            attempt.inference = None  # a continuation's prompt is not the text the pick saw
        room = body["bootstrap_room"]
        _name_room(attempt, room)
        return PrefillLeg(route, attempt, _encoder.encode(body), room)

    async def bootstrap_port(self, pool: str, url: str) -> int:
        """The bootstrap port of the SGLang prefill engine at `url`, for decode pool `pool`:
        the endpoint's own (endpoints[].bootstrap_port), else the one its engine says
        (/server_info, asked once and kept; a failed ask is tried again after
        BOOTSTRAP_RETRY_S), else disaggregation.bootstrap_port, else 8998 (SGLang's
        default)."""
        port = self.endpoint_ports.get(url)
        if port is not None:
            return port
        port, ask = self.learnt_ports.get(url, time.monotonic())
        if port is None and ask:
            port = await self._ask_port(url)
        if port is not None:
            return port
        cfg = self.pools[pool]
        return (cfg.bootstrap_port if cfg is not None else None) or SGLANG_BOOTSTRAP_PORT

    async def _ask_port(self, url: str) -> int | None:
        """Ask the engine at `url` its bootstrap port (one ask at a time per engine)."""
        pending = self._asking.get(url)
        if pending is None:
            pending = self._asking[url] = asyncio.ensure_future(self._fetch_port(url))
            pending.add_done_callback(lambda _: self._asking.pop(url, None))
        return await asyncio.shield(pending)

    async def _fetch_port(self, url: str) -> int | None:
        """GET /server_info (SGLang's, /get_server_info before it was renamed, and still
        its alias): its `disaggregation_bootstrap_port`, learnt; None when it says none."""
        plane = self.plane
        assert plane.upstream is not None
        headers = [("accept", "application/json")]
        port = None
        try:
            async with asyncio.timeout(BOOTSTRAP_ASK_TIMEOUT_S):
                for path in SERVER_INFO_PATHS:
                    up = await plane.upstream.request(url, "GET", path, headers, b"")
                    data = await _read_prefill_answer(up, url, "the server info")
                    if up.status == 200:
                        with contextlib.suppress(ValueError):
                            port = bootstrap_port_of(json.loads(data))
                        break
        except (UpstreamError, OSError, TimeoutError) as exc:
            log.info("bootstrap port of %s not learnt: %s", url, exc)
        now = time.monotonic()
        if port is None:
            self.learnt_ports.failed(url, now)
        else:
            self.learnt_ports.learnt(url, port)
        return port

    async def send_pair(
        self, ctx: RequestContext, leg: PrefillLeg, attempt: Attempt, url: str
    ) -> UpstreamResponse:
        """Send `leg.body` to the prefill engine of `leg` and, as `attempt`, to the decode
        engine at `url`, at once. The decode engine's answer, once its head came and (a 200)
        the prefill leg ended well; a refusal comes back at once (the prefill leg is
        dropped). Raises PrefillLegFailed when the prefill leg failed first (the decode
        request is dropped), and what the decode request raised. Neither leg outlives the
        call."""
        plane = self.plane
        assert plane.upstream is not None
        _name_room(attempt, leg.room)
        headers = attempt.trace.inject_headers(ctx.upstream_headers)
        decode = asyncio.ensure_future(
            plane.upstream.request(url, ctx.method, ctx.target, headers, leg.body)
        )
        leg.task = task = asyncio.ensure_future(self._run_leg(ctx, leg))
        try:
            done, _ = await asyncio.wait({decode, task}, return_when=asyncio.FIRST_COMPLETED)
            if task in done and (why := task.result()) is not None and decode not in done:
                raise PrefillLegFailed(f"{leg.route.url}: {why}")
            up = await decode
            if up.status != 200:
                return up
            why = await task
            if why is not None:
                up.close()
                raise PrefillLegFailed(f"{leg.route.url}: {why}")
            return up
        finally:
            if not decode.done():
                decode.cancel()
            self.close_leg(leg)

    def close_leg(self, leg: PrefillLeg) -> None:
        """Drop a leg still running (its engine frees the KV when the connection goes)."""
        task = leg.task
        if task is not None and not task.done():
            task.cancel()
        if not leg.attempt.settled:
            leg.attempt.cancelled = True
            self.attempts.settle(leg.attempt, "cancelled")

    async def _run_leg(self, ctx: RequestContext, leg: PrefillLeg) -> str | None:
        """One prefill leg, its answer read whole and dropped: None, or why it failed
        (settled as such, and its engine is not asked again for this request)."""
        from meshd.relay import describe, take_usage

        plane = self.plane
        assert plane.upstream is not None and ctx.pd_pair is not None
        plan = ctx.pd_pair
        attempt = leg.attempt
        url = leg.route.url
        try:
            up = await plane.upstream.request(
                url,
                ctx.method,
                ctx.target,
                attempt.trace.inject_headers(ctx.upstream_headers),
                leg.body,
            )
            data = await _read_prefill_answer(up, url, "the prefill leg's answer")
        except asyncio.CancelledError:
            attempt.cancelled = True
            self.attempts.settle(attempt, "cancelled")
            raise
        except (UpstreamError, OSError, TimeoutError) as exc:
            attempt.local_failure = True
            connect = isinstance(exc, UpstreamConnectError)
            self.attempts.settle(
                attempt, "connect_error" if connect else "upstream_error", describe(exc)
            )
            plan.failed.add(url)
            return describe(exc)
        attempt.status = up.status
        if up.status != 200:
            self.attempts.settle(attempt, f"http_{up.status}")
            plan.failed.add(url)
            return f"HTTP {up.status}: {data[:200].decode('utf-8', 'replace')}"
        why, usage = leg_answer(data, sse=up.content_type == "text/event-stream")
        take_usage(attempt, usage)
        attempt.ok = why is None
        if why is not None:
            self.attempts.settle(attempt, "prefill_error", why)
            plan.failed.add(url)
            return why
        _prefilled(attempt)
        self.attempts.settle(attempt, "ok")
        return None

    async def _prefill_on(
        self, ctx: RequestContext, plan: PairPlan, route: Route, body: bytes
    ) -> dict[str, Any] | None:
        """One prefill step on `route`: the transfer params, or None (settled as failed)."""
        from meshd.relay import describe, take_usage

        plane = self.plane
        assert plane.upstream is not None
        attempt = self.attempts.start(ctx, route, "prefill", pool=plan.source, pick=plan.pick)
        ctx.tried.discard(route.url)  # the decode pool may hold the same engine
        loop = asyncio.get_running_loop()
        try:
            timeout = min(
                plane.config.upstream.first_byte_timeout_s,
                min(ctx.deadline, ctx.head_by) - loop.time(),
            )
            async with asyncio.timeout(max(0.001, timeout)):
                up = await plane.upstream.request(
                    route.url,
                    "POST",
                    ctx.target,
                    attempt.trace.inject_headers(ctx.upstream_headers),
                    body,
                )
                data = await _read_prefill_answer(up, route.url, "the prefill answer")
        except asyncio.CancelledError:
            attempt.cancelled = True
            self.attempts.settle(attempt, "client_disconnect")
            raise
        except (UpstreamError, ConnectionError, TimeoutError) as exc:
            attempt.local_failure = True
            self.attempts.settle(
                attempt,
                "timeout" if isinstance(exc, TimeoutError) else "upstream_error",
                describe(exc),
            )
            return None
        attempt.status = up.status
        if up.status != 200:
            self.attempts.settle(attempt, f"http_{up.status}")
            return None
        _prefilled(attempt)
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        params = transfer_params(answer)
        attempt.ok = params is not None
        if isinstance(answer, dict) and isinstance(answer.get("usage"), dict):
            take_usage(attempt, answer["usage"])
        self.attempts.settle(attempt, "ok" if params is not None else "no_transfer_params")
        return params


def _prefilled(attempt: Attempt) -> None:
    """A prefill step's (or leg's) answer came whole: its engine's first token, the prefill
    done. Its router and guard are told as of a stream's first token, so the engine's queue
    moves on in the picker's model (EndpointState.first_token: the next request's prefill
    starts; without it a prefill engine busy for longer than its queue looked idle, its
    queue taken to drain by the clock) and its TTFT is a calibration sample and the token
    breaker's outlier test. Not the request's TTFT: its trace is not told (the client's
    first token comes from the decode leg). A leg of SGLang's answers once its KV was
    fetched: its sample holds the transfer too. The attempt's own record notes it (the
    access log's attempts[].ttft_s: when the prefill leg's one token came, from the
    request's arrival), so each leg's share of the request's TTFT can be read there."""
    attempt.engine_first_token(time.monotonic())
    if attempt.trace.first_token_at is None:  # the trace's clock is the loop's
        attempt.trace.first_token_at = asyncio.get_running_loop().time()


def kv_fetch_failed(status: int, body: bytes) -> bool:
    """Did a decode step fail because its KV could not be fetched? Then it is retried whole
    (a fresh prefill where it decodes; under SGLang's protocol, a new pair). The simulator
    says so exactly (410, error type KVTransferError); a real vLLM ends such a request with
    an internal error (SGLang with a 500 "Decode transfer failed"), so a 5xx from a decode
    step counts too, but for 429 and 503: an engine that sheds load never took the request,
    and another decode engine may (the attempts layer's retry). Other 4xx are the
    client's to see."""
    if status in OVERLOAD_STATUSES:
        return False
    if status == 410 or status >= 500:
        return True
    return status >= 400 and b'"kvtransfererror"' in body[:4096].lower()


def served(ctx: RequestContext) -> PdServed | None:
    """How this sidecar is serving a request of a decode pool, as its answer's head goes
    out (filters/disagg.py PD_HEADER): split, on the prefill engine whose step (or the
    pair's leg) answered last; or whole and why: the decider's reason, `prefill-failed`,
    or `kv-fetch-failed` (its decode step lost the KV and was retried whole). None: not a
    request of a decode pool."""
    split = ctx.pd
    if split is None:
        return None
    if ctx.pd_params is not None or ctx.pd_pair is not None:
        prefill = None
        for a in reversed(ctx.trace.attempts):
            if a.reason == "prefill" and a.outcome == "ok":
                prefill = host_port(a.endpoint)
                break
        return PdServed(True, "split", prefill)
    said = ctx.trace.pd or ""
    if said.startswith("whole:"):
        return PdServed(False, said[len("whole:") :])
    if not split.split:
        return PdServed(False, split.reason)
    return PdServed(False, "kv-fetch-failed")


def whole_body(ctx: RequestContext) -> bytes:
    """The request as the client sent it, without transfer params."""
    assert ctx.inference is not None and ctx.inference.doc is not None
    return _encoder.encode(aggregated_body(ctx.inference.doc))


def bootstrap_host(url: str) -> str:
    """The bootstrap host of the prefill engine at `url`: its hostname, an IPv6 address in
    brackets (SGLang's maybe_wrap_ipv6_address, as mini_lb.py sends it)."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


def _name_room(attempt: Attempt, room: Any) -> None:
    span = attempt.trace.span
    if span is not None and span.is_recording():
        span.set_attribute(ATTR_BOOTSTRAP_ROOM, room if isinstance(room, int) else list(room))
