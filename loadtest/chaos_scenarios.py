"""The fault campaign's scenarios (loadtest/chaos.py): its settings, a scenario in progress
(`Run`), and each fault as an action on the processes of loadtest/chaos_rig.py, injected at
the fault's time and cleared at the clear's."""

from __future__ import annotations

import asyncio
import collections
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from loadtest.bench.scrape import parse_metrics
from loadtest.chaos_client import LoadSpec, limit_probes, send_raw, slowloris
from loadtest.chaos_rig import Rig, RigSettings, partition

EJECTIONS = "meshd_outlier_ejections"
BREAKER_TRANSITIONS = "meshd_breaker_transitions"


@dataclass(frozen=True, slots=True)
class ChaosSettings:
    """One campaign: every scenario's load and timeline (wall seconds from the load's start)."""

    engines: int = 3
    time_scale: float = 1.0
    max_num_seqs: int = 8
    rate_rps: float = 4.0
    duration_s: float = 15.0
    fault_at_s: float = 4.0
    clear_at_s: float = 10.0
    max_tokens: int = 200
    deadline_s: float = 25.0
    reset_after_tokens: int = 40
    slow_factor: float = 10.0
    latency_ms: float = 200.0
    slowloris_clients: int = 20
    abandon_share: float = 0.3
    # overload: its own fleet, slower and with small batches, so 10x its capacity stays
    # within what two shared cores can send
    overload_time_scale: float = 0.125
    overload_max_num_seqs: int = 8
    overload_max_tokens: int = 60
    overload_factor: float = 10.0
    overload_deadline_s: float = 12.0
    calibrate_s: float = 10.0
    seed: int = 0
    sidecar: dict[str, Any] = field(default_factory=dict)  # merged into every sidecar's config

    def load(self, **changes: Any) -> LoadSpec:
        spec = LoadSpec(
            rate_rps=self.rate_rps,
            duration_s=self.duration_s,
            max_tokens=self.max_tokens,
            deadline_s=self.deadline_s,
            seed=self.seed,
        )
        return replace(spec, **changes)

    def rig(self, **changes: Any) -> RigSettings:
        from meshd.config import deep_merge

        base = RigSettings(
            engines=self.engines, time_scale=self.time_scale, max_num_seqs=self.max_num_seqs
        )
        sidecar = deep_merge(changes.pop("sidecar", {}), self.sidecar)
        return replace(base, sidecar=sidecar, **changes)


QUICK = ChaosSettings(
    rate_rps=4.0,
    duration_s=5.0,
    fault_at_s=1.0,
    clear_at_s=3.5,
    max_tokens=60,
    time_scale=2.0,
    deadline_s=15.0,
    reset_after_tokens=20,
    slowloris_clients=5,
    calibrate_s=4.0,
)


class Run:
    """One scenario in progress: its processes, a client session, its notes, and the
    sidecar's counters across restarts (a restarted sidecar counts from zero)."""

    def __init__(self, rig: Rig, session: aiohttp.ClientSession, t0: float) -> None:
        self.rig = rig
        self.session = session
        self.t0 = t0
        self.notes: list[str] = []
        self.carried: dict[str, float] = {"attempts": 0.0, "resumed": 0.0}
        self.base: dict[str, float] = {"attempts": 0.0, "resumed": 0.0}
        self.clear_at: float | None = None
        self.target = rig.engines[0]

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def choose_target(self) -> None:
        """The engine a one-engine fault hits: the one that has served the most so far (at
        low load the picker may keep a whole stream of requests on one engine)."""
        served = [await e.served(self.session) for e in self.rig.engines]
        self.target = self.rig.engines[served.index(max(served))]

    async def until(self, at_s: float) -> None:
        await asyncio.sleep(max(0.0, self.t0 + at_s - time.monotonic()))

    async def sidecar_going(self) -> None:
        """Call before the sidecar stops: what it counted so far is kept."""
        now = await self.rig.sidecar.counters(self.session)
        for k in self.carried:
            self.carried[k] += now.get(k, self.base[k]) - self.base[k]
            self.base[k] = 0.0

    async def counted(self) -> dict[str, float]:
        now = await self.rig.sidecar.counters(self.session)
        return {k: self.carried[k] + now.get(k, self.base[k]) - self.base[k] for k in self.carried}


Action = Callable[[Run], Coroutine[Any, Any, None]]


async def _nothing(run: Run) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    what: str
    inject: Action = _nothing
    clear: Action | None = None  # None: the fault does not clear (recover_s is null)
    rig: Callable[[ChaosSettings], RigSettings] | None = None
    load: Callable[[ChaosSettings], LoadSpec] | None = None
    side: Action | None = None  # a client of its own, run at fault_at_s beside the load
    amplification_bound: bool = False
    may_break: bool = False  # broken streams expected (the sidecar itself is killed)
    # the sidecar's counters end with its process (requests that end after the last scrape
    # are not counted): no amplification
    restarts_sidecar: bool = False
    engine_fault: bool = False  # one engine faulted and cleared: when does it serve again
    netns: bool = False  # runs in a network namespace of its own (iptables)


