"""The response cache, the sans-I/O part: which requests may be answered from a stored
answer, under which key, how an answer is recorded and replayed (as the form the client
asked for: one JSON body or an SSE stream), and the in-memory store. Bytes and dicts in,
bytes out; wall-clock time passed in. The Redis store and the waiting of coalesced
requests are I/O: meshd/response_cache.py.

Which requests (a pool's `response_cache` rule, and the request's `Cache-Control`):
- deterministic ones: `temperature` 0, or a `seed` given (vLLM seeds each request's own
  sampler), with `n` and `best_of` 1 and no beam search. Such a request asked twice is
  asked for the same answer; an engine may still differ between two runs (batch-dependent
  kernels), and the cache then serves one of the answers the engine gave, never another.
- opted in: a request whose `Cache-Control` carries `max-age=N` (N > 0; the client takes an
  answer up to N seconds old) or `only-if-cached`, whatever its sampling (RFC 9111 5.2.1).
- `Cache-Control: no-store`: neither looked up nor stored. `no-cache`: not answered from
  the cache, but the fresh answer is stored. `only-if-cached`: a miss is a 504 (RFC 9111
  5.2.1.7), the engine is not asked.

The key: sha256 over the tenant, the partition headers' values (an API key), the request
kind and the canonical request (JSON with sorted keys) without the fields that only shape
the transport: `stream`, `stream_options.include_usage` and `user`. The model (and so a
LoRA adapter, which vLLM names as a model) stays in it. Numbers are kept as written
(`0` and `0.0` are two keys: a miss, never a wrong answer).

Records: a whole answer is kept as the engine's bytes; a stream as its events (each
`data: <json>\\n\\n`) without the usage-only chunk and `[DONE]`, its usage beside them.
Replayed in the same form they are the engine's bytes (the stream gets its usage chunk
back, as the engine sent it, when the client asks for usage); in the other form they are
converted when the answer is plain text (one choice, content or text only, no logprobs,
tool calls or reasoning), and are a miss otherwise. Never recorded: a status other than
200, an error event, a stream that did not end with `[DONE]` or was resumed on another
engine, an answer over the size limit.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

__all__ = [
    "KEY_VERSION",
    "CacheControl",
    "CacheDecision",
    "CachedAnswer",
    "MemoryStore",
    "answer_from_stream",
    "answer_from_whole",
    "cache_key",
    "decide",
    "decode_answer",
    "encode_answer",
    "is_deterministic",
    "parse_cache_control",
    "render",
]

KEY_VERSION = 1  # part of every key: a change of canonical form is a change of key
Mode = Literal["deterministic", "opt-in", "off"]
# Transport-only request fields: they change how the answer travels, not what it says.
_TRANSPORT_ONLY = frozenset({"stream", "stream_options", "user"})
_EOL = re.compile(rb"\r\n|\r|\n")
_DONE = b"[DONE]"
_ENTRY_OVERHEAD = 256  # bytes a stored entry costs beyond its body and key (estimate)


# -- which requests ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CacheControl:
    """The request directives of RFC 9111 5.2.1 that the cache acts on."""

    no_store: bool = False
    no_cache: bool = False
    only_if_cached: bool = False
    max_age_s: float | None = None


_NO_DIRECTIVES = CacheControl()


def parse_cache_control(values: Iterable[str]) -> CacheControl:
    """Every `Cache-Control` header value of a request, merged. Unknown directives and
    malformed arguments are ignored (RFC 9111 5.2: a cache ignores what it does not
    understand); of two max-age values the smaller wins."""
    no_store = no_cache = only_if_cached = False
    max_age: float | None = None
    found = False
    for value in values:
        for part in value.split(","):
            name, _, arg = part.strip().partition("=")
            name = name.strip().lower()
            if not name:
                continue
            found = True
            if name == "no-store":
                no_store = True
            elif name == "no-cache":
                no_cache = True
            elif name == "only-if-cached":
                only_if_cached = True
            elif name == "max-age":
                arg = arg.strip().strip('"')
                if arg.isdigit() and arg.isascii():
                    age = float(min(int(arg[:12]), 2**31))
                    max_age = age if max_age is None else min(max_age, age)
    if not found:
        return _NO_DIRECTIVES
    return CacheControl(no_store, no_cache, only_if_cached, max_age)


@dataclass(frozen=True, slots=True)
class CacheDecision:
    """What the cache does with one request. `lookup`: may be answered from the cache;
    `store`: its answer may be recorded; `reason`: why neither, or how it qualified."""

    lookup: bool
    store: bool
    reason: str
    max_age_s: float | None = None
    only_if_cached: bool = False

    @property
    def cacheable(self) -> bool:
        return self.lookup or self.store


def is_deterministic(doc: Mapping[str, Any]) -> bool:
    """Asked twice, asked for the same answer: greedy (`temperature` 0) or seeded, one
    choice, no beam search."""
    if not _single_choice(doc):
        return False
    temperature = doc.get("temperature")
    if _number(temperature) and temperature == 0:
        return True
    seed = doc.get("seed")
    return isinstance(seed, int) and not isinstance(seed, bool)


def _single_choice(doc: Mapping[str, Any]) -> bool:
    n, best_of = doc.get("n"), doc.get("best_of")
    if n not in (None, 1) or best_of not in (None, 1):
        return False
    return not doc.get("use_beam_search")


def decide(doc: Mapping[str, Any], mode: Mode, cc: CacheControl) -> CacheDecision:
    """The cache's rule for one request (the module's docstring says it in words)."""
    if mode == "off":
        return CacheDecision(False, False, "off")
    if cc.no_store:
        return CacheDecision(False, False, "no-store")
    if not _single_choice(doc):
        return CacheDecision(False, False, "several choices")
    opted_in = cc.only_if_cached or (cc.max_age_s is not None and cc.max_age_s > 0)
    if opted_in:
        reason = "opted in"
    elif mode == "deterministic" and is_deterministic(doc):
        reason = "deterministic"
    else:
        return CacheDecision(
            False, False, "not opted in" if mode == "opt-in" else "not deterministic"
        )
    return CacheDecision(
        lookup=not cc.no_cache,
        store=True,
        reason=reason,
        max_age_s=cc.max_age_s,
        only_if_cached=cc.only_if_cached,
    )


def cache_key(
    kind: str, tenant: str | None, partition: Sequence[str], doc: Mapping[str, Any]
) -> str:
    """64 hex digits naming the answer to `doc` for this tenant and partition."""
    canon = {k: v for k, v in doc.items() if k not in _TRANSPORT_ONLY}
    options = doc.get("stream_options")
    if isinstance(options, Mapping):
        rest = {k: v for k, v in options.items() if k != "include_usage"}
        if rest:
            canon["stream_options"] = rest
    payload = msgspec.json.encode(
        [KEY_VERSION, kind, tenant or "", list(partition), canon], order="sorted"
    )
    return hashlib.sha256(payload).hexdigest()


# -- the record ----------------------------------------------------------------------------


class CachedAnswer(msgspec.Struct, frozen=True):
    """One stored answer. body: the engine's whole JSON body, or (stream) its events
    without the usage-only chunk and [DONE]. stored_at: wall-clock seconds. gpu_seconds and
    cost_usd: what asking the engine again would cost (what each replay avoids)."""

    kind: str  # chat | completion
    stream: bool
    body: bytes
    usage: dict[str, Any] | None
    stored_at: float
    gpu_seconds: float = 0.0
    cost_usd: float = 0.0
    usage_event: bytes = b""  # a stream's usage-only event as the engine sent it

    @property
    def size(self) -> int:
        return len(self.body) + _ENTRY_OVERHEAD

    def age_s(self, now: float) -> float:
        return max(0.0, now - self.stored_at)


_answer_encoder = msgspec.msgpack.Encoder()
_answer_decoder = msgspec.msgpack.Decoder(CachedAnswer)


def encode_answer(answer: CachedAnswer) -> bytes:
    return _answer_encoder.encode(answer)


def decode_answer(data: bytes) -> CachedAnswer | None:
    """A stored record, or None when it is not one (another version, corrupted)."""
    try:
        answer = _answer_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return answer if answer.kind in ("chat", "completion") else None


def answer_from_whole(
    kind: str, body: bytes, now: float, *, gpu_seconds: float = 0.0, cost_usd: float = 0.0
) -> CachedAnswer | None:
    """The record of a 200 whole answer, or None when it is not one to keep (not JSON,
    an error object, no choices)."""
    obj = _loads(body)
    if not isinstance(obj, dict) or "error" in obj or not isinstance(obj.get("choices"), list):
        return None
    if not obj["choices"]:
        return None
    usage = obj.get("usage")
    return CachedAnswer(
        kind, False, body, usage if isinstance(usage, dict) else None, now, gpu_seconds, cost_usd
    )


def answer_from_stream(
    kind: str, raw: bytes, now: float, *, gpu_seconds: float = 0.0, cost_usd: float = 0.0
) -> CachedAnswer | None:
    """The record of a whole 200 SSE stream (every byte the engine sent), or None when it
    is not one to keep: an event that is not a JSON object, an error event, no [DONE] at
    the end, or no choices at all."""
    events: list[bytes] = []
    usage: dict[str, Any] | None = None
    usage_event = b""
    done = saw_choice = False
    for data in sse_data(raw):
        if done:
            return None  # events after [DONE]
        if data == _DONE:
            done = True
            continue
        obj = _loads(data)
        if not isinstance(obj, dict) or "error" in obj:
            return None
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return None
        if isinstance(obj.get("usage"), dict):
            usage = obj["usage"]
            if not choices:
                usage_event = b"data: " + data + b"\n\n"  # replayed when asked for
                continue
        saw_choice = saw_choice or bool(choices)
        events.append(b"data: " + data + b"\n\n")
    if not done or not saw_choice:
        return None
    return CachedAnswer(
        kind, True, b"".join(events), usage, now, gpu_seconds, cost_usd, usage_event
    )


def sse_data(raw: bytes) -> list[bytes]:
    """The data of each complete event in `raw` (WHATWG SSE: lines ending in CR, LF or
    CRLF, `data:` fields joined by LF, comments and other fields skipped)."""
    out: list[bytes] = []
    data: list[bytes] = []
    for line in _EOL.split(raw):
        if not line:
            if data:
                out.append(b"\n".join(data))
                data = []
        elif line.startswith(b"data:"):
            data.append(line[6:] if line[5:6] == b" " else line[5:])
    return out


# -- replay --------------------------------------------------------------------------------


def render(answer: CachedAnswer, *, stream: bool, include_usage: bool) -> bytes | None:
    """The answer as the client asked for it: one JSON body, or an SSE stream ending in
    [DONE] (with the usage chunk when `include_usage`); None when this record cannot give
    that form (it is then a miss)."""
    if stream:
        if include_usage and answer.usage is None:
            return None
        events = answer.body if answer.stream else _whole_to_events(answer)
        if events is None:
            return None
        if include_usage and answer.usage_event:
            events += answer.usage_event
        elif include_usage:
            head = _first_event(events)
            if head is None:
                return None
            events += _event(
                {
                    "id": head.get("id"),
                    "object": head.get("object"),
                    "created": head.get("created"),
                    "model": head.get("model"),
                    "choices": [],
                    "usage": answer.usage,
                }
            )
        return events + b"data: [DONE]\n\n"
    if not answer.stream:
        return answer.body
    return _events_to_whole(answer)


def _whole_to_events(answer: CachedAnswer) -> bytes | None:
    obj = _loads(answer.body)
    if not isinstance(obj, dict):
        return None
    plain = _plain_whole_choice(answer.kind, obj)
    if plain is None:
        return None
    text, finish_reason, stop_reason = plain
    chat = answer.kind == "chat"
    head = {
        "id": obj.get("id"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": obj.get("created"),
        "model": obj.get("model"),
    }

    def chunk(piece: dict[str, Any]) -> bytes:
        return _event({**head, "choices": [{"index": 0, **piece}]})

    end: dict[str, Any] = {"logprobs": None, "finish_reason": finish_reason}
    if stop_reason is not None:
        end["stop_reason"] = stop_reason
    if chat:
        role = {"delta": {"role": "assistant", "content": ""}, "logprobs": None}
        return (
            chunk({**role, "finish_reason": None})
            + chunk({"delta": {"content": text}, "logprobs": None, "finish_reason": None})
            + chunk({"delta": {"content": ""}, **end})
        )
    return chunk({"text": text, "logprobs": None, "finish_reason": None}) + chunk(
        {"text": "", **end}
    )


def _plain_whole_choice(kind: str, obj: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
    """(text, finish_reason, stop_reason) of a whole answer's single plain choice."""
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    ch = choices[0]
    if ch.get("index", 0) != 0 or ch.get("logprobs") is not None:
        return None
    if kind == "chat":
        msg = ch.get("message")
        if not isinstance(msg, dict) or msg.get("role", "assistant") != "assistant":
            return None
        text = msg.get("content")
        if any(_set(v) for k, v in msg.items() if k not in ("role", "content")):
            return None
    else:
        text = ch.get("text")
        if _set(ch.get("prompt_logprobs")):
            return None
    if not isinstance(text, str):
        return None
    return text, ch.get("finish_reason"), ch.get("stop_reason")


