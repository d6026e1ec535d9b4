"""Model fallback and cascades (issue #24's "move"): a pool may name fallbacks
(`pools[].fallbacks`, each a pool and optionally the model to ask it for). A request its
pool cannot serve in time goes to the next pool of the chain, with the model rewritten in
the request; the engine's answer names the model that answered, and the response says
where it went (`x-meshd-fallback: <pool>; from=<pool>; reason=<code>`), as do the access
log (`fallback_from`, `fallback_reason`), the span (a `meshd.fallback` event) and
meshd_fallbacks_total{pool, to, reason}.

When a pool cannot serve a request in time: it has no endpoint to try
(`no_healthy_upstream`), every endpoint refused or failed before answering
(`upstream_unavailable`), every one is at its in-flight limits (`overloaded`), admission
or the throttle shed it (429 / 503), or, before any attempt, the picker predicts that no
endpoint meets the request's deadline (`deadline_unmeetable`) or that the best one costs
more than the request's cap (`over_cost_cap`: `x-meshd-max-cost-usd` from a trusted peer,
else the tenant's `max_cost_usd`, else the pool's); a request a decode pool splits is
judged on both legs (the prefill's TTFT and the decode leg's transfer and wait; the two
legs' cost). An engine that answered and then
failed or timed out (`upstream_timeout`, `upstream_error`) is not moved: the request's
time is spent.

No storm, by construction: a request reaches at most its pool's attempts plus one pool per
link of the chain, and a move after engines of the pool were tried withdraws from that
pool's retry budget like a retry (a request moved before any attempt costs no engine a
second try, and takes no token). The fallback pool's own admission and breakers protect
it like any pool. The last pool of a chain answers as a pool without fallbacks does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec

from meshd.accounting import Accounting
from meshd.context import Plane, RequestContext
from meshd.http_message import HttpRequest, Reply

if TYPE_CHECKING:
    from filters.pool_router import Route
    from meshd.config_schema import Fallback

# Refusals a fallback does not mend: the engine answered or was waited for (its time is
# spent), or the request was the client's to fix.
_STAY = frozenset({"upstream_timeout", "upstream_error", "not_cached"})
COST_CAP_HEADER = "x-meshd-max-cost-usd"
_encoder = msgspec.json.Encoder()


class Fallbacks:
    """Each pool's chain, and the moves along it."""

    def __init__(
        self, plane: Plane, accounting: Accounting, hash_prompt: Callable[[RequestContext], None]
    ) -> None:
        config = plane.config
        self.plane = plane
        self.acct = accounting
        self.hash_prompt = hash_prompt
        self.chains = {p.name: p.fallbacks for p in config.pools if p.fallbacks}
        self.pool_caps = {p.name: p.max_cost_usd for p in config.pools}
        self.tenant_caps = {
            name: t.max_cost_usd
            for name, t in config.reliability.admission.tenants.items()
            if t.max_cost_usd is not None
        }
        self.moves = plane.metrics.fallbacks

    def cost_cap(self, ctx: RequestContext, headers: list[tuple[str, str]]) -> str | None:
        """Set the request's cost cap; an error message when the header is malformed."""
        if ctx.pool not in self.chains:
            return None  # no cheaper pool to send it to: a cap would change nothing
        if ctx.trusted:
            for name, value in headers:
                if name.lower() == COST_CAP_HEADER:
                    try:
                        cap = float(value)
                    except ValueError:
                        cap = math.nan
                    if not (cap > 0 and math.isfinite(cap)):
                        return f"{COST_CAP_HEADER}: expected dollars above 0, got {value!r}"
                    ctx.max_cost_usd = cap
                    return None
        tenant = ctx.routing.tenant if ctx.routing is not None else None
        tenant_cap = self.tenant_caps.get(tenant) if tenant is not None else None
        ctx.max_cost_usd = tenant_cap if tenant_cap is not None else self.pool_caps.get(ctx.pool)
        return None

    async def serve(
        self,
        req: HttpRequest,
        ctx: RequestContext,
        run: Callable[[HttpRequest, RequestContext], Awaitable[Reply | None]],
    ) -> Reply | None:
        """`run` on the request's pool, then on its fallbacks while each cannot serve it."""
        links = self.chains.get(ctx.pool)
        if links is None:
            return await run(req, ctx)  # no chain: nothing held, nothing to decide
        chain = list(links)
        while True:
            ctx.hold_refusal = bool(chain)
            try:
                reply = await run(req, ctx)
            finally:
                ctx.hold_refusal = False
            refused, ctx.refused = ctx.refused, None
            if refused is None:
                return reply
            status, message, code, kw = refused
            if code in _STAY or not chain or not self.move(ctx, chain.pop(0), code):
                return self.acct.refuse(ctx, status, message, code, **kw)

    def move(self, ctx: RequestContext, target: Fallback, why: str) -> bool:
        """The request goes to `target` (False: the retry budget says no)."""
        plane = self.plane
        now = time.monotonic()
        source = ctx.pool
        if ctx.tried and not plane.retry_budgets[source].withdraw(now, 1):
            plane.metrics.retry_budget_exhausted.labels(source).inc()
            return False
        inference = ctx.inference
        if inference is not None and inference.doc is not None:
            if target.model is not None:
                doc = {**inference.doc, "model": target.model}
                ctx.body = _encoder.encode(doc)
                ctx.inference = dataclasses.replace(inference, model=target.model, doc=doc)
            elif ctx.pd_params is not None:  # a decode step's body: the request as it came
                ctx.body = _encoder.encode(inference.doc)
        ctx.pd = ctx.pd_params = ctx.pd_pair = None
        ctx.pool = target.pool
        ctx.tried = set()
        ctx.cache = None  # the answer is another pool's (model's): not this key's to store
        ctx.pick = None
        ctx.block_hashes = []
        ctx.tokens_per_block = None
        self.hash_prompt(ctx)
        ctx.fallback = (source, target.pool, why)
        model = ctx.inference.model if ctx.inference is not None else None
        ctx.trace.fell_back(source, target.pool, model, why, asyncio.get_running_loop().time())
        self.moves.labels(source, target.pool, why).inc()
        demand = plane.observer.demand
        if demand is not None:
            prompt = ctx.inference.estimated_prompt_tokens if ctx.inference is not None else 0
            # Shed requests were counted as unmet demand when admission refused them.
            unmet = why != "over_cost_cap" and not ctx.shed
            demand.fell_back(source, now, prompt_tokens=prompt, unmet=unmet)
        ctx.shed = False
        return True


