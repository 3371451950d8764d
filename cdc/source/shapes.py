"""The shape of a source table: its columns, their types, its key and replica identity.

Built from a Relation message (in the stream) or from the live catalog (`cdc check`);
the projector binds a mapping to one shape. Pure values, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ColumnShape:
    name: str
    type_oid: int
    key: bool = False


@dataclass(frozen=True, slots=True)
class TableShape:
    """What binding needs to know of a table: its columns and replica identity."""

    schema: str
    name: str
    columns: tuple[ColumnShape, ...]
    #: pg_class.relreplident: 'd' primary key, 'f' full, 'i' index, 'n' nothing
    replica_identity: str = "d"
    #: of a partitioned table FULL itself (read from the catalog): a partition that is not, and its replica
    #: identity columns, which are all its updates and deletes carry ("" when every partition is FULL)
    partial_leaf: str = ""
    leaf_identity: tuple[str, ...] = ()