# ---- the faults ---------------------------------------------------------------------


def _engine_fault(doc: dict[str, Any], engines: str = "one") -> Action:
    async def act(run: Run) -> None:
        targets = run.rig.engines if engines == "all" else [run.target]
        for e in targets:
            await e.fault(run.session, doc)

    return act


async def _kill_engine(run: Run) -> None:
    await run.target.kill()


async def _start_engine(run: Run) -> None:
    await run.target.start()


async def _stop_engine(run: Run) -> None:
    run.target.signal(signal.SIGSTOP)


async def _continue_engine(run: Run) -> None:
    run.target.signal(signal.SIGCONT)


async def _kill_plane(run: Run) -> None:
    await run.rig.planes[0].kill()


async def _start_plane(run: Run) -> None:
    await run.rig.planes[0].start()


async def _kill_agent(run: Run) -> None:
    await run.rig.agents[run.rig.engines.index(run.target)].kill()


async def _start_agent(run: Run) -> None:
    await run.rig.agents[run.rig.engines.index(run.target)].start()


async def _drain_sidecar(run: Run) -> None:
    await run.sidecar_going()
    sent = run.now()
    run.rig.sidecar.signal(signal.SIGTERM)
    code = await run.rig.sidecar.wait(30.0)
    run.notes.append(f"drained and exited {code} in {run.now() - sent:.1f} s")
    await run.rig.sidecar.stop()
    await run.rig.sidecar.start()
    run.clear_at = run.now()
    run.notes.append(f"a new sidecar ready {run.clear_at - sent:.1f} s after SIGTERM")


async def _kill_sidecar(run: Run) -> None:
    await run.sidecar_going()
    sent = run.now()
    await run.rig.sidecar.kill()
    await run.rig.sidecar.stop()
    await run.rig.sidecar.start()
    run.clear_at = run.now()
    run.notes.append(f"restarted, ready {run.clear_at - sent:.1f} s after SIGKILL")


async def _partition(run: Run) -> None:
    partition(run.target.port, True)


async def _heal(run: Run) -> None:
    partition(run.target.port, False)


async def _ejections(run: Run) -> tuple[float, float]:
    """Outlier ejections and breakers opened by the sidecar so far."""
    try:
        url = run.rig.sidecar.admin_url + "/metrics"
        async with run.session.get(url, timeout=aiohttp.ClientTimeout(3)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return 0.0, 0.0
    ejected = parse_metrics(text, (EJECTIONS,)).get(EJECTIONS, 0.0)
    opened = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(BREAKER_TRANSITIONS + "_total{") and 'to="open"' in line
    )
    return ejected, opened


def _latency(ms: float) -> tuple[Action, Action]:
    """Delay everything the busiest engine sends by `ms` (its delay proxy), and clear it;
    the clear notes how many requests the engine took before and during the fault, and
    whether the sidecar ejected an engine or opened a breaker (slow is not failed)."""
    taken = {"before": 0.0}

    async def inject(run: Run) -> None:
        run.rig.proxy(run.target).delay(down_ms=ms)
        taken["before"] = await run.target.served(run.session)

    async def clear(run: Run) -> None:
        run.rig.proxy(run.target).delay(down_ms=0)
        during = await run.target.served(run.session) - taken["before"]
        ejected, opened = await _ejections(run)
        run.notes.append(
            f"the delayed engine took {taken['before']:g} requests before the fault, "
            f"{during:g} during it; by the clear the sidecar had ejected {ejected:g} "
            f"endpoints and opened {opened:g} breakers"
        )

    return inject, clear


def _slowloris(settings: ChaosSettings) -> Action:
    async def act(run: Run) -> None:
        results = await asyncio.gather(
            *(slowloris(run.rig.sidecar.url, 1.0, 30.0) for _ in range(settings.slowloris_clients))
        )
        statuses = collections.Counter(str(s) for s, _ in results)
        took = [t for _, t in results]
        run.notes.append(
            f"{len(results)} slowloris clients (1 byte/s): answered "
            + ", ".join(f"{k} x{v}" for k, v in sorted(statuses.items()))
            + f" after {min(took):.1f}-{max(took):.1f} s"
        )
        if set(statuses) != {"408"}:
            run.notes.append("CHECK: a slowloris client was not answered 408")

    return act


async def _limits(run: Run) -> None:
    probes = limit_probes(65536, 100, 16384)
    results = await asyncio.gather(*(send_raw(run.rig.sidecar.url, p["raw"]) for p in probes))
    wrong = []
    for p, status in zip(probes, results, strict=True):
        ok = status is not None and (
            status == p["want"] if isinstance(p["want"], int) else status not in (413, 431)
        )
        if not ok:
            wrong.append(f"{p['name']}: {status} (want {p['want']})")
    run.notes.append(
        f"{len(probes) - len(wrong)}/{len(probes)} limit probes as expected (body 64 KiB, "
        "100 headers, 16 KiB of headers: at each limit accepted, one past it 413/431)"
        + ("; " + "; ".join(wrong) if wrong else "")
    )
    if wrong:
        run.notes.append("CHECK: a limit probe got the wrong answer")


