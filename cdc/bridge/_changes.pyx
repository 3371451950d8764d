# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""The per-change work, compiled: `route_raw` of `cdc.bridge.changes`, from the message's bytes to its entries.

`cdc.bridge.changes` is the specification; this module must give the same entries,
byte for byte (tests/bridge/test_compiled.py feeds both the same generated
messages and mappings). It reads the change's tuples straight from the message
bytes and writes the entry's JSON without building the row's Python values.

A change it does not handle exactly as written here goes to the reference
instead, before anything is queued: an open backfill window, a streamed block,
an unexpected byte, a binary value, invalid UTF-8, a key field missing from the
row. Per column it writes the common types itself (integers, floats in plain
decimal form, booleans, timestamps, text, json); any other value goes through
the field's own Python converter and `orjson.dumps`, as the reference does.
"""

from cpython.buffer cimport PyBuffer_IsContiguous
from cpython.memoryview cimport PyMemoryView_GET_BUFFER
from cpython.object cimport PyObject
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_GET_SIZE, PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF
from cpython.unicode cimport (PyUnicode_1BYTE_DATA, PyUnicode_AsUTF8AndSize, PyUnicode_DecodeASCII, PyUnicode_DecodeUTF8,
                              PyUnicode_New)
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from ..sink._resp cimport Packed, pack_args

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void *op)

# libpq's PQgetCopyData and PQfreemem, called at the addresses `ReplicationStream.copy_reader` gives
ctypedef int (*_GetCopyData)(void *conn, char **buffer, int async_) noexcept nogil
ctypedef void (*_FreeMem)(void *ptr) noexcept nogil

import zlib

import orjson
from psycopg import Error as _PgError

from ..source import values as _values_module
from ..source.framing import PG_EPOCH_UNIX_US
from ..source.lsn import Lsn as _Lsn

__all__ = ["route_raw", "burst", "refusal"]  # the interface: _changes.pyi

cdef object _dumps = orjson.dumps
cdef object _crc32 = zlib.crc32


cdef object _reference(kind, raw, offset, targets, tx, batcher, windows, decoder):
    """`cdc.bridge.changes.route_raw`, the specification, for the changes this module does not take
    (imported late: that module imports this one)."""
    from .changes import route_raw
    return route_raw(kind, raw, offset, targets, tx, batcher, windows, decoder)


cdef inline unsigned long long _u64(const unsigned char *p) noexcept:
    cdef unsigned long long v = 0
    cdef int i
    for i in range(8):
        v = (v << 8) | p[i]
    return v


cdef inline unsigned long _u32(const unsigned char *p) noexcept:
    return (<unsigned long>p[0] << 24) | (<unsigned long>p[1] << 16) | (<unsigned long>p[2] << 8) | p[3]

cdef enum:
    INSERT = 0x49  # 'I'
    UPDATE = 0x55  # 'U'
    DELETE = 0x44  # 'D'
    BEGIN = 0x42  # 'B'
    COMMIT = 0x43  # 'C'
    C_NULL = 0x6E  # a column's kind in a tuple: 'n'
    C_TEXT = 0x74  # 't'
    C_TOAST = 0x75  # 'u', unchanged TOAST
    _NOT_HANDLED = -2  # `Row.read`: the reference must take the change

# how a mapped field's value is written
cdef enum:
    K_INT, K_FLOAT, K_BOOL, K_TIMESTAMP, K_TIMESTAMPTZ, K_TEXT, K_JSON, K_GENERIC


# -- an output buffer ------------------------------------------------------------------------

cdef struct Buf:
    char *data
    Py_ssize_t size
    Py_ssize_t cap

cdef Buf _out
_out.data = <char *>malloc(4096)
_out.size = 0
_out.cap = 4096
if _out.data == NULL:
    raise MemoryError()


cdef inline int _reserve(Py_ssize_t n) except -1:
    cdef Py_ssize_t want = _out.size + n
    cdef Py_ssize_t cap
    cdef char *grown
    if want <= _out.cap:
        return 0
    cap = _out.cap * 2
    while cap < want:
        cap *= 2
    grown = <char *>realloc(_out.data, cap)
    if grown == NULL:
        raise MemoryError()
    _out.data = grown
    _out.cap = cap
    return 0


cdef inline int _put(const char *src, Py_ssize_t n) except -1:
    _reserve(n)
    memcpy(_out.data + _out.size, src, n)
    _out.size += n
    return 0


cdef inline int _putc(char c) except -1:
    _reserve(1)
    _out.data[_out.size] = c
    _out.size += 1
    return 0


cdef inline int _put_bytes(bytes b) except -1:
    return _put(PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))


cdef inline bytes _take(Py_ssize_t start):
    """The bytes written since `start`, as a bytes object; the buffer goes back to `start`."""
    cdef bytes b = PyBytes_FromStringAndSize(_out.data + start, _out.size - start)
    _out.size = start
    return b


# -- UTF-8 and JSON strings -------------------------------------------------------------------

cdef inline bint _ascii(const unsigned char *p, Py_ssize_t n) noexcept:
    cdef Py_ssize_t i
    for i in range(n):
        if p[i] >= 0x80:
            return False
    return True


cdef bint _valid_utf8(const char *p, Py_ssize_t n):
    """True when the bytes decode as UTF-8 the way Python's strict decoder accepts them."""
    if _ascii(<const unsigned char *>p, n):
        return True
    try:
        PyUnicode_DecodeUTF8(p, n, b"strict")
    except UnicodeDecodeError:
        return False
    return True


cdef inline bint _plain_ascii(const char *p, Py_ssize_t n) noexcept:
    """Printable ASCII that a JSON string holds unescaped."""
    cdef Py_ssize_t i
    cdef unsigned char c
    for i in range(n):
        c = <unsigned char>p[i]
        if c < 0x20 or c >= 0x7F or c == 0x22 or c == 0x5C:
            return False
    return True


