"""The process's heap and CPython's cyclic garbage collector: what a long-running meshd
process freezes once it has started (`settle`), and the collector's pauses as Prometheus
metrics (`GcCollector`), so an operator sees the event-loop stalls they cause.

A collection stops the whole process (the event loop included) while it walks the
objects of the generations it collects; a full (generation-2) one walks every tracked
object that is alive. Most of a sidecar's are built at start (config, routers, the
library modules) and live as long as the process, so each full collection re-walks them
for nothing. `gc.freeze()` moves them to the permanent generation, which no collection
walks (the practice of "Dismissing Python Garbage Collection at Instagram", 2017; CPython's
gc docs recommend it after start). Measured by loadtest/gc_pause_bench.py (1,000 engines
at 10,000 updates/s and 20 requests/s, 30 s windows, 2-core VM at load ~3, three runs):
full collections 86.3-273.6 ms before, 2.2-7.2 ms frozen (~80,000 objects); the event
loop's longest lag 87.2-311.1 -> 27.8-45.0 ms (the rest is the VM's scheduling).

The generation-0 threshold stays CPython's 700: at 10,000 the young collections fall from
~9 a second to a few a minute, but under 200 requests/s each then walks the requests in
flight, 10-21 ms (0.8-2.1 ms at 700), a longer stall than the full collections left.
The control feed's per-update objects are not what fills generation 2: its compiled
decoders build no object the collector tracks (50,000 updates applied in process trigger
no collection); what the process adds after start is per-endpoint state (~10,000
objects at 1,000 endpoints) and requests in flight.
"""

from __future__ import annotations

import gc
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

__all__ = ["PAUSE_BUCKETS", "GcCollector", "GcPauses", "gc_pauses", "settle"]

# A young collection takes tens of microseconds to a few ms; a full one of a large heap
# tens of ms, and anything over 10 ms shows in a relayed stream's inter-token latency.
PAUSE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
GENERATIONS = 3


def settle() -> int:
    """Once the process has started (config loaded, routers built, listeners bound, before
    serving): collect what start-up left as garbage, then freeze every object that is
    left, so no later collection walks them. Returns the objects frozen. Frozen objects
    are still freed when their last reference goes; only a cycle among them would stay
    (start-up's own, once)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Every collection's pause, by generation, as histogram buckets: timed by a
    `gc.callbacks` entry (the collector calls it before and after each collection, on
    the thread that triggered it; the collection between holds the GIL, and no other
    collection starts until this one's callbacks have returned)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._started = 0.0
        # Per generation: the count in each bucket of PAUSE_BUCKETS (and one over the
        # last), the seconds summed.
        self.buckets = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in range(GENERATIONS)]
        self.seconds = [0.0] * GENERATIONS
        self.installed = False

    def install(self) -> None:
        """Time the process's collections from now on (once however often called)."""
        if not self.installed:
            gc.callbacks.append(self._on_gc)
            self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            gc.callbacks.remove(self._on_gc)
            self.installed = False

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = self._clock()
            return
        pause = self._clock() - self._started
        g = info["generation"]
        self.buckets[g][bisect_left(PAUSE_BUCKETS, pause)] += 1
        self.seconds[g] += pause

    def count(self, generation: int) -> int:
        return sum(self.buckets[generation])


_PAUSES = GcPauses()


def gc_pauses() -> GcPauses:
    """The process's one recorder (gc.callbacks is the process's), installed."""
    _PAUSES.install()
    return _PAUSES


class GcCollector(Collector):
    """meshd_gc_pause_seconds{generation} (histogram): the collector's pauses, each a stall
    of the event loop; meshd_gc_frozen_objects (gauge): objects `settle` froze (0: none).
    The figures are the process's (every registry that holds one reads the same)."""

    def __init__(self, pauses: GcPauses) -> None:
        self.pauses = pauses

    def collect(self) -> Iterator[HistogramMetricFamily | GaugeMetricFamily]:
        pauses = HistogramMetricFamily(
            "meshd_gc_pause_seconds",
            "Pauses of Python's cyclic garbage collector (the whole process, its event loop "
            "included, stops), by generation collected (2: full)",
            labels=["generation"],
        )
        for g in range(GENERATIONS):
            total = 0
            cumulative = []
            for bound, n in zip(
                (*(repr(b) for b in PAUSE_BUCKETS), "+Inf"), self.pauses.buckets[g], strict=True
            ):
                total += n
                cumulative.append((bound, float(total)))
            pauses.add_metric([str(g)], cumulative, self.pauses.seconds[g])
        yield pauses
        yield GaugeMetricFamily(
            "meshd_gc_frozen_objects",
            "Objects frozen after start (gc.freeze): never walked by a collection",
            value=gc.get_freeze_count(),
        )

    def describe(self) -> Iterator[HistogramMetricFamily | GaugeMetricFamily]:
        yield HistogramMetricFamily("meshd_gc_pause_seconds", "GC pauses", labels=["generation"])
        yield GaugeMetricFamily("meshd_gc_frozen_objects", "Objects frozen after start")
