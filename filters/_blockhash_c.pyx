# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled twin of filters/blockhash.py: XXH64 in C-level Cython, no external library.

Must return exactly what the pure-Python reference returns (tests/test_blockhash.py
compares them, and both against the `xxhash` package). Import through filters.hotpath.
"""

import operator

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.long cimport PyLong_FromUnsignedLongLong
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport uint32_t, uint64_t

__all__ = ["DEFAULT_BLOCK_SIZE", "block_hashes", "seed_for", "xxh64"]

DEFAULT_BLOCK_SIZE = 64

cdef bytes _SEED_PREFIX = b"meshd-v1\x00"

cdef uint64_t _P1 = 0x9E3779B185EBCA87ULL
cdef uint64_t _P2 = 0xC2B2AE3D27D4EB4FULL
cdef uint64_t _P3 = 0x165667B19E3779F9ULL
cdef uint64_t _P4 = 0x85EBCA77C2B2AE63ULL
cdef uint64_t _P5 = 0x27D4EB2F165667C5ULL

# Below this many bytes the GIL round trip costs more than it frees.
cdef Py_ssize_t _NOGIL_MIN_BYTES = 1 << 16


cdef inline uint64_t _rotl(uint64_t x, int r) noexcept nogil:
    return (x << r) | (x >> (64 - r))


cdef inline uint64_t _read64(const unsigned char* p) noexcept nogil:
    # Byte-wise little-endian assembly: portable, and gcc/clang fold it into one load on
    # little-endian machines.
    return (<uint64_t>p[0] | (<uint64_t>p[1] << 8) | (<uint64_t>p[2] << 16)
            | (<uint64_t>p[3] << 24) | (<uint64_t>p[4] << 32) | (<uint64_t>p[5] << 40)
            | (<uint64_t>p[6] << 48) | (<uint64_t>p[7] << 56))


cdef inline uint64_t _read32(const unsigned char* p) noexcept nogil:
    return (<uint64_t>p[0] | (<uint64_t>p[1] << 8) | (<uint64_t>p[2] << 16)
            | (<uint64_t>p[3] << 24))


cdef inline uint64_t _round(uint64_t acc, uint64_t lane) noexcept nogil:
    acc = acc + lane * _P2
    return _rotl(acc, 31) * _P1


cdef inline uint64_t _merge(uint64_t acc, uint64_t v) noexcept nogil:
    acc = acc ^ _round(0, v)
    return acc * _P1 + _P4


cdef uint64_t _xxh64(const unsigned char* p, Py_ssize_t n, uint64_t seed) noexcept nogil:
    cdef const unsigned char* end = p + n
    cdef const unsigned char* limit
    cdef uint64_t v1, v2, v3, v4, h
    if n >= 32:
        limit = end - 32
        v1 = seed + _P1 + _P2
        v2 = seed + _P2
        v3 = seed
        v4 = seed - _P1
        while p <= limit:
            v1 = _round(v1, _read64(p))
            v2 = _round(v2, _read64(p + 8))
            v3 = _round(v3, _read64(p + 16))
            v4 = _round(v4, _read64(p + 24))
            p += 32
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        h = _merge(h, v1)
        h = _merge(h, v2)
        h = _merge(h, v3)
        h = _merge(h, v4)
    else:
        h = seed + _P5
    h += <uint64_t>n
    while p + 8 <= end:
        h ^= _round(0, _read64(p))
        h = _rotl(h, 27) * _P1 + _P4
        p += 8
    if p + 4 <= end:
        h ^= _read32(p) * _P1
        h = _rotl(h, 23) * _P2 + _P3
        p += 4
    while p < end:
        h ^= p[0] * _P5
        h = _rotl(h, 11) * _P1
        p += 1
    h ^= h >> 33
    h *= _P2
    h ^= h >> 29
    h *= _P3
    h ^= h >> 32
    return h


cdef void _chain(const unsigned char* p, Py_ssize_t nblocks, Py_ssize_t block_size,
                 uint64_t seed, uint64_t* out) noexcept nogil:
    cdef Py_ssize_t i
    cdef uint64_t h = seed
    for i in range(nblocks):
        h = _xxh64(p + i * block_size, block_size, h)
        out[i] = h


def xxh64(data, seed=0, Py_ssize_t start=0, Py_ssize_t length=-1):
    """XXH64 of `data[start:start+length]` (all of it from `start` when length < 0).

    A helper the tests check against the `xxhash` package. On the 400 KB benchmark prompt
    (one call over all of it, measured with timeit on the dev VM) ~0.04 ms vs ~21 ms for the
    pure-Python twin: ~500x.
    """
    cdef const unsigned char[::1] view = _as_bytes(data)
    cdef Py_ssize_t n = view.shape[0] - start if length < 0 else length
    if start < 0 or n < 0 or start + n > view.shape[0]:
        raise ValueError("start/length out of range")
    cdef uint64_t s = <uint64_t>(int(seed) & 0xFFFFFFFFFFFFFFFF)
    if n == 0:
        return PyLong_FromUnsignedLongLong(_xxh64(<const unsigned char*>"", 0, s))
    return PyLong_FromUnsignedLongLong(_xxh64(&view[start], n, s))


cdef object _as_bytes(object data):
    if isinstance(data, (bytes, bytearray)):
        return data
    if isinstance(data, memoryview):
        return data.cast("B") if data.format != "B" or data.ndim != 1 else data
    raise TypeError(f"data must be str or bytes-like, not {type(data).__name__}")


cdef uint64_t _seed(str model, str salt) except? 0:
    cdef bytes pre = _SEED_PREFIX + model.encode("utf-8") + b"\x00" + salt.encode("utf-8")
    return _xxh64(<const unsigned char*>PyBytes_AS_STRING(pre), PyBytes_GET_SIZE(pre), 0)


cdef inline int _check_names(object model, object salt) except -1:
    if not isinstance(model, str):
        raise TypeError(f"model must be str, not {type(model).__name__}")
    if not isinstance(salt, str):
        raise TypeError(f"salt must be str, not {type(salt).__name__}")
    return 0


def seed_for(model, salt=""):
    """The chain's starting seed: XXH64 of the versioned model/salt preamble, seed 0.

    One short hash per call, not a hot spot: compiled only so block_hashes shares it.
    """
    _check_names(model, salt)
    return PyLong_FromUnsignedLongLong(_seed(model, salt))


def block_hashes(data, model, salt="", block_size=DEFAULT_BLOCK_SIZE):
    """Chained XXH64 of every full `block_size`-byte block of `data` (UTF-8 for a str).

    Same contract and results as filters.blockhash.block_hashes. Speeds up prefix hashing of
    every request. Measured by `python -m loadtest.hotpath_bench` on a 100,000-token (400
    KB) word-like prompt with 64-byte blocks (median of 11 repeats; range over 6 runs on a
    shared, busy 2-core x86_64 dev VM, Python 3.11): pure Python 38-75 ms, this 0.20-0.39
    ms, i.e. 120-280x faster (the issue's target is >= 10x). A str or bytes is read in
    place, without a typed memoryview: a 52-character prompt (no whole block) 2.25 -> 0.44
    us a call, 2 KB 7.1 -> 3.3 us (timeit, the same machine; issue #22, the sidecar hashes
    every prompt before its upstream send).
    """
    cdef Py_ssize_t bs = block_size if type(block_size) is int else operator.index(block_size)
    if bs < 1:
        raise ValueError(f"block_size must be >= 1, got {bs}")
    _check_names(model, salt)
    if isinstance(data, str):
        data = (<str>data).encode("utf-8")
    if isinstance(data, bytes):
        # Read in place: a typed memoryview costs ~1 us to take (more with cold caches),
        # as much as hashing a short prompt's blocks.
        return _hash_blocks(<const unsigned char*>PyBytes_AS_STRING(data),
                            PyBytes_GET_SIZE(data), bs, _seed(model, salt))
    cdef const unsigned char[::1] view = _as_bytes(data)
    cdef uint64_t seed = _seed(model, salt)
    if view.shape[0] < bs:
        return []
    return _hash_blocks(&view[0], view.shape[0], bs, seed)


cdef list _hash_blocks(const unsigned char* p, Py_ssize_t n, Py_ssize_t bs, uint64_t seed):
    cdef Py_ssize_t nblocks = n // bs
    cdef Py_ssize_t i
    cdef list out = []
    if nblocks == 0:
        return out
    cdef uint64_t* hs = <uint64_t*>PyMem_Malloc(nblocks * sizeof(uint64_t))
    if hs == NULL:
        raise MemoryError()
    try:
        if n >= _NOGIL_MIN_BYTES:
            with nogil:
                _chain(p, nblocks, bs, seed, hs)
        else:
            _chain(p, nblocks, bs, seed, hs)
        for i in range(nblocks):
            out.append(PyLong_FromUnsignedLongLong(hs[i]))
    finally:
        PyMem_Free(hs)
    return out
