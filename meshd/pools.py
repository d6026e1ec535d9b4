"""A sidecar's decision objects, built from its config: each pool's router, guard
(admission, breaker, outlier ejection, slow start) and retry budget, and the precise prefix
path. The virtual-clock bench builds its routers and guards here too, so that it routes with
the same objects as the sidecar."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from filters.admission import AdmissionConfig, TenantPolicy
from filters.guard import GuardConfig, PoolGuard
from filters.outlier import OutlierConfig
from filters.picker import PickerConfig
from filters.pool_router import EndpointSpec, PickerRouter, PoolRouter, make_router
from filters.request import CHARS_PER_TOKEN
from filters.retry_budget import RetryBudget, RetryBudgetConfig
from filters.slow_start import SlowStartConfig
from filters.throttle import AdaptiveThrottleConfig
from filters.token_breaker import Limits, TokenBreakerConfig
from meshd.config import ADMISSION_SLOTS_PER_ENDPOINT, Config, ConfigError

if TYPE_CHECKING:
    from meshd.kv_events import PrecisePrefix


def build_routers(
    config: Config, picker_overrides: Mapping[str, Any] | None = None
) -> dict[str, PoolRouter]:
    """Pool name -> its router, as `routing` says (the sidecar's, and the virtual-clock
    bench's, so both route with the same objects). `picker_overrides`: PickerConfig fields
    the config does not expose, replaced (the matrix's ablations switch mechanisms off)."""
    routing = config.routing
    picker_config = PickerConfig(
        lambda_usd_per_s=routing.picker.lambda_usd_per_s,
        lambda_knee_s=routing.picker.lambda_knee_s,
        epsilon=routing.picker.epsilon,
        cached_headroom=routing.picker.cached_headroom,
        load_metric=routing.picker.load_metric,
        decode_pricing=routing.picker.decode_pricing,
        decode_weight=routing.picker.decode_weight,
        prefill_delay_weight=routing.picker.prefill_delay_weight,
        elastic=routing.picker.elastic,
        tokens_per_block=routing.block_size_bytes / CHARS_PER_TOKEN,
        prefix_ttl_s=routing.picker.prefix_ttl_s,
        affinity_min_fraction=routing.picker.affinity_min_fraction,
        affinity_imbalance=routing.picker.affinity_imbalance,
        affinity_margin_s=routing.picker.affinity_margin_s,
        affinity_redo_weight=routing.picker.affinity_redo_weight,
        home_weight=routing.picker.home_weight,
        home_window_s=routing.picker.home_window_s,
        ramp_yield_s=config.reliability.slow_start.yield_queue_s,
    )
    if picker_overrides:
        picker_config = dataclasses.replace(picker_config, **picker_overrides)
    return {
        pool.name: make_router(
            routing.policy,
            [
                EndpointSpec(ep.url, ep.weight, ep.gpu, ep.kv_capacity_tokens)
                for ep in pool.endpoints
            ],
            unhealthy_after=routing.unhealthy_after_failures,
            cooldown_s=routing.unhealthy_cooldown_s,
            picker=picker_config,
        )
        for pool in config.pools
    }


def precise_prefixes(config: Config, routers: Mapping[str, PoolRouter]) -> dict[str, PrecisePrefix]:
    """One PrecisePrefix per pool that serves a model of routing.tokenizers, over that
    pool's picker index, following the KV events of its endpoints that set `kv_events`.
    A tokenizer that cannot be loaded is a config error naming its key."""
    routing = config.routing
    if routing.policy != "meshd" or not routing.tokenizers:
        return {}
    from meshd.kv_events import EngineModel, PrecisePrefix, TokenizerError

    models: dict[str, EngineModel] = {}
    for name, t in routing.tokenizers.items():
        try:
            models[name] = EngineModel.load(
                t.path,
                hash_algo=t.hash_algo,
                block_size=t.block_size,
                hash_seed=t.hash_seed,
                content_format=t.content_format,
                max_blocks=t.max_blocks,
            )
        except (TokenizerError, OSError, ValueError) as exc:
            raise ConfigError([f"routing.tokenizers.{name}.path: {exc}"]) from None
    out: dict[str, PrecisePrefix] = {}
    for pool in config.pools:
        served = [m for m in models if pool.serves(m)]
        router = routers.get(pool.name)
        if not served or not isinstance(router, PickerRouter):
            continue
        precise = PrecisePrefix(router.picker.index)
        for m in served:
            precise.add_model(m, models[m])
        for ep in pool.endpoints:
            if ep.kv_events is not None:
                kv = ep.kv_events
                precise.add_engine(
                    ep.url, served[0], kv.endpoint, replay=kv.replay, topic=kv.topic, bind=kv.bind
                )
        out[pool.name] = precise
    return out


def guard_config(config: Config, endpoints: int = 1) -> GuardConfig:
    """The guard of a pool of `endpoints` (admission's slots scale with it unless set)."""
    rel = config.reliability
    b, o, a, t = rel.breaker, rel.outlier, rel.admission, rel.throttle
    ss = rel.slow_start
    return GuardConfig(
        throttle=AdaptiveThrottleConfig(k=t.k, window_s=t.window_s) if t.enabled else None,
        admission=AdmissionConfig(
            max_in_flight=a.max_in_flight or ADMISSION_SLOTS_PER_ENDPOINT * max(1, endpoints),
            max_queued=a.max_queued,
            max_queued_per_tenant=a.max_queued_per_tenant,
            knee_wait_s=a.knee_wait_s,
            knee_max_wait_s=a.knee_max_wait_s,
            tenants={
                name: TenantPolicy(
                    weight=tp.weight,
                    max_priority=tp.max_priority,
                    max_queued=tp.max_queued,
                    max_in_flight=tp.max_in_flight,
                )
                for name, tp in a.tenants.items()
            },
        )
        if a.enabled
        else None,
        breaker=TokenBreakerConfig(
            endpoint_limits=Limits(
                max_tokens=b.max_tokens_per_endpoint,
                max_requests=b.max_requests_per_endpoint,
                max_pending=b.max_pending_per_endpoint,
            ),
            kv_tokens_factor=b.max_tokens_kv_factor,
            consecutive_failures=b.consecutive_failures,
            error_rate=b.error_rate,
            error_window_s=b.error_window_s,
            error_min_requests=b.error_min_requests,
            open_base_s=b.open_base_s,
            open_max_s=b.open_max_s,
            half_open_successes=b.half_open_successes,
            ttft_outlier_factor=b.ttft_outlier_factor,
            ttft_outlier_min_s=b.ttft_outlier_min_s,
        )
        if b.enabled
        else None,
        outlier=OutlierConfig(
            consecutive_5xx=o.consecutive_5xx,
            interval_s=o.interval_s,
            base_ejection_time_s=o.base_ejection_time_s,
            max_ejection_time_s=o.max_ejection_time_s,
            max_ejection_percent=o.max_ejection_percent,
            always_eject_one_host=o.always_eject_one_host,
        )
        if o.enabled
        else None,
        slow_start=SlowStartConfig(
            window_s=ss.window_s,
            aggression=ss.aggression,
            min_weight_percent=ss.min_weight_percent,
        )
        if ss.enabled
        else None,
        slow_abandon_factor=rel.slow_abandon_factor,
    )


def retry_budgets(config: Config) -> dict[str, RetryBudget]:
    """Pool name -> its retry budget (reliability.retry; upstream.max_attempts)."""
    rc = config.reliability.retry
    return {
        pool.name: RetryBudget(
            RetryBudgetConfig(
                window_s=rc.window_s,
                retry_ratio=rc.ratio,
                min_retries_per_s=rc.min_retries_per_s,
                max_attempts=config.upstream.max_attempts,
                backoff_base_s=rc.backoff_base_s,
                backoff_max_s=rc.backoff_max_s,
            )
        )
        for pool in config.pools
    }


def guards(config: Config, routers: Mapping[str, PoolRouter]) -> dict[str, PoolGuard]:
    """Pool name -> its guard, asking its router how long the pool's queue is."""
    return {
        pool.name: PoolGuard(
            guard_config(config, len(pool.endpoints)),
            [ep.url for ep in pool.endpoints],
            pool_wait=routers[pool.name].pool_wait,
        )
        for pool in config.pools
    }
