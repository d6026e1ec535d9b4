# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of filters/endpoint_state.py's `EndpointState.report` (the reference,
`report_reference` there): an engine's report landing on its endpoint, the fields stored
through their slots in C instead of a Python frame's attribute stores. Bound as the
method itself (`bind`), so a router's `s.report(state, now)` calls it with no Python
frame; an instance that is not exactly EndpointState, or a report that is not exactly
ReportedState, goes to the reference.

What it speeds up: a sidecar following the control plane lands every engine update here
(meshd/control_feed.py -> PickerRouter.report -> this), 10,000 a second at 1,000 engines
at 10 Hz. One report landing on an endpoint of a sidecar's pools (the routers
loadtest/xds_apply_bench.py builds), caches warm: 540 -> 170 ns (timeit), ~3,200 -> ~1,100
instructions (callgrind) with the caller's call; the router's whole `report` 840 -> 470
ns. What goes is the Python frame, the epoch checks' comparisons of a str with "" and 0
(an unchanged epoch is the held one's object: the decoder gives it so) and `_changed`'s
call. tests/test_endpoint_state_report.py checks that the two leave every field the same.
"""

from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF

from filters._slots cimport slot as _slot, slot_offset as _slot_offset, store as _store

__all__ = ["bind", "report"]


cdef extern from "Python.h":
    bint PyLong_CheckExact(PyObject *o)
    bint PyUnicode_CheckExact(PyObject *o)
    Py_ssize_t PyUnicode_GET_LENGTH(PyObject *o)
    int _PyLong_Sign(PyObject *o)
    PyObject *Py_None


# EndpointState's slots this touches, and ReportedState's epoch.
cdef enum:
    S_REPORTED, S_REPORTED_AT, S_TOKENS_AT_REPORT, S_OUTPUTS_AT_REPORT, S_TOKENS,
    S_OUTPUTS, S_VERSION, S_STATIC_VERSION, S_PICK_VIEW, S_PICK_STALE, S_TTFT_RATIO,
    S_DECODE_RATIO, S_TTFT_SAMPLED, S_DECODE_SAMPLED, N_SLOTS

_SLOT_NAMES = (
    "reported", "reported_at", "tokens_at_report", "outputs_at_report", "tokens_in_flight",
    "output_tokens_in_flight", "version", "static_version", "_pick_view", "_pick_stale",
    "ttft_ratio", "decode_ratio", "ttft_sampled", "decode_sampled",
)
cdef Py_ssize_t _off[N_SLOTS]
cdef Py_ssize_t _off_epoch = -1
cdef type _ep_type = None
cdef type _rs_type = None
cdef object _reference = None
cdef object _UNSET = ("", 0)


def bind(endpoint_type, reported_type, reference):
    """Give the module EndpointState, ReportedState and the reference `report`; returns
    whether `report` lands reports through the slots (else it is the reference's
    caller for every instance, and the method should stay the reference)."""
    global _ep_type, _rs_type, _reference, _off_epoch
    _ep_type = _rs_type = None
    _reference = reference
    for cls in (endpoint_type, reported_type):
        if cls.__getattribute__ is not object.__getattribute__:
            return False
    if endpoint_type.__setattr__ is not object.__setattr__:
        return False
    for i, name in enumerate(_SLOT_NAMES):
        _off[i] = _slot_offset(endpoint_type, name, True)
        if _off[i] < 0:
            return False
    # ReportedState is frozen (its __setattr__ raises): its slot is only read here.
    _off_epoch = _slot_offset(reported_type, "epoch", True)
    if _off_epoch < 0:
        return False
    _ep_type, _rs_type = endpoint_type, reported_type
    return True


cdef inline int _unset(PyObject *epoch) except -1:
    """`epoch in ("", 0)`: an epoch that says nothing."""
    if PyUnicode_CheckExact(epoch):
        return PyUnicode_GET_LENGTH(epoch) == 0
    if PyLong_CheckExact(epoch):
        return _PyLong_Sign(epoch) == 0
    return <object>epoch in _UNSET


def report(self, state, now):
    """EndpointState.report(state, now): what the reference does, for an exact
    EndpointState given an exact ReportedState (anything else goes to the reference)."""
    return report_c(self, state, now)


cdef object report_c(object self, object state, object now):
    """`report` for C callers (filters/_endpoint_state_c.pxd): xds/_feed_c.pyx lands a
    report with no method lookup or call of `report` where EndpointState's `report` is
    this module's."""
    cdef PyObject *before
    cdef PyObject *was
    cdef PyObject *epoch
    cdef PyObject *p
    cdef int k
    cdef bint restart = False
    if type(self) is not _ep_type or type(state) is not _rs_type:
        return _reference(self, state, now)
    for k in range(N_SLOTS):
        if _slot(self, _off[k]) == NULL:
            return _reference(self, state, now)  # a slot unset: its AttributeError
    if not (
        PyLong_CheckExact(_slot(self, _off[S_VERSION]))
        and PyLong_CheckExact(_slot(self, _off[S_STATIC_VERSION]))
    ):
        return _reference(self, state, now)
    before = _slot(self, _off[S_REPORTED])
    if before != Py_None:
        if type(<object>before) is not _rs_type:
            return _reference(self, state, now)
        was = _slot(<object>before, _off_epoch)
        epoch = _slot(state, _off_epoch)
        if was == NULL or epoch == NULL:
            return _reference(self, state, now)
        # The same object (the decoder gives an unchanged epoch as the held one's): the
        # same epoch, for the str and int epochs are; the reference's order otherwise.
        if not (
            was == epoch and (PyUnicode_CheckExact(was) or PyLong_CheckExact(was))
        ):
            restart = (
                not _unset(was) and not _unset(epoch) and (<object>was != <object>epoch)
            )
    # Everything that can raise is done: the stores below cannot.
    version = <object>_slot(self, _off[S_VERSION]) + 1
    static_version = <object>_slot(self, _off[S_STATIC_VERSION]) + 1
    if restart:
        # A restart: perhaps on another node, another GPU; what was learnt of its speed
        # is learnt again.
        _store(self, _off[S_TTFT_RATIO], 1.0)
        _store(self, _off[S_DECODE_RATIO], 1.0)
        _store(self, _off[S_TTFT_SAMPLED], None)
        _store(self, _off[S_DECODE_SAMPLED], None)
    # `before` may go with this store: not read after it.
    _store(self, _off[S_REPORTED], state)
    _store(self, _off[S_REPORTED_AT], now)
    _store(self, _off[S_TOKENS_AT_REPORT], <object>_slot(self, _off[S_TOKENS]))
    _store(self, _off[S_OUTPUTS_AT_REPORT], <object>_slot(self, _off[S_OUTPUTS]))
    # _changed(): the version, and the picker's view to its stale place.
    _store(self, _off[S_VERSION], version)
    p = _slot(self, _off[S_PICK_VIEW])
    if p != Py_None:
        _store(self, _off[S_PICK_STALE], <object>p)
        _store(self, _off[S_PICK_VIEW], None)
    _store(self, _off[S_STATIC_VERSION], static_version)
