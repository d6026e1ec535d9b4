"""Parse an OpenAI-compatible request body into an `InferenceRequest` descriptor.

Sans-I/O: bytes in, a frozen value or a `RequestError` naming the bad field out.
The descriptor carries the text that prefix hashing runs over: the completion
prompt, or the chat messages rendered so that a new turn extends the rendering
of its history (message k's rendering never depends on message k+1).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

RequestKind = Literal["completion", "chat", "embedding"]

PATH_KINDS: dict[str, RequestKind] = {
    "/v1/completions": "completion",
    "/v1/chat/completions": "chat",
    "/v1/embeddings": "embedding",
}

# Rough characters per token for English text, for estimates made before any
# tokenizer is known (token-aware limits refine this from observed usage).
CHARS_PER_TOKEN = 4


class RequestError(ValueError):
    """A client error in the request body; maps onto an OpenAI-style 400."""

    def __init__(
        self, message: str, param: str | None = None, code: str = "invalid_request"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    kind: RequestKind
    model: str
    prompt_text: str
    max_tokens: int | None
    stream: bool
    include_usage: bool
    n: int
    # The parsed body, for the precise prefix path (the engine's tokenizer renders it).
    doc: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def estimated_prompt_tokens(self) -> int:
        return estimate_prompt_tokens(self.prompt_text)


def estimate_prompt_tokens(text: str, chars_per_token: float | None = None) -> int:
    """The prompt's token count from its length: `chars_per_token` (a model's learnt ratio,
    filters/chars_per_token.py), else CHARS_PER_TOKEN."""
    # Conditionals, not max(): the same values; a builtin max() of two costs ~750
    # instructions (its argument tuple and parse), twice a request (issue #22).
    n = (
        len(text) // CHARS_PER_TOKEN
        if chars_per_token is None
        else int(len(text) / chars_per_token)
    )
    return n if n > 1 else 1


# msgspec decodes JSON to the same Python objects as json.loads, integers of any size
# included (orjson turns those beyond 64 bits into floats; a guard against that costs what
# it saves). python -m loadtest.json_bench: 1.5-4x faster than json.loads to decode OpenAI
# bodies with non-ASCII text, 1.3-1.8x for the whole parse (1.15x for a prompt of token ids).
# Where msgspec refuses what the stdlib accepts (NaN, Infinity, lone surrogates, a UTF-8 BOM,
# UTF-16/32 bodies, numbers beyond a double) or the body is not JSON, json.loads decides, so
# result and error text are the stdlib's. One band differs: nesting within ~4 levels of the
# recursion limit, where json.loads raised RecursionError and msgspec decodes.
_DECODER = msgspec.json.Decoder()


def _loads_stdlib(body: bytes) -> Any:
    """The reference decode: json.loads, its failures as RequestError."""
    try:
        return json.loads(body)
    except UnicodeDecodeError:
        raise RequestError("the request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise RequestError(
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise RequestError("the request body nests too deeply to parse") from None
    except ValueError as exc:  # e.g. an integer past sys.get_int_max_str_digits()
        raise RequestError(f"the request body cannot be parsed: {exc}") from None


def _loads(body: bytes) -> Any:
    """msgspec where it accepts the body, else `_loads_stdlib`: the same result either way."""
    try:
        return _DECODER.decode(body)
    except (msgspec.DecodeError, RecursionError, ValueError):
        return _loads_stdlib(body)


_PROMPT_PARAM = {"chat": "messages", "completion": "prompt", "embedding": "input"}


def _check_encodable(prompt: str, kind: RequestKind) -> None:
    """JSON's "\\ud800" is valid JSON and not valid text: no tokenizer (nor our block
    hasher) can encode a lone UTF-16 surrogate, so it is the client's error, a 400."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            f"the prompt holds a lone UTF-16 surrogate ({prompt[exc.start]!r} at character "
            f"{exc.start}), which is not Unicode text and no tokenizer encodes",
            param=_PROMPT_PARAM.get(kind, "prompt"),
        ) from None


