"""Per-request routing decisions of the virtual-clock bench, recorded and checked.

What `meshd bench --virtual-clock --workload W --policies meshd` routes where, for the
mooncake and demo workloads at the command's defaults: request index -> the endpoint that
served it (and, where it did not succeed, the client's error). A change that should not
move routing (a refactor of meshd/sidecar.py) leaves the recorded file matching:

    python -m loadtest.bench.decisions --record tests/data/virtual_decisions.json
    python -m loadtest.bench.decisions --check tests/data/virtual_decisions.json

The passes are virtual.run_virtual_policy, the per-policy step of `meshd bench
--virtual-clock`, so the routers come from the same code path (sidecar_model). Each
request has one attempt: the pass moves on to another route only on a refused connection,
which needs an engine-loading fault, and these runs inject none; mid-stream resumes are
not modelled on the virtual clock. Both workloads run whole (Mooncake's 3,993 trace rows
in ~3 s, the demo's 336 requests in under 1 s) and, seeds fixed and no wall clock read,
the same way in every process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.bench.cli import add_bench_arguments, config_from_args
from loadtest.bench.runner import BenchConfig, build_workload
from loadtest.bench.virtual import run_virtual_policy
from loadtest.workloads import PlannedRequest, traces_dir
from loadtest.workloads.traces import MOONCAKE_SYNTHETIC

WORKLOADS: tuple[str, ...] = ("mooncake", "demo")
POLICY = "meshd"
RECORDED = Path("tests/data/virtual_decisions.json")
RERECORD = (
    "routing decisions changed on the virtual-clock bench. If that is intended (a routing "
    "change), re-record with `python -m loadtest.bench.decisions --record "
    f"{RECORDED}` and say so in the commit message."
)
# How many differing requests a check prints (the count of all of them comes first).
SHOW = 10
# The trace each trace workload reads; a missing one skips the workload.
TRACE_FILES: dict[str, str] = {"mooncake": MOONCAKE_SYNTHETIC}

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(f"[decisions] {message}", file=sys.stderr, flush=True)


def _quiet(_: str) -> None:
    return None


def _sha256(doc: Any) -> str:
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def missing_trace(workload: str) -> str | None:
    """Why `workload` cannot run here (its trace file is absent), or None."""
    name = TRACE_FILES.get(workload)
    if name is None or (traces_dir() / name).exists():
        return None
    return f"no {name} in {traces_dir()}"


def bench_config(workload: str) -> BenchConfig:
    """What `meshd bench --virtual-clock --workload W --policies meshd` runs (its defaults)."""
    argv = ["--virtual-clock", "--workload", workload, "--policies", POLICY]
    argv += ["--no-progress", "--no-plots"]
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return config_from_args(parser.parse_args(argv), argv)


def settings_of(config: BenchConfig, requests: Sequence[PlannedRequest]) -> dict[str, Any]:
    """What a pass ran: command, fleet, client, workload and a digest of its requests (so a
    check tells a changed workload or default from changed routing)."""
    client = asdict(config.client)
    for key in ("progress", "progress_desc"):
        client.pop(key, None)
    return {
        "command": config.command,
        "policy": POLICY,
        "fleet": config.fleet.to_json(),
        "client": client,
        "sample_period_s": config.sample_period_s,
        "workload": config.workload,
        "workload_args": dict(config.workload_args),
        "requests": len(requests),
        "requests_sha256": _sha256([asdict(r) for r in requests]),
    }


@dataclass(frozen=True, slots=True)
class Decisions:
    """One workload's pass: per request (in workload order) the endpoint URL that served
    it ("" when none did: refused by admission, or never sent) and its error (None: ok)."""

    workload: str
    settings: dict[str, Any]
    request_ids: tuple[str, ...]
    endpoints: tuple[str, ...]
    errors: tuple[str | None, ...]
    wall_s: float = field(default=0.0, compare=False)

    @property
    def digest(self) -> str:
        return _sha256([self.endpoints, self.errors])

    def to_json(self) -> dict[str, Any]:
        """The file's form: each endpoint as an index into `urls` (-1: none)."""
        urls = sorted({u for u in self.endpoints if u})
        index = {u: i for i, u in enumerate(urls)}
        return {
            "digest": self.digest,
            "settings": self.settings,
            "urls": urls,
            "endpoints": [index[u] if u else -1 for u in self.endpoints],
            "errors": {str(i): e for i, e in enumerate(self.errors) if e is not None},
        }

    @classmethod
    def from_json(cls, workload: str, doc: Mapping[str, Any]) -> Decisions:
        urls: list[str] = doc["urls"]
        n = len(doc["endpoints"])
        errors: dict[str, str] = doc["errors"]
        return cls(
            workload=workload,
            settings=doc["settings"],
            request_ids=(),
            endpoints=tuple(urls[i] if i >= 0 else "" for i in doc["endpoints"]),
            errors=tuple(errors.get(str(i)) for i in range(n)),
        )


