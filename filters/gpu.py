"""GPU generations as the picker sees them: prefill speed, decode step time, KV capacity
and price per GPU-hour, for a reference 8B model, with configurable overrides.

The numbers are the engine simulator's (loadtest/engine/profiles.py, a roofline of the
datasheets calibrated on published runs), copied rather than imported because filters/
may not import loadtest/; tests/test_picker.py checks that the two tables agree.

    GPU      prefill   decode step, ctx 1k   KV tokens   max batched  max   $/GPU-h  KV read
             tok/s     b=1 ms    b=64 ms     (8B BF16)   tokens       seqs           ns/token
    A100      8,742    11.6      17.4          442,704    2,048        256    1.30    85.7
    H100     27,712     7.45     11.1          440,112    8,192      1,024    3.00    52.2
    H200     27,712     5.50      8.17         888,032    8,192      1,024    4.00    36.4
    B200     63,045     3.70      5.43       1,173,072    8,192      1,024    5.50    21.8
    unknown   8,742    11.6      17.4          442,704    2,048        256    3.00    85.7

Prefill is compute bound and grows faster than its tokens: attention multiplies every
new token with every token before it (GpuProfile.prefill_work; a 12k-token prompt
prefills at 0.83 of the table's tok/s, 50k at 0.55).

The step grows with the context the batch holds (a decode step streams every running
sequence's KV): step(b, K) = base + per_seq x b + kv_read x K, K the context tokens of the
batch (GpuProfile.decode_step_parts); the table's b=1 / b=64 points are at 1k a sequence.

Sources (as cited in loadtest/engine/profiles.py): NVIDIA datasheets for A100 80GB SXM,
H100 SXM, H200 SXM and HGX B200 (HBM size and bandwidth, dense BF16 FLOP/s); calibration
on TensorRT-LLM's H100-vs-A100 figures (nvidia.github.io/TensorRT-LLM/blogs/H100vsA100.html)
and the vLLM v0.6.0 performance update (blog.vllm.ai/2024/09/05/perf-update.html); batch
defaults from vLLM's vllm/engine/arg_utils.py (get_batch_defaults); prices are the upper end
of 2026 specialty-cloud on-demand list prices per GPU-hour (mercatus-ai.com/blog/
cloud-gpu-pricing; packet.ai/blog/gpu-pricing-models-compared); hyperscaler on-demand is
2-4x these. "unknown" is pessimistic on both axes (A100 speed, H100 price) so that a
known GPU wins a tie; the per-endpoint TTFT calibration corrects the speed once traffic flows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

__all__ = ["GPUS", "UNKNOWN", "GpuProfile", "GpuTable", "normalise_gpu_name"]


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """What one GPU of a generation does for the reference 8B model (Llama-3-8B, BF16)."""

    name: str
    prefill_tokens_per_s: float
    decode_step_s_b1: float  # one decode iteration, batch 1, context 1k
    decode_step_s_b64: float  # one decode iteration, batch 64, context 1k
    kv_tokens: int  # KV capacity for the reference model at gpu_memory_utilization 0.9
    max_num_batched_tokens: int  # vLLM's per-step token budget default
    max_num_seqs: int
    price_per_gpu_hour: float
    # Seconds per context token one decode step streams from HBM (the reference model's
    # 128 KiB of KV per token at the GPU's effective bandwidth): the part of the step that
    # grows with the context the batch holds.
    kv_read_s_per_token: float = 8.57e-8
    # KV bytes one token occupies (K and V, every layer), what a prefill/decode KV transfer
    # moves: the reference model's 2 x 32 layers x 8 KV heads x 128 x 2 bytes (bf16).
    kv_bytes_per_token: int = 131_072
    # Prefill's attention: each (query token, key token) pair a prefill multiplies costs
    # this many tokens' worth of the linear layers' compute (4 x layers x hidden FLOPs a
    # pair against 2 x parameters a token: the reference model's 4 x 32 x 4096 / (2 x
    # 8.03e9)), so a prompt's prefill is prefill_work(...) / prefill_tokens_per_s: 2,048
    # tokens at 0.97 of the table's speed, 12,672 at 0.83, 50,000 at 0.55 (the simulator's
    # roofline, loadtest/engine/profiles.py, which tests/test_picker.py checks it against).
    attn_pair_tokens: float = 3.27e-5

    @property
    def price_per_s(self) -> float:
        return self.price_per_gpu_hour / 3600.0

    def prefill_work(self, uncached: float, cached: float = 0.0) -> float:
        """Prefill of `uncached` tokens after `cached` ones, in tokens of the linear
        layers' work: each new token attends to every token before it and itself."""
        return uncached * (1.0 + self.attn_pair_tokens * (cached + 0.5 * (uncached + 1.0)))

    def decode_step_s(self, batch: int) -> float:
        """One decode iteration at `batch` sequences: linear between the b=1 and b=64 points
        (the step is memory bound: weights once, plus every sequence's KV)."""
        slope = (self.decode_step_s_b64 - self.decode_step_s_b1) / 63.0
        return self.decode_step_s_b1 + slope * ((batch if batch > 1 else 1) - 1)

    def decode_step_parts(self) -> tuple[float, float, float]:
        """The step as base + per_seq x batch + kv x context tokens held by the batch:
        (base, per_seq, kv), the table's points (context 1k a sequence) split by the KV
        read, so that a batch of long prompts costs what it streams."""
        kv = self.kv_read_s_per_token
        per_seq = max(0.0, (self.decode_step_s_b64 - self.decode_step_s_b1) / 63.0 - 1000.0 * kv)
        base = self.decode_step_s_b1 - per_seq - 1000.0 * kv
        return base, per_seq, kv


