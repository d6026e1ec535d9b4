"""The cost ledger: what each request cost in GPU-seconds and dollars, grouped into tasks, so
that the headline figure is cost per *successful* task and every wasted dollar is named.

Sans-I/O: records come in (time is the record's own `ts`), summaries go out. The rules:

- A request's cost is the sum over its upstream attempts of GPU-seconds x the price per
  GPU-second of that attempt's GPU generation. An attempt's GPU-seconds are one of three
  readings, named in `LedgerSummary.readings` and the access log's `gpu_seconds_source`:
  `reported`, the engine's own figure for the request (ORCA `OrcaLoadReport.request_cost`,
  cncf/xds: xds/data/orca/v3/orca_load_report.proto, or a usage extension); else `measured`,
  the engine's measured busy GPU-seconds apportioned to the requests by the timing model's
  shares (filters/busy_time.py: where the engine's /metrics count its busy time); else
  `estimated`, the timing model alone: uncached prompt tokens / prefill rate + output tokens
  x (decode step at the typical batch / batch), the step shared by the batch that decodes
  together (profiles: filters/gpu.py). The model's figure for every request is kept beside
  (`CostFigures.modelled_usd`), so the two can be compared.
- A task is `task_id`, else `workflow_id`, else the request alone. It succeeds when its final
  step succeeds: the record marked `final` (x-meshd-task-final), else, when a record says
  nothing of `final`, the step with `step == steps_in_task - 1` (0-based, as loadtest/
  workloads/request.py numbers steps; x-meshd-task-step / -steps). `final: false` wins over
  the count (an agent that adds steps); a task that says neither is judged by its last
  request when it goes idle. A final step that fails leaves the task open (the client
  may retry the step); an idle task whose final step never succeeded failed.
- Every dollar lands in exactly one bucket: useful (ok requests of succeeded tasks), or waste:
  `retries` (failed attempts inside requests that ended ok; a prefill/decode request's
  successful prefill step is part of its answer, not a retry), `failed_requests` (requests that
  ended in an error), `abandoned_streams` (the client went away mid-response) and
  `failed_tasks` (ok requests of tasks that failed: step 3 of 5 fails, steps 1-2 are waste).

Two views of the spend, both in `summary()`, because GPU-seconds saved are money only when
the pool is elastic:

- elastic (`LedgerSummary.total`, CostFigures): a request costs the GPU-seconds it used, as
  above, so a GPU-second saved is a dollar saved. Read it for an autoscaled pool (an
  autoscaler hands idle GPUs back; the picker's `elastic: true`).
- fixed fleet (`LedgerSummary.fixed`, FixedFleetFigures): every GPU of the fleet is paid for
  the whole window, busy or idle: spend = sum over the fleet's endpoints of GPUs x $/GPU-second
  of its generation x the window. Read it for a fixed fleet (the default): there a GPU-second
  saved is idle time, not money, and what routing buys is more successful tasks per window.
  Utilisation = elastic spend / fixed spend; idle = fixed - elastic (not below 0). The fleet
  is the caller's (`fleet`; an endpoint never used still counts), else the endpoints the
  records name (each attempt's `endpoint`, a record without attempts its own), one GPU each,
  priced by the GPU they reported; the window is the caller's (`summary(window_s=...)`), else
  from the earliest request start (`ts`) to the latest end (`ts + e2e_s`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

from filters.busy_time import BusyApportioner, BusyTicket
from filters.gpu import GPUS, UNKNOWN, GpuTable, normalise_gpu_name

__all__ = [
    "ABANDONED_OUTCOMES",
    "DEFAULT_DECODE_BATCH",
    "DEFAULT_PRICES",
    "ESTIMATED",
    "IDLE_TIMEOUT_S",
    "MAX_FLEET_ENDPOINTS",
    "MAX_OPEN_TASKS",
    "MEASURED",
    "NO_WORK",
    "NO_WORK_OUTCOMES",
    "OK_OUTCOME",
    "REPORTED",
    "AttemptCost",
    "AttemptLike",
    "CostFigures",
    "CostLedger",
    "FixedFleetFigures",
    "FleetSpec",
    "LedgerSummary",
    "PriceTable",
    "ReadingFigures",
    "RecordLike",
    "TaskResult",
    "TimingModel",
    "WasteBreakdown",
    "task_key_of",
]

# Defaults: the upper end of 2026 specialty-cloud on-demand $/GPU-hour (sources in
# filters/gpu.py); "unknown" is priced like an H100 so an unnamed GPU is not free.
DEFAULT_PRICES: dict[str, float] = {
    **{name: p.price_per_gpu_hour for name, p in GPUS.items()},
    "unknown": UNKNOWN.price_per_gpu_hour,
}
# Sequences decoding together in one step at a busy engine; a step's time is shared by them.
# 32 sits between the profiles' b=1 and b=64 points and near vLLM's observed mean batch under
# load; a fleet that knows better passes its own.
DEFAULT_DECODE_BATCH = 32
# Open tasks kept at once; beyond it the least recently active one is closed early (counted
# in `evicted_tasks`), so a flood of one-off task ids cannot grow memory without bound.
MAX_OPEN_TASKS = 100_000
# A task with no request for this long is closed (agent think/tool time is seconds to minutes).
IDLE_TIMEOUT_S = 600.0
# Endpoints remembered for the fixed view when the caller names no fleet. Endpoints come from
# service discovery, not from clients, but an autoscaled pool churns them for as long as the
# ledger lives; beyond this, attempts on new endpoints are counted, not remembered.
MAX_FLEET_ENDPOINTS = 10_000

# A fleet's endpoint: its GPU generation, or (generation, GPUs it holds).
FleetSpec = str | tuple[str, int]

OK_OUTCOME = "ok"
# The client went away: what was generated for it is thrown away.
ABANDONED_OUTCOMES = frozenset({"client_disconnect", "abandoned"})
# Attempts that never reached an engine cost no GPU time.
NO_WORK_OUTCOMES = frozenset({"connect_error", "no_upstream", "rejected", "not_sent"})

# Where an attempt's GPU-seconds came from (the module's docstring).
REPORTED = "reported"  # the engine's figure for this request
MEASURED = "measured"  # the engine's measured busy time, apportioned
ESTIMATED = "estimated"  # the timing model (its batch guess)
NO_WORK = "none"  # it never reached an engine


class AttemptLike(Protocol):
    """One upstream try, as meshd/access_log.py's AttemptRecord has it."""

    @property
    def endpoint(self) -> str: ...
    @property
    def gpu(self) -> str | None: ...
    @property
    def outcome(self) -> str: ...
    @property
    def completion_tokens(self) -> int | None: ...
    @property
    def cached_tokens(self) -> int | None: ...
    @property
    def gpu_seconds(self) -> float | None: ...
    @property
    def gpu_seconds_source(self) -> str | None: ...  # MEASURED, else (None too) REPORTED
    @property
    def reason(self) -> str: ...  # why it was made: "" first, "prefill" a P/D prefill step
    # When it began and ended on the ledger's clock (None: not known, as in a log): the busy
    # apportioner waits for a begun attempt's work before it settles a window.
    @property
    def started_ts(self) -> float | None: ...
    @property
    def first_token_ts(self) -> float | None: ...
    @property
    def ended_ts(self) -> float | None: ...


