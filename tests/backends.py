"""Real aiohttp OpenAI-style test backends with behaviours chosen by the prompt:
normal streams, a crash mid-stream, a hang, a slow first byte. Each records what
it received, so tests assert on what the engine side actually saw."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None


@dataclass
class TestBackend:
    name: str
    models: tuple[str, ...] = ("tiny",)
    requests: list[Seen] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""
    runner: web.AppRunner | None = None
    # When set, every generation request is refused with this status (an engine shedding).
    refuse_with: int | None = None
    # When set, usage.prompt_tokens is the prompt's length over this (else always 3).
    chars_per_token: float | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/v1/models", self._models)
        # No /metrics page (the sidecar's engine probe asks; not a request the tests count).
        app.router.add_get("/metrics", self._no_metrics)
        app.router.add_route("*", "/{tail:.*}", self._other)
        return app

    async def start(self) -> str:
        self.runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _record(self, request: web.Request) -> dict[str, Any] | None:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        self.requests.append(
            Seen(request.path, {k.lower(): v for k, v in request.headers.items()}, body)
        )
        return body

    async def _models(self, request: web.Request) -> web.Response:
        self.requests.append(
            Seen(request.path, {k.lower(): v for k, v in request.headers.items()}, None)
        )
        data = [{"id": m, "object": "model", "owned_by": self.name} for m in self.models]
        return web.json_response({"object": "list", "data": data})

    async def _no_metrics(self, request: web.Request) -> web.Response:
        return web.Response(status=404, text="no metrics here")

    async def _other(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.json_response({"path": request.path, "backend": self.name})

    async def _embeddings(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.json_response(
            {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.1]}]}
        )

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request) or {}
        if self.refuse_with is not None:
            return web.json_response(
                {"error": {"message": "busy", "type": "overloaded", "code": self.refuse_with}},
                status=self.refuse_with,
                headers={"Retry-After": "0"},
            )
        chat = request.path.endswith("chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body.get("prompt", "")
        n = int(body.get("max_tokens") or 5)
        p = 3 if self.chars_per_token is None else max(1, round(len(prompt) / self.chars_per_token))
        words = [f"w{i}" for i in range(n)]
        if prompt == "slow-headers":
            await self.release.wait()
        if not body.get("stream"):
            text = " ".join(words)
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text}
            )
            choice["finish_reason"] = "length"
            return web.json_response(
                {
                    "id": "cmpl-test",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()),
                    "model": body.get("model"),
                    "backend": self.name,
                    "choices": [choice],
                    "usage": {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n},
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.started.set()
        try:
            for i, w in enumerate(words):
                if prompt == "crash" and i == 2:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                if prompt == "hang" and i == 1:
                    await asyncio.Event().wait()
                if prompt == "stall" and i == 1:
                    await self.release.wait()
                piece = w if i == 0 else " " + w
                delta: dict[str, Any] = (
                    {"index": 0, "delta": {"content": piece}, "finish_reason": None}
                    if chat
                    else {"index": 0, "text": piece, "finish_reason": None}
                )
                event = {"id": "cmpl-test", "object": "chunk", "choices": [delta]}
                await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            if prompt != "no-done":
                usage = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
                last = {"id": "cmpl-test", "choices": [], "usage": usage}
                await resp.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return resp


def sse_events(raw: bytes) -> list[Any]:
    """Decode a complete SSE body into JSON payloads ([DONE] kept as the string)."""
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out
