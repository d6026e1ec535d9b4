"""The peers' cache-aware rule (filters/cache_aware.py) and its router: a long match sticks,
a cold prompt goes to the smallest tree, an imbalanced pool goes by shortest queue, the
tree's LRU stays prefix-closed, and a resting endpoint is never the primary."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filters.cache_aware import CacheAwareBalancer, CacheAwareConfig
from filters.hotpath import block_hashes
from filters.picker import PickRequest
from filters.pool_router import EndpointSpec, make_router

EPS = ["a", "b", "c"]


def chain(*ids: int) -> list[int]:
    """Chained hashes of block ids (a prefix names its whole past)."""
    out, h = [], 0
    for i in ids:
        h = hash((h, i))
        out.append(h)
    return out


IDLE = dict.fromkeys(EPS, 0)


def test_a_long_match_sticks_and_a_cold_prompt_goes_to_the_smallest_tree():
    b = CacheAwareBalancer(EPS)
    first = b.choose(chain(1, 2, 3, 4), IDLE)
    assert first == "a"  # every tree empty: the first in order
    assert b.choose(chain(1, 2, 3, 4, 5), IDLE) == "a"  # 4/5 matched > 0.3
    assert b.choose(chain(9, 8, 7), IDLE) == "b"  # cold: the smallest tree
    assert b.choose(chain(1, 6, 6, 6, 6), IDLE) != "a"  # 1/5 matched < 0.3: cold again
    assert b.tree_blocks("a") == 5
    assert b.choose(chain(1, 2, 3), {"b": 0, "c": 0}) in ("b", "c")  # a is not a candidate
    with pytest.raises(ValueError):
        b.choose(chain(1), {})


def test_an_imbalanced_pool_goes_by_shortest_queue():
    b = CacheAwareBalancer(
        EPS, CacheAwareConfig(balance_abs_threshold=4, balance_rel_threshold=1.5)
    )
    assert b.choose(chain(1, 2, 3), IDLE) == "a"
    # a: 6 outstanding, c: 0 -> imbalanced: the shortest queue, whatever the cache says.
    assert b.choose(chain(1, 2, 3, 9), {"a": 6, "b": 1, "c": 0}) == "c"
    # Within the thresholds the cache decides.
    assert b.choose(chain(1, 2, 3, 4), {"a": 4, "b": 1, "c": 0}) == "a"


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=8), min_size=1, max_size=30),
    cap=st.integers(1, 20),
)
def test_match_is_the_longest_prefix_held(prompts, cap):
    b = CacheAwareBalancer(["e"], CacheAwareConfig(max_tree_blocks=cap))
    for p in prompts:
        b.record("e", chain(*p))
        held = set(b._trees["e"])  # the invariant itself
        assert len(held) <= cap
        for q in prompts:
            hashes = chain(*q)
            brute = 0
            while brute < len(hashes) and hashes[brute] in held:
                brute += 1
            assert b.match("e", hashes) == brute


def test_config_is_validated():
    with pytest.raises(ValueError):
        CacheAwareConfig(cache_threshold=1.5)
    with pytest.raises(ValueError):
        CacheAwareConfig(balance_rel_threshold=0.5)
    with pytest.raises(ValueError):
        CacheAwareConfig(max_tree_blocks=0)
    with pytest.raises(ValueError):
        CacheAwareBalancer([])


def _req(text: str) -> PickRequest:
    return PickRequest("m", block_hashes(text, "m"), prompt_tokens=len(text) // 4)


def test_router_sticks_counts_and_skips_a_resting_endpoint():
    urls = [f"http://e{i}" for i in range(3)]
    router = make_router("cache-aware", [EndpointSpec(u) for u in urls], unhealthy_after=1)
    assert router.policy == "cache-aware"
    doc = "A long shared document. " * 100
    r = _req(doc)
    routes = router.order(r, 0.0)
    assert routes[0].reason == "cache-aware" and len(routes) == 3
    router.started(routes[0], 1, r, 0.0)
    router.finished(routes[0], 1, r, 0.0, ok=True)
    again = router.order(_req(doc + " and a question"), 1.0)[0]
    assert again.url == routes[0].url
    # That endpoint fails to connect: it rests, and the next pick goes elsewhere.
    router.started(again, 2, r, 1.0)
    router.connect_failed(again, 2, 1.0, "refused")
    nxt = router.order(_req(doc + " and another"), 2.0)
    assert nxt[0].url != again.url and nxt[-1].url == again.url
