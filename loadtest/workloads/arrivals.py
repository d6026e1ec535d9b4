"""Open-loop arrival processes: Poisson and bursty (two-state Markov-modulated Poisson).

Each function returns n increasing arrival times in seconds, drawn from the caller's
`random.Random`, so a seed fixes the whole schedule.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Burst:
    """Shape of bursty arrivals; see `bursty`.

    factor: arrival rate in the ON state divided by the long-run mean rate (>= 1).
    on_s, off_s: mean durations of the ON and OFF states, seconds.
    """

    factor: float = 3.0
    on_s: float = 2.0
    off_s: float = 6.0


def _check_rate(rate: float, n: int) -> None:
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"arrival rate must be finite and > 0, got {rate}")
    if n < 0:
        raise ValueError(f"number of arrivals must be >= 0, got {n}")


def poisson(rate: float, n: int, rng: random.Random, start_s: float = 0.0) -> list[float]:
    """n arrivals of a Poisson process of `rate` per second: exponential gaps from start_s."""
    _check_rate(rate, n)
    t = start_s
    times: list[float] = []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def bursty(
    rate: float,
    n: int,
    rng: random.Random,
    burst_factor: float = 3.0,
    on_s: float = 2.0,
    off_s: float = 6.0,
    start_s: float = 0.0,
) -> list[float]:
    """n arrivals of an ON/OFF Markov-modulated Poisson process with mean rate `rate`.

    The process alternates ON and OFF states with exponential durations of mean on_s and
    off_s, starting in a state drawn from the stationary distribution. In ON it arrives at
    rate_on = burst_factor * rate; in OFF at rate_off, chosen so that the long-run mean is
    `rate`: rate_off = rate * (1 + (1 - burst_factor) * on_s / off_s). That needs
    1 <= burst_factor <= 1 + off_s / on_s; at the upper limit OFF is silent. By
    memorylessness, drawing the next gap afresh at each state switch is exact.
    """
    _check_rate(rate, n)
    if not (on_s > 0 and off_s > 0 and math.isfinite(on_s) and math.isfinite(off_s)):
        raise ValueError(f"on_s and off_s must be finite and > 0, got {on_s}, {off_s}")
    limit = 1 + off_s / on_s
    if not 1 <= burst_factor <= limit:
        raise ValueError(
            f"burst_factor must be in [1, 1 + off_s/on_s = {limit:g}], got {burst_factor}"
        )
    rate_on = burst_factor * rate
    rate_off = max(0.0, rate * (1 + (1 - burst_factor) * on_s / off_s))
    on = rng.random() < on_s / (on_s + off_s)
    t = start_s
    state_end = t + rng.expovariate(1 / (on_s if on else off_s))
    times: list[float] = []
    while len(times) < n:
        current = rate_on if on else rate_off
        candidate = t + rng.expovariate(current) if current > 0 else math.inf
        if candidate < state_end:
            t = candidate
            times.append(t)
        else:
            t = state_end
            on = not on
            state_end = t + rng.expovariate(1 / (on_s if on else off_s))
    return times


def arrival_times(
    rate: float, n: int, rng: random.Random, burst: Burst | None = None
) -> list[float]:
    """Poisson arrivals at `rate`, or bursty ones of the same mean rate when `burst` is set."""
    if burst is None:
        return poisson(rate, n, rng)
    return bursty(rate, n, rng, burst.factor, burst.on_s, burst.off_s)
