"""Precise prefix routing, the I/O half: the model's tokenizer and chat template (so a
request's tokens, hence the engine's own block hashes, are known before routing), and one
ZMQ subscriber per engine that feeds its KV events into the shared PrefixIndex.

The decisions are in filters/: vLLM's hashing in filters/vllm_blocks.py, event ordering,
replay and staleness in filters/kv_digest.py (KVIndexFeed), the index in
filters/prefix_index.py. Without a tokenizer for a model nothing here runs for it and the
approximate index (text-block hashes recorded at pick time) carries on alone.

    precise = PrecisePrefix(index)                      # index: PrefixIndex(track_blocks=True)
    precise.add_model("tiny", EngineModel.load(dir, hash_algo="sha256_cbor", block_size=32))
    precise.add_engine("http://e0:8000", "tiny", "tcp://e0:5557", replay="tcp://e0:5558")
    await precise.start()
    hashes = precise.block_hashes("tiny", "chat", body_doc)   # None: use text hashes
    ...
    await precise.close()

ZMQ endpoint rule (vLLM's publisher): with `*` or `ipc://` the engine binds and we connect;
with a concrete `tcp://host:port` the engine connects and we must bind (`bind=True`).
Nothing here may crash the process: a bad frame is counted and dropped, a replay that
times out gives up its gap (the feed then clears, never over-reports).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from filters.kv_digest import (
    KVEventError,
    KVIndexFeed,
    KVSequencer,
    parse_pub_frames,
    parse_replay_frames,
)
from filters.prefix_index import PrefixIndex
from filters.vllm_blocks import EnginePrompt, HashAlgo, VllmBlockHasher, engine_prompt

__all__ = [
    "EngineModel",
    "EngineTokenizer",
    "KVEventSubscriber",
    "PrecisePrefix",
    "SubscriberStats",
    "TokenizerError",
]

log = logging.getLogger("meshd.kv_events")

# A template that loops over a message's content parts wants vLLM's "openai" content
# format (parts as dicts); otherwise content is one string ("string" format).
_PARTS_LOOP = re.compile(r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)")


class TokenizerError(ValueError):
    """A model folder whose tokenizer or chat template cannot be used (names the file)."""


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])  # a serialised AddedToken
    return None


class EngineTokenizer:
    """A Hugging Face model folder's tokenizer (tokenizer.json, through the `tokenizers`
    library) and chat template (chat_template.jinja, chat_template.json or the
    tokenizer_config.json field), rendered as transformers renders it (a sandboxed jinja2
    environment with trim_blocks, lstrip_blocks, loop controls, its `tojson`,
    `raise_exception` and `strftime_now`; the special tokens as variables)."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        special_tokens: Mapping[str, str],
        *,
        content_format: str = "auto",
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        self._template: Any = None
        if chat_template is not None:
            self._template = _compile_template(chat_template)
        if content_format == "auto":
            content_format = (
                "openai" if chat_template and _PARTS_LOOP.search(chat_template) else "string"
            )
        if content_format not in ("string", "openai"):
            raise ValueError("content_format must be auto, string or openai")
        self.wrap_parts = content_format == "openai"

    @classmethod
    def load(cls, path: str | Path, *, content_format: str = "auto") -> EngineTokenizer:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # the `precise` extra
            raise TokenizerError(
                "the precise prefix path needs `tokenizers` and `jinja2`: "
                "pip install 'meshd[precise]'"
            ) from exc
        folder = Path(path)
        tj = folder / "tokenizer.json" if folder.is_dir() else folder
        folder = tj.parent
        try:
            tok = Tokenizer.from_file(str(tj))
        except Exception as exc:  # tokenizers raises its own Exception type
            raise TokenizerError(f"{tj}: not a usable tokenizer.json: {exc}") from None
        config: dict[str, Any] = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.exists():
            try:
                config = json.loads(cfg_path.read_text())
            except ValueError as exc:
                raise TokenizerError(f"{cfg_path}: {exc}") from None
        template = _find_template(folder, config)
        specials = {
            k: t
            for k in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (t := _token_text(config.get(k))) is not None
        }
        return cls(tok, template, specials, content_format=content_format)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def render(self, p: EnginePrompt) -> str:
        """The chat text vLLM tokenizes for p (TokenizerError without a template)."""
        if self._template is None:
            raise TokenizerError("this model has no chat template")
        assert p.messages is not None
        kwargs = dict(self.special_tokens)
        kwargs.update(p.template_kwargs)
        return str(
            self._template.render(
                messages=list(p.messages),
                add_generation_prompt=p.add_generation_prompt,
                **kwargs,
            )
        )

    def tokens(self, p: EnginePrompt) -> list[int] | None:
        """The token ids the engine will see for p; None when they cannot be known (no
        template, a template error: vLLM would refuse the request too)."""
        if p.token_ids is not None:
            return list(p.token_ids)
        if p.text is not None:
            return self.encode(p.text, p.add_special_tokens)
        try:
            text = self.render(p)
        except Exception as exc:  # a template error is the request's (or model's) problem
            log.debug("chat template failed: %s", exc)
            return None
        return self.encode(text, p.add_special_tokens)