cdef const char *_HEX = b"0123456789abcdef"


cdef int _json_string(const char *p, Py_ssize_t n) except -1:
    """`p` (valid UTF-8) as a JSON string, escaped as orjson escapes."""
    cdef Py_ssize_t i, run = 0
    cdef unsigned char c
    _reserve(n + 2)
    _out.data[_out.size] = b'"'
    _out.size += 1
    for i in range(n):
        c = <unsigned char>p[i]
        if c >= 0x20 and c != 0x22 and c != 0x5C:
            continue
        _put(p + run, i - run)
        run = i + 1
        if c == 0x22:
            _put(b'\\"', 2)
        elif c == 0x5C:
            _put(b'\\\\', 2)
        elif c == 0x08:
            _put(b'\\b', 2)
        elif c == 0x09:
            _put(b'\\t', 2)
        elif c == 0x0A:
            _put(b'\\n', 2)
        elif c == 0x0C:
            _put(b'\\f', 2)
        elif c == 0x0D:
            _put(b'\\r', 2)
        else:
            _reserve(6)
            memcpy(_out.data + _out.size, b"\\u00", 4)
            _out.data[_out.size + 4] = _HEX[c >> 4]
            _out.data[_out.size + 5] = _HEX[c & 15]
            _out.size += 6
    _put(p + run, n - run)
    _putc(b'"')
    return 0


# -- numbers in the form orjson writes them ------------------------------------------------------

cdef inline bint _is_digit(char c) noexcept:
    return b'0' <= c <= b'9'


cdef bint _plain_integer(const char *p, Py_ssize_t n) noexcept:
    """`-?(0|[1-9][0-9]*)`, not '-0', at most 18 digits: int(text) prints as the text."""
    cdef Py_ssize_t i = 0
    if n and p[0] == b'-':
        i = 1
    if i >= n or n - i > 18:
        return False
    if p[i] == b'0':
        return n == 1  # '0' alone ('-0' and leading zeros print otherwise)
    while i < n:
        if not _is_digit(p[i]):
            return False
        i += 1
    return True


cdef bint _plain_float(const char *p, Py_ssize_t n, bint *integral) noexcept:
    """A float text that orjson writes back as itself (plus '.0' when `integral`).

    `-?(0|[1-9][0-9]*)(\\.[0-9]*[1-9])?` with at most 15 significant digits (so the
    text is the shortest form of its double), at least 1e-5 and below 1e16 (the
    range orjson writes without an exponent), or zero.
    """
    cdef Py_ssize_t i = 0, int_digits = 0, zeros = 0, significant = 0, dot = -1
    cdef bint leading = True
    if n and p[0] == b'-':
        i = 1
    if i >= n or not _is_digit(p[i]):
        return False
    if p[i] == b'0' and i + 1 < n and p[i + 1] != b'.':
        return False  # leading zero
    while i < n and _is_digit(p[i]):
        int_digits += 1
        if leading and p[i] == b'0':
            pass
        else:
            leading = False
            significant += 1
        i += 1
    if i < n:
        if p[i] != b'.':
            return False
        dot = i
        i += 1
        if i >= n or p[n - 1] == b'0':
            return False  # '1.' or a trailing zero: not the shortest form
        while i < n:
            if not _is_digit(p[i]):
                return False
            if leading:
                if p[i] == b'0':
                    zeros += 1
                else:
                    leading = False
                    significant += 1
            else:
                significant += 1
            i += 1
    if significant > 15 or int_digits > 16:
        return False
    if significant and int_digits == 1 and p[n - 1 if dot < 0 else dot - 1] == b'0' and zeros > 4:
        return False  # below 1e-5: orjson writes an exponent
    integral[0] = dot < 0
    return True


# -- tuples ------------------------------------------------------------------------------------

cdef class Row:
    """One TupleData read in place: per column its kind and the span of its text in the message."""

    cdef int count
    cdef int cap
    cdef unsigned char *kinds
    cdef Py_ssize_t *starts
    cdef Py_ssize_t *sizes

    def __cinit__(self):
        self.cap = 0
        self.count = 0
        self._grow(64)

    def __dealloc__(self):
        free(self.kinds)
        free(self.starts)
        free(self.sizes)

    cdef int _grow(self, int cap) except -1:
        cdef unsigned char *k = <unsigned char *>realloc(self.kinds, cap)
        if k == NULL:
            raise MemoryError()
        self.kinds = k
        cdef Py_ssize_t *s = <Py_ssize_t *>realloc(self.starts, cap * sizeof(Py_ssize_t))
        if s == NULL:
            raise MemoryError()
        self.starts = s
        s = <Py_ssize_t *>realloc(self.sizes, cap * sizeof(Py_ssize_t))
        if s == NULL:
            raise MemoryError()
        self.sizes = s
        self.cap = cap
        return 0

    cdef Py_ssize_t read(self, const unsigned char *data, Py_ssize_t off, Py_ssize_t have) except -3:
        """Read TupleData at `off`; the offset past it, or _NOT_HANDLED for anything unusual."""
        cdef int ncols, i
        cdef unsigned char kind
        cdef Py_ssize_t size
        if off + 2 > have:
            return _NOT_HANDLED
        ncols = (data[off] << 8) | data[off + 1]
        off += 2
        if ncols > self.cap:
            self._grow(ncols)
        for i in range(ncols):
            if off >= have:
                return _NOT_HANDLED
            kind = data[off]
            if kind == C_TEXT:
                if off + 5 > have:
                    return _NOT_HANDLED
                size = _u32(data + off + 1)
                off += 5
                if off + size > have:
                    return _NOT_HANDLED
                if not _valid_utf8(<const char *>data + off, size):
                    return _NOT_HANDLED
                self.starts[i] = off
                self.sizes[i] = size
                off += size
            elif kind == C_NULL or kind == C_TOAST:
                off += 1
            else:
                return _NOT_HANDLED  # binary, or a bad byte the reference names
            self.kinds[i] = kind
        self.count = ncols
        return off


