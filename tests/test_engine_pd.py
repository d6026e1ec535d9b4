"""Prefill/decode disaggregation in the engine simulator (loadtest/engine/kv_transfer.py):
vLLM's NIXL protocol between a prefill and a decode engine, over HTTP and on the virtual
clock; the KV hold and its expiry, the transfer time, refusals, roles, metrics, config."""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtest.engine import EngineFleet, EngineSpec, mixed_fleet
from loadtest.engine.cli import register, specs_from_args
from loadtest.engine.config import ConfigError, fleet_from_dict
from loadtest.engine.core import SimRequest
from loadtest.engine.faults import parse_fault
from loadtest.engine.kv_transfer import FETCH_FAILED_STATUS, FETCH_FAILED_TYPE
from loadtest.engine.profiles import get_profile
from loadtest.engine.virtual import Accepted, Refused, VirtualEngine, VirtualFleet

FAST = 200.0
PROMPT = " ".join(f"word{i}" for i in range(300))
KV_BYTES = get_profile("H100").kv_bytes_per_token  # Llama-3-8B: 128 KiB per token


def prefill_body(doc: dict[str, Any]) -> dict[str, Any]:
    """The prefill step's body, as vLLM's toy proxy builds it."""
    body = copy.deepcopy(doc)
    body["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for name in ("stream_options", "min_tokens", "min_completion_tokens"):
        body.pop(name, None)
    return body


def decode_body(doc: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    return {**doc, "kv_transfer_params": params}


def request(prompt: str = PROMPT, max_tokens: int = 12, **kw: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **kw}


# ---- over HTTP -----------------------------------------------------------------------------


@pytest.fixture
async def pd() -> AsyncIterator[EngineFleet]:
    """A prefill engine, a decode engine and an aggregated one (role both)."""
    fleet = EngineFleet(
        mixed_fleet(
            3, ["H100"], base=EngineSpec(time_scale=FAST), roles=["prefill", "decode", "both"]
        )
    )
    await fleet.start()
    yield fleet
    await fleet.stop()


async def post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], rid: str = "r1"
) -> tuple[int, Any, str]:
    async with session.post(
        f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}
    ) as resp:
        raw = await resp.text()
        if resp.content_type == "application/json":
            return resp.status, json.loads(raw), raw
        return resp.status, None, raw


def sse_text(raw: str) -> str:
    out = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            doc = json.loads(line[6:])
            out.extend(c["text"] for c in doc["choices"])
    return "".join(out)


