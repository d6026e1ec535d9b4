# The compiled EndpointState decoder's C entry (xds/_engine_report_c.pyx), for
# xds/_delta_response_c.pyx to decode a response's bodies where they lie.

cdef object decode_span(const unsigned char *p, Py_ssize_t size, object previous)
cdef void warm_report(object previous, int stage) noexcept
