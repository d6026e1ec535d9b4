"""vLLM's OpenAI-compatible request and response shapes, sans-I/O (dicts and strings).

Request fields and their defaults follow vLLM's protocol models
(vllm/entrypoints/openai/protocol.py: CompletionRequest, ChatCompletionRequest): completions
default to max_tokens 16, chat to what fits in max_model_len; `n` must be 1 here; sampling
knobs (temperature, top_p, ...) are accepted and ignored, because output is a pure function
of (prompt, seed). Errors use vLLM's ErrorResponse shape
`{"error": {"message", "type", "param", "code"}}` with `code` the HTTP status
(vllm/entrypoints/openai/protocol.py: ErrorInfo). Ids are `cmpl-<id>` and `chatcmpl-<id>`,
the id taken from an `X-Request-Id` header when there is one, as vLLM does.
`kv_transfer_params` (prefill/decode disaggregation, kv_transfer.py) is parsed into
`KVTransferParams`; a prefill step's answer carries its own at the top level. SGLang's
`bootstrap_host`, `bootstrap_port` and `bootstrap_room` are parsed into `Bootstrap`
(sglang/srt/entrypoints/openai/protocol.py: room an integer, a list of them for a batch).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from loadtest.engine.tokenizer import Tokenizer, render_chat

RequestKind = Literal["completion", "chat"]
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """A client-visible error with vLLM's ErrorResponse body (`err_type`: its `type`
    when not the one the status implies). `in_stream`: a streamed request gets it as vLLM
    gives an error its generator raises, after HTTP 200: one `data: {"error": ...}` event,
    then `data: [DONE]`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        err_type: str | None = None,
        in_stream: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type
        self.in_stream = in_stream

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.err_type)


def error_body(
    status: int, message: str, param: str | None = None, err_type: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": err_type
            or ERROR_TYPES.get(
                status, "InternalServerError" if status >= 500 else "BadRequestError"
            ),
            "param": param,
            "code": status,
        }
    }


KV_PARAMS = "kv_transfer_params"


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """A request's `kv_transfer_params` (vLLM's NIXL connector): a prefill step asks for
    `do_remote_decode`, a decode step for `do_remote_prefill` and names the KV's engine,
    blocks and (NIXL connector version 2) request id."""

    do_remote_decode: bool
    do_remote_prefill: bool
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: tuple[int, ...] = ()
    remote_host: str | None = None
    remote_port: int | None = None


def _kv_transfer(body: Mapping[str, Any]) -> KVTransferParams | None:
    raw = body.get(KV_PARAMS)
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ApiError(400, f"{KV_PARAMS} must be an object", KV_PARAMS)
    decode = _bool(raw, "do_remote_decode", False)
    prefill = _bool(raw, "do_remote_prefill", False)
    if decode and prefill:
        raise ApiError(
            400,
            f"{KV_PARAMS}: do_remote_decode and do_remote_prefill cannot both be true",
            KV_PARAMS,
        )
    if not prefill:
        return KVTransferParams(decode, False)
    # vLLM logs a warning and prefills locally on incomplete params; the simulator
    # refuses them, so a router that builds them wrong finds out.
    engine = raw.get("remote_engine_id")
    if not isinstance(engine, str) or not engine:
        raise ApiError(400, f"{KV_PARAMS}.remote_engine_id must be a non-empty string", KV_PARAMS)
    blocks = raw.get("remote_block_ids")
    if (
        not isinstance(blocks, list)
        or not blocks
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks)
    ):
        raise ApiError(
            400, f"{KV_PARAMS}.remote_block_ids must be a non-empty list of block ids", KV_PARAMS
        )
    rid = raw.get("remote_request_id")
    if rid is not None and not isinstance(rid, str):
        raise ApiError(400, f"{KV_PARAMS}.remote_request_id must be a string", KV_PARAMS)
    host = raw.get("remote_host")
    port = raw.get("remote_port")
    return KVTransferParams(
        False,
        True,
        remote_engine_id=engine,
        remote_request_id=rid,
        remote_block_ids=tuple(blocks),
        remote_host=host if isinstance(host, str) else None,
        remote_port=port if isinstance(port, int) and not isinstance(port, bool) else None,
    )


# SGLang's bootstrap fields, and the largest room (its routers draw 0..2**63 - 1).
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
MAX_ROOM = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """A request's SGLang bootstrap fields: the prefill engine to join (host, and port;
    None: the engine's own default) and the room both legs share."""

    host: str | None
    port: int | None
    room: int


def _one(raw: Mapping[str, Any], key: str) -> Any:
    """A bootstrap field's value: a batch of one is its item (the simulator serves n=1)."""
    v = raw.get(key)
    if isinstance(v, list):
        if len(v) != 1:
            raise ApiError(400, f"{key}: a batch of {len(v)}; the simulated engine serves one", key)
        return v[0]
    return v


