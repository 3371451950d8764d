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
from cpython.ref cimport PyObject

from .entry import Entry as _Entry, _Building, _UNREAD, parse_reply as _reference, reply_text as _reply_text

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


cdef list _fast(object reply, list gone):
    cdef list out = []
    cdef list flat
    cdef Py_ssize_t i, n
    cdef dict fields
    cdef PyObject *raw
    cdef object name, entry_id, e, op
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
            e = _Building()
            e.stream = name
            e.id = entry_id.decode() if type(entry_id) is bytes else entry_id
            e.op = op
            e._key = _UNREAD
            e._data = _UNREAD
            e._before = _UNREAD if PyDict_GetItem(fields, _BEFORE) != NULL else None
            e._unchanged = _UNREAD if PyDict_GetItem(fields, _UNCHANGED) != NULL else ()
            raw = PyDict_GetItem(fields, _LSN)
            if raw == NULL:
                raise _Slow()
            e.lsn = _number(raw, None)
            raw = PyDict_GetItem(fields, _SEQ)
            if raw == NULL:
                raise _Slow()
            e.seq = _number(raw, None)
            e.xid = _number(PyDict_GetItem(fields, _XID), _ZERO)
            e.ts_ms = _number(PyDict_GetItem(fields, _TS_MS), _ZERO)
            e.v = _number(PyDict_GetItem(fields, _V), _ONE)
            e.fields = fields
            e.__class__ = _Entry
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
