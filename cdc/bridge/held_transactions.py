"""Streamed in-progress transactions: their messages held until the transaction ends.

With pgoutput streaming (protocol 2 and later, `postgres.streaming`), the server
sends a large transaction's changes while it is still running, in blocks between
Stream Start and Stream Stop, each message carrying the xid of the
(sub)transaction it belongs to. Nothing may reach Redis before the commit, so the
bridge holds those messages here, in arrival order, per top-level transaction:

- a Stream Abort of a subtransaction drops that subtransaction's changes; one
  naming the top-level xid drops the whole transaction;
- a Stream Commit hands the messages back, in order and without their xid, exactly
  as an unstreamed transaction would have carried them between Begin and Commit.
  The session routes them with the commit's position, so every entry gets the
  same position either way (and a replay after a crash finds the same marks).

Memory is bounded: past `limit` bytes held in memory, all transactions together,
the largest one's messages move to a file of its own under `directory`, read back
at its commit. Spill files are anonymous (unlinked from the start): the system frees
them when the bridge ends, even by kill -9, so none is ever left behind.

Held messages change nothing in what the slot is told: it moves at commits and
quiet keepalives as without streaming, and every position it is told lies before
the commit of any transaction still held. After a crash or a reconnection the
server sends again every transaction committing past the told position, a
streamed one from its start (tests/bridge/test_streaming.py drops the connection
after the slot moved past an open transaction's start).
"""

from __future__ import annotations

import struct
import tempfile
from collections.abc import Iterator
from typing import BinaryIO

from ..errors import ConfigError, SourceError, TransientError

__all__ = ["Held", "StreamedTransactions", "OVERHEAD", "spill_dir_error", "spill_place"]

#: the memory a held message costs beyond its bytes (the bytes object's header and its list slot)
OVERHEAD = 41
_LENGTH = struct.Struct(">I")
_XID = _LENGTH.unpack_from  # the (sub)transaction xid after a streamed message's kind
#: messages a subtransaction's abort drops; a Relation (or Type) describes a table, whoever sent it
_CHANGES = frozenset(b"IUDTM")
_CHUNK = 1 << 20  # bytes written to a spill file at a time


def spill_place(directory: str | None) -> str:
    """Where spill files go for `batch.spill_dir` = `directory` (empty: the system's temporary directory)."""
    return directory or tempfile.gettempdir()


def spill_dir_error(directory: str, source: str) -> ConfigError | None:
    """Why streamed transactions could not spill to `directory` (empty: the system's), as `cdc run`
    refuses to start and `cdc check` reports it (`source`: the config file), or None."""
    try:
        with tempfile.TemporaryFile(dir=directory or None, prefix="cdc-stream-") as f:
            f.write(b"x")
    except OSError as exc:
        return ConfigError(f"{source}: batch.spill_dir: cannot write spill files in {spill_place(directory)}: "
                           f"{exc.strerror or exc}",
                           hint="create the directory, or point batch.spill_dir at a writable one")
    return None


class Held:
    """One top-level transaction's streamed messages: in memory, after those spilled to its file."""

    __slots__ = ("xid", "messages", "size", "file", "spilled", "aborted")

    def __init__(self, xid: int) -> None:
        self.xid = xid
        self.messages: list[bytes] = []  # each a pgoutput message as streamed: kind, xid, body
        self.size = 0  # memory the messages take (see OVERHEAD)
        self.file: BinaryIO | None = None
        self.spilled = 0  # bytes written to the file
        self.aborted: set[int] = set()  # subtransactions aborted after their messages were spilled

    def replay(self) -> Iterator[bytes]:
        """The messages of the committed transaction, in order, each without its xid."""
        if self.file is not None:
            f = self.file
            f.flush()
            f.seek(0)
            read, aborted, end = f.read, self.aborted, self.spilled
            at = 0
            while at < end:
                (n,) = _LENGTH.unpack(read(4))
                message = read(n)
                at += 4 + n
                if aborted and message[0] in _CHANGES and _XID(message, 1)[0] in aborted:
                    continue
                yield message[:1] + message[5:]
        for message in self.messages:
            yield message[:1] + message[5:]

    def close(self) -> None:
        self.messages = []
        self.size = 0
        if self.file is not None:
            self.file.close()
            self.file = None


