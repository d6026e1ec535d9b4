"""The control plane's malloc setting: glibc's mmap threshold pinned, so that large buffers
(full PrefixDigests, publish messages) each get pages of their own and give them back when
freed, instead of fragmenting the heap.

glibc serves an allocation of at least M_MMAP_THRESHOLD (128 KiB) with its own mmap, but
raises the threshold to the size of any such block freed (up to 32 MiB; mallopt(3), "dynamic
mmap threshold"). After the first publish message of 8 full digests (2.5 MB) is freed, the
320 KB digest bodies that stay come from the heap between transient buffers, whose holes
the heap cannot return: loadtest/xds_memory_bench.py measured 378-389 MiB settled for 1,000
engines of 40,000-block digests, 358 MiB with the threshold pinned (the hashes alone are
305 MiB). Setting it turns the adjustment off.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["MMAP_THRESHOLD_BYTES", "pin_mmap_threshold"]

MMAP_THRESHOLD_BYTES = 128 * 2**10  # glibc's default, kept from moving
_M_MMAP_THRESHOLD = -3  # malloc.h


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin the calling process's mmap threshold; False where malloc is not glibc's."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
