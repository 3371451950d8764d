# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""`xadd_command`, `pack_past` and `Packed` of `cdc.sink.lane`, compiled: entries packed as RESP commands.

`cdc.sink.lane` is the specification; this gives the same bytes
(tests/sink/test_compiled_resp.py compares them on generated entries).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_Compare, PyUnicode_DecodeUTF8
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy
from cpython.ref cimport PyObject, Py_INCREF

__all__ = ["xadd_command", "pack_past", "plain_array_end", "Packed"]  # the interface: _resp.pyi


cdef object _reference():
    """The specification, for the entries this module does not pack itself (imported late: it imports this)."""
    from .lane import xadd_command
    return xadd_command

cdef char *_buf = <char *>malloc(4096)
cdef Py_ssize_t _cap = 4096
cdef Py_ssize_t _size = 0
if _buf == NULL:
    raise MemoryError()


cdef int _grow(char **buf, Py_ssize_t *cap, Py_ssize_t want) except -1:
    """`buf` (of `cap` bytes) holding at least `want`, doubled as often as needed."""
    cdef Py_ssize_t n = cap[0]
    cdef char *grown
    if want <= n:
        return 0
    while n < want:
        n *= 2
    grown = <char *>realloc(buf[0], n)
    if grown == NULL:
        raise MemoryError()
    buf[0], cap[0] = grown, n
    return 0


cdef inline int _reserve(Py_ssize_t n) except -1:
    if _size + n <= _cap:
        return 0
    return _grow(&_buf, &_cap, _size + n)


cdef inline int _number(char prefix, Py_ssize_t value) except -1:
    """`prefix` then a non-negative `value` in decimal, then CRLF."""
    global _size
    cdef char digits[24]
    cdef int n = 0
    _reserve(26)
    _buf[_size] = prefix
    _size += 1
    if value == 0:
        digits[0] = b'0'
        n = 1
    while value:
        digits[n] = <char>(48 + value % 10)  # '0' + digit
        value //= 10
        n += 1
    while n:
        n -= 1
        _buf[_size] = digits[n]
        _size += 1
    _buf[_size] = b'\r'
    _buf[_size + 1] = b'\n'
    _size += 2
    return 0


cdef inline int _bulk(const char *p, Py_ssize_t n) except -1:
    global _size
    cdef char *w
    if n >= 100:
        _number(b'$', n)
        _reserve(n + 2)
        w = _buf + _size
    else:  # most arguments: the length in one or two digits, one reservation
        _reserve(n + 7)
        w = _buf + _size
        w[0] = b'$'
        if n < 10:
            w[1] = <char>(48 + n)
            w += 2
        else:
            w[1] = <char>(48 + n // 10)
            w[2] = <char>(48 + n % 10)
            w += 3
        w[0] = b'\r'
        w[1] = b'\n'
        w += 2
    memcpy(w, p, n)
    w[n] = b'\r'
    w[n + 1] = b'\n'
    _size = (w + n + 2) - _buf
    return 0


cdef int _decimal(object value) except -1:
    """An int argument in decimal, written here when it fits a long long (b"%d" % value otherwise)."""
    cdef int overflow = 0
    cdef long long v = PyLong_AsLongLongAndOverflow(value, &overflow)
    cdef bytes b
    if overflow:
        b = b"%d" % value
        return _bulk(PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))
    return _decimal_of(v)


cdef int _decimal_of(long long v) except -1:
    """`v` as a bulk string in decimal."""
    cdef char digits[24]
    cdef int i = 24
    cdef unsigned long long u
    u = <unsigned long long>(-(v + 1)) + 1 if v < 0 else <unsigned long long>v
    while True:
        i -= 1
        digits[i] = <char>(48 + u % 10)
        u //= 10
        if u == 0:
            break
    if v < 0:
        i -= 1
        digits[i] = b'-'
    return _bulk(digits + i, 24 - i)