class AttemptCost(NamedTuple):
    """One attempt's price: `seconds` and `usd` as charged, by `reading`; the timing
    model's figures beside them (`prefill_s` of its `modelled_s` the prefill's), and the
    tokens it carried."""

    seconds: float
    usd: float
    reading: str  # REPORTED | MEASURED | ESTIMATED | NO_WORK
    modelled_s: float
    modelled_usd: float
    prefill_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0


_new_tuple = tuple.__new__  # a NamedTuple built without its Python __new__

# A prefill/decode request's prefill step (meshd/disagg.py): an earlier attempt that, when it
# succeeded, is part of the answer, not a retry.
PREFILL_REASON = "prefill"


def _prefill_step(a: AttemptLike) -> bool:
    return a.reason == PREFILL_REASON


def answer_usd(attempts: Sequence[AttemptLike], costs: Sequence[AttemptCost]) -> float:
    """What the answer cost of a request that ended ok: its final attempt, and a prefill
    step that served it (the rest of `costs` is retries)."""
    if len(costs) == 1 and len(attempts) <= 1:
        return costs[0].usd + 0
    return costs[-1].usd + sum(
        c.usd
        for a, c in zip(attempts[:-1], costs[:-1], strict=True)
        if _prefill_step(a) and a.outcome == OK_OUTCOME
    )


class RecordLike(Protocol):
    """One request, as meshd/access_log.py's AccessRecord has it (filters/ may not import
    meshd/, so the ledger names only the fields it reads)."""

    @property
    def ts(self) -> float: ...
    @property
    def request_id(self) -> str: ...
    @property
    def tenant(self) -> str | None: ...
    @property
    def model(self) -> str | None: ...
    @property
    def pool(self) -> str | None: ...
    @property
    def endpoint(self) -> str | None: ...  # of the final attempt
    @property
    def e2e_s(self) -> float | None: ...  # arrival (ts) to the response's end
    @property
    def task_id(self) -> str | None: ...
    @property
    def workflow_id(self) -> str | None: ...
    @property
    def step(self) -> int | None: ...
    @property
    def steps_in_task(self) -> int | None: ...
    @property
    def final(self) -> bool | None: ...
    @property
    def gpu(self) -> str | None: ...
    @property
    def outcome(self) -> str: ...
    @property
    def prompt_tokens(self) -> int | None: ...
    @property
    def cached_tokens(self) -> int | None: ...
    @property
    def completion_tokens(self) -> int | None: ...
    @property
    def gpu_seconds(self) -> float | None: ...
    @property
    def attempts(self) -> tuple[AttemptLike, ...]: ...


def task_key_of(record: RecordLike) -> str:
    """The task a record belongs to: its task id, else its workflow id, else itself."""
    if record.task_id:
        return "task:" + record.task_id
    if record.workflow_id:
        return "workflow:" + record.workflow_id
    return "request:" + record.request_id


