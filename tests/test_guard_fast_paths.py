"""The guard's work after an attempt ends skips what cannot change anything, and decides as
its general path does: `_publish` passes over an endpoint that is healthy, not ramping and
last published so without `_publish_one`, and `Admission.next` with nothing queued returns
before `_expire`. Random sequences of gates, screens, attempts (every kind of end), pumps,
ticks, releases, requeues, restarts, joins and leaves give the same answers and state with
the skips as with every endpoint and call taken the general way."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from filters.admission import Admission, AdmissionConfig, AdmissionItem
from filters.guard import EndpointFlags, GuardConfig, PoolGuard
from filters.outlier import OutlierConfig
from filters.slow_start import SlowStartConfig
from filters.throttle import AdaptiveThrottleConfig
from filters.token_breaker import Limits, TokenBreakerConfig

URLS = ("a", "b", "c", "d")


class _Route:
    __slots__ = ("url",)

    def __init__(self, url: str) -> None:
        self.url = url

    def __repr__(self) -> str:
        return f"R({self.url})"


class _PublishEach(PoolGuard):
    """Every endpoint through _publish_one (the reference for _publish's skip)."""

    def _publish(self, urls: Iterable[str], now: float) -> list[EndpointFlags]:
        out = []
        for url in urls:
            ejected = self.outlier is not None and self.outlier.ejected(url, now)
            state = self.breaker.state(url, now) if self.breaker is not None else "closed"
            flags = self._publish_one(url, now, state, ejected)
            if flags is not None:
                out.append(flags)
        return out


class _ExpireFirst(Admission):
    """next() always expires first (the reference for its early return)."""

    def next(self, now: float) -> AdmissionItem | None:
        self._expire(now)
        return super().next(now)


class _Rng:
    def __init__(self, values: list[float]) -> None:
        self.values, self.i = values, 0

    def random(self) -> float:
        self.i += 1
        return self.values[self.i % len(self.values)]


_ENDS: list[dict[str, Any]] = [
    {"status": 200, "completion_tokens": 5},
    {"status": 200},
    {"status": 503},
    {"status": 429},
    {"status": 500},
    {"status": 502},
    {"local_failure": True},
    {"status": 200, "cancelled": True},
    {"cancelled": True},
    {"status": 200, "local_failure": True},
]
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("gate"), st.sampled_from([None, 1, 5, 9]), st.booleans()),
        st.tuples(
            st.just("screen"),
            st.lists(st.sampled_from(URLS), min_size=1, max_size=4),
            st.sampled_from([10, 200, 600]),
        ),
        st.tuples(st.just("start"), st.sampled_from(URLS), st.sampled_from([0, 1, 10, 300])),
        st.tuples(st.just("first"), st.integers(0, 30), st.sampled_from([None, 0.05])),
        st.tuples(st.just("end"), st.integers(0, 30), st.integers(0, len(_ENDS) - 1)),
        st.tuples(st.just("release"), st.integers(0, 30), st.just(0)),
        st.tuples(st.just("requeue"), st.integers(0, 30), st.just(0)),
        st.tuples(st.sampled_from(["tick", "pump", "flags"]), st.just(0), st.just(0)),
        st.tuples(
            st.sampled_from(["restarted", "add", "remove"]), st.sampled_from(URLS), st.just(0)
        ),
    ),
    max_size=80,
)
_configs = {
    "default": GuardConfig(),
    "tight": GuardConfig(
        throttle=AdaptiveThrottleConfig(min_requests=3, window_s=10.0),
        admission=AdmissionConfig(max_in_flight=2, max_queued=4),
        breaker=TokenBreakerConfig(
            endpoint_limits=Limits(max_tokens=500, max_requests=2, max_pending=2),
            consecutive_failures=2,
            open_base_s=0.5,
            half_open_successes=1,
        ),
        outlier=OutlierConfig(consecutive_5xx=2, base_ejection_time_s=1.0, interval_s=2.0),
        slow_start=SlowStartConfig(window_s=3.0, min_weight_percent=20.0),
    ),
    # A half-open endpoint at full weight: sick, yet its flags are the healthy ones.
    "flat ramp": GuardConfig(
        throttle=None,
        admission=None,
        breaker=TokenBreakerConfig(consecutive_failures=1, open_base_s=0.5, half_open_successes=1),
        outlier=None,
        slow_start=SlowStartConfig(window_s=3.0, min_weight_percent=100.0),
    ),
}