def parse_inference_request(kind: RequestKind, body: bytes) -> InferenceRequest:
    return _parse(kind, body, _loads)


def _parse(kind: RequestKind, body: bytes, loads: Callable[[bytes], Any]) -> InferenceRequest:
    if not body:
        raise RequestError("the request body is empty; expected a JSON object")
    doc = loads(body)
    if not isinstance(doc, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(doc).__name__}")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("'model' is required and must be a non-empty string", param="model")
    stream = doc.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    n = doc.get("n", 1)
    if not _is_int(n) or n < 1:
        raise RequestError("'n' must be a positive integer", param="n")
    include_usage = False
    opts = doc.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise RequestError("'stream_options' must be an object", param="stream_options")
        include_usage = bool(opts.get("include_usage", False))

    if kind == "chat":
        prompt = render_messages(doc.get("messages"))
        max_tokens = _max_tokens(doc, ("max_completion_tokens", "max_tokens"))
    elif kind == "completion":
        if "prompt" not in doc:
            raise RequestError("'prompt' is required", param="prompt")
        prompt = _prompt_text(doc["prompt"], "prompt")
        max_tokens = _max_tokens(doc, ("max_tokens",))
    else:
        if "input" not in doc:
            raise RequestError("'input' is required", param="input")
        prompt = _prompt_text(doc["input"], "input")
        max_tokens = None
    if not prompt.isascii():
        _check_encodable(prompt, kind)
    return InferenceRequest(
        kind=kind,
        model=model,
        prompt_text=prompt,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        n=n,
        doc=doc,
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _max_tokens(doc: dict[str, Any], names: tuple[str, ...]) -> int | None:
    for name in names:
        v = doc.get(name)
        if v is None:
            continue
        if not _is_int(v) or v < 0:
            raise RequestError(f"'{name}' must be a non-negative integer", param=name)
        return int(v)
    return None


def _prompt_text(prompt: Any, param: str) -> str:
    """A completion prompt: a string, token ids, or a batch of either. For a batch
    the first element is what prefix hashing sees (batches share their route)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise RequestError(f"'{param}' must not be empty", param=param)
        first = prompt[0]
        if _is_int(first):
            if not all(_is_int(t) for t in prompt):
                raise RequestError(f"'{param}' mixes token ids and other values", param=param)
            return " ".join(map(str, prompt))
        if isinstance(first, str | list):
            if not all(isinstance(p, type(first)) for p in prompt):
                raise RequestError(f"'{param}' batch elements must share one type", param=param)
            return _prompt_text(first, param)
    raise RequestError(
        f"'{param}' must be a string, a list of strings, or a list of token ids", param=param
    )


def render_messages(messages: Any) -> str:
    """Render chat messages for prefix hashing: `<|role|>` + content + newline,
    message by message, so a conversation's rendering is a prefix of the
    rendering of its continuation."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' is required and must be a non-empty list", param="messages")
    parts: list[str] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise RequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(
                f"messages[{i}].role is required and must be a string", param=f"messages[{i}].role"
            )
        parts.append(f"<|{role}|>")
        parts.append(_content_text(msg.get("content"), i))
        if msg.get("tool_calls") is not None:
            parts.append(json.dumps(msg["tool_calls"], sort_keys=True, separators=(",", ":")))
        parts.append("\n")
    return "".join(parts)


def _content_text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict):
                raise RequestError(
                    f"messages[{i}].content parts must be objects", param=f"messages[{i}].content"
                )
            if part.get("type") == "text":
                out.append(str(part.get("text", "")))
            else:
                out.append(json.dumps(part, sort_keys=True, separators=(",", ":")))
        return "".join(out)
    raise RequestError(
        f"messages[{i}].content must be a string or a list of parts",
        param=f"messages[{i}].content",
    )
