"""CPU seconds and peak RSS of a process (and its descendants), and the whole machine's
busy and stolen CPU seconds, read from /proc.

The benchmark samples a proxy before and after each phase and charges the difference to
that phase. Linux only: utime+stime from /proc/PID/stat, VmHWM from /proc/PID/status.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ProcSample:
    """One reading of a process tree: CPU seconds used so far and peak/current RSS in bytes."""

    pids: tuple[int, ...]
    cpu_s: float
    peak_rss: int
    rss: int

    def cpu_since(self, earlier: ProcSample) -> float:
        """CPU seconds spent between `earlier` and this sample."""
        return self.cpu_s - earlier.cpu_s


def _stat_fields(pid: int) -> list[str]:
    text = (_PROC / str(pid) / "stat").read_text()
    # comm (field 2) may hold spaces and parentheses; everything after the last ')' is fixed.
    return text[text.rindex(")") + 2 :].split()


def cpu_seconds(pid: int, *, include_reaped_children: bool = True) -> float:
    """utime+stime of `pid` (all its threads), plus that of children it has waited for."""
    fields = _stat_fields(pid)
    # After comm: state is index 0, so utime/stime/cutime/cstime are fields 14..17 -> 11..14.
    ticks = int(fields[11]) + int(fields[12])
    if include_reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _CLOCK_TICKS


def memory(pid: int) -> tuple[int, int]:
    """(VmHWM, VmRSS) of `pid` in bytes: peak and current resident set size."""
    peak = rss = 0
    for line in (_PROC / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            peak = int(line.split()[1]) * 1024
        elif line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return peak, rss


def descendants(pid: int) -> list[int]:
    """`pid` and every live process below it (a pre-forked server's workers, say)."""
    parents: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(_stat_fields(int(entry.name))[1])
        except (OSError, ValueError, IndexError):
            continue  # gone while we looked
        parents.setdefault(ppid, []).append(int(entry.name))
    found = [pid]
    i = 0
    while i < len(found):
        found.extend(parents.get(found[i], ()))
        i += 1
    return found


def pin(pid: int, cpus: set[int]) -> int:
    """Restrict every thread of `pid` and of its live descendants to `cpus` (threads and
    processes started later inherit it from their parent); returns the threads pinned."""
    pinned = 0
    for p in descendants(pid):
        try:
            tids = [int(t.name) for t in (_PROC / str(p) / "task").iterdir()]
        except OSError:
            continue  # gone while we looked
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except (ProcessLookupError, PermissionError):
                continue
            pinned += 1
    return pinned


def sample(pid: int, *, tree: bool = False) -> ProcSample:
    """Read `pid` now; with `tree`, sum over it and its live descendants.

    Summed peak RSS of a tree is an upper bound: the members need not peak together.
    """
    pids = descendants(pid) if tree else [pid]
    cpu = 0.0
    peak = rss = 0
    seen: list[int] = []
    for p in pids:
        try:
            cpu += cpu_seconds(p)
            p_peak, p_rss = memory(p)
        except (OSError, ValueError):
            continue
        peak += p_peak
        rss += p_rss
        seen.append(p)
    if not seen:
        raise ProcessLookupError(f"process {pid} is gone")
    return ProcSample(pids=tuple(seen), cpu_s=cpu, peak_rss=peak, rss=rss)


def self_cpu_seconds() -> float:
    """CPU seconds of the calling process (all threads), for the load generator's own cost."""
    times = os.times()
    return times.user + times.system


def machine_cpu() -> tuple[float, float] | None:
    """(busy, steal) CPU seconds of the whole machine so far, from /proc/stat's `cpu` line:
    busy is user+nice+system+irq+softirq; steal is time the hypervisor ran something else.
    None where /proc/stat cannot be read or parsed."""
    try:
        fields = (_PROC / "stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq) / _CLOCK_TICKS, steal / _CLOCK_TICKS