def _events_to_whole(answer: CachedAnswer) -> bytes | None:
    if answer.usage is None:
        return None  # a whole answer always carries usage
    parts: list[str] = []
    head: dict[str, Any] | None = None
    finish_reason: Any = None
    stop_reason: Any = None
    chat = answer.kind == "chat"
    for data in sse_data(answer.body):
        obj = _loads(data)
        if not isinstance(obj, dict):
            return None
        head = head or obj
        for ch in obj.get("choices") or ():
            piece = _plain_stream_piece(chat, ch)
            if piece is None:
                return None
            parts.append(piece)
            if ch.get("finish_reason") is not None:
                finish_reason = ch["finish_reason"]
                stop_reason = ch.get("stop_reason")
    if head is None:
        return None
    choice: dict[str, Any] = {"index": 0}
    if chat:
        choice["message"] = {"role": "assistant", "content": "".join(parts)}
    else:
        choice["text"] = "".join(parts)
    choice.update(logprobs=None, finish_reason=finish_reason, stop_reason=stop_reason)
    whole = {
        "id": head.get("id"),
        "object": "chat.completion" if chat else "text_completion",
        "created": head.get("created"),
        "model": head.get("model"),
        "choices": [choice],
        "usage": answer.usage,
    }
    return _dumps(whole)