# -- plans: a projector's fields, resolved for this module ---------------------------------------------

cdef class Plan:
    """What a `Projector` writes, resolved once per projector."""

    cdef int n
    cdef list names  # per field: orjson.dumps(name) + b':'
    cdef list quoted  # per field: orjson.dumps(name), for the unchanged list
    cdef list convs  # per field: the reference's converter
    cdef int *cols  # per field: the column in the row
    cdef int *kinds  # per field: K_*
    cdef int nkey
    cdef int *key_order  # insert/update: field numbers of the key, in key order
    cdef int nkey_plan
    cdef int *key_plan  # delete, before: field numbers of the key, in field order
    cdef bytes consts  # b',"name":value...' appended to data, or b'' when the mapping has none
    cdef int partitions
    cdef int npart
    cdef int *part_by  # per partition_by name: its index in key_order
    cdef int *part_by_plan  # and in key_plan
    cdef bint c, u, d, before
    # the target's, fixed for its life (a rebind makes a new target): read here, not per change
    cdef object version
    cdef list entry_lists  # per partition: its batch's entries (`StreamBatch.entries`, the same list for its lifetime)
    cdef list packers  # per partition: its batch's `StreamBatch.packed` (None, or the same object for its lifetime)
    cdef object tail_lsn, tail_xid, tail_ts  # the transaction fields `before_seq` and `after_seq` were packed from
    cdef bytes before_seq, after_seq  # (held, so compared by identity: no other object can take their place)
    cdef list read
    cdef Py_ssize_t unread  # changes read not yet added to `read[0]` (`_add_reads`)

    def __dealloc__(self):
        free(self.cols)
        free(self.kinds)
        free(self.key_order)
        free(self.key_plan)
        free(self.part_by)
        free(self.part_by_plan)


cdef int *_ints(list values) except NULL:
    cdef int *out = <int *>malloc((len(values) or 1) * sizeof(int))
    cdef int i
    if out == NULL:
        raise MemoryError()
    for i in range(len(values)):
        out[i] = values[i]
    return out


# the reference's converters this module writes itself, by identity
cdef dict _KINDS = {
    id(int): K_INT,
    id(_values_module._float): K_FLOAT,
    id(_values_module._bool): K_BOOL,
    id(_values_module._timestamp): K_TIMESTAMP,
    id(_values_module._timestamptz): K_TIMESTAMPTZ,
    id(str): K_TEXT,
    id(orjson.Fragment): K_JSON,
}


cdef int _kind_of(object conv):
    return _KINDS.get(id(conv), K_GENERIC)


def refusal(projector):
    """Why this module hands every change of `projector` to the reference, or None when it writes them.

    Reads the projector's public plan (`cdc.mapping.projector.ProjectorPlan`) only.
    """
    pp = projector.plan
    if pp.filters:
        return "the mapping has filters"
    fields = [f.name for f in pp.fields]
    if len(set(fields)) != len(fields):
        return "a field name repeats"
    if any(name in fields for name in pp.consts):
        return "a constant field has a mapped field's name"
    if any(name not in fields for name in pp.key_order):
        return "a key field is a constant"
    key_plan = [f.name for f in pp.key_fields]
    part_by = list(pp.partition_by) if pp.partitions != 1 else []
    if any(name not in pp.key_order or name not in key_plan for name in part_by):
        return "a partition_by field is not a key field"
    for value in pp.consts.values():
        try:
            _dumps(value)
        except orjson.JSONEncodeError:
            return "a constant's value is not one orjson writes"  # the reference fails on it, per change
    return None


cdef object _plan_for(object projector):
    """A `Plan` for the projector, or False when the reference must take its changes (`refusal`)."""
    cdef Plan plan
    if refusal(projector) is not None:
        return False
    pp = projector.plan
    fields = [f.name for f in pp.fields]
    key_order = list(pp.key_order)
    key_plan = [f.name for f in pp.key_fields]
    part_by = list(pp.partition_by) if pp.partitions != 1 else []
    plan = Plan()
    plan.n = len(fields)
    plan.names = [_dumps(name) + b":" for name in fields]
    plan.quoted = [_dumps(name) for name in fields]
    plan.convs = [f.convert for f in pp.fields]
    plan.cols = _ints([f.column for f in pp.fields])
    plan.kinds = _ints([_kind_of(f.convert) for f in pp.fields])
    plan.nkey = len(key_order)
    plan.key_order = _ints([fields.index(name) for name in key_order])
    plan.nkey_plan = len(key_plan)
    plan.key_plan = _ints([fields.index(name) for name in key_plan])
    plan.consts = b"".join(b"," + _dumps(name) + b":" + _dumps(value) for name, value in pp.consts.items())
    plan.partitions = pp.partitions
    plan.npart = len(part_by)
    plan.part_by = _ints([key_order.index(name) for name in part_by])
    plan.part_by_plan = _ints([key_plan.index(name) for name in part_by])
    ops = pp.ops
    plan.c, plan.u, plan.d = "c" in ops, "u" in ops, "d" in ops
    plan.before = bool(pp.before)
    return plan


# -- writing a row ---------------------------------------------------------------------------------

cdef Py_ssize_t *_spans = NULL  # per field: start, end of its JSON value in the buffer (-1: left out)
cdef int _spans_cap = 0


