"""Helpers shared by the data-plane tests: config for an in-process sidecar."""

from __future__ import annotations

from typing import Any

from meshd.config import Config, load_config
from meshd.sidecar import Sidecar


def sidecar_config(endpoints: list[str], **sections: Any) -> Config:
    base: dict[str, Any] = {
        "listeners": {"outbound": {"port": 0}, "admin": {"port": 0}},
        "pools": [{"name": "default", "endpoints": endpoints}],
        "drain": {"grace_period_s": 2},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return load_config(None, base=base, env={})


def url(s: Sidecar, path: str, listener: str = "outbound") -> str:
    return f"http://{s.addresses[listener]}{path}"
