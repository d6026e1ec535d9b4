"""One inference endpoint as the picker sees it: static config, the engine's last report
(from the control plane, stale after a TTL) and what this proxy observed itself.

Sans-I/O and mutable: the driver (sidecar, ext_proc picker, simulator) calls `start`,
`first_token`, `finish`, `connect_failure` and `report` with `now`; every change bumps
`version`, which is how the picker knows when its cached view of the endpoint is stale.
Where a reported and a local figure disagree the larger load wins: the report sees every
client's traffic but lags, the local figures are current but see only ours.
"""

from __future__ import annotations

import math
import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["BlockDigest", "EndpointState", "ReportedBlocks", "ReportedState"]

# Calibration (observed / predicted TTFT): EWMA weight of a new sample, and clamps that
# keep one pathological sample (a GC pause, a network blip) from swinging the model.
CALIBRATION_ALPHA = 0.1
CALIBRATION_SAMPLE_RANGE = (0.2, 5.0)
CALIBRATION_RANGE = (0.25, 8.0)
# Below this predicted compute time the measured TTFT is mostly network and framing.
CALIBRATION_MIN_NOMINAL_S = 0.002
RESIDENCE_ALPHA = 0.1
# Decode calibration (observed inter-token latency / the predicted decode step at
# dispatch), learnt from streams of at least DECODE_MIN_TOKENS output tokens: the same
# EWMA and clamps as the TTFT's. An engine that decodes slower than its table (an A100
# nobody named, thermals, a noisy neighbour) is seen within a few streams.
DECODE_MIN_TOKENS = 8
# Evidence ages while the engine is shunned: once a calibration has had neither a sample
# nor a request sent there for CALIBRATION_STALE_S (the picker learnt it was slow and
# stopped sending), its log halves every CALIBRATION_HALF_LIFE_S, back toward the table
# (1.0), in steps of CALIBRATION_AGE_STEP_S, so that an engine that recovered wins picks
# again once it is competitive on the rest; and the next sample weighs up to
# CALIBRATION_STALE_ALPHA as the old evidence faded, so a still-slow engine is re-learnt
# from a sample or two. An engine in use keeps what it taught, sample or not (requests
# mostly cached give none).
# (Without it, issue #21's engine-slow run: the engine 10x slow for 6 s was sent nothing
# in the 30 s after it recovered.)
CALIBRATION_STALE_S = 5.0
CALIBRATION_HALF_LIFE_S = 5.0
CALIBRATION_AGE_STEP_S = 1.0
CALIBRATION_STALE_ALPHA = 0.5
PROMPT_ALPHA = 0.05
DEFAULT_PROMPT_TOKENS = 1024.0

# An overload refusal (429 or 503 before any byte): the engine said it is full. Believe
# it for its Retry-After, else REFUSAL_HOLD_S doubling with each refusal in a row up to
# REFUSAL_HOLD_MAX_S; the picker counts the hold as queue there (a refusing engine answers
# at once and would otherwise look idle, the first pick again: issue #21's engine-503
# run, 1.23 attempts per request during the storm). A first token ends the streak.
REFUSAL_HOLD_S = 0.5
REFUSAL_HOLD_MAX_S = 8.0
REFUSAL_RETRY_AFTER_MAX_S = 60.0

# Passive health, as filters/balancer.py: rest after this many connect failures in a row,
# doubling while it keeps failing.
UNHEALTHY_AFTER = 3
COOLDOWN_S = 10.0
COOLDOWN_MAX_FACTOR = 16


@dataclass(frozen=True, slots=True)
class ReportedState:
    """An engine's state as its agent reports it (the xDS EndpointState resource).

    Fields that an agent does not know stay None; counters default to 0.
    """

    epoch: str | int = 0  # changes when the engine restarts (its cache is then empty)
    healthy: bool = True
    draining: bool = False
    gpu: str | None = None
    gpu_count: int | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    kv_block_size: int | None = None  # tokens per engine block
    kv_capacity_blocks: int | None = None
    kv_usage: float | None = None  # 0..1, vllm:kv_cache_usage_perc
    requests_running: int = 0
    requests_waiting: int = 0
    tokens_in_flight: int = 0
    ttft_s: float | None = None  # moving averages
    tpot_s: float | None = None
    models: Mapping[str, bool] = field(default_factory=dict)  # served model -> weights warm
    adapters: Mapping[str, bool] = field(default_factory=dict)  # LoRA adapter -> loaded

    @property
    def kv_capacity_tokens(self) -> int | None:
        if self.kv_block_size is None or self.kv_capacity_blocks is None:
            return None
        return self.kv_block_size * self.kv_capacity_blocks