class PriceTable:
    """$ per GPU-hour by generation: DEFAULT_PRICES with overrides (a name not in the table is
    added; lookups go through filters.gpu.normalise_gpu_name, so "NVIDIA H100 80GB HBM3"
    finds H100, and an unlisted GPU costs "unknown"). Raises ValueError for a price <= 0."""

    def __init__(self, overrides: Mapping[str, float] | None = None) -> None:
        prices = dict(DEFAULT_PRICES)
        for name, value in (overrides or {}).items():
            price = float(value)
            if not price > 0:
                raise ValueError(f"price of {name!r} must be > 0 $/GPU-hour, got {value!r}")
            prices["unknown" if name == "unknown" else normalise_gpu_name(name)] = price
        self._prices = prices

    def per_hour(self, gpu: str | None) -> float:
        return self._prices.get(normalise_gpu_name(gpu), self._prices["unknown"])

    def per_second(self, gpu: str | None) -> float:
        return self.per_hour(gpu) / 3600.0

    def as_dict(self) -> dict[str, float]:
        return dict(self._prices)


@dataclass(frozen=True, slots=True)
class TimingModel:
    """GPU-seconds a request would have used, from its tokens and the GPU's profile."""

    gpus: GpuTable = field(default_factory=GpuTable)
    decode_batch: int = DEFAULT_DECODE_BATCH

    def gpu_seconds(
        self, gpu: str | None, prompt_tokens: int, cached_tokens: int, completion_tokens: int
    ) -> float:
        # Conditionals, not max(): the same values (max(0, x) is x only when x > 0; NaN
        # gives 0), without a builtin call each (four a call, twice an attempt).
        profile = self.gpus.get(gpu)
        if not cached_tokens > 0:
            cached_tokens = 0
        uncached = prompt_tokens - cached_tokens
        prefill = (uncached if uncached > 0 else 0) / profile.prefill_tokens_per_s
        batch = self.decode_batch
        if not batch > 1:
            batch = 1
        decode = (
            (completion_tokens if completion_tokens > 0 else 0)
            * profile.decode_step_s(batch)
            / batch
        )
        return prefill + decode


@dataclass(frozen=True, slots=True)
class WasteBreakdown:
    """Wasted dollars by kind (each dollar in one kind only)."""

    retries: float = 0.0
    failed_requests: float = 0.0
    abandoned_streams: float = 0.0
    failed_tasks: float = 0.0

    @property
    def total(self) -> float:
        return self.retries + self.failed_requests + self.abandoned_streams + self.failed_tasks


@dataclass(frozen=True, slots=True)
class CostFigures:
    """Totals for one slice (everything, a tenant, a model) and the ratios that matter.

    cost_usd counts every dollar, waste included, so cost_per_successful_task is spend /
    succeeded tasks, as loadtest/bench/results.py computes it for a bench pass. Tokens are
    prompt + completion tokens of every request (what a per-token bill counts). Pending is
    the cost of ok requests whose task is still open (neither useful nor waste yet)."""

    requests: int = 0
    ok_requests: int = 0
    tasks_succeeded: int = 0
    tasks_failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    gpu_seconds: float = 0.0
    cost_usd: float = 0.0
    useful_usd: float = 0.0
    pending_usd: float = 0.0
    waste: WasteBreakdown = WasteBreakdown()
    # The same requests priced by the timing model alone (every attempt ESTIMATED).
    modelled_usd: float = 0.0

    @property
    def modelled_cost_per_successful_task(self) -> float | None:
        return self.modelled_usd / self.tasks_succeeded if self.tasks_succeeded else None

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    @property
    def cost_per_successful_task(self) -> float | None:
        return self.cost_usd / self.tasks_succeeded if self.tasks_succeeded else None

    @property
    def cost_per_token(self) -> float | None:
        return self.cost_usd / self.tokens if self.tokens else None

    @property
    def cost_per_request(self) -> float | None:
        return self.cost_usd / self.requests if self.requests else None

    @property
    def success_per_dollar(self) -> float | None:
        return self.tasks_succeeded / self.cost_usd if self.cost_usd > 0 else None

    @property
    def waste_ratio(self) -> float | None:
        return self.waste.total / self.cost_usd if self.cost_usd > 0 else None


@dataclass(frozen=True, slots=True)
class FixedFleetFigures:
    """The fixed-fleet view of the whole ledger: the fleet paid for over `window_s`, busy or
    idle. `usd_per_s` is the fleet's burn rate (sum of GPUs x $/GPU-second), `spend_usd` =
    usd_per_s x window_s, `busy_usd` the elastic view's spend (CostFigures.cost_usd) over the
    same records. `declared`: the caller named the fleet (else: the endpoints seen).
    `untracked_attempts`: attempts on endpoints past MAX_FLEET_ENDPOINTS, not in the fleet.

    Utilisation can pass 1 where the elastic figures count GPUs outside the fleet (a declared
    fleet that misses an endpoint, records that name no endpoint) or the timing model's
    estimate runs ahead of the engines; idle_usd never goes below 0."""

    spend_usd: float
    window_s: float
    endpoints: int
    gpus: int
    usd_per_s: float
    busy_usd: float
    tasks_succeeded: int
    declared: bool
    untracked_attempts: int = 0

    @property
    def cost_per_successful_task(self) -> float | None:
        return self.spend_usd / self.tasks_succeeded if self.tasks_succeeded else None

    @property
    def success_per_dollar(self) -> float | None:
        return self.tasks_succeeded / self.spend_usd if self.spend_usd > 0 else None

    @property
    def utilisation(self) -> float | None:
        return self.busy_usd / self.spend_usd if self.spend_usd > 0 else None

    @property
    def idle_usd(self) -> float:
        return max(0.0, self.spend_usd - self.busy_usd)


