"""The sidecar's heap after start (meshd/heap.py): a started `meshd sidecar` has frozen what
start-up built, and the collector's pauses are on its /metrics. Freezing is done in child
processes only: a gc.freeze() in the test process would hold every test's objects after."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import signal
import subprocess
import sys

import aiohttp
from harness import sidecar_config
from prometheus_client import CollectorRegistry, generate_latest

from meshd.heap import PAUSE_BUCKETS, GcCollector, GcPauses
from meshd.sidecar import Sidecar


def _sample(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert m is not None, f"{name}{labels} not in:\n{text}"
    return float(m.group(1))


def test_settle_collects_start_up_garbage_then_freezes_the_rest() -> None:
    script = """
import gc, json
from meshd.heap import settle
class Node:
    pass
for _ in range(1000):  # cycles start-up left as garbage: collected, not frozen
    a, b = Node(), Node()
    a.other, b.other = b, a
kept = [[i] for i in range(20000)]
frozen = settle()
print(json.dumps({"frozen": frozen, "left": len(gc.get_objects()),
                  "nodes": sum(type(o).__name__ == "Node" for o in gc.get_objects(2))}))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    got = json.loads(out.stdout)
    assert got["frozen"] > 20000
    # Nothing left for a collection to walk but what the print's own calls made.
    assert got["left"] < 100
    assert got["nodes"] == 0


def test_pauses_are_timed_by_generation_and_exported() -> None:
    pauses = GcPauses()
    pauses.install()
    try:
        pauses.install()  # once, however often
        assert gc.callbacks.count(pauses._on_gc) == 1
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        pauses.uninstall()
    assert pauses._on_gc not in gc.callbacks
    assert pauses.count(0) >= 1
    assert pauses.count(2) >= 2
    assert pauses.seconds[2] > 0
    registry = CollectorRegistry()
    registry.register(GcCollector(pauses))
    text = generate_latest(registry).decode()
    count = _sample(text, "meshd_gc_pause_seconds_count", '{generation="2"}')
    assert count == pauses.count(2)
    inf = _sample(text, "meshd_gc_pause_seconds_bucket", '{generation="2",le="+Inf"}')
    assert inf == count
    first = _sample(
        text, "meshd_gc_pause_seconds_bucket", f'{{generation="2",le="{PAUSE_BUCKETS[0]!r}"}}'
    )
    assert first <= count
    assert _sample(text, "meshd_gc_frozen_objects") == gc.get_freeze_count()


def test_a_pause_lands_in_the_first_bucket_at_or_over_it() -> None:
    ticks = iter([0.0, 0.0001, 1.0, 1.0003, 5.0, 7.0])
    pauses = GcPauses(clock=lambda: next(ticks))
    info = {"generation": 1, "collected": 0, "uncollectable": 0}
    for _ in range(3):
        pauses._on_gc("start", info)
        pauses._on_gc("stop", info)
    first, over = PAUSE_BUCKETS.index(0.0001), PAUSE_BUCKETS.index(0.0005)
    assert pauses.buckets[1][first] == 1  # le="0.0001" holds a pause of exactly that
    assert pauses.buckets[1][over] == 1  # 0.3 ms: le="0.0005"
    assert pauses.buckets[1][-1] == 1  # 2 s: over the last bound, +Inf only
    assert pauses.count(1) == 3 and pauses.count(0) == pauses.count(2) == 0
    assert abs(pauses.seconds[1] - 2.0004) < 1e-9


def test_a_sidecar_exports_its_collector_pauses() -> None:
    s = Sidecar(sidecar_config(["http://127.0.0.1:9"]))
    gc.collect(1)
    text = generate_latest(s.metrics.registry).decode()
    assert _sample(text, "meshd_gc_pause_seconds_count", '{generation="1"}') >= 1
    assert "meshd_gc_frozen_objects" in text


async def test_a_started_sidecar_has_frozen_what_start_up_built() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "meshd.cli",
        "sidecar",
        "--upstream",
        "http://127.0.0.1:9",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        assert ready["event"] == "ready"
        async with aiohttp.ClientSession() as http:
            resp = await http.get(f"http://{ready['admin']}/metrics")
            text = await resp.text()
        # The config, the routers, aiohttp and the rest of start-up: tens of thousands.
        assert _sample(text, "meshd_gc_frozen_objects") > 10_000
        # settle's own full collection, timed.
        assert _sample(text, "meshd_gc_pause_seconds_count", '{generation="2"}') >= 1
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _froze_then_stops(proc: asyncio.subprocess.Process) -> None:
    """A started process logged (before its ready line) that it froze more than 10,000
    objects built at start, and exits 0 on SIGTERM."""
    assert proc.stderr is not None
    froze = None
    while froze is None:
        log = (await asyncio.wait_for(proc.stderr.readline(), 5)).decode()
        assert log, "no 'froze' line before stderr ended"
        froze = re.search(r"froze (\d+) objects built at start", log)
    assert int(froze.group(1)) > 10_000
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 20) == 0


async def test_a_started_control_plane_has_frozen_what_start_up_built() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys, argparse; from xds.cli import register; "
        "p = argparse.ArgumentParser(); register(p.add_subparsers()); "
        "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))",
        "control-plane",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line.startswith("meshd control plane on ")
        await _froze_then_stops(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_started_picker_has_frozen_what_start_up_built() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "meshd.extproc",
        "picker",
        "--listen",
        "127.0.0.1:0",
        "--endpoint",
        "127.0.0.1:9",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        assert ready["event"] == "ready"
        await _froze_then_stops(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