def _find_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    js = folder / "chat_template.json"
    if js.exists():
        try:
            doc = json.loads(js.read_text())
        except ValueError as exc:
            raise TokenizerError(f"{js}: {exc}") from None
        if isinstance(doc, dict) and isinstance(doc.get("chat_template"), str):
            return str(doc["chat_template"])
    t = config.get("chat_template")
    if isinstance(t, str):
        return t
    if isinstance(t, list):  # named templates: the default one
        for item in t:
            if isinstance(item, dict) and item.get("name") == "default":
                return str(item.get("template"))
    return None


def _compile_template(source: str) -> Any:
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise TokenizerError("chat templates need jinja2: pip install 'meshd[precise]'") from exc

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TokenizerError(f"chat template: {exc}") from None


@dataclass(slots=True)
class EngineModel:
    """One model's tokenizer and its engines' hashing (all engines serving it must share
    --prefix-caching-hash-algo, --block-size and PYTHONHASHSEED)."""

    tokenizer: EngineTokenizer
    hasher: VllmBlockHasher
    max_blocks: int | None = None  # hash at most this many blocks (None: all)

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        hash_algo: HashAlgo = "sha256",
        block_size: int = 16,
        hash_seed: str | None = None,
        content_format: str = "auto",
        max_blocks: int | None = None,
    ) -> EngineModel:
        return cls(
            EngineTokenizer.load(path, content_format=content_format),
            VllmBlockHasher(hash_algo, block_size, hash_seed),
            max_blocks,
        )

    def block_hashes(self, kind: str, doc: dict[str, Any]) -> list[int] | None:
        """The engine's block hashes for an OpenAI request body, or None when unknowable."""
        p = engine_prompt(kind, doc, wrap_parts=self.tokenizer.wrap_parts)
        if p is None:
            return None
        ids = self.tokenizer.tokens(p)
        if ids is None:
            return None
        return self.hasher.hashes(ids, cache_salt=p.cache_salt, max_blocks=self.max_blocks)


@dataclass(slots=True)
class SubscriberStats:
    messages: int = 0
    bad_frames: int = 0
    bad_payloads: int = 0
    replays: int = 0
    replayed: int = 0
    replay_timeouts: int = 0


class KVEventSubscriber:
    """One engine's KV event stream into a KVSequencer (a KVIndexFeed here, a
    KVDigestTracker in `meshd agent`): a SUB socket, a DEALER to the engine's replay ROUTER
    when a gap opens, and a periodic `tick` for feeds that watch for silence.

    `on_restart()` is called when the feed saw the engine's sequence start again (a new
    process); `on_replay(start_seq, replayed, lost, started_ns)` after each replay (how many
    batches it brought, whether the gap was given up, when it began: wall-clock ns).
    """

    def __init__(
        self,
        feed: KVSequencer,
        endpoint: str,
        *,
        replay: str | None = None,
        topic: str = "",
        bind: bool = False,
        context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = 1.0,
        tick_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        on_restart: Callable[[], None] | None = None,
        on_replay: Callable[[int, int, bool, int], None] | None = None,
    ) -> None:
        self.feed = feed
        self.endpoint = endpoint
        self.replay = replay
        self.topic = topic
        self.bind = bind
        self.replay_timeout_s = replay_timeout_s
        self.tick_s = tick_s
        self.clock = clock
        self.on_restart = on_restart
        self.on_replay = on_replay
        self.stats = SubscriberStats()
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self.bound: str | None = None  # the address bound, with bind=True

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kv-events {self.endpoint}")
            await self._ready.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._own_ctx:
            self._ctx.destroy(linger=0)

    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            if self.bind:
                sub.bind(self.endpoint)
                self.bound = sub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                sub.connect(self.endpoint)
            self._ready.set()
            tick = getattr(self.feed, "tick", None)
            next_tick = self.clock() + self.tick_s
            while True:
                # A feed without `tick` (the agent's KVDigestTracker) waits for frames alone:
                # a timeout that stayed at 0 would spin without yielding to the loop.
                timeout_ms = (
                    None if tick is None else max(0, int((next_tick - self.clock()) * 1000))
                )
                if await sub.poll(timeout_ms):
                    frames = await sub.recv_multipart()
                    try:
                        await self.on_frames(frames)
                    except asyncio.CancelledError:
                        raise
                    except Exception:  # a bug must cost one batch, not the stream
                        log.exception("KV event handling failed for %s", self.endpoint)
                if tick is not None and self.clock() >= next_tick:
                    tick(self.clock())
                    next_tick = self.clock() + self.tick_s
        finally:
            self._ready.set()
            sub.close(linger=0)

    async def on_frames(self, frames: Sequence[bytes]) -> None:
        """One PUB message (public so tests and the agent can drive it directly)."""
        try:
            _, seq, payload = parse_pub_frames(frames)
        except KVEventError:
            self.stats.bad_frames += 1
            return
        self.stats.messages += 1
        try:
            result = self.feed.feed(seq, payload, self.clock())
        except KVEventError as exc:
            self.stats.bad_payloads += 1
            log.warning("%s: bad KV event batch %d: %s", self.endpoint, seq, exc)
            return
        if result.restarted and self.on_restart is not None:
            self.on_restart()
        if result.replay_from is not None:
            await self.replay_from(result.replay_from)

    async def replay_from(self, start_seq: int) -> None:
        """Ask the replay ROUTER for batches from start_seq; a gap it does not fill (or no
        replay socket, or no answer in time) is given up."""
        if not self.replay:
            self.feed.abandon_gap(self.clock())
            return
        self.stats.replays += 1
        started_ns = time.time_ns()
        replayed = 0
        lost = False
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay)
        try:
            await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.replay_timeout_s
            while True:
                left = deadline - loop.time()
                if left <= 0 or not await dealer.poll(left * 1000):
                    self.stats.replay_timeouts += 1
                    log.warning("%s: replay from %d timed out", self.endpoint, start_seq)
                    break
                try:
                    item = parse_replay_frames(await dealer.recv_multipart())
                except KVEventError:
                    self.stats.bad_frames += 1
                    continue
                if item is None:
                    break
                self.stats.replayed += 1
                replayed += 1
                with contextlib.suppress(KVEventError):
                    self.feed.feed(item[0], item[1], self.clock())
        finally:
            dealer.close(linger=0)
            if self.feed.end_replay(self.clock()):
                lost = True
                log.warning(
                    "%s: KV events from %d lost; its entries cleared", self.endpoint, start_seq
                )
            if self.on_replay is not None:
                self.on_replay(start_seq, replayed, lost, started_ns)


