"""Which columns the publication sends of each mapped table: only what the mappings read.

Without a column list pgoutput converts every column of a changed row to text and sends it,
and the bridge drops the unmapped ones. With one (PostgreSQL 15 and later) the server sends
only the listed columns, and the Relation message describes only those. `cdc init` sets each
mapped table's list to what it needs (`wanted`): the columns its mappings read (fields, key,
filter) and the replica identity columns of it and of every partition (PostgreSQL refuses an
UPDATE or DELETE on a table whose list lacks one of them). The before-image is the old key
(the identity) or, under REPLICA IDENTITY FULL, every column: such a table gets no list.
Snapshots, backfills and `cdc reconcile` read the tables themselves, not the publication.

A publication that sends less than the mappings need (a mapping changed to read another
column, or the publication altered by hand) must never give entries lacking a field: `lacking`
finds it for the ack gate and `cdc check`, and a Relation message without a mapped column
stops the bridge (`ColumnsNotSent`). One that sends more is only wasteful (`surplus`).

No row filter (``WHERE``) is set: PostgreSQL turns an update whose old row passes the filter
and the new one not into a DELETE, and the reverse into an INSERT, where the bridge's filter
judges the new row and leaves the update out or keeps it as an update. The entries would
differ (tests/ops/test_publication_columns.py shows it), so the bridge applies every filter
itself. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import SlotError
from .coverage import Publication, TableCoverage

__all__ = ["ColumnPlan", "ColumnsNotSent", "FILTERS_IN_BRIDGE", "INIT_FIX", "columns_not_sent", "lacking", "plan",
           "sends_less", "surplus"]

#: the fix of a publication that sends less than the mappings need
INIT_FIX = ("run: cdc init (it sets the publication's column lists from the mappings), then cdc run; changes written "
            "before that never carry the column: if cdc run then stops on one, run cdc recover, then cdc run")

#: said once at start when a mapping has a filter
FILTERS_IN_BRIDGE = ("a table takes one publication row filter, which several mappings could not share, so the "
                     "bridge applies the mapping's filter itself (an update leaving it is a delete, one entering it "
                     "a create)")


class ColumnsNotSent(SlotError):
    """A Relation message lacks a column a mapping reads: the publication did not send it."""


@dataclass(frozen=True)
class ColumnPlan:
    """What the publication should send of one mapped table."""

    table: TableCoverage
    #: the column list `cdc init` sets, in table order; None: every column (the bridge drops the unmapped ones)
    wanted: tuple[str, ...] | None
    #: why the server cannot leave the unmapped columns out (None when it can)
    reason: str | None = None


def plan(table: TableCoverage, mapped: Iterable[str], publication: Publication) -> ColumnPlan:
    """The column list of `table` for mappings reading `mapped` (columns the table lacks are left to binding)."""
    if not publication.lists:
        return ColumnPlan(table, None, "PostgreSQL before 15 has no publication column lists")
    if publication.all_tables:
        return ColumnPlan(table, None, f"publication {publication.name!r} is FOR ALL TABLES, which takes no column list")
    if publication.schemas:
        return ColumnPlan(table, None, f"publication {publication.name!r} has FOR TABLES IN SCHEMA, which takes no "
                                       "column list")
    if table.full_identity:
        return ColumnPlan(table, None, "REPLICA IDENTITY FULL: updates and deletes carry every column")
    want = set(mapped) | set(table.identity)
    return ColumnPlan(table, tuple(c for c in table.columns if c in want))


def _needed(table: TableCoverage, mapped: Iterable[str]) -> list[str]:
    if table.full_identity:
        return list(table.columns)
    want = set(mapped) | set(table.identity)
    return [c for c in table.columns if c in want]


def lacking(table: TableCoverage, mapped: Iterable[str]) -> list[str]:
    """The columns the mappings or the replica identity need that the publication does not send."""
    if table.published is None:
        return []
    sent = set(table.published)
    return [c for c in _needed(table, mapped) if c not in sent]


def surplus(column_plan: ColumnPlan) -> list[str]:
    """The columns the publication sends that no mapping reads and no update needs (where it could leave them out)."""
    if column_plan.wanted is None:
        return []
    sent = column_plan.table.published if column_plan.table.published is not None else column_plan.table.columns
    return [c for c in sent if c not in column_plan.wanted]


def sends_less(table: TableCoverage, mapped: Iterable[str], publication: str, slot: str | None = None,
               fix: str = INIT_FIX) -> SlotError | None:
    """The publication sends fewer columns or rows of `table` than the mappings need: the error that stops."""
    held = f", slot {slot} held before them" if slot else ""
    missing = lacking(table, mapped)
    if missing:
        return SlotError(
            f"publication {publication!r} does not send column(s) {', '.join(missing)} of mapped table "
            f"{table.qualified} (its column list): changes would come without them{held}", hint=fix)
    if table.row_filter:
        return SlotError(
            f"publication {publication!r} filters the rows of mapped table {table.qualified} (a WHERE on it): the "
            f"changes it leaves out never reach the bridge{held}", hint=fix)
    return None


def columns_not_sent(schema: str, name: str, entity: str, missing: Sequence[str], sent: Sequence[str],
                     publication: str) -> ColumnsNotSent:
    """A Relation message of a mapped table lacks column(s) `missing` that `entity` reads."""
    return ColumnsNotSent(
        f"the stream's description of table {schema}.{name} lacks column(s) {', '.join(missing)} that entity "
        f"{entity!r} reads (it sends: {', '.join(sent)}): publication {publication!r} does not send them, or they did "
        "not exist when the change was written", hint=INIT_FIX)
