"""Picker._view's fast paths give exactly what the general path gives: the calibration's
common case in line (against Picker._calibration), the last request class's constants
built with the view (against Picker._constants from the hot loop), pool_wait's queue in
line (against _queue_now) and follow_up's loop (against any() over a generator), across
the state changes a pool sees (load reports, flags, samples finishing, new and departed
endpoints, time passing). filters.picker._FAST_VIEW false takes the general path each
time."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from functools import partial
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import filters.picker as picker_mod
from filters.endpoint_state import EndpointState, ReportedState
from filters.picker import Picker, PickerConfig, PickRequest

GPUS = ("A100", "H100", "H100", "B200")  # H100s share a calibration class


def _report(rng: random.Random, e: EndpointState, now: float) -> None:
    e.report(
        ReportedState(
            epoch=rng.randrange(1, 3),
            kv_block_size=16,
            kv_capacity_blocks=rng.randrange(200, 60_000),
            kv_usage=rng.random() * 0.95,
            requests_running=rng.randrange(0, 60),
            requests_waiting=rng.randrange(0, 5),
            models={"m": True, "n": rng.random() < 0.5},
        ),
        now,
    )


def reference_pool_wait(
    p: Picker, endpoints: Sequence[EndpointState], now: float, stop_below: float
) -> float | None:
    """Picker.pool_wait as it was, through _queue_now."""
    best = math.inf
    for e in endpoints:
        v = e._pick_view
        if v is None or v.picker is not p or now >= v.until:
            v = p._view(e, now)
        if v.why is not None:
            continue
        q = picker_mod._queue_now(v, now)
        n = e.outstanding
        typical = e.prompt_tokens_avg + (e.output_tokens_in_flight / n if n else 0.0)
        excess = v.kv_used + typical - v.kv_cap
        if excess > 0.0:
            q += excess * v.kv_wait_per_token
        if q < best:
            best = q
            if q < stop_below:
                break
    return None if best == math.inf else best


def reference_follow_up(p: Picker, req: PickRequest, now: float) -> bool:
    """Picker.follow_up as it was, through any() over a generator."""
    key = req.context_key
    if key is not None:
        task = p._tasks.get(key)
        if task is not None and now - task.at <= p.config.task_ttl_s:
            return True
    hashes = req.block_hashes
    if not hashes:
        return False
    need = picker_mod.FOLLOW_UP_FRACTION * len(hashes)
    return any(m[0] >= need for m in p.index.match_detail(hashes, now).values())


def _views(p: Picker, eps: Sequence[EndpointState]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for e in eps:
        v = e._pick_view
        if v is not None and v.picker is p:
            out.append((e.name, v.cal, v.q, v.load, v.kkey, v.kc if v.kkey else None))
    return out


def _drive(
    seed: int, fast: bool, steps: int, reports: float, settle: int, mixed: bool = True
) -> tuple[list[tuple[Any, ...]], dict[str, int]]:
    """A pool's life with the fast paths on or off (pool_wait and follow_up, or the
    references): every answer, and the general path's calls (_calibration, _constants)."""
    saved = picker_mod._FAST_VIEW
    picker_mod._FAST_VIEW = fast
    try:
        rng = random.Random(seed)
        eps: list[EndpointState] = []
        for i in range(rng.randrange(2, 10)):
            e = EndpointState(f"m{i:02d}", url=f"http://m{i}", gpu=GPUS[i % 4])
            if rng.random() < 0.5:
                _report(rng, e, 0.0)
            eps.append(e)
        p = Picker(PickerConfig(decode_pricing=rng.choice(["batch", "reference"])))
        calls = {"_calibration": 0, "_constants": 0}
        for name in calls:
            method = getattr(p, name)

            def counted(*a: Any, _m: Any = method, _n: str = name) -> Any:
                calls[_n] += 1
                return _m(*a)

            setattr(p, name, counted)
        wait_of = p.pool_wait if fast else partial(reference_pool_wait, p)
        follow_of = p.follow_up if fast else partial(reference_follow_up, p)
        chains = [[rng.getrandbits(64) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
        inflight: list[tuple[EndpointState, int]] = []
        out: list[tuple[Any, ...]] = []
        now = 1.0
        for rid in range(steps):
            now += rng.random() * 0.05
            x = rng.random()
            if x < reports:  # a load report
                _report(rng, rng.choice(eps), now)
            elif x < reports + 0.02:  # flags
                rng.choice(eps).set_flags(
                    draining=rng.random() < 0.2,
                    ramp=rng.choice([None, 0.2, 1.0]),
                    breaker_open=rng.random() < 0.2,
                )
            elif x < reports + 0.03:  # a new endpoint
                e = EndpointState(f"n{rid}", url=f"http://n{rid}", gpu=rng.choice(GPUS))
                eps.append(e)
            elif x < reports + 0.035 and len(eps) > 2:  # one leaves
                gone = eps.pop(rng.randrange(len(eps)))
                inflight = [(s, r) for s, r in inflight if s is not gone]
                p.forget(gone.name)
            elif x < reports + 0.05:  # time passes: calibrations age, reports go stale
                now += rng.random() * 30
            chain = chains[rng.randrange(len(chains))]
            req = PickRequest(
                rng.choice(["m", "m", "m", "n"]) if mixed else "m",
                chain[: rng.randrange(0, len(chain) + 1)],
                prompt_tokens=rng.randrange(1, 20_000),
                max_tokens=rng.randrange(0, 800),
                priority=rng.choice([None, None, rng.randrange(0, 10)]),
                context_key=rng.choice([None, "a", "b"]),
                adapter=rng.choice([None, None, None, "lora1"]) if mixed else None,
            )
            stop = rng.choice([-math.inf, 0.0, 0.05, 2.0, math.inf])
            out.append(("wait", wait_of(eps, now, stop)))
            out.append(("follow", follow_of(req, now)))
            choices = p.pick(req, eps, now)
            out.append(tuple(c[:10] + c[11:] for c in choices))
            if choices:
                k = rng.randrange(len(choices)) if rng.random() < 0.1 else 0
                p.dispatch(choices[k], req, rid, now)
                inflight.append((choices[k].state, rid))
            while len(inflight) > settle or (inflight and rng.random() < 0.4):
                s, done = inflight.pop(rng.randrange(len(inflight)))
                if rng.random() < 0.9:
                    # TTFT off the prediction either way: the calibrations move.
                    s.first_token(done, now + rng.random() * 0.3)
                    s.finish(done, now + rng.random() * 0.6)
                else:
                    s.finish(done, now, ok=False)
            out.append(("views", _views(p, eps)))
        return out, calls
    finally:
        picker_mod._FAST_VIEW = saved


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    reports=st.sampled_from([0.0, 0.03, 0.2]),
    settle=st.integers(0, 6),
)
def test_fast_view_answers_as_the_general_path(seed: int, reports: float, settle: int) -> None:
    fast, fast_calls = _drive(seed, True, 150, reports, settle)
    slow, slow_calls = _drive(seed, False, 150, reports, settle)
    assert fast == slow
    # The fast paths were taken: the general path's calls are the exceptions.
    assert fast_calls["_calibration"] <= slow_calls["_calibration"]
    assert fast_calls["_constants"] <= slow_calls["_constants"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_fast_paths_are_the_common_case(seed: int) -> None:
    # One request class, no reports: after its first picks a pool rebuilds its views from the
    # fast paths; the general path only for a new endpoint, class or static change.
    fast, fast_calls = _drive(seed, True, 400, 0.0, 2, mixed=False)
    slow, slow_calls = _drive(seed, False, 400, 0.0, 2, mixed=False)
    assert fast == slow
    assert fast_calls["_calibration"] * 4 < slow_calls["_calibration"]
    assert fast_calls["_constants"] * 2 < slow_calls["_constants"]


def test_a_view_carries_its_last_class_constants_as_the_hot_loop_computes_them() -> None:
    rng = random.Random(7)
    eps = [EndpointState(f"e{i}", url=f"http://e{i}", gpu=GPUS[i % 4]) for i in range(4)]
    p = Picker()
    req = PickRequest("m", (), prompt_tokens=900, max_tokens=100)
    for rid in range(60):
        now = 1.0 + rid * 0.01
        c = p.pick(req, eps, now)[0]
        p.dispatch(c, req, rid, now)
        if rid % 2:
            c.state.first_token(rid, now + rng.random() * 0.2)
            c.state.finish(rid, now + 0.3)
        for e in eps:
            v = p._view(e, now)
            if v.kkey is None:
                continue
            kc = v.kc
            v.kkey = None
            p._constants(v, e, v.kkey_cold, now)
            assert v.kc == kc
