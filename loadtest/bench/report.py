"""The benchmark report: results.json, requests.jsonl, report.md and its plots.

One table row per policy, ratios against the baseline (round robin) for the key figures,
the workload's description and cache hit-rate bounds, the TTFT floor (floor.py) beside the
TTFT target, per-engine hit rates and cost, and matplotlib plots (Agg backend, imported
only when plots are drawn).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtest.bench.results import Distribution, PolicyResult, throughput_series

if TYPE_CHECKING:
    from loadtest.bench.floor import TtftFloor

RESULTS_JSON = "results.json"
REQUESTS_JSONL = "requests.jsonl"
REPORT_MD = "report.md"
PLOTS: tuple[tuple[str, str], ...] = (
    ("ttft_cdf.png", "TTFT CDF"),
    ("throughput.png", "Output tokens/s over time"),
    ("queue_depth.png", "Queue depth over time (all engines)"),
    ("hit_rate_per_engine.png", "Prefix-cache hit rate per engine"),
    ("cost_per_task.png", "Cost per successful task"),
)


@dataclass(frozen=True, slots=True)
class BenchReport:
    """A finished run: its settings, its workload and one result per policy."""

    title: str
    command: str
    started_at: str
    workload_name: str
    workload_args: dict[str, Any]
    workload: dict[str, Any]
    fleet: dict[str, Any]
    client: dict[str, Any]
    results: tuple[PolicyResult, ...]
    baseline: str = "round-robin"
    notes: tuple[str, ...] = field(default_factory=tuple)
    # Per policy: the one-infinite-cache hit-rate bound over the requests it sent (a run
    # cut short by --duration sends a prefix of the workload, whose bound differs).
    hit_bounds: dict[str, float] = field(default_factory=dict)
    peer: str = "sglang-router"  # the cache-aware peer the targets compare with
    # The TTFT no router can beat on this fleet (floor.py); None for stub fleets.
    ttft_floor: TtftFloor | None = None

    @property
    def ran(self) -> tuple[PolicyResult, ...]:
        return tuple(r for r in self.results if r.ok)

    def baseline_result(self) -> PolicyResult | None:
        for r in self.ran:
            if r.policy == self.baseline:
                return r
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "command": self.command,
            "started_at": self.started_at,
            "workload": {
                "name": self.workload_name,
                "args": self.workload_args,
                "description": self.workload,
            },
            "fleet": self.fleet,
            "client": self.client,
            "baseline": self.baseline,
            "notes": list(self.notes),
            "hit_rate_bounds": dict(self.hit_bounds),
            "ttft_floor": floor_json(self),
            "targets": [t.to_json() for t in targets(self)],
            "policies": [r.to_json() for r in self.results],
        }


# ---- formatting ---------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}" if seconds >= 0.1 else f"{seconds * 1000:.1f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f}%"


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "n/a" if value is None else format(value, fmt)


def _usd(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"${value:.3g}" if value < 1 else f"${value:.2f}"


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return "n/a"
    return f"{value / base:.2f}x"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


COMPARISON_HEADER = (
    "policy",
    "ok / failed",
    "TTFT p50 / p90 / p99 ms",
    "ITL p50 / p99 ms",
    "E2E p50 / p99 s",
    "out tok/s",
    "hit rate",
    "queue mean / max",
    "GPU-s",
    "cost",
    "tasks ok / all",
    "$ / ok task",
    "ok tasks / $",
)


def comparison_rows(results: Sequence[PolicyResult]) -> list[list[str]]:
    rows = []
    for r in results:
        if not r.ok:
            continue
        rows.append(
            [
                r.policy,
                f"{r.succeeded} / {r.failed}",
                f"{_ms(r.ttft.p50)} / {_ms(r.ttft.p90)} / {_ms(r.ttft.p99)}",
                f"{_ms(r.itl.p50)} / {_ms(r.itl.p99)}",
                f"{r.e2e.p50:.2f} / {r.e2e.p99:.2f}",
                f"{r.output_tok_s:.0f}",
                _pct(r.hit_rate),
                f"{_num(r.queue_waiting_mean)} / {_num(r.queue_waiting_max, '.0f')}",
                f"{r.gpu_seconds:.0f}",
                _usd(r.cost_usd),
                f"{r.tasks.succeeded} / {r.tasks.planned}",
                _usd(r.cost_per_successful_task),
                _num(r.successful_tasks_per_dollar, ".0f"),
            ]
        )
    return rows


RATIO_HEADER = (
    "policy",
    "TTFT p50",
    "TTFT p99",
    "E2E p99",
    "out tok/s",
    "hit rate",
    "tasks ok",
    "$ / ok task",
    "ok tasks / $",
)


def ratio_rows(results: Sequence[PolicyResult], base: PolicyResult) -> list[list[str]]:
    rows = []
    for r in results:
        if not r.ok or r is base:
            continue
        rows.append(
            [
                r.policy,
                _ratio(r.ttft.p50, base.ttft.p50),
                _ratio(r.ttft.p99, base.ttft.p99),
                _ratio(r.e2e.p99, base.e2e.p99),
                _ratio(r.output_tok_s, base.output_tok_s),
                _ratio(r.hit_rate, base.hit_rate),
                _ratio(r.tasks.succeeded, base.tasks.succeeded),
                _ratio(r.cost_per_successful_task, base.cost_per_successful_task),
                _ratio(r.successful_tasks_per_dollar, base.successful_tasks_per_dollar),
            ]
        )
    return rows


def success_rate(r: PolicyResult) -> float | None:
    """Succeeded / sent requests (None when nothing was sent)."""
    return r.succeeded / r.requests_sent if r.requests_sent else None


def _result(report: BenchReport, name: str) -> PolicyResult | None:
    return next((r for r in report.ran if r.policy == name), None)


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


@dataclass(frozen=True, slots=True)
class Target:
    """One of issue 4's targets for one policy: the measured ratio and whether it holds.

    floor_ratio (the TTFT target, when the report has a floor): the TTFT floor's p90 over
    the peer's successful requests / the peer's p90, what an oracle router would score;
    `reachable`: whether that meets the goal (if not, no router can)."""

    policy: str
    name: str
    ratio: float | None
    goal: str
    met: bool | None  # None: not measurable in this run (a policy missing)
    floor_ratio: float | None = None
    reachable: bool | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "policy": self.policy,
            "target": self.name,
            "ratio": self.ratio,
            "goal": self.goal,
            "met": self.met,
        }
        if self.floor_ratio is not None:
            doc["floor_ratio"] = self.floor_ratio
            doc["reachable"] = self.reachable
        return doc


TTFT_TARGET = "TTFT p90 / peer"
TTFT_GOAL = 0.50
# (name, goal text, test). Ratios are rounded to 2 decimals before the test, as printed.
_TARGETS: tuple[tuple[str, str, Callable[[float], bool]], ...] = (
    ("hit rate / bound", ">= 0.90", lambda x: x >= 0.90),
    (TTFT_TARGET, f"<= {TTFT_GOAL:.2f}", lambda x: x <= TTFT_GOAL),
    ("out tok/s / peer", ">= 1.00", lambda x: x >= 1.00),
    ("success / peer", ">= 1.00", lambda x: x >= 1.00),
    ("$ / ok task / baseline", "<= 0.80", lambda x: x <= 0.80),
)


def target_ratios(report: BenchReport, r: PolicyResult) -> list[float | None]:
    """r's figures as issue 4 states its targets: hit rate over the one-infinite-cache
    bound, TTFT p90, output throughput and success rate over the peer's (sglang-router),
    cost per successful task over the baseline's (round robin)."""
    peer = _result(report, report.peer)
    base = report.baseline_result()
    return [
        _div(r.hit_rate, report.hit_bounds.get(r.policy)),
        _div(r.ttft.p90, peer.ttft.p90) if peer is not None else None,
        _div(r.output_tok_s, peer.output_tok_s) if peer is not None else None,
        _div(success_rate(r), success_rate(peer)) if peer is not None else None,
        _div(r.cost_per_successful_task, base.cost_per_successful_task)
        if base is not None
        else None,
    ]