cdef int _need_spans(int n) except -1:
    global _spans, _spans_cap
    cdef Py_ssize_t *grown
    if n * 2 <= _spans_cap:
        return 0
    grown = <Py_ssize_t *>realloc(_spans, n * 2 * sizeof(Py_ssize_t))
    if grown == NULL:
        raise MemoryError()
    _spans = grown
    _spans_cap = n * 2
    return 0


cdef int _value(Plan plan, int f, const char *p, Py_ssize_t size) except -1:
    """Field `f`'s converted value, from its text `p`, written as JSON."""
    cdef int kind = plan.kinds[f]
    cdef bint integral = False
    cdef Py_ssize_t i
    if kind == K_TEXT:
        return _json_string(p, size)
    if kind == K_INT:
        if _plain_integer(p, size):
            return _put(p, size)
    elif kind == K_FLOAT:
        if _plain_float(p, size, &integral):
            _put(p, size)
            if integral:
                _put(b".0", 2)
            return 0
    elif kind == K_BOOL:
        if size == 1 and p[0] == b't':
            return _put(b"true", 4)
        if size == 1 and p[0] == b'f':
            return _put(b"false", 5)
    elif kind == K_TIMESTAMP:
        if _plain_ascii(p, size):
            # '2026-11-23 00:33:29.123456': the space becomes 'T'; infinity, BC, year > 9999 stay
            if size > 18 and p[10] == b' ' and p[size - 1] != b'C':
                _reserve(size + 2)
                _putc(b'"')
                _put(p, 10)
                _putc(b'T')
                _put(p + 11, size - 11)
                return _putc(b'"')
            return _json_string(p, size)
    elif kind == K_TIMESTAMPTZ:
        if _plain_ascii(p, size) and size >= 14 and p[10] == b' ' \
                and p[size - 3] == b'+' and p[size - 2] == b'0' and p[size - 1] == b'0':
            _reserve(size + 2)
            _putc(b'"')
            _put(p, 10)
            _putc(b'T')
            _put(p + 11, size - 14)
            _put(b'Z"', 2)
            return 0
    elif kind == K_JSON:
        return _put(p, size)  # orjson.Fragment: embedded as it is
    # anything else: the reference's own converter, and orjson
    text = PyUnicode_DecodeUTF8(p, size, b"strict")
    return _put_bytes(_dumps(plan.convs[f](text)))


cdef int _row(Plan plan, Row row, const char *data, Row fallback, list unchanged) except -1:
    """The row's fields as the data object `{...}`; each field's value span in `_spans`.

    A value the server did not send (unchanged TOAST) is taken from `fallback` when
    it holds one, else left out and its field named in `unchanged` (when not None).
    """
    cdef int f, col
    cdef unsigned char kind
    cdef Py_ssize_t start
    cdef bint first = True
    _need_spans(plan.n)
    _putc(b'{')
    for f in range(plan.n):
        col = plan.cols[f]
        kind = row.kinds[col]
        if kind == C_TOAST and fallback is not None:
            if fallback.kinds[col] != C_TOAST:
                row_from = fallback
            else:
                row_from = None
        elif kind == C_TOAST:
            row_from = None
        else:
            row_from = row
        if row_from is None:
            if unchanged is not None:
                unchanged.append(f)
            _spans[2 * f] = -1
            continue
        if not first:
            _putc(b',')
        first = False
        _put_bytes(plan.names[f])
        start = _out.size
        if (<Row>row_from).kinds[col] == C_NULL:
            _put(b"null", 4)
        else:
            _value(plan, f, data + (<Row>row_from).starts[col], (<Row>row_from).sizes[col])
        _spans[2 * f] = start
        _spans[2 * f + 1] = _out.size
    if plan.consts:
        if first:
            _put_bytes(plan.consts[1:])
        else:
            _put_bytes(plan.consts)
    _putc(b'}')
    return 0


cdef object _object(Plan plan, int *fields, int count, list parts):
    """`{"name":value,...}` of the given fields from the spans of the last `_row`; None if one is left out.

    The JSON values are also collected in `parts` (when not None) for the partition.
    """
    cdef Py_ssize_t start = _out.size, a, b
    cdef int i, f
    _putc(b'{')
    for i in range(count):
        f = fields[i]
        a = _spans[2 * f]
        if a < 0:
            _out.size = start
            return None
        b = _spans[2 * f + 1]
        if i:
            _putc(b',')
        _put_bytes(plan.names[f])
        _reserve(b - a)
        memcpy(_out.data + _out.size, _out.data + a, b - a)
        if parts is not None:
            parts.append(PyBytes_FromStringAndSize(_out.data + a, b - a))
        _out.size += b - a
    _putc(b'}')
    return _take(start)


cdef int _key_row(Plan plan, Row row, const char *data, list parts) except -1:
    """`_key`: the key fields in field order, null for a value not sent; spans set for each."""
    cdef int i, f, col
    cdef unsigned char kind
    cdef Py_ssize_t start
    _need_spans(plan.n)
    _putc(b'{')
    for i in range(plan.nkey_plan):
        f = plan.key_plan[i]
        col = plan.cols[f]
        kind = row.kinds[col]
        if i:
            _putc(b',')
        _put_bytes(plan.names[f])
        start = _out.size
        if kind == C_NULL or kind == C_TOAST:
            _put(b"null", 4)
        else:
            _value(plan, f, data + row.starts[col], row.sizes[col])
        if parts is not None:
            parts.append(PyBytes_FromStringAndSize(_out.data + start, _out.size - start))
    _putc(b'}')
    return 0


cdef bint _key_toasted(Plan plan, Row row):
    """A key column's value was not resent (unchanged TOAST)."""
    cdef int i
    for i in range(plan.nkey_plan):
        if row.kinds[plan.cols[plan.key_plan[i]]] == C_TOAST:
            return True
    return False


