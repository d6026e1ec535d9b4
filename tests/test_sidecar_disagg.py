"""Prefill/decode disaggregation through a real sidecar (meshd/disagg.py): vLLM's protocol
(the prefill step, then the decode step with the prefill's kv_transfer_params), the
decider, and every failure path: a prefill engine down, every one down, a decode engine
that cannot fetch the KV, a decode engine that dies mid-stream."""

from __future__ import annotations

import json
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from backends import TestBackend as Backend
from backends import sse_events
from harness import sidecar_config, url

from filters.pool_router import PickerRouter
from meshd.access_log import read_access_log
from meshd.config import ConfigError, load_config
from meshd.sidecar import Sidecar

LONG = "tell me " * 200  # ~400 tokens by meshd's estimate


class PDEngine(Backend):
    """The test backend speaking vLLM's disaggregated protocol: a prefill step answers one
    token and `kv_transfer_params` naming its held KV; a decode step must find that KV in
    `fabric` (the engines' shared KV transfer) or is refused as vLLM's NIXL connector fails a
    load; a request without params is served whole."""

    fabric: dict[str, str]
    lose_kv: bool = False  # the held KV expires at once (the decode step cannot fetch it)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw else {}
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            self.requests.append(_seen(request, body))
            held = f"{self.name}-{len(self.requests)}"
            if not self.lose_kv:
                self.fabric[held] = self.name
            answer = {
                "id": "cmpl-p",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "w0"},
                        "finish_reason": "length",
                    }
                ],
                "usage": {"prompt_tokens": 400, "completion_tokens": 1, "total_tokens": 401},
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": self.name,
                    "remote_block_ids": [held],
                    "remote_host": "127.0.0.1",
                    "remote_port": 1,
                },
            }
            return web.json_response(answer)
        if params.get("do_remote_prefill"):
            held = (params.get("remote_block_ids") or [""])[0]
            if self.fabric.pop(held, None) is None:
                self.requests.append(_seen(request, body))
                error = {  # the simulator's refusal (loadtest/engine: kv_transfer)
                    "message": f"KV transfer failed (unknown_request): {held}",
                    "type": "KVTransferError",
                    "param": "kv_transfer_params",
                    "code": 410,
                }
                return web.json_response({"error": error}, status=410)
        return await self._replay(request, raw)

    async def _replay(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        # TestBackend._generate reads the body again: hand it the bytes already read.
        request._read_bytes = raw
        return await super()._generate(request)


def _seen(request: web.Request, body: dict[str, Any]) -> Any:
    from backends import Seen

    return Seen(request.path, {k.lower(): v for k, v in request.headers.items()}, body)


@pytest.fixture
async def engines() -> Any:
    fabric: dict[str, str] = {}
    started: list[PDEngine] = []

    async def make(name: str) -> PDEngine:
        e = PDEngine(name)
        e.fabric = fabric
        await e.start()
        started.append(e)
        return e

    yield make
    for e in started:
        await e.stop()


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def pd_config(
    prefill: list[str], decode: list[str], tmp_path: Path | None = None, **kw: Any
) -> Any:
    pools = [
        {"name": "prefill", "role": "prefill", "endpoints": prefill},
        {
            "name": "decode",
            "role": "decode",
            "endpoints": decode,
            "disaggregation": {"prefill_pool": "prefill", "min_prefill_tokens": 64, **kw},
        },
    ]
    sections: dict[str, Any] = {"pools": pools}
    if tmp_path is not None:
        sections["telemetry"] = {"access_log": {"path": str(tmp_path / "access.jsonl")}}
    return sidecar_config(decode, **sections)


def ask(content: str = LONG, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            **extra}  # fmt: skip


async def post(s: Sidecar, body: dict[str, Any]) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url(s, "/v1/chat/completions"), json=body) as r,
    ):
        return r.status, await r.read()