GPUS: dict[str, GpuProfile] = {
    "A100": GpuProfile("A100", 8_742.0, 0.01159, 0.01744, 442_704, 2048, 256, 1.30, 8.57e-8),
    "H100": GpuProfile("H100", 27_712.0, 0.00745, 0.01113, 440_112, 8192, 1024, 3.00, 5.22e-8),
    "H200": GpuProfile("H200", 27_712.0, 0.00550, 0.00817, 888_032, 8192, 1024, 4.00, 3.64e-8),
    "B200": GpuProfile("B200", 63_045.0, 0.00370, 0.00543, 1_173_072, 8192, 1024, 5.50, 2.18e-8),
}
UNKNOWN = replace(GPUS["A100"], name="unknown", price_per_gpu_hour=3.00)

# Longest first where one name contains another (GH200 is Hopper with HBM3e: H200-like).
_KNOWN_ORDER = ("B200", "H200", "H100", "A100")
_FIELD_NAMES = frozenset(f.name for f in fields(GpuProfile)) - {"name"}


# normalise_gpu_name's answers by the name given: a request's accounting asks it for the
# same few names (each attempt's GPU, ~4 times a request). Names come from the config and
# the engines' reports, so few; past this many, new ones are computed each time.
MAX_NORMALISED_NAMES = 256
_normalised: dict[str, str] = {}


def normalise_gpu_name(name: str | None) -> str:
    """The table key for a GPU name as NVML or a config spells it ("NVIDIA H100 80GB HBM3",
    "a100-sxm4-80gb", "H200"), else the name upper-cased (looked up as given, then unknown)."""
    if not name:
        return "unknown"
    key = _normalised.get(name)
    if key is not None:
        return key
    key = _normalise(name)
    if len(_normalised) < MAX_NORMALISED_NAMES and type(name) is str:
        _normalised[name] = key
    return key


def _normalise(name: str) -> str:
    upper = name.upper()
    for key in _KNOWN_ORDER:
        if key in upper:
            return key
    return upper.removeprefix("NVIDIA ").strip()


class GpuTable:
    """The GPU profiles in use: the defaults above, with per-name field overrides.

    `overrides` maps a GPU name to fields to replace, e.g. {"H100": {"price_per_gpu_hour":
    2.2}}; a name not in the table starts from "unknown" (so {"L40S": {...}} adds one).
    Raises ValueError for an unknown field or a non-positive number.
    """

    def __init__(self, overrides: Mapping[str, Mapping[str, float]] | None = None) -> None:
        table = dict(GPUS)
        table["unknown"] = UNKNOWN
        for raw_name, changes in (overrides or {}).items():
            bad = set(changes) - _FIELD_NAMES
            if bad:
                raise ValueError(f"gpu {raw_name!r}: unknown field(s) {sorted(bad)}")
            for key, value in changes.items():
                if not value > 0:
                    raise ValueError(f"gpu {raw_name!r}: {key} must be > 0, got {value!r}")
            key = normalise_gpu_name(raw_name) if raw_name != "unknown" else "unknown"
            base = table.get(key, UNKNOWN)
            ints = {"kv_tokens", "max_num_batched_tokens", "max_num_seqs", "kv_bytes_per_token"}
            typed = {k: (int(v) if k in ints else float(v)) for k, v in changes.items()}
            table[key] = replace(base, name=key, **typed)  # type: ignore[arg-type]
        self._table = table

    def get(self, name: str | None) -> GpuProfile:
        return self._table.get(normalise_gpu_name(name), self._table["unknown"])

    def names(self) -> list[str]:
        return list(self._table)
