"""The per-change work: a decoded change of a mapped table, projected, packed into its batch.

This is the hot path. Per change: `PgOutputDecoder.decode` reads the tuple,
`route_row` hands it to each mapping's `Projector` (insert, update or delete),
and `Batcher.add` packs the entry with its position. Kept as plain functions
over plain objects so a compiled version can replace them one by one.
Pure: no I/O.
"""

from __future__ import annotations

from .. import speedups
from ..mapping.model import Mapping
from ..mapping.projector import Projector, message_entry
from ..sink.publisher import StreamBatch
from ..source import pgoutput as pg
from ..source.shapes import ColumnShape, TableShape
from ..source.values import TypeCatalog
from .backfill import Windows
from .batcher import Batcher
from .positions import Transaction

__all__ = ["INSERT", "UPDATE", "DELETE", "Target", "bind", "route_row", "route_raw", "route_change", "burst_changes",
           "route_truncate",
           "route_message"]

INSERT, UPDATE, DELETE = ord("I"), ord("U"), ord("D")


class Target:
    """Where a bound projector writes: its mapping and one batch per partition stream."""

    __slots__ = ("projector", "batches", "version", "read", "plan")

    def __init__(self, projector: Projector, batches: list[StreamBatch], read: list[int]) -> None:
        self.projector = projector
        self.plan = None  # the compiled path's form of the projector, made on first use
        self.batches = batches
        self.version = projector.mapping.version
        self.read = read  # [changes of this entity read], shared across rebinds


def shape_of(relation: pg.Relation) -> TableShape:
    return TableShape(
        schema=relation.namespace,
        name=relation.name,
        columns=tuple(ColumnShape(c.name, c.type_oid, c.is_key) for c in relation.columns),
        replica_identity=relation.replica_identity,
    )


def bind(relation: pg.Relation, mappings: list[Mapping], catalog: TypeCatalog, batcher: Batcher,
         read_by_entity: dict[str, list[int]]) -> list[Target]:
    """A target per mapping of the relation (its column types already in `catalog`)."""
    shape = shape_of(relation)
    return [
        Target(Projector(m, shape, catalog), [batcher.batch(s) for s in m.stream_keys()], read_by_entity[m.entity])
        for m in mappings
    ]


def route_row(kind: int, msg, targets: list[Target], tx: Transaction, batcher: Batcher, windows: Windows) -> None:
    """A change to a mapped table: noted in the backfill windows of its table, queued for each mapping."""
    if windows.tables:
        keyed = targets[0].projector
        if keyed.table in windows.tables:
            for values in (msg.new if kind != DELETE else None, msg.old if kind != INSERT else None):
                if values is not None:
                    windows.changed(keyed.table, keyed.key_values(values))
    for t in targets:
        t.read[0] += 1
        projector = t.projector
        if kind == INSERT:
            out = projector.insert(msg.new)
        elif kind == UPDATE:
            out = projector.update(msg.new, msg.old, msg.old_kind == "O")
        else:
            out = projector.delete(msg.old, msg.old_kind == "O")
        if out is not None:
            batcher.add(t.batches[out.partition], out.fields, t.version, tx)


def route_raw(kind: int, raw: bytes, offset: int, targets: list[Target], tx: Transaction, batcher: Batcher,
              windows: Windows, decoder: pg.PgOutputDecoder) -> None:
    """`route_row` for an Insert, Update or Delete still in its XLogData bytes (the message at `offset`).

    The reference for the compiled `cdc.bridge._changes.route_raw`, which must queue
    the same entries byte for byte.
    """
    route_row(kind, decoder.decode(raw[offset:]), targets, tx, batcher, windows)


_compiled = speedups.load("cdc.bridge._changes")
#: `route_raw`, compiled where the extension is built
route_change = _compiled.route_raw if _compiled is not None else route_raw
#: compiled only: the changes already received, routed in one call (`Session.run` reads them one by one
#: without it)
burst_changes = _compiled.burst if _compiled is not None else None


def route_truncate(msg: pg.Truncate, targets: dict[int, list[Target]], tx: Transaction, batcher: Batcher,
                   windows: Windows) -> None:
    for relid in msg.relids:
        tlist = targets.get(relid, ())
        if tlist:  # only mapped tables have backfill windows
            windows.truncated(tlist[0].projector.table)
        for t in tlist:
            for out in t.projector.truncate():
                batcher.add(t.batches[out.partition], out.fields, t.version, tx)


def route_message(msg: pg.Message, mappings: list[tuple[str, int, StreamBatch]], tx: Transaction,
                  batcher: Batcher) -> None:
    """A logical decoding message, to the first mapping whose prefix it starts with.

    A transactional one takes the transaction's next seq; a lone one has its own position.
    """
    at = tx if msg.transactional else Transaction.lone(msg)
    for prefix, version, batch in mappings:
        if msg.prefix.startswith(prefix):
            batcher.add(batch, message_entry(msg.prefix, msg.content), version, at)
            break
    if msg.transactional:
        tx.seq += 1
