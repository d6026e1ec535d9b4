"""The fuzz targets, by name. Each module has `setup() -> one_input(data: bytes)` (imports
inside, so atheris instruments what it imports), `INCLUDE` (the top-level packages atheris
instruments) and, where it has found something not fixed yet, `KNOWN` (fuzz/common.py
`signature` -> what was reported; its reproducer is fuzz/corpus/<target>/known-*)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

TARGETS = (
    "chunked",
    "sse",
    "routing_headers",
    "blockhash",
    "http_request",
    "http_response",
    "request_json",
    "request_parse",
    "endpoint_state",
    "xds_resources",
    "delta_response",
    "webhook",
    "config",
)


def module(name: str) -> ModuleType:
    if name not in TARGETS:
        raise KeyError(f"unknown fuzz target {name!r}; known: {', '.join(TARGETS)}")
    return importlib.import_module(f"fuzz.targets.{name}")


def known(name: str) -> dict[str, str]:
    """The target's known findings (reported, not fixed yet): signature -> note."""
    return dict(getattr(module(name), "KNOWN", {}))


def load(name: str) -> Callable[[bytes], None]:
    """The target's one_input, ready to call (without instrumentation)."""
    setup: Callable[[], Callable[[bytes], None]] = module(name).setup
    return setup()
