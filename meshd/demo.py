"""`meshd demo`: the main job on an embedded default. A local fleet of simulated
engines, meshd in front, a short shared-prefix plus agentic load, and the
comparison table; the runner itself lives in loadtest/bench."""

from __future__ import annotations

from loadtest.bench.cli import register_demo as register

__all__ = ["register"]
