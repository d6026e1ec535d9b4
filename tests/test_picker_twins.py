"""The picker's hot loop has a compiled twin (filters/_picker_c.pyx): both must give exactly
the same candidates, J values (bit for bit), sums, stamps and refresh calls."""

from __future__ import annotations

import importlib
import random
import types
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import filters.picker as picker_mod
from filters.endpoint_state import EndpointState, ReportedState
from filters.picker import Picker, PickRequest, price_candidates, sort_candidates

compiled: types.ModuleType | None
try:
    compiled = importlib.import_module("filters._picker_c")
except ImportError:  # pragma: no cover - depends on the build
    compiled = None

needs_compiled = pytest.mark.skipif(
    compiled is None,
    reason="compiled twin filters._picker_c not built (run setup.py build_ext --inplace)",
)

KKEY = ("m", None)
OTHER = ("m", "lora")


class _FakeView:
    __slots__ = ("kc", "kkey", "name", "stamp")

    def __init__(self, name: str, kkey: Any, kc: tuple[Any, ...] | None, stamp: int) -> None:
        self.name = name
        self.kkey = kkey
        self.kc = kc
        self.stamp = stamp


class _FakeEndpoint:
    __slots__ = ("_pick_view", "name", "next_kc")

    def __init__(self, name: str) -> None:
        self.name = name
        self._pick_view: _FakeView | None = None
        self.next_kc: tuple[Any, ...] | None = None


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
positive = st.floats(min_value=0.0, max_value=1e7, allow_nan=False, allow_infinity=False)
tiny = st.floats(min_value=0.0, max_value=1e-2, allow_nan=False, allow_infinity=False)
# (c0, s0, c1, s1, usd_per_out_tok, decode_span, decode_extra, free_kv, kvw, load, weight,
# then after the name: step, dcal x step_seq, dcal x step_kv, running, others_span)
span = st.one_of(st.just(float("inf")), positive)
kc_values = st.tuples(
    finite,
    positive,
    tiny,
    tiny,
    tiny,
    span,
    tiny,
    positive,
    tiny,
    positive,
    positive,
    tiny,
    tiny,
    tiny,
    st.integers(min_value=0, max_value=1024).map(float),
    span,
)
lambdas = st.one_of(st.just(0.0), st.floats(min_value=1e-6, max_value=10.0))
endpoint_spec = st.tuples(
    st.sampled_from(["fresh", "none", "other-class"]),
    st.one_of(st.none(), kc_values),  # the kc the view has (or gets from refresh)
    st.booleans(),  # stamped by this pick already (>= base)
)


def _world(
    specs: list[tuple[str, tuple[float, ...] | None, bool]], dup: list[int], base: int
) -> list[_FakeEndpoint]:
    eps = []
    for i, (state, values, stamped) in enumerate(specs):
        e = _FakeEndpoint(f"e{i:02d}")
        kc = None if values is None else (*values[:11], e.name, *values[11:])
        stamp = base + 100 if stamped else base - 1
        if state == "fresh":
            e._pick_view = _FakeView(e.name, KKEY, kc, stamp)
        elif state == "other-class":
            e._pick_view = _FakeView(e.name, OTHER, (0.0,) * 11 + (e.name,) + (0.0,) * 5, stamp)
            e.next_kc = kc
        else:
            e.next_kc = kc
        eps.append(e)
    return eps + [eps[i % len(eps)] for i in dup] if eps else eps


def _run(
    impl: Callable[..., tuple[list[Any], float, float]],
    specs: list[tuple[str, tuple[float, ...] | None, bool]],
    dup: list[int],
    big_p: int,
    big_m: int,
    lam: float,
    lam_d: float,
    lam_i: float,
    hooked: bool,
    big_w: float | None = None,
) -> tuple[Any, ...]:
    base = 1000
    eps = _world(specs, dup, base)
    calls: list[tuple[str, bool]] = []

    def refresh(e: _FakeEndpoint, v: _FakeView | None, kkey: Any, now: float) -> _FakeView:
        calls.append((e.name, v is None))
        nv = _FakeView(e.name, kkey, e.next_kc, base - 1 if v is None else v.stamp)
        e._pick_view = nv
        return nv

    hook = (lambda e, req, now: hash(e.name) % 3 != 0) if hooked else None
    cands, load_sum, weight_sum = impl(
        eps, KKEY, base, big_p, big_m, lam, lam_d, lam_i, refresh, hook, None, 5.0, big_w
    )
    stamps = [e._pick_view.stamp if e._pick_view is not None else None for e in eps]
    return [(j, name, v.name) for j, name, v in cands], load_sum, weight_sum, stamps, calls


