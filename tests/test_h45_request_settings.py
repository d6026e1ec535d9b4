"""Plane.settings: the config values a request reads, as plain attributes (issue #22): the
same values as the config's pydantic models, remade whenever the plane's config is set."""

from __future__ import annotations

import pytest

from meshd.context import RequestSettings
from tests.harness import sidecar_config
from tests.layer_fakes import build_layers

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]

_VARIANTS = [
    {},
    {
        "limits": {"max_concurrent_streams": 7},
        "routing": {"policy": "round-robin", "cache_salt": "s", "block_size_bytes": 128},
        "upstream": {"request_timeout_s": 30, "first_byte_timeout_s": 4.5, "max_attempts": 5},
        "reliability": {
            "admission": {"enabled": True, "refuse_predicted_late": False},
            "failover": {"enabled": False, "max_resumes": 4},
        },
        "response_cache": {"max_entry_bytes": 4096},
    },
    {"reliability": {"admission": {"enabled": False}}},
]


def _expected(config: object) -> dict[str, object]:
    c = config
    return {
        "max_concurrent_streams": c.limits.max_concurrent_streams,  # type: ignore[attr-defined]
        "routing_policy": c.routing.policy,  # type: ignore[attr-defined]
        "cache_salt": c.routing.cache_salt,  # type: ignore[attr-defined]
        "block_size_bytes": c.routing.block_size_bytes,  # type: ignore[attr-defined]
        "request_timeout_s": c.upstream.request_timeout_s,  # type: ignore[attr-defined]
        "first_byte_timeout_s": c.upstream.first_byte_timeout_s,  # type: ignore[attr-defined]
        "max_attempts": c.upstream.max_attempts,  # type: ignore[attr-defined]
        "refuse_predicted_late": bool(
            c.reliability.admission.enabled  # type: ignore[attr-defined]
            and c.reliability.admission.refuse_predicted_late  # type: ignore[attr-defined]
        ),
        "failover_enabled": c.reliability.failover.enabled,  # type: ignore[attr-defined]
        "max_resumes": c.reliability.failover.max_resumes,  # type: ignore[attr-defined]
        "cache_max_entry_bytes": c.response_cache.max_entry_bytes,  # type: ignore[attr-defined]
    }


@pytest.mark.parametrize("sections", _VARIANTS)
def test_settings_are_the_configs_values(sections: dict[str, object]) -> None:
    config = sidecar_config(URLS, **sections)
    settings = RequestSettings.of(config)
    assert {k: getattr(settings, k) for k in RequestSettings.__slots__} == _expected(config)
    layers = build_layers(config)
    assert layers.plane.settings == settings


def test_settings_follow_the_plane_config() -> None:
    layers = build_layers(sidecar_config(URLS))
    other = sidecar_config(URLS, **_VARIANTS[1])  # type: ignore[arg-type]
    layers.plane.config = other
    assert layers.plane.settings == RequestSettings.of(other)
    assert layers.plane.settings.max_attempts == 5
