"""An engine's own busy GPU-seconds, apportioned to the requests a sidecar sent it: the cost
ledger's engine-measured reading (filters/cost_ledger.py), where its batch model is only a
guess at how big the batches were. Sans-I/O: readings and finished work come with their time.

What counts as a reading: a counter of the seconds the engine's GPU was busy, on the
engine's /metrics page (the simulator's `meshd_sim:gpu_busy_seconds_total`; on a real GPU,
NVML's utilisation integrated over time would be one, which no agent reports yet).
vLLM v1 has no such series: its `vllm:request_prefill_time_seconds` and
`vllm:request_decode_time_seconds` histograms (vllm/v1/metrics/loggers.py; the intervals
SCHEDULED -> first NEW_TOKENS and first -> last NEW_TOKENS, docs/design/metrics.md) time each
request's phase on the wall clock while it shares every step with its batch, so their sums
are request-seconds (32 sequences decoding for 1 s add 32 s), not GPU-seconds; they are not
read as busy time, and a vLLM alone leaves the ledger on its batch model.

The rule. Time is cut into windows at the engine's readings; a window holds the engine's
busy seconds and tokens (prompt + generation counters) in it, and the sidecar's own work in
it: each finished attempt's modelled GPU-seconds and tokens, spread over the attempt's life
(its modelled prefill from its start to its first token, its decode from there to its end:
an engine's busy time and prompt tokens come early in a request, and a window's share should
too). A window is settled once no attempt that began before its end is still running (the
sidecar says when attempts start), so its work is complete. Then each attempt that worked in
it gets its part of the window's busy time:

    charge = sum over its windows of  busy x share x its modelled part / all modelled
    share  = min(1, own tokens / the engine's tokens), over the settled windows of `horizon_s`

(`work` returns the attempt's BusyTicket, `charge` prices it once `ready`). So an engine's
busy time is split among the attempts that ran while it was spent, in proportion to the
model: the model's batch guess stops mattering, only its ratio of one request to another at
the same moment remains, and the charges of a window add up to its busy time. `share` gives
the sidecar the part of the busy time its tokens were (other sidecars send the same engine
work); an engine whose page has no token counters is taken to be this sidecar's alone.
`factor` is the same over all the settled windows of the horizon at once: busy x share /
modelled, for an attempt that cannot wait for its own windows. A counter that went back (a
restart) voids the windows not yet settled: their attempts get no charge, and the ledger
keeps its batch model for them, as for an engine that gave no reading.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from dataclasses import dataclass, field

__all__ = [
    "BUSY_HORIZON_S",
    "MAX_BUSY_ENDPOINTS",
    "MAX_BUSY_WINDOWS",
    "BusyApportioner",
    "BusyTicket",
]

# Settled windows a factor is taken over: long enough to hold many requests of minutes-long
# agent steps, short enough to follow a change of load.
BUSY_HORIZON_S = 600.0
# Endpoints followed at once; readings from more are ignored (their attempts keep the model).
MAX_BUSY_ENDPOINTS = 10_000
# Windows kept per endpoint (a reading every 2 s over the horizon is 300).
MAX_BUSY_WINDOWS = 2_000


@dataclass(slots=True)
class _Window:
    t0: float
    t1: float
    busy_s: float
    engine_tokens: float | None  # None: the engine gave no token counters
    modelled_s: float = 0.0
    own_tokens: float = 0.0
    settled: bool = False
    void: bool = False  # its engine restarted before it settled


@dataclass(slots=True)
class BusyTicket:
    """One attempt's modelled work as it lies in its engine's windows: (window, modelled
    seconds) parts."""

    endpoint: str
    parts: list[tuple[_Window, float]]


@dataclass(slots=True)
class _Engine:
    last_t: float
    last_busy: float
    last_tokens: float | None
    windows: deque[_Window] = field(default_factory=deque)
    settled: int = 0  # windows[:settled] are settled
    # Sums over windows[:settled].
    busy_s: float = 0.0
    modelled_s: float = 0.0
    own_tokens: float = 0.0
    engine_tokens: float = 0.0
    untokened: int = 0  # of them, windows without the engine's token counters
    # Past the last reading: the window the next reading closes (t1 inf until then).
    open: _Window = field(default_factory=lambda: _open(0.0))
    # Starts of the attempts still running (a multiset, its least by the heap).
    running: Counter[float] = field(default_factory=Counter)
    starts: list[float] = field(default_factory=list)


class BusyApportioner:
    """Per endpoint: `reading` (cumulative busy seconds and tokens, the engine's), `started`
    and `work` (an attempt of this sidecar began / ended), `factor` (busy seconds per modelled
    second, None when unknown). Memory: at most `max_endpoints` x `max_windows` windows and
    one entry per running attempt (attempts older than the horizon are forgotten)."""

    def __init__(
        self,
        *,
        horizon_s: float = BUSY_HORIZON_S,
        max_endpoints: int = MAX_BUSY_ENDPOINTS,
        max_windows: int = MAX_BUSY_WINDOWS,
    ) -> None:
        if not horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        if max_endpoints < 1 or max_windows < 1:
            raise ValueError("max_endpoints and max_windows must be >= 1")
        self.horizon_s = horizon_s
        self.max_endpoints = max_endpoints
        self.max_windows = max_windows
        self._engines: dict[str, _Engine] = {}
        self.resets = 0
        self.ignored_readings = 0

    @property
    def endpoints(self) -> int:
        return len(self._engines)

    # -- feeding ----------------------------------------------------------------------

    def reading(
        self, endpoint: str, now: float, busy_s: float, tokens: float | None = None
    ) -> None:
        """The engine's cumulative busy GPU-seconds (and prompt + generation tokens, None
        when it does not count them) at `now`. A value that went back starts it over."""
        if not (math.isfinite(busy_s) and busy_s >= 0):
            return
        if tokens is not None and not (math.isfinite(tokens) and tokens >= 0):
            tokens = None
        e = self._engines.get(endpoint)
        if e is None:
            if len(self._engines) >= self.max_endpoints:
                self.ignored_readings += 1
                return
            self._engines[endpoint] = _Engine(now, busy_s, tokens, open=_open(now))
            return
        if now <= e.last_t:
            return
        went_back = busy_s < e.last_busy or (
            tokens is not None and e.last_tokens is not None and tokens < e.last_tokens
        )
        if went_back:
            self.resets += 1
            e.open.void = True
            for w in list(e.windows)[e.settled :]:
                w.void = True
            running, starts = e.running, e.starts
            e = self._engines[endpoint] = _Engine(now, busy_s, tokens, open=_open(now))
            e.running, e.starts = running, starts
            return
        w = e.open
        w.t1, w.busy_s = now, busy_s - e.last_busy
        if tokens is not None and e.last_tokens is not None:
            w.engine_tokens = tokens - e.last_tokens
        e.windows.append(w)
        e.open = _open(now)
        e.last_t, e.last_busy, e.last_tokens = now, busy_s, tokens
        self._advance(e, now)

    def started(self, endpoint: str, at: float) -> None:
        """An attempt on `endpoint` began at `at`: windows from then on wait for its work."""
        e = self._engines.get(endpoint)
        if e is None:
            return  # no reading yet: nothing to settle
        e.running[at] += 1
        heapq.heappush(e.starts, at)

    def work(
        self,
        endpoint: str,
        start: float,
        end: float,
        *,
        prefill_s: float = 0.0,
        decode_s: float = 0.0,
        prompt_tokens: float = 0.0,
        output_tokens: float = 0.0,
        first_token: float | None = None,
        tracked: bool = True,
    ) -> BusyTicket | None:
        """An attempt on `endpoint` that ran from `start` to `end` is over: its modelled
        GPU-seconds and tokens, the prefill's spread from its start to its first token and
        the decode's from there to its end, as an engine spends them (both over its whole
        life when `first_token` is None). `tracked`: `started(endpoint, start)` was said for it.
        Its ticket, None when the engine gave no reading."""
        e = self._engines.get(endpoint)
        if e is None:
            return None
        if tracked and e.running.get(start):
            e.running[start] -= 1
            if not e.running[start]:
                del e.running[start]
        end = max(start, end)
        if first_token is None:  # not known: both over its whole life
            first, after = end, start
        else:
            first = after = min(end, max(start, first_token))
        parts: dict[int, tuple[_Window, float]] = {}
        if prefill_s > 0 or prompt_tokens > 0:
            self._spread(e, start, first, max(0.0, prefill_s), max(0.0, prompt_tokens), parts)
        if decode_s > 0 or output_tokens > 0:
            self._spread(e, after, end, max(0.0, decode_s), max(0.0, output_tokens), parts)
        self._advance(e, max(end, e.last_t))
        return BusyTicket(endpoint, [p for p in parts.values() if p[1] > 0])

    # -- reading ----------------------------------------------------------------------

    def ready(self, ticket: BusyTicket) -> bool:
        """Every window the attempt worked in is settled (or void: its engine restarted)."""
        return all(w.settled or w.void for w, _ in ticket.parts)

    def charge(self, ticket: BusyTicket) -> float | None:
        """The attempt's part of its windows' busy time, once `ready`; None before, or when
        a window was void or the engine is no longer followed (the ledger then keeps its
        model). An attempt that did no modelled work is charged 0."""
        e = self._engines.get(ticket.endpoint)
        if e is None or not self.ready(ticket):
            return None
        total = 0.0
        for w, m in ticket.parts:
            if w.void or w.modelled_s <= 0:
                return None
            total += w.busy_s * m / w.modelled_s
        return total * self._share(e)

    def factor(self, endpoint: str) -> float | None:
        """Busy GPU-seconds the engine spent per modelled GPU-second of this sidecar's work,
        over the settled windows of the horizon; None when there is no such reading."""
        e = self._engines.get(endpoint)
        if e is None or e.modelled_s <= 0 or e.busy_s <= 0:
            return None
        return e.busy_s * self._share(e) / e.modelled_s

    # -- internals --------------------------------------------------------------------

    @staticmethod
    def _share(e: _Engine) -> float:
        if not e.untokened and e.engine_tokens > 0:
            return min(1.0, e.own_tokens / e.engine_tokens)
        return 1.0

    def _spread(
        self,
        e: _Engine,
        start: float,
        end: float,
        modelled: float,
        tokens: float,
        parts: dict[int, tuple[_Window, float]],
    ) -> None:
        """Add work done evenly over [start, end] to the windows it overlaps (an instant's
        to the window holding it); what lies past the last reading goes to the open window,
        which the next reading closes. Each window's modelled part adds to `parts`."""

        def add(w: _Window, m: float, n: float) -> None:
            w.modelled_s += m
            w.own_tokens += n
            had = parts.get(id(w))
            parts[id(w)] = (w, m + (had[1] if had is not None else 0.0))

        span = end - start
        if span <= 0:
            if start >= e.last_t:
                add(e.open, modelled, tokens)
                return
        elif end > e.last_t:
            frac = (end - max(start, e.last_t)) / span
            add(e.open, modelled * frac, tokens * frac)
            if start >= e.last_t:
                return
        windows = e.windows
        for i in range(len(windows) - 1, -1, -1):
            w = windows[i]
            if span <= 0:
                if not w.t0 <= start < w.t1:
                    if w.t1 <= start:
                        return
                    continue
                frac = 1.0
            else:
                if w.t1 <= start:
                    return
                frac = (min(end, w.t1) - max(start, w.t0)) / span
                if frac <= 0:
                    continue
            m, n = modelled * frac, tokens * frac
            add(w, m, n)
            if i < e.settled:  # work for a settled window (an untracked attempt)
                e.modelled_s += m
                e.own_tokens += n
            if span <= 0:
                return

    def _advance(self, e: _Engine, now: float) -> None:
        """Settle the windows no running attempt began before the end of; drop the old."""
        starts, running = e.starts, e.running
        oldest = now - self.horizon_s
        while starts and (not running.get(starts[0]) or starts[0] < oldest):
            at = heapq.heappop(starts)
            if at < oldest and running.get(at):  # never ended: forgotten
                del running[at]
        boundary = starts[0] if starts else math.inf
        windows = e.windows
        while e.settled < len(windows) and windows[e.settled].t1 <= boundary:
            w = windows[e.settled]
            w.settled = True
            e.settled += 1
            e.busy_s += w.busy_s
            e.modelled_s += w.modelled_s
            e.own_tokens += w.own_tokens
            if w.engine_tokens is None:
                e.untokened += 1
            else:
                e.engine_tokens += w.engine_tokens
        while windows and (windows[0].t1 < oldest or len(windows) > self.max_windows):
            w = windows.popleft()
            if e.settled > 0:
                e.settled -= 1
                e.busy_s -= w.busy_s
                e.modelled_s -= w.modelled_s
                e.own_tokens -= w.own_tokens
                if w.engine_tokens is None:
                    e.untokened -= 1
                else:
                    e.engine_tokens -= w.engine_tokens
        if e.settled == 0:  # no float residue from the sums' subtractions
            e.busy_s = e.modelled_s = e.own_tokens = e.engine_tokens = 0.0


def _open(t0: float) -> _Window:
    return _Window(t0, math.inf, 0.0, None)