async def test_prefill_then_decode_gives_the_aggregated_text(pd: EngineFleet) -> None:
    p, d, agg = pd
    async with aiohttp.ClientSession() as s:
        status, whole, _ = await post(s, agg.url, request(), "agg")
        assert status == 200
        status, pre, _ = await post(s, p.url, prefill_body(request()), "r1")
        assert status == 200
        params = pre["kv_transfer_params"]
        n_blocks = -(-whole["usage"]["prompt_tokens"] // 16)
        assert params == {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": params["remote_block_ids"],
            "remote_engine_id": p.replica.kv_engine_id,
            "remote_request_id": "cmpl-r1",
            "remote_host": "127.0.0.1",
            "remote_port": p.port,
            "tp_size": 1,
        }
        assert len(params["remote_block_ids"]) == n_blocks
        assert pre["choices"][0]["finish_reason"] == "length"
        assert p.core.num_held_requests == 1
        status, dec, _ = await post(s, d.url, decode_body(request(), params), "r1")
        assert status == 200
    assert dec["choices"][0]["text"] == whole["choices"][0]["text"]
    # The prompt's KV came over the wire: all of it counts as cached but the last token.
    prompt = whole["usage"]["prompt_tokens"]
    assert dec["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    assert dec["kv_transfer_params"] is None
    # The prefill engine let go of its pinned copy; the blocks stay in its prefix cache.
    assert p.core.num_held_requests == 0
    assert p.core.kv_usage() == 0.0
    assert p.core.pool.num_cached == prompt // 16
    assert p.core.stats.kv_holds_fetched == 1
    assert d.core.stats.kv_remote_decode_steps == 1
    assert d.core.stats.kv_transfer_bytes == prompt * KV_BYTES


async def test_a_streamed_decode_step_matches_too(pd: EngineFleet) -> None:
    p, d, agg = pd
    doc = request(stream=True, stream_options={"include_usage": True}, min_tokens=3)
    async with aiohttp.ClientSession() as s:
        _, _, whole = await post(s, agg.url, doc, "agg")
        _, pre, _ = await post(s, p.url, prefill_body(doc), "s1")
        status, _, streamed = await post(
            s, d.url, decode_body(doc, pre["kv_transfer_params"]), "s1"
        )
    assert status == 200
    assert sse_text(streamed) == sse_text(whole) != ""


async def test_unknown_engine_or_request_is_refused_before_any_token(pd: EngineFleet) -> None:
    p, d, _ = pd
    async with aiohttp.ClientSession() as s:
        _, pre, _ = await post(s, p.url, prefill_body(request()), "r1")
        params = pre["kv_transfer_params"]
        cases = {
            "unknown_engine": {**params, "remote_engine_id": "no-such-engine"},
            "unknown_request": {**params, "remote_request_id": "cmpl-other"},
            "mismatch": {**params, "remote_block_ids": params["remote_block_ids"][:-1]},
        }
        for reason, bad in cases.items():
            for stream in (False, True):
                status, doc, _ = await post(s, d.url, decode_body(request(stream=stream), bad))
                assert status == FETCH_FAILED_STATUS, (reason, doc)
                err = doc["error"]
                assert err["type"] == FETCH_FAILED_TYPE
                assert err["param"] == "kv_transfer_params"
                assert err["code"] == FETCH_FAILED_STATUS
                assert err["message"].startswith(f"KV transfer failed ({reason})")
        assert d.core.stats.kv_fetch_refused["unknown_engine"] == 2
        # The real params still work once, then the KV is gone.
        status, _, _ = await post(s, d.url, decode_body(request(), params))
        assert status == 200
        status, doc, _ = await post(s, d.url, decode_body(request(), params))
        assert status == FETCH_FAILED_STATUS
        assert "(already_fetched)" in doc["error"]["message"]


async def test_roles_refuse_the_other_step(pd: EngineFleet) -> None:
    p, d, agg = pd
    async with aiohttp.ClientSession() as s:
        status, doc, _ = await post(s, d.url, prefill_body(request()))
        assert status == 400 and "kv_consumer" in doc["error"]["message"]
        _, pre, _ = await post(s, agg.url, prefill_body(request()), "r2")
        params = pre["kv_transfer_params"]
        assert params["remote_engine_id"] == agg.replica.kv_engine_id
        status, doc, _ = await post(s, p.url, decode_body(request(), params), "r2")
        assert status == 400 and "kv_producer" in doc["error"]["message"]
        # Refused steps claim nothing: the aggregated engine's KV is still there.
        assert agg.core.num_held_requests == 1
        # kv_both serves either step (vLLM's NIXL engines usually run kv_both).
        status, _, _ = await post(s, agg.url, decode_body(request(), params), "r2")
        assert status == 200
        # Every role serves a plain request.
        for e in pd:
            status, _, _ = await post(s, e.url, request())
            assert status == 200


async def test_a_malformed_decode_step_is_a_400(pd: EngineFleet) -> None:
    _, d, _ = pd
    bad = [
        {"do_remote_prefill": True, "remote_block_ids": [1]},
        {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": []},
        {"do_remote_prefill": True, "do_remote_decode": True},
        "yes",
    ]
    async with aiohttp.ClientSession() as s:
        for params in bad:
            status, doc, _ = await post(s, d.url, {**request(), "kv_transfer_params": params})
            assert status == 400, params
            assert doc["error"]["param"] == "kv_transfer_params"


async def test_metrics_report_role_and_transfers(pd: EngineFleet) -> None:
    p, d, _ = pd
    async with aiohttp.ClientSession() as s:
        _, pre, _ = await post(s, p.url, prefill_body(request()), "m1")
        await post(s, d.url, decode_body(request(), pre["kv_transfer_params"]), "m1")
        await post(s, d.url, decode_body(request(), pre["kv_transfer_params"]), "m1")
        texts = {}
        for e in (p, d):
            async with s.get(f"{e.url}/metrics") as resp:
                texts[e] = await resp.text()
    ptext, dtext = texts[p], texts[d]
    assert 'kv_role="kv_producer"' in ptext and 'kv_role="kv_consumer"' in dtext
    assert f'kv_engine_id="{p.replica.kv_engine_id}"' in ptext

    def sample(text: str, prefix: str) -> float:
        (line,) = [ln for ln in text.splitlines() if ln.startswith(prefix)]
        return float(line.rsplit(" ", 1)[1])

    assert sample(ptext, "meshd_sim:kv_prefill_steps_total{") == 1
    assert sample(ptext, "meshd_sim:kv_holds_fetched_total{") == 1
    assert sample(ptext, "meshd_sim:kv_held_blocks{") == 0
    assert sample(dtext, "meshd_sim:kv_remote_decode_steps_total{") == 1
    assert sample(dtext, "vllm:nixl_xfer_time_seconds_count{") == 1
    assert sample(dtext, "vllm:nixl_bytes_transferred_sum{") == d.core.stats.kv_transfer_bytes
    assert sample(dtext, "meshd_sim:kv_transfer_bytes_total{") == d.core.stats.kv_transfer_bytes
    refused = [ln for ln in dtext.splitlines() if 'reason="already_fetched"' in ln]
    assert refused and refused[0].endswith(" 1.0")


async def test_a_stopped_prefill_engine_cannot_be_fetched_from() -> None:
    fleet = EngineFleet(
        mixed_fleet(2, ["H100"], base=EngineSpec(time_scale=FAST), roles=["prefill", "decode"])
    )
    await fleet.start()
    try:
        p, d = fleet
        async with aiohttp.ClientSession() as s:
            _, pre, _ = await post(s, p.url, prefill_body(request()), "r1")
            await p.stop()
            status, doc, _ = await post(s, d.url, decode_body(request(), pre["kv_transfer_params"]))
        assert status == FETCH_FAILED_STATUS
        assert "(unknown_engine)" in doc["error"]["message"]
    finally:
        await fleet.stop()


async def test_recompute_policy_serves_the_request_whole() -> None:
    specs = mixed_fleet(
        2,
        ["H100"],
        base=EngineSpec(time_scale=FAST, kv_load_failure_policy="recompute"),
        roles=["prefill", "decode"],
    )
    async with EngineFleet(specs) as fleet:
        p, d = fleet
        async with aiohttp.ClientSession() as s:
            _, whole, _ = await post(s, d.url, request(), "plain")
            _, pre, _ = await post(s, p.url, prefill_body(request()), "r1")
            bad = {**pre["kv_transfer_params"], "remote_engine_id": "gone"}
            status, doc, _ = await post(s, d.url, decode_body(request(), bad), "r1")
        assert status == 200
        assert doc["choices"][0]["text"] == whole["choices"][0]["text"]
        assert d.core.stats.kv_fetch_refused["unknown_engine"] == 1
        assert d.core.stats.kv_remote_decode_steps == 0


# ---- on the virtual clock ------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.req: SimRequest | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    def on_tokens(self, engine: VirtualEngine, req: SimRequest, now: float) -> None:
        self.req = req
        if self.first_token_at is None and req.num_output_tokens:
            self.first_token_at = now
        if req.finished:
            self.finished_at = now

    def on_reset(self, engine: VirtualEngine, req: SimRequest, delivered: int, now: float) -> None:
        raise AssertionError("no reset expected")


def run_to(fleet: VirtualFleet, rec: Recorder, limit: int = 100_000) -> None:
    """Run the fleet until `rec`'s request finished."""
    for _ in range(limit):
        if rec.finished_at is not None:
            return
        assert fleet.run_next() is not None, "the fleet went idle"
    raise AssertionError("the request did not finish")


def virtual_pd(
    fleet: VirtualFleet, doc: dict[str, Any], *, at: float = 0.0, p: int = 0, d: int = 1
) -> tuple[Recorder, Recorder, dict[str, Any]]:
    pre = Recorder()
    got = fleet[p].submit("completion", prefill_body(doc), "r", at, pre)
    assert isinstance(got, Accepted)
    run_to(fleet, pre)
    params = fleet[p].transfer_params(got.req)
    assert params is not None
    dec = Recorder()
    got = fleet[d].submit("completion", decode_body(doc, params), "r", fleet.now, dec)
    assert isinstance(got, Accepted), got
    run_to(fleet, dec)
    return pre, dec, params


words = st.lists(
    st.sampled_from(["alpha", "beta", "gamma", "delta", ",", ".", "omega"]),
    min_size=1,
    max_size=90,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=words,
    seed=st.integers(0, 2**31),
    max_tokens=st.integers(1, 20),
    block_size=st.sampled_from([1, 4, 16]),
    warm=st.booleans(),
)
def test_virtual_pd_text_is_the_aggregated_text(
    prompt: list[str], seed: int, max_tokens: int, block_size: int, warm: bool
) -> None:
    """Whatever the prompt, seed, length and block size, and whether the decode engine
    already caches part of the prompt: the decode step says what one engine would, the
    prefill engine ends with nothing pinned, and only the missing tokens cross the link."""
    text = " ".join(prompt)
    doc = request(text, max_tokens, seed=seed)
    base = EngineSpec(block_size=block_size, kv_blocks=4096)
    fleet = VirtualFleet(mixed_fleet(3, ["H100"], base=base, roles=["prefill", "decode", "both"]))
    whole = Recorder()
    fleet[2].submit("completion", doc, "w", 0.0, whole)
    run_to(fleet, whole)
    local = 0
    if warm:
        # The decode engine served the same prompt before: its cache holds a prefix.
        old = Recorder()
        fleet[1].submit("completion", request(text, 1, seed=seed + 1), "o", fleet.now, old)
        run_to(fleet, old)
        assert old.req is not None
        local = (old.req.num_prompt_tokens - 1) // block_size * block_size
    _, dec, _ = virtual_pd(fleet, doc)
    assert whole.req is not None and dec.req is not None
    assert dec.req.output_text() == whole.req.output_text()
    n = dec.req.num_prompt_tokens
    assert dec.req.cached_tokens == n - 1
    assert fleet[1].core.stats.kv_transfer_bytes == (n - local) * KV_BYTES
    assert fleet[0].core.num_held_requests == 0
    assert fleet[0].core.kv_usage() == 0.0


def test_the_decode_step_pays_the_transfer_before_its_first_token() -> None:
    link_gbps = 1.0  # slow enough to see: 300+ tokens x 128 KiB = ~40 ms
    fleet = VirtualFleet(
        mixed_fleet(
            2, ["H100"], base=EngineSpec(kv_link_gbps=link_gbps), roles=["prefill", "decode"]
        )
    )
    _, dec, _ = virtual_pd(fleet, request())
    req = dec.req
    assert req is not None and dec.first_token_at is not None
    n = req.num_prompt_tokens
    transfer = n * KV_BYTES / (link_gbps * 1e9)
    one_token = fleet[1].replica.profile.step_time(1, 1, n, n)
    assert dec.first_token_at - req.arrival == pytest.approx(transfer + one_token)
    stats = fleet[1].core.stats
    assert stats.kv_transfer_seconds == pytest.approx(transfer)
    assert stats.nixl_xfer_time.count == 1
    # The decode engine's prompt was never computed there: one token of it, for logits.
    assert fleet[1].core.stats.iteration_tokens.sum == req.num_output_tokens
    # And the decode step ends in the decode engine's prefix cache.
    prompt_blocks = req.block_hashes[: n // 16]
    assert len(fleet[1].core.pool.cached_prefix(prompt_blocks)) == n // 16


def test_the_kv_expires_after_the_hold_and_the_decode_step_is_refused() -> None:
    fleet = VirtualFleet(
        mixed_fleet(2, ["H100"], base=EngineSpec(kv_hold_s=5.0), roles=["prefill", "decode"])
    )
    pre = Recorder()
    got = fleet[0].submit("completion", prefill_body(request()), "r", 0.0, pre)
    assert isinstance(got, Accepted)
    run_to(fleet, pre)
    params = fleet[0].transfer_params(got.req)
    assert params is not None
    assert fleet[0].core.num_held_blocks == len(params["remote_block_ids"])
    assert fleet[0].core.kv_usage() > 0
    finished = pre.finished_at
    assert finished is not None
    # The hold's end is an engine event: the fleet wakes the prefill engine for it.
    assert fleet.next_event_time() == pytest.approx(finished + 5.0)
    fleet.run_until(finished + 4.9)
    assert fleet[0].core.num_held_requests == 1
    fleet.run_until(finished + 5.1)
    assert fleet[0].core.num_held_requests == 0
    assert fleet[0].core.kv_usage() == 0.0
    assert fleet[0].core.stats.kv_holds_expired == 1
    got2 = fleet[1].submit("completion", decode_body(request(), params), "r", fleet.now, Recorder())
    assert isinstance(got2, Refused)
    assert got2.status == FETCH_FAILED_STATUS
    assert "(expired)" in got2.message
    assert fleet[1].core.stats.kv_fetch_refused["expired"] == 1


def test_a_claimed_hold_does_not_expire_while_the_decode_engine_queues() -> None:
    # The decode engine is busy for longer than the hold: its claim keeps the KV pinned
    # (vLLM's decode side renews its lease while it waits).
    fleet = VirtualFleet(
        mixed_fleet(
            2,
            ["H100"],
            base=EngineSpec(kv_hold_s=0.01, max_num_seqs=1),
            roles=["prefill", "decode"],
        )
    )
    busy = Recorder()
    fleet[1].submit("completion", request(max_tokens=400), "busy", 0.0, busy)
    pre = Recorder()
    got = fleet[0].submit("completion", prefill_body(request()), "r", 0.0, pre)
    assert isinstance(got, Accepted)
    run_to(fleet, pre)
    params = fleet[0].transfer_params(got.req)
    assert params is not None
    dec = Recorder()
    assert isinstance(
        fleet[1].submit("completion", decode_body(request(), params), "r", fleet.now, dec),
        Accepted,
    )
    run_to(fleet, dec)
    assert busy.finished_at is not None and busy.finished_at < (dec.first_token_at or 0)
    assert fleet[0].core.stats.kv_holds_expired == 0
    assert fleet[0].core.stats.kv_holds_fetched == 1


def test_a_decode_step_aborted_before_its_kv_lands_releases_the_hold() -> None:
    fleet = VirtualFleet(
        mixed_fleet(2, ["H100"], base=EngineSpec(kv_link_gbps=0.01), roles=["prefill", "decode"])
    )
    pre = Recorder()
    got = fleet[0].submit("completion", prefill_body(request()), "r", 0.0, pre)
    assert isinstance(got, Accepted)
    run_to(fleet, pre)
    params = fleet[0].transfer_params(got.req)
    assert params is not None
    dec = fleet[1].submit("completion", decode_body(request(), params), "r", fleet.now, Recorder())
    assert isinstance(dec, Accepted)
    fleet.run_until(fleet.now + 0.1)  # admitted, its 4 s transfer under way
    assert fleet[1].core.num_transferring == 1
    fleet[1].abort(dec.req, fleet.now)
    assert fleet[1].core.num_transferring == 0
    assert fleet[1].core.kv_usage() == 0.0
    assert fleet[0].core.num_held_requests == 0
    assert fleet[0].core.kv_usage() == 0.0
    again = fleet[1].submit(
        "completion", decode_body(request(), params), "r", fleet.now, Recorder()
    )
    assert isinstance(again, Refused) and "(released)" in again.message


def test_a_restarted_prefill_engine_forgets_its_kv() -> None:
    fleet = VirtualFleet(mixed_fleet(2, ["H100"], roles=["prefill", "decode"]))
    pre = Recorder()
    got = fleet[0].submit("completion", prefill_body(request()), "r", 0.0, pre)
    assert isinstance(got, Accepted)
    run_to(fleet, pre)
    params = fleet[0].transfer_params(got.req)
    assert params is not None
    fleet[0].inject(parse_fault({"kind": "restart"}), fleet.now)
    assert fleet[0].core.kv_usage() == 0.0
    got2 = fleet[1].submit("completion", decode_body(request(), params), "r", fleet.now, Recorder())
    assert isinstance(got2, Refused) and "(unknown_request)" in got2.message


def test_a_prefill_step_that_ends_on_eos_pins_nothing() -> None:
    fleet = VirtualFleet([EngineSpec(role="prefill", eos_rate=0.9)])
    stopped = 0
    for seed in range(20):
        rec = Recorder()
        doc = {"prompt": PROMPT, "max_tokens": 5, "seed": seed}
        got = fleet[0].submit("completion", prefill_body(doc), f"r{seed}", fleet.now, rec)
        assert isinstance(got, Accepted)
        run_to(fleet, rec)
        params = fleet[0].transfer_params(got.req)
        if got.req.finish_reason == "stop":
            stopped += 1
            assert params is None
        else:
            assert params is not None
    assert stopped > 0
    assert fleet[0].core.num_held_requests == 20 - stopped


def test_one_engine_can_prefill_and_decode_its_own_request() -> None:
    fleet = VirtualFleet([EngineSpec(role="both")])
    whole = Recorder()
    fleet[0].submit("completion", request(), "w", 0.0, whole)
    run_to(fleet, whole)
    _, dec, _ = virtual_pd(fleet, request(), p=0, d=0)
    assert whole.req is not None and dec.req is not None
    assert dec.req.output_text() == whole.req.output_text()
    assert fleet[0].core.num_held_requests == 0
    assert fleet[0].core.kv_usage() == 0.0


# ---- configuration -------------------------------------------------------------------------


def test_fleet_files_and_flags_take_the_roles() -> None:
    cfg = fleet_from_dict(
        {
            "defaults": {"kv_hold_s": 30, "kv_link_gbps": 25},
            "engines": [
                {"role": "prefill", "count": 2, "kv_engine_id": "p"},
                {"role": "decode", "kv_load_failure_policy": "recompute"},
            ],
        }
    )
    assert [e.role for e in cfg.engines] == ["prefill", "prefill", "decode"]
    assert [e.kv_engine_id for e in cfg.engines] == ["p", "p-1", None]
    assert cfg.engines[2].kv_load_failure_policy == "recompute"
    assert {e.kv_hold_s for e in cfg.engines} == {30}
    with pytest.raises(ConfigError, match="role"):
        fleet_from_dict({"engines": [{"role": "producer"}]})
    with pytest.raises(ConfigError, match="kv_hold_s"):
        fleet_from_dict({"engines": [{"kv_hold_s": 0}]})
    with pytest.raises(ConfigError, match="kv_load_failure_policy"):
        fleet_from_dict({"engines": [{"kv_load_failure_policy": "retry"}]})

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(
        [
            "sim-engine",
            "--fleet",
            "5",
            "--roles",
            "prefill,prefill,decode,decode",
            "--kv-hold",
            "60",
            "--kv-link-gbps",
            "12.5",
        ]
    )
    _, specs = specs_from_args(args)
    assert [s.role for s in specs] == ["prefill", "prefill", "decode", "decode", "prefill"]
    assert {(s.kv_hold_s, s.kv_link_gbps) for s in specs} == {(60.0, 12.5)}
    with pytest.raises(ConfigError, match="role"):
        specs_from_args(parser.parse_args(["sim-engine", "--roles", "prefill,oops"]))
