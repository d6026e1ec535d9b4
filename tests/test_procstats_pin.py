"""loadtest.procstats.pin (overhead.py --pin): every thread of a process and of its
children is restricted to the CPUs given, and what they start later inherits it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest import procstats
from loadtest.overhead import parse_args, split_cpus

# A parent with two extra threads and a child process; both wait for stdin to close.
_SCRIPT = """
import subprocess, sys, threading
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE)
stop = threading.Event()
threads = [threading.Thread(target=stop.wait) for _ in range(2)]
for t in threads:
    t.start()
print(child.pid, flush=True)
sys.stdin.readline()
# Started after the pin: inherits it.
late = subprocess.Popen([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                        stdout=subprocess.PIPE, text=True)
print(late.communicate()[0].strip(), flush=True)
stop.set()
child.stdin.close()
child.wait()
"""


def _affinity(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()]


def test_pin_reaches_every_thread_and_child_and_later_ones() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    target = {cpus[-1]}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        child = int(proc.stdout.readline())
        deadline = time.monotonic() + 10
        while len(list(Path(f"/proc/{proc.pid}/task").iterdir())) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pinned = procstats.pin(proc.pid, target)
        assert pinned >= 4  # the parent's 3 threads and the child's
        assert all(a == target for a in _affinity(proc.pid))
        assert all(a == target for a in _affinity(child))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == str(sorted(target))
    finally:
        proc.kill()
        proc.wait()


def test_pin_of_a_gone_process_pins_nothing() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert procstats.pin(proc.pid, {0}) == 0


def test_split_gives_the_proxy_one_cpu_and_the_rest_the_others() -> None:
    assert split_cpus({3, 1, 2}) == ({1}, {2, 3})
    assert split_cpus({0, 1}) == ({0}, {1})


def test_pin_flag_needs_two_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    settings, _ = parse_args(["--quick"])
    assert settings.pin is False
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(SystemExit):
        parse_args(["--pin"])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert parse_args(["--pin"])[0].pin is True