def _plain_stream_piece(chat: bool, ch: Any) -> str | None:
    """A stream choice's text when it is plain (index 0, no logprobs, content or text
    only), else None."""
    if not isinstance(ch, dict) or ch.get("index", 0) != 0 or ch.get("logprobs") is not None:
        return None
    if chat:
        delta = ch.get("delta")
        if not isinstance(delta, dict):
            return None
        if any(_set(v) for k, v in delta.items() if k not in ("role", "content")):
            return None
        piece = delta.get("content")
    else:
        piece = ch.get("text")
    if piece is None:
        return ""
    return piece if isinstance(piece, str) else None


def _first_event(events: bytes) -> dict[str, Any] | None:
    for data in sse_data(events):
        obj = _loads(data)
        return obj if isinstance(obj, dict) else None
    return None


def _set(v: Any) -> bool:
    """A field that says something: not null, not an empty list, string or object."""
    return v is not None and v != [] and v != "" and v != {}


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _event(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


# -- the in-memory store -------------------------------------------------------------------


class MemoryStore:
    """Answers by key, least recently used first out, bounded in bytes (each entry its
    body plus an overhead estimate), each kept at most `ttl_s`. Wall-clock time in."""

    __slots__ = ("_entries", "bytes", "evictions", "expired", "max_bytes", "ttl_s")

    def __init__(self, max_bytes: int, ttl_s: float) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, CachedAnswer] = OrderedDict()
        self.bytes = 0
        self.evictions = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, now: float, max_age_s: float | None = None) -> CachedAnswer | None:
        """The answer stored under `key`, if younger than the TTL (and than `max_age_s`)."""
        answer = self._entries.get(key)
        if answer is None:
            return None
        age = answer.age_s(now)
        if age >= self.ttl_s:
            self._drop(key, answer)
            self.expired += 1
            return None
        if max_age_s is not None and age > max_age_s:
            return None  # too old for this client; still fresh for others
        self._entries.move_to_end(key)
        return answer

    def put(self, key: str, answer: CachedAnswer) -> bool:
        """Store (replacing an older answer under the key); False when it is larger than
        the whole store."""
        size = answer.size + len(key)
        if size > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.size + len(key)
        while self._entries and self.bytes + size > self.max_bytes:
            k, a = self._entries.popitem(last=False)
            self.bytes -= a.size + len(k)
            self.evictions += 1
        self._entries[key] = answer
        self.bytes += size
        return True

    def _drop(self, key: str, answer: CachedAnswer) -> None:
        del self._entries[key]
        self.bytes -= answer.size + len(key)
