"""The messages of PostgreSQL's ``pgoutput`` plugin, as `cdc.source.pgoutput` decodes them.

Frozen dataclasses, one per message type, named and laid out as in the "Logical
Replication Message Formats" chapter of the PostgreSQL docs, and `RelationCache`,
which keeps the newest Relation per table. LSNs are `Lsn`; fields whose names end
in ``_ts`` are PostgreSQL timestamps, microseconds since 2000-01-01 00:00 UTC.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias, Union

from cdc.source.lsn import Lsn

__all__ = [
    "DecodeError",
    "UNCHANGED_TOAST",
    "Value",
    "Begin",
    "Message",
    "Commit",
    "Origin",
    "Column",
    "Relation",
    "Type",
    "Insert",
    "Update",
    "Delete",
    "Truncate",
    "StreamStart",
    "StreamStop",
    "StreamCommit",
    "StreamAbort",
    "BeginPrepare",
    "Prepare",
    "CommitPrepared",
    "RollbackPrepared",
    "StreamPrepare",
    "PgOutputMessage",
    "RelationCache",
    "UnknownRelationError",
]


class DecodeError(ValueError):
    """The bytes are not a well-formed pgoutput message."""


class _UnchangedToastType:
    """Type of `UNCHANGED_TOAST`; there is only ever one instance."""

    __slots__ = ()
    _instance: _UnchangedToastType | None = None

    def __new__(cls) -> _UnchangedToastType:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"

    # Copies and pickles must stay the singleton, so that ``is`` keeps working.
    def __copy__(self) -> _UnchangedToastType:
        return self

    def __deepcopy__(self, memo: object) -> _UnchangedToastType:
        return self

    def __reduce__(self) -> str:
        return "UNCHANGED_TOAST"


UNCHANGED_TOAST = _UnchangedToastType()
"""Stands for a TOASTed column value that an update left unchanged.

The server does not send such values (kind ``'u'`` in TupleData), so the
consumer must keep the previous value if it needs it. Compare with ``is``.
"""

Value: TypeAlias = Union[str, bytes, None, _UnchangedToastType]
"""One column value in a decoded tuple."""


# -- Messages ---------------------------------------------------------------
#
# ``xid`` on change messages is ``None`` outside a streamed transaction: the
# server only sends it between Stream Start and Stream Stop. It comes last
# with a default so that the common, non-streamed case reads naturally.


@dataclass(frozen=True, slots=True)
class Begin:
    """'B': start of a (non-streamed) transaction."""

    final_lsn: Lsn
    """LSN of the transaction's commit record; equals `Commit.commit_lsn`."""
    commit_ts: int
    xid: int


@dataclass(frozen=True, slots=True)
class Message:
    """'M': a message written with ``pg_logical_emit_message()``.

    Only sent when the ``messages`` option is on. A non-transactional message
    arrives as soon as it is decoded, outside any Begin/Commit.
    """

    transactional: bool
    lsn: Lsn
    prefix: str
    content: bytes
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Commit:
    """'C': end of a (non-streamed) transaction."""

    flags: int
    """Unused by PostgreSQL 15, always 0."""
    commit_lsn: Lsn
    end_lsn: Lsn
    """LSN just past the commit record: where to resume after this transaction."""
    commit_ts: int


