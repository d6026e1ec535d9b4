"""`meshd picker` for a prefill/decode disaggregated pool (issue #25): with prefill endpoints
(`--prefill-endpoint`) the `--endpoint`s are decode endpoints, and for each inference
request the picker decides as the sidecar does (filters/disagg.py `decide_split`: the
prefill pool ordered for the prefill leg alone, one output token, recording nothing), then
orders the decode endpoints: for the decode leg (Picker.order_decode: KV headroom, decode
load and ITL, the transfer in each predicted TTFT) when it splits, as any request when it
does not (rule 4, `faster-whole`, included: a split predicted to give its first token later
than the request whole on a decode endpoint, by more than the margin and the stall its
prefill would put into the streams decoding there, is served whole).

The answer is the Gateway API Inference Extension's P/D protocol, as llm-d's endpoint
picker speaks it (its disagg profile handler and prefill header handler): the destination
is always the decode endpoint (`x-gateway-destination-endpoint`), and a split request
carries the chosen prefill endpoint in a header (filters/disagg.py PREFILL_HEADERS: GIE's
proposed `x-gateway-prefill-endpoints` and llm-d's `x-prefiller-host-port`, the same
`ip:port` value; removed when it is served whole). The prefill step runs at the decode
endpoint: its proxy (a meshd sidecar in front of the decode engine, meshd/disagg.py, or
llm-d's routing sidecar) sends the prefill step to the named engine, then the decode step
with its `kv_transfer_params` to its engine. So the picker stays a decision server (no
I/O to engines), and a decode engine is chosen before its KV is ready (the sidecar
chooses it after).

The picker sees only the decode leg's answer; the prefill engine is charged from the
decision (in flight, its prefix noted) to the decode answer's head, which comes once the
prefill step is over: its end, not a first token (the time holds the decode engine's
wait, no TTFT sample for the prefill engine). A meshd at the decode endpoint says in that
head what it did (`x-meshd-pd`: split, on which prefill engine, or whole and why, e.g. a
failed prefill step); the picker counts it (`EndpointPicker.pd_served`), puts it on the
decision's span (`meshd.pd.served`), ends the prefill engine's charge as not served when
its step did not run there, and removes the header from the client's answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from filters.disagg import (
    FASTER_WHOLE_MARGIN_S,
    FASTER_WHOLE_STALL_WEIGHT,
    Split,
    decide_split,
    prefer_whole,
    price_decode_routes,
)
from filters.gpu import GpuTable
from filters.picker import PickRequest
from filters.pool_router import (
    EndpointSpec,
    Policy,
    PoolRouter,
    Route,
    cached_tokens,
    make_router,
)

__all__ = ["PdPlan", "PdSettings", "PrefillPlanner"]


@dataclass(frozen=True, slots=True)
class PdSettings:
    """The prefill side of `meshd picker` (the sidecar's `disaggregation` section, for a
    protocol whose prefill step runs at the decode endpoint)."""

    prefill_endpoints: tuple[EndpointSpec, ...]
    min_prefill_tokens: int = 256
    kv_link_gb_per_s: float = 50.0
    kv_bytes_per_token: int | None = None  # None: the prefill engine's GPU profile's
    # The decider's rule 4 (filters/disagg.py prefer_whole; the sidecar's
    # disaggregation.faster_whole_*, their defaults); a None margin: off.
    faster_whole_margin_s: float | None = FASTER_WHOLE_MARGIN_S
    faster_whole_stall_weight: float = FASTER_WHOLE_STALL_WEIGHT

    def __post_init__(self) -> None:
        if not self.prefill_endpoints:
            raise ValueError("at least one prefill endpoint")
        if self.min_prefill_tokens < 0 or not self.kv_link_gb_per_s > 0:
            raise ValueError("min_prefill_tokens must be >= 0 and kv_link_gb_per_s > 0")
        margin = self.faster_whole_margin_s
        if (margin is not None and margin < 0) or self.faster_whole_stall_weight < 0:
            raise ValueError("faster_whole_margin_s and faster_whole_stall_weight must be >= 0")
        if self.kv_bytes_per_token is not None and self.kv_bytes_per_token < 1:
            raise ValueError("kv_bytes_per_token must be >= 1")


@dataclass(frozen=True, slots=True)
class PdPlan:
    """One request's P/D decision: the decider's answer, the prefill routes to name (the
    first is charged; () when served whole) and the prefill leg's pick."""

    split: Split
    prefill: tuple[Route, ...]
    pick: PickRequest


