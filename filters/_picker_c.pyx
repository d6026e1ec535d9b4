# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: extra_compile_args = -ffp-contract=off
"""Compiled twin of filters/picker.py's `price_candidates`: the picker's hot loop (every
endpoint priced as if nothing were cached) with the J arithmetic in C doubles.

Also `sort_candidates`, the candidates' sort. Both must return exactly what the
pure-Python references return (the same operations in the same order on IEEE doubles;
tests/test_picker_twins.py compares them). Measured in-process on the 64-endpoint
setup of `python -m loadtest.picker_bench`: the loop from 21 to 9 us (no view rebuilt),
the sort from 9.4 to ~2 us. Import through filters.picker.

Since then (callgrind, the bench's steady state, instructions per whole pick: 280k before,
224k after, same answers): the loop reads the picker's own classes' slots directly
(bind_slots; getattr on a __slots__ attribute from C costs ~100 instructions, half the
loop's), and the sort is a C insertion sort of (J, index) pairs instead of list.sort with
a key (tests/test_picker_fastpath.py checks both against the slow paths).

-ffp-contract=off: a compiler allowed to fuse `a + b * c` into one FMA (GCC's default
wherever the target has FMA, e.g. -march=native) would round differently from Python.
"""

import operator

from cpython.object cimport PyObject
from libc.string cimport memmove
from cpython.ref cimport Py_INCREF, Py_XDECREF

from filters._slots cimport slot as _slot, slot_offset

__all__ = ["bind_slots", "price_candidates", "sort_candidates"]


# Direct slot access for the picker's own classes (bind_slots): reading a __slots__
# attribute through getattr costs ~100 instructions (type lookup, descriptor call), the
# slot itself one load. Other types (the twin tests' fakes) take the generic path.
cdef type _ep_type = None
cdef type _view_type = None
cdef Py_ssize_t _off_pick_view = -1
cdef Py_ssize_t _off_kkey = -1
cdef Py_ssize_t _off_kc = -1
cdef Py_ssize_t _off_stamp = -1


def bind_slots(endpoint_type, view_type):
    """Lets price_candidates read EndpointState._pick_view and the view's kkey, kc and
    stamp slots directly, for instances of exactly these classes (a subclass, or a class
    that overrides attribute access, takes the getattr path)."""
    global _ep_type, _view_type, _off_pick_view, _off_kkey, _off_kc, _off_stamp
    _ep_type = _view_type = None
    if (
        endpoint_type.__getattribute__ is not object.__getattribute__
        or endpoint_type.__setattr__ is not object.__setattr__
        or view_type.__getattribute__ is not object.__getattribute__
        or view_type.__setattr__ is not object.__setattr__
    ):
        return False
    pv = slot_offset(endpoint_type, "_pick_view", True)
    kk = slot_offset(view_type, "kkey", True)
    kc = slot_offset(view_type, "kc", True)
    sp = slot_offset(view_type, "stamp", True)
    if pv < 0 or kk < 0 or kc < 0 or sp < 0:
        return False
    _off_pick_view, _off_kkey, _off_kc, _off_stamp = pv, kk, kc, sp
    _ep_type = endpoint_type
    _view_type = view_type
    return True



