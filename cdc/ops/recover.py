"""`cdc recover`: after Redis lost entries, rebuild every mapped stream so that it replays to its table.

Runs with the bridge stopped, and keeps it stopped while it works:

1. It refuses while a bridge is attached to the slot, and (exit 75, changing nothing) while
   the server's WAL has not passed every position Redis holds: after a divergence (Redis
   holding changes the server's history lacks, `cdc.source.history`) a rebuild below the
   high-water marks would be dropped by them. It then sets the record of how far
   Redis holds the source (`keys.flushed_key`) to 0, so a bridge started meanwhile stops
   at once with the data-loss error (exit 6), and checks the slot once more.
2. A temporary slot exports a snapshot at position P: a transaction is in it exactly
   when its commit LSN is below P. Every entry of the rebuild has the position
   (P - 1, seq). Commit records start 8-byte aligned, so no transaction in the snapshot
   has a commit LSN of P - 1 or above, and every one after it has P or above.
3. Per stream, what the stream holds is replayed (`rebuild.KnownRows`), and appended
   after it, exactly once through the high-water marks: a delete (``op d``) for each key
   the stream holds that the snapshot has not, the marker (``op x``), then every row of
   the snapshot (``op r``). A mark that moved meanwhile stops the command.
4. Only then are the unfinished snapshots and backfills of the slot for the rebuilt
   entities marked ``superseded`` in `cdc_backfills` (the rebuild holds every row: going
   on with them would publish each row again after the marker), and the record moves to
   the slot's position, the server's history (system identifier, timeline) is recorded
   beside it, and the recorded loss goes. The bridge resumes from the slot; the
   marks drop its changes below P, which the snapshot already holds.

A mapped stream whose history vanished (gone while its mark says it held entries) is
rebuilt the same way: its mark goes (after the fence), and the rebuild creates the stream
afresh. A key of another type where a stream belongs stops the command before anything
changes: it is not the stream's, so the command never deletes it.

Run again after a failure: the next rebuild replays the partial one too, at a newer position.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import psycopg
from psycopg import sql

from .. import keys
from ..bridge.backfill import supersede
from ..bridge.gate import read_rows, record_current
from ..bridge.guards import clear_data_loss, invalidated_slot_error, record_source, slot_database_error
from ..keys import written_streams
from ..sink.redisconn import redis_for
from ..config import Settings
from ..errors import CdcError, PublishError, SlotError, TransientError
from ..mapping.model import Mapping
from ..mapping.projector import CastRefused, Projector
from ..reconcile.exported_snapshot import ExportedSnapshot, import_snapshot
from ..sink.claims import BridgeIdentity, claim
from ..sink.entry import next_stream_id
from ..sink.publisher import Publisher, StreamBatch, position
from ..sink.trim import accept_removed
from ..source.history import read_history
from ..source.lsn import Lsn
from ..source.replication import classify_pg_error
from ..source.values import TypeCatalog
from . import rebuild
from .admin import bind_live, connect, slot_connection

__all__ = ["recover"]

log = logging.getLogger("cdc.recover")

#: entries per append (one MULTI/EXEC per stream), rows per FETCH, stream entries per XRANGE
BATCH = 2000
PROGRESS_EVERY = 100_000


def _idle_slot(conn: psycopg.Connection, slot: str) -> Lsn:
    """The slot's confirmed position; refuses while a bridge is attached to it."""
    row = conn.execute(
        "SELECT active, active_pid, confirmed_flush_lsn::text, wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,)
    ).fetchone()
    if row is None:
        raise SlotError(f"replication slot {slot!r} does not exist", hint="run: cdc init --config <file>, then cdc recover")
    if row[3] == "lost":
        raise invalidated_slot_error(slot)
    other = slot_database_error(conn, slot)
    if other is not None:
        raise other
    if row[0]:
        raise CdcError(f"a bridge is attached to slot {slot!r} (walsender pid {row[1]})",
                       hint="stop it (cdc run), then run cdc recover again")
    return Lsn.parse(row[2])