class PrefillPlanner:
    """The prefill pool's router and the decider, for one decode pool of endpoints."""

    def __init__(
        self,
        settings: PdSettings,
        decode_endpoints: Sequence[EndpointSpec],
        policy: Policy = "meshd",
        *,
        router: PoolRouter | None = None,
    ) -> None:
        self.settings = settings
        self.router = router or make_router(policy, settings.prefill_endpoints)
        self._gpus = GpuTable()
        self._gpu_of = {e.url: e.gpu for e in settings.prefill_endpoints}
        # The decider's r: the decode endpoints' seconds per prefilled token at their GPUs'
        # nominal speed, the mean (meshd/disagg.py computes it so for a decode pool).
        self.recompute_s = sum(
            1.0 / self._gpus.get(e.gpu).prefill_tokens_per_s for e in decode_endpoints
        ) / max(1, len(decode_endpoints))

    def plan(self, pick: PickRequest, now: float, decode: PoolRouter, names: int = 1) -> PdPlan:
        """Decide for `pick`: split (the first `names` eligible prefill routes) or whole;
        `decode` the decode endpoints' router (what their prefix caches hold)."""
        cfg = self.settings
        leg = dataclasses.replace(pick, max_tokens=1)
        ordered = self.router.order(leg, now, record=False)
        routes = [r for r in ordered if r.reason != "no-eligible-endpoint"]
        best = routes[0] if routes else None
        split = decide_split(
            pick.prompt_tokens,
            best.cached_tokens if best is not None else None,
            min_prefill_tokens=cfg.min_prefill_tokens,
            kv_bytes_per_token=self.kv_bytes_per_token(best, now),
            kv_link_gb_per_s=cfg.kv_link_gb_per_s,
            recompute_s_per_token=self.recompute_s,
            prefill_available=best is not None,
            prefill_ttft_s=best.predicted_ttft_s if best is not None else None,
            decode_cached_tokens=max(cached_tokens(decode, pick, now).values(), default=None),
        )
        if split.split and cfg.faster_whole_margin_s is not None and best is not None:
            split = self._faster_whole(decode, pick, split, now)
        chosen = tuple(routes[: max(1, names)]) if split.split else ()
        return PdPlan(split, chosen, leg)

    def _faster_whole(
        self, decode: PoolRouter, pick: PickRequest, split: Split, now: float
    ) -> Split:
        """Rule 4, as the sidecar's decider applies it: the split's predicted TTFT (the
        prefill's, then the decode leg's on the decode endpoint it would take) against the
        request's on the endpoint it would take whole (both orders recording nothing)."""
        legs = self.order_decode(decode, pick, split, now)
        if not legs or legs[0].choice is None:
            return split  # a balancer predicts nothing
        split = dataclasses.replace(
            split,
            decode_ttft_s=legs[0].predicted_ttft_s,
            decode_cost_usd=legs[0].choice.predicted_cost_usd,
        )
        whole = [r for r in decode.order(pick, now, record=False) if r.choice is not None]
        if not whole:
            return split
        best = whole[0]
        assert best.choice is not None
        cfg = self.settings
        return prefer_whole(
            split,
            best.predicted_ttft_s,
            cfg.faster_whole_margin_s,
            streams=best.choice.state.running(now),
            stall_weight=cfg.faster_whole_stall_weight,
        )

    def order_decode(
        self, decode: PoolRouter, pick: PickRequest, split: Split, now: float
    ) -> list[Route]:
        """The decode endpoints for a split request's decode leg, each pulling the part of
        the prompt its prefix cache lacks (filters/disagg.py price_decode_routes)."""
        routes = decode.order_decode(pick, now, lead_s=split.transfer_s)
        return price_decode_routes(
            routes,
            cached_tokens(decode, pick, now),
            pick.prompt_tokens,
            kv_bytes_per_token=split.kv_bytes_per_token,
            kv_link_gb_per_s=self.settings.kv_link_gb_per_s,
            transfer_s=split.transfer_s,
        )

    def kv_bytes_per_token(self, route: Route | None, now: float) -> int:
        """--kv-bytes-per-token, else the prefill engine's GPU profile's."""
        if self.settings.kv_bytes_per_token is not None:
            return self.settings.kv_bytes_per_token
        gpu = None
        if route is not None:
            choice = route.choice
            gpu = choice.state.gpu_name(now) if choice is not None else self._gpu_of.get(route.url)
        return self._gpus.get(gpu).kv_bytes_per_token
