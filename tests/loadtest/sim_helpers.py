"""Helpers for the engine simulator tests: a fake-clock core and request builder."""

from __future__ import annotations

from collections.abc import Sequence

from loadtest.engine.core import CoreConfig, EngineCore, SimRequest
from loadtest.engine.profiles import get_profile
from loadtest.engine.tokenizer import TokenGenerator, WordTokenizer

# Fast enough that a test's simulated seconds pass in milliseconds of wall time.
FAST = 200.0


def make_core(
    gpu: str = "H100",
    *,
    kv_blocks: int | None = None,
    block_size: int = 16,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    max_model_len: int = 8192,
    caching: bool = True,
    eos_rate: float = 0.0,
) -> EngineCore:
    profile = get_profile(gpu, block_size=block_size, kv_blocks=kv_blocks)
    return EngineCore(
        CoreConfig(
            profile=profile,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=caching,
        ),
        TokenGenerator(WordTokenizer(), eos_rate),
    )


def request(
    rid: str, prompt: Sequence[int], max_tokens: int = 8, *, seed: int = 0, **kw: object
) -> SimRequest:
    return SimRequest(rid, list(prompt), max_tokens, seed=seed, **kw)  # type: ignore[arg-type]