def move_before_trying(ctx: RequestContext, best: Route) -> tuple[str, str] | None:
    """(code, message) when a request with a fallback left should go on to it before any
    attempt here: the picker predicts no endpoint meets its deadline, or the best one costs
    more than its cap. None: try it here.

    A split request (prefill/decode, meshd/disagg.py), `best` its best prefill engine, is
    judged on both legs where the decode leg is predicted (ctx.pd.decode_ttft_s and
    decode_cost_usd): its TTFT is the prefill's plus the decode leg's (the KV transfer and
    the decode engine's wait), as the picker's deadline test takes a TTFT (a necessary
    condition: filters/picker.py), and its cost the two legs' together."""
    if best.reason == "deadline-unmeetable":
        return (
            "deadline_unmeetable",
            f"no endpoint of pool {ctx.pool!r} is predicted to meet the request's deadline",
        )
    split = ctx.pd if ctx.pd is not None and ctx.pd.split else None
    deadline = ctx.pick.deadline_s if ctx.pick is not None else None
    if (
        split is not None
        and split.decode_ttft_s is not None
        and best.predicted_ttft_s is not None
        and deadline is not None
        and best.predicted_ttft_s + split.decode_ttft_s > deadline - time.monotonic()
    ):
        return (
            "deadline_unmeetable",
            f"pool {ctx.pool!r} is predicted to miss the request's deadline: its first token "
            f"after {best.predicted_ttft_s:.3f} s of prefill and {split.decode_ttft_s:.3f} s "
            "of KV transfer and decode wait",
        )
    cap, choice = ctx.max_cost_usd, best.choice
    if cap is None or choice is None:
        return None
    cost, legs = choice.predicted_cost_usd, ""
    if split is not None and split.decode_cost_usd is not None:
        cost += split.decode_cost_usd
        legs = " (prefill and decode legs)"
    if cost > cap:
        return (
            "over_cost_cap",
            f"the request is predicted to cost ${cost:.6f}{legs} on pool "
            f"{ctx.pool!r}, over its cap of ${cap:g}",
        )
    return None
