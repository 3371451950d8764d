"""After a resync marker, a stream brings each row whole before it changes it.

A resync gives up a table's changes, writes the rebuild marker (op ``x``) to its mappings'
streams, and backfills the table online: its chunks (op ``r``, at their high watermarks) and
its live changes interleave. A consumer keyed by the entry's key ends exact whatever the order,
but one that applies changes as differences (a running total adds an after-image and subtracts a
before-image) needs more: after the marker, a row's first entry must bring its whole value, and
no row may be brought twice. Until the resync's last chunk, each of its mappings keeps the keys
its stream has brought since the marker (`Introduction.keys`), and:

- a live insert (``c``) brings its row;
- a live update of a row not brought yet comes as ``c``, its after-image without the before-image
  (which names a value the consumer never had): it is part of its transaction, as ``r`` (the backfill's,
  counted by no END record) is not; once brought, updates pass as they are. An update
  lacking a TOASTed value it did not resend (``unchanged``), or of a mapping whose ``ops`` leave out
  ``c``, cannot bring the row: it passes as it is and its row comes with its chunk;
- a live delete of a row not brought is left out (the consumer never had the row);
- a chunk's row already brought (changed live since the marker) is left out: the stream holds
  a newer value, which the window of its chunk would not always catch (the change may precede it);
- a truncate leaves nothing brought.

Why every row is brought exactly once: a row not brought yet that exists lies in a chunk still to
come (a chunk before it would have brought it, or the row was inserted after that chunk, and its
insert brought it), so it is brought by that chunk or by a live change first, never both.

The keys are the entries' key JSON (key fields sorted where there are several), as text, so the state can be
rebuilt from a stream itself (`Introduction.from_entries`): what a bridge restarted in the middle
of a resync reads back. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson

__all__ = ["Introduction", "canonical_key"]

_SORTED = orjson.OPT_SORT_KEYS


def canonical_key(key: bytes, several: bool) -> bytes:
    """An entry's key JSON as the keys hold it: as it is for one key field, re-serialised with its fields sorted
    for several (a delete lists them in field order, the other ops in the key's order)."""
    return orjson.dumps(orjson.loads(key), option=_SORTED) if several else key


class Introduction:
    """The rows one mapping's stream has brought since its resync marker (see the module)."""

    __slots__ = ("keys", "several", "creates", "converted", "left_out")

    def __init__(self, several: bool = False, creates: bool = True) -> None:
        self.keys: set[str] = set()
        self.several = several  # the key has several fields
        #: the mapping publishes creates (`ops`): without, an update cannot bring its row (as c), and passes as it is
        self.creates = creates
        self.converted = 0  # live updates brought as c
        self.left_out = 0  # live deletes and chunk rows left out

    def key_of(self, key: bytes) -> str:
        """The key as the set holds it: text, a compact copy (orjson's bytes keep the capacity they were written
        with, kilobytes each: a million of them held would take gigabytes)."""
        return canonical_key(key, self.several).decode()

    def live(self, fields: list, old_key: bytes | None = None) -> list | None:
        """A live change's entry fields as the stream takes them, or None to leave it out; `old_key`: the key JSON
        before an update that changed it (None: unchanged)."""
        op = fields[1]
        key = self.key_of(fields[3])
        if op == b"c":
            self.keys.add(key)
            return fields
        had = (self.key_of(old_key) if old_key is not None else key) in self.keys
        if op == b"d":
            if had:
                return fields
            self.left_out += 1
            return None
        if op != b"u" or had:
            self.keys.add(key)
            return fields
        if not self.creates or b"unchanged" in fields[4::2]:
            return fields  # cannot bring the row: its chunk does
        self.keys.add(key)
        self.converted += 1
        return [b"op", b"c", b"key", fields[3], b"data", fields[5]]

    def chunk_row(self, key: bytes) -> bool:
        """A chunk's row with this key JSON: True to publish it (it is brought now), False to leave it out."""
        held = self.key_of(key)
        if held in self.keys:
            self.left_out += 1
            return False
        self.keys.add(held)
        return True

    def truncated(self) -> None:
        """A truncate: no row is brought any more."""
        self.keys.clear()

    @classmethod
    def from_entries(cls, entries: Iterable[tuple[bytes, bytes, bool]], several: bool = False,
                     creates: bool = True) -> Introduction:
        """The state a stream's entries after its resync marker leave: (op, key JSON, whether it lists `unchanged`
        fields) in order. What `live` and `chunk_row` add, each entry they let through adds; an update that could
        not bring its row (`unchanged`, or no creates) adds nothing, as there."""
        intro = cls(several, creates)
        for op, key, unchanged in entries:
            if op == b"t":
                intro.truncated()
            elif op in (b"c", b"r") or (op == b"u" and not unchanged and creates):
                intro.keys.add(intro.key_of(key))
        return intro
