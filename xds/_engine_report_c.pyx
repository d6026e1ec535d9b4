# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of xds/engine_report.py's `reference_decode`: an EndpointState body
(msgpack) read in C straight into an EngineReport and its ReportedState, with no dict of
the body, no key strings, no EndpointState in between; the objects built are the values
the ReportedState holds. Import through xds.engine_report.

It accepts a subset of msgpack on which it agrees with msgpack.unpackb + the reference by
construction: a top-level map whose keys are str; each key the reference reads appears at
most once and has a value of the type the one-pass decoder (decode_endpoint_state) takes
without converting (an int where a float goes is converted there: it falls back); "v"
absent or 1; other keys' values any msgpack but ext, nested under 32 levels, every string
valid UTF-8, map keys str or bin; nothing after the map. Everything else, malformed or
merely unusual, goes to the reference, which returns the value or raises the
ResourceError (tests/test_engine_report.py compares the two on arbitrary bodies).

What it speeds up: a sidecar applying engines' updates. One EndpointState body, 1,000
engines' bodies in turn: 0.6-1.1 us against 7-12 us for the reference (timeit, this
2-core machine); the whole apply of an update (`python -m loadtest.xds_apply_bench`, 100
a response, caches warm): 2.6 us against 16.7 us for the path before it (EndpointState
decoded, then to_reported), in the same run. Strings and maps that come again (address,
epoch, GPU, model, adapters) are built once and shared (the memo below).

