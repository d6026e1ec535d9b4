"""Engine metrics for the benchmark: scrape each engine's Prometheus `/metrics`.

Reads only the few vLLM series the report needs (names as vLLM v1 serves them:
vllm/v1/metrics/loggers.py; observed on vLLM 0.32, /work/shared/notes/real-vllm-on-cpu.md),
summed over label sets. Start and end snapshots give per-engine deltas (prefix-cache hit
rate = delta hits / delta queries); a 1 s sampler records queue depth over time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions"
GENERATION_TOKENS = "vllm:generation_tokens"
PROMPT_TOKENS = "vllm:prompt_tokens"
# vLLM has no GPU-busy counter; the simulator's own, under any of these names, is used when
# an engine serves it (seconds its GPU spent in forward steps).
BUSY_SECONDS: tuple[str, ...] = (
    "vllm:engine_busy_seconds",
    "meshd_sim:busy_seconds",
    "meshd_sim_busy_seconds",
    "sim:busy_seconds",
)
WATCHED: frozenset[str] = frozenset(
    {
        PREFIX_QUERIES,
        PREFIX_HITS,
        RUNNING,
        WAITING,
        KV_USAGE,
        PREEMPTIONS,
        GENERATION_TOKENS,
        PROMPT_TOKENS,
        *BUSY_SECONDS,
    }
)
SCRAPE_TIMEOUT_S = 5.0


def parse_metrics(text: str, names: Iterable[str] = WATCHED) -> dict[str, float]:
    """Sum of each named series over its label sets, from Prometheus text format 0.0.4.

    A counter is found under its name with or without `_total`; `_created` samples are
    ignored. Names not present are absent from the result.
    """
    wanted = frozenset(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            rest = line[line.rfind("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        if name.endswith("_created"):
            continue
        base = name[:-6] if name.endswith("_total") else name
        if base not in wanted:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out[base] = out.get(base, 0.0) + value
    return out


def busy_seconds(metrics: Mapping[str, float]) -> float | None:
    for name in BUSY_SECONDS:
        if name in metrics:
            return metrics[name]
    return None


@dataclass(frozen=True, slots=True)
class QueueSample:
    """Queue state of every engine at one moment (seconds from the run start)."""

    t_s: float
    waiting: tuple[float, ...]
    running: tuple[float, ...]
    kv_usage: tuple[float, ...]


class EngineScraper:
    """Scrapes a fixed list of engines; `snapshot()` once, `sample_every()` in the background."""

    def __init__(self, urls: Sequence[str], session: aiohttp.ClientSession) -> None:
        self.urls = tuple(u.rstrip("/") for u in urls)
        self._session = session
        self.samples: list[QueueSample] = []

    async def _one(self, url: str) -> dict[str, float]:
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                async with self._session.get(url + "/metrics") as resp:
                    if resp.status != 200:
                        return {}
                    return parse_metrics(await resp.text())
        except (TimeoutError, aiohttp.ClientError, ConnectionError, UnicodeDecodeError):
            return {}

    async def snapshot(self) -> list[dict[str, float]]:
        """One scrape of every engine, in `urls` order; {} for an engine that did not answer."""
        return list(await asyncio.gather(*(self._one(u) for u in self.urls)))

    async def sample_every(self, period_s: float, t0: float) -> None:
        """Append a QueueSample every `period_s` until cancelled; `t0` is the run start."""
        loop = asyncio.get_running_loop()
        while True:
            snap = await self.snapshot()
            if not any(WAITING in m for m in snap):
                # Engines without vLLM's queue gauges (stubs): nothing to plot.
                await asyncio.sleep(period_s)
                continue
            self.samples.append(
                QueueSample(
                    t_s=loop.time() - t0,
                    waiting=tuple(m.get(WAITING, 0.0) for m in snap),
                    running=tuple(m.get(RUNNING, 0.0) for m in snap),
                    kv_usage=tuple(m.get(KV_USAGE, 0.0) for m in snap),
                )
            )
            await asyncio.sleep(period_s)


@contextlib.asynccontextmanager
async def sampling(
    scraper: EngineScraper, period_s: float, t0: float
) -> AsyncIterator[EngineScraper]:
    """Run `scraper.sample_every` for the duration of the block."""
    task = asyncio.create_task(scraper.sample_every(period_s, t0))
    try:
        yield scraper
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