cdef int _partition(Plan plan, list parts, int *order):
    """`Projector._partition`: crc32 of the JSON list of the partition_by values, modulo partitions."""
    cdef int i
    cdef bytes listed
    if plan.partitions == 1:
        return 0
    listed = b"[" + b",".join([parts[order[i]] for i in range(plan.npart)]) + b"]"
    return _crc32(listed) % plan.partitions


cdef bytes _names_list(Plan plan, list unchanged):
    return b"[" + b",".join([plan.quoted[f] for f in unchanged]) + b"]"


cdef int _projected_partition = 0  # the partition of `_project`'s last fields
cdef list _unchanged = []  # the fields `_project` found unchanged, emptied at each call

cdef enum:
    AGE_EVERY = 32  # as `cdc.bridge.changes.AGE_EVERY`

cdef enum:
    TAIL = 11  # what `_queue` appends to a target's fields: lsn, seq, xid, ts_ms and v with their values, the position


cdef inline list _entry(Py_ssize_t head):
    """An entry's list, sized for `head` fields and values and the `TAIL` (filled by `_set`, in order)."""
    cdef list f = PyList_New(head + TAIL)
    # bytes, str and int only: the list can be in no reference cycle, and the collector need not walk
    # it (thousands wait in a batch, and walking them again and again cost more than building them)
    PyObject_GC_UnTrack(<PyObject *>f)
    return f


cdef inline void _set(list f, Py_ssize_t i, object value):
    Py_INCREF(value)
    PyList_SET_ITEM(f, i, value)


cdef object _project(Plan plan, int kind, Row new, Row old, unsigned char old_kind, const char *data):
    """The entry's fields for one target (its partition in `_projected_partition`), None when the mapping
    skips the change, or False for the reference."""
    global _projected_partition
    cdef Py_ssize_t base = _out.size, at
    cdef list unchanged = _unchanged, parts, fields
    cdef int i, col
    cdef bytes moved
    cdef bint old_full = old_kind == b'O'
    if PyList_GET_SIZE(unchanged):
        del unchanged[:]
    for i in range(plan.n):
        col = plan.cols[i]
        if (kind != DELETE and col >= new.count) or (old is not None and col >= old.count):
            return False  # a row shorter than the relation: the reference raises
    if kind == INSERT or kind == UPDATE:
        if kind == INSERT and not plan.c or kind == UPDATE and not plan.u:
            return None
        _row(plan, new, data, old if kind == UPDATE and old_full else None, unchanged)
        parts = [] if plan.partitions != 1 else None
        key_json = _object(plan, plan.key_order, plan.nkey, parts)  # written after the data it copies from
        if key_json is None:
            _out.size = base
            return False  # a key field left out: the reference raises
        data_json = _take(base)
        before_json = None
        if kind == UPDATE and old is not None:
            if plan.before:
                if old_full:
                    _row(plan, old, data, None, None)
                else:
                    _key_row(plan, old, data, None)
                before_json = _take(base)
            elif not _key_toasted(plan, new):  # (a key not resent did not change)
                # the key changed: the old key is part of the change, whatever `before` says
                _key_row(plan, old, data, None)
                moved = _take(base)
                _key_row(plan, new, data, None)
                if moved != _take(base):
                    before_json = moved
        fields = _entry(6 + (2 if before_json is not None else 0) + (2 if unchanged else 0))
        _set(fields, 0, b"op")
        _set(fields, 1, b"c" if kind == INSERT else b"u")
        _set(fields, 2, b"key")
        _set(fields, 3, key_json)
        _set(fields, 4, b"data")
        _set(fields, 5, data_json)
        at = 6
        if before_json is not None:
            _set(fields, 6, b"before")
            _set(fields, 7, before_json)
            at = 8
        if unchanged:
            _set(fields, at, b"unchanged")
            _set(fields, at + 1, _names_list(plan, unchanged))
        _projected_partition = _partition(plan, parts, plan.part_by) if parts is not None else 0
        return fields
    # DELETE
    if not plan.d:
        return None
    parts = [] if plan.partitions != 1 else None
    _key_row(plan, old, data, parts)
    key_json = _take(base)
    before_json = None
    if plan.before and old_full:
        _row(plan, old, data, None, None)
        before_json = _take(base)
    fields = _entry(4 if before_json is None else 6)
    _set(fields, 0, b"op")
    _set(fields, 1, b"d")
    _set(fields, 2, b"key")
    _set(fields, 3, key_json)
    if before_json is not None:
        _set(fields, 4, b"before")
        _set(fields, 5, before_json)
    _projected_partition = _partition(plan, parts, plan.part_by_plan) if parts is not None else 0
    return fields


# -- the entry point ----------------------------------------------------------------------------

cdef Row _new = Row()
cdef Row _old = Row()


def route_raw(int kind, bytes raw, Py_ssize_t offset, list targets, tx, batcher, windows, decoder):
    """Route one Insert, Update or Delete, given as the XLogData bytes with its pgoutput message at `offset`.

    The same as `cdc.bridge.changes.route_raw`.
    """
    cdef _State st = _State(tx, batcher)
    try:
        return _route(kind, <const unsigned char *>PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw), raw, offset, targets,
                      windows, decoder, not windows.tables and not windows.introducing and not decoder.streaming, st)
    finally:
        st.store()