def _run(general: bool, config: GuardConfig, ops: list[Any], gaps: list[float],
         draws: list[float]) -> list[Any]:  # fmt: skip
    g = (_PublishEach if general else PoolGuard)(config, URLS[:3])
    if general and config.admission is not None:
        g.admission = _ExpireFirst(config.admission)
    rng = _Rng(draws)
    out: list[Any] = []
    now, ids = 0.0, 0
    started: list[tuple[int, str]] = []
    admitted: list[int] = []
    for i, (op, a, b) in enumerate(ops):
        now += gaps[i % len(gaps)]
        try:
            if op == "gate":
                ids += 1
                d = g.gate(AdmissionItem(ids, priority=a, started=b), now, rng)
                out.append(repr(d))
                if type(d).__name__ in ("Admit", "Queue"):
                    admitted.append(ids)
            elif op == "screen":
                out.append(repr(g.screen([_Route(u) for u in a], b, None, now)))
            elif op == "start":
                ids += 1
                g.started(a, ids, b, now, model="m")
                started.append((ids, a))
            elif op == "first" and started:
                g.first_token(started[a % len(started)][0], now, predicted_ttft_s=b)
            elif op == "end" and started:
                rid, url = started.pop(a % len(started))
                g.finished(url, rid, now, **_ENDS[b])
            elif op == "release" and admitted:
                g.release(admitted.pop(a % len(admitted)), now)
                out.append(repr(g.pump(now)))
            elif op == "requeue" and admitted:
                g.requeue(admitted[a % len(admitted)], now)
                out.append(repr(g.pump(now)))
            elif op == "tick":
                out.append(repr(g.tick(now)))
            elif op == "pump":
                out.append(repr(g.pump(now)))
            elif op == "flags":
                out.append([g.flags(u, now) for u in URLS])
            elif op == "restarted":
                g.restarted(a, now)
            elif op == "add":
                g.add(a, now=now)
            elif op == "remove":
                g.remove(a)
        except (KeyError, ValueError) as exc:
            out.append(type(exc).__name__)
        out.append((sorted(g._published.items()), sorted(g._sick), g.queued, g.in_flight))
    return out


@settings(max_examples=300, deadline=None)
@given(
    config=st.sampled_from(sorted(_configs)),
    ops=_ops,
    gaps=st.lists(st.sampled_from([0.0, 0.01, 0.2, 0.7, 2.0]), min_size=1, max_size=4),
    draws=st.lists(st.sampled_from([0.0, 0.5, 0.99]), min_size=1, max_size=3),
)
def test_the_skips_answer_as_the_general_path(
    config: str, ops: list[Any], gaps: list[float], draws: list[float]
) -> None:
    cfg = _configs[config]
    assert _run(False, cfg, ops, gaps, draws) == _run(True, cfg, ops, gaps, draws)


def test_an_endpoint_back_from_half_open_at_full_weight_is_observed() -> None:
    # Sick (its breaker tripped) though its half-open flags were the healthy ones (a ramp
    # from 100%): its close is still observed, so it leaves the sick set.
    ops: list[Any] = [
        ("start", "a", 10),
        ("end", 0, 6),  # a connection failure trips it
        ("pump", 0, 0),
        ("tick", 0, 0),
        ("start", "a", 10),  # the probe, 0.6 s later
        ("end", 0, 0),  # succeeds: closed
        ("pump", 0, 0),
    ]
    fast = _run(False, _configs["flat ramp"], ops, [0.0, 0.0, 0.0, 0.6, 0.0], [0.5])
    assert fast[-1][1] == []  # nothing sick
    assert fast == _run(True, _configs["flat ramp"], ops, [0.0, 0.0, 0.0, 0.6, 0.0], [0.5])