@needs_compiled
@settings(max_examples=300, deadline=None)
@given(
    specs=st.lists(endpoint_spec, max_size=24),
    dup=st.lists(st.integers(min_value=0, max_value=23), max_size=3),
    big_p=st.integers(min_value=1, max_value=2_000_000),
    big_m=st.integers(min_value=0, max_value=100_000),
    lam=lambdas,
    lam_d=lambdas,
    lam_i=lambdas,
    hooked=st.booleans(),
    work=st.one_of(st.none(), st.floats(min_value=1.0, max_value=3.0)),
)
def test_compiled_loop_agrees_with_the_reference(
    specs: list[tuple[str, tuple[float, ...] | None, bool]],
    dup: list[int],
    big_p: int,
    big_m: int,
    lam: float,
    lam_d: float,
    lam_i: float,
    hooked: bool,
    work: float | None,
) -> None:
    assert compiled is not None
    # big_w: the prompt's prefill in tokens of linear work (attention makes it more).
    big_w = None if work is None else big_p * work
    args = (specs, dup, big_p, big_m, lam, lam_d, lam_i, hooked, big_w)
    want = _run(price_candidates, *args)
    got = _run(compiled.price_candidates, *args)
    assert got == want


# Few distinct J values, so ties (decided by the name) and -0.0 == 0.0 are common.
j_values = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, 2.5, float("nan")]),
    st.floats(allow_nan=True, allow_infinity=True),
)


@needs_compiled
@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(j_values, st.integers(min_value=0, max_value=99)), max_size=70))
def test_compiled_sort_agrees_with_the_reference(rows: list[tuple[float, int]]) -> None:
    assert compiled is not None
    views = [object() for _ in rows]
    # Unique names, as the picker's candidates have; J values repeat.
    cands = [(j, f"e{k:02d}-{i}", v) for i, ((j, k), v) in enumerate(zip(rows, views, strict=True))]
    want = list(cands)
    sort_candidates(want)
    got = list(cands)
    compiled.sort_candidates(got)
    assert [(id(t[2]), t[1]) for t in got] == [(id(t[2]), t[1]) for t in want]


def _fleet(seed: int) -> list[EndpointState]:
    rng = random.Random(seed)
    eps = []
    for i in range(12):
        e = EndpointState(f"e{i:02d}", url=f"http://e{i}", gpu=("A100", "H100", "H200")[i % 3])
        e.report(
            ReportedState(
                epoch=1,
                kv_block_size=16,
                kv_capacity_blocks=rng.randrange(500, 5000),
                kv_usage=rng.random() * 0.9,
                requests_running=rng.randrange(0, 40),
                requests_waiting=rng.randrange(0, 3),
                models={"m": True},
            ),
            0.0,
        )
        eps.append(e)
    return eps


def _drive(price: Callable[..., Any], seed: int) -> list[tuple[Any, ...]]:
    """A short run of picks, dispatches and completions with one implementation."""
    saved = picker_mod._price
    picker_mod._price = price
    try:
        rng = random.Random(seed)
        eps = _fleet(seed)
        p = Picker()
        chains = [[rng.getrandbits(64) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
        out: list[tuple[Any, ...]] = []
        inflight: list[tuple[EndpointState, int]] = []
        now = 1.0
        for rid in range(120):
            now += rng.random() * 0.2
            chain = chains[rng.randrange(len(chains))]
            req = PickRequest(
                "m",
                chain[: rng.randrange(1, len(chain) + 1)],
                prompt_tokens=rng.randrange(1, 9000),
                max_tokens=rng.randrange(0, 800),
                priority=rng.randrange(0, 10),
                context_key=rng.choice([None, "a", "b"]),
            )
            choices = p.pick(req, eps, now)
            out.append(tuple(c[:10] for c in choices))
            p.dispatch(choices[0], req, rid, now)
            inflight.append((choices[0].state, rid))
            if rng.random() < 0.5 and inflight:
                st_, done = inflight.pop(rng.randrange(len(inflight)))
                st_.first_token(done, now)
                st_.finish(done, now + rng.random())
        return out
    finally:
        picker_mod._price = saved


@needs_compiled
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_picks_agree_with_either_loop(seed: int) -> None:
    assert compiled is not None
    assert _drive(compiled.price_candidates, seed) == _drive(price_candidates, seed)
