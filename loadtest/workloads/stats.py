"""Workload summaries for the benchmark report, and cache hit-rate bounds from block ids.

The bounds count blocks, as the traces' README does: the share of all prompt blocks that
repeat a block seen earlier, by one infinite cache or by N infinite caches fed round robin.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from loadtest.workloads.request import PlannedRequest

DEFAULT_REPLICAS = (4, 8, 16)


def round_robin_bound(requests: Sequence[PlannedRequest], n: int) -> float:
    """Hit-rate bound when request i goes to replica i mod n, each with an infinite cache.

    Requests are taken in list order (sorted by at_s for every list this package makes).
    A block hits if its replica has seen the same block id before, in an earlier request.
    Returns 0.0 for no blocks.
    """
    if n < 1:
        raise ValueError(f"replicas must be >= 1, got {n}")
    seen: list[set[int]] = [set() for _ in range(n)]
    total = hits = 0
    for i, r in enumerate(requests):
        cache = seen[i % n]
        total += len(r.block_ids)
        hits += sum(1 for b in r.block_ids if b in cache)
        cache.update(r.block_ids)
    return hits / total if total else 0.0


def upper_bound_hit_rate(requests: Sequence[PlannedRequest]) -> float:
    """Share of blocks that repeat an earlier block: the bound for one infinite cache."""
    return round_robin_bound(requests, 1)


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {
        "mean": sum(values) / len(values) if values else 0.0,
        "p50": quantile(values, 0.50),
        "p99": quantile(values, 0.99),
        "max": max(values, default=0.0),
    }


def context_tokens_estimate(requests: Sequence[PlannedRequest]) -> list[int]:
    """Tokens each request will send, if every earlier answer in its chain used max_tokens.

    Independent requests send prompt_tokens; a dependent step sends its predecessor's
    context + the predecessor's answer + its own prompt_tokens.
    """
    last: dict[str, int] = {}
    out: list[int] = []
    previous_answer: dict[str, int] = {}
    for r in requests:
        n = r.prompt_tokens
        chain = r.chain_id
        if r.depends_on_previous and chain is not None:
            n += last.get(chain, 0) + previous_answer.get(chain, 0)
        if chain is not None:
            last[chain] = n
            previous_answer[chain] = r.max_tokens
        out.append(n)
    return out


def describe(
    requests: Sequence[PlannedRequest], replicas: Sequence[int] = DEFAULT_REPLICAS
) -> dict[str, object]:
    """A JSON-ready summary of a workload for the report.

    Keys: requests, duration_s (last at_s), rate_rps, kinds, workloads and tenants (request
    counts), chains, dependent_requests, prompt_tokens / context_tokens_est / max_tokens
    (each mean, p50, p99, max), blocks, upper_bound_hit_rate and round_robin_bound
    ({str(n): bound}).
    """
    duration = max((r.at_s for r in requests), default=0.0)
    return {
        "requests": len(requests),
        "duration_s": duration,
        "rate_rps": len(requests) / duration if duration > 0 else 0.0,
        "kinds": dict(Counter(r.kind for r in requests)),
        "workloads": dict(Counter(r.workload for r in requests)),
        "tenants": dict(Counter(r.tenant for r in requests)),
        "chains": len({r.chain_id for r in requests if r.chain_id is not None}),
        "dependent_requests": sum(1 for r in requests if r.depends_on_previous),
        "prompt_tokens": _spread([r.prompt_tokens for r in requests]),
        "context_tokens_est": _spread(context_tokens_estimate(requests)),
        "max_tokens": _spread([r.max_tokens for r in requests]),
        "blocks": sum(len(r.block_ids) for r in requests),
        "upper_bound_hit_rate": upper_bound_hit_rate(requests),
        "round_robin_bound": {str(n): round_robin_bound(requests, n) for n in replicas},
    }