cdef class _State:
    """What the per-change work reads and moves of the transaction and the batcher, held here while a
    burst runs: the transaction's position fields (only `Transaction.begin*` changes them) and its next
    seq, the batcher's pending count and when its oldest entry came. `store` writes seq, pending and
    first_at back before any Python code may look at them (the reference, `committed`, the loop), and
    `load_*` reads them again after it ran."""
    cdef object tx, batcher
    cdef object lsn, xid, ts
    cdef str prefix
    cdef const char *prefix_p  # its ASCII bytes (NULL when it is not ASCII or too long: `_position` formats)
    cdef Py_ssize_t prefix_n
    cdef Py_ssize_t seq, pending
    cdef double first_at

    def __cinit__(self, tx, batcher):
        self.tx = tx
        self.batcher = batcher
        self.load_tx()
        self.load_batcher()

    cdef int load_tx(self) except -1:
        tx = self.tx
        self.lsn, self.xid, self.ts, self.prefix = tx.lsn, tx.xid, tx.ts, tx.prefix
        self.seq = tx.seq
        self._prefix_bytes()
        return 0

    cdef int _prefix_bytes(self) except -1:
        cdef Py_ssize_t n
        cdef const char *p = PyUnicode_AsUTF8AndSize(self.prefix, &n)
        if n <= 48 and _ascii(<const unsigned char *>p, n):
            self.prefix_p, self.prefix_n = p, n  # the str's own UTF-8 form: lives as long as `prefix`
        else:
            self.prefix_p, self.prefix_n = NULL, 0
        return 0

    cdef int load_batcher(self) except -1:
        self.pending = self.batcher.pending
        self.first_at = self.batcher.first_at
        return 0

    cdef int store(self) except -1:
        if PyList_GET_SIZE(_unread):
            _add_reads()
        self.tx.seq = self.seq
        batcher = self.batcher
        batcher.pending = self.pending
        batcher.first_at = self.first_at
        return 0


cdef inline bint _plain_position(_State st, Py_ssize_t seq) noexcept:
    """The usual case, written here: an ASCII prefix and 0 <= seq < 10**10 (`prefix_n + 10` characters)."""
    return 0 <= seq < 10000000000 and st.prefix_p != NULL


cdef inline void _write_position(_State st, Py_ssize_t seq, unsigned char *w) noexcept:
    """`prefix + "%010d" % seq` at `w`, for a `_plain_position`."""
    cdef Py_ssize_t n = st.prefix_n, i
    memcpy(w, st.prefix_p, n)
    for i in range(n + 9, n - 1, -1):
        w[i] = <unsigned char>(48 + seq % 10)
        seq //= 10


cdef str _position(_State st, Py_ssize_t seq):
    """`prefix + "%010d" % seq`, written in place for the usual case (`_plain_position`)."""
    if not _plain_position(st, seq):
        return st.prefix + "%010d" % seq
    text = PyUnicode_New(st.prefix_n + 10, 127)
    _write_position(st, seq, <unsigned char *>PyUnicode_1BYTE_DATA(text))
    return text


cdef int _pack(Plan plan, Packed packer, list f, Py_ssize_t pairs, _State st, Py_ssize_t seq) except -1:
    """Pack the entry whose fields are the first `pairs` items of `f` with its source position fields
    (`Packed.append_tail`: the transaction's packed once per mapping), at position `prefix +
    "%010d" % seq`, written on the stack for the usual case (`_position`'s). 0 when it must be packed whole."""
    cdef char chars[64]  # a plain prefix is at most 48 characters (`_State._prefix_bytes`)
    if plan.tail_lsn is not st.lsn or plan.tail_xid is not st.xid or plan.tail_ts is not st.ts:
        plan.before_seq = pack_args([b"lsn", st.lsn, b"seq"])
        plan.after_seq = pack_args([b"xid", st.xid, b"ts_ms", st.ts, b"v", plan.version])
        plan.tail_lsn, plan.tail_xid, plan.tail_ts = st.lsn, st.xid, st.ts
    if not _plain_position(st, seq):
        return 0
    _write_position(st, seq, <unsigned char *>chars)
    return packer.append_tail(f, pairs, plan.before_seq, seq, plan.after_seq, chars, st.prefix_n + 10)


cdef object _route_reference(int kind, bytes raw, Py_ssize_t offset, list targets, windows, decoder, _State st):
    """The reference takes the change: it sees the transaction and batcher as they are, and `st` what it did."""
    st.store()
    try:
        return _reference(kind, raw, offset, targets, st.tx, st.batcher, windows, decoder)
    finally:
        st.seq = st.tx.seq
        st.load_batcher()


cdef inline bytes _bytes_of(object src, const unsigned char *data, Py_ssize_t have):
    """The message as bytes: `src` itself when it is, else a copy of its `have` bytes at `data`."""
    if type(src) is bytes:
        return <bytes>src
    return PyBytes_FromStringAndSize(<const char *>data, have)


