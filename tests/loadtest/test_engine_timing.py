"""The engine simulator's timing model and scheduler, on a fake clock (sans-I/O core)."""

from __future__ import annotations

import math

import pytest
from sim_helpers import make_core, request

from loadtest.engine.core import RequestRejected, Status, run_until_idle
from loadtest.engine.profiles import GPUS, get_profile


def test_more_batch_or_more_context_makes_a_longer_decode_step() -> None:
    p = get_profile("H100")
    assert p.decode_step_time(64, 1000) > p.decode_step_time(8, 1000) > p.decode_step_time(1, 1000)
    assert p.decode_step_time(32, 4000) > p.decode_step_time(32, 500)
    # Decode is memory bound: 64 sequences cost far less than 64 single steps.
    assert p.decode_step_time(64, 1000) < 4 * p.decode_step_time(1, 1000)


def test_gpu_generations_order_by_speed_and_price() -> None:
    order = ["A100", "H100", "H200", "B200"]
    steps = [get_profile(g).decode_step_time(32, 2000) for g in order]
    prefill = [get_profile(g).prefill_tokens_per_s for g in order]
    prices = [get_profile(g).price_per_gpu_hour for g in order]
    assert steps == sorted(steps, reverse=True)
    assert prefill == sorted(prefill)
    assert prices == sorted(prices)
    assert get_profile("H200").kv_blocks > 1.9 * get_profile("H100").kv_blocks
    assert set(GPUS) == set(order)


def test_profile_numbers_match_published_calibration_points() -> None:
    h100 = get_profile("h100")
    # Batch-1 decode of an 8B model on H100 is ~7 ms per token in published runs.
    assert 0.005 < h100.decode_step_time(1, 512) < 0.010
    assert 20_000 < h100.prefill_tokens_per_s < 40_000
    # Llama-3-8B on an 80 GB card holds ~440k tokens of KV at 0.9 utilisation.
    assert 400_000 < h100.kv_blocks * 16 < 480_000
    assert get_profile("A100", kv_blocks=64).kv_blocks == 64
    with pytest.raises(ValueError, match="unknown GPU"):
        get_profile("V100")


def test_chunked_prefill_respects_the_token_budget() -> None:
    core = make_core(max_num_batched_tokens=256)
    prompt = list(range(1000, 1000 + 1000))
    req = request("a", prompt, 4)
    core.submit(req, 0.0)
    steps_before_first_token = 0
    now = 0.0
    while req.first_token_time is None:
        t = core.next_event_time()
        assert t is not None
        now = t
        core.step(now)
        if core._batch_tokens:
            assert sum(core._batch_tokens) <= 256
        steps_before_first_token += 1
    # 1000 prompt tokens at 256 per step: 4 chunks, the 4th ends with the first token.
    assert steps_before_first_token == math.ceil(1000 / 256) + 1
    assert core.stats.iteration_tokens.count >= 4


def test_decode_shares_the_budget_with_a_prefill_chunk() -> None:
    core = make_core(max_num_batched_tokens=64)
    a = request("a", range(5000, 5010), 50)
    core.submit(a, 0.0)
    t = 0.0
    while a.first_token_time is None:
        t = core.next_event_time() or t
        core.step(t)
    b = request("b", range(6000, 6200), 4)
    core.submit(b, t)
    t = core.next_event_time() or t
    core.step(t)
    # One decode token for a, the rest of the 64-token budget goes to b's prefill.
    assert core._batch_tokens == [1, 63]


def test_prefix_cache_hit_shortens_time_to_first_token() -> None:
    core = make_core("A100")
    prompt = list(range(2000, 2000 + 2048))
    first = request("a", prompt, 1)
    core.submit(first, 0.0)
    end, _ = run_until_idle(core)
    cold = first.first_token_time - first.arrival  # type: ignore[operator]
    second = request("b", prompt, 1)
    core.submit(second, end + 1.0)
    run_until_idle(core, end + 1.0)
    warm = second.first_token_time - second.arrival  # type: ignore[operator]
    assert second.cached_tokens == 2032  # all full blocks but the last token's
    assert warm < cold / 5
    assert core.stats.prefix_cache_hits == 2032
    assert core.stats.prefix_cache_queries == 2 * 2048


def test_continuous_batching_joins_running_requests() -> None:
    core = make_core()
    a = request("a", range(10, 20), 30)
    core.submit(a, 0.0)
    t = 0.0
    for _ in range(5):
        t = core.next_event_time() or t
        core.step(t)
    b = request("b", range(30, 40), 5)
    core.submit(b, t)
    run_until_idle(core, t)
    assert a.finish_time is not None and b.finish_time is not None
    assert b.finish_time < a.finish_time
    assert a.num_output_tokens == 30 and b.num_output_tokens == 5


