"""The accounting layer: what a request's end is counted as. Prometheus series, the
request's trace (which feeds the access log, the spans and the cost ledger, all off the
request path: meshd/observe.py), and the OpenAI-style refusal the client gets."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from meshd.context import RequestContext
from meshd.http_message import Reply, error_reply
from meshd.metrics import DataPlaneMetrics, gauge_setter
from meshd.observe import RequestTrace, counter_adder

log = logging.getLogger("meshd.sidecar")

# Entries kept in each per-label answer cache before it starts over.
CACHE_LIMIT = 4096


class PoolSeries:
    """The metric children one pool's every request touches: `labels()` looks a child up
    under a lock (~2.5 us each), four times on a request's happy path. Each is made on its
    first use, as `labels()` would make it, so /metrics lists the same series as before."""

    __slots__ = (
        "_m",
        "_pool",
        "_stream_tokens",
        "queue_depth",
        "set_queue_depth",
        "set_tokens_in_flight",
        "tokens_in_flight",
    )

    def __init__(self, m: DataPlaneMetrics, pool: str) -> None:
        self._m, self._pool = m, pool
        self.queue_depth = m.admission_queue_depth.labels(pool)
        self.tokens_in_flight = m.tokens_in_flight.labels(pool)
        # Their setters (metrics.gauge_setter: Gauge.set's work in one call), which every
        # request's release calls.
        self.set_queue_depth = gauge_setter(self.queue_depth)
        self.set_tokens_in_flight = gauge_setter(self.tokens_in_flight)
        self._stream_tokens: Any = None

    @property
    def stream_tokens(self) -> Any:
        """meshd_stream_tokens_total{pool}'s adder (observe.counter_adder): call it with
        the count, never negative."""
        if self._stream_tokens is None:
            self._stream_tokens = counter_adder(self._m.stream_tokens.labels(self._pool))
        return self._stream_tokens


class Accounting:
    """Counts refusals and attempts, and closes a request's trace."""

    def __init__(self, metrics: DataPlaneMetrics) -> None:
        self.metrics = metrics
        self._pool_series: dict[str, PoolSeries] = {}
        # (pool, endpoint, result) -> its meshd_upstream_attempts child (bounded).
        self._attempt_series: dict[tuple[str, str, str], Any] = {}
        self._pending: list[tuple[RequestTrace, str, dict[str, Any] | None, float, int]] = []

    def series(self, pool: str) -> PoolSeries:
        series = self._pool_series.get(pool)
        if series is None:
            series = self._pool_series[pool] = PoolSeries(self.metrics, pool)
        return series

    def count_attempt(self, pool: str, url: str, result: str) -> None:
        """meshd_upstream_attempts_total{pool, endpoint, result}, its child cached."""
        key = (pool, url, result)
        child = self._attempt_series.get(key)
        if child is None:
            if len(self._attempt_series) >= CACHE_LIMIT:
                self._attempt_series.clear()
            child = self._attempt_series[key] = counter_adder(
                self.metrics.upstream_attempts.labels(pool, url, result)
            )
        child(1)

    def reject(self, status: int, message: str, code: str, **kw: Any) -> Reply:
        """meshd's own error reply, counted in meshd_rejected_requests_total{code}."""
        self.metrics.rejected.labels(code).inc()
        return error_reply(status, message, code, **kw)

    def refuse(self, ctx: RequestContext, status: int, message: str, code: str, **kw: Any) -> Reply:
        """A begun request refused: its trace ends with the code, and the client is told.
        While the request may still go to a fallback pool the refusal is only held (not
        counted, the trace goes on): meshd/fallback.py decides."""
        if ctx.hold_refusal:
            ctx.refused = (status, message, code, kw)
            return error_reply(status, message, code, **kw)
        self.finish(ctx, code, status)
        return self.reject(status, message, code, **kw)

    def finish(
        self,
        ctx: RequestContext,
        outcome: str,
        status: int = 0,
        usage: dict[str, Any] | None = None,
    ) -> None:
        """The request is over (its last bytes are out): its trace is finished off the
        request's path, with the others that ended in this turn of the loop (metrics, cost
        ledger, access log, spans: ~70 us a request), at the time given now."""
        obs = ctx.obs
        if obs is None or obs.finished:
            return
        loop = asyncio.get_running_loop()
        if not self._pending:
            loop.call_soon(self.flush)
        self._pending.append((obs, outcome, usage, loop.time(), status))

    def flush(self) -> None:
        """Finish the traces of the requests that ended since the last flush."""
        pending, self._pending = self._pending, []
        for obs, outcome, usage, now, status in pending:
            try:
                obs.finish(outcome, usage, now, status=status)
            except Exception:  # one bad record must not lose the others
                log.exception("finishing the trace of request %s failed", obs.request_id)