def _overload_rig(s: ChaosSettings, admission: bool) -> RigSettings:
    slots = s.engines * s.overload_max_num_seqs
    adm: dict[str, Any] = {"enabled": admission}
    if admission:
        adm["max_in_flight"] = slots
    # A stream's first token waits in the engine's queue, after its headers: the campaign's
    # 2 s idle timeout would read that wait as a silent engine.
    return s.rig(
        time_scale=s.overload_time_scale,
        max_num_seqs=s.overload_max_num_seqs,
        sidecar={"reliability": {"admission": adm}, "upstream": {"idle_timeout_s": 10}},
    )


def _overload_load(s: ChaosSettings) -> LoadSpec:
    return s.load(max_tokens=s.overload_max_tokens, deadline_s=s.overload_deadline_s)


def scenarios(s: ChaosSettings) -> list[Scenario]:
    crash = {"kind": "crash_after_tokens", "tokens": s.reset_after_tokens, "count": -1}
    storm = {"kind": "status_burst", "status": 503, "count": 100000}
    clear = _engine_fault({"kind": "clear"})
    add_latency, clear_latency = _latency(s.latency_ms)
    cp1 = lambda c: c.rig(control_planes=1, agents=True)  # noqa: E731
    return [
        Scenario("baseline", "no fault"),
        Scenario(
            "engine-kill",
            "the busiest engine SIGKILLed mid-stream, restarted at the clear",
            _kill_engine,
            _start_engine,
            engine_fault=True,
        ),
        Scenario(
            "engine-hang",
            "the busiest engine's GPU stops (HTTP accepts, no token comes)",
            _engine_fault({"kind": "hang"}),
            clear,
            engine_fault=True,
        ),
        Scenario(
            "engine-stop",
            "the busiest engine SIGSTOPped (accepts, never answers), SIGCONT at the clear",
            _stop_engine,
            _continue_engine,
            engine_fault=True,
        ),
        Scenario(
            "engine-slow",
            f"the busiest engine {s.slow_factor:g}x slower (a degraded GPU)",
            _engine_fault({"kind": "slowdown", "factor": s.slow_factor}),
            _engine_fault({"kind": "slowdown", "factor": 1}),
            amplification_bound=True,
            engine_fault=True,
        ),
        Scenario(
            "engine-503",
            "the busiest engine answers 503 to everything",
            _engine_fault(storm),
            clear,
            amplification_bound=True,
            engine_fault=True,
        ),
        Scenario(
            "all-503",
            "every engine answers 503 to everything",
            _engine_fault(storm, "all"),
            _engine_fault({"kind": "clear"}, "all"),
            amplification_bound=True,
        ),
        Scenario(
            "engine-reset",
            f"the busiest engine resets every stream after {s.reset_after_tokens} tokens",
            _engine_fault(crash),
            clear,
            engine_fault=True,
        ),
        Scenario(
            "cp-restart",
            "the control plane SIGKILLed, restarted at the clear",
            _kill_plane,
            _start_plane,
            rig=cp1,
        ),
        Scenario(
            "cp-replica",
            "one of two control-plane replicas SIGKILLed",
            _kill_plane,
            _start_plane,
            rig=lambda c: c.rig(control_planes=2, agents=True),
        ),
        Scenario(
            "agent-kill",
            "the busiest engine's agent SIGKILLed, restarted at the clear",
            _kill_agent,
            _start_agent,
            rig=cp1,
        ),
        Scenario(
            "sidecar-drain",
            "the sidecar SIGTERMed under load (drain), then started again",
            _drain_sidecar,
            restarts_sidecar=True,
        ),
        Scenario(
            "sidecar-kill",
            "the sidecar SIGKILLed under load, restarted at once",
            _kill_sidecar,
            may_break=True,
            restarts_sidecar=True,
        ),
        Scenario(
            "partition",
            "the busiest engine partitioned (iptables DROP both ways, in a netns)",
            _partition,
            _heal,
            netns=True,
            engine_fault=True,
        ),
        Scenario(
            "latency",
            f"{s.latency_ms:g} ms added to everything the busiest engine sends (delay proxy)",
            add_latency,
            clear_latency,
            rig=lambda c: c.rig(delay_proxies=True),
            amplification_bound=True,  # a slow engine is no reason to try another
            engine_fault=True,
        ),
        Scenario(
            "slowloris",
            f"{s.slowloris_clients} clients sending their head at 1 byte/s",
            side=_slowloris(s),
        ),
        Scenario(
            "disconnects",
            f"{s.abandon_share:.0%} of clients leave mid-stream",
            load=lambda c: c.load(abandon_share=c.abandon_share),
        ),
        Scenario("limits", "bodies and heads at and one past every limit", side=_limits),
        Scenario(
            "overload",
            f"{s.overload_factor:g}x the fleet's capacity, admission on",
            rig=lambda c: _overload_rig(c, True),
            load=_overload_load,
        ),
        Scenario(
            "overload-no-admission",
            f"{s.overload_factor:g}x capacity, admission off",
            rig=lambda c: _overload_rig(c, False),
            load=_overload_load,
        ),
    ]
