# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of xds/delta_response.py's `reference_read`: a serialized
DeltaDiscoveryResponse read in C from its protobuf wire format (protobuf.dev's encoding
doc) straight into the Entries the subscriber keeps, with no protobuf message, no
Resource or Any wrapper and no per-field string but the name (shared between updates)
and the version. Import through xds.delta_response.

It reads the subset of the wire format our control plane writes, on which it agrees with
protobuf's parse by construction: the fields DeltaDiscoveryResponse, Resource and Any
define that the subscriber reads (system_version_info, resources, type_url, nonce,
removed_resources; Resource's version, resource, name; Any's type_url and value), each
singular one at most once, with its own wire type, strings valid UTF-8; fields no schema
defines (unknown) of wire types 0, 1, 2 and 5 are skipped, as protobuf keeps them aside.
Everything else (a defined field it does not read: aliases, ttl, control_plane...; a
field given twice; groups; a varint of 10 bytes; malformed framing), and every response
the subscriber refuses (an Any of another type, a decoder's error), goes to the
reference, which returns the same DeltaResponse or raises protobuf's DecodeError
(tests/test_delta_response.py compares the two on arbitrary responses).

What it speeds up: a sidecar applying the control plane's pushes (issue #23). Reading a
response of 60 EndpointStates (1,000 engines in turn, caches warm, this 2-core VM): 1.6 us
a resource against 3.1 us for the reference, the body's decode (1.1 us) included; the
whole in-process apply of an update (`python -m loadtest.xds_apply_bench` (a), 60 a
response: read, the feed's apply, the ACK) 4.6 -> 2.4-2.6 us. In a real sidecar process
the figure is set by cold caches and gRPC's per-response cost (docs/control-plane-scale.md).
An EndpointState body (xds.engine_report's compiled decoder) is decoded in place, with no
bytes object of it, given the report the subscriber holds under its name (`held`): see
xds/_engine_report_c.pyx for what that saves.

In a sidecar those held reports are cold when a push comes (one every 20 ms, the control
plane and other processes on the cores between), and compared one after another each of
their objects' cache misses waited for the last: resources are read in batches of BATCH,
and each batch's held Entries, reports, states and values are asked for from memory a
stage at a time (prefetched) before its bodies are decoded. With strings checked as
ASCII eight bytes at a time, an Any's type compared with the response's before any UTF-8
check, and `changed` sized once: one real sidecar at 10,000 updates/s (`python -m
loadtest.xds_apply_bench --transports frames`, ~204 updates a response), the tree before
and this one alternated, 5 runs each: reading 3.30/3.81/4.44/4.67/3.74 -> 3.14/3.36/3.44/
3.22/3.20 us an update (median 3.81 -> 3.22); instructions (callgrind, responses of 200)
9,439 -> 8,434 an update (the batches cost ~200 of the ~1,200 the rest saves). Then:
a one-byte varint (every tag, most lengths) read without the loop, a tag's 32-bit bound
compared in C (it built an int object a tag), UTF-8 checked inline where it is ASCII, an
ASCII version copied into its str (PyUnicode_DecodeUTF8's loop was ~100 of its ~200
instructions), the subscribed set asked with no abstract dispatch and an Entry's slots
stored with nothing to release: this module's own part of the read 2,590 -> 1,998
instructions an update, the read with the body's decode (xds/_engine_report_c.pyx)
9,750 -> 7,641 (the subscriber's apply without its routers).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.set cimport PySet_Contains
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport uint64_t
from libc.string cimport memcmp, memcpy

from filters._slots cimport slot_offset as _slot_offset, store_new as _store_new
from xds._ascii cimport ascii_only as _ascii

from xds._engine_report_c cimport decode_span as _report_span
from xds._engine_report_c cimport warm_report as _warm_report

from xds._engine_report_c import decode_engine_report as _report_decoder

__all__ = ["bind", "read_response"]


cdef extern from "Python.h":
    object PyType_GenericAlloc(type t, Py_ssize_t nitems)
    void PyObject_GC_UnTrack(void *op)
    int PyObject_GC_IsTracked(object op)

cdef extern from "Python.h":
    dict _PyDict_NewPresized(Py_ssize_t minused)
    object PyUnicode_New(Py_ssize_t size, Py_UCS4 maxchar)
    void *PyUnicode_DATA(object o)

cdef extern from *:
    void _prefetch "__builtin_prefetch"(const void *p) noexcept

cdef enum:
    BATCH = 32  # resources read before they are decoded (their held objects: ~32 KB)


# -- reading the wire format ----------------------------------------------------------------


cdef struct Reader:
    const unsigned char *p
    const unsigned char *end


cdef struct Span:
    const unsigned char *p
    Py_ssize_t n
    bint seen


cdef enum:
    WT_VARINT = 0
    WT_I64 = 1
    WT_LEN = 2
    WT_I32 = 5


cdef inline bint _varint(Reader *r, uint64_t *out) noexcept:
    """A varint of at most 9 bytes (63 bits); False past the end or longer (the reference
    then decides)."""
    cdef uint64_t v = 0
    cdef int shift = 0
    cdef unsigned char b
    if r.p < r.end and r.p[0] < 0x80:  # one byte: every tag here, most lengths
        out[0] = r.p[0]
        r.p += 1
        return True
    while r.p < r.end and shift < 63:
        b = r.p[0]
        r.p += 1
        v |= (<uint64_t>(b & 0x7F)) << shift
        if b < 0x80:
            out[0] = v
            return True
        shift += 7
    return False


cdef inline bint _tag(Reader *r, uint64_t *number, int *wire) noexcept:
    """A field's tag as protobuf (upb) reads one: at most 5 bytes and 32 bits, so a tag
    padded with 0x80 bytes past the fifth is refused there, and goes to the reference here
    (found by fuzz/targets/delta_response.py)."""
    cdef const unsigned char *start = r.p
    cdef uint64_t t
    if not _varint(r, &t) or r.p - start > 5 or (t >> 32) != 0:  # (a C compare: no int object)
        return False
    number[0] = t >> 3
    wire[0] = <int>(t & 7)
    return 0 < number[0] < (1 << 29)


cdef inline bint _len(Reader *r, Span *s) noexcept:
    """A length-delimited payload: its bytes, the reader past them."""
    cdef uint64_t n
    if not _varint(r, &n) or n > <uint64_t>(r.end - r.p):
        return False
    s.p = r.p
    s.n = <Py_ssize_t>n
    r.p += n
    return True


cdef inline bint _skip(Reader *r, int wire) noexcept:
    """Past an unknown field's value (wire types 0, 1, 2, 5; groups: False)."""
    cdef uint64_t v
    cdef Span s
    if wire == WT_VARINT:
        return _varint(r, &v)
    if wire == WT_LEN:
        return _len(r, &s)
    if wire == WT_I64:
        if r.end - r.p < 8:
            return False
        r.p += 8
        return True
    if wire == WT_I32:
        if r.end - r.p < 4:
            return False
        r.p += 4
        return True
    return False


cdef inline bint _utf8_ok(const unsigned char *p, Py_ssize_t n):
    """Whether the bytes are valid UTF-8 (protobuf checks every proto3 string): ASCII
    checked inline, anything else by the decoder."""
    return _ascii(p, n) or _utf8_decodes(p, n)


cdef bint _utf8_decodes(const unsigned char *p, Py_ssize_t n):
    try:
        PyUnicode_DecodeUTF8(<const char *>p, n, NULL)
    except UnicodeDecodeError:
        return False
    return True


cdef inline bint _string_once(Reader *r, int wire, Span *s):
    """A singular string field: its first occurrence, of wire type 2, valid UTF-8."""
    if wire != WT_LEN or s.seen or not _len(r, s):
        return False
    s.seen = True
    return _utf8_ok(s.p, s.n)


cdef struct ResourceSpans:
    Span version
    Span name
    Span any_type
    Span value
    bint any_seen


cdef bint _any(const unsigned char *p, Py_ssize_t n, ResourceSpans *out):
    cdef Reader r
    cdef uint64_t number
    cdef int wire
    r.p = p
    r.end = p + n
    while r.p < r.end:
        if not _tag(&r, &number, &wire):
            return False
        if number == 1:
            # Its UTF-8 is checked by the caller (_any_type_ok): most are the response's
            # own type, checked once.
            if wire != WT_LEN or out.any_type.seen or not _len(&r, &out.any_type):
                return False
            out.any_type.seen = True
        elif number == 2:
            if wire != WT_LEN or out.value.seen or not _len(&r, &out.value):
                return False
            out.value.seen = True
        elif not _skip(&r, wire):
            return False
    return True


cdef bint _resource(const unsigned char *p, Py_ssize_t n, ResourceSpans *out):
    """A Resource's fields (envoy.service.discovery.v3.Resource)."""
    cdef Reader r
    cdef uint64_t number
    cdef int wire
    cdef Span body
    out.version.seen = out.name.seen = out.any_type.seen = out.value.seen = False
    out.version.n = out.name.n = out.any_type.n = out.value.n = 0
    out.any_seen = False
    r.p = p
    r.end = p + n
    while r.p < r.end:
        if not _tag(&r, &number, &wire):
            return False
        if number == 1:
            if not _string_once(&r, wire, &out.version):
                return False
        elif number == 3:
            if not _string_once(&r, wire, &out.name):
                return False
        elif number == 2:
            if wire != WT_LEN or out.any_seen or not _len(&r, &body):
                return False
            out.any_seen = True
            if not _any(body.p, body.n, out):
                return False
        elif number == 4 or 6 <= number <= 9:  # aliases, ttl, cache_control, resource_name, metadata
            return False
        elif not _skip(&r, wire):
            return False
    return True


cdef inline bint _same_span(Span *a, Span *b) noexcept:
    return a.seen and b.seen and a.n == b.n and memcmp(a.p, b.p, a.n) == 0


cdef inline bint _any_type_ok(ResourceSpans *res, Span *type_url):
    """Whether a resource's Any type is valid UTF-8 (or absent): the response's type
    (checked as read) needs no second look."""
    return not res.any_type.seen or _same_span(&res.any_type, type_url) or _utf8_ok(
        res.any_type.p, res.any_type.n
    )


# -- strings built once ---------------------------------------------------------------------


# An engine's resource name and the type URL come again with every response; each is built
# once, then shared (str is immutable). Bounded: MEMO_SLOTS entries of at most
# MEMO_MAX_BYTES each; another string landing in a slot replaces it.
cdef enum:
    MEMO_SLOTS = 8192  # a power of two
    MEMO_MAX_BYTES = 256

cdef struct MemoSlot:
    PyObject *raw  # bytes
    PyObject *value  # str

cdef MemoSlot _memo[MEMO_SLOTS]


cdef object _text(const unsigned char *p, Py_ssize_t n):
    """The str of UTF-8 already checked."""
    if n > MEMO_MAX_BYTES:
        return PyUnicode_DecodeUTF8(<const char *>p, n, NULL)
    cdef uint64_t h = 14695981039346656037ULL  # FNV-1a
    cdef Py_ssize_t i
    for i in range(n):
        h = (h ^ p[i]) * 1099511628211ULL
    cdef MemoSlot *m = &_memo[(h ^ (h >> 29)) & (MEMO_SLOTS - 1)]
    if (
        m.raw != NULL
        and PyBytes_GET_SIZE(<object>m.raw) == n
        and memcmp(PyBytes_AS_STRING(<object>m.raw), p, n) == 0
    ):
        return <object>m.value
    value = PyUnicode_DecodeUTF8(<const char *>p, n, NULL)
    raw = PyBytes_FromStringAndSize(<const char *>p, n)
    Py_INCREF(raw)
    Py_INCREF(value)
    old_raw, old_value = m.raw, m.value
    m.raw, m.value = <PyObject *>raw, <PyObject *>value
    Py_XDECREF(old_raw)
    Py_XDECREF(old_value)
    return value


# -- building the objects -------------------------------------------------------------------


cdef type _Entry = None
cdef type _DeltaResponse = None
cdef object _reference = None
cdef Py_ssize_t _entry_off[4]
cdef bint _slots_bound = False


def bind(entry, delta_response, reference):
    """Give the module its classes (xds.delta_response.Entry, DeltaResponse) and the
    reference it falls back to; returns whether it builds Entries through their slots
    (a plain slotted dataclass of exactly those fields), else through the class."""
    import dataclasses

    global _Entry, _DeltaResponse, _reference, _slots_bound
    _Entry, _DeltaResponse, _reference = entry, delta_response, reference
    _slots_bound = False
    names = ("name", "version", "value", "received_at")
    if not (
        dataclasses.is_dataclass(entry)
        and tuple(f.name for f in dataclasses.fields(entry)) == names
        and entry.__new__ is object.__new__
        and entry.__dictoffset__ == 0
        and getattr(entry, "__post_init__", None) is None
    ):
        return False
    for i, name in enumerate(names):
        _entry_off[i] = _slot_offset(entry, name, True)
        if _entry_off[i] < 0:
            return False
    _slots_bound = True
    return True


cdef object _new_entry(object name, object version, object value, object now):
    if not _slots_bound:
        return _Entry(name, version, value, now)
    e = PyType_GenericAlloc(_Entry, 0)
    _store_new(e, _entry_off[0], name)
    _store_new(e, _entry_off[1], version)
    _store_new(e, _entry_off[2], value)
    _store_new(e, _entry_off[3], now)
    if not PyObject_GC_IsTracked(value):
        # An Entry of values the GC does not track (an untracked EngineReport, bytes)
        # cannot be part of a cycle either: untracked, the GC does not walk it.
        PyObject_GC_UnTrack(<PyObject *>e)
    return e


cdef inline bint _wanted(object names, object name) except -1:
    """`name in names` (Interest.names: a set, looked up with no abstract dispatch)."""
    if type(names) is set:
        return PySet_Contains(names, name)
    return name in names


cdef inline object _str(Span *s):
    return _text(s.p, s.n) if s.seen else ""


cdef inline object _version(Span *s):
    """A resource's version (UTF-8 checked): an ASCII one copied into a new str, as
    PyUnicode_DecodeUTF8 would build it, without its decoding loop (~100 instructions of
    ~200 an update; one or no character: the decoder, which gives its shared strs)."""
    cdef object out
    if not s.seen:
        return ""
    if s.n > 1 and _ascii(s.p, s.n):
        out = PyUnicode_New(s.n, 127)
        memcpy(PyUnicode_DATA(out), s.p, s.n)
        return out
    return PyUnicode_DecodeUTF8(<const char *>s.p, s.n, NULL)


cdef PyObject *_held_value_ptr(PyObject *entry) noexcept:
    """An Entry's value, borrowed (NULL for anything else, or where Entries are not built
    through their slots: then nothing is taken from what the subscriber holds)."""
    if entry == NULL or not _slots_bound or type(<object>entry) is not _Entry:
        return NULL
    return (<PyObject **>((<char *>entry) + _entry_off[2]))[0]


def read_response(raw, interests, decoders, now, held=None):
    """A serialized DeltaDiscoveryResponse as a DeltaResponse, or protobuf's DecodeError:
    what reference_read returns or raises, for every input.

    One pass over the top level finds the type, the nonce and the removed names; a second
    reads each resource (all of them: a malformed one the subscriber does not want still
    makes protobuf refuse the message) and decodes those subscribed. An EndpointState
    body (xds.engine_report's compiled decoder) is decoded where it lies in `raw`, given
    the value `held` has under its name (the subscriber's Entries by type: what it
    replaces) to take unchanged values from.
    """
    cdef Reader r
    cdef uint64_t number
    cdef int wire
    cdef Span version_info, type_url, nonce, item
    cdef ResourceSpans res
    cdef const char *data
    cdef Py_ssize_t resources = 0
    cdef bint wildcard = False
    names = None
    cdef dict changed
    cdef ResourceSpans batch[BATCH]
    cdef PyObject *pending[BATCH]  # per batch member: its held Entry, then that one's value
    cdef Py_ssize_t count, i
    cdef int stage
    table = None
    if _reference is None:
        raise RuntimeError("not bound: import xds.delta_response")
    if type(raw) is not bytes:
        return _reference(raw, interests, decoders, now)
    data = <bytes>raw
    version_info.seen = type_url.seen = nonce.seen = False
    version_info.n = type_url.n = nonce.n = 0
    version_info.p = type_url.p = nonce.p = NULL
    removed = []
    r.p = <const unsigned char *>data
    r.end = r.p + len(<bytes>raw)
    while r.p < r.end:
        if not _tag(&r, &number, &wire):
            return _reference(raw, interests, decoders, now)
        if number == 2:
            if wire != WT_LEN or not _len(&r, &item):
                return _reference(raw, interests, decoders, now)
            resources += 1
        elif number == 6:
            if wire != WT_LEN or not _len(&r, &item) or not _utf8_ok(item.p, item.n):
                return _reference(raw, interests, decoders, now)
            removed.append(PyUnicode_DecodeUTF8(<const char *>item.p, item.n, NULL))
        elif number == 1:
            if not _string_once(&r, wire, &version_info):
                return _reference(raw, interests, decoders, now)
        elif number == 4:
            if not _string_once(&r, wire, &type_url):
                return _reference(raw, interests, decoders, now)
        elif number == 5:
            if not _string_once(&r, wire, &nonce):
                return _reference(raw, interests, decoders, now)
        elif 7 <= number <= 9:  # control_plane, removed_resource_names, resource_errors
            return _reference(raw, interests, decoders, now)
        elif not _skip(&r, wire):
            return _reference(raw, interests, decoders, now)
    t = _str(&type_url)
    interest = interests.get(t)
    decoder = None
    # Sized for every resource at once (grown from 8, a 200-resource response's dict
    # was rebuilt five times).
    changed = _PyDict_NewPresized(resources if interest is not None else 0)
    if interest is not None:
        decoder = decoders.get(t)
        wildcard = interest.wildcard
        names = interest.names
        if held is not None and decoder is _report_decoder:
            table = held.get(t)
            if type(table) is not dict:
                table = None
    r.p = <const unsigned char *>data
    while resources:
        # A batch of the resources wanted, then each decoded. Between the two, the reports
        # the subscriber holds for them (what each body is compared with) are asked for
        # from memory a stage at a time, all of the batch at once: in a sidecar they are
        # cold when a push comes, and one report after another each object's miss (its
        # Entry, report, state, values) would wait for the last.
        count = 0
        batch_names = []
        while resources and count < BATCH:
            _tag(&r, &number, &wire)  # well formed: pass 1 read it
            if wire != WT_LEN:
                _skip(&r, wire)
                continue
            _len(&r, &item)
            if number != 2:
                continue
            resources -= 1
            if not _resource(item.p, item.n, &batch[count]) or not _any_type_ok(
                &batch[count], &type_url
            ):
                return _reference(raw, interests, decoders, now)
            if interest is None:
                continue
            name = _str(&batch[count].name)
            if not wildcard and not _wanted(names, name):
                continue
            if not _same_span(&batch[count].any_type, &type_url):
                return _reference(raw, interests, decoders, now)  # refused: its message
            # Borrowed: the held table keeps it, and nothing before its use changes that.
            pending[count] = NULL if table is None else PyDict_GetItem(table, name)
            if pending[count] != NULL:
                _prefetch(pending[count])
            batch_names.append(name)
            count += 1
        if table is not None:
            for i in range(count):
                pending[i] = _held_value_ptr(pending[i])
                if pending[i] != NULL:
                    _prefetch(pending[i])
            for stage in range(2):
                for i in range(count):
                    if pending[i] != NULL:
                        _warm_report(<object>pending[i], stage)
        for i in range(count):
            res = batch[i]
            name = batch_names[i]
            if decoder is _report_decoder:
                previous = None if pending[i] == NULL else <object>pending[i]
                try:
                    body = _report_span(res.value.p, res.value.n, previous)
                except Exception:
                    return _reference(raw, interests, decoders, now)  # refused: its message
                changed[name] = _new_entry(name, _version(&res.version), body, now)
                continue
            body = PyBytes_FromStringAndSize(<const char *>res.value.p, res.value.n)
            if decoder is not None:
                try:
                    body = decoder(body)
                except Exception:
                    return _reference(raw, interests, decoders, now)  # refused: its message
            changed[name] = _new_entry(name, _version(&res.version), body, now)
    nonce_str = (
        PyUnicode_DecodeUTF8(<const char *>nonce.p, nonce.n, NULL) if nonce.seen else ""
    )
    if interest is None:
        return _DeltaResponse(t, nonce_str, None, (), None)
    return _DeltaResponse(t, nonce_str, changed, tuple(removed), None)
