# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of filters/http_fields.py: the same loops over a head's fields with the
decoding, case-insensitive name tests and limit sums in C. Results equal the pure-Python
reference's for any input (tests/test_http_fields.py checks that with hypothesis). Import
via filters.hotpath.

Speed-up (timeit, shared 2-core dev machine of 2026-12): a 4-field request head read in
~0.57 us instead of ~1.7 us, a 6-field response split in ~0.87 us instead of ~1.2 us (the
name's lower() and the set lookup stay Python's); with them the sidecar's instructions per
1-token request drop 1.025 M -> 1.009 M (`python -m loadtest.sidecar_instructions`).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.unicode cimport (
    PyUnicode_DecodeLatin1,
    PyUnicode_DecodeUTF8,
    PyUnicode_GET_LENGTH,
    PyUnicode_READ_CHAR,
)

__all__ = ["read_request_fields", "split_fields"]


cdef inline bint _bytes_name_is(const unsigned char* p, Py_ssize_t n, const char* lower,
                                Py_ssize_t m) noexcept:
    cdef Py_ssize_t i
    cdef unsigned char c
    if n != m:
        return False
    for i in range(n):
        c = p[i]
        if 65 <= c <= 90:
            c |= 32
        if c != <unsigned char>lower[i]:
            return False
    return True


cdef inline bint _str_name_is(str s, const char* lower, Py_ssize_t m) noexcept:
    """`s.lower() == lower` for an ASCII `lower` without a "k": apart from U+212A (KELVIN
    SIGN, to "k") and U+0130 (to two code points), no non-ASCII character lowers to ASCII."""
    cdef Py_ssize_t i
    cdef unsigned int c
    if PyUnicode_GET_LENGTH(s) != m:
        return False
    for i in range(m):
        c = <unsigned int>PyUnicode_READ_CHAR(s, i)
        if 65 <= c <= 90:
            c |= 32
        if c != <unsigned int>(<unsigned char>lower[i]):
            return False
    return True


cdef str _decode_value(bytes value):
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(value)
    cdef Py_ssize_t i, n = PyBytes_GET_SIZE(value)
    for i in range(n):
        if p[i] >= 128:
            return PyUnicode_DecodeUTF8(<const char*>p, n, "surrogateescape")
    return PyUnicode_DecodeLatin1(<const char*>p, n, NULL)


def read_request_fields(list raw, Py_ssize_t max_count, Py_ssize_t max_bytes):
    """See filters.http_fields.read_request_fields (the reference); `raw` a list."""
    cdef list headers = []
    cdef Py_ssize_t size = 0, n
    cdef const unsigned char* p
    content_length = None
    expect = None
    for name, value in raw:
        if type(name) is not bytes or type(value) is not bytes:
            from filters.http_fields import read_request_fields as reference
            return reference(raw, max_count, max_bytes)
        text = _decode_value(<bytes>value)
        n = PyBytes_GET_SIZE(name)
        p = <const unsigned char*>PyBytes_AS_STRING(name)
        headers.append((PyUnicode_DecodeLatin1(<const char*>p, n, NULL), text))
        size += n + PyBytes_GET_SIZE(value)
        if n == 14 and _bytes_name_is(p, n, b"content-length", 14):
            content_length = int(text)
        elif n == 6 and _bytes_name_is(p, n, b"expect", 6):
            expect = text
        if len(headers) > max_count:
            return headers, content_length, expect, "count"
        if size > max_bytes:
            return headers, content_length, expect, "size"
    return headers, content_length, expect, None


def split_fields(headers, frozenset drop, bint via_apart):
    """See filters.http_fields.split_fields (the reference)."""
    cdef list out = []
    cdef list connection = []
    cdef list via = []
    request_id = None
    for name, value in headers:
        if type(name) is not str:
            from filters.http_fields import split_fields as reference
            return reference(headers, drop, via_apart)
        if _str_name_is(<str>name, b"connection", 10):
            connection.append(value)
        if (<str>name).lower() in drop:
            continue
        if via_apart and _str_name_is(<str>name, b"via", 3):
            via.append(value)
            continue
        if _str_name_is(<str>name, b"x-request-id", 12):
            request_id = value
        out.append((name, value))
    return out, connection, via, request_id
