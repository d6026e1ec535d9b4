"""The cache-aware balancer of sglang-router and vllm-router (`--policy cache_aware`),
rebuilt on meshd's chained block hashes: the peers' rule, as a baseline meshd is measured
against on the virtual clock (where the peers' own processes cannot run) and as a policy a
user may pick (`routing.policy: cache-aware`).

The rule (sglang-router's `policies/cache_aware.rs`, documented in its README and the
router's `--help`; vllm-router copies it):

1. The pool is *imbalanced* when max - min outstanding requests > `balance_abs_threshold`
   and max > `balance_rel_threshold` x min. Then the request goes to the endpoint with
   the fewest outstanding requests (shortest queue), and is still recorded in the tree.
2. Otherwise the prompt is matched against each endpoint's approximate tree (what was
   routed there). When the best match covers more than `cache_threshold` of the prompt,
   the endpoint with the longest match wins; else the endpoint whose tree is smallest
   (the most free cache, by this account).
3. The prompt is recorded in the winner's tree. A tree holds at most `max_tree_blocks`
   blocks; the least recently used go first (the peers prune every 60 s to a size limit;
   pruning as we go keeps the same bound without a timer).

Sans-I/O and O(blocks) per request: a block chain hash names its whole prefix, so an
endpoint's "tree" is the set of chain hashes routed there, and its match is the longest
prefix of the request's chain found in that set (a binary search: chains are prefix-
closed in the set because a prompt's every prefix is inserted with it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["CacheAwareBalancer", "CacheAwareConfig"]


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """The peers' defaults (sglang-router 0.3.2, `launch_router --help`)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    # sglang's max_tree_size is 2**26 characters: at meshd's 64-byte blocks, 2**20 blocks.
    max_tree_blocks: int = 1 << 20

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0, balance_rel_threshold >= 1")
        if self.max_tree_blocks < 1:
            raise ValueError("max_tree_blocks must be >= 1")


class CacheAwareBalancer:
    """Chooses one endpoint per request by the peers' cache-aware rule (module docstring);
    the driver says each candidate's outstanding requests."""

    def __init__(self, endpoints: Sequence[str], config: CacheAwareConfig | None = None) -> None:
        if not endpoints:
            raise ValueError("a pool needs at least one endpoint")
        self.config = config or CacheAwareConfig()
        self.endpoints = list(endpoints)
        self._trees: dict[str, OrderedDict[int, None]] = {e: OrderedDict() for e in self.endpoints}

    def match(self, endpoint: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the endpoint's tree holds."""
        tree = self._trees[endpoint]
        lo, hi = 0, len(hashes)
        while lo < hi:  # the largest k with hashes[k - 1] in tree
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in tree:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def choose(self, hashes: Sequence[int], loads: Mapping[str, int]) -> str:
        """The endpoint for a request with these block hashes among the candidates `loads`
        names (with their outstanding requests; ties go to the first); it is recorded."""
        c = self.config
        names = list(loads)
        if not names:
            raise ValueError("no candidate endpoint")
        lo = min(loads[e] for e in names)
        hi = max(loads[e] for e in names)
        if hi - lo > c.balance_abs_threshold and hi > c.balance_rel_threshold * lo:
            pick = min(names, key=lambda e: loads[e])
        else:
            best, best_n = names[0], -1
            for e in names:
                n = self.match(e, hashes) if hashes else 0
                if n > best_n:
                    best, best_n = e, n
            if hashes and best_n / len(hashes) > c.cache_threshold:
                pick = best
            else:
                pick = min(names, key=lambda e: len(self._trees[e]))
        self.record(pick, hashes)
        return pick

    def record(self, endpoint: str, hashes: Sequence[int]) -> None:
        """Note `hashes` as routed to `endpoint`. Deepest first, so the prefix is the most
        recently used and eviction takes leaves first, as in a radix tree: the set stays
        prefix-closed, which `match`'s binary search needs."""
        tree = self._trees[endpoint]
        for h in reversed(hashes):
            if h in tree:
                tree.move_to_end(h)
            else:
                tree[h] = None
        while len(tree) > self.config.max_tree_blocks:
            tree.popitem(last=False)

    def tree_blocks(self, endpoint: str) -> int:
        return len(self._trees[endpoint])