@dataclass(frozen=True, slots=True)
class ReadingFigures:
    """The attempts whose GPU-seconds came from one reading, and what they were charged;
    `modelled_usd` is what the timing model alone would have charged them."""

    attempts: int = 0
    gpu_seconds: float = 0.0
    usd: float = 0.0
    modelled_usd: float = 0.0


@dataclass(frozen=True, slots=True)
class LedgerSummary:
    total: CostFigures  # the elastic view
    by_tenant: dict[str, CostFigures]
    by_model: dict[str, CostFigures]
    open_tasks: int
    evicted_tasks: int
    estimated_requests: int  # requests whose GPU-seconds came from the timing model
    # The fixed-fleet view of `total`; None when no fleet is known (none given, no endpoint
    # named by a record).
    fixed: FixedFleetFigures | None = None
    # By reading (REPORTED, MEASURED, ESTIMATED): the attempts that did work, what each
    # reading charged; their usd sums to total.cost_usd.
    readings: dict[str, ReadingFigures] = field(default_factory=dict)

    @property
    def measured_share(self) -> float | None:
        """The share of the spend that engines measured (reported or apportioned busy
        time), None when nothing was spent."""
        spent = sum(r.usd for r in self.readings.values())
        if spent <= 0:
            return None
        return sum(r.usd for k, r in self.readings.items() if k != ESTIMATED) / spent

    # The headline figures of the whole ledger, for callers that want one number.
    @property
    def cost_per_successful_task(self) -> float | None:
        return self.total.cost_per_successful_task

    @property
    def success_per_dollar(self) -> float | None:
        return self.total.success_per_dollar


class TaskResult(NamedTuple):
    """A closed task: how it ended and what it cost. `reason`: final_ok (its final step
    succeeded), idle (closed after IDLE_TIMEOUT_S), evicted (MAX_OPEN_TASKS), flushed.
    `settled_usd` is the cost of its ok requests that this close decided: useful when it
    succeeded, `failed_tasks` waste when not. `pool` is its latest step's pool.

    A NamedTuple (immutable, as the frozen dataclass it was): a lone request closes its
    own task on every record, and the frozen dataclass's __init__ set its 12 fields with
    object.__setattr__ each; `record` builds it with tuple.__new__ (issue #22)."""

    key: str
    tenant: str
    model: str
    succeeded: bool
    requests: int
    cost_usd: float
    wasted_usd: float
    first_ts: float
    last_ts: float
    reason: str
    pool: str = "-"
    settled_usd: float = 0.0


@dataclass(slots=True)
class _Figures:
    """Mutable twin of CostFigures while records arrive."""

    requests: int = 0
    ok_requests: int = 0
    tasks_succeeded: int = 0
    tasks_failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    gpu_seconds: float = 0.0
    cost_usd: float = 0.0
    useful_usd: float = 0.0
    pending_usd: float = 0.0
    retries: float = 0.0
    failed_requests: float = 0.0
    abandoned_streams: float = 0.0
    failed_tasks: float = 0.0
    modelled_usd: float = 0.0

    def freeze(self) -> CostFigures:
        return CostFigures(
            requests=self.requests,
            ok_requests=self.ok_requests,
            tasks_succeeded=self.tasks_succeeded,
            tasks_failed=self.tasks_failed,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            gpu_seconds=self.gpu_seconds,
            cost_usd=self.cost_usd,
            useful_usd=self.useful_usd,
            pending_usd=self.pending_usd,
            waste=WasteBreakdown(
                self.retries, self.failed_requests, self.abandoned_streams, self.failed_tasks
            ),
            modelled_usd=self.modelled_usd,
        )


@dataclass(slots=True)
class _OpenTask:
    tenant: str
    model: str
    pool: str
    first_ts: float
    last_ts: float
    requests: int = 0
    cost_usd: float = 0.0
    wasted_usd: float = 0.0
    last_ok: bool = False
    knows_final: bool = False  # some record said steps_in_task or final (true or false)
    # Cost of ok requests, by (tenant, model), not yet useful or waste.
    pending: dict[tuple[str, str], float] = field(default_factory=dict)