cdef object _route(int kind, const unsigned char *data, Py_ssize_t have, object src, Py_ssize_t offset, list targets,
                   windows, decoder, bint plain, _State st):
    """`route_raw`, called from `burst` without Python's call machinery, on the `have` bytes at `data` that
    `src` holds (bytes, or the buffer libpq's message is read from, copied only for the reference); `plain`:
    no backfill window is open and the decoder is not inside a streamed block (read once per burst: only
    the loop's messages change them). The transaction and batcher as `st` holds them."""
    cdef Py_ssize_t off
    cdef unsigned char action, old_kind = 0
    cdef Row old = None
    if not plain or offset + 6 > have:
        return _route_reference(kind, _bytes_of(src, data, have), offset, targets, windows, decoder, st)
    action = data[offset + 5]
    off = offset + 6
    if kind == INSERT:
        if action != b'N':
            off = _NOT_HANDLED
        else:
            off = _new.read(data, off, have)
    elif kind == UPDATE:
        if action == b'K' or action == b'O':
            old_kind = action
            old = _old
            off = _old.read(data, off, have)
            if off >= 0:
                if off < have and data[off] == b'N':
                    off = _new.read(data, off + 1, have)
                else:
                    off = _NOT_HANDLED
        elif action == b'N':
            off = _new.read(data, off, have)
        else:
            off = _NOT_HANDLED
    else:
        if action == b'K' or action == b'O':
            old_kind = action
            old = _old
            off = _old.read(data, off, have)
        else:
            off = _NOT_HANDLED
    if off != have:
        return _route_reference(kind, _bytes_of(src, data, have), offset, targets, windows, decoder, st)
    cdef Py_ssize_t ntargets = len(targets), i
    cdef bint projected = True
    cdef int only_partition = 0
    if ntargets == 0:
        return None
    outs = [] if ntargets > 1 else None  # one target (the usual case): its projection in `only`
    only = only_plan = None
    for t in targets:  # outside the try below: a plan this module cannot read fails here, never falls back
        if t.plan is None:
            plan_obj = t.plan = _plan_for(t.projector)
            if plan_obj is not False:
                (<Plan>plan_obj).version = t.version
                (<Plan>plan_obj).entry_lists = [b.entries for b in t.batches]
                (<Plan>plan_obj).packers = [b.packed for b in t.batches]
                (<Plan>plan_obj).read = t.read
    _out.size = 0
    try:
        for t in targets:
            plan_obj = t.plan
            if plan_obj is False:
                projected = False
                break
            out = _project(<Plan>plan_obj, kind, _new, old, old_kind, <const char *>data)
            if out is False:
                projected = False
                break
            if outs is None:
                only = out
                only_plan = plan_obj
                only_partition = _projected_partition
            else:
                outs.append((_projected_partition, out))
    except Exception:
        # A value its converter or orjson refuses. The reference has by then counted the
        # change read and queued the entries of the mappings before it, and it converts
        # every field of a row before writing any (so another field may fail first): it
        # takes the change, to fail the same way after the same side effects.
        _out.size = 0
        projected = False
    if not projected:
        return _route_reference(kind, _bytes_of(src, data, have), offset, targets, windows, decoder, st)
    # every target is projected: now queue them, as `route_row` and `Batcher.add` do
    if outs is None:
        _queue(<Plan>only_plan, only, only_partition, st)
    else:
        for i in range(ntargets):
            partition, out = <tuple>outs[i]
            _queue(<Plan>(targets[i].plan), out, partition, st)


cdef list _unread = []  # the plans whose `unread` is not 0


cdef int _add_reads() except -1:
    """Add the changes counted in C to the targets' `read` counts (`_State.store`: before Python looks)."""
    cdef Plan plan
    for plan in _unread:
        plan.read[0] += plan.unread
        plan.unread = 0
    del _unread[:]
    return 0


cdef int _queue(Plan plan, object fields, int partition, _State st) except -1:
    """A target's change counted read and its entry, if any, completed with its position and queued
    (`Batcher.add`): `fields` has room for them (`_entry`)."""
    cdef Py_ssize_t seq = st.seq, at
    cdef list f, entries
    if not plan.unread:
        _unread.append(plan)
    plan.unread += 1
    if fields is None:
        return 0
    f = <list>fields
    at = PyList_GET_SIZE(f) - TAIL
    entries = <list>plan.entry_lists[partition]
    packer = plan.packers[partition]
    # packed while in the cache, then let go; after entries someone else queued: behind them, in order
    cdef bint packing = packer is not None and PyList_GET_SIZE(entries) == 0
    if packing and _pack(plan, <Packed>packer, f, at, st, seq):
        return _queued(st)
    _set(f, at, b"lsn")
    _set(f, at + 1, st.lsn)
    _set(f, at + 2, b"seq")
    _set(f, at + 3, seq)
    _set(f, at + 4, b"xid")
    _set(f, at + 5, st.xid)
    _set(f, at + 6, b"ts_ms")
    _set(f, at + 7, st.ts)
    _set(f, at + 8, b"v")
    _set(f, at + 9, plan.version)
    _set(f, at + 10, _position(st, seq))
    if packing:
        (<Packed>packer).append_entry(f)  # what `_pack` leaves: the whole entry, the reference packing
    else:
        entries.append(f)
    return _queued(st)


cdef inline int _queued(_State st) except -1:
    if not st.pending:
        st.first_at = st.batcher.clock()
    st.pending += 1
    return 0


# -- the loop's inner part: the changes already received -----------------------------------------


cdef inline double _now() noexcept:
    """`time.monotonic()` (CLOCK_MONOTONIC, nanoseconds over 1e9, as CPython computes it), without a call."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>(<long long>ts.tv_sec * 1000000000LL + ts.tv_nsec) / 1e9



cdef long long _EPOCH_US = PG_EPOCH_UNIX_US


cdef str _digits(unsigned long long v, int width):
    """`v` in decimal, zero-padded to `width` digits (`f"{v:0{width}d}"`)."""
    cdef char buf[24]
    cdef int i = 24
    while True:
        i -= 1
        buf[i] = <char>(48 + v % 10)
        v //= 10
        if v == 0 and 24 - i >= width:
            break
    return PyUnicode_DecodeASCII(buf + i, 24 - i, NULL)


cdef int _begin(_State st, unsigned long long final, long long commit_ts, unsigned long xid) except -1:
    """`Transaction.begin_at` from a Begin's fields, written here: the same attributes, the same text."""
    cdef long long us, ms
    tx = st.tx
    if commit_ts > 0x7FFFFFFFFFFFFFFF - _EPOCH_US or commit_ts < -0x7FFFFFFFFFFFFFFF + _EPOCH_US:
        tx.begin_at(final, commit_ts, xid)  # cannot happen: the reference's arithmetic in Python ints
        st.load_tx()
        return 0
    us = commit_ts + _EPOCH_US
    ms = us / 1000
    if us % 1000 and us < 0:  # `pg_ts_to_unix_ms` floors
        ms -= 1
    st.seq = 0
    st.lsn = _digits(final, 1)
    st.prefix = _digits(final, 20)
    st._prefix_bytes()
    st.xid = _digits(xid, 1)
    st.ts = _digits(<unsigned long long>ms, 1) if ms >= 0 else "-" + _digits(<unsigned long long>(-(ms + 1)) + 1, 1)
    tx.open = True
    tx.seq = 0
    tx.lsn, tx.prefix, tx.xid, tx.ts = st.lsn, st.prefix, st.xid, st.ts
    return 0


