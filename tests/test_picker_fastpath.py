"""The compiled picker's fast paths give exactly what the slow paths give: the loop's
direct slot reads (filters._picker_c.bind_slots) against its getattr path and the pure
Python loop, and the C sort of the candidates against list.sort(), across the state
changes a pool sees (load reports, flags, new and departed endpoints, time passing)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_picker_twins import compiled

import filters.picker as picker_mod
from filters.endpoint_state import EndpointState, ReportedState
from filters.kv_digest import Digest
from filters.picker import Picker, PickerConfig, PickRequest, price_candidates, sort_candidates
from filters.pool_router import EndpointSpec, PickerRouter

needs_compiled = pytest.mark.skipif(
    compiled is None or not hasattr(compiled, "bind_slots"),
    reason="compiled twin filters._picker_c not built (run setup.py build_ext --inplace)",
)

GPUS = ("A100", "H100", "H200", "B200")


class _SubState(EndpointState):
    """Not exactly EndpointState: the loop must take the getattr path for it."""

    __slots__ = ()


def _report(rng: random.Random, e: EndpointState, now: float) -> None:
    e.report(
        ReportedState(
            epoch=rng.randrange(1, 3),
            kv_block_size=16,
            kv_capacity_blocks=rng.randrange(500, 60_000),
            kv_usage=rng.random() * 0.9,
            requests_running=rng.randrange(0, 60),
            requests_waiting=rng.randrange(0, 5),
            models={"m": True, "n": rng.random() < 0.5},
        ),
        now,
    )


def _drive(
    seed: int,
    price: Callable[..., Any],
    sort: Callable[[list[Any]], None],
    picks: int = 700,
) -> list[tuple[Any, ...]]:
    """A pool's life with one implementation: every pick's answer (less the state)."""
    saved = picker_mod._price, picker_mod._sort
    picker_mod._price, picker_mod._sort = price, sort
    try:
        rng = random.Random(seed)
        eps: list[EndpointState] = []
        for i in range(24):
            cls = _SubState if i % 5 == 0 else EndpointState
            e = cls(f"m{i:02d}", url=f"http://m{i}", gpu=GPUS[i % 4])
            _report(rng, e, 0.0)
            eps.append(e)
        p = Picker()
        chains = [[rng.getrandbits(64) for _ in range(rng.randrange(1, 120))] for _ in range(12)]
        inflight: list[tuple[EndpointState, int]] = []
        out: list[tuple[Any, ...]] = []
        now = 1.0
        for rid in range(picks):
            now += rng.random() * 0.05
            x = rng.random()
            if x < 0.04:  # a load report
                _report(rng, rng.choice(eps), now)
            elif x < 0.06:  # flags
                rng.choice(eps).set_flags(
                    draining=rng.random() < 0.3,
                    ramp=rng.choice([None, 0.2, 1.0]),
                    breaker_open=rng.random() < 0.2,
                )
            elif x < 0.07:  # a new endpoint
                e = EndpointState(f"n{rid}", url=f"http://n{rid}", gpu=rng.choice(GPUS))
                _report(rng, e, now)
                eps.append(e)
            elif x < 0.075 and len(eps) > 8:  # one leaves
                gone = eps.pop(rng.randrange(len(eps)))
                p.forget(gone.name)
            elif x < 0.09:  # time passes: reports go stale, the index expires
                now += rng.random() * 200
            chain = chains[rng.randrange(len(chains))]
            req = PickRequest(
                rng.choice(["m", "m", "n"]),
                chain[: rng.randrange(1, len(chain) + 1)],
                prompt_tokens=rng.randrange(1, 40_000),
                max_tokens=rng.randrange(0, 800),
                priority=rng.choice([None, rng.randrange(0, 10)]),
                context_key=rng.choice([None, "a", "b", "c"]),
                deadline_s=rng.choice([None, now + rng.random() * 3]),
                adapter=rng.choice([None, None, "lora1"]),
            )
            # Duplicates in the endpoint list now and then (the loop skips them).
            pool = [*eps, eps[0]] if rid % 17 == 0 else eps
            choices = p.pick(req, pool, now)
            out.append(tuple(c[:10] for c in choices))
            if choices:
                k = rng.randrange(len(choices)) if rng.random() < 0.1 else 0
                p.dispatch(choices[k], req, rid, now)
                inflight.append((choices[k].state, rid))
            while inflight and rng.random() < 0.5:
                st_, done = inflight.pop(rng.randrange(len(inflight)))
                st_.first_token(done, now + rng.random() * 0.5)
                st_.finish(done, now + rng.random())
        return out
    finally:
        picker_mod._price, picker_mod._sort = saved


@needs_compiled
def test_bind_slots_accepts_the_picker_classes_and_refuses_others() -> None:
    assert compiled is not None
    try:
        assert compiled.bind_slots(EndpointState, picker_mod._View) is True

        class NoSlots:
            pass

        class Custom:
            __slots__ = ("_pick_view", "kc", "kkey", "stamp")

            def __getattribute__(self, name: str) -> Any:
                return object.__getattribute__(self, name)

        assert compiled.bind_slots(NoSlots, picker_mod._View) is False
        assert compiled.bind_slots(EndpointState, NoSlots) is False
        assert compiled.bind_slots(EndpointState, Custom) is False
    finally:
        assert compiled.bind_slots(EndpointState, picker_mod._View) is True


@needs_compiled
@pytest.mark.parametrize("seed", [1, 2])
def test_direct_slot_reads_agree_with_getattr_and_pure_python(seed: int) -> None:
    assert compiled is not None
    fast = _drive(seed, compiled.price_candidates, compiled.sort_candidates)
    pure = _drive(seed, price_candidates, sort_candidates)
    assert compiled.bind_slots(object, object) is False  # unbound: the getattr path
    try:
        slow = _drive(seed, compiled.price_candidates, compiled.sort_candidates)
    finally:
        assert compiled.bind_slots(EndpointState, picker_mod._View) is True
    assert fast == pure
    assert slow == pure
    assert sum(1 for picks in fast if picks) > 300  # the run really picked


@needs_compiled
def test_unset_slot_raises_as_getattr_does() -> None:
    """A view whose kc slot was never set: AttributeError, as the reference raises."""
    assert compiled is not None
    e = EndpointState("a", url="http://a", gpu="H100")
    v = picker_mod._View()
    v.kkey = ("m", None)
    v.stamp = 0
    e._pick_view = v

    def refresh(e: Any, v: Any, kkey: Any, now: float) -> Any:
        raise AssertionError("not stale")

    for impl in (price_candidates, compiled.price_candidates):
        with pytest.raises(AttributeError):
            impl([e], v.kkey, 1, 10, 10, 0.01, 0.01, 0.01, refresh, None, None, 0.0)


# Few distinct J values (ties, -0.0 == 0.0, NaN) or many; lists longer than the C sort's
# 128-entry buffer too (they take the list.sort path).
j_values = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, 2.5, float("nan")]),
    st.floats(allow_nan=True, allow_infinity=True),
)


@needs_compiled
@settings(max_examples=150, deadline=None)
@given(
    rows=st.one_of(
        st.lists(j_values, min_size=100, max_size=300),
        st.lists(st.floats(-1e9, 1e9), min_size=100, max_size=300, unique=True),
    )
)
def test_long_candidate_lists_sort_as_list_sort(rows: list[float]) -> None:
    assert compiled is not None
    views = [object() for _ in rows]
    cands = [(j, f"e{i:03d}", v) for i, (j, v) in enumerate(zip(rows, views, strict=True))]
    random.Random(len(rows)).shuffle(cands)
    want = list(cands)
    sort_candidates(want)
    got = list(cands)
    compiled.sort_candidates(got)
    assert [id(t[2]) for t in got] == [id(t[2]) for t in want]


@needs_compiled
@settings(max_examples=150, deadline=None)
@given(
    rows=st.one_of(
        st.lists(j_values, min_size=2, max_size=128),
        st.lists(st.floats(-1e9, 1e9), min_size=2, max_size=128, unique=True),
    )
)
def test_short_candidate_lists_sort_as_list_sort(rows: list[float]) -> None:
    """Up to 128: the C insertion sort (distinct J), else the tuple sort."""
    assert compiled is not None
    cands = [(j, f"e{i:03d}", object()) for i, j in enumerate(rows)]
    random.Random(len(rows)).shuffle(cands)
    want = list(cands)
    sort_candidates(want)
    got = list(cands)
    compiled.sort_candidates(got)
    assert [id(t[2]) for t in got] == [id(t[2]) for t in want]


def _chained(xs: list[int]) -> list[int]:
    out, h = [], 17
    for x in xs:
        h = hash((h, x)) & 0xFFFFFFFFFFFFFFFF
        out.append(h)
    return out


def _drive_router(
    seed: int,
    n_eps: int,
    picks: int,
    price: Callable[..., Any],
    sort: Callable[[list[Any]], None],
) -> list[str]:
    """The sidecar's router (PickerRouter) through what its PoolGuard and control feed hand
    it: flags (breaker open, ejected, slow-start ramp), reports (fresh, stale, withdrawn,
    unhealthy, draining, odd GPUs), digests (precise prefixes), connect failures and
    outcomes; identical endpoints (J ties) in some pools, lambda = inf (NaN J) in some."""
    saved = picker_mod._price, picker_mod._sort
    picker_mod._price, picker_mod._sort = price, sort
    try:
        rng = random.Random(seed)
        same = seed % 2 == 0
        specs = [
            EndpointSpec(
                f"http://10.0.{i // 250}.{i % 250}:8000",
                gpu="H100" if same else rng.choice([*GPUS, "unknown"]),
                kv_capacity_tokens=rng.choice([None, 8192, 100_000]),
            )
            for i in range(n_eps)
        ]
        config = [
            None,
            PickerConfig(max_choices=None),
            PickerConfig(load_metric="tokens"),
            PickerConfig(lambda_usd_per_s=float("inf")),
        ][seed % 4]
        router = PickerRouter(specs, config)
        chains = [
            _chained([rng.getrandbits(64) for _ in range(rng.randrange(4, 200))]) for _ in range(8)
        ]
        seqs: dict[str, int] = {}
        live: list[tuple[Any, int, PickRequest]] = []
        out: list[str] = []
        now = 10.0
        for rid in range(picks):
            now += rng.choice([0.0, 0.001, 0.01, 0.1, 0.5]) * rng.random()
            if rng.random() < 0.01:
                now += rng.random() * 150  # reports go stale, index entries expire
            for _ in range(rng.choice([0, 0, 1, 3])):
                s = rng.choice(router.states)
                x = rng.random()
                if x < 0.25:
                    router.set_flags(
                        s.url,
                        breaker_open=rng.random() < 0.4,
                        ejected_until=rng.choice([None, now + rng.random() * 3, now - 1]),
                        ramp=rng.choice([1.0, 1.0, 0.05, 0.5]),
                        now=now,
                    )
                elif x < 0.6:
                    state = ReportedState(
                        epoch=rng.choice([1, 1, 1, 2]),
                        healthy=rng.random() < 0.95,
                        draining=rng.random() < 0.03,
                        kv_block_size=16,
                        kv_capacity_blocks=rng.choice([None, 512, 6000]),
                        kv_usage=rng.choice([rng.random(), 0.0, 1.0]),
                        requests_running=rng.randrange(0, 300),
                        requests_waiting=rng.randrange(0, 30),
                        tokens_in_flight=rng.randrange(0, 50_000),
                        gpu=rng.choice([None, "H100", "A100"]),
                        gpu_count=rng.choice([None, 1, 8]),
                        models=rng.choice([{}, {"m": True}, {"m": False}]),
                        adapters=rng.choice([{}, {"a": True}, {"a": False}]),
                    )
                    router.report(s.url, state, now, ttl_s=rng.choice([1.0, 30.0]))
                elif x < 0.65:
                    router.report(s.url, None, now, ttl_s=30.0)
                elif x < 0.85:
                    c = rng.choice(chains)
                    q = seqs[s.url] = seqs.get(s.url, 0) + 1
                    full = q == 1 or rng.random() < 0.3
                    digest = Digest(
                        engine=s.url,
                        epoch="e1",
                        seq=q,
                        base_seq=q if full else 1,
                        full=full,
                        block_size=16,
                        added=tuple(c[: rng.randrange(1, len(c) + 1)]),
                    )
                    router.apply_digest(s.url, digest, now)
                else:
                    router.apply_digest(s.url, None, now)
            c = rng.choice(chains)
            hashes = c[: rng.randrange(0, len(c) + 1)]
            req = PickRequest(
                rng.choice(["m", "m", "n"]),
                hashes,
                prompt_tokens=rng.choice([1, 16 * len(hashes) + 5, 40_000]),
                max_tokens=rng.choice([0, 256, 4096]),
                adapter=rng.choice([None, None, "a"]),
                priority=rng.choice([None, 0, 9]),
                deadline_s=rng.choice([None, None, now + 0.05, now + 30]),
                context_key=rng.choice([None, "w1", f"w{rid % 7}"]),
            )
            routes = router.order(req, now)
            # repr: bit for bit, and a NaN score equals itself
            out.append(
                repr([(r.url, r.reason, r.choice[:10] if r.choice else None) for r in routes])
            )
            if routes:
                r = routes[0]
                if rng.random() < 0.05 and len(routes) > 1:
                    router.started(r, -rid, req, now)
                    router.connect_failed(r, -rid, now, "refused")
                    r = routes[1]
                router.started(r, rid, req, now)
                live.append((r, rid, req))
            if len(live) > rng.randrange(1, 40):
                r, i, q_ = live.pop(rng.randrange(len(live)))
                router.first_token(r, i, now)
                router.finished(r, i, q_, now, ok=rng.random() < 0.97, cached_tokens=None)
        return out
    finally:
        picker_mod._price, picker_mod._sort = saved


@needs_compiled
@pytest.mark.parametrize(("seed", "n_eps"), [(1, 5), (2, 64), (3, 64), (4, 200), (7, 200)])
def test_the_sidecars_router_decides_alike_on_every_path(seed: int, n_eps: int) -> None:
    """What ff602d7 was reverted for (the demo's hit rate fell): the same routes, reasons and
    figures from the slot reads, the getattr path and pure Python, on the router's inputs."""
    assert compiled is not None
    picks = 300 if n_eps > 100 else 500
    fast = _drive_router(seed, n_eps, picks, compiled.price_candidates, compiled.sort_candidates)
    pure = _drive_router(seed, n_eps, picks, price_candidates, sort_candidates)
    assert compiled.bind_slots(object, object) is False
    try:
        slow = _drive_router(
            seed, n_eps, picks, compiled.price_candidates, compiled.sort_candidates
        )
    finally:
        assert compiled.bind_slots(EndpointState, picker_mod._View) is True
    assert fast == pure
    assert slow == pure
    assert sum(1 for routes in fast if "sticky" in routes or "cold-hash" in routes) > picks // 10
    assert ("nan" in "".join(fast)) == (seed % 4 == 3)  # lambda = inf: NaN J
