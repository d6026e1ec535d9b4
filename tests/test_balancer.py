"""EndpointBalancer: least-request order, round-robin ties, passive health."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from filters.balancer import EndpointBalancer


def test_least_outstanding_first_and_ties_rotate():
    b = EndpointBalancer([("a", 1.0), ("b", 1.0), ("c", 1.0)])
    firsts = [b.order(0.0)[0] for _ in range(3)]
    assert sorted(firsts) == ["a", "b", "c"]
    b.on_start("a")
    b.on_start("b")
    assert b.order(0.0)[0] == "c"
    b.on_finish("a")
    assert b.order(0.0)[:2] in (["a", "c"], ["c", "a"])


def test_weight_scales_load():
    b = EndpointBalancer([("big", 4.0), ("small", 1.0)])
    for _ in range(3):
        b.on_start("big")
    assert b.order(0.0)[0] == "small"  # 0/1 < 3/4
    b.on_start("small")
    assert b.order(0.0)[0] == "big"  # 3/4 < 1/1


def test_failing_endpoint_rests_then_returns():
    b = EndpointBalancer([("a", 1.0), ("b", 1.0)], unhealthy_after=2, cooldown_s=10.0)
    b.on_connect_failure("a", 0.0, "refused")
    assert b.load("a").healthy(0.0)
    b.on_connect_failure("a", 1.0, "refused")
    assert not b.load("a").healthy(5.0)
    assert all(b.order(5.0)[0] == "b" for _ in range(4))
    assert b.order(5.0)[-1] == "a"  # still present, last
    b.on_connect_failure("a", 11.5, "refused")  # keeps failing: rest doubles
    assert not b.load("a").healthy(11.5 + 19.0)
    assert b.load("a").healthy(11.5 + 20.0)
    b.on_success("a")
    assert b.load("a").healthy(12.0)


@given(
    st.lists(
        st.tuples(
            st.sampled_from("abcd"), st.sampled_from(["start", "finish", "fail"]), st.floats(0, 100)
        ),
        max_size=60,
    )
)
def test_order_is_always_a_permutation(events):
    b = EndpointBalancer([(u, 1.0) for u in "abcd"])
    outstanding = dict.fromkeys("abcd", 0)
    for url, what, now in events:
        if what == "start":
            b.on_start(url)
            outstanding[url] += 1
        elif what == "finish" and outstanding[url]:
            b.on_finish(url)
            outstanding[url] -= 1
        else:
            b.on_connect_failure(url, now, "x")
        order = b.order(now)
        assert sorted(order) == list("abcd")
        healthy = [u for u in order if b.load(u).healthy(now)]
        assert order[: len(healthy)] == healthy
