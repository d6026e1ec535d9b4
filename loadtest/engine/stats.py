"""The engine simulator's counters and histograms, and their /metrics text.

Names, types, help strings, labels (`engine`, `model_name`) and bucket bounds are vLLM
v1's own, from vllm/v1/metrics/loggers.py (PrometheusStatLogger) as served by vLLM 0.32
(/work/shared/notes/real-vllm-on-cpu.md lists the observed names). Counters carry the
`_total` suffix and a `_created` sample, as prometheus_client writes them. The text is
written by hand (Prometheus text format 0.0.4): 16 engines with a registry each would cost
more than the few string joins here. Values are in simulated seconds.

Prefill/decode disaggregation: the KV transfers a decode engine made use the NIXL
connector's histograms (vllm:nixl_xfer_time_seconds, vllm:nixl_bytes_transferred, from
vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py: NixlPromMetrics); what
vLLM does not count (prefill steps whose KV was pinned, holds fetched or expired, fetches
refused, bytes and seconds in total, the pinned blocks, the engine's kv_role) is
simulator-only, under `meshd_sim:`. So is the GPU's busy time
(`meshd_sim:gpu_busy_seconds_total`, the seconds a step was running: what NVML's
utilisation integrates on a real GPU, and what the cost ledger apportions to requests,
filters/busy_time.py); vLLM has no such series.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Final

from prometheus_client.utils import floatToGoString

TTFT_BUCKETS: Final = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS: Final = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS: Final = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_TOKENS_BUCKETS: Final = (
    1,
    8,
    16,
    32,
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096,
    8192,
    16384,
)
# vllm/v1/engine/__init__.py FINISH_REASON_STRINGS; every one is pre-created as vLLM does.
FINISH_REASONS: Final = ("stop", "length", "abort", "error", "repetition")
# NixlPromMetrics' buckets: transfer time (its first bound dropped, as vLLM does) and
# bytes (2 KiB to 8 GiB by factors of 4).
NIXL_XFER_TIME_BUCKETS: Final = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    5.0,
)
NIXL_BYTES_BUCKETS: Final = tuple(2 ** (10 + i) for i in range(1, 25, 2))
# Why a decode step's KV fetch was refused (kv_transfer.py), each pre-created.
KV_FETCH_REFUSALS: Final = (
    "unknown_engine",
    "unknown_request",
    "expired",
    "already_fetched",
    "released",
    "mismatch",
    "timeout",
)


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return tuple(out)
            out.append(float(v))
        exp += 1


class Histogram:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        # Bucket le=b counts values <= b: bisect_left finds the first bound >= value.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


class EngineStats:
    """Everything /metrics reports that is not read live from the scheduler."""

    __slots__ = (
        "created",
        "decode_time",
        "e2e",
        "generation_tokens",
        "inference_time",
        "iteration_tokens",
        "itl",
        "kv_fetch_refused",
        "kv_holds_expired",
        "kv_holds_fetched",
        "kv_prefill_steps",
        "kv_remote_decode_steps",
        "kv_transfer_bytes",
        "kv_transfer_seconds",
        "max_tokens_param",
        "nixl_bytes_transferred",
        "nixl_xfer_time",
        "num_preemptions",
        "prefill_time",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "prompt_tokens",
        "prompt_tokens_cached",
        "queue_time",
        "request_generation_tokens",
        "request_prompt_tokens",
        "request_success",
        "ttft",
    )

    def __init__(self, max_model_len: int, created: float | None = None) -> None:
        self.created = time.time() if created is None else created
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens_cached = 0
        self.num_preemptions = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        tokens = build_1_2_5_buckets(max_model_len)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = Histogram(tokens)
        self.request_generation_tokens = Histogram(tokens)
        self.max_tokens_param = Histogram(tokens)
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)
        self.kv_prefill_steps = 0
        self.kv_holds_fetched = 0
        self.kv_holds_expired = 0
        self.kv_remote_decode_steps = 0
        self.kv_transfer_bytes = 0
        self.kv_transfer_seconds = 0.0
        self.kv_fetch_refused = dict.fromkeys(KV_FETCH_REFUSALS, 0)
        self.nixl_xfer_time = Histogram(NIXL_XFER_TIME_BUCKETS)
        self.nixl_bytes_transferred = Histogram(NIXL_BYTES_BUCKETS)


# (name without _total, help, EngineStats attribute) in vLLM's registration order.
_COUNTERS: Final = (
    (
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        "prefix_cache_queries",
    ),
    (
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        "prefix_cache_hits",
    ),
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    (
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local prefix cache hits).",
        "prompt_tokens_cached",
    ),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
)
_HISTOGRAMS: Final = (
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "request_prompt_tokens"),
    (
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        "request_generation_tokens",
    ),
    (
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        "iteration_tokens",
    ),
    (
        "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
        "max_tokens_param",
    ),
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "itl"),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "e2e"),
    (
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        "queue_time",
    ),
    (
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        "inference_time",
    ),
    (
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        "prefill_time",
    ),
    (
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        "decode_time",
    ),
)
_NIXL_HISTOGRAMS: Final = (
    (
        "vllm:nixl_xfer_time_seconds",
        "Histogram of transfer duration for NIXL KV Cache transfers.",
        "nixl_xfer_time",
    ),
    (
        "vllm:nixl_bytes_transferred",
        "Histogram of bytes transferred per NIXL KV Cache transfers.",
        "nixl_bytes_transferred",
    ),
)
# Simulator-only disaggregation counters (no vLLM twin).
_SIM_KV_COUNTERS: Final = (
    (
        "meshd_sim:kv_prefill_steps",
        "Prefill steps (kv_transfer_params.do_remote_decode) whose KV was pinned.",
        "kv_prefill_steps",
    ),
    (
        "meshd_sim:kv_holds_fetched",
        "Pinned prefill KV fetched by a decode step and released.",
        "kv_holds_fetched",
    ),
    (
        "meshd_sim:kv_holds_expired",
        "Pinned prefill KV released unfetched after kv_hold_s.",
        "kv_holds_expired",
    ),
    (
        "meshd_sim:kv_remote_decode_steps",
        "Decode steps (kv_transfer_params.do_remote_prefill) whose KV came from a remote engine.",
        "kv_remote_decode_steps",
    ),
    (
        "meshd_sim:kv_transfer_bytes",
        "KV bytes fetched from remote prefill engines.",
        "kv_transfer_bytes",
    ),
    (
        "meshd_sim:kv_transfer_seconds",
        "Seconds spent fetching KV from remote prefill engines.",
        "kv_transfer_seconds",
    ),
)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Mapping[str, str]) -> str:
    # prometheus_client writes labels sorted by name.
    return ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(pairs.items()))


def render_metrics(
    stats: EngineStats,
    *,
    model_name: str,
    engine: str,
    running: int,
    waiting: int,
    waiting_capacity: int,
    kv_cache_usage: float,
    cache_config: Mapping[str, str],
    extra_info: Mapping[str, str] | None = None,
    kv_held_requests: int = 0,
    kv_held_blocks: int = 0,
    busy_seconds: float | None = None,
) -> str:
    """Prometheus text for one engine, laid out as prometheus_client lays it out."""
    fmt = floatToGoString
    ident = {"engine": engine, "model_name": model_name}
    base = _labels(ident)
    created = fmt(stats.created)
    out: list[str] = []
    w = out.append

    def family(name: str, mtype: str, help_: str) -> None:
        w(f"# HELP {name} {help_}\n# TYPE {name} {mtype}\n")

    def gauge(name: str, help_: str, value: float, labels: str = base) -> None:
        family(name, "gauge", help_)
        w(f"{name}{{{labels}}} {fmt(value)}\n")

    def created_family(name: str, help_: str, label_sets: Sequence[str]) -> None:
        family(f"{name}_created", "gauge", help_)
        for lab in label_sets:
            w(f"{name}_created{{{lab}}} {created}\n")

    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
    name = "vllm:num_requests_waiting_by_reason"
    family(name, "gauge", "Number of requests waiting, by the reason they wait.")
    for reason, value in (("capacity", waiting_capacity), ("deferred", waiting - waiting_capacity)):
        w(f"{name}{{{_labels({**ident, 'reason': reason})}}} {fmt(value)}\n")
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_cache_usage)
    for metric, help_, attr in _COUNTERS:
        family(f"{metric}_total", "counter", help_)
        w(f"{metric}_total{{{base}}} {fmt(getattr(stats, attr))}\n")
        created_family(metric, help_, (base,))
    name = "vllm:request_success"
    help_ = "Count of successfully processed requests."
    family(f"{name}_total", "counter", help_)
    label_sets = [_labels({**ident, "finished_reason": r}) for r in stats.request_success]
    for lab, value in zip(label_sets, stats.request_success.values(), strict=True):
        w(f"{name}_total{{{lab}}} {fmt(value)}\n")
    created_family(name, help_, label_sets)

    def histograms(table: Sequence[tuple[str, str, str]]) -> None:
        for metric, help_, attr in table:
            h: Histogram = getattr(stats, attr)
            family(metric, "histogram", help_)
            acc = 0
            for bound, n in zip(h.bounds, h.counts, strict=False):
                acc += n
                w(f"{metric}_bucket{{{_labels({**ident, 'le': fmt(bound)})}}} {fmt(acc)}\n")
            w(
                f"{metric}_bucket{{{_labels({**ident, 'le': '+Inf'})}}} {fmt(h.count)}\n"
                f"{metric}_count{{{base}}} {fmt(h.count)}\n"
                f"{metric}_sum{{{base}}} {fmt(h.sum)}\n"
            )
            created_family(metric, help_, (base,))

    histograms(_HISTOGRAMS)
    # vLLM's info gauges: labels from CacheConfig.metrics_info() plus `engine`.
    info = _labels({**cache_config, "engine": engine})
    gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", 1.0, info)
    histograms(_NIXL_HISTOGRAMS)
    for metric, help_, attr in _SIM_KV_COUNTERS:
        family(f"{metric}_total", "counter", help_)
        w(f"{metric}_total{{{base}}} {fmt(getattr(stats, attr))}\n")
    name = "meshd_sim:kv_fetch_refused"
    family(
        f"{name}_total",
        "counter",
        "Decode steps refused (or recomputed) because their remote KV could not be fetched.",
    )
    for reason, value in stats.kv_fetch_refused.items():
        w(f"{name}_total{{{_labels({**ident, 'reason': reason})}}} {fmt(value)}\n")
    gauge(
        "meshd_sim:kv_held_requests",
        "Prefill steps whose KV is pinned for a decode step.",
        kv_held_requests,
    )
    gauge("meshd_sim:kv_held_blocks", "KV blocks pinned for decode steps.", kv_held_blocks)
    if busy_seconds is not None:
        name = "meshd_sim:gpu_busy_seconds"
        family(f"{name}_total", "counter", "Simulated seconds the GPU was running a step.")
        w(f"{name}_total{{{base}}} {fmt(busy_seconds)}\n")
    if extra_info:
        gauge(
            "meshd_sim:engine_info",
            "Simulator facts a real vLLM does not expose (GPU model, price).",
            1.0,
            _labels({**extra_info, **ident}),
        )
    return "".join(out)
