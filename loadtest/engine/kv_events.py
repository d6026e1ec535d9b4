"""KV cache events in vLLM's wire format, and a ZMQ publisher with vLLM's replay socket.

Source: vllm/distributed/kv_events.py (vllm-project/vllm). `EventBatch` is a msgspec
Struct with `array_like=True, omit_defaults=True`, so a batch is the msgpack array
`[ts, [events...], data_parallel_rank]`; `KVCacheEvent` has `tag=True, omit_defaults=True`
and no array_like, so an event is a msgpack map whose first key is `"type"` (the class
name) followed by the fields in declaration order, fields equal to their default left
out. That is what a real vLLM 0.32 sends (observed, /work/shared/notes/real-vllm-on-cpu.md):

    {"type": "BlockStored", "block_hashes": [u64...], "parent_block_hash": u64 | None,
     "token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU",
     "lora_name": None, "extra_keys": [None, ...], "group_idx": 0,
     "kv_cache_spec_kind": "full_attention"}
    {"type": "BlockRemoved", "block_hashes": [u64], "medium": "GPU", "group_idx": 0}
    {"type": "AllBlocksCleared"}

Older vLLM releases declared the events `array_like=True` too (`["BlockStored", hashes,
parent, token_ids, block_size, lora_id, medium]`); `event_format="array"` produces that.

Transport (ZmqEventPublisher in the same file): PUB multipart `[topic, seq, payload]`,
seq an 8-byte big-endian counter from 0, +1 per batch (one batch per engine step with
events). The PUB socket binds when the endpoint has `*`, `::`, `ipc://` or `inproc://`
and connects otherwise. Replay: a ROUTER socket; a DEALER sends `[b"", start_seq]` and gets
`[b"", topic, seq, payload]` for each buffered batch with seq >= start_seq, then
`[b"", b"", 0xffffffffffffffff, b""]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import zmq
import zmq.asyncio

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
EventFormat = Literal["map", "array"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str = "full_attention"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def event_to_wire(event: KVEvent, fmt: EventFormat = "map") -> Any:
    """The msgpack-ready form of one event (see the module docstring)."""
    if isinstance(event, BlockStored):
        if fmt == "array":
            return [
                "BlockStored",
                event.block_hashes,
                event.parent_block_hash,
                event.token_ids,
                event.block_size,
                event.lora_id,
                event.medium,
            ]
        return {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
            # One entry per block; None = no LoRA, multimodal input or cache salt.
            "extra_keys": [None] * len(event.block_hashes),
            "group_idx": event.group_idx,
            "kv_cache_spec_kind": event.kv_cache_spec_kind,
        }
    if isinstance(event, BlockRemoved):
        if fmt == "array":
            return ["BlockRemoved", event.block_hashes, event.medium]
        return {
            "type": "BlockRemoved",
            "block_hashes": event.block_hashes,
            "medium": event.medium,
            "group_idx": event.group_idx,
        }
    return ["AllBlocksCleared"] if fmt == "array" else {"type": "AllBlocksCleared"}


def encode_batch(
    ts: float, events: Sequence[KVEvent], data_parallel_rank: int = 0, fmt: EventFormat = "map"
) -> bytes:
    return msgpack.packb(
        [float(ts), [event_to_wire(e, fmt) for e in events], data_parallel_rank],
        use_bin_type=True,
    )


def event_from_wire(obj: Any) -> KVEvent:
    """Parse one event in either format (the inverse of event_to_wire)."""
    if isinstance(obj, dict):
        kind = obj.get("type")
        if kind == "BlockStored":
            return BlockStored(
                block_hashes=list(obj["block_hashes"]),
                parent_block_hash=obj["parent_block_hash"],
                token_ids=list(obj["token_ids"]),
                block_size=obj["block_size"],
                lora_id=obj.get("lora_id"),
                medium=obj.get("medium"),
                lora_name=obj.get("lora_name"),
                group_idx=obj.get("group_idx") or 0,
                kv_cache_spec_kind=obj.get("kv_cache_spec_kind") or "full_attention",
            )
        if kind == "BlockRemoved":
            return BlockRemoved(
                block_hashes=list(obj["block_hashes"]),
                medium=obj.get("medium"),
                group_idx=obj.get("group_idx") or 0,
            )
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        raise ValueError(f"unknown KV event type {kind!r}")
    if isinstance(obj, list) and obj:
        kind = obj[0]
        if kind == "BlockStored":
            return BlockStored(
                list(obj[1]), obj[2], list(obj[3]), obj[4], obj[5], obj[6] if len(obj) > 6 else None
            )
        if kind == "BlockRemoved":
            return BlockRemoved(list(obj[1]), obj[2] if len(obj) > 2 else None)
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    raise ValueError(f"not a KV event: {obj!r}")


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent], int | None]:
    """(ts, events, data_parallel_rank) of one payload."""
    doc = msgpack.unpackb(payload, raw=False)
    if not isinstance(doc, list) or len(doc) < 2:
        raise ValueError("a KV event batch is a msgpack array [ts, events, dp_rank]")
    rank = doc[2] if len(doc) > 2 else None
    return float(doc[0]), [event_from_wire(e) for e in doc[1]], rank


def endpoint_binds(endpoint: str) -> bool:
    """vLLM's rule: bind for wildcard/ipc/inproc endpoints, connect otherwise."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def offset_endpoint(endpoint: str | None, offset: int) -> str | None:
    """Port + offset for tcp endpoints (as vLLM offsets by data-parallel rank)."""
    if not endpoint or offset == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + offset}"
    return f"{endpoint}_{offset}"


class ZmqEventPublisher:
    """PUB + optional ROUTER replay, on the caller's asyncio loop.

    `publish` never blocks: a PUB socket drops at its high-water mark, like vLLM's.
    The replay buffer keeps the last `buffer_steps` payloads.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        data_parallel_rank: int = 0,
        event_format: EventFormat = "map",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._fmt: EventFormat = event_format
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        # PUB on a plain socket so a NOBLOCK send is a synchronous call; the replay
        # ROUTER needs awaiting, so it lives on the asyncio context.
        self._pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if endpoint_binds(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        if replay_endpoint:
            self._replay = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    @property
    def next_seq(self) -> int:
        return self._seq

    def bound_endpoint(self) -> str:
        """The PUB socket's actual endpoint (resolves `tcp://127.0.0.1:*`)."""
        last = self._pub.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) and last else self.endpoint

    def bound_replay_endpoint(self) -> str | None:
        if self._replay is None:
            return None
        last = self._replay.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) and last else self.replay_endpoint

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int:
        """Send one batch; returns its sequence number."""
        payload = encode_batch(time.time() if ts is None else ts, events, self._rank, self._fmt)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(
                [self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
            )
        return seq

    async def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        while True:
            try:
                frames = await sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated, zmq.ZMQError):
                return
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await sock.send_multipart(
                        [client, b"", self._topic, seq.to_bytes(8, "big"), payload]
                    )
            await sock.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        if self._replay is not None:
            self._replay.close(linger=0)
        self._pub.close(linger=0)
