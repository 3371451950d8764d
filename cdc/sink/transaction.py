"""Appending with MULTI/EXEC, guarded by WATCH on the streams' high-water marks.

A lane is one connection that appends to a fixed set of streams (all of them on
a single server; one stream per lane on a cluster, where a transaction must stay
in one hash slot). Between two transactions the lane keeps every mark it knows
WATCHed, and it reads them right after watching: each pipeline ends with
``EXEC, WATCH marks.., MGET marks..``. So when the next batch is filtered
against the marks (only positions past a stream's mark are appended), those
marks are what Redis holds, and if anyone changes one before the next EXEC (a
second bridge on the same streams, a recovery rewriting marks), that EXEC
appends nothing and the lane filters again against the new marks. Entries and
marks move together or not at all, as with the append script, but Redis runs
plain XADDs instead of a Lua wrapper around each one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import hiredis

from .. import speedups
from ..errors import PublishError
from .node import Node, classify

__all__ = ["TransactionLane", "xadd_command", "pack_past", "pack_entries"]

log = logging.getLogger("cdc.publish")

MULTI = hiredis.pack_command((b"MULTI",))
EXEC = hiredis.pack_command((b"EXEC",))
OK, QUEUED = b"+OK\r\n", b"+QUEUED\r\n"  # MULTI's reply, and each accepted command's
#: how often one batch is filtered again after marks changed under it before giving up
MAX_ABORTS = 20
#: Redis' memory for a queued transaction per byte of its commands (measured on Redis 7.0: 2,000
#: queued XADDs of 255 bytes took 1.75 MB until EXEC, 3.4 times their bytes); a memory limit must
#: leave that much room, so the bridge's backpressure counts it (`TransactionLane.reserve`)
QUEUE_MEMORY_FACTOR = 4

_templates: dict[tuple, bytes] = {}


def _template(stream: bytes, names: tuple) -> bytes:
    # the template is itself a format string: a literal % in a name is written %%
    parts = [b"*%d\r\n$4\r\nXADD\r\n$%d\r\n%s\r\n$1\r\n*\r\n" % (3 + 2 * len(names), len(stream),
                                                                  stream.replace(b"%", b"%%"))]
    for name in names:
        name = name if type(name) is bytes else str(name).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(name), name.replace(b"%", b"%%")) + b"$%d\r\n%s\r\n")
    return b"".join(parts)


def xadd_command(stream: bytes, entry: Sequence) -> bytes:
    """``XADD stream * field value ...`` for an entry (its field/value list, then its position), packed.

    The same bytes as ``hiredis.pack_command``, about twice as fast: the fields of
    a stream's entries repeat, so their part of the command is formatted once.
    """
    names = tuple(entry[0:-1:2])
    try:
        template = _templates.get((stream, names))
    except TypeError:  # an unhashable name: never cached
        template = None
    if template is None:
        template = _template(stream, names)
        if all(type(name) is bytes for name in names):  # 1, True and 1.0 are equal keys but pack differently
            _templates[(stream, names)] = template
    args = []
    for value in entry[1:-1:2]:
        if type(value) is not bytes:
            value = value.encode() if type(value) is str else b"%d" % value if type(value) is int else str(value).encode()
        args.append(len(value))
        args.append(value)
    return template % tuple(args)


def pack_past(stream: bytes, entries: Sequence[Sequence], held: str) -> tuple[bytes, int, str | None]:
    """The ``XADD`` commands of the entries whose position (last item) is past `held`, joined.

    Also how many there are and the last one's position (None when there is none).
    """
    commands = []
    last = None
    for entry in entries:
        pos = entry[-1]
        if pos > held:
            commands.append(xadd_command(stream, entry))
            last = pos
    return b"".join(commands), len(commands), last


_compiled = speedups.load("cdc.sink._resp")
#: `pack_past`, compiled where the extension is built (the same bytes)
pack_entries = _compiled.pack_past if _compiled is not None else pack_past


class _Plan:
    """One pipeline sent on a lane and what its replies mean."""

    __slots__ = ("group", "flushed", "after", "queued", "appended", "watched")

    def __init__(self, group, flushed, after, queued, appended, watched) -> None:
        self.group, self.flushed, self.after = group, flushed, after
        self.queued, self.appended, self.watched = queued, appended, watched


class TransactionLane:
    """One connection appending to its streams in transactions that EXEC only if no mark moved."""

    def __init__(self, node: Node) -> None:
        self.node = node
        #: mark key -> position Redis holds ('' when the stream was never written); valid while watched
        self.marks: dict[str, str] = {}
        self._plan: _Plan | None = None
        self._watching_on = -1  # the node's connection the marks are watched on
        self._largest = 0  # bytes of the largest transaction sent

    def reserve(self) -> int:
        """Bytes Redis may need to queue the next transaction, judged by the largest one so far."""
        return self._largest * QUEUE_MEMORY_FACTOR

    def _arm(self, mark_keys: Sequence[str]) -> None:
        """Watch `mark_keys` and learn their values (one round trip; the first batch of a stream)."""
        replies = self.node.round_trip([hiredis.pack_command((b"WATCH", *mark_keys)),
                                        hiredis.pack_command((b"MGET", *mark_keys))])
        for reply in replies:
            if isinstance(reply, Exception):
                self.marks.clear()
                raise classify(reply)
        for key, value in zip(mark_keys, replies[1]):
            self.marks[key] = value.decode() if value else ""

    def send(self, group: Sequence[tuple[str, str, list]], flushed: tuple[str, int] | None,
             after: list[bytes]) -> None:
        """Send one transaction appending each (stream, mark key, entries) past its mark.

        `flushed` (key, LSN), the record of how far Redis holds the source, is moved
        in the same transaction, and only forward: it is watched like the marks, so a
        stale writer can never set it back. `after` follows the transaction in the
        pipeline (WAIT, test faults). The replies are read by `confirm()`.
        """
        self.node.connection()
        if self._watching_on != self.node.connects:  # a new connection watches nothing yet
            self.marks.clear()
            self._watching_on = self.node.connects
        new = [mark for _, mark, _ in group if mark not in self.marks]
        if flushed is not None and flushed[0] not in self.marks:
            new.append(flushed[0])
        if new:
            self._arm(new)
        commands = [MULTI]
        appended = []
        marks = self.marks
        queued = 0  # commands inside MULTI/EXEC
        for stream, mark, entries in group:
            packed, count, last = pack_entries(stream.encode(), entries, marks[mark])
            if last is not None:
                commands.append(packed)
                commands.append(hiredis.pack_command((b"SET", mark, last)))
                queued += count + 1
            appended.append(count)
        if flushed is not None and flushed[1] > int(marks[flushed[0]] or 0):
            commands.append(hiredis.pack_command((b"SET", flushed[0], str(flushed[1]))))
            queued += 1
        commands.append(EXEC)
        watched = list(marks)
        commands.append(hiredis.pack_command((b"WATCH", *watched)))
        commands.append(hiredis.pack_command((b"MGET", *watched)))
        size = sum(map(len, commands))
        if size > self._largest:
            self._largest = size
        self.node.send(commands + after)
        self._plan = _Plan(group, flushed, after, queued, appended, watched)

    def confirm(self) -> tuple[list[int], list]:
        """Read the replies of the last send: entries appended per stream, and the `after` replies.

        When a watched mark moved before EXEC, nothing was appended; the batch is
        filtered again against the marks as they are now and sent again.
        """
        for _ in range(MAX_ABORTS):
            plan, self._plan = self._plan, None
            if plan is None:
                return [], []
            q = plan.queued
            replies, accepted = self.node.receive(q + 4 + len(plan.after), expect=OK + QUEUED * q)
            if not accepted:  # some command was refused: find which
                for reply in replies[: 1 + q]:
                    if isinstance(reply, Exception):
                        self.marks.clear()  # the transaction was discarded; learn the marks again
                        raise classify(reply)
                replies = replies[1 + q :]
            exec_reply, watch, values = replies[:3]
            after = replies[3:]
            for reply in (watch, values):
                if isinstance(reply, Exception):
                    self.marks.clear()
                    raise classify(reply)
            for key, value in zip(plan.watched, values):
                self.marks[key] = value.decode() if value else ""
            if isinstance(exec_reply, Exception):
                self.marks.clear()
                raise classify(exec_reply)
            if exec_reply is not None:
                for reply in exec_reply:
                    if isinstance(reply, Exception):
                        self.marks.clear()
                        raise classify(reply)
                return plan.appended, after
            log.warning("a stream mark changed under the bridge (another writer or a recovery): "
                        "filtering the batch again against the marks Redis holds")
            self.send(plan.group, plan.flushed, plan.after)
        raise PublishError(f"stream marks kept changing during {MAX_ABORTS} attempts to append one batch",
                           hint="another process writes the same streams: stop every bridge but one on this slot")