def served_ids(r: PolicyResult) -> list[str]:
    """The requests whose TTFT r's distribution counts (successful, with a first token)."""
    return [o.request_id for o in r.outcomes if o.ok and o.ttft_s is not None]


def floor_of(report: BenchReport, r: PolicyResult) -> Distribution | None:
    """The TTFT floor over the requests r's TTFT figures count (None without a floor)."""
    floor = report.ttft_floor
    if floor is None:
        return None
    d = floor.over(served_ids(r))
    return d if d.n else None


def floor_peer_ratio(report: BenchReport) -> float | None:
    """The floor's p90 / the peer's TTFT p90, over the peer's successful requests: the
    TTFT target an oracle router would score against this peer."""
    peer = _result(report, report.peer)
    if peer is None:
        return None
    floor = floor_of(report, peer)
    return None if floor is None else _div(floor.p90, peer.ttft.p90)


def targets(report: BenchReport) -> list[Target]:
    """The targets for every meshd policy that ran (names starting with "meshd")."""
    out = []
    floor_ratio = floor_peer_ratio(report)
    for r in report.ran:
        if not r.policy.startswith("meshd"):
            continue
        for (name, goal, test), ratio in zip(_TARGETS, target_ratios(report, r), strict=True):
            met = None if ratio is None else test(round(ratio, 2))
            target = Target(r.policy, name, ratio, goal, met)
            if name == TTFT_TARGET and floor_ratio is not None:
                target = replace(
                    target, floor_ratio=floor_ratio, reachable=test(round(floor_ratio, 2))
                )
            out.append(target)
    return out


