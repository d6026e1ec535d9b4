"""meshd/agent.py end to end: a simulated vLLM engine (HTTP + KV events over ZMQ), the
control plane, the agent in-process and a subscriber that sees what the agent publishes."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp
import pytest

from loadtest.engine import EngineSpec, SimEngine
from loadtest.engine.blocks import external_hash
from loadtest.engine.faults import FaultSpec
from meshd.agent import AgentConfig, EngineAgent, channel_credentials
from meshd.agent_cmd import config_from_args, register
from xds.client import Backoff, Subscriber, Update
from xds.resources import ENDPOINT_STATE_TYPE, PREFIX_DIGEST_TYPE, EndpointState, PrefixDigest
from xds.server import ControlPlane, TlsConfig

NAME = "engine-0"
WAIT_S = 10.0


async def until(
    pred: Callable[[], bool], wait: Callable[[Callable[[], bool]], Awaitable[None]]
) -> None:
    await asyncio.wait_for(wait(pred), WAIT_S)


@dataclass
class Rig:
    engine: SimEngine
    plane: ControlPlane
    agent: EngineAgent
    sub: Subscriber
    digest_blocks: dict[str, set[int]]  # epoch -> blocks, as a picker would rebuild them

    def state(self) -> EndpointState | None:
        v = self.sub.get(ENDPOINT_STATE_TYPE, NAME)
        assert v is None or isinstance(v, EndpointState)
        return v

    def digest(self) -> PrefixDigest | None:
        v = self.sub.get(PREFIX_DIGEST_TYPE, NAME)
        assert v is None or isinstance(v, PrefixDigest)
        return v

    def engine_blocks(self) -> set[int]:
        return {external_hash(h) for h in self.engine.core.pool._table}

    def seen_blocks(self) -> set[int] | None:
        d = self.digest()
        return None if d is None else self.digest_blocks.get(f"{d.epoch}/{d.seq}")

    async def complete(self, prompt: str) -> None:
        async with aiohttp.ClientSession() as s:
            body = {"model": self.engine.spec.model, "prompt": prompt, "max_tokens": 20}
            async with s.post(self.engine.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()


def agent_config(engine: SimEngine, port: int) -> AgentConfig:
    pub = engine.publisher
    assert pub is not None
    return AgentConfig(
        name=NAME,
        engine_url=engine.url,
        address=engine.url.removeprefix("http://"),
        pool="p",
        control_planes=(f"127.0.0.1:{port}",),
        interval_s=0.02,
        heartbeat_s=0.5,
        kv_events=pub.bound_endpoint(),
        kv_events_replay=pub.bound_replay_endpoint(),
        gpu_count=1,
        nvml=False,
        backoff=Backoff(base_s=0.02, max_s=0.2),
    )


def subscriber(port: int, seen: dict[str, set[int]]) -> Subscriber:
    base: dict[str, set[int]] = {}

    def on_update(u: Update) -> None:
        # A picker's rebuild: a full digest is the base, a delta applies to its base.
        for e in u.changed.values():
            d = e.value
            if not isinstance(d, PrefixDigest):
                continue
            key = f"{d.epoch}/{d.base_seq}"
            if d.full:
                base[key] = set(d.added)
            if key in base:
                seen[f"{d.epoch}/{d.seq}"] = d.apply(base[key])

    sub = Subscriber(
        f"127.0.0.1:{port}",
        {ENDPOINT_STATE_TYPE: [NAME], PREFIX_DIGEST_TYPE: [NAME]},
        backoff=Backoff(base_s=0.02, max_s=0.2),
        on_update=on_update,
        rng=random.Random(1),
    )
    sub.start()
    return sub


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    engine = SimEngine(
        EngineSpec(
            name=NAME,
            kv_blocks=48,
            block_size=16,
            time_scale=50.0,
            kv_events_endpoint="tcp://127.0.0.1:*",
            kv_events_replay_endpoint="tcp://127.0.0.1:*",
        )
    )
    await engine.start()
    plane = ControlPlane()
    await plane.start("127.0.0.1", 0)
    agent = EngineAgent(agent_config(engine, plane.port))
    await agent.start()
    seen: dict[str, set[int]] = {}
    sub = subscriber(plane.port, seen)
    try:
        yield Rig(engine, plane, agent, sub, seen)
    finally:
        await sub.close()
        await agent.close()
        await plane.stop(0)
        await engine.stop()


async def test_state_and_digest_follow_the_engine(rig: Rig) -> None:
    await until(lambda: (s := rig.state()) is not None and s.healthy, rig.sub.wait_until)
    s = rig.state()
    assert s is not None
    assert s.model == rig.engine.spec.model and s.pool == "p" and s.gpu == "H100"
    assert (s.kv_block_size, s.kv_capacity_blocks) == (16, 48)
    assert s.address == rig.engine.url.removeprefix("http://")
    first_epoch = s.epoch
    for i in range(4):
        await rig.complete(f"request {i} " + "shared system prompt words " * 12)
    expected = rig.engine_blocks()
    assert len(expected) > 10
    await until(lambda: rig.seen_blocks() == rig.engine_blocks(), rig.sub.wait_until)
    # Enough requests to evict: removals reach the digest too.
    for i in range(6):
        await rig.complete(f"other {i} " + "different words entirely here " * 14)
    await until(lambda: rig.seen_blocks() == rig.engine_blocks(), rig.sub.wait_until)
    await until(lambda: (s := rig.state()) is not None and s.ttft_s is not None, rig.sub.wait_until)
    assert rig.agent.stats.kv_batches > 0

    # Restart: the engine's counters fall and its cache empties; a new epoch, an empty digest.
    rig.engine.inject(FaultSpec("restart"))
    await until(
        lambda: (
            (s := rig.state()) is not None
            and s.epoch != first_epoch
            and (d := rig.digest()) is not None
            and d.epoch == s.epoch
            and rig.seen_blocks() == set()
        ),
        rig.sub.wait_until,
    )
    await rig.complete("after the restart " + "fresh words " * 10)
    await until(
        lambda: bool(rig.seen_blocks()) and rig.seen_blocks() == rig.engine_blocks(),
        rig.sub.wait_until,
    )


async def test_engine_death_marks_unhealthy(rig: Rig) -> None:
    await until(lambda: (s := rig.state()) is not None and s.healthy, rig.sub.wait_until)
    await rig.engine.stop()
    await until(lambda: (s := rig.state()) is not None and not s.healthy, rig.sub.wait_until)
    assert rig.agent.stats.scrape_failures > 0


async def test_control_plane_down_then_up() -> None:
    engine = SimEngine(
        EngineSpec(name=NAME, time_scale=50.0, kv_events_endpoint="tcp://127.0.0.1:*")
    )
    await engine.start()
    plane = ControlPlane()
    port = await plane.start("127.0.0.1", 0)
    await plane.stop(0)
    agent = EngineAgent(agent_config(engine, port))
    await agent.start()
    sub = None
    try:
        await until(lambda: agent.stats.publish_failures >= 2, agent.wait_until)
        # Blocks cached while no control plane listens: they must arrive all the same.
        async with aiohttp.ClientSession() as s:
            body = {"model": engine.spec.model, "prompt": "while away " * 30, "max_tokens": 5}
            async with s.post(engine.url + "/v1/completions", json=body) as r:
                assert r.status == 200
        await until(lambda: len(agent.tracker.blocks) > 3, agent.wait_until)
        plane = ControlPlane()
        await plane.start("127.0.0.1", port)
        seen: dict[str, set[int]] = {}
        sub = subscriber(port, seen)
        expected = {external_hash(h) for h in engine.core.pool._table}

        def rebuilt() -> set[int] | None:
            d = sub.get(PREFIX_DIGEST_TYPE, NAME) if sub is not None else None
            return None if not isinstance(d, PrefixDigest) else seen.get(f"{d.epoch}/{d.seq}")

        # The new replica never had a base: only a full digest sent after reconnecting lets
        # a subscriber rebuild the set.
        await until(lambda: rebuilt() == expected, sub.wait_until)
        assert isinstance(sub.get(ENDPOINT_STATE_TYPE, NAME), EndpointState)
    finally:
        if sub is not None:
            await sub.close()
        await agent.close()
        await plane.stop(0)
        await engine.stop()


def test_cli_flags() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(
        [
            "agent",
            "--name=e1",
            "--engine=http://10.0.0.5:8000",
            "--control-plane=cp-a:18000",
            "--control-plane=cp-b:18000",
            "--kv-events=tcp://127.0.0.1:5557",
            "--gpu=H100",
            "--gpu-memory-gib=80",
        ]
    )
    c = config_from_args(args)
    assert channel_credentials(c) is None  # plaintext unless a --tls-* flag is given
    flags = ["--control-plane=cp:1", "--tls-ca=ca", "--tls-cert=c", "--tls-key=k"]
    tls = config_from_args(parser.parse_args(["agent", "--name=e1", *flags]))
    assert (tls.tls_ca_file, tls.tls_cert_file, tls.tls_key_file) == ("ca", "c", "k")
    assert c.control_planes == ("cp-a:18000", "cp-b:18000")
    assert c.address == "10.0.0.5:8000" and c.interval_s == 0.1
    assert c.memory_total_bytes == 80 * 2**30 and c.gpu == "H100"


async def test_publishing_ticks_are_traced() -> None:
    from otlp_receiver import OtlpReceiver

    from meshd import telemetry

    receiver = OtlpReceiver().start()
    provider = telemetry.setup_tracing("meshd-agent", receiver.endpoint, 1.0)
    engine = SimEngine(
        EngineSpec(name=NAME, time_scale=50.0, kv_events_endpoint="tcp://127.0.0.1:*")
    )
    await engine.start()
    plane = ControlPlane()
    port = await plane.start("127.0.0.1", 0)
    agent = EngineAgent(agent_config(engine, port), tracer_provider=provider)
    try:
        await agent.start()
        await until(lambda: agent.state is not None and agent.state.healthy, agent.wait_until)
        async with aiohttp.ClientSession() as s:
            body = {"model": engine.spec.model, "prompt": "traced words " * 30, "max_tokens": 5}
            async with s.post(engine.url + "/v1/completions", json=body) as r:
                assert r.status == 200
        await until(lambda: len(agent.tracker.blocks) > 3, agent.wait_until)
        scrapes = agent.stats.scrapes
        await until(lambda: agent.stats.scrapes > scrapes + 1, agent.wait_until)
        agent.new_epoch("test asked")
    finally:
        await agent.close()
        await plane.stop(0)
        await engine.stop()
    assert provider.force_flush(10_000)
    receiver.wait_for(3)
    provider.shutdown()
    receiver.stop()
    by = receiver.by_name()
    publishes = by[telemetry.SPAN_AGENT_PUBLISH]
    # Quiet ticks make no span: fewer spans than scrapes.
    assert 1 <= len(publishes) < agent.stats.scrapes
    healthy = [s for s in publishes if s.attributes[telemetry.ATTR_HEALTHY]]
    assert healthy and all(s.attributes[telemetry.ATTR_ENGINE] == NAME for s in publishes)
    assert healthy[0].attributes[telemetry.ATTR_POOL] == "p"
    digests = [s for s in publishes if telemetry.ATTR_DIGEST_SEQ in s.attributes]
    assert any(s.attributes[telemetry.ATTR_DIGEST_ADDED] > 0 for s in digests)
    (epoch,) = by[telemetry.SPAN_AGENT_EPOCH]
    assert epoch.attributes[telemetry.ATTR_REASON] == "test asked"
    assert all(s.end_ns >= s.start_ns for s in publishes)


async def test_agent_publishes_over_mtls_and_a_rogue_certificate_is_refused(
    tmp_path: Path,
) -> None:
    import certs

    ca, rogue = certs.ca("meshd-ca"), certs.ca("rogue-ca")
    server_cert, server_key = certs.leaf(ca, "control-plane")
    files: dict[str, str] = {}
    for name, data in (
        ("ca.pem", certs.pem(ca[1])),
        *zip(("cert.pem", "key.pem"), certs.leaf(ca, "agent"), strict=True),
        *zip(("rogue-cert.pem", "rogue-key.pem"), certs.leaf(rogue, "agent"), strict=True),
    ):
        (tmp_path / name).write_bytes(data)
        files[name] = str(tmp_path / name)
    engine = SimEngine(
        EngineSpec(name=NAME, time_scale=50.0, kv_events_endpoint="tcp://127.0.0.1:*")
    )
    await engine.start()
    plane = ControlPlane()
    port = await plane.start("127.0.0.1", 0, TlsConfig(server_cert, server_key, certs.pem(ca[1])))
    base = agent_config(engine, port)
    good = EngineAgent(
        replace(
            base,
            tls_ca_file=files["ca.pem"],
            tls_cert_file=files["cert.pem"],
            tls_key_file=files["key.pem"],
        )
    )
    rogue_agent = EngineAgent(
        replace(
            base,
            name="rogue",
            tls_ca_file=files["ca.pem"],
            tls_cert_file=files["rogue-cert.pem"],
            tls_key_file=files["rogue-key.pem"],
        )
    )
    plain = EngineAgent(replace(base, name="plain"))
    agents = (good, rogue_agent, plain)
    try:
        for a in agents:
            await a.start()
        await until(lambda: good.stats.publishes > 0, good.wait_until)
        assert NAME in plane.cache.resources(ENDPOINT_STATE_TYPE)
        await until(lambda: rogue_agent.stats.publish_failures >= 2, rogue_agent.wait_until)
        await until(lambda: plain.stats.publish_failures >= 2, plain.wait_until)
        names = set(plane.cache.resources(ENDPOINT_STATE_TYPE))
        assert names == {NAME} and rogue_agent.stats.publishes == plain.stats.publishes == 0
    finally:
        for a in agents:
            await a.close()
        await plane.stop(0)
        await engine.stop()

    with pytest.raises(ValueError, match=r"tls_key_file: cannot read .*missing\.pem"):
        EngineAgent(replace(base, tls_cert_file=files["cert.pem"], tls_key_file="missing.pem"))
    with pytest.raises(ValueError, match=r"--tls-cert, --tls-key"):
        EngineAgent(replace(base, tls_cert_file=files["cert.pem"]))