@dataclass(frozen=True, slots=True)
class Origin:
    """'O': the transaction was replayed from another node (replication origin)."""

    origin_lsn: Lsn
    """The commit LSN on the origin server."""
    name: str


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a `Relation`."""

    is_key: bool
    """Part of the replica identity (all columns are, with REPLICA IDENTITY FULL)."""
    name: str
    type_oid: int
    type_modifier: int
    """``atttypmod``: -1 when the type has none, e.g. ``varchar(10)`` gives 14."""


@dataclass(frozen=True, slots=True)
class Relation:
    """'R': describes a table; sent before the first change to it in a session.

    The server sends it again after anything that invalidates the table's
    cache entry (ALTER TABLE, but also TRUNCATE), and inside each streamed
    transaction that touches the table, so a later Relation replaces an
    earlier one with the same relid.
    """

    relid: int
    namespace: str
    """Schema name as sent: the empty string means ``pg_catalog``."""
    name: str
    replica_identity: str
    """``'d'`` default (primary key), ``'n'`` nothing, ``'f'`` full, ``'i'`` index."""
    columns: tuple[Column, ...]
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Type:
    """'Y': describes a non-built-in data type used by a following Relation."""

    type_oid: int
    namespace: str
    """Schema name as sent: the empty string means ``pg_catalog``."""
    name: str
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Insert:
    """'I': a row was inserted."""

    relid: int
    new: tuple[Value, ...]
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Update:
    """'U': a row was updated.

    ``old`` is sent only when the replica identity changed (``old_kind`` 'K',
    key columns filled, the others None) or when the table has REPLICA
    IDENTITY FULL (``old_kind`` 'O', the whole old row).
    """

    relid: int
    old_kind: Literal["K", "O"] | None
    old: tuple[Value, ...] | None
    new: tuple[Value, ...]
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Delete:
    """'D': a row was deleted; ``old`` holds its key ('K') or whole row ('O')."""

    relid: int
    old_kind: Literal["K", "O"]
    old: tuple[Value, ...]
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Truncate:
    """'T': one TRUNCATE statement over one or more tables."""

    cascade: bool
    restart_identity: bool
    relids: tuple[int, ...]
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class StreamStart:
    """'S': a block of changes of a large in-progress transaction follows."""

    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop:
    """'E': end of the current block of streamed changes."""


@dataclass(frozen=True, slots=True)
class StreamCommit:
    """'c': a streamed transaction committed."""

    xid: int
    flags: int
    commit_lsn: Lsn
    end_lsn: Lsn
    commit_ts: int


@dataclass(frozen=True, slots=True)
class StreamAbort:
    """'A': a streamed transaction (xid == subxid) or a subtransaction of it aborted."""

    xid: int
    subxid: int


@dataclass(frozen=True, slots=True)
class BeginPrepare:
    """'b': start of a transaction prepared for two-phase commit."""

    prepare_lsn: Lsn
    end_lsn: Lsn
    prepare_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class Prepare:
    """'P': end of the changes of a prepared transaction (PREPARE TRANSACTION)."""

    flags: int
    prepare_lsn: Lsn
    end_lsn: Lsn
    prepare_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class CommitPrepared:
    """'K': COMMIT PREPARED of a transaction sent earlier."""

    flags: int
    commit_lsn: Lsn
    end_lsn: Lsn
    commit_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class RollbackPrepared:
    """'r': ROLLBACK PREPARED of a transaction sent earlier."""

    flags: int
    prepare_end_lsn: Lsn
    rollback_end_lsn: Lsn
    prepare_ts: int
    rollback_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class StreamPrepare:
    """'p': a streamed transaction was prepared."""

    flags: int
    prepare_lsn: Lsn
    end_lsn: Lsn
    prepare_ts: int
    xid: int
    gid: str


PgOutputMessage: TypeAlias = Union[
    Begin,
    Message,
    Commit,
    Origin,
    Relation,
    Type,
    Insert,
    Update,
    Delete,
    Truncate,
    StreamStart,
    StreamStop,
    StreamCommit,
    StreamAbort,
    BeginPrepare,
    Prepare,
    CommitPrepared,
    RollbackPrepared,
    StreamPrepare,
]


class UnknownRelationError(LookupError):
    """A change refers to a relid for which no Relation message was seen."""


class RelationCache:
    """The latest Relation (and Type) seen for each oid.

    Change messages only carry a relid; the server sends the table's
    Relation before the first change to it in each session, and again when
    the table's definition changes, so keep the newest one.
    """

    __slots__ = ("relations", "types")

    def __init__(self) -> None:
        self.relations: dict[int, Relation] = {}
        self.types: dict[int, Type] = {}

    def update(self, message: Relation | Type) -> None:
        if type(message) is Relation:
            self.relations[message.relid] = message
        elif type(message) is Type:
            self.types[message.type_oid] = message
        else:
            raise TypeError(f"expected a Relation or Type message, got {type(message).__name__}")

    def get(self, relid: int) -> Relation:
        try:
            return self.relations[relid]
        except KeyError:
            raise UnknownRelationError(
                f"no relation message seen for relid {relid}"
            ) from None

    def __len__(self) -> int:
        return len(self.relations)