def floor_json(report: BenchReport) -> dict[str, Any] | None:
    """results.json's "ttft_floor": the floor, its ratio to the peer, and per policy the
    floor's p90 over the policy's successful requests and the policy's p90 over it."""
    floor = report.ttft_floor
    if floor is None:
        return None
    policies = {}
    for r in report.ran:
        d = floor_of(report, r)
        policies[r.policy] = {
            "floor_p90_s": None if d is None else round(d.p90, 6),
            "ttft_p90_over_floor_p90": None if d is None else _div(r.ttft.p90, d.p90),
        }
    return {
        **floor.to_json(),
        "floor_p90_over_peer_p90": floor_peer_ratio(report),
        "policies": policies,
    }


def floor_line(report: BenchReport) -> str | None:
    """The floor in one line: what it is, what it cost, its p50 / p90 / p99."""
    floor = report.ttft_floor
    if floor is None:
        return None
    d = floor.ttft
    unserved = f", {len(floor.unserved):,} the engines refuse" if floor.unserved else ""
    return (
        f"TTFT floor ({floor.gpu}: {floor.definition}; {d.n:,} requests{unserved}, computed "
        f"in {floor.wall_s:.1f} s): p50 / p90 / p99 = {_ms(d.p50)} / {_ms(d.p90)} / "
        f"{_ms(d.p99)} ms"
    )


def _floor_verdict(report: BenchReport, t: Target) -> str:
    if t.floor_ratio is not None:
        if t.reachable:
            return f"; floor p90 / peer = {t.floor_ratio:.2f}"
        return f"; floor p90 / peer = {t.floor_ratio:.2f}: no router can meet {t.goal} here"
    floor = report.ttft_floor
    if floor is None or not floor.ttft.n:
        return ""
    p90 = floor.ttft.p90
    return (
        f"; floor p90 = {_ms(p90)} ms: {t.goal} needs a peer p90 of at least "
        f"{_ms(p90 / TTFT_GOAL)} ms"
    )


TARGET_HEADER = (
    "policy",
    "hit rate / bound",
    "TTFT p90 / peer",
    "out tok/s / peer",
    "success / peer",
    "$ / ok task / baseline",
)


