"""loadtest.procstats.pin (overhead.py --placement): every thread of a process and of its
children is restricted to the CPUs given, and what they start later inherits it; and
which CPUs each placement gives to the proxy, the backends and the load generator."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest import procstats
from loadtest.overhead import (
    PLACEMENTS,
    Run,
    Split,
    comparison_rows,
    parse_args,
    placement_split,
    split_cpus,
)

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


def test_pin_flag_is_proxy_alone_and_needs_two_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    placements = parse_args(["--quick"])[1]
    assert placements == ["shared"]
    assert parse_args(["--pin"])[1] == ["proxy-alone"]
    assert parse_args(["--placement", "sidecar,shared"])[1] == ["sidecar", "shared"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert parse_args(["--placement", "shared"])[1] == ["shared"]  # needs no second CPU
    for argv in (["--pin"], ["--placement", "sidecar"], ["--placement", "shared,proxy-alone"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["--placement", "everywhere"],
        ["--placement", "sidecar,sidecar"],
        ["--pin", "--placement", "sidecar"],
    ],
)
def test_bad_placements_are_refused(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "--p" in capsys.readouterr().err  # the message names the flag


def test_shared_placement_pins_nothing() -> None:
    split = placement_split("shared", {0, 1})
    assert split.proxy is None and split.backends is None and split.load is None


def test_sidecar_placement_keeps_the_app_with_its_proxy_and_the_engines_apart() -> None:
    for cpus in ({0, 1}, {2, 5, 7, 9}, set(range(3))):
        split = placement_split("sidecar", cpus)
        assert split.proxy == split.load  # app and sidecar share the pod's CPUs
        assert split.backends is not None and split.proxy is not None
        assert not split.backends & split.proxy  # the engine runs elsewhere
        assert split.backends | split.proxy == cpus
    assert placement_split("sidecar", {0, 1}) == Split(
        "sidecar", frozenset({1}), frozenset({0}), frozenset({1})
    )


def test_proxy_alone_placement_gives_the_proxy_one_cpu() -> None:
    split = placement_split("proxy-alone", {4, 6, 8})
    assert split.proxy == {4}
    assert split.backends == split.load == {6, 8}


def test_every_placement_but_shared_needs_two_cpus() -> None:
    for placement in PLACEMENTS:
        if placement == "shared":
            assert placement_split(placement, {0}).proxy is None
        else:
            with pytest.raises(ValueError, match="2 CPUs"):
                placement_split(placement, {0})
    with pytest.raises(ValueError, match="unknown placement"):
        placement_split("nowhere", {0, 1})


def test_comparison_rows_read_each_placements_table() -> None:
    from loadtest.overhead import Row, Settings

    settings = parse_args(["--quick"])[0]
    assert isinstance(settings, Settings)

    def run(placement: str, meshd: float, envoy: float) -> Run:
        rows = [
            Row("added TTFB p50 @ 100/s (ms)", {"meshd": meshd, "envoy": envoy}, meshd / envoy),
            Row("proxy CPU s / 1000 req (all)", {"meshd": 0.5, "envoy": 0.25}, 2.0),
        ]
        return Run(placement_split(placement, {0, 1}), {}, rows, [], 1.0, {}, {})

    got = comparison_rows([run("shared", 1.2, 0.6), run("sidecar", 0.4, 0.5)], settings)
    assert got == [
        ("shared", "1.200", "0.600", "2.00", "2.00"),
        ("sidecar", "0.400", "0.500", "0.80", "2.00"),
    ]
