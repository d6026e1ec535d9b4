"""meshd/kv_events.py: the real vLLM frames of tests/golden decoded; a subscriber on real ZMQ
sockets (PUB, and a ROUTER answering replays the way vLLM's does) catching up, filling
gaps and giving them up; the tokenizer and chat template; the precise path end to end."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from filters.kv_digest import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventError,
    KVIndexFeed,
    decode_batch,
    parse_pub_frames,
    parse_replay_frames,
)
from filters.prefix_index import PrefixIndex
from filters.vllm_blocks import VllmBlockHasher
from loadtest.engine.kv_events import BlockStored as SimStored
from loadtest.engine.kv_events import encode_batch
from meshd.kv_events import (
    EngineModel,
    EngineTokenizer,
    KVEventSubscriber,
    PrecisePrefix,
    TokenizerError,
)

GOLDEN = Path(__file__).parent / "golden"


def golden(algo: str = "sha256_cbor") -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((GOLDEN / f"vllm_kv_events_{algo}.json").read_text())
    return doc


def frames_of(doc: dict[str, Any], key: str = "frames") -> list[list[bytes]]:
    return [[bytes.fromhex(x) for x in fr] for fr in doc[key]]


async def until(pred: Callable[[], bool], timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


# -- the captured wire format ------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
def test_golden_frames_decode(algo: str) -> None:
    doc = golden(algo)
    kinds: dict[str, int] = {}
    seqs = []
    for fr in frames_of(doc):
        topic, seq, payload = parse_pub_frames(fr)
        assert topic == b"kv-events"
        seqs.append(seq)
        ts, events = decode_batch(payload)
        assert ts > 1.7e9
        for e in events:
            kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
            if isinstance(e, BlockStored):
                assert e.block_size == 32 and e.medium == "GPU" and e.group_idx == 0
                assert len(e.token_ids) == 32 * len(e.block_hashes)
                assert e.extra_keys is not None and len(e.extra_keys) == len(e.block_hashes)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # +1 per batch
    assert kinds["BlockStored"] >= 10 and kinds["BlockRemoved"] >= 20
    assert kinds["AllBlocksCleared"] == 1
    parents = [
        e.parent_block_hash
        for fr in frames_of(doc)
        for e in decode_batch(fr[2])[1]
        if isinstance(e, BlockStored)
    ]
    assert any(p is not None for p in parents) and None in parents


def test_golden_replay_frames() -> None:
    doc = golden()
    live = {parse_pub_frames(fr)[1]: fr[2] for fr in frames_of(doc)}
    replay = frames_of(doc, "replay")
    first = parse_replay_frames(replay[0])
    assert first is not None and first[0] == doc["replay_from"]
    for fr in replay[:-1]:
        item = parse_replay_frames(fr)
        assert item is not None and live[item[0]] == item[1]  # the same bytes again
    assert parse_replay_frames(replay[-1]) is None  # the end marker
    assert int.from_bytes(replay[-1][2], "big") == REPLAY_END_SEQ


@pytest.mark.parametrize(
    "frames",
    [[], [b"t", b"123", b"p"], [b"t", b"12345678"], [b"a", b"b", b"c", b"d"]],
)
def test_malformed_frames_raise_kv_event_error(frames: list[bytes]) -> None:
    with pytest.raises(KVEventError):
        parse_pub_frames(frames)
    with pytest.raises(KVEventError):
        parse_replay_frames([*frames, b"x"][:3])


# -- a fake engine on real sockets ---------------------------------------------------------------


class FakeEngine:
    """vLLM's publisher: PUB for live batches, ROUTER answering `[b"", start_seq]` with
    `[b"", topic, seq, payload]` per buffered batch and the end marker."""

    def __init__(self, ctx: zmq.asyncio.Context, *, answer: bool = True) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []
        self.answer = answer
        self.requests: list[int] = []
        self._task = asyncio.create_task(self._serve())

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            s = int.from_bytes(start, "big")
            self.requests.append(s)
            if not self.answer:
                continue
            for seq, payload in self.buffer:
                if seq >= s:
                    await self.router.send_multipart(
                        [client, b"", b"kv-events", seq.to_bytes(8, "big"), payload]
                    )
            await self.router.send_multipart([client, b"", b"", b"\xff" * 8, b""])

    async def publish(self, seq: int, payload: bytes, *, live: bool = True) -> None:
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close(0)
        self.router.close(0)


async def joined(engine: FakeEngine, sub: KVEventSubscriber, seq: int, payload: bytes) -> None:
    """Publish one batch until the subscriber has it (ZMQ's slow joiner drops the first)."""
    engine.buffer.append((seq, payload))
    while sub.stats.messages == 0:
        await engine.pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
        await asyncio.sleep(0.01)


def reference(doc: dict[str, Any]) -> PrefixIndex:
    idx = PrefixIndex(track_blocks=True)
    feed = KVIndexFeed(idx, "e", catch_up=False)
    for fr in frames_of(doc):
        _, seq, payload = parse_pub_frames(fr)
        feed.feed(seq, payload, 0.0)
    return idx


async def test_subscriber_catches_up_and_fills_gaps_through_replay() -> None:
    doc = golden()
    frames = [parse_pub_frames(fr)[1:] for fr in frames_of(doc)]
    ctx = zmq.asyncio.Context()
    engine = FakeEngine(ctx)
    idx = PrefixIndex(track_blocks=True)
    feed = KVIndexFeed(idx, "e")
    # The engine's seq 0 (the capture's warm-up) is not in the fixture: re-number from 0.
    base = frames[0][0]
    sub = KVEventSubscriber(
        feed, engine.endpoint, replay=engine.replay, topic="kv-events", context=ctx
    )
    try:
        await sub.start()
        # We join late: batch 1 arrives first, so batch 0 is asked from the replay socket.
        engine.buffer.append((0, frames[0][1]))
        await joined(engine, sub, 1, frames[1][1])
        for seq, payload in frames[2:]:
            # Batch 5 never reaches us live (a PUB over its high-water mark drops).
            await engine.publish(seq - base, payload, live=seq - base != 5)
        await until(lambda: feed.next_seq == len(frames) and not feed.gap_open)
        assert engine.requests == [0, 5]
        assert sub.stats.replays == 2 and feed.lost_gaps == 0
        want = reference(doc)
        assert idx.held("e") == want.held("e") and idx.used_blocks("e") > 0
        idx.check()
    finally:
        await sub.close()
        await engine.close()
        ctx.destroy(0)


async def test_unanswered_replay_gives_the_gap_up() -> None:
    ctx = zmq.asyncio.Context()
    engine = FakeEngine(ctx, answer=False)
    idx = PrefixIndex(track_blocks=True)
    feed = KVIndexFeed(idx, "e", catch_up=False)
    h = VllmBlockHasher("sha256_cbor", 4)
    sub = KVEventSubscriber(
        feed, engine.endpoint, replay=engine.replay, context=ctx, replay_timeout_s=0.2
    )
    try:
        await sub.start()
        a = list(range(8))
        await joined(engine, sub, 0, encode_batch(1.0, [SimStored(h.hashes(a), None, a, 4)]))
        b = list(range(50, 54))
        await engine.publish(2, encode_batch(3.0, [SimStored(h.hashes(b), None, b, 4)]))
        await until(lambda: sub.stats.replay_timeouts == 1 and not feed.gap_open)
        # Batch 1 (maybe a removal of a) is lost: a is forgotten, b applied.
        assert idx.match(h.hashes(a), 0.0) == {} and idx.match(h.hashes(b), 0.0) == {"e": 1}
        assert feed.lost_gaps == 1
    finally:
        await sub.close()
        await engine.close()
        ctx.destroy(0)


async def test_bind_mode_and_bad_frames() -> None:
    """With a concrete tcp:// endpoint vLLM connects its PUB, so the subscriber binds."""
    ctx = zmq.asyncio.Context()
    idx = PrefixIndex(track_blocks=True)
    feed = KVIndexFeed(idx, "e", catch_up=False)
    sub = KVEventSubscriber(feed, "tcp://127.0.0.1:*", bind=True, context=ctx)
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        await sub.start()
        assert sub.bound is not None
        pub.connect(sub.bound)
        h = VllmBlockHasher("sha256", 4)
        a = list(range(4))
        good = encode_batch(1.0, [SimStored(h.hashes(a), None, a, 4)])
        while sub.stats.messages == 0:
            await pub.send_multipart([b"", b"\x00" * 8, good])
            await asyncio.sleep(0.01)
        await pub.send_multipart([b"", b"short"])
        await pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1not msgpack"])
        await until(lambda: sub.stats.bad_frames == 1 and sub.stats.bad_payloads == 1)
        assert idx.match(h.hashes(a), 0.0) == {"e": 1}
    finally:
        pub.close(0)
        await sub.close()
        ctx.destroy(0)


async def test_a_feed_without_tick_waits_for_frames_without_spinning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent's KVDigestTracker has no `tick`: once the tick time passed, the SUB socket
    was polled with a timeout of 0 in a loop, a busy spin (it starved the agent's gRPC
    calls). It must wait for frames with no timeout."""
    import faulthandler

    from filters.kv_digest import KVDigestTracker

    timeouts: list[object] = []
    original: Any = zmq.asyncio.Socket.poll

    def spy(self: zmq.asyncio.Socket, timeout: object = None, flags: int = zmq.POLLIN) -> Any:
        if self.type == zmq.SUB:
            timeouts.append(timeout)
        return original(self, timeout, flags)

    monkeypatch.setattr(zmq.asyncio.Socket, "poll", spy)
    # With the spin the event loop never gets here again: end the run with a traceback
    # rather than hang the suite.
    faulthandler.dump_traceback_later(30, exit=True)
    ctx = zmq.asyncio.Context()
    tracker = KVDigestTracker("e", "epoch-1", block_size=4, catch_up=False)
    now = [0.0]

    def clock() -> float:
        now[0] += 10.0  # every reading is past the next tick
        return now[0]

    sub = KVEventSubscriber(
        tracker, "tcp://127.0.0.1:*", bind=True, context=ctx, tick_s=0.001, clock=clock
    )
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        await sub.start()
        assert sub.bound is not None
        pub.connect(sub.bound)
        h = VllmBlockHasher("sha256", 4)
        a = list(range(8))
        batch = encode_batch(1.0, [SimStored(h.hashes(a), None, a, 4)])
        while sub.stats.messages < 2:
            await pub.send_multipart([b"", b"\x00" * 8, batch])
            await asyncio.sleep(0.01)
        assert tracker.blocks == set(h.hashes(a))
    finally:
        faulthandler.cancel_dump_traceback_later()
        pub.close(0)
        await sub.close()
        ctx.destroy(0)
    assert len(timeouts) >= 2 and all(t is None for t in timeouts)


# -- tokenizer and chat template -------------------------------------------------------------

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
    "<{{ m['role'] }}> {{ m['content'] }} </s>\n"
    "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def make_model(tmp_path: Path, template: str | None = TEMPLATE) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["<s>", "</s>", "<unk>", "<system>", "<user>", "<assistant>", "hello", "world"]
    words += [f"w{i}" for i in range(40)] + ['[{"name":', '"f"}]']
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>", "<system>", "<user>", "<assistant>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg: dict[str, Any] = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if template is not None:
        cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_tokenizer_encodes_and_renders_like_transformers(tmp_path: Path) -> None:
    t = EngineTokenizer.load(make_model(tmp_path))
    assert t.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    model = EngineModel(t, VllmBlockHasher("sha256_cbor", 2))
    from filters.vllm_blocks import engine_prompt

    p = engine_prompt("completion", {"prompt": "hello world"})
    assert p is not None and t.tokens(p) == [0, 6, 7]  # BOS added for completions
    doc = {"messages": [{"role": "user", "content": "hello"}]}
    chat = engine_prompt("chat", doc)
    assert chat is not None
    assert t.render(chat) == "<s><user> hello </s>\n<assistant>"
    assert t.tokens(chat) == [0, 4, 6, 1, 5]  # no second BOS: the template has it
    tools = engine_prompt("chat", {**doc, "tools": [{"name": "f"}]})
    assert tools is not None and '[{"name": "f"}]' in t.render(tools)
    bad = engine_prompt("chat", {"messages": [{"role": "bad", "content": "x"}]})
    assert bad is not None and t.tokens(bad) is None
    assert model.block_hashes("chat", doc) == VllmBlockHasher("sha256_cbor", 2).hashes(
        [0, 4, 6, 1, 5]
    )
    assert model.block_hashes("chat", {"messages": "nope"}) is None


def test_template_files_and_errors(tmp_path: Path) -> None:
    d = make_model(tmp_path, template=None)
    t = EngineTokenizer.load(d)
    assert t.chat_template is None
    from filters.vllm_blocks import engine_prompt

    chat = engine_prompt("chat", {"messages": [{"role": "user", "content": "x"}]})
    assert chat is not None and t.tokens(chat) is None
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"
    )
    t = EngineTokenizer.load(d)
    assert t.wrap_parts  # the template walks content parts: vLLM's "openai" format
    wrapped = engine_prompt(
        "chat", {"messages": [{"role": "user", "content": "hello"}]}, wrap_parts=True
    )
    assert wrapped is not None and t.render(wrapped) == "hello"
    (d / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(TokenizerError, match="chat template"):
        EngineTokenizer.load(d)
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        EngineTokenizer.load(tmp_path / "missing")


# -- the precise path end to end --------------------------------------------------------------


async def test_precise_prefix_sees_what_the_engine_stores(tmp_path: Path) -> None:
    ctx = zmq.asyncio.Context()
    engine = FakeEngine(ctx)
    idx = PrefixIndex(track_blocks=True)
    precise = PrecisePrefix(idx)
    precise.add_model("m", EngineModel.load(make_model(tmp_path), block_size=2))
    feed = precise.add_engine("e0", "m", engine.endpoint, replay=engine.replay)
    try:
        await precise.start()
        doc = {"prompt": " ".join(f"w{i}" for i in range(9))}
        hashes = precise.block_hashes("m", "completion", doc)
        assert hashes is not None and len(hashes) == 5  # BOS + 9 words = 10 tokens
        assert precise.block_hashes("other-model", "completion", doc) is None
        toks = [0, *range(8, 17)]
        sub = precise.engines["e0"].subscriber
        batch = encode_batch(1.0, [SimStored(hashes, None, toks, 2)])
        await joined(engine, sub, 0, batch)
        await until(lambda: idx.match(hashes, 0.0) == {"e0": 5})
        assert feed.hash_checks == 1 and feed.hash_mismatches == 0
        (row,) = precise.snapshot()
        assert row["stored_blocks"] == 5 and row["held_blocks"] == 5 and row["trust"] == 1.0
        precise.engine_restarted("e0", 1.0)
        assert idx.match(hashes, 1.0) == {}
    finally:
        await precise.close()
        await engine.close()
        ctx.destroy(0)


def test_events_module_types_are_the_filters_ones() -> None:
    # The agent and this module share one decoder; AllBlocksCleared/BlockRemoved included.
    ts, events = decode_batch(encode_batch(2.0, []))
    assert ts == 2.0 and events == []
    assert BlockRemoved((1,)).group_idx == 0 and AllBlocksCleared() == AllBlocksCleared()
