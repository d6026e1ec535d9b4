"""KV events in vLLM's wire format: msgpack encoding, and a real ZMQ SUB and replay."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from loadtest.engine import EngineSpec
from loadtest.engine.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    decode_batch,
    encode_batch,
    endpoint_binds,
    offset_endpoint,
)

STORED = BlockStored(
    block_hashes=[2**64 - 1, 12345],
    parent_block_hash=None,
    token_ids=list(range(32)),
    block_size=16,
)


def test_batch_is_an_array_and_events_are_maps_tagged_by_type() -> None:
    payload = encode_batch(1.5, [STORED, BlockRemoved([7]), AllBlocksCleared()])
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (1.5, 0)
    stored, removed, cleared = events
    # Field order as msgspec encodes vLLM's structs: tag first, then declaration order.
    assert list(stored) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
    ]
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == [2**64 - 1, 12345]
    assert stored["medium"] == "GPU" and stored["extra_keys"] == [None, None]
    assert stored["kv_cache_spec_kind"] == "full_attention" and stored["group_idx"] == 0
    assert removed == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}


@pytest.mark.parametrize("fmt", ["map", "array"])
def test_encoding_round_trips(fmt: Any) -> None:
    events: list[KVEvent] = [STORED, BlockRemoved([1, 2]), AllBlocksCleared()]
    ts, back, rank = decode_batch(encode_batch(3.25, events, 2, fmt))
    assert (ts, rank) == (3.25, 2)
    assert back == events


def test_array_format_is_the_older_positional_one() -> None:
    _, events, _ = msgpack.unpackb(encode_batch(0.0, [STORED, BlockRemoved([9])], fmt="array"))
    assert events[0] == ["BlockStored", [2**64 - 1, 12345], None, list(range(32)), 16, None, "GPU"]
    assert events[1] == ["BlockRemoved", [9], "GPU"]


def test_endpoint_rules_follow_vllm() -> None:
    assert endpoint_binds("tcp://*:5557") and endpoint_binds("ipc:///tmp/x")
    assert not endpoint_binds("tcp://127.0.0.1:5557")
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"


async def _complete(url: str, prompt: str, max_tokens: int = 2) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}) as r,
    ):
        assert r.status == 200
        await r.read()


async def test_sub_receives_published_events_and_replay_fills_gaps(fleet: Any) -> None:
    spec = EngineSpec(
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
        kv_events_topic="kv-events",
        kv_blocks=64,
    )
    f = await fleet(spec)
    engine = f[0]
    assert engine.publisher is not None
    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(engine.publisher.bound_endpoint())
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(engine.publisher.bound_replay_endpoint() or "")
    try:
        frames = None
        # PUB/SUB joins asynchronously: publish until the subscription is live. Each
        # prompt is new (40 tokens: two full blocks), so each one stores blocks.
        for attempt in range(100):
            await _complete(engine.url, " ".join(f"a{attempt}w{i}" for i in range(40)))
            if await sub.poll(200):
                frames = await sub.recv_multipart()
                break
        assert frames is not None
        topic, seq, payload = frames
        assert topic == b"kv-events" and len(seq) == 8
        _, events, rank = decode_batch(payload)
        assert rank == 0
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert stored and len(stored[0].block_hashes) == 2 and stored[0].block_size == 16
        assert stored[0].parent_block_hash is None and len(stored[0].token_ids) == 32

        # Replay from 0 returns every batch published so far, then the end marker.
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            reply = await asyncio.wait_for(dealer.recv_multipart(), 5)
            empty, rtopic, rseq, rpayload = reply
            assert empty == b""
            if rseq == END_SEQ:
                assert rpayload == b"" and rtopic == b""
                break
            assert rtopic == b"kv-events"
            seqs.append(int.from_bytes(rseq, "big"))
            decode_batch(rpayload)
        assert seqs == list(range(engine.publisher.next_seq))
        assert int.from_bytes(seq, "big") in seqs

        # A restart is announced with AllBlocksCleared.
        async with (
            aiohttp.ClientSession() as s,
            s.post(engine.url + "/admin/fault", json={"kind": "restart"}) as r,
        ):
            assert r.status == 200
        cleared = False
        while not cleared:
            assert await sub.poll(5000)
            _, _, payload = await sub.recv_multipart()
            cleared = any(isinstance(e, AllBlocksCleared) for e in decode_batch(payload)[1])
    finally:
        sub.close(0)
        dealer.close(0)


async def test_eviction_sends_block_removed_before_block_stored(fleet: Any) -> None:
    f = await fleet(EngineSpec(kv_events_endpoint="tcp://127.0.0.1:*", kv_blocks=6))
    engine = f[0]
    got: list[KVEvent] = []
    assert engine.publisher is not None
    original = engine.publisher.publish

    def record(events: Any, ts: float | None = None) -> int:
        got.extend(events)
        return original(events, ts)

    engine.publisher.publish = record
    for i in range(4):  # 4 prompts x 2 full blocks each > 6 blocks
        await _complete(engine.url, " ".join(f"p{i}x{j}" for j in range(33)))
    kinds = [type(e).__name__ for e in got]
    assert "BlockRemoved" in kinds
    first_removed = kinds.index("BlockRemoved")
    assert "BlockStored" in kinds[first_removed:]
