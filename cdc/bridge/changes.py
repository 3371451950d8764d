"""The per-change work: a decoded change of a mapped table, projected, packed into its batch.

This is the hot path. Per change: `PgOutputDecoder.decode` reads the tuple,
`route_row` hands it to each mapping's `Projector` (insert, update or delete),
and `Batcher.add` packs the entry with its position. Kept as plain functions
over plain objects so a compiled version can replace them one by one.
Pure: no I/O.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Any

import psycopg

from .. import speedups
from ..mapping.model import Mapping
from ..mapping.projector import CastRefused, Projector, message_entry
from ..sink.publisher import StreamBatch
from ..source import pgoutput as pg
from ..source.shapes import ColumnShape, TableShape
from ..source.values import TypeCatalog
from .backfill import Windows
from .batcher import Batcher
from .positions import Transaction

__all__ = ["INSERT", "UPDATE", "DELETE", "Target", "bind", "route_row", "route_raw", "burst", "route_change",
           "burst_changes", "route_truncate", "route_message"]

INSERT, UPDATE, DELETE = ord("I"), ord("U"), ord("D")
_BEGIN, _COMMIT = ord("B"), ord("C")
_XLOG = 0x77  # XLogData; its pgoutput message starts at 25
_KEEPALIVE = 0x6B  # a primary keepalive: 'k', wal end, send time, reply requested (18 bytes)
_HEADER = 25
_RELID = struct.Struct(">I").unpack_from
_BEGIN_FIELDS = struct.Struct(">QqI").unpack_from  # final LSN, commit time, xid
_END_LSN = struct.Struct(">Q").unpack_from
_BURST_MAX = 65536  # changes per call, so the loop's timers are seen now and then
AGE_EVERY = 32  # `burst` looks at the clock once per this many messages that leave a batch pending


class Target:
    """Where a bound projector writes: its mapping and one batch per partition stream."""

    __slots__ = ("projector", "batches", "version", "read", "plan")

    def __init__(self, projector: Projector, batches: list[StreamBatch], read: list[int]) -> None:
        self.projector = projector
        self.plan = None  # the compiled module's C form of `projector.plan`, made on first use
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
        try:
            if kind == INSERT:
                out = projector.insert(msg.new)
            elif kind == UPDATE:
                out = projector.update(msg.new, msg.old, msg.old_kind == "O")
            else:
                out = projector.delete(msg.old, msg.old_kind == "O")
        except CastRefused as exc:
            raise projector.placed(exc, msg.new if kind != DELETE else msg.old, tx.lsn, tx.seq) from None
        if out is not None:
            fields: list | None = out.fields
            if windows.introducing:
                intro = windows.introducing.get(projector.mapping.entity)
                if intro is not None:
                    fields = intro.live(out.fields, projector.key_json(msg.old)
                                        if kind == UPDATE and msg.old is not None else None)
            if fields is not None:
                batcher.add(t.batches[out.partition], fields, t.version, tx)


def route_raw(kind: int, raw: bytes, offset: int, targets: list[Target], tx: Transaction, batcher: Batcher,
              windows: Windows, decoder: pg.PgOutputDecoder) -> None:
    """`route_row` for an Insert, Update or Delete still in its XLogData bytes (the message at `offset`).

    The reference for the compiled `cdc.bridge._changes.route_raw`, which must queue
    the same entries byte for byte.
    """
    route_row(kind, decoder.decode(raw[offset:]), targets, tx, batcher, windows)


def burst(stream: Any, targets: dict[int, list[Target]], tx: Transaction, batcher: Batcher, windows: Windows,
          decoder: pg.PgOutputDecoder, committed: Callable[[Any], object], streams: Any) -> tuple[int, bytes | None]:
    """Route the row changes that have already arrived, without waiting for more.

    The inner part of `Session.run`'s loop, for the messages libpq holds
    (`stream.get_copy_data(1)`): each Insert, Update or Delete is counted, routed
    by `route_raw`, and takes the next seq; a Begin goes to `tx.begin_at` and a
    Commit to `tx.commit_at` and then `committed(end LSN)`, as `Session.dispatch`
    does. Inside a streamed block (of a transaction still running) a change is
    counted and held in `streams` instead. A keepalive that asks no reply, read after
    changes of this burst while the batch is pending, is passed over (it would change
    nothing: see the loop). Stops at the first other message
    (returned for the loop, which also decodes, and so names, anything malformed),
    when none is left, or when the batch is due (the rule of `Batcher.due`; its age is looked at
    once every `AGE_EVERY` messages that leave it pending, as the clock costs more than a change's
    bookkeeping). Returns (changes read, that message or None). The reference for the compiled
    `cdc.bridge._changes.burst`.
    """
    count = ticks = 0
    max_entries, max_delay, clock = batcher.max_entries, batcher.max_delay, time.monotonic
    xid = decoder.stream_xid  # the block being received, if any: only the loop's messages start or stop one
    streaming = xid is not None
    get = stream.get_copy_data
    while count < _BURST_MAX:
        try:
            n, data = get(1)
        except psycopg.Error as exc:
            raise stream.failure(exc) from exc
        if n <= 0:
            if n == 0:
                return count, None
            raise stream.failure(n)
        raw = bytes(data)
        size = len(raw)
        if size < _HEADER + 5 or raw[0] != _XLOG:  # not XLogData with a change's relid: the loop's
            if not (count and size == 18 and raw[0] == _KEEPALIVE and not raw[17] and batcher.pending):
                return count, raw
            # a keepalive asking no reply, after changes of this burst, while a batch is pending: the server
            # says it has sent everything so far, as it does after each transaction on live traffic; with
            # a batch pending it moves nothing (`Session.keepalive`) and the loop would only wait on, so
            # the burst reads on instead of handing it back (the changes read tell the loop it heard)
            continue
        kind = raw[_HEADER]
        if kind == INSERT or kind == UPDATE or kind == DELETE:
            count += 1
            if streaming:
                streams.add(xid, raw[_HEADER:])
                continue
            tlist = targets.get(_RELID(raw, _HEADER + 1)[0])
            if tlist:
                route_raw(kind, raw, _HEADER, tlist, tx, batcher, windows, decoder)
            tx.seq += 1
        elif kind == _BEGIN and size == _HEADER + 21 and not streaming:
            tx.begin_at(*_BEGIN_FIELDS(raw, _HEADER + 1))
            continue
        elif kind == _COMMIT and size == _HEADER + 26 and not streaming:
            committed(tx.commit_at(_END_LSN(raw, _HEADER + 10)[0]))
        else:
            return count, raw
        pending = batcher.pending
        if pending:
            if pending >= max_entries:
                return count, None
            ticks += 1
            if ticks == AGE_EVERY:
                ticks = 0
                if clock() - batcher.first_at >= max_delay:
                    return count, None
    return count, None


_compiled = speedups.load("cdc.bridge._changes")
#: `route_raw`, compiled where the extension is built
route_change = _compiled.route_raw if _compiled is not None else route_raw
#: `burst`, compiled where the extension is built: what `Session.run` calls for the changes already received
burst_changes = _compiled.burst if _compiled is not None else burst


def route_truncate(msg: pg.Truncate, targets: dict[int, list[Target]], tx: Transaction, batcher: Batcher,
                   windows: Windows) -> None:
    for relid in msg.relids:
        tlist = targets.get(relid, ())
        if tlist:  # only mapped tables have backfill windows
            windows.truncated(tlist[0].projector.table)
        for t in tlist:
            intro = windows.introducing.get(t.projector.mapping.entity)
            if intro is not None:
                intro.truncated()
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
