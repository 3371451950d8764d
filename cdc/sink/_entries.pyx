# cython: language_level=3, boundscheck=False, wraparound=False
"""`parse_reply` of `cdc.sink.entry`, compiled: a consumer's XREADGROUP reply as entries in one pass.

`cdc.sink.entry.parse_reply` is the specification; this gives the same entries
(tests/sink/test_compiled_entries.py compares them on generated replies). Whatever
this pass does not take in its stride (a field that is not plain decimal digits, an
entry the bridge did not write) goes to the specification, for the same result or the
same error.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem, PyDict_New, PyDict_SetItem
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.ref cimport PyObject, Py_INCREF

from .entry import Entry as _Entry, _UNREAD, parse_reply as _reference, reply_text as _reply_text


cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef *d_member
    int T_OBJECT_EX


cdef Py_ssize_t _offset(str name) except -1:
    """Where `Entry`'s slot `name` sits in an entry: its member descriptor's offset (checked to be an object slot)."""
    member = _Entry.__dict__[name]
    if type(member).__name__ != "member_descriptor" or (<PyMemberDescrObject *>member).d_member.type != T_OBJECT_EX:
        raise ImportError(f"Entry.{name} is not a slot this module can fill")
    return (<PyMemberDescrObject *>member).d_member.offset


# each slot of a new entry is written in place (13 attribute calls through Entry's frozen __setattr__ cost as
# much again as the rest of the parse); the slots of an entry just made are empty, so nothing is released
cdef Py_ssize_t _STREAM = _offset("stream"), _ID = _offset("id"), _OP_ = _offset("op"), _LSN_ = _offset("lsn")
cdef Py_ssize_t _SEQ_ = _offset("seq"), _XID_ = _offset("xid"), _TS_MS_ = _offset("ts_ms"), _V_ = _offset("v")
cdef Py_ssize_t _FIELDS = _offset("fields"), _KEY_ = _offset("_key"), _DATA_ = _offset("_data")
cdef Py_ssize_t _BEFORE_ = _offset("_before"), _UNCHANGED_ = _offset("_unchanged")
if sorted(_Entry.__slots__) != sorted(["stream", "id", "op", "lsn", "seq", "xid", "ts_ms", "v", "fields",
                                       "_key", "_data", "_before", "_unchanged"]):
    raise ImportError("Entry's slots changed: cdc.sink._entries fills the ones it knows")


cdef inline void _put(object entry, Py_ssize_t offset, object value):
    Py_INCREF(value)
    (<PyObject **>((<char *><PyObject *>entry) + offset))[0] = <PyObject *>value

__all__ = ["parse_reply"]  # the interface: _entries.pyi

cdef bytes _OP = b"op", _LSN = b"lsn", _SEQ = b"seq", _XID = b"xid", _TS_MS = b"ts_ms", _V = b"v"
cdef bytes _BEFORE = b"before", _UNCHANGED = b"unchanged"
cdef object _ZERO = 0, _ONE = 1
cdef dict _OPS = {op.encode(): op for op in ("c", "u", "d", "r", "t", "x", "m", "e", "s")}


class _Slow(Exception):
    """Not a value this pass reads itself: the specification reads the reply."""


cdef inline object _number(PyObject *raw, object default):
    """int(raw) for a bytes value of plain decimal digits (fewer than 19), else `_Slow`."""
    cdef Py_ssize_t n, i
    cdef const char *s
    cdef long long value = 0
    cdef char c
    if raw == NULL:
        return default
    if type(<object>raw) is not bytes:
        raise _Slow()
    n = PyBytes_GET_SIZE(<object>raw)
    if n == 0 or n > 18:
        raise _Slow()
    s = PyBytes_AS_STRING(<object>raw)
    for i in range(n):
        c = s[i]
        if c < 48 or c > 57:
            raise _Slow()
        value = value * 10 + (c - 48)
    return value


cdef object _new = object.__new__


cdef list _fast(object reply, list gone):
    cdef list out = []
    cdef list flat
    cdef Py_ssize_t i, n
    cdef dict fields
    cdef PyObject *raw
    cdef object name, entry_id, e, op, lsn, seq, xid, ts_ms, v
    for stream, items in (reply.items() if type(reply) is dict else reply):
        name = _reply_text(stream)
        for item in items:
            entry_id, flat_obj = item
            if not flat_obj:
                if gone is not None:
                    gone.append((name, _reply_text(entry_id)))
                continue
            if type(flat_obj) is not list:
                raise _Slow()
            flat = <list>flat_obj
            n = PyList_GET_SIZE(flat)
            if n & 1:
                raise _Slow()
            fields = PyDict_New()
            i = 0
            while i < n:
                PyDict_SetItem(fields, <object>PyList_GET_ITEM(flat, i), <object>PyList_GET_ITEM(flat, i + 1))
                i += 2
            raw = PyDict_GetItem(fields, _OP)
            if raw == NULL:
                raise _Slow()
            op = _OPS.get(<object>raw)
            if op is None:
                raise _Slow()
            raw = PyDict_GetItem(fields, _LSN)
            if raw == NULL:
                raise _Slow()
            lsn = _number(raw, None)
            raw = PyDict_GetItem(fields, _SEQ)
            if raw == NULL:
                raise _Slow()
            seq = _number(raw, None)
            xid = _number(PyDict_GetItem(fields, _XID), _ZERO)
            ts_ms = _number(PyDict_GetItem(fields, _TS_MS), _ZERO)
            v = _number(PyDict_GetItem(fields, _V), _ONE)
            e = _new(_Entry)
            _put(e, _STREAM, name)
            _put(e, _ID, entry_id.decode() if type(entry_id) is bytes else entry_id)
            _put(e, _OP_, op)
            _put(e, _KEY_, _UNREAD)
            _put(e, _DATA_, _UNREAD)
            _put(e, _BEFORE_, _UNREAD if PyDict_GetItem(fields, _BEFORE) != NULL else None)
            _put(e, _UNCHANGED_, _UNREAD if PyDict_GetItem(fields, _UNCHANGED) != NULL else ())
            _put(e, _LSN_, lsn)
            _put(e, _SEQ_, seq)
            _put(e, _XID_, xid)
            _put(e, _TS_MS_, ts_ms)
            _put(e, _V_, v)
            _put(e, _FIELDS, fields)
            out.append(e)
    return out


def parse_reply(reply, gone=None):
    """`cdc.sink.entry.parse_reply`, compiled."""
    if not reply:
        return []
    cdef Py_ssize_t had = len(gone) if gone is not None else 0
    try:
        return _fast(reply, gone)
    except (_Slow, ValueError, TypeError, UnicodeDecodeError, AttributeError, KeyError):
        if gone is not None:
            del gone[had:]
        return _reference(reply, gone)
