# An object's __slots__ read and written through their byte offsets (the PyMemberDef
# behind each slot's descriptor), for the compiled twins that build or update slotted
# classes with no attribute lookup: filters/_endpoint_state_c.pyx, filters/_picker_c.pyx,
# filters/_cost_ledger_c.pyx, xds/_engine_report_c.pyx, xds/_delta_response_c.pyx,
# xds/_feed_c.pyx. Inline only, so nothing of it is imported at run time; in filters/
# because xds/ may use filters/ and not the other way round.
#
# An offset is valid for instances of exactly the class it was found on (a subclass may
# add slots but keeps these); the callers check `type(o) is cls` before reading one.

from cpython.object cimport PyObject, PyTypeObject, Py_TYPE
from cpython.ref cimport Py_INCREF, Py_XDECREF

cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        const char *name
        int type
        Py_ssize_t offset
        int flags
    ctypedef struct PyMemberDescrObject:
        PyMemberDef *d_member
    PyTypeObject PyMemberDescr_Type  # types.MemberDescriptorType

cdef extern from "structmember.h":
    int T_OBJECT_EX
    int READONLY


cdef inline Py_ssize_t slot_offset(type cls, str name, bint writable) except -2:
    """The byte offset of `name`'s slot in instances of `cls` (the first class along its
    MRO that defines `name`), or -1 where that is not a plain object slot (T_OBJECT_EX:
    unset reads as NULL), or, `writable`, is a read-only one."""
    d = None
    for k in cls.__mro__:
        if name in k.__dict__:
            d = k.__dict__[name]
            break
    if d is None or Py_TYPE(d) is not &PyMemberDescr_Type:
        return -1
    cdef PyMemberDef *m = (<PyMemberDescrObject *>d).d_member
    if m.type != T_OBJECT_EX or (writable and (m.flags & READONLY)):
        return -1
    return m.offset


cdef inline PyObject *slot(object o, Py_ssize_t off) noexcept:
    """The slot's value, borrowed (NULL: unset)."""
    return (<PyObject **>((<char *><PyObject *>o) + off))[0]


cdef inline void store(object o, Py_ssize_t off, object value) noexcept:
    """`value` into the slot, the value it held released after (its release may run code:
    the slot already holds the new one then)."""
    cdef PyObject **p = <PyObject **>((<char *><PyObject *>o) + off)
    cdef PyObject *old = p[0]
    Py_INCREF(value)
    p[0] = <PyObject *>value
    Py_XDECREF(old)


cdef inline void store_new(object o, Py_ssize_t off, object value) noexcept:
    """`value` into a slot of an object just allocated (NULL: nothing to release)."""
    Py_INCREF(value)
    (<PyObject **>((<char *><PyObject *>o) + off))[0] = <PyObject *>value