Given the report a body replaces (`previous`; xds/_delta_response_c.pyx passes the one the
subscriber holds and decodes the body where it lies in the response, `decode_span`), each
value equal to that report's is its object again (compared in place: no int, float, str
or dict built, no memo hash), and a report equal in every field is `previous` itself (the
router then renews it without rebuilding the picker's view: filters/pool_router.py).
Measured, reading responses of 210 EndpointStates (1,000 engines in turn, the load
fields changing every update; `python -m loadtest.xds_apply_bench`'s bodies), in process,
the tree before and this one alternated on this VM at load 4.5: 3.09 / 2.72, 2.38 / 1.98,
2.13 / 1.76 us an update (-12% to -17%), while its instructions (callgrind) barely move:
10,599 -> 10,370 an update (what goes is objects allocated and freed, their memory; the
time figure is this VM's, noisy, and in a sidecar process the gain is inside its noise).
The fields an update changes are still built. The previous report's values are
prefetched together before they are compared (`_build`; `warm_report` does it for a batch
of resources ahead: xds/_delta_response_c.pyx), strings are checked as ASCII eight bytes
at a time, and the key encode() writes next is matched whole (header and name) with no
libc call: with the reader's own changes, 9,439 -> 8,434 instructions an update read.
Then: the key expected next compared as precomputed words (its first eight bytes, the
middle ones, the last eight; a key under eight bytes as one masked word: the byte loop was
~25 instructions a key), strings' ASCII checked inline with the last word overlapping the
ones before (no call, no byte loop), an int compared with the held one from its digits
where it has at most two (CPython before 3.12; the three C-API calls were ~40
instructions an int, seven an update), big-endian integers read with one load and a
byte swap, the memo's hash over words, a new report's slots stored with nothing to
release: a body's decode 5,621 -> 4,102 instructions an update, the subscriber's apply
without its routers (with xds/_delta_response_c.pyx's own) 9,750 -> 7,641 (callgrind,
loadtest/xds_apply_bench.py's sidecar set-up, 1,000 engines, responses of 200).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_Next
from cpython.float cimport PyFloat_FromDouble
from cpython.long cimport PyLong_FromUnsignedLongLong
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset, strlen

from filters._slots cimport slot as _slot, slot_offset as _slot_offset, store_new as _store_new
from xds._ascii cimport ascii_only as _ascii

from xds.resources import MAX_RESOURCE_BYTES, SCHEMA_VERSION

__all__ = ["bind", "decode_engine_report"]


cdef extern from "Python.h":
    object PyType_GenericAlloc(type t, Py_ssize_t nitems)
    void PyObject_GC_UnTrack(void *op)
    bint PyLong_CheckExact(PyObject *o)
    bint PyFloat_CheckExact(PyObject *o)
    bint PyDict_CheckExact(PyObject *o)
    bint PyUnicode_CheckExact(PyObject *o)
    bint PyUnicode_IS_COMPACT_ASCII(PyObject *o)
    Py_ssize_t PyUnicode_GET_LENGTH(PyObject *o)
    void *PyUnicode_DATA(PyObject *o)
    double PyFloat_AS_DOUBLE(PyObject *o)
    Py_ssize_t PyDict_GET_SIZE(PyObject *o)
    uint64_t PyLong_AsUnsignedLongLongMask(PyObject *o)
    int _PyLong_Sign(PyObject *o)
    size_t _PyLong_NumBits(PyObject *o)
    PyObject *Py_True
    PyObject *Py_False
    PyObject *Py_None

cdef extern from *:
    void _prefetch "__builtin_prefetch"(const void *p) noexcept

cdef extern from *:
    """
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    #define meshd_from_be16(x) __builtin_bswap16(x)
    #define meshd_from_be32(x) __builtin_bswap32(x)
    #define meshd_from_be64(x) __builtin_bswap64(x)
    #elif defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    #define meshd_from_be16(x) (x)
    #define meshd_from_be32(x) (x)
    #define meshd_from_be64(x) (x)
    #else
    static uint64_t meshd_be_bytes(const void *x, int n) {
        const unsigned char *p = (const unsigned char *)x;
        uint64_t v = 0;
        for (int i = 0; i < n; i++) v = (v << 8) | p[i];
        return v;
    }
    static uint16_t meshd_from_be16(uint16_t x) { return (uint16_t)meshd_be_bytes(&x, 2); }
    static uint32_t meshd_from_be32(uint32_t x) { return (uint32_t)meshd_be_bytes(&x, 4); }
    static uint64_t meshd_from_be64(uint64_t x) { return meshd_be_bytes(&x, 8); }
    #endif

    /* An exact int's value from its digits where it is >= 0 and has at most two
       (CPython before 3.12, whose PyLongObject is ob_size and ob_digit): 1, else 0 (the
       caller asks the C API). */
    static CYTHON_INLINE int meshd_small_uint(PyObject *o, uint64_t *out) {
    #if PY_VERSION_HEX < 0x030C0000 && !defined(PYPY_VERSION) && !defined(Py_LIMITED_API)
        Py_ssize_t size = Py_SIZE(o);
        const digit *d = ((PyLongObject *)o)->ob_digit;
        if (size == 0) { *out = 0; return 1; }
        if (size == 1) { *out = d[0]; return 1; }
        if (size == 2) { *out = (uint64_t)d[0] | ((uint64_t)d[1] << PyLong_SHIFT); return 1; }
    #endif
        (void)o; (void)out;
        return 0;
    }
    """
    uint16_t _from_be16 "meshd_from_be16"(uint16_t x) noexcept nogil
    uint32_t _from_be32 "meshd_from_be32"(uint32_t x) noexcept nogil
    uint64_t _from_be64 "meshd_from_be64"(uint64_t x) noexcept nogil
    bint _small_uint "meshd_small_uint"(PyObject *o, uint64_t *out) noexcept


# The fields of the body, in EndpointState.encode()'s order.
cdef enum:
    F_V, F_ADDRESS, F_POOL, F_MODEL, F_ADAPTERS, F_GPU, F_GPU_COUNT, F_MEMORY_TOTAL,
    F_MEMORY_USED, F_KV_BLOCK_SIZE, F_KV_CAPACITY, F_KV_USAGE, F_RUNNING, F_WAITING,
    F_TOKENS, F_TTFT, F_TPOT, F_HEALTHY, F_DRAINING, F_EPOCH, N_FIELDS

cdef enum:
    MAX_DEPTH = 32  # deeper values of unknown keys fall back

# How a field's value was given (pass 1), for pass 2 to build.
cdef enum:
    K_ABSENT, K_NIL, K_UINT, K_FLOAT, K_TRUE, K_FALSE, K_STR, K_MAP


cdef struct Value:
    int kind
    uint64_t u
    double f
    const unsigned char *p  # K_STR: the UTF-8; K_MAP: its encoding (header first)
    Py_ssize_t n  # K_STR, K_MAP: bytes


cdef const char *_NAMES[N_FIELDS]
_NAMES[F_V] = "v"
_NAMES[F_ADDRESS] = "address"
_NAMES[F_POOL] = "pool"
_NAMES[F_MODEL] = "model"
_NAMES[F_ADAPTERS] = "adapters"
_NAMES[F_GPU] = "gpu"
_NAMES[F_GPU_COUNT] = "gpu_count"
_NAMES[F_MEMORY_TOTAL] = "memory_total_bytes"
_NAMES[F_MEMORY_USED] = "memory_used_bytes"
_NAMES[F_KV_BLOCK_SIZE] = "kv_block_size"
_NAMES[F_KV_CAPACITY] = "kv_capacity_blocks"
_NAMES[F_KV_USAGE] = "kv_usage"
_NAMES[F_RUNNING] = "requests_running"
_NAMES[F_WAITING] = "requests_waiting"
_NAMES[F_TOKENS] = "tokens_in_flight"
_NAMES[F_TTFT] = "ttft_s"
_NAMES[F_TPOT] = "tpot_s"
_NAMES[F_HEALTHY] = "healthy"
_NAMES[F_DRAINING] = "draining"
_NAMES[F_EPOCH] = "epoch"
cdef Py_ssize_t _NAME_LEN[N_FIELDS]
# Each key as encode() writes it (msgpack fixstr: its header byte, then the name), matched
# whole where the next field is expected.
cdef enum:
    KEY_MAX = 24  # > 1 + the longest name
cdef unsigned char _KEY[N_FIELDS][KEY_MAX]
cdef Py_ssize_t _KEY_LEN[N_FIELDS]
# Each key as words (_key_next): bytes 0-7, 8-15 (keys over 16 bytes) and the last eight
# (keys of 8 or more), or, under 8 bytes, the key's bytes and zeros with the mask of them.
cdef uint64_t _KEY_WORD[N_FIELDS][3]
cdef uint64_t _KEY_MASK[N_FIELDS]
cdef unsigned char _mask_bytes[8]
for _i in range(N_FIELDS):
    _NAME_LEN[_i] = strlen(_NAMES[_i])
    assert _NAME_LEN[_i] < min(32, KEY_MAX)
    _KEY[_i][0] = 0xA0 | _NAME_LEN[_i]
    memcpy(&_KEY[_i][1], _NAMES[_i], _NAME_LEN[_i])
    _KEY_LEN[_i] = 1 + _NAME_LEN[_i]
    memcpy(&_KEY_WORD[_i][0], &_KEY[_i][0], 8)  # (zeros past a short key)
    memcpy(&_KEY_WORD[_i][1], &_KEY[_i][8], 8)
    memcpy(&_KEY_WORD[_i][2], &_KEY[_i][_KEY_LEN[_i] - 8 if _KEY_LEN[_i] >= 8 else 0], 8)
    memset(_mask_bytes, 0, 8)
    memset(_mask_bytes, 0xFF, min(_KEY_LEN[_i], 8))
    memcpy(&_KEY_MASK[_i], _mask_bytes, 8)
assert SCHEMA_VERSION == 1  # _field takes "v" as the fixint 1
# As a C integer: compared with a body's size once an update (against the Python int, the
# size became an int object first: ~200 of the ~6,700 instructions of a decode).
cdef Py_ssize_t _MAX_BYTES = MAX_RESOURCE_BYTES


# -- reading msgpack ------------------------------------------------------------------------


cdef struct Reader:
    const unsigned char *p
    const unsigned char *end


cdef inline bint _need(Reader *r, Py_ssize_t n) noexcept:
    return r.end - r.p >= n


cdef inline uint64_t _be(const unsigned char *p, int n) noexcept:
    """The big-endian unsigned integer of n (1, 2, 4 or 8; else a byte loop) bytes."""
    cdef uint16_t v16
    cdef uint32_t v32
    cdef uint64_t v = 0
    cdef int i
    if n == 1:
        return p[0]
    if n == 2:
        memcpy(&v16, p, 2)
        return _from_be16(v16)
    if n == 4:
        memcpy(&v32, p, 4)
        return _from_be32(v32)
    if n == 8:
        memcpy(&v, p, 8)
        return _from_be64(v)
    for i in range(n):
        v = (v << 8) | p[i]
    return v


cdef inline bint _utf8_ok(const unsigned char *p, Py_ssize_t n):
    """Whether CPython's strict UTF-8 decoder (what unpackb uses) takes these bytes: ASCII
    checked inline (six strings an update), anything else by the decoder."""
    return _ascii(p, n) or _utf8_decodes(p, n)


cdef bint _utf8_decodes(const unsigned char *p, Py_ssize_t n):
    try:
        PyUnicode_DecodeUTF8(<const char *>p, n, NULL)
    except UnicodeDecodeError:
        return False
    return True


cdef inline bint _str_header(Reader *r, const unsigned char **s, Py_ssize_t *n) noexcept:
    """A str's bytes (not yet checked as UTF-8); False if the next value is no str."""
    cdef unsigned char b
    cdef int w
    if not _need(r, 1):
        return False
    b = r.p[0]
    if 0xA0 <= b <= 0xBF:
        n[0] = b & 0x1F
        w = 0
    elif b == 0xD9:
        w = 1
    elif b == 0xDA:
        w = 2
    elif b == 0xDB:
        w = 4
    else:
        return False
    if not _need(r, 1 + w):
        return False
    if w:
        n[0] = <Py_ssize_t>_be(r.p + 1, w)
    if not _need(r, 1 + w + n[0]):
        return False
    s[0] = r.p + 1 + w
    r.p += 1 + w + n[0]
    return True


cdef bint _map_header(Reader *r, Py_ssize_t *n) noexcept:
    cdef unsigned char b
    if not _need(r, 1):
        return False
    b = r.p[0]
    if 0x80 <= b <= 0x8F:
        n[0] = b & 0x0F
        r.p += 1
    elif b == 0xDE and _need(r, 3):
        n[0] = <Py_ssize_t>_be(r.p + 1, 2)
        r.p += 3
    elif b == 0xDF and _need(r, 5):
        n[0] = <Py_ssize_t>_be(r.p + 1, 4)
        r.p += 5
    else:
        return False
    return True


cdef bint _skip(Reader *r, int depth):
    """Past one value of a key not read, as unpackb would accept it; False where it might
    not (or where we do not know: ext types)."""
    cdef unsigned char b
    cdef Py_ssize_t n, i, length
    cdef const unsigned char *s
    if depth > MAX_DEPTH or not _need(r, 1):
        return False
    b = r.p[0]
    if b <= 0x7F or b >= 0xE0 or b == 0xC0 or b == 0xC2 or b == 0xC3:
        r.p += 1
        return True
    if 0x80 <= b <= 0x8F or b == 0xDE or b == 0xDF:
        if not _map_header(r, &n):
            return False
        for i in range(n):
            # strict_map_key: str or bin keys only.
            if _str_header(r, &s, &length):
                if not _utf8_ok(s, length):
                    return False
            elif not _need(r, 1) or not (0xC4 <= r.p[0] <= 0xC6) or not _skip(r, depth + 1):
                return False
            if not _skip(r, depth + 1):
                return False
        return True
    if 0x90 <= b <= 0x9F or b == 0xDC or b == 0xDD:
        if b <= 0x9F:
            n = b & 0x0F
            r.p += 1
        elif b == 0xDC and _need(r, 3):
            n = <Py_ssize_t>_be(r.p + 1, 2)
            r.p += 3
        elif b == 0xDD and _need(r, 5):
            n = <Py_ssize_t>_be(r.p + 1, 4)
            r.p += 5
        else:
            return False
        for i in range(n):
            if not _skip(r, depth + 1):
                return False
        return True
    if 0xA0 <= b <= 0xBF or 0xD9 <= b <= 0xDB:
        return _str_header(r, &s, &length) and _utf8_ok(s, length)
    if 0xC4 <= b <= 0xC6:  # bin 8/16/32
        i = 1 << (b - 0xC4)
        if not _need(r, 1 + i):
            return False
        n = <Py_ssize_t>_be(r.p + 1, <int>i)
        if not _need(r, 1 + i + n):
            return False
        r.p += 1 + i + n
        return True
    if b == 0xCA or b == 0xCB:  # float 32/64
        i = 5 if b == 0xCA else 9
    elif 0xCC <= b <= 0xCF:  # uint 8..64
        i = 1 + (1 << (b - 0xCC))
    elif 0xD0 <= b <= 0xD3:  # int 8..64
        i = 1 + (1 << (b - 0xD0))
    else:
        return False  # ext, or 0xC1 (never used)
    if not _need(r, i):
        return False
    r.p += i
    return True


cdef bint _uint(Reader *r, Value *v) noexcept:
    """A non-negative integer (uint, or int of a non-negative value)."""
    cdef unsigned char b = r.p[0]
    cdef int w
    cdef uint64_t u
    if b <= 0x7F:
        v.u = b
        r.p += 1
    elif 0xCC <= b <= 0xCF:
        w = 1 << (b - 0xCC)
        if not _need(r, 1 + w):
            return False
        v.u = _be(r.p + 1, w)
        r.p += 1 + w
    elif 0xD0 <= b <= 0xD3:
        w = 1 << (b - 0xD0)
        if not _need(r, 1 + w):
            return False
        u = _be(r.p + 1, w)
        if u >> (8 * w - 1):  # negative
            return False
        v.u = u
        r.p += 1 + w
    else:
        return False
    v.kind = K_UINT
    return True


cdef bint _float(Reader *r, Value *v) noexcept:
    cdef unsigned char b = r.p[0]
    cdef unsigned int bits32
    cdef uint64_t bits64
    cdef float f32
    if b == 0xCA and _need(r, 5):
        bits32 = <unsigned int>_be(r.p + 1, 4)
        memcpy(&f32, &bits32, 4)
        v.f = f32
        r.p += 5
    elif b == 0xCB and _need(r, 9):
        bits64 = _be(r.p + 1, 8)
        memcpy(&v.f, &bits64, 8)
        r.p += 9
    else:
        return False
    v.kind = K_FLOAT
    return True


cdef bint _field(Reader *r, int field, Value *v):
    """The value of a key the reference reads, if of the type the one-pass decoder takes
    without converting; False otherwise (then the reference decides)."""
    cdef unsigned char b = r.p[0]
    cdef Py_ssize_t n, i, length
    cdef const unsigned char *s
    if b == 0xC0:
        if field in (F_GPU, F_MEMORY_TOTAL, F_MEMORY_USED, F_KV_BLOCK_SIZE, F_KV_CAPACITY,
                     F_KV_USAGE, F_TTFT, F_TPOT):
            v.kind = K_NIL
            r.p += 1
            return True
        return False
    if field == F_V:
        if b != 1:  # positive fixint 1 only
            return False
        r.p += 1
        v.kind = K_UINT
        return True
    if field in (F_ADDRESS, F_POOL, F_MODEL, F_GPU, F_EPOCH):
        if not _str_header(r, &s, &length) or not _utf8_ok(s, length):
            return False
        if field == F_ADDRESS and length == 0:
            return False
        v.kind, v.p, v.n = K_STR, s, length
        return True
    if field in (F_HEALTHY, F_DRAINING):
        if b == 0xC2 or b == 0xC3:
            v.kind = K_TRUE if b == 0xC3 else K_FALSE
            r.p += 1
            return True
        return False
    if field in (F_KV_USAGE, F_TTFT, F_TPOT):
        if not _float(r, v):
            return False
        if field == F_KV_USAGE:
            return 0.0 <= v.f <= 1.0
        return v.f >= 0.0
    if field == F_ADAPTERS:
        v.p = r.p
        if not _map_header(r, &n):
            return False
        for i in range(n):
            if not _str_header(r, &s, &length) or not _utf8_ok(s, length):
                return False
            if not _need(r, 1) or not (r.p[0] == 0xC2 or r.p[0] == 0xC3):
                return False
            r.p += 1
        v.kind, v.n = K_MAP, r.p - v.p
        return True
    # The integer fields.
    if not _uint(r, v):
        return False
    return field != F_KV_BLOCK_SIZE or v.u > 0


cdef inline bint _same(const unsigned char *a, const unsigned char *b, Py_ssize_t n) noexcept:
    """memcmp(a, b, n) == 0 for short keys and strings, inline (no libc call), eight bytes
    at a time, the last eight overlapping the ones before (no byte loop past 8 bytes)."""
    cdef uint64_t x, y
    if n >= 8:
        while n > 8:
            memcpy(&x, a, 8)
            memcpy(&y, b, 8)
            if x != y:
                return False
            a += 8
            b += 8
            n -= 8
        memcpy(&x, a + n - 8, 8)
        memcpy(&y, b + n - 8, 8)
        return x == y
    while n > 0:
        if a[0] != b[0]:
            return False
        a += 1
        b += 1
        n -= 1
    return True


cdef inline bint _key_next(const unsigned char *p, Py_ssize_t avail, int k) noexcept:
    """Whether the bytes at `p` (`avail` of them, more than _KEY_LEN[k]) start with key k
    as encode() writes it: compared as precomputed words (a key of under 8 bytes as one
    masked word), where the byte loop of _same was ~25 instructions a key."""
    cdef Py_ssize_t n = _KEY_LEN[k]
    cdef uint64_t w
    if n >= 8:
        memcpy(&w, p, 8)
        if w != _KEY_WORD[k][0]:
            return False
        if n > 16:
            memcpy(&w, p + 8, 8)
            if w != _KEY_WORD[k][1]:
                return False
        memcpy(&w, p + n - 8, 8)
        return w == _KEY_WORD[k][2]
    if avail >= 8:
        memcpy(&w, p, 8)
        return (w & _KEY_MASK[k]) == _KEY_WORD[k][0]
    return _same(p, _KEY[k], n)


cdef int _key(const unsigned char *s, Py_ssize_t n, int hint) noexcept:
    """The field a key names, or -1; `hint` is tried first (encode() writes the fields in
    order, so the one after the last key found)."""
    cdef int i
    cdef const unsigned char **names = <const unsigned char **>_NAMES
    if hint < N_FIELDS and _NAME_LEN[hint] == n and _same(s, names[hint], n):
        return hint
    for i in range(N_FIELDS):
        if _NAME_LEN[i] == n and _same(s, names[i], n):
            return i
    return -1


# -- building the objects -------------------------------------------------------------------


# What the decoder built before, by the bytes it came from: an engine's address, epoch,
# GPU, model and adapters come again with every update, and among engines; each is built
# once, then shared (str is immutable; the `models` and `adapters` dicts are a frozen
# ReportedState's values, read-only to every reader). A slot holds one kind of value for
# one encoding; another encoding landing there replaces it. Bounded: MEMO_SLOTS entries
# of at most MEMO_MAX_BYTES each.
cdef enum:
    MEMO_SLOTS = 8192  # a power of two
    MEMO_MAX_BYTES = 256
    KIND_STR = 1
    KIND_MODELS = 2  # {model: True} (or {}), by the model's UTF-8
    KIND_ADAPTERS = 3  # the adapters dict, by the msgpack map's encoding

cdef struct MemoSlot:
    int kind
    PyObject *raw  # bytes
    PyObject *value

cdef MemoSlot _memo[MEMO_SLOTS]
cdef const unsigned char *_NOTHING = <const unsigned char *>""
cdef const unsigned char *_EMPTY_MAP = <const unsigned char *>"\x80"  # msgpack's {}


cdef inline MemoSlot *_memo_slot(const unsigned char *p, Py_ssize_t n, int kind) noexcept:
    # FNV-1a over eight bytes at a time (then the last ones): a slot, not a digest.
    cdef uint64_t h = 14695981039346656037ULL ^ <uint64_t>kind
    cdef uint64_t w
    while n >= 8:
        memcpy(&w, p, 8)
        h = (h ^ w) * 1099511628211ULL
        p += 8
        n -= 8
    while n > 0:
        h = (h ^ p[0]) * 1099511628211ULL
        p += 1
        n -= 1
    h ^= h >> 32
    return &_memo[(h ^ (h >> 13)) & (MEMO_SLOTS - 1)]


cdef inline bint _memo_hit(MemoSlot *m, const unsigned char *p, Py_ssize_t n, int kind) noexcept:
    return (
        m.kind == kind
        and PyBytes_GET_SIZE(<object>m.raw) == n
        and memcmp(PyBytes_AS_STRING(<object>m.raw), p, n) == 0
    )


cdef void _memo_put(MemoSlot *m, const unsigned char *p, Py_ssize_t n, int kind, object value):
    raw = PyBytes_FromStringAndSize(<const char *>p, n)
    Py_INCREF(raw)
    Py_INCREF(value)
    old_raw, old_value = m.raw, m.value
    m.kind, m.raw, m.value = kind, <PyObject *>raw, <PyObject *>value
    Py_XDECREF(old_raw)
    Py_XDECREF(old_value)


cdef object _text(const unsigned char *p, Py_ssize_t n):
    if n > MEMO_MAX_BYTES:
        return PyUnicode_DecodeUTF8(<const char *>p, n, NULL)
    cdef MemoSlot *m = _memo_slot(p, n, KIND_STR)
    if _memo_hit(m, p, n, KIND_STR):
        return <object>m.value
    value = PyUnicode_DecodeUTF8(<const char *>p, n, NULL)
    _memo_put(m, p, n, KIND_STR, value)
    return value


cdef inline object _str(Value *v):
    return _text(v.p, v.n)


cdef object _models(Value *v):
    """{model: True}, or {} for no model (EndpointState.to_reported)."""
    cdef const unsigned char *p = v.p
    cdef Py_ssize_t n = v.n
    if v.kind != K_STR:
        p, n = _NOTHING, 0
    if n > MEMO_MAX_BYTES:
        return {PyUnicode_DecodeUTF8(<const char *>p, n, NULL): True}
    cdef MemoSlot *m = _memo_slot(p, n, KIND_MODELS)
    if _memo_hit(m, p, n, KIND_MODELS):
        return <object>m.value
    value = {_text(p, n): True} if n else {}
    _memo_put(m, p, n, KIND_MODELS, value)
    return value


cdef inline object _opt_int(Value *v):
    return None if v.kind != K_UINT else PyLong_FromUnsignedLongLong(v.u)


cdef inline object _opt_float(Value *v):
    return None if v.kind != K_FLOAT else PyFloat_FromDouble(v.f)


cdef object _adapters(Value *v):
    """The adapters map as a dict (checked in pass 1); absent: {}."""
    cdef Reader r
    cdef const unsigned char *s = NULL
    cdef Py_ssize_t n = 0, i, entries = 0
    cdef const unsigned char *p = v.p
    cdef Py_ssize_t size = v.n
    if v.kind != K_MAP:
        p, size = _EMPTY_MAP, 1
    cdef MemoSlot *m = NULL
    if size <= MEMO_MAX_BYTES:
        m = _memo_slot(p, size, KIND_ADAPTERS)
        if _memo_hit(m, p, size, KIND_ADAPTERS):
            return <object>m.value
    cdef dict out = {}
    r.p = p
    r.end = p + size
    _map_header(&r, &entries)
    for i in range(entries):
        _str_header(&r, &s, &n)
        out[_text(s, n)] = r.p[0] == 0xC3
        r.p += 1
    if m is not NULL:
        _memo_put(m, p, size, KIND_ADAPTERS, out)
    return out


# What bind() was given: the classes to build (their slot offsets, when they are plain
# slotted dataclasses of exactly these fields, for building with plain stores as dataclass
# __init__ leaves them; frozen, it stores through object.__setattr__ too) and the reference.
_REPORTED_FIELDS = (
    "epoch", "healthy", "draining", "gpu", "gpu_count", "memory_total_bytes",
    "memory_used_bytes", "kv_block_size", "kv_capacity_blocks", "kv_usage",
    "requests_running", "requests_waiting", "tokens_in_flight", "ttft_s", "tpot_s",
    "models", "adapters",
)
cdef enum:
    N_REPORTED = 17
cdef Py_ssize_t _rs_off[N_REPORTED]
cdef Py_ssize_t _er_off[2]
cdef bint _slots_bound = False
cdef type _EngineReport = None
cdef type _ReportedState = None
cdef object _reference = None


cdef bint _plain(type cls, tuple names):
    import dataclasses

    return (
        dataclasses.is_dataclass(cls)
        and tuple(f.name for f in dataclasses.fields(cls)) == names
        and cls.__new__ is object.__new__
        and cls.__dictoffset__ == 0  # no instance __dict__: slots only
        and getattr(cls, "__post_init__", None) is None
    )


def bind(engine_report, reported_state, reference):
    """Give the module its classes (xds.engine_report.EngineReport, ReportedState) and the
    reference decoder it falls back to; returns whether it builds instances through their
    slots (else through the classes)."""
    global _EngineReport, _ReportedState, _reference, _slots_bound
    _slots_bound = False
    _EngineReport, _ReportedState, _reference = engine_report, reported_state, reference
    if not (_plain(reported_state, _REPORTED_FIELDS) and _plain(engine_report, ("address", "state"))):
        return False
    for i, name in enumerate(_REPORTED_FIELDS):
        _rs_off[i] = _slot_offset(reported_state, name, True)
        if _rs_off[i] < 0:
            return False
    for i, name in enumerate(("address", "state")):
        _er_off[i] = _slot_offset(engine_report, name, True)
        if _er_off[i] < 0:
            return False
    _slots_bound = True
    return True


cdef inline object _count(Value *v):
    return PyLong_FromUnsignedLongLong(v.u if v.kind == K_UINT else 0)


# -- reusing the previous report's values ---------------------------------------------------


# An engine's next report is mostly its last one: its address, epoch, GPU, model, adapters,
# memory and KV capacity stay; its load moves. Given the report it replaces (any report:
# only equal values are taken from it), each value equal to the one there is that object
# again instead of a new one (or a memo lookup: an FNV hash of its bytes), and a report
# equal in every field is the previous report itself.


cdef inline bint _same_text(PyObject *o, const unsigned char *p, Py_ssize_t n) noexcept:
    """Whether `o` is the str of these bytes (ASCII strs only: the common case)."""
    return (
        o != NULL
        and PyUnicode_CheckExact(o)
        and PyUnicode_IS_COMPACT_ASCII(o)
        and PyUnicode_GET_LENGTH(o) == n
        and _same(<const unsigned char *>PyUnicode_DATA(o), p, n)
    )


cdef inline object _text_as(Value *v, PyObject *o):
    if _same_text(o, v.p, v.n):
        return <object>o
    return _text(v.p, v.n)


cdef inline bint _same_uint(PyObject *o, uint64_t u) noexcept:
    """Whether `o` is the int `u`: read from its digits where it has at most two (below
    2^60 on CPython before 3.12: _small_uint), else its low 64 bits, then its sign and
    size (no error to clear, and no byte-array conversion for ints past 2^30 as
    PyLong_AsUnsignedLongLong does). The digits' read saves the three calls, ~40
    instructions an int, seven an update."""
    cdef uint64_t small
    if o == NULL or not PyLong_CheckExact(o):
        return False
    if _small_uint(o, &small):
        return small == u
    if PyLong_AsUnsignedLongLongMask(o) != u:
        return False
    return _PyLong_Sign(o) >= 0 and _PyLong_NumBits(o) <= 64


cdef inline object _opt_int_as(Value *v, PyObject *o):
    if v.kind != K_UINT:
        return None
    if _same_uint(o, v.u):
        return <object>o
    return PyLong_FromUnsignedLongLong(v.u)


cdef inline object _count_as(Value *v, PyObject *o):
    cdef uint64_t u = v.u if v.kind == K_UINT else 0
    if _same_uint(o, u):
        return <object>o
    return PyLong_FromUnsignedLongLong(u)


cdef inline object _opt_float_as(Value *v, PyObject *o):
    cdef double d
    if v.kind != K_FLOAT:
        return None
    if o != NULL and PyFloat_CheckExact(o):
        d = PyFloat_AS_DOUBLE(o)
        if memcmp(&d, &v.f, sizeof(double)) == 0:  # the same bits (0.0 is not -0.0)
            return <object>o
    return PyFloat_FromDouble(v.f)


cdef object _models_as(Value *v, PyObject *o):
    """_models, or `o` where it is that dict ({model: True}, or {})."""
    cdef Py_ssize_t pos = 0
    cdef PyObject *key
    cdef PyObject *value
    cdef Py_ssize_t n = v.n if v.kind == K_STR else 0
    if o != NULL and PyDict_CheckExact(o):
        if n == 0:
            if PyDict_GET_SIZE(o) == 0:
                return <object>o
        elif PyDict_GET_SIZE(o) == 1 and PyDict_Next(<object>o, &pos, &key, &value):
            if value == Py_True and _same_text(key, v.p, n):
                return <object>o
    return _models(v)


cdef object _adapters_as(Value *v, PyObject *o):
    """_adapters, or `o` where it holds the same entries in the same order."""
    cdef Reader r
    cdef const unsigned char *s = NULL
    cdef Py_ssize_t n = 0, i, entries = 0, pos = 0
    cdef PyObject *key
    cdef PyObject *value
    if o == NULL or not PyDict_CheckExact(o):
        return _adapters(v)
    if v.kind != K_MAP:
        if PyDict_GET_SIZE(o) == 0:
            return <object>o
        return _adapters(v)
    r.p = v.p
    r.end = v.p + v.n
    _map_header(&r, &entries)
    if PyDict_GET_SIZE(o) != entries:  # (a key given twice makes the dict smaller)
        return _adapters(v)
    for i in range(entries):
        _str_header(&r, &s, &n)
        if not PyDict_Next(<object>o, &pos, &key, &value) or not _same_text(key, s, n):
            return _adapters(v)
        if value != (Py_True if r.p[0] == 0xC3 else Py_False):
            return _adapters(v)
        r.p += 1
    return <object>o


cdef object _build(Value *f, object previous):
    """The EngineReport: EndpointState.to_reported's values, from pass 1's; values equal
    to `previous`'s are its objects (previous itself where all are)."""
    cdef PyObject *pv[N_REPORTED]
    cdef PyObject *paddr = NULL
    cdef PyObject *pstate
    cdef int k
    for k in range(N_REPORTED):
        pv[k] = NULL
    if _slots_bound and type(previous) is _EngineReport:
        pstate = _slot(previous, _er_off[1])
        if pstate != NULL and type(<object>pstate) is _ReportedState:
            paddr = _slot(previous, _er_off[0])
            _prefetch(paddr)
            # Every value asked for at once: in a sidecar they are cold (a push comes every
            # 20 ms, other processes between), and compared one after another each miss
            # would wait for the last.
            for k in range(N_REPORTED):
                pv[k] = _slot(<object>pstate, _rs_off[k])
                _prefetch(pv[k])
    epoch = _text_as(&f[F_EPOCH], pv[0]) if f[F_EPOCH].kind == K_STR else ""
    gpu = _text_as(&f[F_GPU], pv[3]) if f[F_GPU].kind == K_STR else None
    # `or None`
    gpu_count = _count_as(&f[F_GPU_COUNT], pv[4]) if f[F_GPU_COUNT].u else None
    address = _text_as(&f[F_ADDRESS], paddr)
    cdef bint healthy = f[F_HEALTHY].kind != K_FALSE
    cdef bint draining = f[F_DRAINING].kind == K_TRUE
    if not _slots_bound:
        return _EngineReport(
            address,
            _ReportedState(
                epoch=epoch,
                healthy=healthy,
                draining=draining,
                gpu=gpu,
                gpu_count=gpu_count,
                memory_total_bytes=_opt_int(&f[F_MEMORY_TOTAL]),
                memory_used_bytes=_opt_int(&f[F_MEMORY_USED]),
                kv_block_size=_opt_int(&f[F_KV_BLOCK_SIZE]),
                kv_capacity_blocks=_opt_int(&f[F_KV_CAPACITY]),
                kv_usage=_opt_float(&f[F_KV_USAGE]),
                requests_running=_count(&f[F_RUNNING]),
                requests_waiting=_count(&f[F_WAITING]),
                tokens_in_flight=_count(&f[F_TOKENS]),
                ttft_s=_opt_float(&f[F_TTFT]),
                tpot_s=_opt_float(&f[F_TPOT]),
                models=_models(&f[F_MODEL]),
                adapters=_adapters(&f[F_ADAPTERS]),
            ),
        )
    mem_total = _opt_int_as(&f[F_MEMORY_TOTAL], pv[5])
    mem_used = _opt_int_as(&f[F_MEMORY_USED], pv[6])
    block = _opt_int_as(&f[F_KV_BLOCK_SIZE], pv[7])
    blocks = _opt_int_as(&f[F_KV_CAPACITY], pv[8])
    usage = _opt_float_as(&f[F_KV_USAGE], pv[9])
    running = _count_as(&f[F_RUNNING], pv[10])
    waiting = _count_as(&f[F_WAITING], pv[11])
    tokens = _count_as(&f[F_TOKENS], pv[12])
    ttft = _opt_float_as(&f[F_TTFT], pv[13])
    tpot = _opt_float_as(&f[F_TPOT], pv[14])
    models = _models_as(&f[F_MODEL], pv[15])
    adapters = _adapters_as(&f[F_ADAPTERS], pv[16])
    if (
        paddr != NULL
        and <PyObject *>address == paddr
        and <PyObject *>epoch == pv[0]
        and (Py_True if healthy else Py_False) == pv[1]
        and (Py_True if draining else Py_False) == pv[2]
        and <PyObject *>gpu == pv[3]
        and <PyObject *>gpu_count == pv[4]
        and <PyObject *>mem_total == pv[5]
        and <PyObject *>mem_used == pv[6]
        and <PyObject *>block == pv[7]
        and <PyObject *>blocks == pv[8]
        and <PyObject *>usage == pv[9]
        and <PyObject *>running == pv[10]
        and <PyObject *>waiting == pv[11]
        and <PyObject *>tokens == pv[12]
        and <PyObject *>ttft == pv[13]
        and <PyObject *>tpot == pv[14]
        and <PyObject *>models == pv[15]
        and <PyObject *>adapters == pv[16]
    ):
        return previous  # an unchanged report: nothing to build
    state = PyType_GenericAlloc(_ReportedState, 0)
    _store_new(state, _rs_off[0], epoch)
    _store_new(state, _rs_off[1], healthy)
    _store_new(state, _rs_off[2], draining)
    _store_new(state, _rs_off[3], gpu)
    _store_new(state, _rs_off[4], gpu_count)
    _store_new(state, _rs_off[5], mem_total)
    _store_new(state, _rs_off[6], mem_used)
    _store_new(state, _rs_off[7], block)
    _store_new(state, _rs_off[8], blocks)
    _store_new(state, _rs_off[9], usage)
    _store_new(state, _rs_off[10], running)
    _store_new(state, _rs_off[11], waiting)
    _store_new(state, _rs_off[12], tokens)
    _store_new(state, _rs_off[13], ttft)
    _store_new(state, _rs_off[14], tpot)
    _store_new(state, _rs_off[15], models)
    _store_new(state, _rs_off[16], adapters)
    report = PyType_GenericAlloc(_EngineReport, 0)
    _store_new(report, _er_off[0], address)
    _store_new(report, _er_off[1], state)
    # Neither can be part of a reference cycle (frozen; strs, numbers and the shared
    # str -> bool dicts inside): the cyclic GC need not walk them. A sidecar following
    # 1,000 engines holds 1,000 of each, replaced 10,000 times a second.
    PyObject_GC_UnTrack(<PyObject *>state)
    PyObject_GC_UnTrack(<PyObject *>report)
    return report


cdef object _decode(const unsigned char *p, Py_ssize_t size, object body, object previous):
    """decode_engine_report of the bytes at `p` (`body`: those bytes as an object, or None
    to build them only for the reference)."""
    cdef Reader r
    cdef Value fields[N_FIELDS]
    cdef Py_ssize_t n, i, length
    cdef const unsigned char *s
    cdef int k, hint = 0
    if _reference is None:
        raise RuntimeError("not bound: import xds.engine_report")
    if size > _MAX_BYTES:
        return _fall_back(p, size, body)
    r.p = p
    r.end = p + size
    for k in range(N_FIELDS):
        fields[k].kind = K_ABSENT
        fields[k].u = 0
    if not _map_header(&r, &n):
        return _fall_back(p, size, body)
    for i in range(n):
        if (
            hint < N_FIELDS
            and r.end - r.p > _KEY_LEN[hint]
            and _key_next(r.p, r.end - r.p, hint)
        ):
            # The key encode() writes next, header and name matched at once (a value
            # byte follows: checked above).
            k = hint
            r.p += _KEY_LEN[hint]
        else:
            if not _str_header(&r, &s, &length) or not _need(&r, 1):
                return _fall_back(p, size, body)
            k = _key(s, length, hint)
            if k < 0:
                if not _utf8_ok(s, length) or not _skip(&r, 1):
                    return _fall_back(p, size, body)
                continue
        if fields[k].kind != K_ABSENT or not _field(&r, k, &fields[k]):
            return _fall_back(p, size, body)
        hint = k + 1
    if r.p != r.end or fields[F_ADDRESS].kind != K_STR:
        return _fall_back(p, size, body)
    return _build(fields, previous)


cdef object _fall_back(const unsigned char *p, Py_ssize_t size, object body):
    if body is None:
        body = PyBytes_FromStringAndSize(<const char *>p, size)
    return _reference(body)


cdef void warm_report(object previous, int stage) noexcept:
    """Ask for a held report's objects from memory ahead of decoding what replaces it
    (xds/_delta_response_c.pyx does it for a batch of resources a stage at a time, so the
    misses overlap): stage 0 its state (three cache lines) and address, stage 1 the
    state's values (the state must have come in: stage 0 a batch before)."""
    cdef PyObject *pstate
    cdef int k
    if not _slots_bound or type(previous) is not _EngineReport:
        return
    pstate = _slot(previous, _er_off[1])
    if pstate == NULL:
        return
    if stage == 0:
        _prefetch(pstate)
        _prefetch(<char *>pstate + 64)
        _prefetch(<char *>pstate + 128)
        _prefetch(_slot(previous, _er_off[0]))
    elif type(<object>pstate) is _ReportedState:
        for k in range(N_REPORTED):
            _prefetch(_slot(<object>pstate, _rs_off[k]))


cdef object decode_span(const unsigned char *p, Py_ssize_t size, object previous):
    """decode_engine_report(bytes of p[:size], previous), the bytes read where they are
    (xds/_delta_response_c.pyx reads a response's bodies in place: no copy of each)."""
    return _decode(p, size, None, previous)


def decode_engine_report(body, previous=None):
    """An EndpointState body as an EngineReport, or ResourceError: what reference_decode
    returns or raises, for every body. `previous`: the report this one replaces, if any
    (values equal to its are its objects; an unchanged report is `previous` itself).

    One pass over the bytes checks the map and notes where each field's value is, a
    second builds the objects; anything not plainly well formed goes to the reference.
    """
    if type(body) is not bytes:
        if _reference is None:
            raise RuntimeError("not bound: import xds.engine_report")
        return _reference(body)
    return _decode(
        <const unsigned char *>PyBytes_AS_STRING(body), PyBytes_GET_SIZE(body), body, previous
    )
