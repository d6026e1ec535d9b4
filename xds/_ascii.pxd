# Whether bytes are all ASCII, eight at a time (a byte at a time was ~8 instructions a
# byte; ~1,000 instructions an update in an engine report's strings): the check before a
# string is built, shared by the compiled decoders
# (xds/_delta_response_c.pyx, xds/_engine_report_c.pyx). Inline only, so nothing of it is
# imported at run time.

from libc.stdint cimport uint64_t
from libc.string cimport memcpy


cdef inline bint ascii_only(const unsigned char *p, Py_ssize_t n) noexcept:
    cdef uint64_t w, acc = 0
    if n >= 8:
        # The last eight bytes overlapping the words before: no byte loop.
        memcpy(&w, p + n - 8, 8)
        acc = w
        while n > 8:
            memcpy(&w, p, 8)
            acc |= w
            p += 8
            n -= 8
        return (acc & 0x8080808080808080ULL) == 0
    while n > 0:
        acc |= p[0]
        p += 1
        n -= 1
    return (acc & 0x8080808080808080ULL) == 0