def price_candidates(
    endpoints, kkey, Py_ssize_t base, big_p, big_m, double lam, double lam_d, double lam_i,
    refresh, hook, req, now, big_w=None
):
    cdef double dp = big_p if big_w is None else big_w
    cdef double dm = big_m
    cdef double pm = big_p + big_m
    cdef double x = big_p + 0.5 * big_m
    cdef double j, span, free, so, load_sum = 0.0, weight_sum = 0.0
    cdef Py_ssize_t slot = base
    cdef list cands = []
    cdef tuple kc
    cdef PyObject *p
    cdef PyObject **sp
    cdef object stamp
    cdef bint fast
    cdef type ept = _ep_type
    cdef type vt = _view_type
    cdef Py_ssize_t off_pv = _off_pick_view, off_kkey = _off_kkey
    cdef Py_ssize_t off_kc = _off_kc, off_stamp = _off_stamp
    for e in endpoints:
        # v = e._pick_view
        p = NULL
        if type(e) is ept:
            p = _slot(e, off_pv)
        v = <object>p if p is not NULL else e._pick_view
        # if v is None or v.kkey is not kkey: refresh
        if v is None:
            v = refresh(e, v, kkey, now)
        else:
            p = NULL
            if type(v) is vt:
                p = _slot(v, off_kkey)
            if p is not NULL:
                if p is not <PyObject *>kkey:
                    v = refresh(e, v, kkey, now)
            elif v.kkey is not kkey:
                v = refresh(e, v, kkey, now)
        fast = type(v) is vt
        # kco = v.kc; stamp = v.stamp
        p = NULL
        if fast:
            p = _slot(v, off_kc)
        kco = <object>p if p is not NULL else v.kc
        if kco is None:
            continue
        p = NULL
        if fast:
            p = _slot(v, off_stamp)
        if <Py_ssize_t>(<object>p if p is not NULL else v.stamp) >= base:
            continue
        if hook is not None and not hook(e, req, now):
            continue
        # v.stamp = slot (as member_set does for an object slot)
        stamp = slot
        if fast:
            sp = <PyObject **>((<char *><PyObject *>v) + off_stamp)
            p = sp[0]
            Py_INCREF(stamp)
            sp[0] = <PyObject *>stamp
            Py_XDECREF(p)
        else:
            v.stamp = stamp
        slot += 1
        kc = <tuple>kco
        j = (<double>kc[0] + lam * <double>kc[1]
             + dp * (<double>kc[2] + lam * <double>kc[3]) + dm * <double>kc[4])
        span = <double>kc[5]
        if dm > span:
            j += (dm - span) * <double>kc[6]
        free = <double>kc[7]
        if pm > free:
            j += (pm - free) * (<double>kc[8] * lam)
        if dm > 0.0:
            so = <double>kc[16]
            if dm < so:
                so = dm
            j += lam_d * (dm * <double>kc[12] + (dm + <double>kc[15] * so)
                          * (<double>kc[13] + <double>kc[14] * x))
        j += lam_i * <double>kc[15] * dp * <double>kc[3]
        cands.append((j, kc[11], v))
        load_sum += <double>kc[9]
        weight_sum += <double>kc[10]
    return cands, load_sum, weight_sum


ctypedef struct _Key:
    double j
    Py_ssize_t i


cdef void _insertion_sort(_Key *keys, Py_ssize_t n) noexcept nogil:
    """By J ascending: a binary insertion sort (a few dozen keys; no call per comparison,
    unlike qsort). Stable, though callers only rely on it for distinct keys."""
    cdef Py_ssize_t i, lo, hi, mid
    cdef _Key t
    for i in range(1, n):
        t = keys[i]
        if not keys[i - 1].j > t.j:
            continue
        lo = 0
        hi = i - 1
        while lo < hi:  # the first key > t.j in keys[0:i] (keys[i - 1] is one)
            mid = (lo + hi) >> 1
            if keys[mid].j > t.j:
                hi = mid
            else:
                lo = mid + 1
        memmove(&keys[lo + 1], &keys[lo], (i - lo) * sizeof(_Key))
        keys[lo] = t


def sort_candidates(list cands):
    """Sorts (J, name, view) tuples as list.sort() does. A tuple sort pays an equality
    test per comparison (9.4 us for 64 on the dev box); when every J is distinct (and not
    NaN) the names never decide, and the order is that of the J values alone. Up to 128
    candidates: sorted here as C doubles (an insertion sort of (J, index) pairs, then the
    list rebuilt in that order); more: list.sort by J (an insertion sort is quadratic).
    A tie, or a NaN, anywhere: the tuple sort of the input as it came (its order decides
    NaNs)."""
    cdef Py_ssize_t i, n = len(cands)
    cdef double a, b
    cdef _Key keys[128]
    if n < 2:
        return
    if n > 128:
        _sort_by_j(cands, n)
        return
    for i in range(n):
        a = <double>(<tuple>cands[i])[0]
        if a != a:  # NaN
            cands.sort()
            return
        keys[i].j = a
        keys[i].i = i
    _insertion_sort(keys, n)
    a = keys[0].j
    for i in range(1, n):
        b = keys[i].j
        if not a < b:  # a tie: the names decide
            cands.sort()
            return
        a = b
    before = cands[:]
    for i in range(n):
        cands[i] = before[keys[i].i]


cdef object _first = operator.itemgetter(0)


cdef void _sort_by_j(list cands, Py_ssize_t n) except *:
    """The large-pool path: list.sort by J, then the tuple sort if any J ties or is NaN."""
    cdef Py_ssize_t i
    cdef double a, b
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