cdef int _arg(object value) except -1:
    """One argument as the reference writes it: bytes as they are, str as UTF-8, int in decimal."""
    cdef const char *p
    cdef Py_ssize_t n
    cdef bytes b
    if type(value) is bytes:
        return _bulk(PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value))
    if type(value) is str:
        p = PyUnicode_AsUTF8AndSize(value, &n)
        return _bulk(p, n)
    if type(value) is int:
        return _decimal(value)
    else:
        b = str(value).encode()
    return _bulk(PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))


cdef enum:
    NAME_SLOTS = 256  # a table of field names packed (an entry's are the producer's few constants, reused)
    NAME_LIMIT = 128  # names it takes at most (half full: probes stay short); the others are packed each time

# a field name already packed as a bulk string, found by the name object itself (open addressing): the
# table holds a reference to each name, so no other object can take its address (bytes are immutable)
cdef PyObject *_name_keys[NAME_SLOTS]  # static: all NULL at first
cdef PyObject *_name_packed[NAME_SLOTS]
cdef Py_ssize_t _names_held = 0


cdef inline Py_ssize_t _name_slot(PyObject *name):
    """The slot of `name` in the table, or the empty one where it would go."""
    cdef size_t slot = ((<size_t>name >> 4) * <size_t>0x9E3779B97F4A7C15ULL) >> 56  # 8 bits: NAME_SLOTS
    while _name_keys[slot] != NULL and _name_keys[slot] != name:
        slot = (slot + 1) % NAME_SLOTS
    return slot


cdef int _name(object name) except -1:
    global _size, _names_held
    cdef bytes b
    cdef Py_ssize_t slot, n
    cdef PyObject *packed
    if type(name) is bytes and PyBytes_GET_SIZE(name) <= 64:
        slot = _name_slot(<PyObject *>name)
        if _name_keys[slot] == NULL:
            if _names_held >= NAME_LIMIT:
                return _bulk(PyBytes_AS_STRING(name), PyBytes_GET_SIZE(name))
            b = b"$%d\r\n%b\r\n" % (PyBytes_GET_SIZE(name), name)
            Py_INCREF(name)
            Py_INCREF(b)
            _name_keys[slot] = <PyObject *>name
            _name_packed[slot] = <PyObject *>b
            _names_held += 1
        packed = _name_packed[slot]
        n = PyBytes_GET_SIZE(<bytes>packed)
        _reserve(n)
        memcpy(_buf + _size, PyBytes_AS_STRING(<bytes>packed), n)
        _size += n
        return 0
    if type(name) is bytes:
        return _bulk(PyBytes_AS_STRING(name), PyBytes_GET_SIZE(name))
    b = str(name).encode()
    return _bulk(PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))


cdef bytes _head(bytes stream):
    """What follows each command's argument count: ``XADD``, the stream and ``*``, packed once per call."""
    return b"$4\r\nXADD\r\n$%d\r\n%b\r\n$1\r\n*\r\n" % (PyBytes_GET_SIZE(stream), stream)


cdef int _append_xadd(bytes head, object entry) except -1:
    """Append ``XADD stream * field value ...`` for `entry` to the buffer (`head`: `_head(stream)`);
    0 when the reference must pack it.

    An exception (a str that is not valid UTF-8) leaves part of a command in the
    buffer: the caller puts the buffer back and hands the entry to the reference,
    which encodes every name before any value, so which one it reports is its own
    to say.
    """
    cdef Py_ssize_t count
    if type(entry) is not list:
        return 0
    count = len(<list>entry)
    if count % 2 == 0:
        return 0
    return _append_pairs(head, <list>entry, count - 1, 0)