def target_lines(report: BenchReport) -> list[str]:
    """Every policy's figures as target ratios, then meshd's verdicts."""
    ran = report.ran
    if not ran:
        return []
    has_floor = report.ttft_floor is not None
    rows = []
    for r in ran:
        ratios = target_ratios(report, r)
        hit = "n/a"
        bound = report.hit_bounds.get(r.policy)
        if ratios[0] is not None and bound is not None:
            hit = f"{_pct(r.hit_rate)} / {_pct(bound)} = {ratios[0]:.2f}"
        rest = ["n/a" if x is None else f"{x:.2f}" for x in ratios[1:]]
        row = [r.policy, hit, *rest]
        if has_floor:
            floor = floor_of(report, r)
            row.append(_num(None if floor is None else _div(r.ttft.p90, floor.p90), ".2f"))
        rows.append(row)
    header = (*TARGET_HEADER, "TTFT p90 / floor") if has_floor else TARGET_HEADER
    lines = [
        "",
        f"Targets (peer: {report.peer}, baseline: {report.baseline}; bound: one infinite "
        "cache over the requests each policy sent"
        + ("; floor: over the requests each policy served" if has_floor else "")
        + "):",
        "",
    ]
    line = floor_line(report)
    if line is not None:
        lines += [line, ""]
    lines += _table(header, rows)
    verdicts = targets(report)
    if verdicts:
        lines.append("")
        for t in verdicts:
            mark = "n/a" if t.met is None else ("met" if t.met else "MISSED")
            ratio = "n/a" if t.ratio is None else f"{t.ratio:.2f}"
            extra = _floor_verdict(report, t) if t.name == TTFT_TARGET else ""
            lines.append(f"- {t.policy}: {t.name} = {ratio} (goal {t.goal}): {mark}{extra}")
    return lines


def comparison_table(report: BenchReport) -> str:
    """The comparison table (Markdown; readable as plain text too), the ratios against the
    baseline and the targets."""
    lines = _table(COMPARISON_HEADER, comparison_rows(report.results))
    base = report.baseline_result()
    ratios = ratio_rows(report.results, base) if base is not None else []
    if base is not None and ratios:
        lines += ["", f"Ratios vs {base.policy} (lower is better for latency and $ / task):", ""]
        lines += _table(RATIO_HEADER, ratios)
    lines += target_lines(report)
    not_run = [r for r in report.results if not r.ok]
    if not_run:
        lines += [""]
        lines += [f"- {r.policy}: {r.status}: {r.reason}" for r in not_run]
    return "\n".join(lines)


def render_markdown(report: BenchReport, plots: Sequence[str] = ()) -> str:
    w = report.workload
    out = [f"# {report.title}", ""]
    out += [f"Started {report.started_at}. Command: `{report.command}`", ""]
    out += ["## Comparison", "", comparison_table(report), ""]
    out += _basis_lines(report)
    out += ["## Setup", ""]
    fleet = report.fleet
    out.append(
        f"- Fleet: {fleet.get('engines')} {fleet.get('kind')} engines "
        f"({fleet.get('gpu_summary')}), a fresh fleet per policy (caches start cold)"
        + (f", time_scale {fleet['time_scale']}" if fleet.get("time_scale", 1.0) != 1.0 else "")
        + (f", {fleet['kv_blocks']} KV blocks each" if fleet.get("kv_blocks") else "")
        + "."
    )
    c = report.client
    out.append(
        f"- Client: open loop by arrival time plus dependency chains, streaming, timeout "
        f"{c.get('timeout_s')} s, at most {c.get('max_concurrency')} in flight"
        + (f", sends stop at {c['duration_s']} s" if c.get("duration_s") else "")
        + "."
    )
    for r in report.results:
        out.append(f"- `{r.policy}`: {r.summary}" + ("" if r.ok else f" — {r.status}: {r.reason}"))
    out += [""]
    out += ["## Workload", ""]
    args = ", ".join(f"{k}={v}" for k, v in report.workload_args.items())
    out.append(f"`{report.workload_name}`" + (f" ({args})" if args else ""))
    out.append("")
    rr_bounds = w.get("round_robin_bound", {})
    rows = [
        ["requests", str(w.get("requests"))],
        ["duration (planned), s", f"{w.get('duration_s', 0):.1f}"],
        ["rate, req/s", f"{w.get('rate_rps', 0):.2f}"],
        ["kinds", json.dumps(w.get("kinds"))],
        ["workloads", json.dumps(w.get("workloads"))],
        ["tenants", json.dumps(w.get("tenants"))],
        ["chains / dependent requests", f"{w.get('chains')} / {w.get('dependent_requests')}"],
        ["prompt tokens mean / p99", _spread(w.get("prompt_tokens"))],
        ["context tokens (est.) mean / p99", _spread(w.get("context_tokens_est"))],
        ["max_tokens mean / p99", _spread(w.get("max_tokens"))],
        ["hit-rate upper bound (one infinite cache)", _pct(w.get("upper_bound_hit_rate"))],
    ]
    rows += [
        [f"hit-rate bound, round robin over {n} infinite caches", _pct(v)]
        for n, v in rr_bounds.items()
    ]
    floor = report.ttft_floor
    if floor is not None:
        d = floor.ttft
        rows.append(
            [
                f"TTFT floor p50 / p90 / p99 ms ({floor.gpu}, no queue, one infinite cache)",
                f"{_ms(d.p50)} / {_ms(d.p90)} / {_ms(d.p99)}",
            ]
        )
    out += _table(["", ""], rows)
    out += [
        "",
        "Bounds count prompt blocks (a block hits if an earlier request had it); the engines "
        "count tokens, and dependent steps add answers the bounds do not know about.",
        "",
    ]
    out += _engine_section(report)
    out += _failure_section(report)
    if plots:
        out += ["## Plots", ""]
        titles = dict(PLOTS)
        for name in plots:
            out += [f"### {titles.get(name, name)}", "", f"![{titles.get(name, name)}]({name})", ""]
    if report.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in report.notes] + [""]
    out += [
        f"Raw figures: `{RESULTS_JSON}` (per policy) and `{REQUESTS_JSONL}` (per request).",
        "",
    ]
    return "\n".join(out)


