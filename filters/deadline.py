"""A request's whole answer, predicted before its first attempt, so one that would end after
its deadline is refused before it spends a GPU-second. Sans-I/O: time comes in.

`x-meshd-deadline-ms` is the budget of the whole answer (an agent's task budget, counted
down per step). The admission queue refuses what its queue already makes late, and the
picker drops engines whose first token alone misses (filters/picker.py, a necessary
condition). Neither sees the answer's length. Here, after the pool is ordered, the best
route's predicted end is

    end = TTFT + E[output] x step

TTFT the picker's (queue, prefill of the uncached part, KV waits, cold loads), step its
decode step for the batch the request joins x that engine's learnt decode calibration
(Choice.step_s x EndpointState.decode_ratio), E[output] = max_tokens x the pool's fill:
an EWMA of completion_tokens / max_tokens over the answers the pool finished (clients
that ask for 4,096 tokens and get 300 are not judged as if they would take 4,096). The
request is refused (429, `deadline_unmeetable`) when end > the time left: a request
predicted late is refused, not sent late.

Only a new task's request is refused: a step of a task under way (admission's
`AdmissionItem.started`: a task step past 0, or a prompt extending one routed before)
is tried, since refusing it would throw away the steps already spent on its task. And
nothing is refused until the pool has finished FillConfig.min_samples (16) answers:
before them the speeds are a datasheet's guess.

Why refuse rather than try: on a shared fleet, a request that ends after its deadline is
work for nobody, and the GPU-seconds it takes delay everyone behind it. Measured on the
routing matrix's Mooncake sessions cells (closed-loop conversations, each task due in 3 s
+ 50 ms per output token per turn, the deadline header counting down; virtual clock,
2026-12-06, meshd given URLs only), 8 H100s at load 0.8: share of work spent on tasks
that then failed 0.246 -> 0.142 (cache_aware 0.254), task success 0.876 -> 0.937 (0.834),
7 of 1,000 requests refused. Variants on the 9 sessions cells: refusing steps of started
tasks too was worse on both in 6 (8 H100: 0.125 wasted, 0.931 success, without the
warm-up); refusing only when the prediction is twice the time left kept the waste (0.273
on 8 H100): the gain is in the requests predicted just late, whose GPU-seconds the others
then get; refusing from the first request (no warm-up) refused 17 on 8 H100 (0.089,
0.944), most of them in the first seconds on the datasheet's slower speeds, and on 64
H100s lost tasks the peers served in time (0.949 against 0.954 with the warm-up). The
prediction errs (the actual E2E over the predicted, p10 / p50 / p90 0.29 / 0.77 / 1.95
on the 8 H100 cell), so some refused requests would have ended in time.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from filters.picker import PickRequest
    from filters.pool_router import Route

__all__ = ["EndPredictor", "FillConfig", "late_message", "late_refusal"]


class _Predicts(Protocol):
    def predicted_end_s(self, route: Route, req: PickRequest) -> float | None: ...


@dataclass(frozen=True, slots=True)
class FillConfig:
    alpha: float = 0.05  # EWMA weight of one finished answer's completion / max_tokens
    prior: float = 1.0  # fill before any answer: the client's max_tokens taken at its word
    max_tracked: int = 65536  # dispatched requests remembered until they finish
    # Answers the pool must have finished before it predicts an end at all: before them
    # the speeds are a datasheet's guess, not what these engines do.
    min_samples: int = 16

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if not (math.isfinite(self.prior) and self.prior > 0.0):
            raise ValueError(f"prior must be finite and > 0, got {self.prior}")
        if self.max_tracked < 1 or self.min_samples < 0:
            raise ValueError(
                f"max_tracked must be >= 1 and min_samples >= 0, got {self.max_tracked}, "
                f"{self.min_samples}"
            )


class EndPredictor:
    """The pool's expected share of max_tokens an answer uses, learnt from the answers it
    finished, and the predicted end of a request on a route."""

    def __init__(self, config: FillConfig | None = None) -> None:
        self.config = config or FillConfig()
        self.fill = self.config.prior
        self.samples = 0
        self._asked: OrderedDict[Hashable, int] = OrderedDict()  # rid -> its max_tokens

    def dispatched(self, rid: Hashable, max_tokens: int) -> None:
        asked = self._asked
        asked[rid] = max_tokens
        if len(asked) > self.config.max_tracked:
            asked.popitem(last=False)

    def finished(self, rid: Hashable, ok: bool, completion_tokens: int | None) -> None:
        """An attempt ended: a whole answer with its usage teaches the fill; a failed or
        cut one only forgets the request."""
        asked = self._asked.pop(rid, None)
        if not ok or asked is None or asked <= 0 or completion_tokens is None:
            return
        x = (completion_tokens if completion_tokens > 0 else 0) / asked  # max(0, ...)
        self.fill += self.config.alpha * (x - self.fill)
        self.samples += 1

    def output_tokens(self, max_tokens: int) -> float:
        return max(0, max_tokens) * self.fill

    def end_s(self, ttft_s: float, step_s: float, max_tokens: int) -> float | None:
        """Seconds from now to the answer's last token: the first token, then the expected
        output at the decode step the request joins; None until the pool has finished
        min_samples answers."""
        if self.samples < self.config.min_samples:
            return None
        return ttft_s + self.output_tokens(max_tokens) * step_s


def late_refusal(
    router: _Predicts, best: Route, req: PickRequest, now: float, pool: str, *, started: bool
) -> str | None:
    """Why a request is refused before any attempt (each driver's one call: the sidecar's
    Attempts._late, meshd picker, the virtual bench): a new task's request (not `started`:
    a step of a task under way) with a deadline whose `best` route is predicted to end after
    it; None: route it."""
    if started or req.deadline_s is None:
        return None
    end = router.predicted_end_s(best, req)
    return None if end is None else late_message(pool, end, req.deadline_s - now)


def late_message(pool: str, end_s: float, left_s: float) -> str | None:
    """Why a request predicted to end `end_s` from now, with `left_s` left of its deadline,
    is refused; None when it is predicted in time."""
    if end_s <= left_s:
        return None
    if left_s <= 0.0:
        return (
            f"the request's deadline has passed ({-left_s:.3f} s ago) before pool {pool!r} tried it"
        )
    return (
        f"pool {pool!r} is predicted to finish the answer {end_s:.3f} s from now, after its "
        f"deadline ({left_s:.3f} s away)"
    )