def run_decisions(workload: str, log: Log = _stderr) -> Decisions:
    """The meshd pass of `workload` on the virtual clock, and where each request went."""
    config = bench_config(workload)
    requests = build_workload(config.workload, config.workload_args)
    t0 = time.perf_counter()
    _, run = run_virtual_policy(
        POLICY,
        config.fleet,
        requests,
        config.client,
        sample_period_s=config.sample_period_s,
        log=log,
    )
    wall = time.perf_counter() - t0
    if run is None:
        raise RuntimeError(f"policy {POLICY} did not run on the virtual clock")
    by_id = {o.request_id: o for o in run.outcomes}
    if len(by_id) != len(run.outcomes):
        raise RuntimeError("a request id has two outcomes: decisions need unique ids")
    endpoints: list[str] = []
    errors: list[str | None] = []
    for r in requests:
        o = by_id.get(r.request_id)
        endpoints.append("" if o is None else o.endpoint)
        errors.append("not_sent" if o is None else o.error)
    return Decisions(
        workload=workload,
        settings=settings_of(config, requests),
        request_ids=tuple(r.request_id for r in requests),
        endpoints=tuple(endpoints),
        errors=tuple(errors),
        wall_s=wall,
    )


def differences(recorded: Decisions, now: Decisions, show: int = SHOW) -> list[str]:
    """Lines saying how `now` differs from `recorded` (empty: the same decisions)."""
    out: list[str] = []
    w = now.workload
    for key in sorted(set(recorded.settings) | set(now.settings)):
        was, is_ = recorded.settings.get(key), now.settings.get(key)
        if was != is_:
            out.append(f"{w}: settings.{key} was {was!r}, now {is_!r}")
    if out:
        out.append(f"{w}: the run's settings or workload changed (not only routing)")
    n_was, n_now = len(recorded.endpoints), len(now.endpoints)
    if n_was != n_now:
        out.append(f"{w}: {n_was} requests recorded, {n_now} now")
    before = list(zip(recorded.endpoints, recorded.errors, strict=True))
    after = list(zip(now.endpoints, now.errors, strict=True))
    diff = [i for i in range(min(n_was, n_now)) if before[i] != after[i]]
    if diff:
        out.append(f"{w}: {len(diff)} of {n_now} requests routed differently; first:")
    for i in diff[:show]:
        rid = f" ({now.request_ids[i]})" if i < len(now.request_ids) else ""
        out.append(f"  request {i}{rid}: recorded {_what(*before[i])}, now {_what(*after[i])}")
    if not out and recorded.digest != now.digest:  # cannot happen: same pairs, same digest
        out.append(f"{w}: digest {recorded.digest} recorded, {now.digest} now")
    return out


def _what(endpoint: str, error: str | None) -> str:
    where = endpoint or "no endpoint"
    return where if error is None else f"{where} [{error}]"


def load(path: Path) -> dict[str, Decisions]:
    doc = json.loads(path.read_text())
    return {w: Decisions.from_json(w, d) for w, d in doc["workloads"].items()}


def file_doc(runs: Sequence[Decisions]) -> dict[str, Any]:
    return {
        "about": "per-request endpoints of `meshd bench --virtual-clock --policies meshd` "
        "(loadtest/bench/decisions.py); endpoints index urls, -1: none",
        "rerecord": f"python -m loadtest.bench.decisions --record {RECORDED}",
        "digest": overall_digest(runs),
        "workloads": {d.workload: d.to_json() for d in runs},
    }


def overall_digest(runs: Sequence[Decisions]) -> str:
    return _sha256({d.workload: d.digest for d in runs})


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench.decisions",
        description="Record or check the virtual-clock bench's per-request routing decisions.",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", type=Path, metavar="FILE", help="run and write FILE")
    mode.add_argument("--check", type=Path, metavar="FILE", help="run and compare with FILE")
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated (default: {','.join(WORKLOADS)})",
    )
    p.add_argument("--quiet", action="store_true", help="no per-pass log lines")
    args = p.parse_args(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    log = _quiet if args.quiet else _stderr
    recorded = load(args.check) if args.check is not None else {}
    runs: list[Decisions] = []
    failed = False
    for name in names:
        reason = missing_trace(name)
        if reason is not None:
            print(f"{name}: cannot run: {reason}", file=sys.stderr)
            return 2
        d = run_decisions(name, log)
        runs.append(d)
        print(f"{name}: {len(d.endpoints)} requests, digest {d.digest} ({d.wall_s:.1f} s)")
        if args.check is not None:
            if name not in recorded:
                print(f"{name}: not in {args.check}")
                failed = True
                continue
            lines = differences(recorded[name], d)
            for line in lines:
                print(line)
            failed = failed or bool(lines)
    print(f"digest {overall_digest(runs)}")
    if args.record is not None:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(file_doc(runs), indent=1) + "\n")
        print(f"recorded {args.record}")
        return 0
    if failed:
        print(RERECORD)
        return 1
    print(f"same decisions as {args.check}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
