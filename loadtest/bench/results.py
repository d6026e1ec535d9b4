"""Benchmark results: per-policy figures computed from what the client and engines saw.

Pure arithmetic, no I/O. Cost is meshd's headline: a task is a chain (agentic task or chat
session) or a lone request; it succeeds when every planned step succeeded. Every GPU-second
of the pass counts as spend, failed and retried work included, so
cost per successful task = pass cost / successful tasks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from loadtest.bench.client import RequestOutcome, task_key
from loadtest.bench.scrape import PREFIX_HITS, PREFIX_QUERIES, QueueSample
from loadtest.workloads import PlannedRequest, quantile

Status = Literal["ok", "skipped", "failed"]
GpuBasis = Literal["busy", "provisioned"]


@dataclass(frozen=True, slots=True)
class Distribution:
    """Percentiles of one latency, in seconds; n = 0 when nothing was measured."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return NO_DISTRIBUTION
        ordered = sorted(values)
        return cls(
            n=len(ordered),
            mean=sum(ordered) / len(ordered),
            p50=quantile(ordered, 0.50),
            p90=quantile(ordered, 0.90),
            p99=quantile(ordered, 0.99),
            max=ordered[-1],
        )


NO_DISTRIBUTION = Distribution(0, 0.0, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class TaskCounts:
    """Tasks of one pass: succeeded (every step ok), failed (a step failed), unfinished
    (no step failed but some were never sent: the run's time ran out)."""

    planned: int
    succeeded: int
    failed: int
    unfinished: int


@dataclass(frozen=True, slots=True)
class EngineResult:
    """One engine over one pass: its prefix cache and what its GPU cost.

    hit_rate: delta hits / delta queries of vLLM's prefix-cache counters (tokens), None
    when the engine serves no such counters. busy_s: the simulator's GPU-busy seconds,
    None when it does not say.
    """

    name: str
    url: str
    gpu: str
    price_per_gpu_hour: float
    prefix_queries: float | None
    prefix_hits: float | None
    busy_s: float | None
    gpu_seconds: float
    cost_usd: float

    @property
    def hit_rate(self) -> float | None:
        if not self.prefix_queries or self.prefix_hits is None:
            return None
        return self.prefix_hits / self.prefix_queries


def count_tasks(
    planned: Iterable[PlannedRequest], outcomes: Iterable[RequestOutcome]
) -> TaskCounts:
    """Count tasks: a task succeeds when all its planned steps were sent and succeeded."""
    steps = Counter(task_key(r) for r in planned)
    ok: Counter[str] = Counter()
    failed: set[str] = set()
    for o in outcomes:
        if o.ok:
            ok[o.task_key] += 1
        else:
            failed.add(o.task_key)
    succeeded = sum(1 for t, n in steps.items() if t not in failed and ok[t] >= n)
    failed_n = sum(1 for t in steps if t in failed)
    return TaskCounts(
        planned=len(steps),
        succeeded=succeeded,
        failed=failed_n,
        unfinished=len(steps) - succeeded - failed_n,
    )


def cost_per_success(cost_usd: float, successes: int) -> float | None:
    """Spend per successful task; None when nothing succeeded (infinitely expensive)."""
    return cost_usd / successes if successes else None


def success_per_dollar(cost_usd: float, successes: int) -> float | None:
    """Successful tasks per dollar; None when nothing was spent."""
    return successes / cost_usd if cost_usd > 0 else None


def gpu_cost(gpu_seconds: float, price_per_gpu_hour: float) -> float:
    return gpu_seconds * price_per_gpu_hour / 3600.0


def engine_results(
    engines: Sequence[tuple[str, str, str, float]],
    before: Sequence[Mapping[str, float]],
    after: Sequence[Mapping[str, float]],
    busy_before: Sequence[float | None],
    busy_after: Sequence[float | None],
    provisioned_s: float,
) -> tuple[tuple[EngineResult, ...], GpuBasis]:
    """Per-engine results from start/end scrapes. `engines`: (name, url, gpu, price).

    GPU-seconds are busy seconds when every engine reported them (basis "busy"), else the
    pass's wall time for every provisioned engine (basis "provisioned").
    """
    busy = [
        None if b is None or a is None else max(0.0, a - b)
        for b, a in zip(busy_before, busy_after, strict=True)
    ]
    basis: GpuBasis = "busy" if busy and all(b is not None for b in busy) else "provisioned"
    out = []
    for i, (name, url, gpu, price) in enumerate(engines):
        q0, q1 = before[i].get(PREFIX_QUERIES), after[i].get(PREFIX_QUERIES)
        h0, h1 = before[i].get(PREFIX_HITS), after[i].get(PREFIX_HITS)
        b = busy[i]
        seconds = b if basis == "busy" and b is not None else provisioned_s
        out.append(
            EngineResult(
                name=name,
                url=url,
                gpu=gpu,
                price_per_gpu_hour=price,
                prefix_queries=None if q1 is None else q1 - (q0 or 0.0),
                prefix_hits=None if h1 is None else h1 - (h0 or 0.0),
                busy_s=b,
                gpu_seconds=seconds,
                cost_usd=gpu_cost(seconds, price),
            )
        )
    return tuple(out), basis


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """One policy's pass. For a skipped or failed pass only the first four fields matter."""

    policy: str
    summary: str
    status: Status
    reason: str = ""
    wall_s: float = 0.0
    requests_planned: int = 0
    requests_sent: int = 0
    succeeded: int = 0
    failed: int = 0
    not_sent: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    ttft: Distribution = NO_DISTRIBUTION
    itl: Distribution = NO_DISTRIBUTION
    e2e: Distribution = NO_DISTRIBUTION
    output_tokens: int = 0
    output_tok_s: float = 0.0
    hit_rate: float | None = None
    queue_waiting_mean: float | None = None
    queue_waiting_max: float | None = None
    running_mean: float | None = None
    gpu_seconds: float = 0.0
    gpu_basis: GpuBasis = "provisioned"
    provisioned_gpu_seconds: float = 0.0
    cost_usd: float = 0.0
    tasks: TaskCounts = TaskCounts(0, 0, 0, 0)
    cost_per_successful_task: float | None = None
    successful_tasks_per_dollar: float | None = None
    engines: tuple[EngineResult, ...] = ()
    samples: tuple[QueueSample, ...] = field(default=(), repr=False)
    outcomes: tuple[RequestOutcome, ...] = field(default=(), repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict[str, Any]:
        """Everything but per-request records and raw samples (written apart)."""

        def dist(d: Distribution) -> dict[str, float]:
            return {k: round(getattr(d, k), 6) for k in ("n", "mean", "p50", "p90", "p99", "max")}

        return {
            "policy": self.policy,
            "summary": self.summary,
            "status": self.status,
            "reason": self.reason,
            "wall_s": round(self.wall_s, 3),
            "requests": {
                "planned": self.requests_planned,
                "sent": self.requests_sent,
                "succeeded": self.succeeded,
                "failed": self.failed,
                "not_sent": self.not_sent,
                "failures": dict(self.failures),
            },
            "ttft_s": dist(self.ttft),
            "itl_s": dist(self.itl),
            "e2e_s": dist(self.e2e),
            "output_tokens": self.output_tokens,
            "output_tok_s": round(self.output_tok_s, 3),
            "prefix_cache_hit_rate": self.hit_rate,
            "queue": {
                "waiting_mean": self.queue_waiting_mean,
                "waiting_max": self.queue_waiting_max,
                "running_mean": self.running_mean,
                # Sums over engines, one point per sample: enough to redraw the plot.
                "series": {
                    "t_s": [round(q.t_s, 3) for q in self.samples],
                    "waiting": [sum(q.waiting) for q in self.samples],
                    "running": [sum(q.running) for q in self.samples],
                    "kv_usage_mean": [
                        round(sum(q.kv_usage) / len(q.kv_usage), 4) if q.kv_usage else 0.0
                        for q in self.samples
                    ],
                },
            },
            "gpu_seconds": round(self.gpu_seconds, 3),
            "gpu_seconds_basis": self.gpu_basis,
            "provisioned_gpu_seconds": round(self.provisioned_gpu_seconds, 3),
            "cost_usd": round(self.cost_usd, 6),
            "tasks": {
                "planned": self.tasks.planned,
                "succeeded": self.tasks.succeeded,
                "failed": self.tasks.failed,
                "unfinished": self.tasks.unfinished,
            },
            "cost_per_successful_task_usd": self.cost_per_successful_task,
            "successful_tasks_per_dollar": self.successful_tasks_per_dollar,
            "engines": [
                {
                    "name": e.name,
                    "url": e.url,
                    "gpu": e.gpu,
                    "price_per_gpu_hour": e.price_per_gpu_hour,
                    "prefix_cache_queries": e.prefix_queries,
                    "prefix_cache_hits": e.prefix_hits,
                    "prefix_cache_hit_rate": e.hit_rate,
                    "busy_s": e.busy_s,
                    "gpu_seconds": round(e.gpu_seconds, 3),
                    "cost_usd": round(e.cost_usd, 6),
                }
                for e in self.engines
            ],
        }


def skipped(policy: str, summary: str, reason: str, status: Status = "skipped") -> PolicyResult:
    return PolicyResult(policy=policy, summary=summary, status=status, reason=reason)


def summarize(
    policy: str,
    summary: str,
    planned: Sequence[PlannedRequest],
    outcomes: Sequence[RequestOutcome],
    not_sent: int,
    wall_s: float,
    engines: tuple[EngineResult, ...],
    gpu_basis: GpuBasis,
    samples: Sequence[QueueSample] = (),
) -> PolicyResult:
    """The PolicyResult of one finished pass."""
    good = [o for o in outcomes if o.ok]
    bad = [o for o in outcomes if not o.ok]
    itl = [g for o in good for g in o.itl_s]
    out_tokens = sum(o.output_tokens for o in good)
    span = _load_span(outcomes)
    queries = [e.prefix_queries for e in engines if e.prefix_queries is not None]
    hits = [e.prefix_hits for e in engines if e.prefix_hits is not None]
    hit_rate = sum(hits) / sum(queries) if queries and sum(queries) > 0 else None
    waiting = [sum(s.waiting) for s in samples]
    running = [sum(s.running) for s in samples]
    cost = sum(e.cost_usd for e in engines)
    tasks = count_tasks(planned, outcomes)
    return PolicyResult(
        policy=policy,
        summary=summary,
        status="ok",
        wall_s=wall_s,
        requests_planned=len(planned),
        requests_sent=len(outcomes),
        succeeded=len(good),
        failed=len(bad),
        not_sent=not_sent,
        failures=dict(Counter(o.error or "?" for o in bad)),
        ttft=Distribution.of([o.ttft_s for o in good if o.ttft_s is not None]),
        itl=Distribution.of(itl),
        e2e=Distribution.of([o.e2e_s for o in good]),
        output_tokens=out_tokens,
        output_tok_s=out_tokens / span if span > 0 else 0.0,
        hit_rate=hit_rate,
        queue_waiting_mean=sum(waiting) / len(waiting) if waiting else None,
        queue_waiting_max=max(waiting) if waiting else None,
        running_mean=sum(running) / len(running) if running else None,
        gpu_seconds=sum(e.gpu_seconds for e in engines),
        gpu_basis=gpu_basis,
        provisioned_gpu_seconds=wall_s * len(engines),
        cost_usd=cost,
        tasks=tasks,
        cost_per_successful_task=cost_per_success(cost, tasks.succeeded),
        successful_tasks_per_dollar=success_per_dollar(cost, tasks.succeeded),
        engines=engines,
        samples=tuple(samples),
        outcomes=tuple(outcomes),
    )


def _load_span(outcomes: Sequence[RequestOutcome]) -> float:
    """First send to last completion: the time over which output tokens were produced."""
    if not outcomes:
        return 0.0
    return max(o.end_at_s for o in outcomes) - min(o.sent_at_s for o in outcomes)


def throughput_series(
    outcomes: Sequence[RequestOutcome], bin_s: float = 1.0
) -> tuple[list[float], list[float]]:
    """Output tokens/s over time: each successful request's tokens spread evenly from its
    first token to its end, summed into `bin_s` bins. Returns (bin starts, tokens/s)."""
    ends = [o.end_at_s for o in outcomes if o.ok]
    if not ends:
        return [], []
    bins = [0.0] * (int(max(ends) / bin_s) + 1)
    for o in outcomes:
        if not o.ok or o.output_tokens <= 0:
            continue
        start = o.sent_at_s + (o.ttft_s or 0.0)
        end = o.end_at_s
        if end - start <= 1e-9:
            bins[min(int(end / bin_s), len(bins) - 1)] += o.output_tokens
            continue
        rate = o.output_tokens / (end - start)
        i = int(start / bin_s)
        while i < len(bins) and i * bin_s < end:
            lo, hi = max(start, i * bin_s), min(end, (i + 1) * bin_s)
            if hi > lo:
                bins[i] += rate * (hi - lo)
            i += 1
    return [i * bin_s for i in range(len(bins))], [b / bin_s for b in bins]