cdef int _append_pairs(bytes head, list entry, Py_ssize_t pairs, Py_ssize_t more) except -1:
    """`_append_xadd` for the first `pairs` items of `entry` (field, value, ...; an even count), in a
    command of `more` arguments more (written after by the caller)."""
    global _size
    cdef Py_ssize_t i
    _number(b'*', pairs + 3 + more)  # XADD, stream, '*', then the pairs (the position is not sent)
    _put(head)
    for i in range(0, pairs, 2):
        name = (<list>entry)[i]
        if type(name) is not bytes and type(name) is not str:
            # the reference keys its formats on the names, and equal names of other
            # types (1 and True) share one: it packs those
            return 0
        _name(name)
        _arg((<list>entry)[i + 1])
    return 1


def xadd_command(bytes stream, entry):
    """``XADD stream * field value ...`` for an entry (its field/value list, then its position), packed."""
    global _size
    _size = 0
    try:
        packed = _append_xadd(_head(stream), entry)
    except Exception:
        packed = 0
    if not packed:
        return _reference()(stream, entry)
    return PyBytes_FromStringAndSize(_buf, _size)


def pack_past(bytes stream, entries, str held):
    """The ``XADD`` commands of the entries whose position (last item) is past `held`, joined, and
    those entries' positions, in order.
    """
    global _size
    cdef Py_ssize_t start
    cdef list chunks = []
    cdef list positions = []
    cdef bytes head = _head(stream)
    _size = 0
    for entry in entries:
        if type(entry) is list and PyList_GET_SIZE(entry):
            pos = <object>PyList_GET_ITEM(entry, PyList_GET_SIZE(entry) - 1)
        else:
            pos = entry[len(entry) - 1]  # not entry[-1]: negative indices are off in this module
        if type(pos) is str:
            if PyUnicode_Compare(pos, held) <= 0:
                continue
        elif not pos > held:
            continue
        positions.append(pos)
        start = _size
        try:
            packed = _append_xadd(head, entry)
        except Exception:
            packed = 0
        if packed:
            continue
        # the reference packs this one: keep what the buffer holds before it
        _size = start
        if _size:
            chunks.append(PyBytes_FromStringAndSize(_buf, _size))
            _size = 0
        chunks.append(_reference()(stream, entry))
    if chunks:
        if _size:
            chunks.append(PyBytes_FromStringAndSize(_buf, _size))
        return b"".join(chunks), positions
    return PyBytes_FromStringAndSize(_buf, _size), positions


cdef Py_ssize_t _eol(const char *p, Py_ssize_t n, Py_ssize_t at):
    """Where the first CRLF at or after `at` starts, -1 when there is none."""
    while at + 1 < n:
        if p[at] == b'\r' and p[at + 1] == b'\n':
            return at
        at += 1
    return -1


def plain_array_end(bytes data, Py_ssize_t count):
    """Where the RESP array of `count` replies at the start of `data` ends, when every one is a bulk
    or simple string; -1 when it is anything else, -2 when `data` stops before that is known."""
    cdef const char *p = PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data), at, eol, end, size, i, j
    cdef bytes head
    eol = _eol(p, n, 0)
    if eol < 0:
        return -2
    head = b"*%d" % count
    if eol != PyBytes_GET_SIZE(head) or memcmp(p, PyBytes_AS_STRING(head), eol) != 0:
        return -1
    at = eol + 2
    for i in range(count):
        eol = _eol(p, n, at)
        if eol < 0:
            return -2
        if p[at] == b'+':
            at = eol + 2
            continue
        if p[at] != b'$' or eol - at - 1 < 1 or eol - at - 1 > 18 or (p[at + 1] == b'0' and eol - at - 1 > 1):
            return -1  # a length as Redis writes it: no leading 0
        size = 0
        for j in range(at + 1, eol):
            if p[j] < b'0' or p[j] > b'9':
                return -1
            size = size * 10 + (p[j] - 48)
        end = eol + 2 + size
        if end + 2 > n:
            return -2
        if p[end] != b'\r' or p[end + 1] != b'\n':
            return -1
        at = end + 2
    return at


# -- Packed: a stream's entries packed as they are queued ---------------------------------------


