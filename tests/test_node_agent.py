"""meshd/node_agent.py: one process for a node's engines, their updates sharing publish
messages; against simulated vLLM engines and a real control plane."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
from pathlib import Path

import pytest

from loadtest.engine import EngineSpec, SimEngine
from meshd.agent import AgentConfig
from meshd.agent_cmd import node_configs, register
from meshd.node_agent import NodeAgent, engine_configs
from xds.client import Backoff, Subscriber
from xds.resources import ENDPOINT_STATE_TYPE, EndpointState
from xds.server import ControlPlane

WAIT_S = 10.0


def node(port: int) -> AgentConfig:
    return AgentConfig(
        name="node",
        engine_url="http://unused",
        address="unused",
        control_planes=(f"127.0.0.1:{port}",),
        interval_s=0.02,
        heartbeat_s=0.5,
        nvml=False,
        backoff=Backoff(base_s=0.02, max_s=0.2),
    )


async def test_a_nodes_engines_share_publish_messages() -> None:
    engines = [SimEngine(EngineSpec(name=f"e{i}", time_scale=50.0)) for i in range(4)]
    for e in engines:
        await e.start()
    plane = ControlPlane()
    await plane.start("127.0.0.1", 0)
    names = [e.spec.name for e in engines]
    configs = engine_configs(
        node(plane.port), [{"name": e.spec.name, "engine": e.url, "pool": "p"} for e in engines]
    )
    sub = Subscriber(
        f"127.0.0.1:{plane.port}",
        {ENDPOINT_STATE_TYPE: names},
        backoff=Backoff(base_s=0.02, max_s=0.2),
        rng=random.Random(1),
    )
    sub.start()
    agent = NodeAgent(configs, window_s=0.01)
    await agent.start()
    try:

        def everyone_healthy() -> bool:
            states = [sub.get(ENDPOINT_STATE_TYPE, n) for n in names]
            return all(isinstance(s, EndpointState) and s.healthy for s in states)

        await asyncio.wait_for(sub.wait_until(everyone_healthy), WAIT_S)
        for e, n in zip(engines, names, strict=True):
            s = sub.get(ENDPOINT_STATE_TYPE, n)
            assert isinstance(s, EndpointState)
            assert s.address == e.url.removeprefix("http://") and s.pool == "p"
        # Four engines' updates, in fewer messages than updates: they shared them.
        stats = agent.stats
        for _ in range(200):  # the link counts once the control plane has answered
            if stats.publishes >= len(names):
                break
            await asyncio.sleep(0.01)
        assert stats.publishes >= len(names)
        assert stats.publish_messages < stats.publishes
    finally:
        await agent.close()
        await sub.close()
        await plane.stop(0)
        for e in engines:
            await e.stop()


async def test_a_lost_link_makes_every_engines_next_digest_full() -> None:
    configs = engine_configs(
        node(1), [{"name": "a", "engine": "http://127.0.0.1:9"}, {"name": "b", "engine": "x"}]
    )
    agent = NodeAgent(configs)
    for a in agent.agents:
        a.tracker.digest(0.0)  # the first (full) digest went out
        assert a.tracker.digest(1.0) is None  # nothing new: nothing to send
    agent.on_link_lost()
    for a in agent.agents:
        d = a.tracker.digest(2.0)
        assert d is not None and d.full


def test_engine_entries_are_checked_and_name_the_mistake() -> None:
    base = node(1)
    with pytest.raises(ValueError, match=r"engines\[1\]\.name: 'a' is listed twice"):
        engine_configs(base, [{"name": "a", "engine": "u"}, {"name": "a", "engine": "v"}])
    with pytest.raises(ValueError, match=r"engines\[0\]\.engine: required"):
        engine_configs(base, [{"name": "a"}])
    with pytest.raises(ValueError, match=r"engines\[0\]\.colour: not an engine key"):
        engine_configs(base, [{"name": "a", "engine": "u", "colour": "red"}])
    with pytest.raises(ValueError, match="empty"):
        engine_configs(base, [])
    [c] = engine_configs(
        base,
        [{"name": "a", "engine": "http://10.0.0.7:8000/", "gpu_memory_gib": 80, "gpu_index": [1]}],
    )
    assert c.address == "10.0.0.7:8000" and c.memory_total_bytes == 80 * 2**30
    assert c.gpu_indices == (1,) and c.control_planes == base.control_planes
    other = dataclasses.replace(c, name="b", control_planes=("elsewhere:1",))
    both = dataclasses.replace(c, name="c", control_planes=(*c.control_planes, "elsewhere:1"))
    n = NodeAgent([c, other, both])  # engines of different shards share what they share
    assert sorted(n.links) == sorted({*c.control_planes, "elsewhere:1"})
    a, b, ab = n.agents
    assert a._links == [n.links[c.control_planes[0]]] and b._links == [n.links["elsewhere:1"]]
    assert ab._links == [n.links[c.control_planes[0]], n.links["elsewhere:1"]]


def test_the_engines_file_on_the_command_line(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    f = tmp_path / "node.yaml"
    f.write_text(
        "- {name: gpu0, engine: 'http://10.0.0.5:8000', pool: chat}\n"
        "- {name: gpu1, engine: 'http://10.0.0.5:8001', pool: chat, gpu: H100}\n"
    )
    args = parser.parse_args(["agent", "--engines", str(f), "--control-plane=cp:18000"])
    a, b = node_configs(args)
    assert (a.name, a.address, b.name, b.gpu) == ("gpu0", "10.0.0.5:8000", "gpu1", "H100")
    assert a.control_planes == b.control_planes == ("cp:18000",)
    f.write_text("- {name: gpu0}\n")
    with pytest.raises(SystemExit, match=r"node.yaml: engines\[0\]\.engine: required"):
        node_configs(parser.parse_args(["agent", "--engines", str(f), "--control-plane=c:1"]))
    with pytest.raises(SystemExit, match="--name is required"):
        from meshd.agent_cmd import config_from_args

        config_from_args(parser.parse_args(["agent", "--control-plane=c:1"]))


def test_each_engine_publishes_to_the_replicas_of_its_own_shard(tmp_path: Path) -> None:
    from meshd.agent_cmd import config_from_args
    from meshd.shards import shard_for

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    shards = ["cp-0a:15010,cp-0b:15010", "cp-1a:15010,cp-1b:15010", "cp-2a:15010"]
    flags = [f"--shard={s}" for s in shards]
    f = tmp_path / "node.yaml"
    f.write_text("".join(f"- {{name: gpu{i}, engine: 'http://h:{8000 + i}'}}\n" for i in range(8)))
    configs = node_configs(parser.parse_args(["agent", "--engines", str(f), *flags]))
    parsed = [tuple(s.split(",")) for s in shards]
    for c in configs:
        assert c.control_planes == shard_for(c.name, parsed)
    assert len({c.control_planes for c in configs}) > 1  # 8 engines over 3 shards
    argv = ["agent", "--name=gpu3", "--control-plane=all:1", *flags]
    one = config_from_args(parser.parse_args(argv))
    assert one.control_planes == ("all:1", *shard_for("gpu3", parsed))
    with pytest.raises(SystemExit, match="--control-plane or --shard"):
        config_from_args(parser.parse_args(["agent", "--name=x"]))