def _spread(d: Any) -> str:
    if not isinstance(d, dict):
        return "n/a"
    return f"{d.get('mean', 0):.0f} / {d.get('p99', 0):.0f}"


def _basis_lines(report: BenchReport) -> list[str]:
    ran = report.ran
    if not ran:
        return ["No policy ran.", ""]
    bases = {r.gpu_basis for r in ran}
    if bases == {"busy"}:
        text = (
            "GPU-seconds are each engine's busy time (the simulator's own counter of time "
            "spent in forward steps), priced per GPU-hour by GPU generation."
        )
    elif bases == {"provisioned"}:
        text = (
            "GPU-seconds are wall time x engines provisioned (the engines expose no busy "
            "counter), priced per GPU-hour by GPU generation."
        )
    else:
        text = "GPU-seconds: busy time where engines report it, else wall time x engines."
    return [
        text + " Cost counts all spend, failed and cut-off work included; a task is a "
        "chain (agentic task or chat session) or a lone request, and succeeds when all its "
        "steps succeed. Latencies are measured at the client, successful requests only.",
        "",
    ]


def _engine_section(report: BenchReport) -> list[str]:
    ran = report.ran
    if not ran or not ran[0].engines:
        return []
    names = [e.name for e in ran[0].engines]
    header = ["engine", "GPU", "$/h", *[f"{r.policy} hit rate" for r in ran]]
    header += [f"{r.policy} GPU-s" for r in ran]
    rows = []
    for i, name in enumerate(names):
        e0 = ran[0].engines[i]
        row = [name, e0.gpu, f"{e0.price_per_gpu_hour:.2f}"]
        row += [_pct(r.engines[i].hit_rate) if i < len(r.engines) else "n/a" for r in ran]
        row += [f"{r.engines[i].gpu_seconds:.1f}" if i < len(r.engines) else "n/a" for r in ran]
        rows.append(row)
    return ["## Engines", "", *_table(header, rows), ""]


def _failure_section(report: BenchReport) -> list[str]:
    lines: list[str] = []
    for r in report.ran:
        if r.failures or r.not_sent:
            parts = [f"{k} x{v}" for k, v in sorted(r.failures.items())]
            if r.not_sent:
                parts.append(f"not sent x{r.not_sent}")
            detail = next((o.detail for o in r.outcomes if not o.ok and o.detail), "")
            line = f"- {r.policy}: " + ", ".join(parts)
            lines.append(line + (f" (e.g. {detail})" if detail else ""))
    return ["## Failures", "", *lines, ""] if lines else []


# ---- plots --------------------------------------------------------------------------


def _legend(ax: Any, **kw: Any) -> None:
    if ax.get_legend_handles_labels()[0]:  # a pass with nothing to draw adds no line
        ax.legend(**kw)


