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

The stream keys are watched too, and their TYPE read in the same round trip
(``EXEC, WATCH marks.. streams.., MGET marks.., TYPE stream..``), so a
transaction is refused before MULTI when a key holds another type or a stream
whose mark says it held entries is gone (`cdc.sink.streamkeys`): a command
failing inside EXEC would not roll back the marks set beside it, and an XADD
would re-create a vanished stream. Whatever changes a stream key after that
read (XADD, DEL, a type change, an XTRIM that removes entries; not reads, acks
or group changes) aborts the EXEC, and the batch is judged again. A watched mark
(or the flushed record) that was set and reads unset was lost under the lane
(FLUSHALL, FLUSHDB): that too is refused, as a data loss.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import hiredis

from .. import speedups
from ..errors import PublishError, TransientError
from .node import PLAIN, Node, classify
from .streamkeys import stream_key_error, vanished_mark_error

__all__ = ["TransactionLane", "xadd_command", "pack_past", "pack_entries", "plain_array_end", "Packed", "packer"]

log = logging.getLogger("cdc.publish")

MULTI = hiredis.pack_command((b"MULTI",))
EXEC = hiredis.pack_command((b"EXEC",))
OK, QUEUED = b"+OK\r\n", b"+QUEUED\r\n"  # MULTI's reply, and each accepted command's
#: the types of a reply that is no error (hiredis gives bulk and simple strings as bytes, numbers as int)
_PLAIN_REPLIES = frozenset((bytes, int))
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


def pack_past(stream: bytes, entries: Sequence[Sequence], held: str) -> tuple[bytes, list[str]]:
    """The ``XADD`` commands of the entries whose position (last item) is past `held`, joined, and
    those entries' positions, in order.
    """
    commands = []
    positions = []
    for entry in entries:
        pos = entry[-1]
        if pos > held:
            commands.append(xadd_command(stream, entry))
            positions.append(pos)
    return b"".join(commands), positions


class Packed:
    """A stream's entries packed as ``XADD`` commands as they are appended, with their positions.

    The specification keeps the entries and packs them when asked; the compiled twin packs each at once
    and lets the entry go while it is still in the cache. Either way `past` is `pack_past` of the entries
    appended since the last `clear`, as they were when appended.
    """

    def __init__(self, stream: bytes) -> None:
        self.stream = stream
        self._entries: list[list] = []

    def append(self, entry: list) -> None:
        """Pack `entry` (field, value, ..., then its position, a str) at the end."""
        if type(entry[-1]) is not str:
            raise TypeError(f"an entry's position is a str, not {type(entry[-1]).__name__}")
        self._entries.append(list(entry))

    @property
    def count(self) -> int:
        return len(self._entries)

    @property
    def last(self) -> str:
        """The last entry's position ('' when there is none)."""
        return self._entries[-1][-1] if self._entries else ""

    def past(self, held: str) -> tuple[bytes, Sequence[str]]:
        """The commands of the entries whose position is past `held`, joined, and their positions."""
        return pack_past(self.stream, self._entries, held)

    def copy(self) -> Packed:
        """Another `Packed` holding the same entries."""
        other = Packed(self.stream)
        other._entries = list(self._entries)
        return other

    def clear(self) -> None:
        """Let every entry go."""
        self._entries.clear()


def command_ends(packed: bytes, count: int) -> list[int]:
    """Where each of the `count` RESP commands joined in `packed` ends (walked by their lengths)."""
    ends = []
    at = 0
    for _ in range(count):
        eol = packed.index(b"\r\n", at)
        args = int(packed[at + 1:eol])  # *N
        at = eol + 2
        for _ in range(args):
            eol = packed.index(b"\r\n", at)
            at = eol + 2 + int(packed[at + 1:eol]) + 2  # $len, the bytes, \r\n
        ends.append(at)
    if at != len(packed):
        raise ValueError(f"{len(packed) - at} bytes past {count} commands")
    return ends


