# The compiled `Packed`, declared for `cdc.bridge._changes`, which appends to it without Python's call machinery.

cdef class Packed:
    cdef readonly bytes stream
    cdef bytes head  # ``XADD``, the stream and ``*``, packed
    cdef char *buf  # the commands, joined
    cdef Py_ssize_t size, cap
    cdef char *pos  # the positions' characters (ASCII), joined
    cdef Py_ssize_t pos_size, pos_cap
    cdef Py_ssize_t *ends  # per command: where it ends in `buf`, then where its position ends in `pos`
    cdef Py_ssize_t count_, slots
    cdef int _room(self) except -1
    cdef int _record(self, const char *pos, Py_ssize_t size) except -1
    cdef int append_entry(self, list entry) except -1
    cdef int append_fields(self, list entry, Py_ssize_t pairs, const char *pos, Py_ssize_t size) except -1
    cdef int append_tail(self, list entry, Py_ssize_t pairs, bytes before_seq, long long seq, bytes after_seq,
                         const char *pos, Py_ssize_t size) except -1


cdef bytes pack_args(list items)
