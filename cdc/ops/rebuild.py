"""What a rebuilt stream must say, computed from what it already says (pure, no I/O).

After Redis lost a range of entries, a stream no longer replays to its table. A
rebuild appends, at one position:

1. a delete (``op: d``) for every key the stream still holds alive but the table
   no longer has: rows deleted inside the lost range would otherwise live on;
2. a marker (``op: x``) telling consumers that the stream was rebuilt: what follows
   it is the whole table, so a consumer may reset its state there;
3. every row of the table the mapping publishes (``op: r``).

`known_rows` replays a stream's entries into the keys it holds alive (with their
last record, the before-image of a tombstone); `tombstone` and `marker` form the
entries' fields.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson

__all__ = ["REBUILT", "KnownRows", "marker", "tombstone"]

#: the marker's op: the entries after it, at its commit position, are the whole table
REBUILT = b"x"
EMPTY_KEY = b"{}"


class KnownRows:
    """The keys a stream holds alive, by their `key` text, with the record it last told for each."""

    def __init__(self) -> None:
        self.rows: dict[bytes, bytes | None] = {}
        self.entries = 0

    def apply(self, fields: dict) -> None:
        """Apply one entry (bytes field names and values, as XRANGE returns them)."""
        self.entries += 1
        op = fields.get(b"op")
        if op in (b"c", b"u", b"r"):
            key = fields[b"key"]
            data = fields.get(b"data")
            if op == b"u" and b"unchanged" in fields and self.rows.get(key):
                # fields the server did not resend keep the value the stream told before
                data = orjson.dumps({**orjson.loads(self.rows[key]), **orjson.loads(data or b"{}")})
            self.rows[key] = data
        elif op == b"d":
            self.rows.pop(fields[b"key"], None)
        elif op == b"t":
            self.rows.clear()
        # m (messages) carry no row; x (an earlier rebuild) changes nothing by itself: the
        # rows and deletes that follow it do, so a rebuild cut short is completed by the next one

    def extend(self, entries: Iterable[dict]) -> None:
        for fields in entries:
            self.apply(fields)


def tombstone(key: bytes, last: bytes | None, with_before: bool) -> list:
    """A delete for `key`; its before-image is the record the stream last told (when the mapping sends one)."""
    fields = [b"op", b"d", b"key", key]
    if with_before and last is not None:
        fields += [b"before", last]
    return fields


def marker(snapshot: str, lost_from: str | None, lost_to: str | None) -> list:
    """The rebuilt marker: where the table was read, and the range Redis had lost (if recorded)."""
    data = {"rebuilt": True, "snapshot": snapshot, "lost_from": lost_from, "lost_to": lost_to}
    return [b"op", REBUILT, b"key", EMPTY_KEY, b"data", orjson.dumps(data)]
