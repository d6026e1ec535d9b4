"""What a sidecar may learn from an engine's own /metrics when no control plane reports it:
the decisions of meshd/engine_probe.py (which fetches the text), sans-I/O, time passed in.

A fleet nobody described still says what its engines know: KV capacity (vLLM's
`vllm:cache_config_info` num_gpu_blocks x block_size; SGLang's max total tokens where its
page has them), the share of KV in use, and restarts (a counter that went back: a new
epoch, so the prefix index forgets what the old process held, and the guard ramps the
engine back in). The sidecar's picker then models eviction against the engine's real
capacity instead of a guess (filters/picker.py: the index capacity is otherwise learnt from
cached-token answers, starting at 4x a default GPU's).

Nor is the GPU (only the project's engine simulator names it; a real vLLM does not, and
the decode and TTFT calibrations learn its speed). Running and waiting counts are not taken
from the page: the sidecar counts its own requests
exactly and at once, while a scrape lags by up to an interval, and the picker takes the
larger of a reported and a local figure. An endpoint that does not serve the page (404,
not Prometheus text, unreachable) is asked again after a backoff that doubles up to
`max_backoff_s`; one that never answered is never reported, one that stops answering keeps
its last report until that report's TTL passes.
"""

from __future__ import annotations

from dataclasses import dataclass

from filters.endpoint_state import ReportedState
from filters.vllm_metrics import (
    MAX_METRICS_BYTES,
    EngineMetrics,
    MetricsParseError,
    MetricsTracker,
    parse_engine_metrics,
)

__all__ = ["ProbeResult", "ProbeState"]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One scrape's outcome: the report to give the router (None: none), whether the
    engine restarted since the last good scrape, the delay before the next scrape, why
    the scrape failed (None: it did not), and the prompt tokens the engine looked up in
    its prefix cache and found there since the last good scrape (queries, hits; None on
    the first page, after a restart, or where the page does not count them)."""

    state: ReportedState | None
    restarted: bool
    next_in_s: float
    error: str | None = None
    prefix_window: tuple[float, float] | None = None


class ProbeState:
    """One endpoint's probe: call `observed` with each scrape's /metrics text (None for a
    failed fetch: a status other than 200, a timeout, a refused connection)."""

    def __init__(self, name: str, *, interval_s: float = 2.0, max_backoff_s: float = 60.0) -> None:
        if not 0 < interval_s <= max_backoff_s:
            raise ValueError("need 0 < interval_s <= max_backoff_s")
        self.name = name
        self.interval_s = interval_s
        self.max_backoff_s = max_backoff_s
        self.tracker = MetricsTracker()
        self.epoch = 0
        self.scrapes = 0
        self.good = 0  # scrapes that gave a report
        self.failures = 0  # in a row
        self.last: EngineMetrics | None = None
        self.last_ok_at: float | None = None
        self.last_error: str | None = None

    def ttl_s(self) -> float:
        """How long a report stays in force: three intervals, so one late scrape keeps it."""
        return 3.0 * self.interval_s

    def observed(self, text: str | None, now: float, *, error: str | None = None) -> ProbeResult:
        self.scrapes += 1
        if text is None:
            return self._failed(error or "no answer")
        if len(text) > MAX_METRICS_BYTES:
            return self._failed(f"/metrics is {len(text)} bytes, over {MAX_METRICS_BYTES}")
        try:
            m = parse_engine_metrics(text)
        except MetricsParseError as exc:
            return self._failed(f"not an engine's /metrics: {exc}")
        update = self.tracker.update(m)  # a reset restarts its averages from this page
        restarted = update.counters_reset
        if restarted:
            self.epoch += 1
        window = None
        last = self.last
        if (
            not restarted
            and last is not None
            and last.prefix_queries is not None
            and last.prefix_hits is not None
            and m.prefix_queries is not None
            and m.prefix_hits is not None
            and m.prefix_queries >= last.prefix_queries
            and m.prefix_hits >= last.prefix_hits
        ):
            window = (m.prefix_queries - last.prefix_queries, m.prefix_hits - last.prefix_hits)
        self.failures = 0
        self.good += 1
        self.last = m
        self.last_ok_at = now
        self.last_error = None
        state = ReportedState(
            epoch=self.epoch,
            kv_block_size=m.kv_block_size,
            kv_capacity_blocks=m.kv_capacity_blocks,
            kv_usage=m.kv_usage,
            ttft_s=update.ttft_s,
            tpot_s=update.tpot_s,
        )
        return ProbeResult(state, restarted, self.interval_s, prefix_window=window)

    def _failed(self, why: str) -> ProbeResult:
        self.failures += 1
        self.last_error = why
        delay = min(self.max_backoff_s, self.interval_s * 2.0 ** min(self.failures - 1, 30))
        return ProbeResult(None, False, delay, why)