def command_args(packed: bytes) -> list[list[bytes]]:
    """The arguments of each RESP command joined in `packed` (``XADD stream * field value ...``: its list)."""
    commands = []
    at = 0
    while at < len(packed):
        eol = packed.index(b"\r\n", at)
        count = int(packed[at + 1:eol])  # *N
        at = eol + 2
        args = []
        for _ in range(count):
            eol = packed.index(b"\r\n", at)
            size = int(packed[at + 1:eol])  # $len
            args.append(packed[eol + 2:eol + 2 + size])
            at = eol + 2 + size + 2
        commands.append(args)
    return commands


def plain_array_end(data: bytes, count: int) -> int:
    """Where the RESP array of `count` replies at the start of `data` ends, when every one of them is a
    bulk or simple string (an EXEC's entry IDs and OKs); -1 when it is anything else (an error, nil, an
    array of another length: the replies must be parsed), -2 when `data` stops before that is known."""
    eol = data.find(b"\r\n")
    if eol < 0:
        return -2
    if data[:eol] != b"*%d" % count:
        return -1
    at = eol + 2
    for _ in range(count):
        eol = data.find(b"\r\n", at)
        if eol < 0:
            return -2
        kind = data[at:at + 1]
        if kind == b"+":
            at = eol + 2
        elif kind == b"$" and data[at + 1:eol].isdigit() and eol - at - 1 <= 18 and (
                data[at + 1] != 48 or eol - at - 1 == 1):  # a length as Redis writes it: no leading 0
            end = eol + 2 + int(data[at + 1:eol])
            if end + 2 > len(data):
                return -2
            if data[end:end + 2] != b"\r\n":
                return -1
            at = end + 2
        else:
            return -1
    return at


_compiled = speedups.load("cdc.sink._resp")
#: `pack_past`, compiled where the extension is built (the same bytes)
pack_entries = _compiled.pack_past if _compiled is not None else pack_past
#: `plain_array_end`, compiled where the extension is built (the same answers)
array_end = _compiled.plain_array_end if _compiled is not None else plain_array_end
#: the compiled `Packed`, where the extension is built: batches pack their entries as they are queued
#: (the pure `Packed` would only keep them; without it batches keep their entries until sent)
packer = _compiled.Packed if _compiled is not None else None


class _Part:
    """One stream's share of a transaction: its entries past the mark `held`, packed (the entries
    themselves are let go once packed, while still in the cache), with their positions, and how many
    entries of the batch the filters left out (so that the part can be filtered again after an abort)."""

    __slots__ = ("stream", "mark", "packed", "positions", "held", "dropped")

    def __init__(self, stream: str, mark: str, packed: bytes, positions: Sequence[str], held: str, dropped: int) -> None:
        self.stream, self.mark, self.packed, self.positions = stream, mark, packed, positions
        self.held, self.dropped = held, dropped

    def past(self, held: str) -> _Part:
        """The part filtered again against the mark `held` Redis holds now (after an aborted EXEC)."""
        positions = self.positions
        if held < self.held and self.dropped:
            # entries left out against the higher mark may be due now, and they were not kept
            raise TransientError(f"the mark {self.mark} moved back under the bridge (from {self.held} to "
                                 f"{held or 'unset'}) while a batch was appended; the batch is read again from the slot")
        keep = [i for i, pos in enumerate(positions) if pos > held]
        if len(keep) == len(positions):
            return _Part(self.stream, self.mark, self.packed, positions, held, self.dropped)
        packed, ends = self.packed, command_ends(self.packed, len(positions))
        starts = [0, *ends]
        return _Part(self.stream, self.mark, b"".join([packed[starts[i]:ends[i]] for i in keep]),
                     [positions[i] for i in keep], held, self.dropped + len(positions) - len(keep))


class _Plan:
    """One pipeline sent on a lane and what its replies mean."""

    __slots__ = ("parts", "flushed", "after", "queued", "appended", "watched")

    def __init__(self, parts, flushed, after, queued, appended, watched) -> None:
        self.parts, self.flushed, self.after = parts, flushed, after
        self.queued, self.appended, self.watched = queued, appended, watched


def _refuse(stream: str, key_type: str, mark: str) -> None:
    """The default judge of a stream key: raise when nothing may be appended to it."""
    error = stream_key_error(stream, key_type, mark)
    if error is not None:
        raise error


