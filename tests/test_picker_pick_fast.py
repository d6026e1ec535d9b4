"""Picker.pick's cheaper paths give exactly what they replaced, across the state changes a
pool sees (prompts sharing prefixes, tasks, deadlines, ramps, load reports, time passing
with a finite prefix TTL, index changes between admission's follow_up and the pick):

- the prefix match follow_up found, reused by the pick of the same request while the
  index is unchanged (filters.picker._FAST_MATCH false: the index walked each time);
- _choice with _work, decode_usd and _step in line (against reference_choice, as it was);
- the bounded-load rule as a module function of the pick's terms (_within, against
  reference_within, the closure it was), and _fallbacks through it;
- dispatch's fields read at once (against reference_start_kwargs, what it passed to
  EndpointState.start);
- PickerRouter.order's routes built in a loop (against the comprehension it was);
- PrefixIndex.match_keyed: a kept match answers as a fresh one while the index's version
  holds, whatever changed the index before (a change that did not move it would fail here).
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import filters.picker as picker_mod
from filters.endpoint_state import EndpointState, ReportedState
from filters.picker import Choice, Picker, PickerConfig, PickRequest
from filters.pool_router import EndpointSpec, PickerRouter, Route

GPUS = ("A100", "H100", "H100", "B200")


def reference_choice(
    p: Picker, t: Any, req: PickRequest, cached_of: dict[str, float], reason: str, rank: int
) -> Choice:
    """Picker._choice as it was, through _work, _View.decode_usd and _step."""
    score, name, v = t
    prompt = max(1, req.prompt_tokens)
    big_m = max(0, req.max_tokens)
    cached = min(cached_of.get(name, 0.0), prompt - 1.0)
    unc = prompt - cached
    w = picker_mod._work(unc, cached)
    pre = w * v.inv
    cold = v.cold_now
    fixed = cold + v.q_fixed
    ttft = cold + v.q + pre
    if unc + big_m > v.free_kv:
        kv_wait = (unc + big_m - v.free_kv) * v.kv_wait_per_token
        ttft += kv_wait
        fixed += kv_wait
    cost = v.price_s * (pre + cold) + v.decode_usd(big_m)
    nominal = v.q_nominal + w * v.inv_nominal
    step = picker_mod._step(v, prompt + 0.5 * big_m) / v.dcal
    return Choice(
        name, v.url, ttft, cost, int(cached), reason, score, rank, nominal, fixed, v.state, step
    )


def reference_within(bound: Any, t: Any) -> bool:
    """Picker.pick's `within` closure as it was, over the same terms (its least queue
    computed each time, not kept)."""
    cap, headroom, cached_of, x, yield_q, _, cands, now = bound
    v = t[2]
    top = cap
    if headroom:
        held = cached_of.get(t[1])
        if held:
            top = cap * (1.0 + headroom * held)
    if v.load <= v.floor_load or picker_mod._fits(v.load + x, top * v.weight):
        return True
    if (
        yield_q is None
        or v.weight >= v.full_weight
        or not picker_mod._fits(v.load + x, cap * v.full_weight)
    ):
        return False
    q = min(
        (picker_mod._queue_now(u[2], now) for u in cands if u[2].weight >= u[2].full_weight),
        default=math.inf,
    )
    return q > yield_q


def reference_start_kwargs(c: Choice, req: PickRequest) -> dict[str, Any]:
    """What Picker.dispatch passed to EndpointState.start, as it was."""
    uncached = max(1, req.prompt_tokens - c.cached_tokens)
    return {
        "prompt_tokens": max(1, req.prompt_tokens),
        "uncached_tokens": uncached,
        "max_tokens": max(0, req.max_tokens),
        "nominal_s": c.nominal_s if c.cached_tokens <= uncached else 0.0,
        "fixed_s": c.fixed_s,
        "step_s": c.step_s,
    }


def _report(rng: random.Random, e: EndpointState, now: float) -> None:
    e.report(
        ReportedState(
            epoch=1,
            kv_block_size=16,
            kv_capacity_blocks=rng.randrange(200, 60_000),
            kv_usage=rng.random() * 0.95,
            requests_running=rng.randrange(0, 60),
            requests_waiting=rng.randrange(0, 5),
            models={"m": True},
        ),
        now,
    )


def _drive(seed: int, fast: bool, steps: int) -> tuple[list[Any], dict[str, int]]:
    """A pool's life, picks after admission's follow_up: every answer, and counts of the
    spied helpers' calls (each checked against its reference as it runs)."""
    saved = picker_mod._FAST_MATCH
    picker_mod._FAST_MATCH = fast
    try:
        rng = random.Random(seed)
        eps = [
            EndpointState(f"m{i:02d}", url=f"http://m{i}", gpu=GPUS[i % 4])
            for i in range(rng.randrange(2, 7))
        ]
        p = Picker(
            PickerConfig(
                prefix_ttl_s=rng.choice([None, 0.5, 3.0]),
                max_choices=rng.choice([None, 1, 2, 4]),
                ramp_yield_s=rng.choice([None, 0.0, 0.1]),
                load_metric=rng.choice(["requests", "tokens"]),
            )
        )
        calls = {"choice": 0, "within": 0, "start": 0, "walks": 0}
        choice, within, match_keyed = p._choice, picker_mod._within, p.index.match_keyed
        start = EndpointState.start

        def spy_choice(*a: Any) -> Choice:
            calls["choice"] += 1
            got = choice(*a)
            assert got == reference_choice(p, *a)
            return got

        def spy_within(bound: Any, t: Any) -> bool:
            calls["within"] += 1
            got = within(bound, t)
            assert got == reference_within(bound, t)
            return got

        def spy_match(*a: Any) -> Any:
            calls["walks"] += 1
            return match_keyed(*a)

        want: list[dict[str, Any]] = []

        def spy_start(e: EndpointState, rid_: Any, now_: float, **kw: Any) -> None:
            calls["start"] += 1
            assert kw == want.pop()
            start(e, rid_, now_, **kw)

        EndpointState.start = spy_start  # type: ignore[method-assign]
        p._choice = spy_choice  # type: ignore[method-assign]
        p.index.match_keyed = spy_match  # type: ignore[method-assign]
        picker_mod._within = spy_within
        # Prompts as chains sharing prefixes: agents' steps extending earlier ones, a hub.
        hub = [rng.getrandbits(64) for _ in range(6)]
        chains = [hub + [rng.getrandbits(64) for _ in range(30)] for _ in range(4)]
        chains += [[rng.getrandbits(64) for _ in range(30)] for _ in range(2)]
        inflight: list[tuple[EndpointState, int]] = []
        out: list[Any] = []
        now = 1.0
        for rid in range(steps):
            now += rng.random() * 0.05
            x = rng.random()
            if x < 0.05:
                _report(rng, rng.choice(eps), now)
            elif x < 0.08:
                rng.choice(eps).set_flags(ramp=rng.choice([None, 0.2, 1.0]))
            elif x < 0.10:
                now += rng.random() * 5  # prefix entries expire (a finite TTL)
            chain = chains[rng.randrange(len(chains))]
            req = PickRequest(
                "m",
                chain[: rng.randrange(0, len(chain) + 1)],
                prompt_tokens=rng.randrange(1, 20_000),
                max_tokens=rng.randrange(-1, 800),
                priority=rng.choice([None, None, rng.randrange(-2, 12)]),
                context_key=rng.choice([None, None, "a", "b", f"t{rid % 7}"]),
                deadline_s=rng.choice([None, None, now + rng.random() * 0.5]),
            )
            out.append(("follow", p.follow_up(req, now)))
            y = rng.random()
            if y < 0.1:  # the index changes between the two: another request's pick
                other = chains[rng.randrange(len(chains))]
                p.pick(PickRequest("m", other[: rng.randrange(1, len(other))]), eps, now)
            elif y < 0.15:
                now += rng.random() * 2  # time passes (expiry may fall due)
            elif y < 0.2:
                p.index.demote(rng.choice(eps).name, 0.5)
            choices = p.pick(req, eps, now, record=rng.random() < 0.9)
            out.append(tuple(c[:10] + c[11:] for c in choices))
            out.append(("departure", p.last_departure, dict(p.departures)))
            if choices:
                k = rng.randrange(len(choices)) if rng.random() < 0.2 else 0
                c = choices[k]
                want.append(reference_start_kwargs(c, req))
                p.dispatch(c, req, rid, now, recorded=k == 0 and rng.random() < 0.9)
                assert not want
                inflight.append((c.state, rid))
            while len(inflight) > 4 or (inflight and rng.random() < 0.4):
                s, done = inflight.pop(rng.randrange(len(inflight)))
                s.first_token(done, now + rng.random() * 0.3)
                s.finish(done, now + rng.random() * 0.6)
        return out, calls
    finally:
        picker_mod._FAST_MATCH = saved
        picker_mod._within = within
        EndpointState.start = start  # type: ignore[method-assign]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_pick_answers_as_before(seed: int) -> None:
    fast, fast_calls = _drive(seed, True, 120)
    slow, slow_calls = _drive(seed, False, 120)
    assert fast == slow
    assert fast_calls["choice"] == slow_calls["choice"] > 0
    assert fast_calls["start"] == slow_calls["start"] > 0
    # The match is reused: fewer walks of the index than with every one walked.
    assert fast_calls["walks"] <= slow_calls["walks"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_pick_reuses_the_follow_ups_match(seed: int) -> None:
    fast, fast_calls = _drive(seed, True, 300)
    slow, slow_calls = _drive(seed, False, 300)
    assert fast == slow
    assert fast_calls["within"] > 0
    assert fast_calls["walks"] < slow_calls["walks"]


def test_admission_and_the_pick_walk_the_index_once() -> None:
    p = Picker()
    eps = [EndpointState(f"e{i}", url=f"http://e{i}", gpu="H100") for i in range(3)]
    walks = []
    match_keyed = p.index.match_keyed

    def spy(*a: Any) -> Any:
        walks.append(a)
        return match_keyed(*a)

    p.index.match_keyed = spy  # type: ignore[method-assign]
    chain = list(range(1, 40))
    for i in range(30):
        req = PickRequest("m", chain[: 5 + i], prompt_tokens=1000 + 64 * i)
        p.follow_up(req, 1.0 + i)
        c = p.pick(req, eps, 1.1 + i)[0]
        p.dispatch(c, req, i, 1.1 + i)
        assert len(walks) == i + 1


def test_order_builds_the_routes_as_before() -> None:
    router = PickerRouter([EndpointSpec(f"http://e{i}", gpu="H100") for i in range(3)])
    rng = random.Random(5)
    chain = [rng.getrandbits(64) for _ in range(12)]
    for i in range(40):
        now = 1.0 + 0.01 * i
        req = PickRequest("m", chain[: rng.randrange(0, 12)], prompt_tokens=rng.randrange(1, 900))
        record = rng.random() < 0.8
        routes = router.order(req, now, record=record)
        choices = [r.choice for r in routes]
        assert all(c is not None for c in choices)
        want = [
            Route(c.url, c.reason, c.predicted_ttft_s, c.cached_tokens, c, recorded=record)
            for c in choices
            if c is not None
        ]
        left = router.picker.last_departure
        if left is not None:
            want[0] = want[0]._replace(departure=left)
        assert routes == want
        assert [type(r) for r in routes] == [Route] * len(routes)
        router.started(routes[0], i, req, now)
        router.finished(routes[0], i, req, now + 0.005, ok=True)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), ttl=st.sampled_from([math.inf, 0.3, 2.0]))
