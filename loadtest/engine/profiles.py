"""Per-GPU performance profiles for the engine simulator's timing model.

A profile is derived, not picked: datasheet numbers of a GPU (HBM size and bandwidth,
dense BF16 tensor FLOP/s) and the shape of a model (parameters, layers, KV heads) go
through a roofline model with two efficiency factors calibrated on published runs.

Step time of one continuous-batching iteration (the engine's only timing primitive)::

    t = overhead + per_seq * num_seqs + max(compute, memory)
    compute = tokens / prefill_tokens_per_s + attn_pairs * attn_s_per_pair
    memory  = weight_read_s + kv_tokens_read * kv_read_s_per_token

`tokens` counts every token the step computes (one per decoding sequence, a chunk per
prefilling one), `attn_pairs` the (query token, key token) pairs attention multiplies,
`kv_tokens_read` the context tokens whose KV the step streams from HBM. A decode step is
memory bound (weights plus every sequence's KV are read once per step), so it grows with
batch size and context length; a prefill chunk is compute bound.

Derived numbers for Llama-3-8B in BF16 (8.03e9 params, 32 layers, 8 KV heads x 128, so
128 KiB of KV per token and 2 MiB per 16-token block; gpu_memory_utilization 0.9,
3 GiB reserved for activations and CUDA graphs)::

    GPU   HBM      BW      BF16 dense  prefill   decode b=1  decode b=64  KV blocks  $/GPU-h
                   TB/s    TFLOP/s     tok/s     ctx 1k, ms  ctx 1k, ms   (16 tok)
    A100  80 GB    2.039     312        8,742      11.6        17.3       27,669     1.30
    H100  80 GB    3.35      989       27,712       7.5        11.1       27,507     3.00
    H200  141 GB   4.8       989       27,712       5.5         8.1       55,502     4.00
    B200  180 GB   8.0     2,250       63,045       3.7         5.4       73,317     5.50

Sources:
- Datasheets: NVIDIA A100 (80 GB SXM: 2,039 GB/s, 312 TFLOP/s BF16 dense), H100 SXM
  (3.35 TB/s, 989 TFLOP/s), H200 SXM (141 GB, 4.8 TB/s, same Hopper compute as H100),
  DGX/HGX B200 (180 GB per GPU, 8 TB/s, 72 PFLOP/s FP8 sparse per 8 GPUs, so 2.25 PFLOP/s
  BF16 dense per GPU). Total memory per GPU as nvidia-smi reports it (MiB below).
- Calibration, memory efficiency 0.75 and compute efficiency 0.45: TensorRT-LLM's
  "H100 has 4.6x A100 performance" (nvidia.github.io/TensorRT-LLM/blogs/H100vsA100.html):
  GPT-J 6B FP16 on A100 SXM 80GB, batch 1 -> 111 output tok/s (9.0 ms per token; the
  model above gives 9.0 ms for 12.1 GB of weights) and 12.5 ms to first token for a
  128-token prompt (the model gives 12.1 ms); batch 64 at 128/128 -> 3,679 tok/s
  (the model gives ~4,950 for pure decode at context 192; it leaves out the prefills).
- vLLM v0.6.0 performance update (blog.vllm.ai/2024/09/05/perf-update.html): Llama 3 8B
  on one H100 is CPU-overhead sensitive once the GPU part is a few ms, hence the fixed
  per-step overhead of 1 ms and a small per-sequence cost.
- Batch defaults: vllm/engine/arg_utils.py (get_batch_defaults): GPUs with >= 70 GiB
  other than A100 default to max_num_batched_tokens 8192 and max_num_seqs 1024 for the
  API server; A100 to 2048 and 256.
- Prices, on-demand per GPU-hour, specialty-cloud tier (2026): A100 80GB $1.10-1.50,
  H100 SXM $2.50-3.50, H200 SXM $3.50-4.50 (mercatus-ai.com/blog/cloud-gpu-pricing);
  B200 $3.75-5.60 on specialty clouds and up to $14.24 on AWS
  (packet.ai/blog/gpu-pricing-models-compared). Hyperscaler on-demand is 2-4x these
  (AWS p5.48xlarge $98.32/h for 8 H100). We take the upper end of the specialty range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

MIB = 1024 * 1024

# vLLM's default --gpu-memory-utilization.
GPU_MEMORY_UTILIZATION = 0.9
# Activations for a max_num_batched_tokens forward pass plus CUDA graph pools.
ACTIVATION_RESERVE_BYTES = 3 * 1024 * MIB
# Calibrated on the TensorRT-LLM A100 figures in the module docstring.
MEMORY_EFFICIENCY = 0.75
COMPUTE_EFFICIENCY = 0.45
# Scheduler, launch and sampling costs that do not scale with the model.
STEP_OVERHEAD_S = 0.001
PER_SEQ_OVERHEAD_S = 5e-6


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Datasheet numbers for one GPU model."""

    name: str
    memory_mib: int
    bandwidth_bytes_per_s: float
    bf16_dense_flops: float
    price_per_gpu_hour: float
    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a dense decoder-only model, enough for a roofline."""

    name: str
    params: float
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attn_flops_per_pair(self) -> float:
        # QK^T and AV, a multiply-add each, over every query head of every layer.
        return 4.0 * self.num_layers * self.hidden_size


GPUS: dict[str, GpuSpec] = {
    "A100": GpuSpec("A100", 81_920, 2.039e12, 312e12, 1.30, 2048, 256),
    "H100": GpuSpec("H100", 81_559, 3.35e12, 989e12, 3.00, 8192, 1024),
    "H200": GpuSpec("H200", 143_771, 4.8e12, 989e12, 4.00, 8192, 1024),
    "B200": GpuSpec("B200", 183_359, 8.0e12, 2250e12, 5.50, 8192, 1024),
}

LLAMA_3_8B = ModelSpec(
    name="meta-llama/Llama-3.1-8B-Instruct",
    params=8.03e9,
    num_layers=32,
    hidden_size=4096,
    num_kv_heads=8,
    head_dim=128,
)


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """What the timing model needs: derived from a GpuSpec and a ModelSpec."""

    gpu: str
    model: str
    prefill_tokens_per_s: float
    attn_s_per_pair: float
    weight_read_s: float
    kv_read_s_per_token: float
    step_overhead_s: float
    per_seq_overhead_s: float
    kv_blocks: int
    block_size: int
    price_per_gpu_hour: float
    max_num_batched_tokens: int
    max_num_seqs: int
    # KV bytes one token occupies (K and V, every layer): what a KV transfer moves.
    kv_bytes_per_token: int = LLAMA_3_8B.kv_bytes_per_token

    def step_time(
        self, num_seqs: int, tokens: int, attn_pairs: float, kv_tokens_read: int
    ) -> float:
        """Seconds one iteration takes on this GPU (see the module docstring)."""
        compute = tokens / self.prefill_tokens_per_s + attn_pairs * self.attn_s_per_pair
        memory = self.weight_read_s + kv_tokens_read * self.kv_read_s_per_token
        return (
            self.step_overhead_s
            + self.per_seq_overhead_s * num_seqs
            + (compute if compute > memory else memory)
        )

    def decode_step_time(self, batch: int, context: int) -> float:
        """One decode iteration for `batch` sequences of `context` tokens each."""
        return self.step_time(batch, batch, batch * context, batch * context)

    def prefill_time(self, prompt_tokens: int) -> float:
        """One prefill of a whole prompt in a single step (no chunking, no cache)."""
        pairs = prompt_tokens * (prompt_tokens + 1) / 2
        return self.step_time(1, prompt_tokens, pairs, prompt_tokens)


def derive_profile(
    gpu: GpuSpec,
    model: ModelSpec = LLAMA_3_8B,
    *,
    block_size: int = 16,
    kv_blocks: int | None = None,
) -> EngineProfile:
    flops = gpu.bf16_dense_flops * COMPUTE_EFFICIENCY
    bandwidth = gpu.bandwidth_bytes_per_s * MEMORY_EFFICIENCY
    kv_budget = (
        gpu.memory_mib * MIB * GPU_MEMORY_UTILIZATION
        - model.weight_bytes
        - ACTIVATION_RESERVE_BYTES
    )
    blocks = math.floor(kv_budget / (model.kv_bytes_per_token * block_size))
    return EngineProfile(
        gpu=gpu.name,
        model=model.name,
        prefill_tokens_per_s=flops / (2.0 * model.params),
        attn_s_per_pair=model.attn_flops_per_pair / flops,
        weight_read_s=model.weight_bytes / bandwidth,
        kv_read_s_per_token=model.kv_bytes_per_token / bandwidth,
        step_overhead_s=STEP_OVERHEAD_S,
        per_seq_overhead_s=PER_SEQ_OVERHEAD_S,
        kv_blocks=kv_blocks if kv_blocks is not None else max(1, blocks),
        block_size=block_size,
        price_per_gpu_hour=gpu.price_per_gpu_hour,
        max_num_batched_tokens=gpu.max_num_batched_tokens,
        max_num_seqs=gpu.max_num_seqs,
        kv_bytes_per_token=model.kv_bytes_per_token,
    )


def get_profile(
    gpu: str, *, block_size: int = 16, kv_blocks: int | None = None, model: str | None = None
) -> EngineProfile:
    """The profile for a GPU name (case-insensitive: a100, H100, h200, B200)."""
    try:
        spec = GPUS[gpu.upper()]
    except KeyError:
        raise ValueError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}") from None
    profile = derive_profile(spec, block_size=block_size, kv_blocks=kv_blocks)
    return profile if model is None else replace(profile, model=model)
