# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: extra_compile_args = -ffp-contract=off
"""Compiled twin of filters/picker.py's `price_candidates`: the picker's hot loop (every
endpoint priced as if nothing were cached) with the J arithmetic in C doubles.

Also `sort_candidates`, the candidates' sort. Both must return exactly what the
pure-Python references return (the same operations in the same order on IEEE doubles;
tests/test_picker_twins.py compares them). Measured in-process on the 64-endpoint
setup of `python -m loadtest.picker_bench`: the loop from 21 to 9 us (no view rebuilt),
the sort from 9.4 to ~2 us. Import through filters.picker.

-ffp-contract=off: a compiler allowed to fuse `a + b * c` into one FMA (GCC's default
wherever the target has FMA, e.g. -march=native) would round differently from Python.
"""

import operator

__all__ = ["price_candidates", "sort_candidates"]


def price_candidates(
    endpoints, kkey, Py_ssize_t base, big_p, big_m, refresh, hook, req, now
):
    cdef double dp = big_p
    cdef double dm = big_m
    cdef double pm = big_p + big_m
    cdef double j, free, load_sum = 0.0, weight_sum = 0.0
    cdef Py_ssize_t slot = base
    cdef list cands = []
    cdef tuple kc
    for e in endpoints:
        v = e._pick_view
        if v is None or v.kkey is not kkey:
            v = refresh(e, v, kkey, now)
        kco = v.kc
        if kco is None or <Py_ssize_t>v.stamp >= base:
            continue
        if hook is not None and not hook(e, req, now):
            continue
        v.stamp = slot
        slot += 1
        kc = <tuple>kco
        j = <double>kc[0] + dp * <double>kc[1] + dm * <double>kc[2]
        free = <double>kc[3]
        if pm > free:
            j += (pm - free) * <double>kc[4]
        cands.append((j, kc[7], v))
        load_sum += <double>kc[5]
        weight_sum += <double>kc[6]
    return cands, load_sum, weight_sum


cdef object _first = operator.itemgetter(0)


def sort_candidates(list cands):
    """Sorts (J, name, view) tuples as list.sort() does. A tuple sort pays an equality
    test per comparison (9.4 us for 64 on the dev box); sorting by J alone then checking
    for equal (or NaN) J, where the name would decide, is the same order (about 2 us)."""
    cdef Py_ssize_t i, n = len(cands)
    cdef double a, b
    if n < 2:
        return
    cdef list before = cands[:]  # the tuple sort of a NaN J depends on the input order
    cands.sort(key=_first)
    a = <double>(<tuple>cands[0])[0]
    if a != a:
        cands[:] = before
        cands.sort()
        return
    for i in range(1, n):
        b = <double>(<tuple>cands[i])[0]
        if not a < b:  # a tie, or NaN: the names decide
            cands[:] = before
            cands.sort()
            return
        a = b