def _plot_ttft_cdf(ax: Any, ran: Sequence[PolicyResult]) -> None:
    for r in ran:
        values = sorted(o.ttft_s * 1000 for o in r.outcomes if o.ok and o.ttft_s is not None)
        if values:
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, ys, where="post", label=r.policy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT, ms (log)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, alpha=0.3)
    _legend(ax)


def _plot_throughput(ax: Any, ran: Sequence[PolicyResult]) -> None:
    for r in ran:
        xs, ys = throughput_series(r.outcomes)
        ax.plot(xs, ys, label=r.policy)
    ax.set_xlabel("time, s")
    ax.set_ylabel("output tokens/s")
    ax.grid(True, alpha=0.3)
    _legend(ax)


def _plot_queue(ax: Any, ran: Sequence[PolicyResult]) -> None:
    # vLLM admits every request it has KV room for, so "waiting" stays near 0 until an
    # engine is full; running + waiting shows where the load went before that.
    for k, r in enumerate(ran):
        if not r.samples:
            continue
        color = f"C{k}"
        ts = [s.t_s for s in r.samples]
        total = [sum(s.waiting) + sum(s.running) for s in r.samples]
        ax.plot(ts, total, color=color, label=f"{r.policy}: running + waiting")
        ax.plot(ts, [sum(s.waiting) for s in r.samples], color=color, linestyle="--",
                label=f"{r.policy}: waiting")  # fmt: skip
    ax.set_xlabel("time, s")
    ax.set_ylabel("requests (sum over engines)")
    ax.grid(True, alpha=0.3)
    _legend(ax, fontsize="small")


def _plot_hit_rate(ax: Any, ran: Sequence[PolicyResult]) -> None:
    if not ran or not ran[0].engines:
        return
    names = [e.name for e in ran[0].engines]
    width = 0.8 / len(ran)
    for k, r in enumerate(ran):
        xs = [i + k * width for i in range(len(names))]
        ys = [(e.hit_rate or 0.0) * 100 for e in r.engines]
        ax.bar(xs[: len(ys)], ys, width=width, label=r.policy)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_ylabel("prefix-cache hit rate, %")
    ax.set_ylim(0, 100)
    _legend(ax)


def _plot_cost(ax: Any, ran: Sequence[PolicyResult]) -> None:
    names = [r.policy for r in ran]
    values = [(r.cost_per_successful_task or 0.0) * 1000 for r in ran]
    bars = ax.bar(names, values, color="tab:orange")
    for bar, r in zip(bars, ran, strict=True):
        label = "n/a" if r.cost_per_successful_task is None else f"{bar.get_height():.3f}"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom")  # fmt: skip
    ax.set_ylabel("$ per 1000 successful tasks")


_PLOTTERS: dict[str, Callable[[Any, Sequence[PolicyResult]], None]] = {
    "ttft_cdf.png": _plot_ttft_cdf,
    "throughput.png": _plot_throughput,
    "queue_depth.png": _plot_queue,
    "hit_rate_per_engine.png": _plot_hit_rate,
    "cost_per_task.png": _plot_cost,
}


def write_plots(report: BenchReport, out_dir: Path) -> list[str]:
    """Draw every plot into `out_dir`; returns the file names written ([] without
    matplotlib or without a policy that ran)."""
    ran = report.ran
    if not ran:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    for name, title in PLOTS:
        if name == "queue_depth.png" and not any(r.samples for r in ran):
            continue
        if name == "hit_rate_per_engine.png" and not any(
            e.hit_rate is not None for r in ran for e in r.engines
        ):
            continue
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        _PLOTTERS[name](ax, ran)
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(out_dir / name)
        plt.close(fig)
        written.append(name)
    return written


def write_report(report: BenchReport, out_dir: Path, *, plots: bool = True) -> Path:
    """Write results.json, requests.jsonl, the plots and report.md; returns report.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RESULTS_JSON).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    with (out_dir / REQUESTS_JSONL).open("w") as f:
        for r in report.results:
            for o in r.outcomes:
                f.write(json.dumps({"policy": r.policy, **o.to_json()}) + "\n")
    names = write_plots(report, out_dir) if plots else []
    path = out_dir / REPORT_MD
    path.write_text(render_markdown(report, names))
    return path
