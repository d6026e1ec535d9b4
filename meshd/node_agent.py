"""The agent of a node's engines: one EngineAgent per engine (its scrapes, KV events,
digests and epochs, as ever), sharing one link per control plane, so what the engines
offer within a short window leaves as one publish message. The control plane pays ~120 us
of gRPC per message whatever it carries and ~8 us per update in it
(`python -m loadtest.xds_ingest_bench`: 148 us an update one a message, 21.5 us ten a
message), so a node of 8 engines costs it about a fifth of 8 agents of one (issue #23).

`meshd agent --engines FILE` runs one: the file lists the engines, each with the keys of
`meshd agent`'s per-engine flags (name, engine, address, pool, model, flavor, kv_events,
kv_events_replay, kv_events_topic, kv_events_bind, gpu, gpu_count, gpu_memory_gib,
gpu_index); the other flags (control planes, TLS, interval, ...) are the node's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from meshd.agent import (
    AgentConfig,
    AgentStats,
    EngineAgent,
    channel_credentials,
    client_ssl_context,
)
from meshd.agent_link import ControlPlaneLink

__all__ = ["ENGINE_KEYS", "NodeAgent", "engine_configs"]

# The per-engine keys of an --engines file, and the AgentConfig field each sets.
ENGINE_KEYS = {
    "name": "name",
    "engine": "engine_url",
    "address": "address",
    "pool": "pool",
    "model": "model",
    "flavor": "flavor",
    "kv_events": "kv_events",
    "kv_events_replay": "kv_events_replay",
    "kv_events_topic": "kv_events_topic",
    "kv_events_bind": "kv_events_bind",
    "gpu": "gpu",
    "gpu_count": "gpu_count",
    "gpu_memory_gib": "memory_total_bytes",
    "gpu_index": "gpu_indices",
}


def engine_configs(node: AgentConfig, engines: Sequence[Mapping[str, Any]]) -> list[AgentConfig]:
    """One AgentConfig per engine: the node's settings with the engine's own keys. Raises
    ValueError naming the entry and key of a mistake."""
    if not engines:
        raise ValueError("engines: the list is empty")
    out: list[AgentConfig] = []
    names: set[str] = set()
    for i, entry in enumerate(engines):
        where = f"engines[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: expected a mapping of engine keys")
        unknown = sorted(set(entry) - set(ENGINE_KEYS))
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: not an engine key ({', '.join(ENGINE_KEYS)})")
        for key in ("name", "engine"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise ValueError(f"{where}.{key}: required, a non-empty string")
        if entry["name"] in names:
            raise ValueError(f"{where}.name: {entry['name']!r} is listed twice")
        names.add(entry["name"])
        fields: dict[str, Any] = {ENGINE_KEYS[k]: v for k, v in entry.items()}
        if "gpu_memory_gib" in entry:
            fields["memory_total_bytes"] = int(float(entry["gpu_memory_gib"]) * 2**30)
        if "gpu_index" in entry:
            fields["gpu_indices"] = tuple(int(x) for x in entry["gpu_index"])
        fields.setdefault("address", str(entry["engine"]).split("://", 1)[-1].rstrip("/"))
        out.append(dataclasses.replace(node, **fields))
    return out


class NodeAgent:
    """Several engines' agents behind one link per control plane. `start()`, `close()`;
    `agents` are the EngineAgents, `stats` the links' publish counters. Each engine
    publishes to its own config's control planes (its shard's replicas)."""

    def __init__(
        self,
        configs: Sequence[AgentConfig],
        *,
        window_s: float | None = None,
        tracer_provider: Any = None,
    ) -> None:
        """`window_s`: how long a link gathers bodies before it sends (default: a fifth of
        the scrape interval, at most 20 ms; what an update waits for its neighbours)."""
        if not configs:
            raise ValueError("a node agent needs at least one engine")
        first = configs[0]
        self.config = first  # the node's settings: backoff, TLS
        self.credentials: grpc.ChannelCredentials | None = channel_credentials(first)
        self.ssl_context = client_ssl_context(first)
        self.stats = AgentStats()
        if window_s is None:
            window_s = min(0.02, first.interval_s / 5)
        # One link per control plane any engine publishes to (engines of different shards
        # share the links of the shards they have in common: meshd/shards.py).
        self.links: dict[str, ControlPlaneLink] = {}
        for c in configs:
            for t in c.control_planes:
                if t not in self.links:
                    self.links[t] = ControlPlaneLink(self, t, window_s=window_s)
        self.agents = [
            EngineAgent(
                c,
                tracer_provider=tracer_provider,
                links=[self.links[t] for t in c.control_planes],
            )
            for c in configs
        ]

    def on_link_lost(self) -> None:
        """The control plane may have lost the digests' bases: every engine's next is full."""
        for agent in self.agents:
            agent.on_link_lost()

    async def start(self) -> None:
        for link in self.links.values():
            link.start()
        for agent in self.agents:
            await agent.start()

    async def close(self) -> None:
        for agent in self.agents:
            await agent.close()
        for link in self.links.values():
            await link.close()

    async def __aenter__(self) -> NodeAgent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
