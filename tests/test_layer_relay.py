"""The relay layer (meshd/relay.py) alone: a fake upstream response feeds it, a fake
client request records what the client receives, and a fake upstream pool answers the
continuation of a resumed stream. Whole bodies become one reply; SSE goes out chunk by
chunk, scanned; a broken stream is resumed or ends with an error event; a client that
leaves drops the upstream."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from backends import sse_events
from harness import sidecar_config
from layer_fakes import (
    COMPLETIONS,
    HANG,
    POOL,
    FakePool,
    FakeRequest,
    FakeUpstream,
    GuardLog,
    Layers,
    RouterLog,
    assert_settled_once,
    build_layers,
    install_logs,
    request_context,
)

from filters.pool_router import Route
from meshd.context import Attempt, RequestContext
from meshd.upstream import UpstreamClosedError

URLS = ["http://e1.test:8001", "http://e2.test:8002"]
SSE = "text/event-stream"
PROMPT_DOC = {"model": "tiny", "prompt": "Count:", "max_tokens": 10, "stream": True}


def event(text: str, finish: str | None = None, rid: str = "cmpl-1") -> bytes:
    doc = {
        "id": rid,
        "object": "text_completion",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def usage_event(prompt: int, completion: int, rid: str = "cmpl-1") -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    doc = {"id": rid, "object": "text_completion", "choices": [], "usage": usage}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


class Relayed:
    """One relay under test: its layers, the request, the attempt on the first endpoint."""

    def __init__(self, upstream: FakeUpstream, *, trusted: bool = True, **sections: Any):
        self.layers: Layers = build_layers(sidecar_config(URLS, **sections))
        logs: tuple[RouterLog, GuardLog] = install_logs(self.layers)
        self.router, self.guard = logs
        self.pool = FakePool()
        self.layers.plane.upstream = self.pool  # type: ignore[assignment]
        self.upstream = upstream
        self.ctx: RequestContext = request_context(
            self.layers, PROMPT_DOC, path=COMPLETIONS, trusted=trusted
        )
        self.attempt: Attempt = self.layers.attempts.start(self.ctx, Route(URLS[0], "test"), "")
        # As the attempts layer leaves it when it hands an answer on.
        self.attempt.status = upstream.status
        self.attempt.ok = upstream.status < 500
        self.req = FakeRequest(path=COMPLETIONS)

    async def run(self) -> Any:
        return await self.layers.relay.relay(self.req, self.ctx, self.attempt, self.upstream)

    def outcomes(self) -> list[str]:
        return [a.outcome for a in self.ctx.trace.attempts]

    async def finished(self) -> str:
        """The request's outcome once its trace is finished (off the request's path)."""
        await asyncio.sleep(0)
        assert self.ctx.trace.finished
        return self.ctx.trace.outcome


def texts(body: bytes) -> list[str]:
    return [
        c["text"] for e in sse_events(body) if isinstance(e, dict) for c in e.get("choices", [])
    ]


async def test_a_whole_body_is_one_reply_with_its_usage_taken() -> None:
    body = [
        b'{"id":"cmpl-1","choices":[{"text":"hi"}],',
        b'"usage":{"prompt_tokens":7,"completion_tokens":3,'
        b'"prompt_tokens_details":{"cached_tokens":4}}}',
    ]
    hop = [
        ("Connection", "keep-alive, x-hop"),
        ("Keep-Alive", "timeout=5"),
        ("X-Hop", "1"),
        ("Content-Length", "123"),
        ("Transfer-Encoding", "chunked"),
        ("X-Engine", "vllm"),
    ]
    r = Relayed(FakeUpstream(200, body, headers=hop))

    reply = await r.run()

    assert reply.status == 200 and reply.body == b"".join(body)
    names = [n.lower() for n, _ in reply.headers]
    assert "x-engine" in names and "content-type" in names
    for dropped in ("connection", "keep-alive", "x-hop", "content-length", "transfer-encoding"):
        assert dropped not in names
    assert ("x-meshd-endpoint", URLS[0]) in reply.headers  # a trusted client is told
    a = r.attempt
    assert (a.prompt_tokens, a.completion_tokens, a.cached_tokens) == (7, 3, 4)
    assert r.upstream.released and not r.upstream.closed
    assert r.outcomes() == ["ok"]
    assert_settled_once(r.router, r.guard)
    assert await r.finished() == "ok"


async def test_an_untrusted_client_is_not_told_the_endpoint() -> None:
    r = Relayed(FakeUpstream(200, [b"{}"]), trusted=False)
    reply = await r.run()
    assert all(n.lower() != "x-meshd-endpoint" for n, _ in reply.headers)


async def test_a_whole_body_that_breaks_is_502() -> None:
    broken = UpstreamClosedError(URLS[0], "connection reset")
    r = Relayed(FakeUpstream(200, [b'{"id":', broken]))

    reply = await r.run()

    assert reply.status == 502
    assert json.loads(reply.body)["error"]["code"] == "upstream_error"
    assert r.upstream.closed and not r.upstream.released
    assert r.outcomes() == ["stream_broken"]
    assert [e["local_failure"] for e in r.guard.ends] == [True]
    assert_settled_once(r.router, r.guard)


STREAM = [event(" one"), event(" two"), event(" three", "stop"), usage_event(4, 3), DONE]


@pytest.mark.parametrize("usage", [True, False], ids=["usage", "no_usage"])
async def test_sse_goes_out_in_order_and_the_attempt_learns_its_tokens(usage: bool) -> None:
    # Without a usage event the tokens are what the relay counted passing.
    stream = STREAM if usage else [e for e in STREAM if b"usage" not in e]
    r = Relayed(FakeUpstream(200, stream, content_type=SSE))

    assert await r.run() is None  # streamed

    out = r.req.out
    assert out is not None and out.status == 200 and out.ended
    assert out.body == b"".join(stream)
    assert texts(out.body) == [" one", " two", " three"]
    a = r.attempt
    assert a.completion_tokens == 3 and a.prompt_tokens == (4 if usage else None)
    assert a.first_token_at is not None and r.router.first_tokens == [a.rid]
    assert r.outcomes() == ["ok"]
    assert_settled_once(r.router, r.guard)
    assert r.upstream.released
    assert await r.finished() == "ok"


async def test_a_resumable_stream_sends_only_whole_events() -> None:
    raw = b"".join(STREAM)
    cuts = [5, 40, 41, 150, len(raw) - 3]
    parts = [raw[i:j] for i, j in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    r = Relayed(FakeUpstream(200, parts, content_type=SSE))

    await r.run()

    out = r.req.out
    assert out is not None and out.body == raw
    assert all(c.endswith(b"\n\n") for c in out.chunks)


async def test_a_stream_broken_mid_way_is_resumed_on_another_endpoint() -> None:
    broken = UpstreamClosedError(URLS[0], "connection reset")
    first = FakeUpstream(200, [event(" one"), event(" two"), broken], content_type=SSE)
    rest = [event(" three", rid="other"), event(" four", "stop", rid="other"), DONE]
    r = Relayed(first)
    r.pool.answers.append(FakeUpstream(200, rest, content_type=SSE))

    assert await r.run() is None

    # The continuation went to the other endpoint, its prompt holding what was sent.
    (cont,) = r.pool.sent
    assert cont.url == URLS[1] and cont.method == "POST" and cont.target == COMPLETIONS
    assert cont.json()["prompt"] == "Count: one two"
    assert cont.json()["max_tokens"] == 8
    # The client saw one stream: every token once, one id, [DONE] last, no error.
    out = r.req.out
    assert out is not None and out.ended
    events = sse_events(out.body)
    assert texts(out.body) == [" one", " two", " three", " four"]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert {e["id"] for e in events if isinstance(e, dict)} == {"cmpl-1"}
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    assert r.outcomes() == ["stream_broken", "ok"]
    assert r.layers.metric("meshd_stream_resumes_total", pool=POOL, outcome="resumed") == 1
    assert_settled_once(r.router, r.guard)
    assert await r.finished() == "ok"


async def test_a_stream_cut_before_done_with_failover_off_ends_with_an_error_event() -> None:
    first = FakeUpstream(200, [event(" one"), event(" two")], content_type=SSE)
    r = Relayed(first, reliability={"failover": {"enabled": False}})

    await r.run()

    out = r.req.out
    assert out is not None and out.ended
    events = sse_events(out.body)
    assert texts(out.body) == [" one", " two"]
    assert events[-1]["error"]["code"] == "upstream_stream_truncated"
    assert not r.pool.sent
    assert r.outcomes() == ["stream_truncated"]
    assert [e["local_failure"] for e in r.guard.ends] == [True]
    assert_settled_once(r.router, r.guard)
    assert await r.finished() == "upstream_stream_truncated"


async def test_a_stream_of_an_error_event_alone_failed() -> None:
    # vLLM's answer when it fails before its first token: 200, one error event, [DONE].
    error = {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}
    first = FakeUpstream(200, [b"data: " + json.dumps({"error": error}).encode() + b"\n\n", DONE],
                         content_type=SSE)  # fmt: skip
    r = Relayed(first)

    await r.run()

    out = r.req.out
    assert out is not None and out.ended
    assert sse_events(out.body) == [{"error": error}, "[DONE]"]  # as sent, nothing added
    assert not r.pool.sent  # nothing to resume: no token reached the client
    assert r.outcomes() == ["http_500"]
    assert [e["local_failure"] for e in r.guard.ends] == [True]
    assert_settled_once(r.router, r.guard)
    assert await r.finished() == "upstream_error"  # not ok: charged as a failed request


async def test_a_broken_stream_no_endpoint_will_continue_ends_with_an_error_event() -> None:
    broken = UpstreamClosedError(URLS[0], "connection reset")
    first = FakeUpstream(200, [event(" one"), broken], content_type=SSE)
    r = Relayed(first)
    r.pool.answers.append(FakeUpstream(503))

    await r.run()

    out = r.req.out
    assert out is not None and out.ended
    assert sse_events(out.body)[-1]["error"]["code"] == "upstream_stream_broken"
    assert r.outcomes() == ["stream_broken", "http_503"]
    assert_settled_once(r.router, r.guard)


async def test_a_client_that_leaves_mid_stream_drops_the_upstream() -> None:
    r = Relayed(FakeUpstream(200, STREAM, content_type=SSE))
    r.req.writes_ok = 1  # the second write finds the client gone

    assert await r.run() is None

    out = r.req.out
    assert out is not None and out.chunks == [STREAM[0]] and not out.ended
    assert r.upstream.closed and not r.upstream.released
    assert r.outcomes() == ["client_disconnect"]
    assert [e["cancelled"] for e in r.guard.ends] == [True]
    assert_settled_once(r.router, r.guard)
    assert r.layers.metric("meshd_client_disconnects_total", pool=POOL) == 1
    assert await r.finished() == "client_disconnect"


async def test_a_client_that_leaves_while_the_engine_is_silent_drops_the_upstream() -> None:
    r = Relayed(FakeUpstream(200, [event(" one"), HANG], content_type=SSE))
    task = asyncio.create_task(r.run())
    await r.upstream.reading.wait()

    task.cancel()  # as the listener cancels the handler of a connection that closed
    with pytest.raises(asyncio.CancelledError):
        await task

    assert r.upstream.closed and not r.upstream.released
    assert r.outcomes() == ["client_disconnect"]
    assert [e["cancelled"] for e in r.guard.ends] == [True]
    assert_settled_once(r.router, r.guard)
    assert not r.layers.plane.watches  # the reaper no longer watches it
    assert await r.finished() == "client_disconnect"
