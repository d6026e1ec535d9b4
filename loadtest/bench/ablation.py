"""Ablations: meshd on the robustness matrix's cells with one mechanism switched off at a
time, against meshd with everything on, in the same run (issue #27: "an ablation row per
mechanism ... keep only what wins across the matrix").

Each mechanism is switched off through the config or a PickerConfig field (the virtual
pass's `overrides`); a mechanism earns its place when switching it off makes meshd worse
across the cells: the report's verdict is the geometric mean, over cells and figures, of
ablated / full for the lower-is-better figures (TTFT p90 and p99, E2E p50, task makespan
p50, the share of work spent on tasks that then failed) and full / ablated for the hit
rate and task success. Above 1: off is worse, so it stays.

    python -m loadtest.bench.ablation [--jobs 2] [--out DIR] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.bench.client import ClientSettings
from loadtest.bench.matrix import MESHD, Cell, figures, setup

# What switching each mechanism off means (filters/picker.py's docstring names them).
ABLATIONS: dict[str, dict[str, Any]] = {
    "knee (lambda_knee_s)": {"picker_config": {"lambda_knee_s": None}},
    "bounded load (epsilon)": {"picker_config": {"epsilon": 1e9}},
    "cached headroom": {"picker_config": {"cached_headroom": 0.0}},
    "load floor": {"picker_config": {"load_floor": 0.0}},
    "cold-hash window": {"picker_config": {"cold_tolerance": 0.0}},
    "cold-prompt homes": {"picker_config": {"home_weight": 0.0}},
    "replication": {"picker_config": {"replicate_utilisation": 1e9}},
    "affinity holder": {"picker_config": {"affinity_min_fraction": 1.0}},
    "imbalance bound": {"picker_config": {"affinity_imbalance": 1e9}},
    "decode seconds in J": {"picker_config": {"decode_weight": 0.0}},
    "fixed-fleet J": {"picker_config": {"elastic": True}},
    "admission knee gate": {"reliability": {"admission": {"knee_wait_s": None}}},
    "predicted-late refusal": {"reliability": {"admission": {"refuse_predicted_late": False}}},
}
FULL = "all on"
# One cell per workload family (the matrix's centres; agentic on the mixed fleet nobody
# described, where learning matters most), and two where the rarer mechanisms act: 4
# engines (the imbalance bound) and 1.5x load (admission's knee gate).
CELLS = (
    Cell("mooncake"),
    Cell("sessions-nohdr"),
    Cell("agentic", gpus="mixed"),
    Cell("shared-prefix"),
    Cell("azure-conv"),
    Cell("agentic", engines=4),
    Cell("sessions-nohdr", load=1.5),
)
LOWER = ("ttft_p90", "ttft_p99", "e2e_p50", "makespan_p50", "wasted_share")
HIGHER = ("hit_rate", "task_success")


def run_one(cell: Cell, name: str) -> dict[str, Any]:
    from loadtest.bench.virtual import run_virtual_policy

    requests, fleet = setup(cell)
    settings = ClientSettings(
        timeout_s=600.0,
        max_concurrency=1_000_000,
        context_headers=cell.workload != "sessions-nohdr",
    )
    started = time.monotonic()
    result, run = run_virtual_policy(
        MESHD,
        fleet,
        requests,
        settings,
        log=lambda m: None,
        overrides=ABLATIONS.get(name),
    )
    assert run is not None
    return {
        "cell": asdict(cell),
        "label": cell.label,
        "ablation": name,
        "figures": asdict(figures(MESHD, requests, run.outcomes, result, fleet)),
        "wall_s": round(time.monotonic() - started, 1),
    }


def _run(args: tuple[Cell, str]) -> dict[str, Any]:
    return run_one(*args)


def verdicts(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per ablation: per cell the ratios ablated / full (hit rate: full / ablated, so above
    1 is always worse), and their geometric mean over every cell and figure."""
    full = {r["label"]: r["figures"] for r in rows if r["ablation"] == FULL}
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        name = r["ablation"]
        if name == FULL or r["label"] not in full:
            continue
        base, mine = full[r["label"]], r["figures"]
        ratios: dict[str, float] = {}
        for k in LOWER + HIGHER:
            a, b = mine.get(k), base.get(k)
            if a is None or b is None or a <= 0 or b <= 0:
                continue
            ratios[k] = a / b if k in LOWER else b / a
        entry = out.setdefault(name, {"cells": {}, "logs": []})
        entry["cells"][r["label"]] = ratios
        entry["logs"] += [math.log(v) for v in ratios.values()]
    for entry in out.values():
        logs = entry.pop("logs")
        entry["worse_when_off"] = math.exp(sum(logs) / len(logs)) if logs else 1.0
    return out


def report(rows: Sequence[dict[str, Any]]) -> str:
    v = verdicts(rows)
    labels = list(dict.fromkeys(r["label"] for r in rows))
    lines = [
        "# Ablations (virtual clock)",
        "",
        "meshd (URLs only) with one mechanism off, against meshd with all on, same cells,",
        "same run. Per cell: TTFT p90 / E2E p50 / hit rate as off vs on (hit rate: on /",
        "off), so above 1 means switching it off made that figure worse. `off is worse`:",
        "the geometric mean over the cells of those and TTFT p99 and makespan p50; above",
        "1.00 (bold) the mechanism earns its place.",
        "",
        "| mechanism off | " + " | ".join(labels) + " | off is worse |",
        "|" + "---|" * (len(labels) + 2),
    ]
    for name in ABLATIONS:
        if name not in v:
            continue
        cells = v[name]["cells"]
        row = [name]
        for label in labels:
            c = cells.get(label, {})
            row.append(
                " / ".join(
                    f"{c[k]:.2f}" if k in c else "-" for k in ("ttft_p90", "e2e_p50", "hit_rate")
                )
            )
        w = v[name]["worse_when_off"]
        row.append(f"**{w:.2f}**" if round(w, 2) > 1.0 else f"{w:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.ablation", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", type=Path, default=None, help="default results/ablation-<time>")
    parser.add_argument("--only", default="", help="comma-separated mechanisms (names above)")
    args = parser.parse_args(argv)
    names = [n for n in ABLATIONS if not args.only or n in args.only.split(",")]
    work = [(c, n) for c in CELLS for n in (FULL, *names)]
    out_dir = args.out or Path("results") / time.strftime("ablation-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for res in pool.map(_run, work):
            rows.append(res)
            print(
                f"[{len(rows)}/{len(work)}] {res['label']}, {res['ablation']}: {res['wall_s']} s",
                file=sys.stderr,
                flush=True,
            )
    (out_dir / "ablation.json").write_text(json.dumps(rows, indent=1, default=str))
    text = report(rows)
    (out_dir / "ablation.md").write_text(text)
    print(text)
    print(f"written to {out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