def _bootstrap(body: Mapping[str, Any]) -> Bootstrap | None:
    if all(body.get(k) is None for k in BOOTSTRAP_FIELDS):
        return None
    room = _one(body, "bootstrap_room")
    if room is None:
        return None  # host/port without a room: SGLang pairs nothing either
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        raise ApiError(
            400,
            f"bootstrap_room must be an integer in [0, 2**63 - 1], got {room!r}",
            "bootstrap_room",
        )
    host = _one(body, "bootstrap_host")
    if host is not None and (not isinstance(host, str) or not host):
        raise ApiError(400, "bootstrap_host must be a non-empty string", "bootstrap_host")
    port = _one(body, "bootstrap_port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                             or not 0 < port < 65536):  # fmt: skip
        raise ApiError(400, "bootstrap_port must be a port number or null", "bootstrap_port")
    return Bootstrap(host, port, room)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: RequestKind
    model: str
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    seed: int
    ignore_eos: bool
    stop: tuple[str, ...]
    min_tokens: int
    kv_transfer: KVTransferParams | None = None
    bootstrap: Bootstrap | None = None


@dataclass(frozen=True, slots=True)
class ApiContext:
    """What request parsing needs to know about the engine."""

    served_model: str
    tokenizer: Tokenizer
    max_model_len: int
    default_seed: int = 0


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{key} must be a boolean", key)
    return v


def _int(body: Mapping[str, Any], key: str, *, minimum: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{key} must be an integer", key)
    if v < minimum:
        raise ApiError(400, f"{key} must be at least {minimum}, got {v}.", key)
    return v


def _check_common(body: Mapping[str, Any], ctx: ApiContext) -> str:
    model = body.get("model")
    if model is not None and model != ctx.served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise ApiError(400, "n must be 1: the simulated engine returns one choice", "n")
    if body.get("stream_options") is not None and not body.get("stream"):
        raise ApiError(
            400, "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    return ctx.served_model


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise ApiError(400, "stop must be a string or a list of strings", "stop")


def _finish_parse(
    kind: RequestKind,
    body: Mapping[str, Any],
    ctx: ApiContext,
    model: str,
    prompt_ids: list[int],
    default_max: int | None,
) -> ParsedRequest:
    if not prompt_ids:
        raise ApiError(400, "The prompt cannot be empty.", "prompt")
    n_prompt = len(prompt_ids)
    room = ctx.max_model_len - n_prompt
    if room <= 0:
        raise ApiError(
            400,
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, "
            f"your request has {n_prompt} input tokens. Please reduce the length of the "
            "input messages.",
            "messages" if kind == "chat" else "prompt",
        )
    max_tokens = _int(body, "max_tokens", minimum=1)
    if kind == "chat":
        mct = _int(body, "max_completion_tokens", minimum=1)
        max_tokens = mct if mct is not None else max_tokens
    if max_tokens is None:
        max_tokens = room if default_max is None else default_max
    if max_tokens > room:
        raise ApiError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
            f"model's maximum context length is {ctx.max_model_len} tokens and your request "
            f"has {n_prompt} input tokens ({max_tokens} > {ctx.max_model_len} - {n_prompt}).",
            "max_tokens",
        )
    seed = _int(body, "seed", minimum=-(1 << 63))
    opts = body.get("stream_options") or {}
    if not isinstance(opts, Mapping):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    return ParsedRequest(
        kind=kind,
        model=model,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        stream=_bool(body, "stream", False),
        include_usage=bool(opts.get("include_usage", False)),
        continuous_usage=bool(opts.get("continuous_usage_stats", False)),
        seed=ctx.default_seed if seed is None else seed,
        ignore_eos=_bool(body, "ignore_eos", False),
        stop=_stop(body),
        min_tokens=_int(body, "min_tokens", minimum=0) or 0,
        kv_transfer=_kv_transfer(body),
        bootstrap=_bootstrap(body),
    )


def parse_completion(body: Any, ctx: ApiContext) -> ParsedRequest:
    """A /v1/completions body -> ParsedRequest, or ApiError (400/404)."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    model = _check_common(body, ctx)
    if body.get("echo"):
        raise ApiError(400, "echo is not supported by the simulated engine", "echo")
    if body.get("logprobs") is not None:
        raise ApiError(400, "logprobs are not supported by the simulated engine", "logprobs")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = ctx.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        ids = list(prompt)
    elif prompt is None:
        raise ApiError(400, "prompt is required", "prompt")
    else:
        raise ApiError(
            400,
            "prompt must be a string, a list of token ids, or a list of one of those",
            "prompt",
        )
    return _finish_parse("completion", body, ctx, model, ids, 16)


def parse_chat(body: Any, ctx: ApiContext) -> ParsedRequest:
    """A /v1/chat/completions body -> ParsedRequest, or ApiError (400/404)."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    model = _check_common(body, ctx)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise ApiError(400, "logprobs are not supported by the simulated engine", "logprobs")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    if not all(isinstance(m, Mapping) for m in messages):
        raise ApiError(400, "each message must be an object", "messages")
    add_gen = _bool(body, "add_generation_prompt", True)
    cont = _bool(body, "continue_final_message", False)
    if add_gen and cont:
        raise ApiError(
            400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    try:
        text = render_chat(messages, add_generation_prompt=add_gen, continue_final_message=cont)
    except ValueError as exc:
        raise ApiError(400, str(exc), "messages") from None
    return _finish_parse("chat", body, ctx, model, ctx.tokenizer.encode(text), None)


def request_id(kind: RequestKind, header: str | None) -> str:
    base = header if header else uuid.uuid4().hex
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + base


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_response(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str | None,
    stop_reason: str | None,
    use: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "prompt_logprobs": None,
            }
        ],
        "usage": use,
    }


def chat_response(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str | None,
    stop_reason: str | None,
    use: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
            }
        ],
        "usage": use,
        "prompt_logprobs": None,
    }


