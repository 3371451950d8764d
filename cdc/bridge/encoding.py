"""Text PostgreSQL cannot send as UTF-8: a database whose encoding is SQL_ASCII stores text bytes
unchecked, and the walsender refuses to convert a value that is not valid UTF-8 for the bridge's
connection ("invalid byte sequence for encoding "UTF8""), on every restart, for the transaction that
wrote it. The slot can never decode that transaction: the way past is the tables repaired, then a
new slot and a rebuild of the streams (`cdc recover`)."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import SourceError
from ..mapping.model import Mapping
from ..source.lsn import Lsn
from ..source.replication import quote_ident

__all__ = ["InvalidText", "invalid_text_error", "is_invalid_text", "sql_ascii_warning"]

_NEEDLE = "invalid byte sequence for encoding"


class InvalidText(SourceError):
    """A change the server cannot send as UTF-8 (exit 4)."""


def is_invalid_text(error: BaseException) -> bool:
    """The server refused to send a change whose text is not valid in the connection's encoding."""
    return _NEEDLE in str(error)


def sql_ascii_warning(database: str | None) -> str:
    return (f"database {database!r} uses encoding SQL_ASCII: PostgreSQL stores its text bytes unchecked, and a "
            "value that is not valid UTF-8 cannot be streamed (the bridge stops at its transaction, naming the way "
            "past); create the database with ENCODING 'UTF8' to have PostgreSQL refuse such values when written")


def _finder(m: Mapping) -> str:
    """A query naming the keys of `m`'s rows holding a byte beyond ASCII in a column it reads."""
    by_field = {f.name: f.column for f in m.fields if f.column is not None}
    keys = [quote_ident(by_field.get(k, k)) for k in m.key]
    table = ".".join(quote_ident(part) for part in m.table or ())
    test = " OR ".join(f"{quote_ident(c)}::text ~ '[\\x80-\\xff]'" for c in m.columns)
    return f"SELECT {', '.join(keys)} FROM {table} WHERE {test}"


def invalid_text_error(error: BaseException, database: str | None, slot: str, mappings: Sequence[Mapping],
                       xid: str | None, commit_lsn: int | None) -> InvalidText:
    """What happened, where (the transaction, the mapped text columns to look in) and the way past."""
    detail = str(error).split(_NEEDLE, 1)[1].strip(" :\n")
    where = (f"transaction {xid} (committed at {Lsn(commit_lsn)})" if xid and commit_lsn
             else "the next transaction after the slot's position")
    looks = ", ".join(f"`{_finder(m)}`" for m in mappings if m.table is not None)
    return InvalidText(
        f"postgres cannot send a change of {where} to the bridge: a text value in it is not valid UTF-8 "
        f"(byte sequence {detail}); database {database!r} stores text unchecked (encoding SQL_ASCII), and the slot "
        "can never decode that transaction",
        hint=f"find the rows holding bytes beyond ASCII with {looks} and repair those values in the tables, then "
             f"drop the slot (SELECT pg_drop_replication_slot('{slot}')), then cdc init, then cdc recover before cdc run (the "
             "streams are rebuilt from the tables; the individual changes in between cannot be restored)")
