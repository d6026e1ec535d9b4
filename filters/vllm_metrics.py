"""An inference engine's Prometheus /metrics text, parsed and normalised: vLLM's names, and
SGLang's as a second adapter, into one `EngineMetrics` record; `MetricsTracker` turns
successive records into TTFT/TPOT moving averages and notices counter resets (restarts).

Sans-I/O: the agent (meshd/agent.py) fetches the text and passes `now`. Names: vLLM v1's
PrometheusStatLogger (vllm-project/vllm, vllm/v1/metrics/loggers.py; observed names in
/work/shared/notes/real-vllm-on-cpu.md); SGLang's from sgl-project/sglang,
docs/references/production_metrics.md (`sglang:num_running_reqs`, `sglang:num_queue_reqs`,
`sglang:token_usage`, `sglang:cache_hit_rate`, `sglang:time_to_first_token_seconds`,
`sglang:time_per_output_token_seconds`, newer `sglang:inter_token_latency_seconds`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "MAX_METRICS_BYTES",
    "EngineMetrics",
    "Histogram",
    "LatencyUpdate",
    "MetricsParseError",
    "MetricsTracker",
    "Sample",
    "detect_flavor",
    "parse_engine_metrics",
    "parse_samples",
    "parse_sglang",
    "parse_vllm",
]

# A vLLM /metrics page is ~60 KB; a 16 MiB one is a misconfigured target, not an engine.
MAX_METRICS_BYTES = 16 * 2**20
# Labels per sample: vLLM uses 2-9; more than this is not an engine's page.
MAX_LABELS = 64
Flavor = Literal["vllm", "sglang"]


class MetricsParseError(ValueError):
    """Text that is not Prometheus exposition format (the reason is the message)."""


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        for k, v in self.labels:
            if k == key:
                return v
        return None


@dataclass(frozen=True, slots=True)
class Histogram:
    """A histogram's cumulative count and sum (summed over label sets)."""

    count: float = 0.0
    sum: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What one scrape says about the engine, in engine-neutral terms (None: not exposed).

    `counters` holds the monotone counters restart detection watches (name -> value)."""

    flavor: Flavor
    model: str | None = None
    running: int = 0
    waiting: int = 0
    kv_usage: float | None = None
    kv_block_size: int | None = None
    kv_capacity_blocks: int | None = None
    cache_hit_rate: float | None = None
    ttft: Histogram | None = None
    tpot: Histogram | None = None
    gpu: str | None = None  # only the simulator says (meshd_sim:engine_info{gpu=...})
    counters: Mapping[str, float] = field(default_factory=dict)
    # Seconds the GPU was busy since the engine started: only the simulator counts them
    # (meshd_sim:gpu_busy_seconds_total); vLLM's request prefill/decode histograms are
    # request-seconds, shared with the batch, so not this (filters/busy_time.py).
    busy_seconds: float | None = None
    # Prompt tokens looked up in the prefix cache and found there since the engine started
    # (vllm:prefix_cache_queries / hits; SGLang's page has a hit-rate gauge only).
    prefix_queries: float | None = None
    prefix_hits: float | None = None

    @property
    def tokens(self) -> float | None:
        """Prompt + generation tokens since the engine started (None: not counted)."""
        c = self.counters
        names = _TOKEN_COUNTERS[self.flavor]
        if not all(n in c for n in names):
            return None
        return sum(c[n] for n in names)


# -- the text format ----------------------------------------------------------------------


def _parse_labels(s: str, i: int, line: str) -> tuple[tuple[tuple[str, str], ...], int]:
    """Labels from `s[i]` (just after "{"); returns them and the index after "}"."""
    labels: list[tuple[str, str]] = []
    n = len(s)
    while True:
        while i < n and s[i] in " \t,":
            i += 1
        if i < n and s[i] == "}":
            return tuple(labels), i + 1
        eq = s.find("=", i)
        if eq < 0 or eq + 1 >= n or s[eq + 1] != '"':
            raise MetricsParseError(f"bad label in {line[:200]!r}")
        key = s[i:eq].strip()
        if not key or not (key[0].isalpha() or key[0] == "_"):
            raise MetricsParseError(f"bad label name {key!r}")
        j = eq + 2
        out: list[str] = []
        while True:
            k = s.find('"', j)
            if k < 0:
                raise MetricsParseError(f"unterminated label value in {line[:200]!r}")
            chunk = s[j:k]
            # An escaped quote: count the backslashes before it.
            bs = len(chunk) - len(chunk.rstrip("\\"))
            if bs % 2:
                out.append(chunk[:-1] + '"')
                j = k + 1
                continue
            out.append(chunk)
            j = k + 1
            break
        value = "".join(out)
        if "\\" in value:
            value = value.replace("\\\\", "\x00").replace("\\n", "\n").replace("\x00", "\\")
        labels.append((key, value))
        if len(labels) > MAX_LABELS:
            raise MetricsParseError(f"more than {MAX_LABELS} labels")
        i = j


def _parse_value(token: str, line: str) -> float:
    try:
        return float(token)
    except ValueError:
        raise MetricsParseError(f"bad sample value in {line[:200]!r}") from None


def parse_samples(text: str) -> Iterator[Sample]:
    """Every sample of Prometheus text format 0.0.4 (comments skipped, timestamps dropped).

    Raises MetricsParseError, and nothing else, for text that is not in that format."""
    if len(text) > MAX_METRICS_BYTES:
        raise MetricsParseError(f"metrics text over {MAX_METRICS_BYTES} bytes")
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = min((p for p in (line.find(" "), line.find("\t")) if p >= 0), default=-1)
        if brace >= 0 and (space < 0 or brace < space):
            name = line[:brace]
            labels, end = _parse_labels(line, brace + 1, line)
            rest = line[end:].split()
        else:
            if space < 0:
                raise MetricsParseError(f"sample without a value: {line[:200]!r}")
            name, labels, rest = line[:space], (), line[space:].split()
        if not name or not (name[0].isalpha() or name[0] in "_:"):
            raise MetricsParseError(f"bad metric name in {line[:200]!r}")
        if not 1 <= len(rest) <= 2:
            raise MetricsParseError(f"bad sample in {line[:200]!r}")
        yield Sample(name, labels, _parse_value(rest[0], line))


# -- engine adapters ----------------------------------------------------------------------


@dataclass(slots=True)
class _Acc:
    """Per-name sums over label sets (an engine with several `engine` labels: DP ranks)."""

    values: dict[str, float] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)
    model: str | None = None
    cache_config: dict[str, str] = field(default_factory=dict)
    gpu: str | None = None

    def add(self, s: Sample) -> None:
        self.values[s.name] = self.values.get(s.name, 0.0) + s.value
        self.seen.add(s.name)
        if self.model is None:
            self.model = s.label("model_name")

    def get(self, name: str) -> float | None:
        return self.values.get(name) if name in self.seen else None

    def hist(self, base: str) -> Histogram | None:
        count, total = self.get(base + "_count"), self.get(base + "_sum")
        if count is None or total is None:
            return None
        return Histogram(count, total)


def _collect(text: str) -> _Acc:
    acc = _Acc()
    for s in parse_samples(text):
        if s.name.endswith("_bucket") or s.name.endswith("_created"):
            continue
        if s.name == "vllm:cache_config_info":
            acc.cache_config = dict(s.labels)
            continue
        if s.name == "meshd_sim:engine_info":
            acc.gpu = s.label("gpu")
        acc.add(s)
    return acc


def _count(v: float | None) -> int:
    if v is None or not math.isfinite(v) or v < 0:
        return 0
    return round(v)


def _fraction(v: float | None) -> float | None:
    if v is None or not math.isfinite(v):
        return None
    return min(1.0, max(0.0, v))


def _nonneg(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) and v >= 0 else None


def _pos_int(s: str | None) -> int | None:
    if s is None:
        return None
    try:
        v = int(float(s))
    except ValueError:
        return None  # vLLM writes "None" for an unset num_gpu_blocks_override
    return v if v > 0 else None


_VLLM_COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:request_success_total",
)
_SGLANG_COUNTERS = (
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:num_requests_total",
)


_TOKEN_COUNTERS: dict[str, tuple[str, str]] = {
    "vllm": ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
    "sglang": ("sglang:prompt_tokens_total", "sglang:generation_tokens_total"),
}


def _counters(acc: _Acc, names: tuple[str, ...]) -> dict[str, float]:
    return {n: v for n in names if (v := acc.get(n)) is not None}


def parse_vllm(text: str) -> EngineMetrics:
    """vLLM's /metrics. TPOT is `vllm:inter_token_latency_seconds` (v1), else the older
    `vllm:time_per_output_token_seconds`; KV capacity and block size come from the labels
    of `vllm:cache_config_info` (vLLM's `--num-gpu-blocks-override` wins when set)."""
    acc = _collect(text)
    cc = acc.cache_config
    capacity = _pos_int(cc.get("num_gpu_blocks_override")) or _pos_int(cc.get("num_gpu_blocks"))
    usage = acc.get("vllm:kv_cache_usage_perc")
    if usage is None:
        usage = acc.get("vllm:gpu_cache_usage_perc")  # vLLM v0's name
    hits, queries = (
        acc.get("vllm:prefix_cache_hits_total"),
        acc.get("vllm:prefix_cache_queries_total"),
    )
    return EngineMetrics(
        flavor="vllm",
        model=acc.model,
        running=_count(acc.get("vllm:num_requests_running")),
        waiting=_count(acc.get("vllm:num_requests_waiting")),
        kv_usage=_fraction(usage),
        kv_block_size=_pos_int(cc.get("block_size")),
        kv_capacity_blocks=capacity,
        cache_hit_rate=_fraction(hits / queries) if hits is not None and queries else None,
        ttft=acc.hist("vllm:time_to_first_token_seconds"),
        tpot=acc.hist("vllm:inter_token_latency_seconds")
        or acc.hist("vllm:time_per_output_token_seconds"),
        gpu=acc.gpu,
        counters=_counters(acc, _VLLM_COUNTERS),
        busy_seconds=_nonneg(acc.get("meshd_sim:gpu_busy_seconds_total")),
        prefix_queries=_nonneg(queries),
        prefix_hits=_nonneg(hits),
    )


def parse_sglang(text: str) -> EngineMetrics:
    """SGLang's /metrics (`--enable-metrics`). `sglang:token_usage` is the fraction of the
    KV token pool in use; SGLang's radix cache is token-granular (page size 1 by default),
    so capacity is `sglang:max_total_num_tokens` tokens when exposed."""
    acc = _collect(text)
    capacity = acc.get("sglang:max_total_num_tokens")
    return EngineMetrics(
        flavor="sglang",
        model=acc.model,
        running=_count(acc.get("sglang:num_running_reqs")),
        waiting=_count(acc.get("sglang:num_queue_reqs")),
        kv_usage=_fraction(acc.get("sglang:token_usage")),
        kv_block_size=1 if capacity is not None else None,
        kv_capacity_blocks=_count(capacity) if capacity is not None else None,
        cache_hit_rate=_fraction(acc.get("sglang:cache_hit_rate")),
        ttft=acc.hist("sglang:time_to_first_token_seconds"),
        tpot=acc.hist("sglang:inter_token_latency_seconds")
        or acc.hist("sglang:time_per_output_token_seconds"),
        counters=_counters(acc, _SGLANG_COUNTERS),
    )


def detect_flavor(text: str) -> Flavor | None:
    if "vllm:" in text:
        return "vllm"
    if "sglang:" in text:
        return "sglang"
    return None


def parse_engine_metrics(text: str, flavor: Flavor | None = None) -> EngineMetrics:
    """Parse with the named adapter, or the one whose names appear in the text."""
    flavor = flavor or detect_flavor(text)
    if flavor is None:
        raise MetricsParseError("neither vLLM nor SGLang metric names in the text")
    return parse_sglang(text) if flavor == "sglang" else parse_vllm(text)


# -- over time ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LatencyUpdate:
    """The tracker's view after one scrape."""

    ttft_s: float | None
    tpot_s: float | None
    counters_reset: bool


class MetricsTracker:
    """TTFT/TPOT moving averages from histogram deltas between scrapes, and restarts.

    Each scrape's new observations give a mean (delta sum / delta count); the moving
    average weights it by `alpha`, or more when many requests finished at once, so a
    busy engine's figure follows it quickly and an idle one keeps its last value. A
    counter smaller than last time means a new engine process: the averages restart.
    """

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.ttft_s: float | None = None
        self.tpot_s: float | None = None
        self._last: EngineMetrics | None = None

    def _blend(
        self, avg: float | None, old: Histogram | None, new: Histogram | None
    ) -> float | None:
        if new is None:
            return avg
        base = old or Histogram()
        dc, ds = new.count - base.count, new.sum - base.sum
        if dc <= 0 or ds < 0 or not math.isfinite(ds):
            return avg
        mean = ds / dc
        if avg is None:
            return mean
        # n new observations at weight alpha each, as n single updates would give.
        w = 1.0 - (1.0 - self.alpha) ** min(dc, 1000.0)
        return avg + w * (mean - avg)

    def update(self, m: EngineMetrics) -> LatencyUpdate:
        last = self._last
        reset = last is not None and (
            any(m.counters.get(k, v) < v for k, v in last.counters.items())
            or _went_back(last.ttft, m.ttft)
            or _went_back(last.tpot, m.tpot)
        )
        if reset:
            last = None
            self.ttft_s = self.tpot_s = None
        # With no previous scrape the totals so far are the best estimate there is.
        self.ttft_s = self._blend(self.ttft_s, last.ttft if last else None, m.ttft)
        self.tpot_s = self._blend(self.tpot_s, last.tpot if last else None, m.tpot)
        self._last = m
        return LatencyUpdate(self.ttft_s, self.tpot_s, reset)


def _went_back(old: Histogram | None, new: Histogram | None) -> bool:
    return old is not None and new is not None and new.count < old.count