class StreamedTransactions:
    """The open streamed transactions of one replication session.

    Which block is being received is the decoder's to know (`PgOutputDecoder.stream_xid`:
    it reads a change's xid prefix by it): each message added names its transaction.
    """

    __slots__ = ("limit", "directory", "held", "size", "spilled_bytes", "committed", "aborted")

    def __init__(self, limit: int, directory: str | None = None) -> None:
        self.limit = limit  # bytes held in memory before the largest transaction spills
        self.directory = directory or None  # None: the system's temporary directory
        self.held: dict[int, Held] = {}
        self.size = 0  # memory held, all transactions together
        self.spilled_bytes = 0  # written to spill files since start (a counter)
        self.committed = self.aborted = 0  # streamed transactions ended (counters)

    def start(self, xid: int, first: bool) -> None:
        """Stream Start: the messages until Stream Stop belong to `xid`."""
        if xid not in self.held:
            if not first:
                raise SourceError(
                    f"the server continued streamed transaction {xid} whose start this session never received",
                    hint="restart the bridge: a new session receives the transaction from its start",
                )
            self.held[xid] = Held(xid)

    def add(self, xid: int | None, message: bytes) -> None:
        """A message of a block of top-level transaction `xid` (None: outside any block), as streamed (its
        kind, its (sub)transaction's xid, its body)."""
        held = self.held.get(xid) if xid is not None else None
        if held is None:
            raise SourceError("a streamed change arrived outside a Stream Start/Stop block")
        held.messages.append(message)
        cost = len(message) + OVERHEAD
        held.size += cost
        self.size += cost
        if self.size > self.limit:
            self._spill()

    def abort(self, xid: int, subxid: int) -> None:
        """Stream Abort: drop `subxid`'s changes, or the whole transaction when `subxid` is `xid`."""
        held = self.held.get(xid)
        if held is None:
            return  # nothing of it was held (its blocks carried no published change)
        if subxid == xid:
            self._end(held)
            self.aborted += 1
            return
        kept = [m for m in held.messages if m[0] not in _CHANGES or _XID(m, 1)[0] != subxid]
        if len(kept) != len(held.messages):
            freed = held.size - sum(len(m) + OVERHEAD for m in kept)
            held.messages = kept
            held.size -= freed
            self.size -= freed
        if held.file is not None:
            held.aborted.add(subxid)

    def commit(self, xid: int) -> Iterator[bytes]:
        """Stream Commit: the transaction's messages in order, each without its xid; then it is gone."""
        held = self.held.get(xid)
        if held is None:
            return
        try:
            yield from held.replay()
        except OSError as exc:
            raise TransientError(f"cannot read back streamed transaction {xid} from its spill file: {exc}") from exc
        finally:
            self._end(held)
        self.committed += 1

    def close(self) -> None:
        """The session ended: drop everything held (a new session receives it again from the server)."""
        for held in list(self.held.values()):
            self._end(held)

    def _end(self, held: Held) -> None:
        self.size -= held.size
        held.close()
        self.held.pop(held.xid, None)

    def _spill(self) -> None:
        """Move the messages of the transaction holding the most memory to its file."""
        held = max(self.held.values(), key=lambda h: h.size)
        try:
            if held.file is None:
                held.file = tempfile.TemporaryFile(dir=self.directory, prefix="cdc-stream-")
            write, pack, out, written = held.file.write, _LENGTH.pack, bytearray(), 0
            for message in held.messages:
                out += pack(len(message))
                out += message
                if len(out) >= _CHUNK:
                    write(out)
                    written += len(out)
                    out.clear()
            write(out)
            written += len(out)
        except OSError as exc:
            raise TransientError(
                f"cannot spill a streamed transaction to {spill_place(self.directory)}: {exc.strerror or exc}; free space there, "
                "point batch.spill_dir at a larger disk or raise batch.stream_buffer_mb"
            ) from exc
        held.spilled += written
        self.spilled_bytes += written
        self.size -= held.size
        held.messages = []
        held.size = 0