class CostLedger:
    """Feed it access records (`record`), read `summary()`; closed tasks come back from
    `record`, `close_idle` and `close_all` as TaskResult for callers that list them.

    Records should arrive roughly in `ts` order (a log is); idle closing uses the newest ts
    seen. Memory: one small entry per open task, at most `max_open_tasks`, and one per
    endpoint seen, at most `max_fleet_endpoints` (none when `fleet` is given).

    `fleet`: endpoint -> GPU generation, or (generation, GPU count), for the fixed view;
    without it the fleet is the endpoints the records name, one GPU each. Raises ValueError
    for an empty fleet or a GPU count < 1.

    `busy`: the engines' measured busy time (filters/busy_time.py), fed by the caller's
    readings. `record` tells it each attempt's work and charges an attempt on an engine it
    has a factor for MEASURED by the horizon's factor; a live caller does better: `track`
    the request's work as it finishes, wait until `settle` gives each attempt the busy time
    of the windows it ran in, then `record(..., tracked=True)` (meshd/observe.py)."""

    def __init__(
        self,
        prices: PriceTable | None = None,
        timing: TimingModel | None = None,
        *,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_open_tasks: int = MAX_OPEN_TASKS,
        fleet: Mapping[str, FleetSpec] | None = None,
        max_fleet_endpoints: int = MAX_FLEET_ENDPOINTS,
        busy: BusyApportioner | None = None,
    ) -> None:
        if max_open_tasks < 1:
            raise ValueError(f"max_open_tasks must be >= 1, got {max_open_tasks}")
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
        if max_fleet_endpoints < 1:
            raise ValueError(f"max_fleet_endpoints must be >= 1, got {max_fleet_endpoints}")
        self._fleet = None if fleet is None else _fleet_of(fleet)
        self.prices = prices or PriceTable()
        self.timing = timing or TimingModel()
        self.idle_timeout_s = idle_timeout_s
        self.max_open_tasks = max_open_tasks
        self._open: OrderedDict[str, _OpenTask] = OrderedDict()  # least recently active first
        self._total = _Figures()
        self._tenants: dict[str, _Figures] = {}
        self._models: dict[str, _Figures] = {}
        # The one (tenant, model) of every record so far, whose figures are the total's
        # object (_slices); None once a second tenant or model came (or before any).
        self._one: tuple[str, str] | None = None
        self._one_slices: tuple[_Figures, ...] = ()
        self._evicted = 0
        self._estimated = 0
        self._now = float("-inf")
        self.max_fleet_endpoints = max_fleet_endpoints
        self._seen: dict[str, str | None] = {}  # endpoint -> its GPU, when no fleet is given
        self._untracked = 0
        self._first_start = float("inf")
        self._last_end = float("-inf")
        self.busy = busy
        # reading -> [attempts, gpu_seconds, usd, modelled_usd]
        self._readings: dict[str, list[float]] = {}

    # -- cost of one request ----------------------------------------------------------

    def attempt_costs(self, record: RecordLike) -> list[AttemptCost]:
        """Each attempt's AttemptCost; the last is the final attempt. A record without
        attempts is one attempt on its own GPU with its own figures."""
        prompt = record.prompt_tokens or 0
        timing = self.timing
        attempts = record.attempts  # (a live record's property builds a tuple each read)
        if not attempts:
            gpu = record.gpu
            price = self.prices.per_second(gpu)
            completion = record.completion_tokens or 0
            work = record.outcome not in NO_WORK_OUTCOMES
            if not work:
                prompt = completion = 0
            prefill = timing.gpu_seconds(gpu, prompt, record.cached_tokens or 0, 0)
            modelled = prefill + timing.gpu_seconds(gpu, 0, 0, completion)
            seconds, reading = record.gpu_seconds, REPORTED
            if seconds is None:
                seconds, reading = modelled, ESTIMATED if work else NO_WORK
            return [
                AttemptCost(
                    seconds, seconds * price, reading, modelled, modelled * price,
                    prefill, prompt, completion,
                )
            ]  # fmt: skip
        out = []
        last = len(attempts) - 1
        # Tokens earlier attempts sent the client (a prefill step's one token never is).
        earlier_tokens = (
            sum(a.completion_tokens or 0 for a in attempts[:last] if not _prefill_step(a))
            if last
            else 0
        )
        busy = self.busy
        for i, a in enumerate(attempts):
            gpu = a.gpu or record.gpu
            price = self.prices.per_second(gpu)
            seconds = a.gpu_seconds
            if a.outcome in NO_WORK_OUTCOMES and seconds is None:
                out.append(AttemptCost(0.0, 0.0, NO_WORK, 0.0, 0.0))
                continue
            if i == last:
                cached = a.cached_tokens if a.cached_tokens is not None else record.cached_tokens
                tokens = a.completion_tokens
                if tokens is None:  # the rest of what the client got
                    tokens = max(0, (record.completion_tokens or 0) - earlier_tokens)
            else:
                cached, tokens = a.cached_tokens, a.completion_tokens
            prefill = timing.gpu_seconds(gpu, prompt, cached or 0, 0)
            modelled = prefill + timing.gpu_seconds(gpu, 0, 0, tokens or 0)
            if seconds is not None:
                reading = MEASURED if a.gpu_seconds_source == MEASURED else REPORTED
            else:
                factor = busy.factor(a.endpoint) if busy is not None else None
                if factor is None:
                    seconds, reading = modelled, ESTIMATED
                else:
                    seconds, reading = modelled * factor, MEASURED
            out.append(
                AttemptCost(
                    seconds, seconds * price, reading, modelled, modelled * price,
                    prefill, prompt, tokens or 0,
                )
            )  # fmt: skip
        return out

    # -- feeding ----------------------------------------------------------------------

    def record(
        self,
        record: RecordLike,
        costs: list[AttemptCost] | None = None,
        *,
        tracked: bool = False,
    ) -> list[TaskResult]:
        """Account one request; returns the tasks this closed (its own, idle or evicted).
        `costs`: the record's `attempt_costs` (or `settle`'s), when the caller has them
        already. `tracked`: the caller gave its work to the busy apportioner (`track`)."""
        closed = self.close_idle(record.ts) if self._open else []
        ts = record.ts
        if ts > self._now:
            self._now = ts
        if ts < self._first_start:
            self._first_start = ts
        e2e = record.e2e_s or 0.0
        end = ts + (e2e if e2e > 0.0 else 0.0)  # max(0.0, e2e) without the builtin call
        if end > self._last_end:
            self._last_end = end
        attempts = record.attempts  # (a live record's property builds a tuple each read)
        if self._fleet is None:
            self._see_endpoints(record, attempts)
        tenant = record.tenant or "-"
        model = record.model or "-"
        pool = record.pool or "-"
        if costs is None:
            costs = self.attempt_costs(record)
        readings = self._readings
        estimated = False
        seconds = usd = modelled_usd = 0.0
        for c in costs:
            seconds += c.seconds
            usd += c.usd
            modelled_usd += c.modelled_usd
            if c.reading == NO_WORK:
                continue
            estimated = estimated or c.reading == ESTIMATED
            tally = readings.get(c.reading)
            if tally is None:
                tally = readings[c.reading] = [0, 0.0, 0.0, 0.0]
            tally[0] += 1
            tally[1] += c.seconds
            tally[2] += c.usd
            tally[3] += c.modelled_usd
        if estimated:
            self._estimated += 1
        if self.busy is not None and not tracked:
            self.track(record, costs)
        outcome = record.outcome
        ok = outcome == OK_OUTCOME
        # The answer's cost: its final attempt, and a prefill step that served it.
        final_usd = answer_usd(attempts, costs)
        # Buckets decided now: the request's fate is known; only ok work waits for its task.
        prompt_tokens = record.prompt_tokens or 0
        completion_tokens = record.completion_tokens or 0
        abandoned = not ok and outcome in ABANDONED_OUTCOMES
        # A request alone is its own task, closed at once: its close is done here, each
        # slice's figures moved as an open task's close would (same operations, same order),
        # without the open entry made and dropped.
        lone = not record.task_id and not record.workflow_id
        settle = 0.0 + final_usd
        for figures in self._slices(tenant, model):
            figures.requests += 1
            figures.ok_requests += ok
            figures.input_tokens += prompt_tokens
            figures.output_tokens += completion_tokens
            figures.gpu_seconds += seconds
            figures.cost_usd += usd
            figures.modelled_usd += modelled_usd
            if ok:
                figures.retries += usd - final_usd
                figures.pending_usd += final_usd
            elif abandoned:
                figures.abandoned_streams += usd
            else:
                figures.failed_requests += usd
            if lone:
                if ok:
                    figures.pending_usd -= settle
                    figures.useful_usd += settle
                    figures.tasks_succeeded += 1
                else:
                    figures.tasks_failed += 1
        if lone:
            # TaskResult's fields in order: key, tenant, model, succeeded, requests,
            # cost_usd, wasted_usd, first_ts, last_ts, reason, pool, settled_usd.
            closed.append(
                _new_tuple(
                    TaskResult,
                    (
                        "request:" + record.request_id, tenant, model, ok, 1, 0.0 + usd,
                        0.0 + (usd - final_usd) if ok else 0.0 + usd + 0, ts, ts,
                        "final_ok" if ok else "final", pool, 0 + settle if ok else 0,
                    ),
                )
            )  # fmt: skip
            return closed

        key = task_key_of(record)
        task = self._open.get(key)
        if task is None:
            task = _OpenTask(tenant, model, pool, record.ts, record.ts)
            self._open[key] = task
        else:
            self._open.move_to_end(key)
        task.last_ts = max(task.last_ts, record.ts)
        task.pool = pool  # the pool of its latest step
        task.requests += 1
        task.cost_usd += usd
        task.wasted_usd += usd - final_usd if ok else usd
        task.last_ok = ok
        if ok:
            task.pending[(tenant, model)] = task.pending.get((tenant, model), 0.0) + final_usd
        if record.final is not None:
            is_final = record.final
        else:
            is_final = (
                record.step is not None
                and record.steps_in_task is not None
                and record.step >= record.steps_in_task - 1
            )
        task.knows_final = (
            task.knows_final or record.final is not None or record.steps_in_task is not None
        )
        if is_final and ok:
            task.model = model  # a task's model is the one its final step ran on
            closed.append(self._close(key, succeeded=ok, reason="final_ok" if ok else "final"))
        while len(self._open) > self.max_open_tasks:
            oldest = next(iter(self._open))
            self._evicted += 1
            closed.append(self._close_judged(oldest, "evicted"))
        return closed

    def record_all(self, records: Iterable[RecordLike]) -> list[TaskResult]:
        closed: list[TaskResult] = []
        for r in records:
            closed += self.record(r)
        return closed

    def close_idle(self, now: float) -> list[TaskResult]:
        """Close tasks with no request for idle_timeout_s before `now`."""
        closed = []
        while self._open:
            key, task = next(iter(self._open.items()))
            if task.last_ts + self.idle_timeout_s > now:
                break
            closed.append(self._close_judged(key, "idle"))
        return closed

    def close_all(self) -> list[TaskResult]:
        """Close every open task as if idle (the end of a log)."""
        return [self._close_judged(k, "flushed") for k in list(self._open)]

    # -- reading ----------------------------------------------------------------------

    def summary(self, *, window_s: float | None = None) -> LedgerSummary:
        """Both views. `window_s`: the time the fixed fleet was paid for (a bench pass's wall
        time, an hour of a live pool); default: from the earliest request start to the latest
        request end seen. Raises ValueError for a window < 0."""
        if window_s is not None and not window_s >= 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        total = self._total.freeze()
        readings = {
            k: ReadingFigures(int(v[0]), v[1], v[2], v[3])
            for k, v in sorted(self._readings.items())
        }
        return LedgerSummary(
            readings=readings,
            total=total,
            by_tenant={k: v.freeze() for k, v in sorted(self._tenants.items())},
            by_model={k: v.freeze() for k, v in sorted(self._models.items())},
            open_tasks=len(self._open),
            evicted_tasks=self._evicted,
            estimated_requests=self._estimated,
            fixed=self._fixed(total, window_s),
        )

    @property
    def window_s(self) -> float:
        """Earliest request start to latest request end seen (0 before any record)."""
        return max(0.0, self._last_end - self._first_start)  # -inf before any record

    # -- internals --------------------------------------------------------------------

    def track(self, record: RecordLike, costs: list[AttemptCost]) -> list[BusyTicket | None] | None:
        """Tell the busy apportioner what work each attempt of a finished request was, over
        its life; each attempt's ticket (None: its engine gave no reading), None without an
        apportioner. A live caller that wants each attempt's own windows' busy time waits
        for them (`settle`) before it records the request (`record(..., tracked=True)`)."""
        busy = self.busy
        if busy is None:
            return None
        e2e = record.e2e_s or 0.0
        end = record.ts + (e2e if e2e > 0.0 else 0.0)  # max(0.0, e2e) without the call
        attempts = record.attempts
        if not attempts:
            c = costs[0]
            if not record.endpoint or c.reading == NO_WORK:
                return [None]
            return [
                busy.work(
                    record.endpoint, record.ts, end,
                    prefill_s=c.prefill_s, decode_s=c.modelled_s - c.prefill_s,
                    prompt_tokens=c.prompt_tokens, output_tokens=c.output_tokens,
                    tracked=False,
                )
            ]  # fmt: skip
        out: list[BusyTicket | None] = []
        for a, c in zip(attempts, costs, strict=True):
            start, stop = a.started_ts, a.ended_ts
            out.append(
                busy.work(
                    a.endpoint,
                    record.ts if start is None else start,
                    end if stop is None else stop,
                    prefill_s=c.prefill_s,
                    decode_s=c.modelled_s - c.prefill_s,
                    prompt_tokens=c.prompt_tokens,
                    output_tokens=c.output_tokens,
                    first_token=a.first_token_ts,
                    tracked=start is not None,
                )
            )
        return out

    def settle(
        self,
        record: RecordLike,
        costs: list[AttemptCost],
        tickets: list[BusyTicket | None],
        *,
        force: bool = False,
    ) -> list[AttemptCost] | None:
        """`costs` with each tracked attempt's own share of its windows' busy time (MEASURED),
        once every ticket is ready; None while one is not. `force`: now, the attempts whose
        windows have not settled keep the costs given (the horizon's factor, or the model).
        An attempt with an engine-reported figure keeps it."""
        busy = self.busy
        if busy is None:
            return costs
        if not force and not all(t is None or busy.ready(t) for t in tickets):
            return None
        out = list(costs)
        attempts = record.attempts
        for i, t in enumerate(tickets):
            c = costs[i]
            if t is None or c.reading in (REPORTED, NO_WORK):
                continue
            if attempts and attempts[i].gpu_seconds is not None:
                continue
            seconds = busy.charge(t)
            if seconds is None:
                continue
            gpu = (attempts[i].gpu if attempts else None) or record.gpu
            price = self.prices.per_second(gpu)
            out[i] = c._replace(seconds=seconds, usd=seconds * price, reading=MEASURED)
        return out

    def _see_endpoints(self, record: RecordLike, attempts: Sequence[AttemptLike]) -> None:
        seen: list[tuple[str | None, str | None]]
        if attempts:
            seen = [(a.endpoint, a.gpu or record.gpu) for a in attempts]
        else:
            seen = [(record.endpoint, record.gpu)]
        for endpoint, gpu in seen:
            if not endpoint:
                continue
            if endpoint in self._seen:
                if gpu:  # the latest GPU it reported
                    self._seen[endpoint] = gpu
            elif len(self._seen) < self.max_fleet_endpoints:
                self._seen[endpoint] = gpu
            else:
                self._untracked += 1

    def _fixed(self, total: CostFigures, window_s: float | None) -> FixedFleetFigures | None:
        fleet = self._fleet
        if fleet is None:
            fleet = {endpoint: (gpu, 1) for endpoint, gpu in self._seen.items()}
        if not fleet:
            return None
        window = self.window_s if window_s is None else window_s
        usd_per_s = sum(n * self.prices.per_second(gpu) for gpu, n in fleet.values())
        return FixedFleetFigures(
            spend_usd=usd_per_s * window,
            window_s=window,
            endpoints=len(fleet),
            gpus=sum(n for _, n in fleet.values()),
            usd_per_s=usd_per_s,
            busy_usd=total.cost_usd,
            tasks_succeeded=total.tasks_succeeded,
            declared=self._fleet is not None,
            untracked_attempts=self._untracked,
        )

    def _slices(self, tenant: str, model: str) -> tuple[_Figures, ...]:
        """The figures a record of (tenant, model) moves: the total, its tenant's and its
        model's. While every record so far had one tenant and one model, the three are
        one object (each would have had the same operations in the same order from zero,
        so the same values), moved once; the first other tenant or model parts them, each
        a copy of the figures as they stand (_part)."""
        one = self._one
        if one is not None:
            if tenant == one[0] and model == one[1]:
                return self._one_slices
            self._part(one)
        elif not self._tenants:  # the first record
            total = self._total
            self._one = (tenant, model)
            self._tenants[tenant] = self._models[model] = total
            self._one_slices = (total,)
            return self._one_slices
        # get() first: setdefault(key, _Figures()) would build a _Figures on every call.
        by_tenant = self._tenants.get(tenant)
        if by_tenant is None:
            by_tenant = self._tenants[tenant] = _Figures()
        by_model = self._models.get(model)
        if by_model is None:
            by_model = self._models[model] = _Figures()
        return self._total, by_tenant, by_model

    def _part(self, one: tuple[str, str]) -> None:
        """The one tenant's and model's figures, shared with the total until now, their own."""
        total = self._total
        self._tenants[one[0]] = replace(total)
        self._models[one[1]] = replace(total)
        self._one = None
        self._one_slices = ()

    def _close_judged(self, key: str, reason: str) -> TaskResult:
        task = self._open[key]
        # A task that announced its final step succeeds only through `record` (final ok);
        # one that never said how long it is is judged by its last request.
        succeeded = (not task.knows_final) and task.last_ok
        return self._close(key, succeeded=succeeded, reason=reason)

    def _close(self, key: str, *, succeeded: bool, reason: str) -> TaskResult:
        task = self._open.pop(key)
        for (tenant, model), usd in task.pending.items():
            for figures in self._slices(tenant, model):
                figures.pending_usd -= usd
                if succeeded:
                    figures.useful_usd += usd
                else:
                    figures.failed_tasks += usd
        settled = sum(task.pending.values())
        if not succeeded:
            task.wasted_usd += settled
        # The task is counted once, under its own tenant and its final step's model.
        for figures in self._slices(task.tenant, task.model):
            if succeeded:
                figures.tasks_succeeded += 1
            else:
                figures.tasks_failed += 1
        return TaskResult(
            key=key,
            tenant=task.tenant,
            model=task.model,
            succeeded=succeeded,
            requests=task.requests,
            cost_usd=task.cost_usd,
            wasted_usd=task.wasted_usd,
            first_ts=task.first_ts,
            last_ts=task.last_ts,
            reason=reason,
            pool=task.pool,
            settled_usd=settled,
        )


