"""The engine's GPUs through NVML (`nvidia-ml-py`, an optional extra): name, count and
memory of the devices the agent was given, for its EndpointState. Without the package or a
GPU the agent's flags say what the GPUs are.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from filters.gpu import normalise_gpu_name

# The agent's logger: NVML is read for `meshd agent` only.
log = logging.getLogger("meshd.agent")


@dataclass(frozen=True, slots=True)
class GpuReading:
    name: str
    count: int
    memory_total_bytes: int
    memory_used_bytes: int


_nvml_state: dict[str, bool] = {}


def read_nvml(indices: Sequence[int] = ()) -> GpuReading | None:
    """The engine's GPUs through NVML (`nvidia-ml-py`, an optional extra), or None when it
    is not installed or there is no GPU. NVML is initialised once, at the first call."""
    if _nvml_state.get("failed"):
        return None
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        _nvml_state["failed"] = True
        return None
    try:
        if not _nvml_state.get("ready"):
            pynvml.nvmlInit()
            _nvml_state["ready"] = True
        n = pynvml.nvmlDeviceGetCount()
        wanted = [i for i in indices if 0 <= i < n] if indices else list(range(n))
        if not wanted:
            return None
        name, total, used = "", 0, 0
        for i in wanted:
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            raw = pynvml.nvmlDeviceGetName(h)
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            total += int(mem.total)
            used += int(mem.used)
        return GpuReading(normalise_gpu_name(name), len(wanted), total, used)
    except Exception as exc:  # NVMLError (no driver, no GPU): fall back to config for good
        log.info("NVML unavailable (%s); GPU facts come from flags", exc)
        _nvml_state["failed"] = True
        return None