class BlockDigest(Protocol):
    """One digest of an engine's cached KV blocks, as the control plane carries it
    (xds.resources.PrefixDigest, which filters/ must not import, has this shape): full (the
    whole set) or cumulative since the full digest `base_seq`."""

    @property
    def epoch(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def base_seq(self) -> int: ...
    @property
    def full(self) -> bool: ...
    @property
    def added(self) -> Sequence[int]: ...
    @property
    def removed(self) -> Sequence[int]: ...


@dataclass(slots=True)
class ReportedBlocks:
    """The block hashes one engine holds, rebuilt from its digests.

    A digest that is not full applies only on top of the full digest it names (same epoch,
    `base_seq`); any other is ignored until the next full one, so the set may lag but never
    claims a block on a base it did not see. `apply` returns the blocks that left the set
    (what a PrefixIndex must forget), or None when the digest was ignored.
    """

    epoch: str | None = None
    base_seq: int = -1
    seq: int = -1
    base: frozenset[int] = frozenset()
    blocks: frozenset[int] = frozenset()
    applied_at: float = float("-inf")
    ignored: int = 0

    def apply(self, digest: BlockDigest, now: float) -> frozenset[int] | None:
        same_epoch = digest.epoch == self.epoch
        if digest.full:
            if same_epoch and digest.seq <= self.seq:
                self.ignored += 1  # an older full digest (a replica lagging behind)
                return None
            new = frozenset(digest.added)
            self.base, self.base_seq = new, digest.seq
        elif same_epoch and digest.base_seq == self.base_seq and digest.seq > self.seq:
            new = (self.base - frozenset(digest.removed)) | frozenset(digest.added)
        else:
            self.ignored += 1
            return None
        gone = self.blocks - new
        self.epoch, self.seq, self.blocks, self.applied_at = digest.epoch, digest.seq, new, now
        return gone

    def prefix_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a chained hash sequence the engine holds (chained
        hashes: the first miss ends the match)."""
        blocks = self.blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n


@dataclass(slots=True)
class _InFlight:
    prompt_tokens: int
    uncached_tokens: int
    max_tokens: int
    started_at: float
    nominal_s: float
    fixed_s: float
    step_s: float = 0.0  # the predicted decode step at dispatch, uncalibrated (0: none)
    first_token_at: float | None = None


@dataclass(slots=True, eq=False)
class EndpointState:
    """Static config + reported state + local observations of one endpoint.

    `models` None means "whatever it is asked for" (a plain pool with no model list);
    `speed_scale` is the served model's speed relative to the reference 8B model
    (about 8e9 / parameters for a dense model; the TTFT calibration refines it).
    """

    name: str
    url: str = ""
    gpu: str = "unknown"
    gpu_count: int = 1
    models: frozenset[str] | None = None
    adapters: frozenset[str] = frozenset()
    dynamic_lora: bool = False  # can load any adapter on demand (cold)
    kv_capacity_tokens: int | None = None
    speed_scale: float = 1.0
    report_ttl_s: float = 10.0

    # Reported state.
    reported: ReportedState | None = None
    reported_at: float = float("-inf")
    # Ours when the report came (tokens_in_flight, output_tokens_in_flight): the report's KV
    # in use less these is the other clients' (Picker._static_view), and ours now is exact.
    tokens_at_report: int = 0
    outputs_at_report: int = 0
    # Local observations.
    outstanding: int = 0
    waiting: int = 0  # outstanding without a first token yet
    pending_prefill_tokens: int = 0  # uncached prompt tokens of those
    # Since when the engine has been working through those: the last time the queue went
    # from empty to busy or its head got its first token (engines prefill first come,
    # first served), so the work done since is behind it (Picker: the queue drains).
    prefill_since: float = 0.0
    tokens_in_flight: int = 0  # prompt + max output tokens of all outstanding
    output_tokens_in_flight: int = 0  # max output tokens of all outstanding
    ttft_ratio: float = 1.0  # EWMA of observed / predicted TTFT compute time
    decode_ratio: float = 1.0  # EWMA of observed inter-token latency / predicted step
    # Each ratio's evidence: (the ratio, when last sampled or used, how much of it had
    # faded when traffic came back); None: never sampled. The ratios above age from
    # these (age_calibration).
    ttft_sampled: tuple[float, float, float] | None = None
    decode_sampled: tuple[float, float, float] | None = None
    calibration_aged_at: float = float("-inf")
    residence_s: float | None = None  # EWMA of request duration
    prompt_tokens_avg: float = DEFAULT_PROMPT_TOKENS
    consecutive_failures: int = 0
    failures: int = 0
    refusals: int = 0  # overload refusals in a row (refused())
    refused_until: float = float("-inf")
    last_failure_at: float | None = None
    ejected_until: float = float("-inf")  # by our own connect failures (above)
    draining: bool = False  # set locally (admin drain, an EDS health flag)
    # Set by the reliability filters (filters/guard.py through PoolRouter.set_flags): the
    # breaker, the outlier detector's ejection (kept apart from `ejected_until` so that
    # either one ending does not end the other) and the slow-start weight in (0, 1].
    breaker_open: bool = False
    outlier_ejected_until: float = float("-inf")
    ramp: float = 1.0
    version: int = 0  # bumped by every change
    static_version: int = 0  # bumped by reports, flags and failures (not request traffic)
    _inflight: dict[Hashable, _InFlight] = field(default_factory=dict, repr=False)
    # The picker's cached, request-independent view of this endpoint (filters/picker.py),
    # kept here so that a pick finds it with one attribute load instead of a dict lookup;
    # every change moves it to _pick_stale (the picker rebuilds from there), so a pick
    # need only test it for None.
    _pick_view: Any = field(default=None, repr=False)
    _pick_stale: Any = field(default=None, repr=False)

    def _changed(self) -> None:
        """Every mutation ends here. Change fields through the methods (or call touch())."""
        self.version += 1
        v = self._pick_view
        if v is not None:
            self._pick_stale = v
            self._pick_view = None

    def touch(self) -> None:
        """Fields were assigned directly (e.g. `models`): make the picker look again."""
        self.static_version += 1
        self._changed()

    # -- reports --------------------------------------------------------------------------

    def report(self, state: ReportedState, now: float) -> None:
        before = self.reported
        if (
            before is not None
            and before.epoch not in ("", 0)
            and state.epoch not in ("", 0)
            and before.epoch != state.epoch
        ):
            # A restart: perhaps on another node, another GPU. What was learnt of its speed
            # may not hold; it is learnt again (its cache is dropped by the prefix index).
            self.ttft_ratio = 1.0
            self.decode_ratio = 1.0
            self.ttft_sampled = self.decode_sampled = None
        self.reported = state
        self.reported_at = now
        self.tokens_at_report = self.tokens_in_flight
        self.outputs_at_report = self.output_tokens_in_flight
        self._changed()
        self.static_version += 1

    def forget_report(self) -> None:
        """The engine's report is gone (its resource removed): back to local observations."""
        if self.reported is None:
            return
        self.reported = None
        self.reported_at = float("-inf")
        self._changed()
        self.static_version += 1

    def fresh_report(self, now: float) -> ReportedState | None:
        """The last report if it is younger than `report_ttl_s`, else None."""
        if self.reported is not None and now - self.reported_at < self.report_ttl_s:
            return self.reported
        return None

    def silent_for(self, now: float) -> float:
        """Seconds since the last report went stale (0 when fresh or never reported)."""
        if self.reported is None:
            return 0.0
        return max(0.0, now - self.reported_at - self.report_ttl_s)

    @property
    def epoch(self) -> str | int | None:
        return None if self.reported is None else self.reported.epoch

    # -- request lifecycle ----------------------------------------------------------------

    def start(
        self,
        request_id: Hashable,
        now: float,
        *,
        prompt_tokens: int,
        uncached_tokens: int | None = None,
        max_tokens: int = 0,
        nominal_s: float = 0.0,
        fixed_s: float = 0.0,
        step_s: float = 0.0,
    ) -> None:
        """A request was sent here. `nominal_s` is the predicted TTFT compute part at the
        GPU's nominal speed and `fixed_s` the part that does not scale with it (a cold
        load); both come from the picker's Choice and feed the calibration. `step_s` is
        the predicted decode step it joins, before the decode calibration (0: none)."""
        if request_id in self._inflight:
            raise ValueError(f"request {request_id!r} already started on {self.name}")
        uncached = prompt_tokens if uncached_tokens is None else uncached_tokens
        self._inflight[request_id] = _InFlight(
            prompt_tokens, uncached, max_tokens, now, nominal_s, fixed_s, step_s
        )
        self.outstanding += 1
        if self.ttft_sampled is not None:
            self.ttft_sampled = _fold(self.ttft_sampled, now)
            self.ttft_ratio = self.ttft_sampled[0]
        if self.decode_sampled is not None:
            self.decode_sampled = _fold(self.decode_sampled, now)
            self.decode_ratio = self.decode_sampled[0]
        if not self.waiting:
            self.prefill_since = now
        self.waiting += 1
        self.pending_prefill_tokens += uncached
        self.tokens_in_flight += prompt_tokens + max_tokens
        self.output_tokens_in_flight += max_tokens
        self.prompt_tokens_avg += PROMPT_ALPHA * (prompt_tokens - self.prompt_tokens_avg)
        self._changed()

    def first_token(self, request_id: Hashable, now: float) -> float | None:
        """The first token arrived; returns the observed TTFT (None for an unknown id)."""
        f = self._inflight.get(request_id)
        if f is None or f.first_token_at is not None:
            return None
        f.first_token_at = now
        self.waiting -= 1
        self.pending_prefill_tokens -= f.uncached_tokens
        self.prefill_since = now
        self.refusals = 0
        ttft = now - f.started_at
        if f.nominal_s >= CALIBRATION_MIN_NOMINAL_S:
            lo, hi = CALIBRATION_SAMPLE_RANGE
            sample = min(hi, max(lo, (ttft - f.fixed_s) / f.nominal_s))
            self.ttft_ratio = _learn(self.ttft_sampled, self.ttft_ratio, sample, now)
            self.ttft_sampled = (self.ttft_ratio, now, 0.0)
        self.consecutive_failures = 0
        self._changed()
        return ttft

    def finish(
        self,
        request_id: Hashable,
        now: float,
        *,
        ok: bool = True,
        output_tokens: int | None = None,
    ) -> None:
        """The request ended (completed, failed or cancelled). Unknown ids are ignored.
        `output_tokens` (a stream's completion tokens) with the first token's time gives
        the observed inter-token latency, which feeds the decode calibration."""
        f = self._inflight.pop(request_id, None)
        if f is None:
            return
        t1 = f.first_token_at
        if (
            ok
            and t1 is not None
            and f.step_s > 0.0
            and output_tokens is not None
            and output_tokens >= DECODE_MIN_TOKENS
        ):
            lo, hi = CALIBRATION_SAMPLE_RANGE
            itl = (now - t1) / (output_tokens - 1)
            sample = min(hi, max(lo, itl / f.step_s))
            self.decode_ratio = _learn(self.decode_sampled, self.decode_ratio, sample, now)
            self.decode_sampled = (self.decode_ratio, now, 0.0)
        if f.first_token_at is None:
            self.waiting -= 1
            self.pending_prefill_tokens -= f.uncached_tokens
        self.outstanding -= 1
        self.tokens_in_flight -= f.prompt_tokens + f.max_tokens
        self.output_tokens_in_flight -= f.max_tokens
        if ok:
            d = now - f.started_at
            r = self.residence_s
            self.residence_s = d if r is None else r + RESIDENCE_ALPHA * (d - r)
            self.consecutive_failures = 0
        self._changed()

    def refused(self, now: float, retry_after_s: float | None = None) -> float:
        """The engine refused a request as overloaded (429, or 503 before any byte),
        saying Retry-After `retry_after_s` or not; returns how long it is held (the
        picker's queue there until then, see REFUSAL_HOLD_S)."""
        self.refusals += 1
        if retry_after_s is not None and retry_after_s >= 0:
            hold = min(REFUSAL_RETRY_AFTER_MAX_S, retry_after_s)
        else:
            hold = min(REFUSAL_HOLD_MAX_S, REFUSAL_HOLD_S * 2.0 ** min(16, self.refusals - 1))
        if now + hold > self.refused_until:
            self.refused_until = now + hold
        self._changed()
        self.static_version += 1  # the views' freshness deadline moves (next_change)
        return hold

    def connect_failure(self, now: float) -> None:
        """A connection or request to this endpoint failed before any response byte."""
        self.failures += 1
        self.consecutive_failures += 1
        self.last_failure_at = now
        over = self.consecutive_failures - UNHEALTHY_AFTER
        if over >= 0:
            self.ejected_until = now + COOLDOWN_S * min(COOLDOWN_MAX_FACTOR, 2**over)
        self._changed()
        self.static_version += 1

    def set_flags(
        self,
        *,
        draining: bool | None = None,
        breaker_open: bool | None = None,
        outlier_ejected_until: float | None = None,
        ramp: float | None = None,
    ) -> bool:
        """Set the flags given (None: leave as is; `outlier_ejected_until` -inf: not
        ejected). Returns whether anything changed: only a change makes the picker look
        again, so a driver may repeat the same flags cheaply."""
        if ramp is not None and not 0.0 < ramp <= 1.0:
            raise ValueError(f"ramp must be in (0, 1], got {ramp}")
        changed = False
        if draining is not None and draining != self.draining:
            self.draining, changed = draining, True
        if breaker_open is not None and breaker_open != self.breaker_open:
            self.breaker_open, changed = breaker_open, True
        if (
            outlier_ejected_until is not None
            and outlier_ejected_until != self.outlier_ejected_until
        ):
            self.outlier_ejected_until, changed = outlier_ejected_until, True
        if ramp is not None and ramp != self.ramp:
            self.ramp, changed = ramp, True
        if changed:
            self._changed()
            self.static_version += 1
        return changed

    # -- derived views ----------------------------------------------------------------------

    def ineligible_reason(self, now: float) -> str | None:
        """Why the picker must not use this endpoint now, or None when it may."""
        if self.draining:
            return "draining"
        if self.breaker_open:
            return "breaker-open"
        if now < self.ejected_until or now < self.outlier_ejected_until:
            return "ejected"
        r = self.fresh_report(now)
        if r is not None:
            if not r.healthy:
                return "unhealthy"
            if r.draining:
                return "draining"
        return None

    def age_calibration(self, now: float) -> None:
        """Let the calibrations' evidence age to `now` (CALIBRATION_STALE_S above): a
        ratio with neither a sample nor a request for that long moves back toward 1.0.
        Idempotent; a change counts as one (views rebuild). The picker calls it as it
        rebuilds a view."""
        if now < self.calibration_aged_at + CALIBRATION_AGE_STEP_S:
            return
        self.calibration_aged_at = now
        ttft = _aged(self.ttft_sampled, self.ttft_ratio, now)
        decode = _aged(self.decode_sampled, self.decode_ratio, now)
        if ttft != self.ttft_ratio or decode != self.decode_ratio:
            self.ttft_ratio = ttft
            self.decode_ratio = decode
            self._changed()

    def next_change(self, now: float) -> float:
        """The next time at which a time-dependent view (freshness, ejection, a
        calibration's ageing step) flips."""
        t = float("inf")
        if self.ejected_until > now:
            t = self.ejected_until
        if now < self.outlier_ejected_until < t:
            t = self.outlier_ejected_until
        if self.reported is not None:
            stale_at = self.reported_at + self.report_ttl_s
            if stale_at > now:
                t = min(t, stale_at)
        if now < self.refused_until < t:
            t = self.refused_until
        for sampled, ratio in (
            (self.ttft_sampled, self.ttft_ratio),
            (self.decode_sampled, self.decode_ratio),
        ):
            if sampled is not None and ratio != 1.0:
                at = sampled[1] + CALIBRATION_STALE_S
                step = self.calibration_aged_at + CALIBRATION_AGE_STEP_S
                t = min(t, at if at > step else step)
        return t

    def model_warm(self, model: str, now: float) -> bool | None:
        """True/False: served with weights warm/cold; None: not served here."""
        r = self.fresh_report(now)
        if r is not None and r.models:
            return r.models.get(model)  # a fresh list of served models is authoritative
        if self.models is None or model in self.models:
            return True
        return None

    def adapter_warm(self, adapter: str, now: float) -> bool | None:
        r = self.fresh_report(now)
        if r is not None and r.adapters:
            warm = r.adapters.get(adapter)
            if warm is not None:
                return warm
        if adapter in self.adapters:
            return True
        return False if self.dynamic_lora else None

    def gpu_name(self, now: float) -> str:
        r = self.fresh_report(now)
        return r.gpu if r is not None and r.gpu else self.gpu

    def gpus(self, now: float) -> int:
        r = self.fresh_report(now)
        return r.gpu_count if r is not None and r.gpu_count else self.gpu_count

    def kv_capacity(self, now: float) -> int | None:
        r = self.fresh_report(now)
        if r is not None and r.kv_capacity_tokens is not None:
            return r.kv_capacity_tokens
        return self.kv_capacity_tokens

    def kv_used(self, now: float) -> float:
        """KV tokens in use: the report's usage fraction or our in-flight tokens, larger."""
        used = float(self.tokens_in_flight)
        r = self.fresh_report(now)
        if r is not None:
            cap = r.kv_capacity_tokens
            if cap is not None and r.kv_usage is not None:
                used = max(used, r.kv_usage * cap)
            used = max(used, float(r.tokens_in_flight))
        return used

    def running(self, now: float) -> int:
        local = self.outstanding - self.waiting
        r = self.fresh_report(now)
        return max(local, r.requests_running) if r is not None else local

    def queued(self, now: float) -> int:
        r = self.fresh_report(now)
        return max(self.waiting, r.requests_waiting) if r is not None else self.waiting

    def queued_prefill_tokens(self, now: float) -> float:
        """Uncached prompt tokens ahead of a new request (the report counts waiting
        requests, not their tokens: each is taken at the average prompt seen here)."""
        local = float(self.pending_prefill_tokens)
        r = self.fresh_report(now)
        if r is not None:
            return max(local, r.requests_waiting * self.prompt_tokens_avg)
        return local

    def load_tokens(self, now: float) -> float:
        r = self.fresh_report(now)
        local = float(self.tokens_in_flight)
        return max(local, float(r.tokens_in_flight)) if r is not None else local

    def load_requests(self, now: float) -> float:
        r = self.fresh_report(now)
        if r is not None:
            return float(max(self.outstanding, r.requests_running + r.requests_waiting))
        return float(self.outstanding)


def _keep(sampled: tuple[float, float, float] | None, now: float) -> float:
    """How much of a calibration's evidence still holds at `now` (1: fresh or none)."""
    if sampled is None:
        return 1.0
    idle = now - sampled[1] - CALIBRATION_STALE_S
    if idle <= 0.0:
        return 1.0
    return 0.5 ** (idle / CALIBRATION_HALF_LIFE_S)


def _aged(sampled: tuple[float, float, float] | None, current: float, now: float) -> float:
    """The ratio its evidence left, aged to `now`: its log shrinks by the evidence lost
    (1.0 within 0.5% of it, so that a view settles). Never sampled: `current`."""
    if sampled is None:
        return current
    keep = _keep(sampled, now)
    if keep == 1.0:
        return sampled[0]
    ratio = math.exp(math.log(sampled[0]) * keep)
    return 1.0 if abs(ratio - 1.0) < 0.005 else ratio


def _fold(sampled: tuple[float, float, float], now: float) -> tuple[float, float, float]:
    """A request is sent there at `now`: what had faded stays faded (the ratio as aged,
    the share lost carried to the next sample's weight), and the evidence is current."""
    keep = _keep(sampled, now)
    if keep == 1.0:
        return (sampled[0], now, sampled[2])
    return (_aged(sampled, sampled[0], now), now, 1.0 - (1.0 - sampled[2]) * keep)


def _learn(
    sampled: tuple[float, float, float] | None, current: float, sample: float, now: float
) -> float:
    """The calibration after `sample` (already clamped to CALIBRATION_SAMPLE_RANGE): an
    EWMA from the aged ratio, with a weight that grows from CALIBRATION_ALPHA toward
    CALIBRATION_STALE_ALPHA with the share of the evidence that had faded."""
    ratio = _aged(sampled, current, now)
    faded = 0.0 if sampled is None else 1.0 - (1.0 - sampled[2]) * _keep(sampled, now)
    alpha = CALIBRATION_ALPHA + (CALIBRATION_STALE_ALPHA - CALIBRATION_ALPHA) * faded
    ratio += alpha * (sample - ratio)
    return min(CALIBRATION_RANGE[1], max(CALIBRATION_RANGE[0], ratio))


# EndpointState.report as written above: the reference for the compiled twin
# (filters/_endpoint_state_c.pyx), which becomes the method when built, unless
# MESHD_PURE_PYTHON is set. A control-plane sidecar lands every engine update through it.
report_reference = EndpointState.report
IMPLEMENTATION = "python (forced by MESHD_PURE_PYTHON)"
if not os.environ.get("MESHD_PURE_PYTHON"):
    try:
        from filters import _endpoint_state_c  # type: ignore[attr-defined]
    except ImportError:
        IMPLEMENTATION = "python (compiled extension not built)"
    else:
        if _endpoint_state_c.bind(EndpointState, ReportedState, report_reference):
            EndpointState.report = _endpoint_state_c.report  # type: ignore[method-assign]
            IMPLEMENTATION = "cython"
        else:
            IMPLEMENTATION = "python (EndpointState's slots not as the compiled twin reads them)"