class TransactionLane:
    """One connection appending to its streams in transactions that EXEC only if no mark or stream changed."""

    def __init__(self, node: Node, judge=_refuse) -> None:
        self.node = node
        #: mark key -> position Redis holds ('' when the stream was never written); valid while watched
        self.marks: dict[str, str] = {}
        #: stream key -> its TYPE ('stream', 'none', or another type); valid while watched
        self.types: dict[str, str] = {}
        #: raises when a stream may not be appended to, given its key's type and its mark (`cdc.sink.streamkeys`)
        self.judge = judge
        self._tail: tuple[list[str], list[str], bytes] | None = None  # the watch-and-read commands, packed
        self._plan: _Plan | None = None
        self._watching_on = -1  # the node's connection the marks are watched on
        self._largest = 0  # bytes of the largest transaction sent

    def reserve(self) -> int:
        """Bytes Redis may need to queue the next transaction, judged by the largest one so far, twice
        while one is sent and not confirmed: Redis may not have queued it yet when its memory is read."""
        return self._largest * QUEUE_MEMORY_FACTOR * (2 if self._plan is not None else 1)

    def _forget(self) -> None:
        self.marks.clear()
        self.types.clear()
        self._tail = None

    def _watch_tail(self, mark_keys: Sequence[str], streams: Sequence[str]) -> bytes:
        """``WATCH marks.. streams.., MGET marks.., TYPE stream..``, packed."""
        commands = [hiredis.pack_command((b"WATCH", *mark_keys, *streams))]
        if mark_keys:
            commands.append(hiredis.pack_command((b"MGET", *mark_keys)))
        commands += [hiredis.pack_command((b"TYPE", s)) for s in streams]
        return b"".join(commands)

    def _learn(self, mark_keys: Sequence[str], streams: Sequence[str], replies: list) -> None:
        """Take in the replies of `_watch_tail`."""
        for reply in replies:
            if isinstance(reply, Exception):
                self._forget()
                raise classify(reply)
        values = replies[1] if mark_keys else []
        marks = self.marks
        for key, value in zip(mark_keys, values):
            if value:
                marks[key] = value.decode()
            elif marks.get(key):  # set, and gone: never the lane's doing (its marks only move forward)
                held = marks[key]
                self._forget()
                raise vanished_mark_error(key, held)
            else:
                marks[key] = ""
        for stream, key_type in zip(streams, replies[2 if mark_keys else 1:]):
            self.types[stream] = key_type.decode()

    def _arm(self, mark_keys: Sequence[str], streams: Sequence[str]) -> None:
        """Watch `mark_keys` and `streams`, learn their values and types (one round trip; a stream's first batch)."""
        self._tail = None
        self.node.send([self._watch_tail(mark_keys, streams)])
        n = 1 + (1 if mark_keys else 0) + len(streams)
        self._learn(mark_keys, streams, self.node.receive(n)[0])

    def send(self, group: Sequence[tuple[str, str, list, Packed | None]], flushed: tuple[str, int] | None,
             after: list[bytes]) -> None:
        """Send one transaction appending each (stream, mark key, entries, packed) past its mark: the
        entries `packed` holds (if any), then those of the list.

        `flushed` (key, LSN), the record of how far Redis holds the source, is moved
        in the same transaction, and only forward: it is watched like the marks, so a
        stale writer can never set it back. `after` follows the transaction in the
        pipeline (WAIT, test faults), before the keys are watched again. The replies are read by `confirm()`.
        The entries are packed before this returns, and not held: the caller may let them go.
        """
        self._ready([(stream, mark) for stream, mark, _, _ in group], flushed)
        marks = self.marks
        parts = []
        for stream, mark, entries, packed in group:
            held = marks[mark]
            total = len(entries)
            if packed is not None and packed.count:
                total += packed.count
                commands, positions = packed.past(held)
                if entries:
                    more, later = pack_entries(stream.encode(), entries, held)
                    commands += more
                    positions = [*positions, *later]
            else:
                commands, positions = pack_entries(stream.encode(), entries, held)
            parts.append(_Part(stream, mark, commands, positions, held, total - len(positions)))
        self._send(parts, flushed, after)

    def _ready(self, streams: Sequence[tuple[str, str]], flushed: tuple[str, int] | None) -> None:
        """Connected, with the marks of `streams` (stream, mark key) and `flushed` known and watched, and
        every stream key judged: refused before MULTI, nothing of the batch is appended."""
        self.node.connection()
        if self._watching_on != self.node.connects:  # a new connection watches nothing yet
            self._forget()
            self._watching_on = self.node.connects
        new = [mark for _, mark in streams if mark not in self.marks]
        if flushed is not None and flushed[0] not in self.marks:
            new.append(flushed[0])
        new_streams = [stream for stream, _ in streams if stream not in self.types]
        if new or new_streams:
            self._arm(new, new_streams)
        marks, types = self.marks, self.types
        for stream, mark in streams:
            if types[stream] != "stream":
                try:
                    self.judge(stream, types[stream], marks[mark])
                except Exception:
                    if stream in new_streams:
                        raise
                    self._arm([mark], [stream])  # judged on what Redis holds now, not on a read before a fix
                    self.judge(stream, types[stream], marks[mark])

    def _send(self, parts: list[_Part], flushed: tuple[str, int] | None, after: list[bytes]) -> None:
        marks = self.marks
        commands = [MULTI]
        appended = []
        queued = 0  # commands inside MULTI/EXEC
        for part in parts:
            count = len(part.positions)
            if count:
                commands.append(part.packed)
                commands.append(hiredis.pack_command((b"SET", part.mark, part.positions[-1])))
                queued += count + 1
            appended.append(count)
        if flushed is not None and flushed[1] > int(marks[flushed[0]] or 0):
            commands.append(hiredis.pack_command((b"SET", flushed[0], str(flushed[1]))))
            queued += 1
        commands.append(EXEC)
        # `after` before the marks and stream keys are watched again: what it writes (a test fault's
        # duplicate XADDs) must not abort the next transaction
        commands += after
        if self._tail is None:
            watched, streams = list(marks), list(self.types)
            self._tail = (watched, streams, self._watch_tail(watched, streams))
        commands.append(self._tail[2])
        size = sum(map(len, commands))
        if size > self._largest:
            self._largest = size
        self.node.send(commands)
        self._plan = _Plan(parts, flushed, after, queued, appended, self._tail)

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
            watched, streams, _ = plan.watched
            reads = 1 + (1 if watched else 0) + len(streams)  # WATCH, MGET, TYPE..
            replies, accepted = self.node.receive(q + 2 + reads + len(plan.after), expect=OK + QUEUED * q,
                                                  plain=(q, array_end))
            if not accepted:  # some command was refused: find which
                for reply in replies[: 1 + q]:
                    if isinstance(reply, Exception):
                        self._forget()  # the transaction was discarded; learn the marks again
                        raise classify(reply)
                replies = replies[1 + q :]
            exec_reply = replies[0]
            n = len(plan.after)
            after = replies[1:1 + n]
            self._learn(watched, streams, replies[1 + n:1 + n + reads])
            if isinstance(exec_reply, Exception):
                self._forget()
                raise classify(exec_reply)
            if exec_reply is not None:
                # one reply per queued command (an entry ID per XADD, an OK per SET): checked unparsed
                # (`PLAIN`) when all are, else their types gathered in C, and looked at one by one only
                # when one is not a plain reply
                if exec_reply is not PLAIN and not _PLAIN_REPLIES.issuperset(map(type, exec_reply)):
                    for reply in exec_reply:
                        if isinstance(reply, Exception):
                            self._forget()
                            raise classify(reply)
                return plan.appended, after
            log.warning("a stream or its mark changed under the bridge (another writer, a recovery, a trim): "
                        "judging and filtering the batch again against what Redis holds")
            self._ready([(part.stream, part.mark) for part in plan.parts], plan.flushed)
            self._send([part.past(self.marks[part.mark]) for part in plan.parts], plan.flushed, plan.after)
        raise PublishError(f"stream marks kept changing during {MAX_ABORTS} attempts to append one batch",
                           hint="another process writes the same streams: stop every bridge but one on this slot")
