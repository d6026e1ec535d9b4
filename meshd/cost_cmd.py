"""`meshd cost`: read a day of access logs (or a Mooncake/Azure trace joined with a `meshd
bench` run) through the cost ledger and print cost per successful task beside cost per token
and cost per request, with the waste broken down, as a table and an optional plot; and both
views of the spend: elastic (busy GPU-seconds) and fixed fleet (every GPU, the whole window).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from filters.cost_ledger import (
    ESTIMATED,
    MEASURED,
    REPORTED,
    CostFigures,
    CostLedger,
    FixedFleetFigures,
    FleetSpec,
    LedgerSummary,
    PriceTable,
    TaskResult,
)
from meshd.access_log import AccessLogError, AccessRecord, read_access_log

EXIT_USAGE = 2
_WASTE = ("retries", "failed_requests", "abandoned_streams", "failed_tasks")


def load_prices(path: str | Path | None) -> PriceTable:
    """A price table from YAML: `{H100: 2.5, ...}` or `{prices: {H100: 2.5}}` ($/GPU-hour)."""
    if path is None:
        return PriceTable()
    doc = yaml.safe_load(Path(path).read_text()) or {}
    if isinstance(doc, dict) and "prices" in doc:
        doc = doc["prices"]
    if not isinstance(doc, dict) or not all(isinstance(v, int | float) for v in doc.values()):
        raise ValueError(f"{path}: expected a mapping of GPU name to $/GPU-hour")
    return PriceTable({str(k): float(v) for k, v in doc.items()})


def load_fleet(path: str | Path | None) -> dict[str, FleetSpec] | None:
    """A fleet from YAML: `{endpoint: GPU}` or `{endpoint: [GPU, count]}`, optionally under
    `fleet:`; endpoints as the access log names them (attempts' `endpoint`)."""
    if path is None:
        return None
    doc = yaml.safe_load(Path(path).read_text()) or {}
    if isinstance(doc, dict) and "fleet" in doc:
        doc = doc["fleet"]
    if not isinstance(doc, dict) or not doc:
        raise ValueError(f"{path}: expected a mapping of endpoint to GPU or [GPU, count]")
    fleet: dict[str, FleetSpec] = {}
    for endpoint, spec in doc.items():
        if isinstance(spec, str):
            fleet[str(endpoint)] = spec
        elif (
            isinstance(spec, list)
            and len(spec) == 2
            and isinstance(spec[0], str)
            and isinstance(spec[1], int)
            and not isinstance(spec[1], bool)
            and spec[1] >= 1
        ):
            fleet[str(endpoint)] = (spec[0], spec[1])
        else:
            raise ValueError(f"{path}: {endpoint}: expected GPU or [GPU, count >= 1], got {spec!r}")
    return fleet


def _usd(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"${v:.6f}" if abs(v) < 0.01 else f"${v:,.4f}"


def _per_token(v: float | None) -> str:
    return "n/a" if v is None else f"${v * 1e6:.4f}/M"


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.1f}"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 100:.1f}%"


HEADER = (
    "group",
    "requests ok/all",
    "tasks ok/all",
    "cost",
    "$/ok task",
    "$/token",
    "$/request",
    "ok tasks/$",
    "waste",
    "retries",
    "failed req",
    "abandoned",
    "failed tasks",
)


def figures_row(name: str, f: CostFigures) -> list[str]:
    tasks = f.tasks_succeeded + f.tasks_failed
    waste = f"{_usd(f.waste.total)} ({(f.waste_ratio or 0.0) * 100:.1f}%)"
    return [
        name,
        f"{f.ok_requests}/{f.requests}",
        f"{f.tasks_succeeded}/{tasks}",
        _usd(f.cost_usd),
        _usd(f.cost_per_successful_task),
        _per_token(f.cost_per_token),
        _usd(f.cost_per_request),
        _num(f.success_per_dollar),
        waste,
        *(_usd(getattr(f.waste, k)) for k in _WASTE),
    ]


# The fixed-fleet view, appended to a comparison row (one per policy of a bench run).
FIXED_HEADER = ("fixed cost", "fixed $/ok task", "utilisation")


def fixed_cells(fx: FixedFleetFigures | None) -> list[str]:
    if fx is None:
        return ["n/a"] * len(FIXED_HEADER)
    return [_usd(fx.spend_usd), _usd(fx.cost_per_successful_task), _pct(fx.utilisation)]


def views_table(summary: LedgerSummary) -> str:
    """Elastic beside fixed fleet, for the whole ledger (the fleet is shared by every group)."""
    total, fx = summary.total, summary.fixed
    header = ("view", "spend", "$/ok task", "ok tasks/$", "utilisation", "idle", "basis")
    rows = [
        [
            "elastic",
            _usd(total.cost_usd),
            _usd(total.cost_per_successful_task),
            _num(total.success_per_dollar),
            "-",
            "-",
            f"{total.gpu_seconds:,.1f} busy GPU-s (an autoscaled pool)",
        ]
    ]
    if fx is not None:
        source = "as given" if fx.declared else "seen in the log"
        rows.append(
            [
                "fixed",
                _usd(fx.spend_usd),
                _usd(fx.cost_per_successful_task),
                _num(fx.success_per_dollar),
                _pct(fx.utilisation),
                _usd(fx.idle_usd),
                f"{fx.gpus} GPU(s) on {fx.endpoints} endpoint(s) {source} x {fx.window_s:,.1f} s",
            ]
        )
    return render_table(header, rows)


# How each reading of an attempt's GPU-seconds is named in the report.
_READINGS = (
    (REPORTED, "reported by the engine for the request"),
    (MEASURED, "the engine's measured busy time, apportioned"),
    (ESTIMATED, "the timing model's estimate"),
)


def readings_line(summary: LedgerSummary) -> str:
    """Which reading the elastic spend is: each one's share of the dollars and attempts,
    and the timing model's figure for the same requests ("" when nothing was spent)."""
    spent = sum(r.usd for r in summary.readings.values())
    if spent <= 0:
        return ""
    parts = [
        f"{r.usd / spent:.0%} {what} ({r.attempts} attempt(s), {_usd(r.usd)})"
        for key, what in _READINGS
        if (r := summary.readings.get(key)) is not None
    ]
    model = summary.total.modelled_usd
    return (
        "elastic spend by reading: " + "; ".join(parts)
        + f". The timing model alone: {_usd(model)}, $/ok task "
        + _usd(summary.total.modelled_cost_per_successful_task)
    )  # fmt: skip


def task_rows(tasks: Sequence[TaskResult]) -> tuple[tuple[str, ...], list[list[str]]]:
    header = ("task", "tenant", "model", "ok", "requests", "cost", "wasted", "closed")
    rows = [
        [
            t.key,
            t.tenant,
            t.model,
            "yes" if t.succeeded else "no",
            str(t.requests),
            _usd(t.cost_usd),
            _usd(t.wasted_usd),
            t.reason,
        ]
        for t in sorted(tasks, key=lambda t: -t.cost_usd)
    ]
    return header, rows


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(out)


class CacheReplays:
    """What the response cache did, from the access log's `response_cache` fields."""

    def __init__(self) -> None:
        self.requests = self.cacheable = self.hits = self.coalesced = 0
        self.gpu_seconds = self.usd = 0.0

    def add(self, record: AccessRecord) -> None:
        self.requests += 1
        result = record.response_cache
        if result is None:
            return
        self.cacheable += 1
        if result in ("hit", "coalesced"):
            self.hits += result == "hit"
            self.coalesced += result == "coalesced"
            self.gpu_seconds += record.avoided_gpu_seconds or 0.0
            self.usd += record.avoided_usd or 0.0

    def line(self) -> str:
        replayed = self.hits + self.coalesced
        return (
            f"response cache: {replayed} of {self.requests} requests answered without an "
            f"engine ({self.hits} hits, {self.coalesced} coalesced; {self.cacheable} "
            f"cacheable); avoided {self.gpu_seconds:.3f} GPU-s, {_usd(self.usd)}"
        )


def render_summary(summary: LedgerSummary, by: str | None, tasks: Sequence[TaskResult] = ()) -> str:
    rows = [figures_row("all", summary.total)]
    if by == "tenant":
        rows += [figures_row(k, v) for k, v in summary.by_tenant.items()]
    elif by == "model":
        rows += [figures_row(k, v) for k, v in summary.by_model.items()]
    out = [render_table(HEADER, rows)]
    if by == "task":
        out += ["", render_table(*task_rows(tasks))]
    out += ["", views_table(summary)]
    readings = readings_line(summary)
    if readings:
        out += [readings]
    notes = []
    if summary.estimated_requests:
        notes.append(
            f"{summary.estimated_requests} request(s) had no engine-reported GPU-seconds; "
            "their cost is the timing model's estimate"
        )
    if summary.evicted_tasks:
        notes.append(f"{summary.evicted_tasks} task(s) closed early (open-task limit)")
    if summary.fixed is None:
        notes.append("no fixed-fleet view: the log names no endpoint (give --fleet)")
    elif summary.fixed.untracked_attempts:
        notes.append(
            f"{summary.fixed.untracked_attempts} attempt(s) on endpoints past the ledger's "
            "endpoint limit are not in the fixed fleet (give --fleet)"
        )
    out += [""] + [f"note: {n}" for n in notes] if notes else []
    return "\n".join(out)


def write_plot(summary: LedgerSummary, by: str | None, path: Path) -> None:
    """Two panels: $/ok task beside $/request per group, and the waste stacked by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: Mapping[str, CostFigures] = {"all": summary.total}
    if by == "tenant":
        groups = {**groups, **summary.by_tenant}
    elif by == "model":
        groups = {**groups, **summary.by_model}
    names = list(groups)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(names))
    left.bar([x - 0.2 for x in xs], [g.cost_per_successful_task or 0 for g in groups.values()], 0.4,
             label="$ / successful task")  # fmt: skip
    left.bar([x + 0.2 for x in xs], [g.cost_per_request or 0 for g in groups.values()], 0.4,
             label="$ / request")  # fmt: skip
    left.set_xticks(list(xs), names)
    left.set_ylabel("USD")
    left.legend()
    left.set_title("Cost per successful task vs per request")
    bottom = [0.0] * len(names)
    for kind in _WASTE:
        values = [getattr(g.waste, kind) for g in groups.values()]
        right.bar(list(xs), values, bottom=bottom, label=kind.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.bar(list(xs), [g.useful_usd for g in groups.values()], bottom=bottom, label="useful")
    right.set_xticks(list(xs), names)
    right.set_ylabel("USD")
    right.legend()
    right.set_title("Where the money went")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- traces joined with a bench run --------------------------------------------------


def records_from_bench(
    planned: Iterable[Any], results_dir: Path, prices: PriceTable
) -> dict[str, list[AccessRecord]]:
    """Per policy of a bench run, access records for the trace's requests it sent.

    requests.jsonl (loadtest/bench/report.py) gives each request's outcome and tokens,
    joined to the trace by request id ("<stem>:<line>", as loadtest/workloads/traces.py
    names them); prompt tokens come from the trace when the engine did not report them. The
    run measured GPU-seconds per engine, not per request, so each request's share is its
    timing-model estimate scaled to the pass's measured total (results.json gpu_seconds), on
    the pass's most common GPU."""
    by_id = {p.request_id: p for p in planned}
    doc = json.loads((results_dir / "results.json").read_text())
    passes = {p["policy"]: p for p in doc.get("policies", []) if p.get("status") == "ok"}
    rows: dict[str, list[dict[str, Any]]] = {}
    with (results_dir / "requests.jsonl").open() as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if row.get("request_id") in by_id and row.get("policy") in passes:
                    rows.setdefault(row["policy"], []).append(row)
    ledger_timing = CostLedger(prices).timing
    out: dict[str, list[AccessRecord]] = {}
    for policy, prow in rows.items():
        p = passes[policy]
        gpus = Counter(e.get("gpu") for e in p.get("engines", []))
        gpu = gpus.most_common(1)[0][0] if gpus else None
        drafts = []
        for row in prow:
            plan = by_id[row["request_id"]]
            prompt = row.get("prompt_tokens") or plan.prompt_tokens
            est = ledger_timing.gpu_seconds(
                gpu, prompt, row.get("cached_tokens") or 0, row.get("output_tokens") or 0
            )
            drafts.append((row, prompt, est))
        measured = float(p.get("gpu_seconds") or 0.0)
        estimated = sum(e for _, _, e in drafts)
        scale = measured / estimated if measured > 0 and estimated > 0 else 1.0
        out[policy] = [
            AccessRecord(
                ts=float(row.get("sent_at_s") or 0.0),
                request_id=row["request_id"],
                outcome="ok" if row.get("ok") else (row.get("error") or "failed"),
                status=int(row.get("status") or 0),
                tenant=row.get("tenant"),
                task_id=row.get("task") if row.get("task") != row["request_id"] else None,
                step=row.get("step"),
                gpu=gpu,
                stream=True,
                prompt_tokens=prompt,
                cached_tokens=row.get("cached_tokens"),
                completion_tokens=row.get("output_tokens"),
                ttft_s=row.get("ttft_s"),
                e2e_s=row.get("e2e_s"),
                gpu_seconds=est * scale,
                gpu_seconds_source="estimated",
            )
            for row, prompt, est in drafts
        ]
    return out


def bench_fleets(results_dir: Path) -> dict[str, tuple[dict[str, FleetSpec], float | None]]:
    """Per ok policy of a bench run, its engines as a fleet (name -> GPU) and its wall time:
    what a fixed fleet paid for during the pass."""
    doc = json.loads((results_dir / "results.json").read_text())
    out: dict[str, tuple[dict[str, FleetSpec], float | None]] = {}
    for p in doc.get("policies", []):
        if p.get("status") != "ok":
            continue
        fleet: dict[str, FleetSpec] = {
            str(e.get("name") or e.get("url") or f"engine-{i}"): str(e.get("gpu") or "unknown")
            for i, e in enumerate(p.get("engines", []))
        }
        wall = float(p.get("wall_s") or 0.0)
        out[p["policy"]] = (fleet, wall if wall > 0 else None)
    return out


def run_trace_join(
    args: argparse.Namespace, prices: PriceTable, fleet: Mapping[str, FleetSpec] | None = None
) -> int:
    """One row per policy; the fixed view's fleet is `fleet` (--fleet), else the pass's
    engines, over the pass's wall time."""
    from loadtest.workloads.traces import read_azure, read_mooncake

    planned = read_mooncake(args.mooncake) if args.mooncake else read_azure(args.azure)
    per_policy = records_from_bench(planned, Path(args.results), prices)
    if not per_policy:
        print("meshd cost: no request of the trace is in the bench results", file=sys.stderr)
        return 1
    fleets = bench_fleets(Path(args.results))
    rows = []
    for policy, records in sorted(per_policy.items()):
        engines, wall = fleets.get(policy, ({}, None))
        ledger = CostLedger(
            prices, idle_timeout_s=args.idle_timeout, fleet=fleet or engines or None
        )
        ledger.record_all(sorted(records, key=lambda r: r.ts))
        ledger.close_all()
        summary = ledger.summary(window_s=wall)
        rows.append([*figures_row(policy, summary.total), *fixed_cells(summary.fixed)])
    matched = sum(len(r) for r in per_policy.values())
    print(f"trace: {len(planned)} requests; {matched} matched in {args.results}")
    print(render_table(("policy", *HEADER[1:], *FIXED_HEADER), rows))
    return 0


def cost(args: argparse.Namespace) -> int:
    try:
        prices = load_prices(args.prices)
        fleet = load_fleet(args.fleet)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"meshd cost: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.mooncake or args.azure:
        if not args.results:
            print("meshd cost: --mooncake/--azure need --results DIR", file=sys.stderr)
            return EXIT_USAGE
        return run_trace_join(args, prices, fleet)
    if not args.log:
        print("meshd cost: give --log FILE (or --mooncake/--azure with --results)", file=sys.stderr)
        return EXIT_USAGE
    ledger = CostLedger(prices, idle_timeout_s=args.idle_timeout, fleet=fleet)
    tasks: list[TaskResult] = []
    errors: list[str] = []
    replays = CacheReplays()
    try:
        for path in args.log:
            for record in read_access_log(path, strict=not args.skip_bad, errors=errors):
                tasks += ledger.record(record)
                replays.add(record)
    except (OSError, AccessLogError) as exc:
        print(f"meshd cost: {exc}", file=sys.stderr)
        return 1
    tasks += ledger.close_all()
    summary = ledger.summary()
    print(render_summary(summary, args.by, tasks))
    if replays.cacheable:
        print(replays.line())
    if errors:
        print(f"skipped {len(errors)} malformed line(s); first: {errors[0]}", file=sys.stderr)
    if args.plot:
        write_plot(summary, args.by, Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


def add_cost_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log", action="append", metavar="FILE", help="access log (repeat for rotated files, "
        "oldest first)"
    )  # fmt: skip
    p.add_argument("--by", choices=("tenant", "model", "task"), help="break the table down")
    p.add_argument("--plot", metavar="PNG", help="also draw the figures into this file")
    p.add_argument("--prices", metavar="YAML", help="$/GPU-hour by GPU, e.g. {H100: 2.5}")
    p.add_argument(
        "--fleet", metavar="YAML", help="the fixed fleet, endpoint: GPU or [GPU, count] "
        "(default: the endpoints the log names, one GPU each)"
    )  # fmt: skip
    p.add_argument(
        "--idle-timeout", type=float, default=600.0, metavar="S",
        help="close a task after this long without a request (default 600)",
    )  # fmt: skip
    p.add_argument("--skip-bad", action="store_true", help="skip malformed lines, don't stop")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--mooncake", metavar="FILE", help="a Mooncake JSONL trace")
    src.add_argument("--azure", metavar="FILE", help="an Azure LLM inference CSV trace")
    p.add_argument("--results", metavar="DIR", help="a `meshd bench` output dir to join with")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `meshd cost`."""
    p = subparsers.add_parser(
        "cost",
        help="cost per successful task, cost per token and waste from access logs",
        description="Read access logs (JSON lines, docs/access-log.md) through the cost "
        "ledger: cost per successful task beside cost per token and per request, the "
        "waste (retries, failed requests, abandoned streams, failed tasks), and the spend "
        "as an elastic pool (busy GPU-seconds) and as a fixed fleet (every GPU, all the "
        "time) sees it.",
        epilog="Example: meshd cost --log access.jsonl --by tenant --plot cost.png",
    )
    add_cost_arguments(p)
    p.set_defaults(func=cost)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshd cost")
    add_cost_arguments(parser)
    return cost(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