cdef inline int _put(bytes b) except -1:
    global _size
    _reserve(PyBytes_GET_SIZE(b))
    memcpy(_buf + _size, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))
    _size += PyBytes_GET_SIZE(b)
    return 0


cdef bytes pack_args(list items):
    """Each of `items` as the bulk string `XADD`'s arguments carry it (bytes as they are, str as UTF-8,
    int in decimal), joined: a part of a command to write again and again."""
    global _size
    _size = 0
    for item in items:
        _arg(item)
    packed = PyBytes_FromStringAndSize(_buf, _size)
    _size = 0
    return packed

cdef char *_saved_buf = NULL
cdef Py_ssize_t _saved_cap = 0


cdef inline void _use(Packed p) noexcept:
    """The packer writes at the end of `p`'s commands (`_done` gives the buffer back)."""
    global _buf, _cap, _size, _saved_buf, _saved_cap
    _saved_buf, _saved_cap = _buf, _cap
    _buf, _cap, _size = p.buf, p.cap, p.size


cdef inline void _done(Packed p, bint keep) noexcept:
    """`p` takes its buffer back (grown, perhaps), with what was written when `keep`."""
    global _buf, _cap, _size
    p.buf, p.cap = _buf, _cap
    if keep:
        p.size = _size
    _buf, _cap, _size = _saved_buf, _saved_cap, 0


cdef bint _after(const char *a, Py_ssize_t an, const char *b, Py_ssize_t bn) noexcept:
    """`a > b`, for UTF-8 text: code point order is byte order."""
    cdef Py_ssize_t n = an if an < bn else bn
    cdef int c = memcmp(a, b, n)
    return c > 0 or (c == 0 and an > bn)


cdef bint _ascending(Packed p) noexcept:
    """Each position after the one before (then past a mark the first is past, all are)."""
    cdef Py_ssize_t i, ps = 0, pe, prev_s = 0, prev_e = -1
    for i in range(p.count_):
        pe = p.ends[2 * i + 1]
        if prev_e >= 0 and not _after(p.pos + ps, pe - ps, p.pos + prev_s, prev_e - prev_s):
            return False
        prev_s, prev_e, ps = ps, pe, pe
    return True


cdef class Positions:
    """The positions of a `Packed`'s entries as they were when taken, a sequence of str read when asked."""
    cdef bytes chars
    cdef bytes ends  # per entry: where its position ends in `chars` (Py_ssize_t each)
    cdef Py_ssize_t count

    def __cinit__(self, Packed packed):
        cdef Py_ssize_t i
        cdef Py_ssize_t *ends
        self.count = packed.count_
        self.chars = PyBytes_FromStringAndSize(packed.pos, packed.pos_size)
        self.ends = PyBytes_FromStringAndSize(NULL, self.count * sizeof(Py_ssize_t))
        ends = <Py_ssize_t *>PyBytes_AS_STRING(self.ends)
        for i in range(self.count):
            ends[i] = packed.ends[2 * i + 1]

    def __len__(self):
        return self.count

    def __getitem__(self, Py_ssize_t i):
        cdef Py_ssize_t *ends = <Py_ssize_t *>PyBytes_AS_STRING(self.ends)
        cdef Py_ssize_t start
        if i < 0:
            i += self.count
        if i < 0 or i >= self.count:
            raise IndexError("position index out of range")
        start = ends[i - 1] if i else 0
        return PyUnicode_DecodeUTF8(PyBytes_AS_STRING(self.chars) + start, ends[i] - start, NULL)

    def __eq__(self, other):
        return list(self) == list(other) if isinstance(other, (list, Positions)) else NotImplemented

    def __repr__(self):
        return f"Positions({list(self)!r})"


cdef enum:
    KEEP = 64 * 1024  # bytes a cleared `Packed` keeps for the next batch, at least, in each buffer