def test_a_keyed_match_holds_while_its_version_does(seed: int, ttl: float) -> None:
    # Whatever happens to the index (records, stores, removals, truncation, trust, capacity,
    # expiry, endpoints leaving), a match kept with its version answers as a fresh one at any
    # later time before its `until`, while the version has not moved.
    from filters.prefix_index import PrefixIndex

    rng = random.Random(seed)
    index = PrefixIndex(ttl_s=ttl, track_blocks=True, expire_budget=rng.choice([1, 8]))
    names = ["a", "b", "c"]
    base = [rng.getrandbits(64) for _ in range(12)]
    chains = [base[: rng.randrange(1, 12)] + [rng.getrandbits(64) for _ in range(8)] for _ in "xyz"]
    kept: list[Any] = []
    now = 0.0
    for _ in range(150):
        now += rng.random() * 0.2
        chain = rng.choice(chains)[: rng.randrange(1, 20)]
        name = rng.choice(names)
        op = rng.random()
        if op < 0.35:
            index.record(name, chain, now)
        elif op < 0.45:
            index.store(name, chain, now)
        elif op < 0.5:
            index.remove(name, chain[rng.randrange(len(chain)) :], now)
        elif op < 0.55:
            index.truncate(name, chain, rng.randrange(len(chain) + 1))
        elif op < 0.6:
            index.demote(name, rng.random())
        elif op < 0.63:
            index.restore(name)
        elif op < 0.68:
            index.set_capacity(name, rng.randrange(0, 30))
        elif op < 0.7:
            index.forget(name)
        elif op < 0.72:
            index.expire(now)
        else:
            kept.append((chain, index.match_keyed(chain, now)))
        for chain, (version, until, answer) in kept[-5:]:
            if index.version == version and now < until:
                assert index.match_detail(chain, now) == answer
