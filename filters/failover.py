"""Mid-stream failover, the sans-I/O part: watch a stream on its way to the client, build
the continuation request when the upstream dies after the first byte, and rewrite the
continuation's events so the client sees one unbroken stream. Bytes and dicts in, bytes out.

Continuation (vLLM's OpenAI-compatible server, vllm-project/vllm:
vllm/entrypoints/openai/protocol.py, ChatCompletionRequest):
- completions: prompt + the text already sent; max_tokens (and min_tokens) reduced by the
  tokens already sent.
- chat: the messages plus the partial assistant message, with `continue_final_message:
  true` ("the chat will be formatted so that the final message in the chat is open-ended,
  without any EOS tokens. The model will continue this message rather than starting a new
  one") and `add_generation_prompt: false` (vLLM refuses both true at once);
  max_tokens / max_completion_tokens reduced. `stream_options.include_usage` is forced on
  so the splice can correct the final usage.
- Refused (FailoverUnsupported) where resuming from text would change the answer: n > 1,
  best_of / beam search, echo, token-id prompts, structured output (response_format
  json_*, guided_*, structured_outputs: the grammar would restart at the partial text),
  and streams that already carried tool calls or reasoning.

Exactness: for a deterministic engine whose next token depends only on the text so far,
original prefix + continuation = the uninterrupted output (tests/test_failover.py checks
it at random split points). Real tokenizers can merge across the seam (the text is
re-tokenized), and chat templates that trim message content drop trailing whitespace of
the partial message; both change at most the token at the seam.

Splice (what the client sees): every continuation event gets the original's `id`,
`created` and `model`; the continuation's role chunk (chat) is dropped; `usage` becomes
prompt_tokens = the original's (when unknown: the continuation's minus the tokens sent,
since its prompt is the original plus them), completion_tokens = sent + the
continuation's, total = their sum; usage chunks are dropped if the client did not ask for
usage. Event framing follows WHATWG SSE as filters/sse.py does.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from typing import Any, Literal

__all__ = [
    "DEFAULT_MAX_EVENT_BYTES",
    "FailoverUnsupported",
    "StreamKind",
    "StreamRecorder",
    "StreamSplicer",
    "continuation_body",
    "failover_refusal",
    "remaining_tokens",
]

StreamKind = Literal["completion", "chat"]
DEFAULT_MAX_EVENT_BYTES = 1 << 20  # as filters/sse.py: a vLLM chunk is a few hundred bytes

_EOL = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"
_DONE = b"[DONE]"
_STRUCTURED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


class FailoverUnsupported(ValueError):
    """This stream cannot be continued on another endpoint; the message says why."""


# -- the continuation request ------------------------------------------------------------


def failover_refusal(kind: StreamKind, body: Mapping[str, Any]) -> str | None:
    """Why a request cannot be resumed mid-stream, or None when it can."""
    if (body.get("n") or 1) != 1:
        return "n > 1"
    best_of = body.get("best_of")
    if (isinstance(best_of, int) and best_of > 1) or body.get("use_beam_search"):
        return "best_of or beam search"
    if body.get("echo"):
        return "echo"
    fmt = body.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
        return f"response_format {fmt.get('type')}"
    for key in _STRUCTURED:
        if body.get(key) is not None:
            return key
    if kind == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return None
        if not isinstance(prompt, str):
            return "the prompt is not a single string"
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "no messages"
    return None


def remaining_tokens(kind: StreamKind, body: Mapping[str, Any], tokens_sent: int) -> int | None:
    """Output tokens the continuation may still produce (None: the request set no limit)."""
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    for name in names:
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool):
            return v - tokens_sent
    return None


def continuation_body(
    kind: StreamKind, body: Mapping[str, Any], text_sent: str, tokens_sent: int
) -> dict[str, Any]:
    """The request that continues `body` after `text_sent` (`tokens_sent` tokens) reached
    the client. Raises FailoverUnsupported when it cannot (see failover_refusal), or when
    max_tokens is used up: then end the stream with StreamSplicer.synthesize_end."""
    refusal = failover_refusal(kind, body)
    if refusal is not None:
        raise FailoverUnsupported(f"cannot resume a request with {refusal}")
    left = remaining_tokens(kind, body, tokens_sent)
    if left is not None and left <= 0:
        raise FailoverUnsupported("max_tokens already reached")
    out: dict[str, Any] = copy.deepcopy(dict(body))
    for name in ("max_tokens", "max_completion_tokens"):
        v = out.get(name)
        if isinstance(v, int) and not isinstance(v, bool):
            out[name] = max(1, v - tokens_sent)
    min_tokens = out.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens:
        out["min_tokens"] = max(0, min_tokens - tokens_sent)
    out["stream"] = True
    opts = out.get("stream_options")
    opts = dict(opts) if isinstance(opts, Mapping) else {}
    opts["include_usage"] = True
    out["stream_options"] = opts
    if kind == "completion":
        prompt = out["prompt"]
        out["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + text_sent
        return out
    messages: list[Any] = out["messages"]
    last = messages[-1]
    if (
        body.get("continue_final_message")
        and isinstance(last, dict)
        and last.get("role") == "assistant"
        and isinstance(last.get("content"), str)
    ):
        # The client was already prefilling the assistant turn: extend that message.
        last["content"] = last["content"] + text_sent
    else:
        messages.append({"role": "assistant", "content": text_sent})
    out["continue_final_message"] = True
    out["add_generation_prompt"] = False
    out["echo"] = False
    return out


# -- event framing ----------------------------------------------------------------------


class _Events:
    """Splits bytes into complete SSE events: (raw bytes, data value or None). Scans only
    new bytes; an event larger than max_event_bytes raises FailoverUnsupported."""

    __slots__ = ("_buf", "_data", "_head", "_max", "_pos")

    def __init__(self, max_event_bytes: int) -> None:
        self._buf = bytearray()
        self._pos = 0  # scanning resumes here (start of an unterminated line)
        self._data: list[bytes] = []  # data values of the current event
        self._head = True  # a leading BOM is still possible
        self._max = max_event_bytes

    def feed(self, chunk: bytes, *, final: bool = False) -> list[tuple[bytes, bytes | None]]:
        """`final`: the stream ended, so a trailing CR ends its line (no LF can follow)."""
        buf = self._buf
        buf += chunk
        if self._head:
            if len(buf) < 3 and _BOM.startswith(bytes(buf)):
                return []
            self._head = False
            if buf.startswith(_BOM):
                del buf[:3]
        out: list[tuple[bytes, bytes | None]] = []
        start = 0
        pos = self._pos
        n = len(buf)
        while True:
            m = _EOL.search(buf, pos)
            if m is None or (not final and m.end() == n and buf[n - 1] == 0x0D):
                break  # no terminator yet, or a CR that may be the first half of CRLF
            line = bytes(buf[pos : m.start()])
            pos = m.end()
            if not line:
                data = b"\n".join(self._data) if self._data else None
                out.append((bytes(buf[start:pos]), data))
                self._data = []
                start = pos
            elif line.startswith(b"data:"):
                self._data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif line == b"data":
                self._data.append(b"")
        del buf[:start]
        self._pos = pos - start
        if len(buf) > self._max:
            raise FailoverUnsupported(f"an SSE event exceeds {self._max} bytes")
        return out

    def reset(self) -> int:
        """Forget a partial event (its upstream died); returns the bytes dropped."""
        n = len(self._buf)
        self._buf = bytearray()
        self._pos = 0
        self._data = []
        return n


def _decode(data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _encode(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


# -- the original stream ---------------------------------------------------------------------


class StreamRecorder:
    """Sits on the stream to the client. `feed` returns the bytes of complete events only
    (a failure mid-event must not leave half an event at the client: a continuation could
    not be spliced after it) and records what the client has seen: `response_id`,
    `created`, `model`, `text` (choice 0), `tokens` (token-bearing events of choice 0, or
    usage.completion_tokens when the stream carries usage per chunk), `finish_reason`,
    `usage`, `done`, and `refusal` (why it can no longer be resumed, if so).

    Feed it the spliced continuation too: a second failure then resumes from all of it.
    """

    __slots__ = (
        "_events",
        "_parts",
        "_token_events",
        "_usage_tokens",
        "created",
        "done",
        "finish_reason",
        "kind",
        "model",
        "refusal",
        "response_id",
        "role_sent",
        "usage",
    )

    def __init__(self, kind: StreamKind, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.kind = kind
        self._events = _Events(max_event_bytes)
        self._parts: list[str] = []
        self._token_events = 0
        self._usage_tokens: int | None = None
        self.response_id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.refusal: str | None = None
        self.role_sent = False  # chat: the client has its role chunk

    @property
    def text(self) -> str:
        return "".join(self._parts)

    @property
    def tokens(self) -> int:
        u = self._usage_tokens
        return self._token_events if u is None else max(u, self._token_events)

    @property
    def finished(self) -> bool:
        """The stream already ended (a finish reason or [DONE]): nothing to resume."""
        return self.done or self.finish_reason is not None

    def feed(self, chunk: bytes, *, final: bool = False) -> bytes:
        out = []
        for raw, data in self._events.feed(chunk, final=final):
            out.append(raw)
            if data is not None:
                self._observe(data)
        return b"".join(out)

    def close(self) -> bytes:
        """End of stream: a last event terminated by a bare CR is complete now."""
        return self.feed(b"", final=True)

    def discard_partial(self) -> int:
        """The upstream died: drop the partial event it left (it never reached the
        client), so the continuation's events follow whole ones. Returns bytes dropped."""
        return self._events.reset()

    def _observe(self, data: bytes) -> None:
        if data == _DONE:
            self.done = True
            return
        obj = _decode(data)
        if not isinstance(obj, dict):
            return
        if self.response_id is None and isinstance(obj.get("id"), str):
            self.response_id = obj["id"]
        if self.created is None and _int(obj.get("created")) is not None:
            self.created = obj["created"]
        if self.model is None and isinstance(obj.get("model"), str):
            self.model = obj["model"]
        usage = obj.get("usage")
        choices = obj.get("choices")
        if isinstance(usage, dict):
            self.usage = usage
            if choices:  # usage per chunk (continuous_usage_stats): exact token count
                self._usage_tokens = _int(usage.get("completion_tokens"))
        if not isinstance(choices, list):
            return
        for ch in choices:
            if not isinstance(ch, dict) or ch.get("index", 0) != 0:
                continue
            piece: Any = ch.get("text") if self.kind == "completion" else None
            delta = ch.get("delta")
            if isinstance(delta, dict):
                piece = delta.get("content")
                if "role" in delta:
                    self.role_sent = True
                if delta.get("tool_calls"):
                    self.refusal = "tool calls were streamed"
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self.refusal = "reasoning was streamed"
            if isinstance(piece, str) and piece:
                self._parts.append(piece)
                self._token_events += 1
            fr = ch.get("finish_reason")
            if isinstance(fr, str):
                self.finish_reason = fr


