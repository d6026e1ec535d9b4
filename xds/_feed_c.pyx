# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of meshd/control_feed.py's `land_reports`: a response's EngineReports
handed to their endpoints' routers, the loop in C. Per update: the Entry's value, the
report's address and state and the held state's epoch read through their slots, the three
dict lookups that say the engine is ours, at the same address, in the same epoch, and the
routers' `report(url, state, now, ttl_s=...)` called with vectorcall (no argument tuple or
keyword dict); anything else goes to `on_state`, as in the reference. Import through
meshd.control_feed.

What it speeds up: a sidecar following the control plane runs this loop once an update
(10,000 a second at 1,000 engines at 10 Hz). With EndpointState.report compiled
(filters/_endpoint_state_c.pyx), the sidecar's apply of an update into its routers (what
follows read_response: loadtest/xds_apply_bench.py's sidecar set-up in process, responses
of 200, callgrind) 7,328 -> 3,809 instructions. A router that is exactly a PickerRouter
(filters/pool_router.py) has its report's common path taken here with no Python frame
(_picker_common: a known url, a fresh held report, the same TTL and KV sizes -> only the
endpoint's report; bind_picker), the method the reference for anything else: this loop's
marginal instructions an update (callgrind, land_reports toggled) 4,448 -> 2,679. There
EndpointState.report, where it is the compiled one (filters/_endpoint_state_c.pyx) and
still the class's, is called in C (report_c, through filters/_endpoint_state_c.pxd) with
no method lookup or call, and a KV size that is the held one's object taken as equal with
no comparison: the whole in-process apply 9,694 -> 9,484 instructions an update.
tests/test_control_feed_land.py and tests/test_pool_router_report_c.py check they agree.
"""

from cpython.object cimport PyObject

from filters._slots cimport slot as _slot, slot_offset as _slot_offset

from filters._endpoint_state_c cimport report_c as _endpoint_report

__all__ = ["bind", "bind_picker", "common_path_count", "land_reports", "picker_report"]


cdef extern from "Python.h":
    PyObject *PyDict_GetItemWithError(object d, object key) except? NULL
    bint PyLong_CheckExact(PyObject *o)
    bint PyUnicode_CheckExact(PyObject *o)
    object PyObject_Vectorcall(object callable, PyObject **args, size_t nargsf, object kwnames)
    size_t PY_VECTORCALL_ARGUMENTS_OFFSET
    bint PyFloat_CheckExact(PyObject *o)
    double PyFloat_AS_DOUBLE(PyObject *o)
    bint PyMethod_Check(PyObject *o)
    PyObject *PyMethod_GET_FUNCTION(PyObject *o)
    PyObject *PyMethod_GET_SELF(PyObject *o)
    long long PyLong_AsLongLongAndOverflow(PyObject *o, int *overflow) except? -1
    PyObject *Py_None
    PyObject *_PyType_Lookup(type t, object name)


cdef type _entry_type = None
cdef type _report_type = None
cdef type _state_type = None
cdef Py_ssize_t _off_value = -1, _off_address = -1, _off_state = -1, _off_epoch = -1
cdef tuple _KWNAMES = ("ttl_s",)
# PickerRouter.report's common path (bind_picker): the router's type, its report function
# (the reference, filters/pool_router.py), EndpointState and the slots read and compared.
cdef type _picker_type = None
cdef object _picker_report = None
cdef type _ep_type = None
cdef Py_ssize_t _off_reported = -1, _off_reported_at = -1, _off_ttl = -1
cdef Py_ssize_t _off_block = -1, _off_blocks = -1
cdef Py_ssize_t _common = 0  # reports landed through the common path (common_path_count)
# filters/_endpoint_state_c.pyx's `report` where it is EndpointState's (bind_picker): then
# called in C (report_c) while the class still has it, else through the method.
cdef object _compiled_report = None
cdef str _REPORT = "report"


def bind(entry_type, report_type, state_type):
    """Give the module Entry, EngineReport and ReportedState: their slots are read
    directly (else through getattr). EngineReport is the type of report it lands (an
    Entry whose value is of another type is skipped, as in the reference)."""
    global _entry_type, _report_type, _state_type
    global _off_value, _off_address, _off_state, _off_epoch
    _report_type = report_type
    _entry_type = _state_type = None
    for cls in (entry_type, report_type, state_type):
        if cls.__getattribute__ is not object.__getattribute__:
            return False
    _off_value = _slot_offset(entry_type, "value", False)
    _off_address = _slot_offset(report_type, "address", False)
    _off_state = _slot_offset(report_type, "state", False)
    _off_epoch = _slot_offset(state_type, "epoch", False)
    if min(_off_value, _off_address, _off_state, _off_epoch) < 0:
        return False
    _entry_type, _state_type = entry_type, state_type
    return True


def bind_picker(picker_type, report_function, endpoint_type):
    """Give the module PickerRouter, its `report` function (the reference) and
    EndpointState (after `bind`): a router's bound `report` that is exactly that function
    on exactly that type has its common path taken here (_picker_common); returns whether
    it is (else every report goes to the method)."""
    global _picker_type, _picker_report, _ep_type, _compiled_report
    global _off_reported, _off_reported_at, _off_ttl, _off_block, _off_blocks
    _picker_type = None
    if _state_type is None:
        return False
    for cls in (picker_type, endpoint_type):
        if cls.__getattribute__ is not object.__getattribute__:
            return False
    _off_reported = _slot_offset(endpoint_type, "reported", False)
    _off_reported_at = _slot_offset(endpoint_type, "reported_at", False)
    _off_ttl = _slot_offset(endpoint_type, "report_ttl_s", False)
    _off_block = _slot_offset(_state_type, "kv_block_size", False)
    _off_blocks = _slot_offset(_state_type, "kv_capacity_blocks", False)
    if min(_off_reported, _off_reported_at, _off_ttl, _off_block, _off_blocks) < 0:
        return False
    _picker_report, _ep_type = report_function, endpoint_type
    from filters import _endpoint_state_c

    # Its report landed in C only where no instance can have a `report` of its own.
    _compiled_report = None
    if endpoint_type.__dictoffset__ == 0:
        _compiled_report = _endpoint_state_c.report
    _picker_type = picker_type
    return True


def common_path_count():
    """How many reports landed through PickerRouter.report's common path here."""
    return _common


cdef inline int _same_size(PyObject *a, PyObject *b) except -1:
    """1: `a != b` is False for these (both None, or equal exact ints); 0: anything else
    (unequal, or of a type whose comparison is left to the reference)."""
    if a == NULL or b == NULL:
        return 0
    if a == Py_None and b == Py_None:
        return 1
    if a == b and PyLong_CheckExact(a):
        return 1  # one int (the decoder gives an unchanged size as the held one's object)
    if PyLong_CheckExact(a) and PyLong_CheckExact(b):
        return (<object>a) == (<object>b)
    return 0


cdef int _picker_common(object router, object url, object state, object now, object ttl_s) except -1:
    """PickerRouter.report(url, state, now, ttl_s=ttl_s)'s common path, as the reference
    takes it: a known url, a report that is not the held one's object, the held one fresh,
    the same TTL, the same KV block size and capacity (nothing for kv_version): the state
    stored by s.report(state, now). 1: done so (the method returns True); 0: not that path,
    nothing read that runs code or changed (the caller calls the method)."""
    global _common
    cdef PyObject *found
    cdef PyObject *before
    cdef PyObject *at
    cdef PyObject *held_ttl
    cdef double ttl
    cdef long long small
    cdef int overflow = 0
    if type(state) is not _state_type or not PyUnicode_CheckExact(<PyObject *>url):
        return 0
    if not PyFloat_CheckExact(<PyObject *>now):
        return 0
    by_url = router._by_url
    if type(by_url) is not dict:
        return 0
    found = PyDict_GetItemWithError(by_url, url)
    if found == NULL or type(<object>found) is not _ep_type:
        return 0
    s = <object>found
    before = _slot(s, _off_reported)
    if before == NULL or before == <PyObject *>state or type(<object>before) is not _state_type:
        return 0
    at = _slot(s, _off_reported_at)
    held_ttl = _slot(s, _off_ttl)
    if at == NULL or held_ttl == NULL or not PyFloat_CheckExact(at):
        return 0
    # `s.report_ttl_s != ttl_s` False: equal floats, or the same int (an int TTL is
    # stored as given), compared in doubles only while that is exact.
    if PyFloat_CheckExact(held_ttl) and PyFloat_CheckExact(<PyObject *>ttl_s):
        ttl = PyFloat_AS_DOUBLE(held_ttl)
        if not (ttl == PyFloat_AS_DOUBLE(<PyObject *>ttl_s)):
            return 0
    elif held_ttl == <PyObject *>ttl_s and PyLong_CheckExact(held_ttl):
        small = PyLong_AsLongLongAndOverflow(held_ttl, &overflow)
        if overflow or small > 9007199254740992LL or small < -9007199254740992LL:
            return 0
        ttl = <double>small
    else:
        return 0
    # `now - s.reported_at >= s.report_ttl_s`: gone stale (kv_version moves).
    if PyFloat_AS_DOUBLE(<PyObject *>now) - PyFloat_AS_DOUBLE(at) >= ttl:
        return 0
    if not _same_size(_slot(<object>before, _off_block), _slot(state, _off_block)):
        return 0
    if not _same_size(_slot(<object>before, _off_blocks), _slot(state, _off_blocks)):
        return 0
    # s.report(state, now): the compiled one called in C while it is the class's.
    if _compiled_report is not None and _PyType_Lookup(_ep_type, _REPORT) == <PyObject *>_compiled_report:
        _endpoint_report(s, state, now)
    else:
        s.report(state, now)
    _common += 1
    return 1


cdef inline int _is_picker_report(object tell) noexcept:
    cdef PyObject *t = <PyObject *>tell
    return (
        _picker_type is not None
        and PyMethod_Check(t)
        and PyMethod_GET_FUNCTION(t) == <PyObject *>_picker_report
        and type(<object>PyMethod_GET_SELF(t)) is _picker_type
    )


def picker_report(tell, url, state, now, ttl_s):
    """`tell(url, state, now, ttl_s=ttl_s)` as land_reports makes it: a PickerRouter's
    report through its common path here when it is that path, else the call."""
    if _is_picker_report(tell) and _picker_common(
        <object>PyMethod_GET_SELF(<PyObject *>tell), url, state, now, ttl_s
    ):
        return True
    return tell(url, state, now, ttl_s=ttl_s)


cdef inline object _value(object entry):
    cdef PyObject *p
    if type(entry) is _entry_type:
        p = _slot(entry, _off_value)
        if p != NULL:
            return <object>p
    return entry.value


cdef inline object _address(object report):
    cdef PyObject *p
    if _state_type is not None:  # bound: `report` is exactly _report_type here
        p = _slot(report, _off_address)
        if p != NULL:
            return <object>p
    return report.address


cdef inline object _state(object report):
    cdef PyObject *p
    if _state_type is not None:
        p = _slot(report, _off_state)
        if p != NULL:
            return <object>p
    return report.state


cdef inline object _epoch(object state):
    cdef PyObject *p
    if type(state) is _state_type:
        p = _slot(state, _off_epoch)
        if p != NULL:
            return <object>p
    return state.epoch


def land_reports(changed, dict engines, dict reports, dict by_address, now, ttl_s, on_state):
    """meshd.control_feed.land_reports: the same calls in the same order, the same count
    returned."""
    cdef Py_ssize_t applied = 0, i, n
    cdef PyObject *found
    cdef PyObject *args[5]
    cdef tuple ts
    if _report_type is None:
        raise RuntimeError("not bound: import meshd.control_feed")
    args[0] = NULL  # PY_VECTORCALL_ARGUMENTS_OFFSET: the callee may use it
    args[3] = <PyObject *>now
    args[4] = <PyObject *>ttl_s
    for name, entry in changed.items():
        report = _value(entry)
        if type(report) is not _report_type:
            continue
        found = PyDict_GetItemWithError(engines, name)
        state = _state(report)
        if found == NULL:
            on_state(name, report, now)
            continue
        targets = <object>found
        if PyDict_GetItemWithError(by_address, _address(report)) != found:
            on_state(name, report, now)
            continue
        held = reports[name]
        was = _epoch(held)
        epoch = _epoch(state)
        # One object (the decoder gives an unchanged epoch as the held one's): equal, for
        # the str and int epochs are; else compared as the reference does.
        if not (
            was is epoch and (PyUnicode_CheckExact(<PyObject *>was) or PyLong_CheckExact(<PyObject *>was))
        ) and was != epoch:
            on_state(name, report, now)
            continue
        reports[name] = state
        args[2] = <PyObject *>state
        if type(targets) is tuple:
            ts = <tuple>targets
            n = len(ts)
            for i in range(n):
                target = ts[i]
                if type(target) is tuple and len(<tuple>target) == 3:
                    url = (<tuple>target)[1]
                    tell = (<tuple>target)[2]
                else:
                    _, url, tell = target
                if _is_picker_report(tell) and _picker_common(
                    <object>PyMethod_GET_SELF(<PyObject *>tell), url, state, now, ttl_s
                ):
                    continue
                args[1] = <PyObject *>url
                PyObject_Vectorcall(
                    tell, &args[1], 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, _KWNAMES
                )
        else:
            for _, url, tell in targets:
                if _is_picker_report(tell) and _picker_common(
                    <object>PyMethod_GET_SELF(<PyObject *>tell), url, state, now, ttl_s
                ):
                    continue
                args[1] = <PyObject *>url
                PyObject_Vectorcall(
                    tell, &args[1], 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, _KWNAMES
                )
        applied += 1
    return applied