@dataclass(slots=True)
class _Engine:
    model: str
    feed: KVIndexFeed
    subscriber: KVEventSubscriber


@dataclass(slots=True)
class PrecisePrefix:
    """The precise prefix path of one router: models with a tokenizer, and a KV event feed
    per engine into `index` (the picker's PrefixIndex, built with track_blocks=True)."""

    index: PrefixIndex
    feed_options: dict[str, Any] = field(default_factory=dict)
    models: dict[str, EngineModel] = field(default_factory=dict)
    engines: dict[str, _Engine] = field(default_factory=dict)
    _ctx: zmq.asyncio.Context | None = None

    def add_model(self, name: str, model: EngineModel) -> None:
        self.models[name] = model

    def block_hashes(self, model: str, kind: str, doc: dict[str, Any]) -> list[int] | None:
        """The request's engine block hashes, or None (no tokenizer for the model, or a
        request whose tokens cannot be known): then use the text-block hashes."""
        m = self.models.get(model)
        if m is None:
            return None
        return m.block_hashes(kind, doc)

    def block_size(self, model: str) -> int | None:
        m = self.models.get(model)
        return None if m is None else m.hasher.block_size

    def add_engine(
        self,
        name: str,
        model: str,
        endpoint: str,
        *,
        replay: str | None = None,
        topic: str = "",
        bind: bool = False,
    ) -> KVIndexFeed:
        """Follow engine `name` (the picker's endpoint name) at its KV event `endpoint`."""
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        m = self.models.get(model)
        feed = KVIndexFeed(
            self.index, name, verify=m.hasher if m is not None else None, **self.feed_options
        )
        sub = KVEventSubscriber(
            feed, endpoint, replay=replay, topic=topic, bind=bind, context=self._ctx
        )
        self.engines[name] = _Engine(model, feed, sub)
        return feed

    async def start(self) -> None:
        for e in self.engines.values():
            await e.subscriber.start()

    async def close(self) -> None:
        for e in self.engines.values():
            await e.subscriber.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def engine_restarted(self, name: str, now: float) -> None:
        """Another signal (a new epoch on /metrics, the process gone and back) says the
        engine restarted: its entries go."""
        e = self.engines.get(name)
        if e is not None:
            e.feed.restart(now)

    def snapshot(self) -> list[dict[str, Any]]:
        out = []
        for name, e in self.engines.items():
            f, s = e.feed, e.subscriber.stats
            out.append(
                {
                    "engine": name,
                    "model": e.model,
                    "batches": f.batches,
                    "stored_blocks": f.stored_blocks,
                    "removed_blocks": f.removed_blocks,
                    "orphan_stores": f.orphan_stores,
                    "clears": f.clears,
                    "gaps": f.gaps,
                    "lost_gaps": f.lost_gaps,
                    "restarts": f.restarts,
                    "silences": f.silences,
                    "hash_checks": f.hash_checks,
                    "hash_mismatches": f.hash_mismatches,
                    "held_blocks": self.index.used_blocks(name),
                    "trust": self.index.trust(name),
                    "replays": s.replays,
                    "bad_frames": s.bad_frames + s.bad_payloads,
                }
            )
        return out
