"""Which control-plane shard holds an engine: rendezvous (highest random weight) hashing of
the engine's name over the shards' names, so every agent and tool agrees without talking,
and a shard added or removed moves only the engines it gains or held (1/N of them), not
a reshuffle of the fleet as `hash % N` would. Sidecars subscribe to every shard that holds
their pools' engines (all of them, without a way to tell) and merge what they hear.

A shard is named by its replicas' addresses ("cp-0a:15010,cp-0b:15010"): an agent
publishes to every replica of its engine's shard, a sidecar follows any one of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = ["parse_shard", "shard_for"]


def parse_shard(text: str) -> tuple[str, ...]:
    """'a:1,b:1' -> ('a:1', 'b:1'): one shard's replicas. ValueError when empty."""
    replicas = tuple(a.strip() for a in text.split(",") if a.strip())
    if not replicas:
        raise ValueError(f"a shard needs at least one control-plane address, got {text!r}")
    return replicas


def _weight(engine: str, shard: tuple[str, ...]) -> int:
    key = engine.encode() + b"\0" + ",".join(shard).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


def shard_for(engine: str, shards: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
    """The shard (its replicas) that holds `engine`'s resources."""
    if not shards:
        raise ValueError("no control-plane shard to choose from")
    return max(shards, key=lambda s: (_weight(engine, s), s))