def burst(stream, dict targets, tx, batcher, windows, decoder, committed, streams):
    """Route the row changes that have already arrived, without waiting for more.

    The inner part of `Session.run`'s loop, for the messages libpq holds: each
    Insert, Update or Delete is counted, routed as `route_raw` does, and takes the
    next seq; a Begin goes to `tx.begin_at` and a Commit to `tx.commit_at` and then
    `committed(end LSN)`, as `Session.dispatch` does. Inside a streamed block (of a
    transaction still running) a change is counted and held in `streams` instead.
    A keepalive that asks no reply, read after changes of this burst while the batch
    is pending, is passed over (`changes.burst`). Stops at the first other
    message (returned for the loop, which also decodes, and so names, anything
    malformed), when none is left, or when the batch is due (the rule of
    `Batcher.due`). Returns (changes read, that message or None).
    """
    xid = decoder.stream_xid  # the block being received, if any: only the loop's messages start or stop one
    # nor open or close a window, nor bring rows after a resync marker (`cdc.bridge.introductions`)
    cdef bint plain = not windows.tables and not windows.introducing and xid is None
    cdef _State st = _State(tx, batcher)
    get = stream.get_copy_data
    reader = getattr(stream, "copy_reader", None)
    try:
        return _burst(get, stream, targets, windows, decoder, committed, streams, st, plain, xid, reader)
    finally:
        st.store()


cdef tuple _burst(get, stream, dict targets, windows, decoder, committed, streams, _State st, bint plain, xid,
                  reader):
    """`burst`'s loop, with the transaction and batcher held in `st`; with `reader` (`copy_reader`'s
    addresses) each message is read from libpq by a call of its own, and freed once handled."""
    cdef Py_ssize_t count = 0, n, size, ticks = 0
    cdef Py_ssize_t max_entries = st.batcher.max_entries
    cdef double max_delay = st.batcher.max_delay
    cdef const unsigned char *p
    cdef unsigned char kind
    cdef unsigned long relid, last_relid = 0
    cdef bint streaming = xid is not None
    cdef void *conn = NULL
    cdef _GetCopyData get_copy_data = NULL
    cdef _FreeMem freemem = NULL
    cdef char *buf = NULL
    if reader is not None:
        conn = <void *><size_t>reader[0]
        get_copy_data = <_GetCopyData><size_t>reader[1]
        freemem = <_FreeMem><size_t>reader[2]
    last_targets = None  # the targets of `last_relid` (the dict changes only between bursts: a Relation is the loop's)
    tx = st.tx
    data = None
    while count < 65536:
        if get_copy_data != NULL:
            buf = NULL
            n = get_copy_data(conn, &buf, 1)
            if n <= 0:
                if buf != NULL:
                    freemem(buf)
                if n == 0:
                    return count, None
                raise stream.failure(n)
            p = <const unsigned char *>buf  # libpq's buffer, freed below once handled (copied only where kept)
            size = n
        else:
            try:
                n, data = get(1)
            except _PgError as exc:
                raise stream.failure(exc) from exc
            if n <= 0:
                if n == 0:
                    return count, None
                raise stream.failure(n)
            if type(data) is memoryview and PyBuffer_IsContiguous(PyMemoryView_GET_BUFFER(data), b'C'):
                # read in place: libpq's buffer, held by `data` until the next read (copied only where kept)
                p = <const unsigned char *>PyMemoryView_GET_BUFFER(data).buf
                size = PyMemoryView_GET_BUFFER(data).len
            else:
                data = bytes(data)
                p = <const unsigned char *>PyBytes_AS_STRING(data)
                size = PyBytes_GET_SIZE(data)
        try:
            if size < 30 or p[0] != 0x77:  # not XLogData with a change's relid: the loop's
                if not (count and size == 18 and p[0] == 0x6B and not p[17] and st.pending):
                    return count, _bytes_of(data, p, size)
                continue  # a keepalive asking no reply while a batch is pending (`changes.burst`)
            kind = p[25]
            if kind == INSERT or kind == UPDATE or kind == DELETE:
                count += 1
                if streaming:
                    streams.add(xid, PyBytes_FromStringAndSize(<const char *>p + 25, size - 25))
                    continue
                relid = _u32(p + 26)
                if relid != last_relid or last_targets is None:
                    last_targets = targets.get(relid)
                    last_relid = relid
                tlist = last_targets
                if tlist:
                    _route(kind, p, size, data, 25, tlist, windows, decoder, plain, st)
                st.seq += 1
            elif kind == BEGIN and size == 25 + 21 and not streaming:
                _begin(st, _u64(p + 26), <long long>_u64(p + 34), _u32(p + 42))
                continue
            elif kind == COMMIT and size == 25 + 26 and not streaming:
                st.store()
                tx.open = False  # `Transaction.commit_at`, inline
                try:
                    committed(_Lsn(_u64(p + 35)))
                finally:
                    st.seq = tx.seq
                    st.load_batcher()
            else:
                return count, _bytes_of(data, p, size)
        finally:
            if buf != NULL:  # the message handled (or failed): libpq's buffer goes back
                freemem(buf)
                buf = NULL
        if st.pending:  # the rule of `Batcher.due`, the age looked at once per AGE_EVERY (`changes.burst`)
            if st.pending >= max_entries:
                return count, None
            ticks += 1
            if ticks == AGE_EVERY:
                ticks = 0
                if _now() - st.first_at >= max_delay:
                    return count, None
    return count, None
