"""Chained XXH64 hashes of a prompt's full blocks, for prefix-cache affinity.

Pure-Python reference; `filters/_blockhash_c.pyx` is the compiled twin and must return
exactly the same integers. Callers import `block_hashes` from `filters.hotpath`.

The chain (stable across processes and versions; never Python's `hash()`):
    seed0 = XXH64(b"meshd-v1\\x00" + model + b"\\x00" + salt, seed=0)
    h_i   = XXH64(block_i, seed=h_{i-1}),  h_{-1} = seed0
Only full blocks of `block_size` bytes are hashed; a trailing partial block is not (as in
vLLM's prefix caching, vllm-project/vllm: vllm/v1/core/kv_cache_utils.py). So two prompts
that share their first k full blocks share their first k hashes.

XXH64 follows the published algorithm (Cyan4973/xxHash: doc/xxhash_spec.md, "XXH64
algorithm description"); the tests check it against the `xxhash` package.
"""

from __future__ import annotations

import operator
import struct

__all__ = ["DEFAULT_BLOCK_SIZE", "block_hashes", "seed_for", "xxh64"]

# Bytes per block. 64 bytes is ~16 tokens of English text, vLLM's default block size.
DEFAULT_BLOCK_SIZE = 64

_SEED_PREFIX = b"meshd-v1\x00"

_M64 = 0xFFFFFFFFFFFFFFFF
_P1 = 0x9E3779B185EBCA87
_P2 = 0xC2B2AE3D27D4EB4F
_P3 = 0x165667B19E3779F9
_P4 = 0x85EBCA77C2B2AE63
_P5 = 0x27D4EB2F165667C5

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_STRIPES: dict[int, struct.Struct] = {}


def _stripe_struct(nstripes: int) -> struct.Struct:
    """A cached unpacker for `nstripes` 32-byte stripes (4 little-endian u64 lanes each)."""
    s = _STRIPES.get(nstripes)
    if s is None:
        s = struct.Struct(f"<{4 * nstripes}Q")
        if len(_STRIPES) < 64:  # block sizes are few; don't let odd callers grow this
            _STRIPES[nstripes] = s
    return s


def xxh64(
    data: bytes | bytearray | memoryview, seed: int = 0, start: int = 0, length: int = -1
) -> int:
    """XXH64 of `data[start:start+length]` (all of it from `start` when length < 0)."""
    buf = data
    n = len(buf) - start if length < 0 else length
    seed &= _M64
    end = start + n
    i = start
    if n >= 32:
        nstripes = n // 32
        lanes = _stripe_struct(nstripes).unpack_from(buf, i)
        i += 32 * nstripes
        v1 = (seed + _P1 + _P2) & _M64
        v2 = (seed + _P2) & _M64
        v3 = seed
        v4 = (seed - _P1) & _M64
        it = iter(lanes)
        # The round, inlined: acc = rotl64(acc + lane * P2, 31) * P1 (mod 2**64).
        for a, b, c, d in zip(it, it, it, it, strict=True):
            v1 = (v1 + a * _P2) & _M64
            v1 = (((v1 << 31) | (v1 >> 33)) * _P1) & _M64
            v2 = (v2 + b * _P2) & _M64
            v2 = (((v2 << 31) | (v2 >> 33)) * _P1) & _M64
            v3 = (v3 + c * _P2) & _M64
            v3 = (((v3 << 31) | (v3 >> 33)) * _P1) & _M64
            v4 = (v4 + d * _P2) & _M64
            v4 = (((v4 << 31) | (v4 >> 33)) * _P1) & _M64
        h = (
            ((v1 << 1) | (v1 >> 63))
            + ((v2 << 7) | (v2 >> 57))
            + ((v3 << 12) | (v3 >> 52))
            + ((v4 << 18) | (v4 >> 46))
        ) & _M64
        for v in (v1, v2, v3, v4):
            k = (v * _P2) & _M64
            k = (((k << 31) | (k >> 33)) * _P1) & _M64
            h = ((h ^ k) * _P1 + _P4) & _M64
    else:
        h = (seed + _P5) & _M64
    h = (h + n) & _M64
    while i + 8 <= end:
        k = (_U64.unpack_from(buf, i)[0] * _P2) & _M64
        k = (((k << 31) | (k >> 33)) * _P1) & _M64
        h ^= k
        h = ((((h << 27) | (h >> 37)) & _M64) * _P1 + _P4) & _M64
        i += 8
    if i + 4 <= end:
        h ^= (_U32.unpack_from(buf, i)[0] * _P1) & _M64
        h = ((((h << 23) | (h >> 41)) & _M64) * _P2 + _P3) & _M64
        i += 4
    while i < end:
        h ^= (buf[i] * _P5) & _M64
        h = ((((h << 11) | (h >> 53)) & _M64) * _P1) & _M64
        i += 1
    h ^= h >> 33
    h = (h * _P2) & _M64
    h ^= h >> 29
    h = (h * _P3) & _M64
    h ^= h >> 32
    return h


def _check_names(model: object, salt: object) -> None:
    if not isinstance(model, str):
        raise TypeError(f"model must be str, not {type(model).__name__}")
    if not isinstance(salt, str):
        raise TypeError(f"salt must be str, not {type(salt).__name__}")


def seed_for(model: str, salt: str = "") -> int:
    """The chain's starting seed: XXH64 of the versioned model/salt preamble, seed 0."""
    _check_names(model, salt)
    return xxh64(_SEED_PREFIX + model.encode("utf-8") + b"\x00" + salt.encode("utf-8"))


def block_hashes(
    data: str | bytes, model: str, salt: str = "", block_size: int = DEFAULT_BLOCK_SIZE
) -> list[int]:
    """Chained XXH64 of every full `block_size`-byte block of `data` (UTF-8 for a str).

    Returns one unsigned 64-bit int per full block; a trailing partial block is not hashed.
    Raises ValueError when block_size < 1, TypeError for a data type other than str or a
    bytes-like object, UnicodeEncodeError for a str that is not encodable (lone surrogates).
    """
    block_size = operator.index(block_size)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    _check_names(model, salt)
    if isinstance(data, str):
        buf: bytes | bytearray | memoryview = data.encode("utf-8")
    elif isinstance(data, bytes | bytearray):
        buf = data
    elif isinstance(data, memoryview):
        buf = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    else:
        raise TypeError(f"data must be str or bytes-like, not {type(data).__name__}")
    h = seed_for(model, salt)
    out: list[int] = []
    append = out.append
    for off in range(0, len(buf) - block_size + 1, block_size):
        h = xxh64(buf, h, off, block_size)
        append(h)
    return out