def test_preemption_when_kv_cache_is_exhausted() -> None:
    # 8 blocks of 16 tokens; two requests that each grow to 4-5 blocks cannot both fit.
    core = make_core(kv_blocks=8, caching=False)
    a = request("a", range(100, 140), 30)
    b = request("b", range(200, 240), 30)
    core.submit(a, 0.0)
    core.submit(b, 0.0)
    run_until_idle(core)
    assert core.stats.num_preemptions >= 1
    assert b.num_preemptions >= 1  # the later-admitted request is the victim
    assert a.finish_reason == b.finish_reason == "length"
    assert a.num_output_tokens == b.num_output_tokens == 30
    assert core.pool.num_free == 8
    again = make_core(kv_blocks=64, caching=False)
    solo = request("b", range(200, 240), 30)
    again.submit(solo, 0.0)
    run_until_idle(again)
    # Preemption recomputes; it never changes what is generated.
    assert solo.output_pieces == b.output_pieces


def test_waiting_requests_queue_behind_max_num_seqs() -> None:
    core = make_core(max_num_seqs=2)
    reqs = [request(str(i), range(300 + 10 * i, 305 + 10 * i), 10) for i in range(4)]
    for r in reqs:
        core.submit(r, 0.0)
    core.step(0.0)
    assert core.num_running == 2 and core.num_waiting == 2
    run_until_idle(core)
    assert all(r.finished for r in reqs)
    q = core.stats.queue_time
    assert q.count == 4 and q.sum > 0


def test_slowdown_multiplies_step_time() -> None:
    fast, slow = make_core(), make_core()
    slow.set_slowdown(10.0)
    for core in (fast, slow):
        core.submit(request("a", range(50, 90), 20), 0.0)
    t_fast, _ = run_until_idle(fast)
    t_slow, _ = run_until_idle(slow)
    assert t_slow == pytest.approx(10 * t_fast, rel=1e-9)


def test_pause_freezes_and_resume_shifts_the_inflight_step() -> None:
    core = make_core()
    req = request("a", range(50, 60), 5)
    core.submit(req, 0.0)
    core.step(0.0)
    finish = core.next_event_time()
    assert finish is not None
    core.pause(finish / 2)
    assert core.next_event_time() is None
    assert not core.step(finish + 100.0).updated
    core.resume(finish / 2 + 7.0)
    assert core.next_event_time() == pytest.approx(finish + 7.0)
    core.pause(core.next_event_time() or 0.0, until=50.0)
    assert core.next_event_time() == 50.0
    run_until_idle(core)
    assert req.finished and req.finish_time is not None and req.finish_time > 50.0


def test_restart_drops_requests_and_clears_the_cache() -> None:
    core = make_core()
    done = request("a", range(7000, 7100), 2)
    core.submit(done, 0.0)
    t, _ = run_until_idle(core)
    assert core.pool.num_cached > 0
    live = request("b", range(8000, 8050), 100)
    core.submit(live, t)
    core.step(t)
    core.take_events()
    dropped = core.restart(t + 0.001)
    assert dropped == [live] and live.reset and live.finish_reason == "abort"
    assert core.pool.num_cached == 0 and core.pool.num_free == core.pool.num_blocks
    assert [type(e).__name__ for e in core.take_events()] == ["AllBlocksCleared"]
    assert core.stats.generation_tokens == 0
    assert core.next_event_time() is None


def test_abort_frees_blocks_and_counts_the_reason() -> None:
    core = make_core()
    req = request("a", range(400, 480), 100)
    core.submit(req, 0.0)
    core.step(0.0)
    assert core.kv_usage() > 0
    core.abort(req, 0.01)
    assert req.status is Status.FINISHED and req.finish_reason == "abort"
    assert core.kv_usage() == 0
    assert core.stats.request_success["abort"] == 1
    run_until_idle(core)


def test_requests_that_can_never_fit_are_rejected() -> None:
    core = make_core(kv_blocks=4, max_model_len=1024)
    with pytest.raises(RequestRejected, match="KV blocks"):
        core.submit(request("a", range(10, 60), 30), 0.0)
    with pytest.raises(RequestRejected, match="max_model_len"):
        make_core(max_model_len=64).submit(request("b", range(10, 60), 30), 0.0)
    with pytest.raises(RequestRejected, match="empty"):
        core.submit(request("c", [], 3), 0.0)


def test_virtual_clock_throughput_matches_the_profile() -> None:
    # 32 concurrent decodes on a B200 vs an A100: the B200 finishes ~3x sooner.
    ends = {}
    for gpu in ("A100", "B200"):
        core = make_core(gpu)
        for i in range(32):
            core.submit(request(str(i), range(1000 + i * 7, 1000 + i * 7 + 500), 200), 0.0)
        ends[gpu], _ = run_until_idle(core)
    assert 2.0 < ends["A100"] / ends["B200"] < 5.0
