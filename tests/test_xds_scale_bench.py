"""loadtest/xds_scale_bench.py in miniature: real processes (control planes, publishers,
thin subscribers) measure what they say, with one and two shards, and the report and the
JSON carry every figure and a verdict per target."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from typing import Any

from loadtest import xds_scale_bench as bench
from loadtest.xds_scale_bench import Scenario, run_scenario
from meshd.shards import shard_for
from xds.resources import PrefixDigest, decode_endpoint_state, decode_prefix_digest

TINY: dict[str, Any] = {
    "engines": 24,
    "rate": 5.0,
    "duration_s": 1.0,
    "per_message": 4,
    "per_process": 1,
}


def test_a_stamped_body_is_the_engine_state_with_its_publish_time() -> None:
    bodies = bench.StampedBodies(7)
    for n, us in ((0, 123_456_789_012), (5, 1)):
        state = decode_endpoint_state(bodies.body(n, us))
        assert state.tokens_in_flight == us and state.address == "10.0.0.7:8000"
        assert bench._STAMP.findall(bodies.body(n, us)) == [us.to_bytes(8, "big")]


def test_a_digest_body_is_what_prefix_digest_encodes() -> None:
    from array import array

    body = bench.digest_body(3, 500)
    d = decode_prefix_digest(body)
    hashes = array("Q")
    hashes.frombytes(random.Random(3).randbytes(8 * 500))
    assert d.added == tuple(hashes) and len(set(d.added)) == 500
    assert body == PrefixDigest(bench.engine_name(3), f"{3:08x}", 1, 1, True, 16, d.added).encode()


def test_nodes_carry_per_message_engines_of_one_shard() -> None:
    shards = [("cp-0:1",), ("cp-1:1",)]
    nodes = bench.plan_nodes(50, shards, 8)
    assert sorted(i for _, node in nodes for i in node) == list(range(50))
    for k, node in nodes:
        assert 1 <= len(node) <= 8
        assert all(shard_for(bench.engine_name(i), shards) == shards[k] for i in node)


def test_a_tiny_run_measures_every_update() -> None:
    delta = run_scenario(Scenario("delta x2", "delta", 2), digest_blocks=64, **TINY)
    sotw = run_scenario(Scenario("sotw x1", "sotw", 1), **TINY)
    two = run_scenario(Scenario("delta x2 2sh", "delta", 2, 2), **TINY)
    for r in (delta, sotw, two):
        assert 0.8 <= r.publish_share <= 1.2  # 24 engines (a shard) x 5/s, a second
        assert r.seen_share > 0.9 and 0 < r.p50_ms <= r.p99_ms <= r.max_ms < 1000
        assert all(s.rss_mib > 10 and s.updates_per_message <= 4 for s in r.per_shard)
        assert r.cp_cpu_share > 0 and r.sub_cpu_share > 0 and r.pub_cpu_share > 0
    assert len(two.per_shard) == 2 and two.engines == 48
    assert 1.6 <= two.published_per_s / delta.published_per_s <= 2.2
    # Every SotW response carries all 24 engines; delta only what changed.
    assert sotw.bytes_per_s > 5 * delta.bytes_per_s

    results = [delta, sotw, two]
    text = bench.report(results, engines=24, rate=5.0, per_message=4, digest_blocks=64)
    assert "ratios against delta x2" in text and "fewer bytes than state-of-the-world" in text
    verdicts = re.findall(r"^(PASS|FAIL|INVALID) ", text, re.M)
    assert len(verdicts) == 5  # p99, CP cores, publishers, RSS, shards (no delta x1 here)
    doc = json.loads(json.dumps(bench.document(results, {"per_message": 4, "digest_blocks": 64})))
    assert [s["name"] for s in doc["scenarios"]] == ["delta x2", "sotw x1", "delta x2 2sh"]
    scenario = doc["scenarios"][2]
    for key in ("valid", "p99_ms", "cp_us_per_update", "bytes_per_s", "machine_busy_share"):
        assert key in scenario
    assert {"us_per_update", "updates_per_message", "digests_rss_mib"} <= set(
        scenario["per_shard"][0]
    )
    assert "fanout_us_per_push_per_subscriber" in doc["unit_costs"]
    # Every key the JSON carries is listed in the bench's docstring.
    doc_keys = {*scenario, *scenario["per_shard"][0], *doc["unit_costs"], *doc["checks"][0]}
    assert bench.__doc__ is not None
    assert not {k for k in doc_keys if k not in bench.__doc__}
    assert {c["verdict"] for c in doc["checks"]} <= {"PASS", "FAIL", "INVALID"}

    # Publishers that fell short make their scenario's figures no result.
    short = dataclasses.replace(delta, published=delta.published // 2)
    assert not short.valid
    text = bench.report([short, sotw], engines=24, rate=5.0)
    assert "INVALID (publishers short)" in text
    assert re.search(r"^INVALID .*p99 update-to-subscriber.*publishers reached", text, re.M)


def test_publishers_can_take_the_frames_port() -> None:
    r = run_scenario(
        Scenario("delta x1 2sh", "delta", 1, 2), digest_blocks=64, transport="frames", **TINY
    )
    assert 0.8 <= r.publish_share <= 1.2 and r.seen_share > 0.9
    assert all(s.updates_per_message <= 4 and s.us_per_update > 0 for s in r.per_shard)


def test_subscribers_can_take_the_frames_port() -> None:
    # Two subscribers a shard, each following both shards over their frames ports.
    r = run_scenario(
        Scenario("delta x2 2sh", "delta", 2, 2),
        digest_blocks=64,
        subscriber_transport="frames",
        **TINY,
    )
    assert 0.8 <= r.publish_share <= 1.2 and r.seen_share > 0.9
    assert r.responses_per_s > 0 and r.bytes_per_s > 0
    assert all(s.acks > 0 and s.responses >= s.acks for s in r.per_shard)