def _fleet_of(fleet: Mapping[str, FleetSpec]) -> dict[str, tuple[str | None, int]]:
    if not fleet:
        raise ValueError("fleet is empty; pass None to use the endpoints the records name")
    out: dict[str, tuple[str | None, int]] = {}
    for endpoint, spec in fleet.items():
        gpu, count = (spec, 1) if isinstance(spec, str) else spec
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"fleet endpoint {endpoint!r}: GPU count must be >= 1, got {count!r}")
        out[endpoint] = (gpu, count)
    return out


# CostLedger's per-record path as written above: the references for the compiled twin
# (filters/_cost_ledger_c.pyx), which becomes the methods when built, unless
# MESHD_PURE_PYTHON is set. Every finished request of a sidecar is priced and recorded
# through them (meshd/observe.py).
attempt_costs_reference = CostLedger.attempt_costs
track_reference = CostLedger.track
record_reference = CostLedger.record
IMPLEMENTATION = "python (forced by MESHD_PURE_PYTHON)"
if not os.environ.get("MESHD_PURE_PYTHON"):
    try:
        from filters import _cost_ledger_c  # type: ignore[attr-defined]
    except ImportError:
        IMPLEMENTATION = "python (compiled extension not built)"
    else:
        _cost_ledger_c.bind(globals())
        CostLedger.attempt_costs = _cost_ledger_c.attempt_costs  # type: ignore[method-assign]
        CostLedger.track = _cost_ledger_c.track  # type: ignore[method-assign]
        CostLedger.record = _cost_ledger_c.record  # type: ignore[method-assign]
        IMPLEMENTATION = "cython"
