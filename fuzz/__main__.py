"""`python -m fuzz <target|all> [--seconds N | --runs N]`: fuzz each target in its own
process (atheris.Fuzz() ends the process), starting from fuzz/corpus/<target>/, and print
per target its executions, exec/s, coverage (libFuzzer's cov and ft counts) and crashes.

New inputs go to a scratch corpus (--work, default a temporary directory), never to the
seed corpus; a crash's input is saved as <artifacts>/crash-<sha1> (--artifacts, default
fuzz/artifacts/) and is the file to minimise (`--minimize FILE`) and add to the corpus.
Exit status 1 when any target crashed.

--native also puts libFuzzer's coverage inside the Cython twins: fuzz/native.py builds copies
of them with SanitizerCoverage (the `ziglang` wheel's clang, Cython; the `fuzz` extra) into
--native-dir (default .fuzz-build/, reused while the sources and tools are unchanged), and each
target imports those instead of the repository's .so files.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fuzz.common import MAX_LEN
from fuzz.targets import TARGETS

ROOT = Path(__file__).resolve().parent
CORPUS = ROOT / "corpus"


@dataclass
class Result:
    target: str
    executions: int = 0
    exec_per_s: int = 0
    cov: int = 0
    ft: int = 0
    corpus: int = 0
    crashes: int = 0
    seconds: float = 0.0
    rc: int = 0
    artifacts: tuple[str, ...] = ()
    tail: str = ""
    native: tuple[tuple[str, str], ...] = ()  # (module, file) instrumented twins imported
    native_counters: int = 0  # their SanitizerCoverage counters, as libFuzzer loaded them


_STATUS = re.compile(r"^#(\d+)\s+\S+\s+cov: (\d+) ft: (\d+) corp: (\d+)/", re.M)
_NATIVE = re.compile(r"^INFO: native: (\S+) (\S+)$", re.M)
_LOADED = re.compile(r"^INFO: Loaded \d+ modules\s+\((\d+) inline 8-bit counters\)", re.M)


def parse(target: str, output: str, rc: int, seconds: float) -> Result:
    r = Result(target, rc=rc, seconds=seconds)
    statuses = _STATUS.findall(output)
    if statuses:
        last = statuses[-1]
        r.executions, r.cov, r.ft, r.corpus = (int(x) for x in last)
    m = re.search(r"stat::number_of_executed_units:\s*(\d+)", output)
    if m:
        r.executions = int(m.group(1))
    m = re.search(r"stat::average_exec_per_sec:\s*(\d+)", output)
    if m:
        r.exec_per_s = int(m.group(1))
    elif seconds:
        r.exec_per_s = int(r.executions / seconds)
    r.artifacts = tuple(re.findall(r"Test unit written to (\S+)", output))
    r.crashes = len(r.artifacts) or (1 if rc else 0)
    r.native = tuple(_NATIVE.findall(output))
    m = _LOADED.search(output)
    if m:
        r.native_counters = int(m.group(1))
    r.tail = output[-6000:]
    return r


def fuzz_one(
    target: str,
    seconds: float | None,
    runs: int | None,
    work: Path,
    artifacts: Path,
    strict: bool = False,
    seed: int | None = None,
    native: Path | None = None,
) -> Result:
    scratch = work / target
    scratch.mkdir(parents=True, exist_ok=True)
    artifacts.mkdir(parents=True, exist_ok=True)
    args = [
        sys.executable,
        "-m",
        "fuzz.run_one",
        target,
        f"-max_len={MAX_LEN}",
        "-timeout=20",
        "-rss_limit_mb=2048",
        "-print_final_stats=1",
        f"-artifact_prefix={artifacts}/{target}-",
    ]
    if seconds is not None:
        args.append(f"-max_total_time={max(1, round(seconds))}")
    if runs is not None:
        args.append(f"-runs={runs}")
    if strict:
        args.append("--strict")
    if seed is not None:
        args.append(f"-seed={seed}")
    if native is not None:
        args.append(f"--native={native}")
    args += [str(scratch), str(CORPUS / target)]
    start = time.monotonic()
    env = dict(os.environ)
    env.pop("MESHD_PURE_PYTHON", None)  # the targets import both twins themselves
    proc = subprocess.run(
        args, capture_output=True, text=True, errors="replace", env=env, cwd=ROOT.parent
    )
    took = time.monotonic() - start
    return parse(target, proc.stdout + proc.stderr, proc.returncode, took)


def table(results: list[Result]) -> str:
    lines = [
        f"{'target':<16} {'executions':>10} {'exec/s':>7} {'cov':>6} {'ft':>6} "
        f"{'corpus':>6} {'crashes':>7}"
    ]
    for r in results:
        lines.append(
            f"{r.target:<16} {r.executions:>10} {r.exec_per_s:>7} {r.cov:>6} {r.ft:>6} "
            f"{r.corpus:>6} {r.crashes:>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "target", nargs="?", default="all", help=f"all, or one of: {', '.join(TARGETS)}"
    )
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--seconds", type=float, help="fuzzing time per target (default 10)")
    how.add_argument("--runs", type=int, help="inputs per target instead of a time")
    ap.add_argument("--work", type=Path, help="scratch corpus directory (default: temporary)")
    ap.add_argument("--artifacts", type=Path, default=ROOT / "artifacts")
    ap.add_argument("--minimize", type=Path, metavar="FILE", help="minimise a crash input")
    ap.add_argument(
        "--strict", action="store_true", help="stop at known findings too (targets' KNOWN)"
    )
    ap.add_argument("--seed", type=int, help="libFuzzer's random seed (default: from the time)")
    ap.add_argument(
        "--native",
        action="store_true",
        help="fuzz coverage-instrumented builds of the Cython twins (needs ziglang, Cython)",
    )
    ap.add_argument(
        "--native-dir",
        type=Path,
        default=None,
        help="where --native builds them (default: .fuzz-build/)",
    )
    args = ap.parse_args(argv)
    names = list(TARGETS) if args.target == "all" else [args.target]
    for name in names:
        if name not in TARGETS:
            ap.error(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    native = None
    if args.native:
        from fuzz import native as instrumented

        reason = instrumented.missing()
        if reason:
            ap.error(f"--native: {reason}")
        native = args.native_dir or instrumented.CACHE
        instrumented.build(native)
    if args.minimize is not None:
        return subprocess.call(
            [
                sys.executable,
                "-m",
                "fuzz.run_one",
                names[0],
                "--strict",
                "-minimize_crash=1",
                "-runs=20000",
                f"-exact_artifact_path={args.minimize}.min",
                *([f"--native={native}"] if native else []),
                str(args.minimize),
            ]
        )
    seconds = args.seconds if args.seconds is not None or args.runs is not None else 10.0
    results = []
    with tempfile.TemporaryDirectory(prefix="meshd-fuzz-") as tmp:
        work = args.work or Path(tmp)
        for name in names:
            r = fuzz_one(
                name, seconds, args.runs, work, args.artifacts, args.strict, args.seed, native
            )
            results.append(r)
            instrumented_twins = (
                f", native {'+'.join(m for m, _ in r.native)} ({r.native_counters} counters)"
                if r.native
                else ""
            )
            print(
                f"{name}: {r.executions} executions, {r.exec_per_s} exec/s, cov {r.cov}, "
                f"ft {r.ft}, corpus {r.corpus}, crashes {r.crashes} ({r.seconds:.1f} s)"
                f"{instrumented_twins}",
                flush=True,
            )
            if r.crashes:
                print(r.tail, file=sys.stderr)
    print()
    print(table(results))
    return 1 if any(r.crashes for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