cdef inline void _shrink(char **buf, Py_ssize_t *cap, Py_ssize_t used) noexcept:
    cdef char *smaller
    if cap[0] > KEEP and used < cap[0] // 4:
        smaller = <char *>realloc(buf[0], cap[0] // 2)
        if smaller != NULL:
            buf[0], cap[0] = smaller, cap[0] // 2


cdef class Packed:
    """A stream's entries as ``XADD stream * field value ...`` commands packed when appended, with their
    positions: the entries themselves are let go at once, while still in the cache (`cdc.sink.lane.Packed`)."""

    def __cinit__(self, bytes stream):
        self.stream = stream
        self.head = _head(stream)
        self.buf = <char *>malloc(4096)
        self.cap = 4096
        self.pos = <char *>malloc(1024)
        self.pos_cap = 1024
        self.slots = 64
        self.ends = <Py_ssize_t *>malloc(2 * self.slots * sizeof(Py_ssize_t))
        if self.buf == NULL or self.pos == NULL or self.ends == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.buf)
        free(self.pos)
        free(self.ends)

    cdef int _room(self) except -1:
        """Room in `ends` for one entry more."""
        cdef Py_ssize_t *grown
        if self.count_ == self.slots:
            grown = <Py_ssize_t *>realloc(self.ends, 4 * self.slots * sizeof(Py_ssize_t))
            if grown == NULL:
                raise MemoryError()
            self.ends, self.slots = grown, self.slots * 2
        return 0

    cdef int _record(self, const char *pos, Py_ssize_t size) except -1:
        """The entry whose command was just packed (up to `self.size`), at position `pos` (`size` bytes)."""
        _grow(&self.pos, &self.pos_cap, self.pos_size + size)
        memcpy(self.pos + self.pos_size, pos, size)
        self.pos_size += size
        self.ends[2 * self.count_] = self.size
        self.ends[2 * self.count_ + 1] = self.pos_size
        self.count_ += 1
        return 0

    cdef int append_entry(self, list entry) except -1:
        """Pack `entry` (field, value, ..., then its position, a str) at the end (taken as it is now)."""
        cdef Py_ssize_t n
        cdef const char *p
        if PyList_GET_SIZE(entry) == 0:
            raise IndexError("an entry without a position")
        position = <object>PyList_GET_ITEM(entry, PyList_GET_SIZE(entry) - 1)
        if type(position) is not str:
            raise TypeError(f"an entry's position is a str, not {type(position).__name__}")
        p = PyUnicode_AsUTF8AndSize(position, &n)
        return self.append_fields(entry, PyList_GET_SIZE(entry) - 1, p, n)

    cdef int append_fields(self, list entry, Py_ssize_t pairs, const char *pos, Py_ssize_t size) except -1:
        """Pack the first `pairs` items of `entry` (field, value, ...) at the end, the entry at position
        `pos` (`size` bytes of UTF-8): the compiled loop gives its position without making it a str."""
        cdef Py_ssize_t start = self.size
        cdef bytes command
        cdef int packed = 0
        self._room()
        if pairs % 2 == 0:
            _use(self)
            try:
                packed = _append_pairs(self.head, entry, pairs, 0)
            except Exception:
                packed = 0
            finally:
                _done(self, packed)
        if not packed:  # the reference packs this one (and raises what it raises)
            command = _reference()(self.stream, entry[:pairs] + [PyUnicode_DecodeUTF8(pos, size, NULL)])
            _grow(&self.buf, &self.cap, start + PyBytes_GET_SIZE(command))
            memcpy(self.buf + start, PyBytes_AS_STRING(command), PyBytes_GET_SIZE(command))
            self.size = start + PyBytes_GET_SIZE(command)
        self._record(pos, size)
        return 0

    cdef int append_tail(self, list entry, Py_ssize_t pairs, bytes before_seq, long long seq, bytes after_seq,
                         const char *pos, Py_ssize_t size) except -1:
        """Pack the first `pairs` items of `entry` (field, value, ...) and then the source position fields,
        `before_seq` (``lsn`` and its value, and the name ``seq``, packed by `pack_args`), `seq` and
        `after_seq` (``xid``, ``ts_ms``, ``v`` and their values, packed), the entry at position `pos`:
        the compiled loop packs a transaction's fields once, not once per entry. 0, with nothing packed,
        when the first items are not all packed here (the caller then appends the whole entry)."""
        cdef int packed = 0
        if pairs % 2:
            return 0
        self._room()
        _use(self)
        try:
            packed = _append_pairs(self.head, entry, pairs, 10)
            if packed:
                _put(before_seq)
                _decimal_of(seq)
                _put(after_seq)
        except Exception:
            packed = 0
        finally:
            _done(self, packed)
        if not packed:
            return 0
        self._record(pos, size)
        return 1

    def append(self, list entry):
        """Pack `entry` (field, value, ..., then its position) at the end."""
        self.append_entry(entry)

    @property
    def count(self):
        return self.count_

    @property
    def last(self):
        """The last entry's position ('' when there is none)."""
        cdef Py_ssize_t start = self.ends[2 * self.count_ - 3] if self.count_ > 1 else 0
        if not self.count_:
            return ""
        return PyUnicode_DecodeUTF8(self.pos + start, self.ends[2 * self.count_ - 1] - start, NULL)

    def past(self, str held):
        """The commands of the entries whose position is past `held`, joined, and their positions."""
        cdef Py_ssize_t i, cs = 0, ps = 0, ce, pe, hn
        cdef list positions
        cdef list kept
        cdef const char *h = PyUnicode_AsUTF8AndSize(held, &hn)
        if not self.count_:
            return b"", []
        if _after(self.pos, self.ends[1], h, hn) and _ascending(self):
            # past the mark from the first on (the usual case): every one, their positions read when asked
            return PyBytes_FromStringAndSize(self.buf, self.size), Positions(self)
        positions, kept = [], []
        for i in range(self.count_):
            ce, pe = self.ends[2 * i], self.ends[2 * i + 1]
            if _after(self.pos + ps, pe - ps, h, hn):
                positions.append(PyUnicode_DecodeUTF8(self.pos + ps, pe - ps, NULL))
                kept.append(cs)
                kept.append(ce)
            cs, ps = ce, pe
        if len(positions) == self.count_:
            return PyBytes_FromStringAndSize(self.buf, self.size), positions
        chunks = []
        for i in range(0, len(kept), 2):
            cs, ce = kept[i], kept[i + 1]
            chunks.append(PyBytes_FromStringAndSize(self.buf + cs, ce - cs))
        return b"".join(chunks), positions

    def copy(self):
        """Another `Packed` holding the same entries."""
        cdef Packed other = Packed(self.stream)
        _grow(&other.buf, &other.cap, self.size)
        _grow(&other.pos, &other.pos_cap, self.pos_size)
        if self.slots > other.slots:
            free(other.ends)
            other.ends = <Py_ssize_t *>malloc(2 * self.slots * sizeof(Py_ssize_t))
            if other.ends == NULL:
                raise MemoryError()
            other.slots = self.slots
        memcpy(other.buf, self.buf, self.size)
        memcpy(other.pos, self.pos, self.pos_size)
        memcpy(other.ends, self.ends, 2 * self.count_ * sizeof(Py_ssize_t))
        other.size, other.pos_size, other.count_ = self.size, self.pos_size, self.count_
        return other

    def clear(self):
        """Let every entry go. The buffers are kept for the next ones, and halved (down to `KEEP` bytes) each
        time they were less than a quarter full: a stream whose batches shrank, or that went quiet, gives
        back what a batch of many or huge entries made them grow to."""
        _shrink(&self.buf, &self.cap, self.size)
        _shrink(&self.pos, &self.pos_cap, self.pos_size)
        self.size = self.pos_size = self.count_ = 0