class _Appender:
    """Entries at (base, seq) into per-stream batches, appended exactly once when full."""

    def __init__(self, publisher: Publisher, base: int, version: int) -> None:
        self.publisher, self.base, self.version = publisher, base, version
        self.lsn = str(base)
        self.ts = str(int(time.time() * 1000))
        self.batches: dict[str, StreamBatch] = {}
        self.pending = 0

    def add(self, stream: str, fields: list, seq: int) -> None:
        fields += [b"lsn", self.lsn, b"seq", seq, b"xid", "0", b"ts_ms", self.ts, b"v", self.version]
        batch = self.batches.get(stream)
        if batch is None:
            batch = self.batches[stream] = StreamBatch(stream)
        batch.add(position(self.base, seq), fields)
        self.pending += 1
        if self.pending >= BATCH:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.publisher.publish(self.batches.values())
        for b in self.batches.values():
            b.clear()
        self.pending = 0
        if self.publisher.entries_skipped:
            raise CdcError("a stream's high-water mark moved during the rebuild: another process writes the streams",
                           hint="stop every bridge on this slot, then run cdc recover again")


def _read_stream(client, stream: str) -> rebuild.KnownRows:
    known = rebuild.KnownRows()
    start = "-"
    while True:
        page = client.xrange(stream, start, "+", count=BATCH)
        known.extend(fields for _, fields in page)
        if len(page) < BATCH:
            return known
        start = next_stream_id(page[-1][0])


def _rows(conn: psycopg.Connection, projector: Projector):
    """Every row of the table under the imported snapshot, as text in the projector's column order."""
    schema, table = projector.table
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DECLARE cdc_recover NO SCROLL CURSOR FOR SELECT * FROM {}.{}").format(
            sql.Identifier(schema), sql.Identifier(table)))
        while True:
            cur.execute(f"FETCH {BATCH} FROM cdc_recover")
            result = cur.pgresult  # the text the server sent, as pgoutput would send it
            index = {result.fname(i).decode(): i for i in range(result.nfields)}
            order = [index.get(c.name) for c in projector.shape.columns]
            if not result.ntuples:
                break
            for r in range(result.ntuples):
                yield [None if c is None or (v := result.get_value(r, c)) is None else v.decode() for c in order]
        cur.execute("CLOSE cdc_recover")


def _rebuild(conn, client, publisher: Publisher, projector: Projector, base: int, marker: list,
             say: Callable[[str], None]) -> None:
    """Rebuild one mapping's streams: deletes for the keys the table no longer has, the marker, the rows.

    The deletes come first, so that a consumer which resets its state at the marker never
    sees a delete of a row it no longer holds; that takes a first pass over the snapshot.
    """
    mapping = projector.mapping
    streams = mapping.stream_keys()
    started = time.monotonic()
    for stream, mark in publisher.marks(streams).items():
        if mark is not None and mark[0] >= base:
            raise CdcError(f"stream {stream} already holds entries at or after the snapshot ({Lsn(mark[0])})",
                           hint="a bridge wrote meanwhile: stop it, then run cdc recover again")
    known = {}
    for stream in streams:
        known[stream] = _read_stream(client, stream)
        say(f"{stream}: read {known[stream].entries} entries, {len(known[stream].rows)} keys alive")
    for entry in _entries(conn, projector):
        known[streams[entry.partition]].rows.pop(entry.fields[3], None)
    out = _Appender(publisher, base, mapping.version)
    seq = 0
    if "d" in mapping.ops:
        for stream in streams:
            for key, last in known[stream].rows.items():
                out.add(stream, rebuild.tombstone(key, last, mapping.before), seq)
                seq += 1
    deletes = seq
    for stream in streams:
        out.add(stream, list(marker), seq)
    rows = 0
    for entry in _entries(conn, projector):
        seq += 1
        out.add(streams[entry.partition], entry.fields, seq)
        rows += 1
        if rows % PROGRESS_EVERY == 0:
            say(f"{mapping.entity}: {rows} rows")
    out.flush()
    note = "" if "d" in mapping.ops else " (its ops leave out d: keys gone from the table are not deleted)"
    say(f"{mapping.entity}: rebuilt {len(streams)} stream(s): {deletes} deleted keys (d), the marker (x), {rows} rows (r)"
        f" in {time.monotonic() - started:.1f}s{note}")


def _mark_transactions(publisher: Publisher, stream: str, base: int, marker: list, say: Callable[[str], None]) -> None:
    """The transactions stream gets the marker too: its END records before it may count entries the rebuild
    replaced (a transaction-mode consumer resets there, as at the marker of each rebuilt stream)."""
    mark = publisher.marks([stream])[stream]
    if mark is not None and mark[0] >= base:
        raise CdcError(f"stream {stream} already holds entries at or after the snapshot ({Lsn(mark[0])})",
                       hint="a bridge wrote meanwhile: stop it, then run cdc recover again")
    out = _Appender(publisher, base, 1)
    out.add(stream, list(marker), 0)
    out.flush()
    say(f"{stream}: the marker (x); END records after it count only entries after the rebuild")


