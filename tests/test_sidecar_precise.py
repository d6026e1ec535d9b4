"""The precise prefix path through the sidecar: with `routing.tokenizers` set for a model and
`kv_events` on its endpoints, the sidecar hashes each request as the engine does (its
tokenizer, vLLM's block hashes) and follows each engine's KV events over real ZMQ sockets,
so a prefix an engine reports storing steers the request there, one it reports evicting
stops doing so, and a model without a tokenizer keeps the approximate path."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from backends import TestBackend as Backend
from harness import sidecar_config, url
from test_kv_events import FakeEngine, make_model

from filters.hotpath import block_hashes
from filters.picker import PickRequest
from filters.pool_router import EndpointSpec, make_router
from loadtest.engine.kv_events import BlockRemoved as SimRemoved
from loadtest.engine.kv_events import BlockStored as SimStored
from loadtest.engine.kv_events import encode_batch
from meshd.config import ConfigError
from meshd.kv_events import EngineModel
from meshd.sidecar import Sidecar

MODEL = "tiny"
BLOCK = 2
WAIT_S = 10.0


async def poll(pred: Callable[[], bool]) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + WAIT_S
    while not pred():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(0)


Rig = tuple[list[Backend], list[FakeEngine], Sidecar, Path]


@pytest.fixture
async def rig(
    tmp_path: Path,
    zctx: zmq.asyncio.Context,
    backends: Callable[..., Awaitable[Backend]],
    sidecar: Callable[..., Awaitable[Sidecar]],
) -> AsyncIterator[Rig]:
    bs = [await backends(f"b{i}") for i in range(3)]
    engines = [FakeEngine(zctx) for _ in bs]
    model_dir = make_model(tmp_path)
    cfg = sidecar_config(
        [],
        pools=[
            {
                "name": "default",
                "models": [MODEL, "other"],
                "endpoints": [
                    {"url": b.url, "kv_events": {"endpoint": e.endpoint, "replay": e.replay}}
                    for b, e in zip(bs, engines, strict=True)
                ],
            }
        ],
        routing={
            "policy": "meshd",
            "tokenizers": {MODEL: {"path": str(model_dir), "block_size": BLOCK}},
        },
    )
    s = await sidecar(cfg)
    yield bs, engines, s, model_dir
    for e in engines:
        await e.close()


async def complete(s: Sidecar, prompt: str, model: str = MODEL) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 4}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url(s, "/v1/completions"), json=body) as r,
    ):
        assert r.status == 200, await r.text()
        doc: dict[str, Any] = await r.json()
        return doc


async def publish(s: Sidecar, e: FakeEngine, engine_url: str, seq: int, payload: bytes) -> None:
    """Publish one batch until that engine's subscriber has taken it (ZMQ's slow joiner
    drops what is sent before the subscription is up)."""
    sub = s.precise["default"].engines[engine_url].subscriber
    before = sub.stats.messages
    e.buffer.append((seq, payload))
    while sub.stats.messages == before:
        await e.pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
        await asyncio.sleep(0.01)


async def test_reported_blocks_steer_and_evictions_release(rig: Rig) -> None:
    bs, engines, s, model_dir = rig
    prompt = " ".join(f"w{i}" for i in range(20))
    model = EngineModel.load(model_dir, block_size=BLOCK)
    hashes = model.block_hashes("completion", {"prompt": prompt})
    assert hashes is not None and len(hashes) == 10  # BOS + 20 words = 21 tokens
    # Where the picker would send it on the text hashes alone (idle pool): the blocks are
    # reported on another engine, so only the precise path can send it there.
    cfg = s.config.routing
    text = block_hashes(prompt, MODEL, cfg.cache_salt, cfg.block_size_bytes)
    plain = make_router("meshd", [EndpointSpec(b.url) for b in bs])
    req = PickRequest(model=MODEL, block_hashes=text, prompt_tokens=len(prompt) // 4)
    default = plain.order(req, 0.0)[0].url
    target = next(i for i, b in enumerate(bs) if b.url != default)
    toks = [0, *range(8, 28)][: len(hashes) * BLOCK]
    await publish(
        s, engines[target], bs[target].url, 0, encode_batch(1.0, [SimStored(hashes, None, toks, 2)])
    )
    index = s.precise["default"].index
    await poll(lambda: index.match(hashes, 0.0).get(bs[target].url) == len(hashes))
    for _ in range(3):
        assert (await complete(s, prompt))["backend"] == bs[target].name

    # The admin view says what each engine's stream did.
    async with aiohttp.ClientSession() as session, session.get(url(s, "/endpoints", "admin")) as r:
        rows = {row["engine"]: row for row in (await r.json())["kv_events"]["default"]}
    assert rows[bs[target].url]["stored_blocks"] == len(hashes)
    assert rows[bs[target].url]["gaps"] == 0

    # Evicted there: the precise entries go (what we routed since stays approximate).
    await publish(s, engines[target], bs[target].url, 1, encode_batch(2.0, [SimRemoved(hashes)]))
    await poll(lambda: s.precise["default"].engines[bs[target].url].feed.removed_blocks > 0)


async def test_a_model_without_tokenizer_keeps_the_text_hashes(rig: Rig) -> None:
    _, _, s, _ = rig
    precise = s.precise["default"]
    prompt = "other model " * 20
    first = (await complete(s, prompt, model="other"))["backend"]
    # The approximate index (what we routed where) keeps the prefix on one engine.
    assert (await complete(s, prompt + "more", model="other"))["backend"] == first
    assert precise.block_hashes("other", "completion", {"prompt": prompt}) is None


async def test_unloadable_tokenizer_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    cfg = sidecar_config(
        ["http://127.0.0.1:9"],
        routing={"policy": "meshd", "tokenizers": {MODEL: {"path": str(tmp_path / "none")}}},
    )
    with pytest.raises(ConfigError, match=r"routing\.tokenizers\.tiny\.path"):
        Sidecar(cfg)


def test_kv_events_endpoint_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"kv_events\.endpoint"):
        sidecar_config(
            [],
            pools=[
                {
                    "name": "p",
                    "endpoints": [{"url": "http://a:1", "kv_events": {"endpoint": "a:5557"}}],
                }
            ],
        )
