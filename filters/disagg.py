"""Prefill/decode disaggregation, the sans-I/O part: whether a request is worth splitting
(the decider), and the bodies of vLLM's disaggregated-serving protocol.

The protocol is vLLM's with the NIXL connector, as vLLM's own proxy speaks it
(vllm-project/vllm tests/v1/kv_connector/nixl_integration/toy_proxy_server.py):
1. the prefill step goes to a prefill engine: the client's request with
   `kv_transfer_params: {do_remote_decode: true, do_remote_prefill: false, remote_*: null}`,
   `stream: false`, `max_tokens: 1` (and `max_completion_tokens: 1` when set), without
   `stream_options`, `min_tokens` and `min_completion_tokens`; the engine prefills, keeps
   the KV and answers with the `kv_transfer_params` the decode side needs (remote engine
   id, block ids, host, port);
2. the decode step goes to a decode engine: the client's request as it came plus those
   `kv_transfer_params`; the engine pulls the KV and generates, streamed to the client as
   the one answer.
Both legs carry the same `X-Request-Id`.

The decider (llm-d's prefix-based pd-decider, in tokens): a request is split when the part
of its prompt the prefill pool does not hold in cache is at least `min_prefill_tokens`; a
shorter prefill is cheaper done where the decode runs than shipped as KV. The KV transfer
it pays is the whole prompt's KV over the link: tokens x bytes per token / bandwidth.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KV_PARAMS",
    "Split",
    "aggregated_body",
    "decide_split",
    "decode_body",
    "prefill_body",
    "transfer_params",
]

KV_PARAMS = "kv_transfer_params"
_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True, slots=True)
class Split:
    """The decider's answer: split or not, why, and the transfer it would cost."""

    split: bool
    reason: str  # split | short-prefill | no-prefill-engine
    uncached_tokens: int
    transfer_s: float


def decide_split(
    prompt_tokens: int,
    cached_tokens: float | None,
    *,
    min_prefill_tokens: int,
    kv_bytes_per_token: int,
    kv_link_gb_per_s: float,
    prefill_available: bool = True,
) -> Split:
    """Split a request of `prompt_tokens` whose best prefill engine holds `cached_tokens` of
    it? (The module's docstring has the rule.)"""
    uncached = max(0, prompt_tokens - int(cached_tokens or 0))
    transfer_s = prompt_tokens * kv_bytes_per_token / (kv_link_gb_per_s * 1e9)
    if not prefill_available:
        return Split(False, "no-prefill-engine", uncached, transfer_s)
    if uncached < min_prefill_tokens:
        return Split(False, "short-prefill", uncached, transfer_s)
    return Split(True, "split", uncached, transfer_s)


def prefill_body(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill step's body for the client's request `doc`."""
    body = copy.deepcopy(dict(doc))
    body[KV_PARAMS] = dict(_PREFILL_PARAMS)
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for name in ("stream_options", "min_tokens", "min_completion_tokens"):
        body.pop(name, None)
    return body


def transfer_params(answer: Any) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a prefill step's answer (a parsed JSON body), or None
    when it has none (the engine does not run a KV connector: no split is possible)."""
    if not isinstance(answer, dict):
        return None
    params = answer.get(KV_PARAMS)
    if not isinstance(params, dict) or not params:
        return None
    return params


def decode_body(doc: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode step's body: the client's request plus the prefill's transfer params."""
    return {**doc, KV_PARAMS: dict(params)}


def aggregated_body(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The request served whole (a decode step that lost its KV, a continuation after a
    mid-stream failover): without any transfer params."""
    return {k: v for k, v in doc.items() if k != KV_PARAMS}
