"""A minimal, fast OpenAI-compatible backend for data-plane benchmarks and tests.

Streams N deterministic tokens (one SSE event per token, vLLM's chunk shape, then
`data: [DONE]`) with no artificial delay, so what a benchmark measures is the proxy in front.
Run `python -m loadtest.stub_backend --port 0 [--workers K]`; it prints one JSON ready line.

Chunk shapes follow vLLM's `CompletionStreamResponse` / `ChatCompletionStreamResponse`
(vllm-project/vllm: vllm/entrypoints/openai/completion/protocol.py, serving_chat.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import itertools
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

DEFAULT_TOKENS = 200
DEFAULT_MODEL = "stub-model"
# A request for more than this is clamped: the stub caches one encoded piece per token index.
MAX_TOKENS_LIMIT = 16_384
# Deterministic vocabulary; token i of every answer is WORDS[i % len(WORDS)].
WORDS: tuple[str, ...] = (
    " the",
    " quick",
    " brown",
    " fox",
    " jumps",
    " over",
    " a",
    " lazy",
    " dog",
    ".",
)
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class StubConfig:
    """What every answer looks like."""

    default_tokens: int = DEFAULT_TOKENS
    model: str = DEFAULT_MODEL
    # Pause between tokens; 0 (the default) streams as fast as the socket takes them.
    token_delay_s: float = 0.0


def token_text(index: int) -> str:
    """The text of token `index` of every answer."""
    return WORDS[index % len(WORDS)]


def answer_text(n_tokens: int) -> str:
    """The full text of an `n_tokens`-token answer (what the stream concatenates to)."""
    return "".join(token_text(i) for i in range(n_tokens))


class _Pieces:
    """Per-token encoded tails of SSE events, built once: a request only joins bytes."""

    def __init__(self) -> None:
        self._completion: list[bytes] = []
        self._chat: list[bytes] = []

    def completion(self, n: int) -> list[bytes]:
        self._grow(n)
        return self._completion

    def chat(self, n: int) -> list[bytes]:
        self._grow(n)
        return self._chat

    def _grow(self, n: int) -> None:
        for i in range(len(self._completion), n):
            text = json.dumps(token_text(i))
            self._completion.append(
                f',"choices":[{{"index":0,"text":{text},"logprobs":null,'.encode()
            )
            self._chat.append(
                f',"choices":[{{"index":0,"delta":{{"content":{text}}},"logprobs":null,'.encode()
            )


_PIECES = _Pieces()
_IDS = itertools.count(1)
_CONFIG_KEY = web.AppKey("stub_config", StubConfig)


def _request_tokens(body: dict[str, Any], config: StubConfig) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return config.default_tokens
    return min(value, MAX_TOKENS_LIMIT)


def _prompt_tokens(body: dict[str, Any]) -> int:
    # A rough count (words), good enough for usage figures nobody bills on.
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt.split())
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(
            len(m.get("content", "").split())
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), str)
        )
    return 0


async def _read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except ValueError as exc:
        raise web.HTTPBadRequest(text=f"invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="JSON body must be an object")
    return body


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


async def _stream(
    request: web.Request,
    head: bytes,
    first: bytes | None,
    pieces: list[bytes],
    n: int,
    usage: bytes | None,
) -> web.StreamResponse:
    resp = web.StreamResponse(headers=_SSE_HEADERS)
    await resp.prepare(request)
    if first is not None:
        await resp.write(first)
    tail_open = b'"finish_reason":null,"stop_reason":null}]}\n\n'
    tail_last = b'"finish_reason":"length","stop_reason":null}]}\n\n'
    last = n - 1
    delay = request.app[_CONFIG_KEY].token_delay_s
    # One write per token: each SSE event reaches the proxy as its own chunk, as it would
    # from an engine; the proxy's per-chunk cost is what the benchmark is after.
    for i in range(n):
        if delay > 0 and i:
            await asyncio.sleep(delay)
        await resp.write(b"".join((head, pieces[i], tail_last if i == last else tail_open)))
    if usage is not None:
        await resp.write(usage)
    await resp.write(_DONE)
    await resp.write_eof()
    return resp


def _wants_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


async def _completions(request: web.Request) -> web.StreamResponse:
    config = request.app[_CONFIG_KEY]
    body = await _read_json(request)
    n = _request_tokens(body, config)
    model = body.get("model") if isinstance(body.get("model"), str) else config.model
    rid = f"cmpl-{os.getpid():08x}{next(_IDS):024x}"
    created = int(time.time())
    prompt_tokens = _prompt_tokens(body)
    if not body.get("stream"):
        return web.json_response(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": answer_text(n),
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                    }
                ],
                "usage": _usage(prompt_tokens, n),
            }
        )
    prefix = f'{{"id":"{rid}","object":"text_completion","created":{created},"model":'
    head = b"data: " + (prefix + json.dumps(model)).encode()
    usage = None
    if _wants_usage(body):
        usage_obj = {"choices": [], "usage": _usage(prompt_tokens, n)}
        usage = head + b"," + json.dumps(usage_obj, separators=(",", ":")).encode()[1:] + b"\n\n"
    return await _stream(request, head, None, _PIECES.completion(n), n, usage)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    config = request.app[_CONFIG_KEY]
    body = await _read_json(request)
    n = _request_tokens(body, config)
    model = body.get("model") if isinstance(body.get("model"), str) else config.model
    rid = f"chatcmpl-{os.getpid():08x}{next(_IDS):024x}"
    created = int(time.time())
    prompt_tokens = _prompt_tokens(body)
    if not body.get("stream"):
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": answer_text(n)},
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                    }
                ],
                "usage": _usage(prompt_tokens, n),
            }
        )
    prefix = f'{{"id":"{rid}","object":"chat.completion.chunk","created":{created},"model":'
    head = b"data: " + (prefix + json.dumps(model)).encode()
    # vLLM opens a chat stream with an empty assistant delta that carries the role.
    first = (
        head + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        b'"logprobs":null,"finish_reason":null}]}\n\n'
    )
    usage = None
    if _wants_usage(body):
        usage_obj = {"choices": [], "usage": _usage(prompt_tokens, n)}
        usage = head + b"," + json.dumps(usage_obj, separators=(",", ":")).encode()[1:] + b"\n\n"
    return await _stream(request, head, first, _PIECES.chat(n), n, usage)


async def _models(request: web.Request) -> web.Response:
    config = request.app[_CONFIG_KEY]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": config.model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "meshd-stub",
                    "root": config.model,
                    "parent": None,
                    "max_model_len": 32_768,
                }
            ],
        }
    )


async def _health(request: web.Request) -> web.Response:
    # vLLM answers /health with 200 and an empty body.
    return web.Response(status=200)


def make_app(config: StubConfig | None = None) -> web.Application:
    """The stub as an aiohttp application (tests run it with `web.AppRunner`, port 0)."""
    app = web.Application()
    app[_CONFIG_KEY] = config or StubConfig()
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; accepted sockets inherit TCP_NODELAY from it on Linux."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def _serve(
    sock: socket.socket, config: StubConfig, stop: asyncio.Event, ready: Callable[[], None]
) -> None:
    # access_log=None: logging each request would cost more than answering it.
    runner = web.AppRunner(make_app(config), access_log=None, handle_signals=False)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    ready()
    await stop.wait()
    await runner.cleanup()


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: a worker must not outlive a parent killed before it could clean up.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def _run_worker(sock: socket.socket, config: StubConfig, ready: Callable[[], None]) -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await _serve(sock, config, stop, ready)

    asyncio.run(main())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.stub_backend", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument(
        "--workers", type=int, default=1, help="processes sharing the one listening socket"
    )
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="default max_tokens")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--token-delay-ms", type=float, default=0.0, help="pause between tokens (default none)"
    )
    args = parser.parse_args(argv)
    config = StubConfig(
        default_tokens=args.tokens, model=args.model, token_delay_s=args.token_delay_ms / 1000.0
    )
    sock = bind_socket(args.host, args.port)
    port = sock.getsockname()[1]
    children: list[int] = []
    # Pre-fork: every worker accepts on the same socket, so the kernel spreads connections.
    for _ in range(max(args.workers, 1) - 1):
        pid = os.fork()
        if pid == 0:
            _die_with_parent()
            _run_worker(sock, config, lambda: None)
            os._exit(0)
        children.append(pid)

    ready = {"event": "ready", "port": port, "pid": os.getpid(), "workers": args.workers}
    try:
        # Printed once this process serves and handles SIGTERM, so a reader may stop it at once.
        _run_worker(sock, config, lambda: print(json.dumps(ready), flush=True))
    finally:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGTERM)
        for child in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
