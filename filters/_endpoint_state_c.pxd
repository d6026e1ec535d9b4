# The compiled EndpointState.report's C entry (filters/_endpoint_state_c.pyx), for
# xds/_feed_c.pyx to land a report with no method lookup or call.

cdef object report_c(object self, object state, object now)