def count(s: Sidecar, name: str, **labels: str) -> float:
    return s.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_a_long_prompt_is_prefilled_on_the_prefill_pool_then_decoded(
    engines: Callable[[str], Awaitable[PDEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    tmp_path: Path,
) -> None:
    p, d = await engines("p0"), await engines("d0")
    s = await sidecar(pd_config([p.url], [d.url], tmp_path))
    status, raw = await post(s, ask(stream=True, stream_options={"include_usage": True}))
    assert status == 200 and sse_events(raw)[-1] == "[DONE]"
    (step,) = p.requests
    assert step.body is not None
    assert step.body["max_tokens"] == 1 and step.body["stream"] is False
    assert "stream_options" not in step.body
    assert step.body["kv_transfer_params"]["do_remote_decode"] is True
    (dec,) = d.requests
    assert dec.body is not None and dec.body["stream"] is True and dec.body["max_tokens"] == 4
    assert dec.body["kv_transfer_params"]["remote_engine_id"] == "p0"
    assert step.headers["x-request-id"] == dec.headers["x-request-id"]
    assert count(s, "meshd_pd_requests_total", pool="decode", path="split", reason="split") == 1
    s.accounting.flush()
    await s.observer.aclose()
    (record,) = read_access_log(tmp_path / "access.jsonl")
    assert [(a.endpoint, a.reason, a.outcome) for a in record.attempts] == [
        (p.url, "prefill", "ok"),
        (d.url, "", "ok"),
    ]
    assert record.pool == "decode" and record.outcome == "ok" and record.pd == "split"
    # The decode step waited for the prompt's KV: ~400 tokens x 128 KiB over 50 GB/s.
    prefill_step, decode_step = record.attempts
    assert prefill_step.kv_transfer_s is None
    assert decode_step.kv_transfer_s is not None and 0.5e-3 < decode_step.kv_transfer_s < 2e-3
    # The client's tokens are the decode step's: the prefill step's one is its first again.
    assert prefill_step.completion_tokens == 1 and decode_step.completion_tokens
    assert record.completion_tokens == decode_step.completion_tokens


async def test_a_short_prompt_is_served_whole_on_the_decode_pool(
    engines: Callable[[str], Awaitable[PDEngine]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    p, d = await engines("p0"), await engines("d0")
    s = await sidecar(pd_config([p.url], [d.url]))
    status, _ = await post(s, ask("hi"))
    assert status == 200 and p.requests == []
    assert d.requests[0].body is not None and "kv_transfer_params" not in d.requests[0].body
    labels = {"pool": "decode", "path": "whole", "reason": "short-prefill"}
    assert count(s, "meshd_pd_requests_total", **labels) == 1


async def test_a_dead_prefill_engine_is_passed_over_and_none_at_all_means_whole(
    engines: Callable[[str], Awaitable[PDEngine]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    p, d = await engines("p1"), await engines("d0")
    s = await sidecar(pd_config([dead_url(), p.url], [d.url]))
    # Two prompts (the same one again would be served whole where its KV now is).
    for i in range(2):
        status, _ = await post(s, ask(f"{i} {LONG}"))
        assert status == 200
    assert len(p.requests) == 2  # each prefill step found the live engine
    assert all(r.body and "kv_transfer_params" in r.body for r in d.requests)

    alone = await sidecar(pd_config([dead_url()], [d.url]))
    status, _ = await post(alone, ask())
    assert status == 200 and "kv_transfer_params" not in (d.requests[-1].body or {})
    labels = {"pool": "decode", "path": "whole", "reason": "prefill-failed"}
    assert count(alone, "meshd_pd_requests_total", **labels) == 1


async def test_a_decode_step_that_cannot_fetch_its_kv_is_retried_whole(
    engines: Callable[[str], Awaitable[PDEngine]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    p, d = await engines("p0"), await engines("d0")
    s = await sidecar(pd_config([p.url], [d.url]))
    p.lose_kv = True
    status, raw = await post(s, ask())
    assert status == 200, raw
    bodies = [r.body or {} for r in d.requests]
    assert [("kv_transfer_params" in b) for b in bodies] == [True, False]
    assert count(s, "meshd_retries_total", pool="decode", reason="kv_fetch") == 1


async def test_a_decode_engine_dying_mid_stream_is_resumed_whole_on_another(
    engines: Callable[[str], Awaitable[PDEngine]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    p, d0, d1 = await engines("p0"), await engines("d0"), await engines("d1")
    # "crash" (the test backend breaks after two tokens) is short: split it anyway.
    s = await sidecar(pd_config([p.url], [d0.url, d1.url], min_prefill_tokens=0))
    status, raw = await post(s, ask("crash", stream=True))
    assert status == 200 and sse_events(raw)[-1] == "[DONE]"
    sent = [r.body for r in d0.requests + d1.requests if r.body]
    steps = [b for b in sent if "kv_transfer_params" in b]
    continuations = [b for b in sent if "kv_transfer_params" not in b]
    assert len(steps) == 1 and len(continuations) == 1  # the decode step, then its rest whole
    assert continuations[0]["continue_final_message"] is True
    assert continuations[0]["messages"][-1] == {"role": "assistant", "content": "w0 w1"}


def test_the_roles_are_checked_where_they_are_configured() -> None:
    def load(*pools: dict[str, Any]) -> Any:
        base = {"listeners": {"outbound": {"port": 0}, "admin": {"port": 0}}}
        return load_config(None, base={**base, "pools": list(pools)}, env={})

    ep = ["http://a:1"]
    with pytest.raises(ConfigError, match=r"disaggregation\.prefill_pool"):
        load({"name": "d", "role": "decode", "endpoints": ep})
    with pytest.raises(ConfigError, match="is not another pool"):
        load({"name": "d", "role": "decode", "endpoints": ep,
              "disaggregation": {"prefill_pool": "nope"}})  # fmt: skip
    with pytest.raises(ConfigError, match="a pool of role decode"):
        load({"name": "b", "endpoints": ep, "disaggregation": {"prefill_pool": "b"}})


async def test_no_model_is_routed_to_a_prefill_pool(
    engines: Callable[[str], Awaitable[PDEngine]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    p = await engines("p0")
    cfg = sidecar_config(
        [p.url], pools=[{"name": "prefill", "role": "prefill", "endpoints": [p.url]}]
    )
    s = await sidecar(cfg)
    status, raw = await post(s, ask("hi"))
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("status", "body", "lost"),
    [
        (410, b'{"error":{"type":"KVTransferError"}}', True),  # the simulator
        (500, b'{"error":{"message":"internal"}}', True),  # a real vLLM's failed load
        (503, b'{"error":{"message":"overloaded"}}', False),  # shed: another engine may
        (429, b"{}", False),
        (400, b'{"error":{"type":"KVTransferError","code":400}}', True),
        (400, b'{"error":{"message":"bad kv_transfer_params","type":"BadRequestError"}}', False),
        (404, b"not found", False),
        (200, b"{}", False),
    ],
)
def test_which_decode_refusals_mean_the_kv_was_not_fetched(
    status: int, body: bytes, lost: bool
) -> None:
    from meshd.disagg import kv_fetch_failed

    assert kv_fetch_failed(status, body) is lost


async def test_a_decode_pool_that_fails_falls_back_with_the_request_as_it_came(
    engines: Callable[[str], Awaitable[PDEngine]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    p, spare = await engines("p0"), await engines("spare")
    cfg = pd_config([p.url], [dead_url()])
    pools = [pool.model_dump() for pool in cfg.pools]
    pools[1]["fallbacks"] = [{"pool": "spare"}]
    pools[1]["models"] = ["tiny"]
    pools.append({"name": "spare", "models": ["other"], "endpoints": [{"url": spare.url}]})
    s = await sidecar(sidecar_config([p.url], pools=pools))
    status, _ = await post(s, ask())
    assert status == 200 and len(p.requests) == 1  # split, then the decode pool failed
    (moved,) = spare.requests
    assert moved.body is not None and "kv_transfer_params" not in moved.body
    assert moved.body["max_tokens"] == 4 and moved.body["model"] == "tiny"


async def test_round_robin_takes_each_decode_engine_in_turn(
    engines: Callable[[str], Awaitable[PDEngine]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    # The decode pool is ordered once per split request (for its decode leg): round robin's
    # turn moves one engine a request (it moved two when the pool was also ordered for the
    # request whole, and with two engines every decode step went to the same one).
    p, d0, d1 = await engines("p0"), await engines("d0"), await engines("d1")
    cfg = pd_config([p.url], [d0.url, d1.url])
    pools = [pool.model_dump() for pool in cfg.pools]
    s = await sidecar(sidecar_config([p.url], pools=pools, routing={"policy": "round-robin"}))
    for i in range(4):
        status, _ = await post(s, ask(LONG + f" question {i}"))
        assert status == 200
    assert len(p.requests) == 4
    assert (len(d0.requests), len(d1.requests)) == (2, 2)


async def test_only_the_engines_a_request_went_to_hold_its_prompt_in_the_index(
    engines: Callable[[str], Awaitable[PDEngine]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    p0, p1 = await engines("p0"), await engines("p1")
    decode = [await engines(f"d{i}") for i in range(3)]
    s = await sidecar(pd_config([p0.url, p1.url], [d.url for d in decode]))
    prefill, dpool = s.plane.routers["prefill"], s.plane.routers["decode"]
    assert isinstance(prefill, PickerRouter) and isinstance(dpool, PickerRouter)

    def held(router: PickerRouter) -> dict[str, int]:
        return {st.url: router.picker.index.used_blocks(st.name) for st in router.states}

    # Served whole (a short prompt): the prefill pool's order noted nothing.
    status, _ = await post(s, ask("hi " * 40))
    assert status == 200 and sum(held(prefill).values()) == 0
    for i in range(6):
        before = {d.url: len(d.requests) for d in decode}
        status, _ = await post(s, ask(f"{i} " + LONG))
        assert status == 200
        (used,) = [d.url for d in decode if len(d.requests) > before[d.url]]
        assert held(dpool)[used] > 0
    went = {d.url for d in decode if d.requests}
    assert {u for u, n in held(dpool).items() if n} == went
    assert {u for u, n in held(prefill).items() if n} == {e.url for e in (p0, p1) if e.requests}


async def test_a_prefill_answer_is_its_engines_first_token(
    engines: Callable[[str], Awaitable[PDEngine]], sidecar: Callable[..., Awaitable[Sidecar]]
) -> None:
    # The prefill step's answer is its engine's first token: the picker's queue there moves
    # on and its TTFT calibrates the engine (before, a prefill engine never had a first
    # token: its queue looked drained by the clock once it had been busy that long).
    p, d = await engines("p0"), await engines("d0")
    s = await sidecar(pd_config([p.url], [d.url]))
    prefill = s.plane.routers["prefill"]
    assert isinstance(prefill, PickerRouter)
    (state,) = prefill.states
    status, _ = await post(s, ask())
    assert status == 200 and state.outstanding == 0
    assert state.ttft_sampled is not None  # a sample: the step's TTFT against its prediction


@pytest.mark.parametrize(("margin", "path", "reason"), [(0.3, "whole", "faster-whole"),
                                                       (None, "split", "split")])  # fmt: skip
async def test_a_queued_prefill_pool_sends_the_request_whole_to_an_idle_decode_engine(
    engines: Callable[[str], Awaitable[PDEngine]],
    sidecar: Callable[..., Awaitable[Sidecar]],
    tmp_path: Path,
    margin: float | None,
    path: str,
    reason: str,
) -> None:
    # The decider's rule 4: the prefill engine has ~3 s of prompts queued (as the picker
    # sees it), the decode engine is idle: whole there, the first token seconds sooner.
    import time

    from filters.picker import PickRequest

    p, d = await engines("p0"), await engines("d0")
    cfg = pd_config([p.url], [d.url], tmp_path, faster_whole_margin_s=margin)
    s = await sidecar(cfg)
    prefill = s.plane.routers["prefill"]
    assert isinstance(prefill, PickerRouter)
    now = time.monotonic()
    for i in range(6):
        queued = PickRequest(model="tiny", prompt_tokens=16_000, max_tokens=1)
        (route, *_) = prefill.order(queued, now)
        prefill.started(route, f"queued-{i}", queued, now)
    status, _ = await post(s, ask(stream=True))
    assert status == 200
    assert len(p.requests) == (path == "split")
    (dec,) = d.requests
    assert dec.body is not None and ("kv_transfer_params" in dec.body) == (path == "split")
    assert count(s, "meshd_pd_requests_total", pool="decode", path=path, reason=reason) == 1
    s.accounting.flush()
    await s.observer.aclose()
    (record,) = read_access_log(tmp_path / "access.jsonl")
    assert record.pd == ("split" if path == "split" else f"whole:{reason}")
    if path == "split":
        # Each leg's time is in the log: the prefill step's answer, then the first token.
        prefill_step, decode_step = record.attempts
        assert prefill_step.ttft_s is not None and decode_step.ttft_s is not None
        assert 0 < prefill_step.ttft_s <= decode_step.ttft_s
        assert decode_step.ttft_s == pytest.approx(record.ttft_s, abs=1e-6)
