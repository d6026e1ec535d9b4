"""The sidecar's own scrape of each endpoint's /metrics, when no control plane reports the
engines (`routing.engine_metrics`): the I/O of filters/engine_probe.py, whose ProbeState
decides what a page says and when to ask again. One task per endpoint; a scrape never
holds a request, and an endpoint without the page is asked again after a backoff.

Each good scrape's page also goes to `on_metrics(url, now, metrics)` (the sidecar hands an
engine's busy-time counter to the cost ledger). The prefix-cache counters of two pages in a
row (vLLM's hits and queries) go to the router, which checks its prefix index against them
(Picker.observe_engine_hits); each verdict's error goes to `on_index_check(pool, url,
error)` (the sidecar's gauge meshd_prefix_index_hit_error). The first good scrape of an
endpoint logs what was learnt (its KV capacity); a restart (a new epoch) goes to
`on_restart(pool, url, now)` as the control feed's does, so the guard ramps the engine back
in while the picker's prefix index forgets what it held.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping

import aiohttp

from filters.engine_probe import ProbeState
from filters.pool_router import PoolRouter
from filters.vllm_metrics import MAX_METRICS_BYTES, EngineMetrics
from meshd.config import Config
from meshd.tasks import cancel_and_wait

__all__ = ["EngineProbes"]

log = logging.getLogger("meshd.engine_probe")


class EngineProbes:
    """Scrapes every endpoint of every pool; `states` holds each one's ProbeState."""

    def __init__(
        self,
        config: Config,
        routers: Mapping[str, PoolRouter],
        *,
        on_restart: Callable[[str, str, float], None] | None = None,
        on_metrics: Callable[[str, float, EngineMetrics], None] | None = None,
        on_index_check: Callable[[str, str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = s = config.routing.engine_metrics
        self.routers = routers
        self._on_restart = on_restart
        self._on_metrics = on_metrics
        self._on_index_check = on_index_check
        self._clock = clock
        self.states: dict[tuple[str, str], ProbeState] = {
            (pool.name, ep.url): ProbeState(
                ep.url, interval_s=s.interval_s, max_backoff_s=s.max_backoff_s
            )
            for pool in config.pools
            for ep in pool.endpoints
        }
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.settings.timeout_s),
            skip_auto_headers=("User-Agent",),
        )
        for key in self.states:
            self._tasks.append(asyncio.create_task(self._run(*key)))

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def scrape(self, pool: str, url: str) -> float:
        """One scrape of `url` (pool `pool`): report what it says; the delay to the next."""
        st = self.states[(pool, url)]
        text, error = await self._fetch(url)
        now = self._clock()
        result = st.observed(text, now, error=error)
        if result.state is not None:
            router = self.routers[pool]
            first = st.good == 1
            router.report(url, result.state, now, ttl_s=st.ttl_s())
            if self._on_metrics is not None and st.last is not None:
                self._on_metrics(url, now, st.last)
            if result.prefix_window is not None:
                miss = router.engine_hits(url, *result.prefix_window, now)
                if miss is not None and self._on_index_check is not None:
                    self._on_index_check(pool, url, miss)
            if result.restarted and self._on_restart is not None:
                log.info("engine %s restarted (its /metrics counters went back)", url)
                self._on_restart(pool, url, now)
            if first or result.restarted:
                cap = result.state.kv_capacity_tokens
                log.info(
                    "engine %s: KV capacity %s from its /metrics",
                    url,
                    f"{cap:,} tokens" if cap is not None else "not on the page",
                )
        elif st.failures in (1, 4):  # the first failure, and once it backs off for good
            log.info(
                "engine %s: no /metrics (%s); asking again in %.0f s",
                url,
                result.error,
                result.next_in_s,
            )
        return result.next_in_s

    async def _fetch(self, url: str) -> tuple[str | None, str | None]:
        assert self._session is not None
        target = url.rstrip("/") + self.settings.path
        try:
            async with self._session.get(target) as r:
                if r.status != 200:
                    return None, f"HTTP {r.status}"
                body = await r.content.read(MAX_METRICS_BYTES + 1)
                return body.decode("utf-8", "replace"), None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

    async def _run(self, pool: str, url: str) -> None:
        # Spread the first scrapes over an interval: a big pool does not ask all at once.
        await asyncio.sleep(random.uniform(0.0, min(0.5, self.settings.interval_s)))
        while True:
            try:
                delay = await self.scrape(pool, url)
            except asyncio.CancelledError:
                raise
            except Exception:  # a probe must not die; the data plane does not depend on it
                log.exception("engine %s: scrape failed", url)
                delay = self.settings.max_backoff_s
            await asyncio.sleep(delay)