# -- the continuation stream -----------------------------------------------------------------


class StreamSplicer:
    """Rewrites a continuation's SSE bytes into the original stream's identity. `feed`
    any split of the continuation's bytes; write what it returns to the client."""

    __slots__ = (
        "_events",
        "created",
        "done",
        "include_usage",
        "kind",
        "model",
        "prompt_tokens",
        "response_id",
        "role_sent",
        "tokens_sent",
        "usage",
    )

    def __init__(
        self,
        kind: StreamKind,
        *,
        response_id: str | None,
        created: int | None,
        model: str | None,
        tokens_sent: int,
        prompt_tokens: int | None,
        include_usage: bool,
        role_sent: bool = True,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    ) -> None:
        self.kind = kind
        self.role_sent = role_sent
        self.response_id = response_id
        self.created = created
        self.model = model
        self.tokens_sent = tokens_sent
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage
        self.usage: dict[str, Any] | None = None  # the corrected usage, once seen
        self.done = False
        self._events = _Events(max_event_bytes)

    @classmethod
    def after(
        cls, recorder: StreamRecorder, *, include_usage: bool, prompt_tokens: int | None = None
    ) -> StreamSplicer:
        """A splicer for what `recorder` has seen so far."""
        return cls(
            recorder.kind,
            response_id=recorder.response_id,
            created=recorder.created,
            model=recorder.model,
            tokens_sent=recorder.tokens,
            prompt_tokens=prompt_tokens,
            include_usage=include_usage,
            role_sent=recorder.role_sent,
        )

    def close(self) -> bytes:
        """End of the continuation: a last event terminated by a bare CR is complete now
        (an unterminated one is discarded, as WHATWG SSE says)."""
        return self.feed(b"", final=True)

    def feed(self, chunk: bytes, *, final: bool = False) -> bytes:
        out = []
        for raw, data in self._events.feed(chunk, final=final):
            if data is None:
                out.append(raw)  # comments, keep-alives
            elif data == _DONE:
                self.done = True
                out.append(b"data: [DONE]\n\n")
            else:
                obj = _decode(data)
                if not isinstance(obj, dict):
                    out.append(raw)
                    continue
                rewritten = self._rewrite(obj)
                if rewritten is not None:
                    out.append(_encode(rewritten))
        return b"".join(out)

    def corrected_usage(self, usage: Mapping[str, Any]) -> dict[str, Any]:
        fixed = dict(usage)
        completion = (_int(usage.get("completion_tokens")) or 0) + self.tokens_sent
        prompt = self.prompt_tokens
        if prompt is None:
            prompt = max(0, (_int(usage.get("prompt_tokens")) or 0) - self.tokens_sent)
        fixed["prompt_tokens"] = prompt
        fixed["completion_tokens"] = completion
        fixed["total_tokens"] = prompt + completion
        return fixed

    def _rewrite(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        if "error" in obj and "choices" not in obj:
            return obj
        if self.response_id is not None:
            obj["id"] = self.response_id
        if self.created is not None:
            obj["created"] = self.created
        if self.model is not None and "model" in obj:
            obj["model"] = self.model
        choices = obj.get("choices")
        had_choices = isinstance(choices, list) and bool(choices)
        if self.kind == "chat" and self.role_sent and isinstance(choices, list):
            kept = [c for c in choices if not _drop_role_only(c)]
            obj["choices"] = choices = kept
        usage = obj.get("usage")
        if isinstance(usage, dict):
            fixed = self.corrected_usage(usage)
            self.usage = fixed
            if self.include_usage:
                obj["usage"] = fixed
            else:
                del obj["usage"]
                if not choices:
                    return None
        if had_choices and not choices and not isinstance(obj.get("usage"), dict):
            return None  # it was only the continuation's role chunk
        return obj

    def synthesize_end(self, finish_reason: str = "length") -> bytes:
        """End the stream without a continuation (max_tokens already reached): a final
        chunk with `finish_reason`, usage if the client asked for it, and [DONE]."""
        base: dict[str, Any] = {}
        if self.response_id is not None:
            base["id"] = self.response_id
        if self.created is not None:
            base["created"] = self.created
        if self.model is not None:
            base["model"] = self.model
        if self.kind == "chat":
            base["object"] = "chat.completion.chunk"
            choice: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": finish_reason}
        else:
            base["object"] = "text_completion"
            choice = {"index": 0, "text": "", "finish_reason": finish_reason}
        out = [_encode({**base, "choices": [choice]})]
        if self.include_usage:
            prompt = self.prompt_tokens or 0
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": self.tokens_sent,
                "total_tokens": prompt + self.tokens_sent,
            }
            self.usage = usage
            out.append(_encode({**base, "choices": [], "usage": usage}))
        out.append(b"data: [DONE]\n\n")
        self.done = True
        return b"".join(out)


def _drop_role_only(choice: Any) -> bool:
    """Strip the role from a chat choice; True when nothing is left worth sending."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if not isinstance(delta, dict) or "role" not in delta:
        return False
    delta.pop("role")
    if choice.get("finish_reason") is not None or choice.get("logprobs"):
        return False
    return not any(v not in (None, "", []) for v in delta.values())