def _entries(conn: psycopg.Connection, projector: Projector):
    """The snapshot's rows the mapping publishes, as op r entries (rows its filter leaves out are skipped)."""
    for values in _rows(conn, projector):
        try:
            entry = projector.snapshot(values)
        except CastRefused as exc:
            raise projector.placed(exc, values, None, None) from None
        if entry is not None:
            yield entry


def _fence(client, settings: Settings, say: Callable[[str], None]) -> tuple[str | None, str | None]:
    """Record that Redis holds nothing of the slot (a bridge started now stops); the loss recorded, if any."""
    slot = settings.postgres.slot
    held = client.get(keys.flushed_key(slot))
    state = client.hgetall(keys.bridge_state_key(slot))
    lost = (state.get(b"data_loss_from"), state.get(b"data_loss_to"))
    lost_from, lost_to = (None if v is None else v.decode() or None for v in lost)
    client.set(keys.flushed_key(slot), 0)
    if lost_to:
        say(f"redis lost the entries of transactions committed in ({lost_from or 'the start'}, {lost_to}]")
    else:
        say("redis holds changes up to " + (str(Lsn(int(held))) if held is not None else "nothing (no record)"))
    return lost_from, lost_to


def _vanished_streams(client, written: dict[str, str]) -> dict[str, Lsn]:
    """Streams gone while their marks say they held entries (-> the mark's LSN); refuses, changing
    nothing, when a key holds another type where a stream belongs. `written`: stream -> its entity."""
    vanished = {}
    for stream, entity in written.items():
        key_type, name = client.type(stream).decode(), keys.mark_key(stream)
        if client.type(name) not in (b"string", b"none"):
            raise PublishError(
                f"redis key {name} holds a {client.type(name).decode()}, not the high-water mark of stream {stream} "
                f"(entity {entity}); cdc recover changed nothing",
                hint=f"rename that key away (redis-cli RENAME {name} <new name>; cdc recover never deletes it), "
                "then run cdc recover again")
        mark = client.get(name)
        if key_type not in ("stream", "none"):
            raise PublishError(
                f"redis key {stream} holds a {key_type}, not a stream, stream of entity {entity}; "
                "cdc recover changed nothing",
                hint=f"rename that key away (redis-cli RENAME {stream} <new name>; cdc recover never deletes it), "
                "then run cdc recover again")
        if key_type == "none" and mark:
            vanished[stream] = Lsn(int(mark[:20]))
    return vanished


def _forget_vanished(client, mappings: Sequence[Mapping], vanished: dict[str, Lsn],
                     say: Callable[[str], None]) -> None:
    """Drop the marks of vanished streams, so that the rebuild creates them afresh."""
    rebuilt = {s for m in mappings if m.table is not None and "r" in m.ops for s in m.stream_keys()}
    for stream, lsn in vanished.items():
        client.delete(keys.mark_key(stream))
        what = "rebuilt from its table" if stream in rebuilt else "left empty (its entries stay missing)"
        say(f"{stream}: the stream is gone from redis (its mark said it held entries up to {lsn}): {what}")


def _still_fenced(client, slot: str) -> None:
    """A bridge that got past its data-loss check just before the fence, and attached after the second
    look at the slot, has recorded a position with its first append: the rebuild cannot be trusted."""
    held = client.get(keys.flushed_key(slot))
    if held is None or int(held) != 0:
        raise CdcError("a bridge wrote to redis during the rebuild",
                       hint="stop every bridge on this slot, then run cdc recover again")