DONE = b"data: [DONE]\n\n"


class StreamFormatter:
    """SSE events of one streamed response, one `data:` event per token, as vLLM sends."""

    __slots__ = ("_head", "_kind", "_obj")

    def __init__(self, kind: RequestKind, rid: str, created: int, model: str) -> None:
        self._kind = kind
        self._obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._head = (
            f'data: {{"id":{_dumps(rid)},"object":"{self._obj}","created":{created},'
            f'"model":{_dumps(model)},"choices":['
        )

    def role(self) -> str:
        """Chat only: the first chunk carries the assistant role and empty content."""
        return (
            self._head + '{"index":0,"delta":{"role":"assistant","content":""},'
            '"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def token(
        self,
        text: str,
        finish: str | None = None,
        stop_reason: str | None = None,
        use: dict[str, Any] | None = None,
    ) -> str:
        fin = "null" if finish is None else f'"{finish}"'
        sr = "null" if stop_reason is None else _dumps(stop_reason)
        tail = "]}" if use is None else f'],"usage":{_dumps(use)}}}'
        if self._kind == "chat":
            stop_part = f',"stop_reason":{sr}' if finish is not None else ""
            return (
                f'{self._head}{{"index":0,"delta":{{"content":{_dumps(text)}}},'
                f'"logprobs":null,"finish_reason":{fin}{stop_part}}}{tail}\n\n'
            )
        return (
            f'{self._head}{{"index":0,"text":{_dumps(text)},"logprobs":null,'
            f'"finish_reason":{fin},"stop_reason":{sr}}}{tail}\n\n'
        )

    def usage(self, use: dict[str, Any]) -> str:
        """The final chunk with `stream_options.include_usage`: no choices, only usage."""
        return f'{self._head}],"usage":{_dumps(use)}}}\n\n'


def error_event(status: int, message: str) -> str:
    return f"data: {_dumps(error_body(status, message))}\n\n"


def models_response(
    model: str, max_model_len: int, created: int | None = None, root: str | None = None
) -> dict[str, Any]:
    created = int(time.time()) if created is None else created
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root or model,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{uuid.uuid4().hex}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }


def parse_tokenize(body: Any, ctx: ApiContext) -> list[int]:
    """vLLM's /tokenize: {"prompt": str} or {"messages": [...]} -> token ids."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    _check_common({k: v for k, v in body.items() if k == "model"}, ctx)
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise ApiError(400, "messages must be a list", "messages")
        text = render_chat(
            messages,
            add_generation_prompt=_bool(body, "add_generation_prompt", True),
            continue_final_message=_bool(body, "continue_final_message", False),
        )
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string", "prompt")
        text = prompt
    return ctx.tokenizer.encode(text)


def parse_detokenize(body: Any) -> Sequence[int]:
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise ApiError(400, "tokens must be a list of integers", "tokens")
    return tokens


def orca_header(fmt: str, num_requests_waiting: int, kv_cache_usage: float) -> str | None:
    """vLLM's `endpoint-load-metrics` value for a request's `endpoint-load-metrics-format`.

    vllm/entrypoints/openai/orca_metrics.py: TEXT is `TEXT named_metrics.k=v, ...`, JSON is
    `JSON {"named_metrics": {...}}`; the metrics are vllm:num_requests_waiting and
    vllm:kv_cache_usage_perc, in registration order. vLLM attaches it to non-streamed
    responses only. Other formats get no header.
    """
    metrics = (
        ("num_requests_waiting", float(num_requests_waiting)),
        ("kv_cache_usage_perc", float(kv_cache_usage)),
    )
    f = fmt.lower()
    if f == "text":
        return "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in metrics)
    if f == "json":
        return "JSON " + json.dumps({"named_metrics": dict(metrics)})
    return None


def dumps(obj: Any) -> str:
    return _dumps(obj)