def _past_redis(conn: psycopg.Connection, client, settings: Settings, written: dict[str, str]) -> Lsn:
    """Refuse (exit 75, nothing changed) while the server's WAL has not reached every position Redis holds.

    The rebuilt entries take position (P - 1, seq) for a snapshot at P, and the marks drop every entry at
    or below them: after a divergence (Redis holding positions the server's history lacks, see
    `cdc.source.history`) a snapshot at or below Redis' record would be dropped, and a consumer would see
    positions go backwards after the marker. Resetting the marks would break that order too: wait instead.
    """
    slot = settings.postgres.slot
    raw = client.get(keys.flushed_key(slot))
    held = Lsn(int(raw)) if raw else Lsn(0)
    for stream in written:
        mark = client.get(keys.mark_key(stream))
        if mark:  # entries at (P - 1, seq) go after a mark whose LSN is below P - 1
            held = max(held, Lsn(int(mark[:20]) + 1))
    row = conn.execute("SELECT CASE WHEN pg_is_in_recovery() THEN NULL ELSE pg_current_wal_lsn()::text END").fetchone()
    # creating the snapshot's slot writes WAL first, so P > the WAL position read here: P - 1 >= every mark
    if row[0] is not None and Lsn.parse(row[0]) < held:
        raise TransientError(
            f"the server's WAL is at {row[0]}, below {held}, where redis holds the source of slot {slot!r} "
            "(redis holds changes this server's history lacks): a rebuild now would sit below the streams' "
            "high-water marks; cdc recover changed nothing",
            hint=f"wait until pg_current_wal_lsn() reaches {held} (after more writes), or run SELECT pg_switch_wal() "
            "as a superuser (it moves the WAL to the next 16 MB segment, once something was written in this one; "
            "repeat as needed), then cdc recover again")
    return held


def recover(settings: Settings, mappings: Sequence[Mapping], say: Callable[[str], None]) -> None:
    """Rebuild every mapped table's streams (see the module's docstring); `say` prints one line per step."""
    slot = settings.postgres.slot
    with connect(settings) as conn, slot_connection(settings, conn) as sconn, redis_for(settings) as client:
        try:
            confirmed = _idle_slot(sconn, slot)
            server = read_history(settings.postgres.slot_server)  # the slot and streams must be this bridge's own
            written = written_streams(settings, mappings)
            claim(client, BridgeIdentity(slot, server.system_id, server.database, settings.postgres.publication), written)
            vanished = _vanished_streams(client, written)  # keys of another type first: their marks cannot be read
            _past_redis(conn, client, settings, written)
            lost_from, lost_to = _fence(client, settings, say)
            _forget_vanished(client, mappings, vanished, say)
            _idle_slot(sconn, slot)
            say(f"slot {slot} is at {confirmed}; no bridge is attached, and one started now stops until this ends")
            with ExportedSnapshot(settings.postgres.dsn, label="recover") as snap:
                base = int(snap.position) - 1
                say(f"snapshot at {snap.position}: the rebuilt entries take position {Lsn(base)}")
                import_snapshot(conn, snap.name)
                publisher = Publisher(settings.redis.url, cluster=settings.redis.cluster,
                                      flushed_key=keys.flushed_key(slot), settings=settings.redis,
                                      entities=written)
                try:
                    catalog = TypeCatalog()
                    marker = rebuild.marker(str(snap.position), lost_from, lost_to)
                    rebuilt = []
                    for m in mappings:
                        if m.table is None or "r" not in m.ops:
                            why = "logical messages are no table" if m.table is None else "its ops leave out r"
                            say(f"{m.entity}: not rebuilt ({why}); its lost entries stay missing")
                            continue
                        _rebuild(conn, client, publisher, bind_live(conn, m, catalog), base, marker, say)
                        rebuilt.append(m.entity)
                    if settings.transactions.stream:
                        _mark_transactions(publisher, settings.transactions.stream, base, marker, say)
                    tables = [m.table for m in mappings if m.table]
                    # as of the snapshot: a change to the publication after it is the next reading's to find
                    rows = read_rows(conn, settings.postgres.publication, tables)
                    conn.execute("COMMIT")
                    _idle_slot(sconn, slot)
                    _still_fenced(client, slot)
                    # the rebuild holds every row: a snapshot or backfill published after it would repeat them
                    for backfill_id, entity in supersede(conn, slot, rebuilt, f"superseded by cdc recover at {snap.position}"):
                        say(f"backfill {backfill_id} of {entity}: superseded (the rebuild holds every row)")
                    for stream in written:  # entries removed before the rebuild are accounted for by its marker
                        if client.exists(stream):
                            accept_removed(client, stream)
                    publisher.record_flushed(confirmed)
                    # the streams replay to the tables as they are now: bind them from the snapshot on
                    record_current(conn, client, slot, tables, snap.position, rows)
                finally:
                    publisher.close()
            record_source(client, slot, read_history(settings.postgres.slot_server))  # the streams are this server's now
            clear_data_loss(client, slot)
        except psycopg.Error as exc:
            raise classify_pg_error(exc, slot=slot) from exc
    say(f"recovered: redis holds slot {slot} up to {confirmed}; start the bridge (cdc run)")
