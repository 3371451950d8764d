"""cdc.source.pgoutput against the bytes a real PostgreSQL 15 sends.

A throwaway server is started for this module. The raw pgoutput payloads
are read with ``pg_logical_slot_get_binary_changes()``: the same bytes a
walsender puts inside XLogData, without a replication connection.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import psycopg
import pytest

from cdc.demo.local import pg_bin
from cdc.source import pgoutput as po
from cdc.source.lsn import Lsn
from cdc.source.pgoutput import UNCHANGED_TOAST, PgOutputDecoder
from cdc.source.framing import pg_ts_to_unix_ms

# cdc.source.pgoutput has no compiled twin and runs the same on both paths (the compiled code's own reading is held to
# it by tests/bridge/test_compiled.py): once is enough
pytestmark = [pytest.mark.integration, pytest.mark.one_path]

PG_BIN = pg_bin()  # the server the run was given (tests/conftest.py --pg)
START_TIMEOUT = 60.0


@dataclass(frozen=True)
class Server:
    port: int
    socket_dir: str

    def conninfo(self, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname} connect_timeout=5"


def _as_postgres(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: drop to the postgres user if we are root."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


def _run(cmd: list[str], cwd: str) -> None:
    proc = subprocess.run(
        _as_postgres(cmd), cwd=cwd, capture_output=True, text=True, timeout=START_TIMEOUT
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{cmd[0]} failed with exit code {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_accepting(server: Server, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            with psycopg.connect(server.conninfo()) as conn:
                conn.execute("SELECT 1")
            return
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline:
                text = log.read_text() if log.exists() else "(no log)"
                raise RuntimeError(f"postgres did not accept connections: {exc}\n{text}") from exc
            time.sleep(0.05)


@pytest.fixture(scope="module")
def pg_server() -> Iterator[Server]:
    for tool in ("initdb", "pg_ctl", "postgres"):
        if not (PG_BIN / tool).exists():
            pytest.skip(f"PostgreSQL not installed ({PG_BIN / tool} missing)")
    tmp = tempfile.mkdtemp(prefix="cdc-pgoutput-")
    data = os.path.join(tmp, "data")
    log = Path(tmp, "server.log")
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(tmp, pw.pw_uid, pw.pw_gid)
    server = Server(_free_port(), tmp)
    try:
        _run(
            [str(PG_BIN / "initdb"), "-D", data, "-U", "postgres", "--auth=trust",
             "-E", "UTF8", "--locale=C", "--no-sync"],
            cwd=tmp,
        )
        with open(os.path.join(data, "postgresql.conf"), "a") as conf:
            conf.write(
                f"listen_addresses = '127.0.0.1'\n"
                f"port = {server.port}\n"
                f"unix_socket_directories = '{tmp}'\n"
                "wal_level = logical\n"
                "max_replication_slots = 10\n"
                "max_wal_senders = 10\n"
                "max_prepared_transactions = 10\n"
                "fsync = off\n"
                "full_page_writes = off\n"
            )
        _run(
            [str(PG_BIN / "pg_ctl"), "-D", data, "-l", str(log), "-w",
             "-t", str(int(START_TIMEOUT)), "start"],
            cwd=tmp,
        )
        _wait_until_accepting(server, log)
        yield server
    finally:
        if os.path.exists(os.path.join(data, "postmaster.pid")):
            subprocess.run(
                _as_postgres([str(PG_BIN / "pg_ctl"), "-D", data, "-m", "immediate", "-w", "stop"]),
                cwd=tmp, capture_output=True, timeout=START_TIMEOUT,
            )
        shutil.rmtree(tmp, ignore_errors=True)


_db_numbers = count(1)


@pytest.fixture
def conn(pg_server: Server) -> Iterator[psycopg.Connection]:
    """An autocommit connection to a fresh database."""
    dbname = f"pgoutput_{next(_db_numbers)}"
    with psycopg.connect(pg_server.conninfo(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {dbname}")
    with psycopg.connect(pg_server.conninfo(dbname), autocommit=True) as c:
        yield c
        for (slot,) in c.execute(
            "SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"
        ).fetchall():
            c.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


def get_changes(conn: psycopg.Connection, slot: str, *options: str) -> list[tuple[Lsn, int, bytes]]:
    """Consume the slot's pending changes: (lsn, xid, raw pgoutput message) rows."""
    placeholders = ", ".join(["%s"] * len(options))
    rows = conn.execute(
        f"SELECT lsn::text, xid::text::bigint, data"
        f" FROM pg_logical_slot_get_binary_changes(%s, NULL, NULL, {placeholders})",
        (slot, *options),
    ).fetchall()
    return [(Lsn.parse(lsn), xid, data) for lsn, xid, data in rows]


def decode_all(rows: list[tuple[Lsn, int, bytes]]) -> list[po.PgOutputMessage]:
    dec = PgOutputDecoder()
    return [dec.decode(data) for _, _, data in rows]


def check_transaction_frames(messages: list[po.PgOutputMessage]) -> None:
    """Every Begin is closed by a Commit at its final LSN, with nothing else nested."""
    begin = None
    for m in messages:
        if isinstance(m, po.Begin):
            assert begin is None
            begin = m
        elif isinstance(m, po.Commit):
            assert begin is not None
            assert m.commit_lsn == begin.final_lsn
            assert m.end_lsn > m.commit_lsn
            assert m.commit_ts == begin.commit_ts
            assert m.flags == 0
            begin = None
    assert begin is None


def test_basic_changes_proto_1(conn: psycopg.Connection) -> None:
    conn.execute("CREATE TYPE mood AS ENUM ('happy', 'sad')")
    conn.execute(
        "CREATE TABLE items (id int PRIMARY KEY, name text, qty int,"
        " price numeric(10,2), note text, feeling mood, code varchar(10))"
    )
    # Stored out of line and uncompressed, so a large note is TOASTed.
    conn.execute("ALTER TABLE items ALTER COLUMN note SET STORAGE EXTERNAL")
    conn.execute("CREATE TABLE other (k bigint PRIMARY KEY)")
    conn.execute("CREATE PUBLICATION pub FOR TABLE items, other")
    conn.execute("SELECT pg_create_logical_replication_slot('slot', 'pgoutput')")
    relid = conn.execute("SELECT 'items'::regclass::oid::bigint").fetchone()[0]
    other_relid = conn.execute("SELECT 'other'::regclass::oid::bigint").fetchone()[0]
    mood_oid = conn.execute("SELECT 'mood'::regtype::oid::bigint").fetchone()[0]
    started_ms = time.time() * 1000

    conn.execute("INSERT INTO items VALUES (1, 'apple', 3, 1.50, NULL, 'happy', 'é€')")
    conn.execute("UPDATE items SET qty = 4 WHERE id = 1")
    conn.execute("UPDATE items SET id = 2 WHERE id = 1")
    conn.execute("UPDATE items SET note = repeat('x', 10000) WHERE id = 2")
    conn.execute("UPDATE items SET qty = 5 WHERE id = 2")
    with conn.transaction():
        conn.execute("INSERT INTO items (id, name) VALUES (3, 'pear')")
        conn.execute("SELECT pg_logical_emit_message(true, 'cdc', 'in-txn')")
    conn.execute("SELECT pg_logical_emit_message(false, 'cdc', 'at once'::bytea)")
    conn.execute("DELETE FROM items WHERE id = 2")
    conn.execute("ALTER TABLE items REPLICA IDENTITY FULL")
    conn.execute("UPDATE items SET qty = 9 WHERE id = 3")
    conn.execute("TRUNCATE items, other RESTART IDENTITY")

    rows = get_changes(
        conn, "slot", "proto_version", "1", "publication_names", "pub", "messages", "true"
    )
    messages = decode_all(rows)
    check_transaction_frames(messages)
    # Compare without the transaction frames, checked above.
    body = [m for m in messages if not isinstance(m, (po.Begin, po.Commit))]

    begins = [m for m in messages if isinstance(m, po.Begin)]
    for begin in begins:
        assert abs(pg_ts_to_unix_ms(begin.commit_ts) - started_ms) < 60_000
    # The xid column the SQL function reports is the Begin's xid.
    begin_rows = [(lsn, xid) for (lsn, xid, data) in rows if data[:1] == b"B"]
    assert [xid for _, xid in begin_rows] == [b.xid for b in begins]

    relation = po.Relation(
        relid,
        "public",
        "items",
        "d",
        (
            po.Column(True, "id", 23, -1),
            po.Column(False, "name", 25, -1),
            po.Column(False, "qty", 23, -1),
            po.Column(False, "price", 1700, (10 << 16 | 2) + 4),
            po.Column(False, "note", 25, -1),
            po.Column(False, "feeling", mood_oid, -1),
            po.Column(False, "code", 1043, 14),
        ),
    )
    big = "x" * 10000
    key_only = (None,) * 6
    full_relation = po.Relation(
        relid, "public", "items", "f",
        tuple(po.Column(True, c.name, c.type_oid, c.type_modifier) for c in relation.columns),
    )
    expected = [
        po.Type(mood_oid, "public", "mood"),
        relation,
        po.Insert(relid, ("1", "apple", "3", "1.50", None, "happy", "é€")),
        po.Update(relid, None, None, ("1", "apple", "4", "1.50", None, "happy", "é€")),
        po.Update(relid, "K", ("1", *key_only), ("2", "apple", "4", "1.50", None, "happy", "é€")),
        po.Update(relid, None, None, ("2", "apple", "4", "1.50", big, "happy", "é€")),
        po.Update(relid, None, None, ("2", "apple", "5", "1.50", UNCHANGED_TOAST, "happy", "é€")),
        po.Insert(relid, ("3", "pear", None, None, None, None, None)),
        po.Message(True, body[8].lsn, "cdc", b"in-txn"),  # type: ignore[union-attr]
        po.Message(False, body[9].lsn, "cdc", b"at once"),  # type: ignore[union-attr]
        po.Delete(relid, "K", ("2", *key_only)),
        # ALTER TABLE invalidated the table: its Type and Relation come again.
        po.Type(mood_oid, "public", "mood"),
        full_relation,
        po.Update(
            relid,
            "O",
            ("3", "pear", None, None, None, None, None),
            ("3", "pear", "9", None, None, None, None),
        ),
        # TRUNCATE gives the table a new relfilenode, which also invalidates
        # it: both tables are described (again) before the Truncate.
        po.Type(mood_oid, "public", "mood"),
        full_relation,
        po.Relation(other_relid, "public", "other", "d", (po.Column(True, "k", 20, -1),)),
        po.Truncate(False, True, (relid, other_relid)),
    ]
    assert body == expected

    # The non-transactional message is not wrapped in Begin/Commit.
    i = messages.index(body[9])
    assert isinstance(messages[i - 1], po.Commit) and isinstance(messages[i + 1], po.Begin)
    # The transactional one sits inside its transaction, after the insert.
    assert body[8].lsn > 0 and body[9].lsn > body[8].lsn  # type: ignore[union-attr]


def test_streamed_transaction_proto_2(conn: psycopg.Connection) -> None:
    conn.execute("CREATE TABLE big (id int PRIMARY KEY, payload text)")
    conn.execute("CREATE PUBLICATION pub FOR TABLE big")
    conn.execute("SELECT pg_create_logical_replication_slot('slot', 'pgoutput')")
    relid = conn.execute("SELECT 'big'::regclass::oid::bigint").fetchone()[0]
    n = 3000
    with conn.transaction():
        conn.execute(
            "INSERT INTO big SELECT i, 'row ' || i FROM generate_series(1, %s::int) AS i", (n,)
        )
        conn.execute("SELECT pg_logical_emit_message(true, 'cdc', 'streamed')")
        xid = conn.execute("SELECT txid_current()").fetchone()[0]
    with pytest.raises(RuntimeError, match="roll back"):
        with conn.transaction():
            conn.execute(
                "INSERT INTO big SELECT i, 'gone' FROM generate_series(%s::int, %s::int) AS i",
                (n + 1, 2 * n),
            )
            aborted_xid = conn.execute("SELECT txid_current()").fetchone()[0]
            raise RuntimeError("roll back")
    # Abort records are not flushed at once, and the SQL interface decodes
    # only flushed WAL: a later commit flushes it.
    conn.execute("CREATE TABLE flush_marker ()")

    # Decoding memory is per session: lower it so the transaction is streamed.
    conn.execute("SET logical_decoding_work_mem = '64kB'")
    rows = get_changes(
        conn, "slot",
        "proto_version", "2", "publication_names", "pub", "messages", "true", "streaming", "on",
    )
    dec = PgOutputDecoder()
    messages = []
    for _, _, data in rows:
        m = dec.decode(data)
        messages.append(m)
        if isinstance(m, po.StreamStart):
            assert dec.streaming and dec.stream_xid == m.xid
        elif isinstance(m, po.StreamStop):
            assert not dec.streaming

    starts = [m for m in messages if isinstance(m, po.StreamStart)]
    assert len(starts) >= 2, "expected the transactions to be streamed in blocks"
    assert not any(isinstance(m, (po.Begin, po.Commit)) for m in messages)
    committed = [m for m in starts if m.xid == xid]
    assert committed[0].first_segment and not any(m.first_segment for m in committed[1:])

    inserts = [m for m in messages if isinstance(m, po.Insert) and m.xid == xid]
    assert [m.new for m in inserts] == [(str(i), f"row {i}") for i in range(1, n + 1)]
    assert all(m.relid == relid for m in inserts)
    relations = [m for m in messages if isinstance(m, po.Relation)]
    assert relations and relations[0].xid == xid and relations[0].name == "big"
    logical = [m for m in messages if isinstance(m, po.Message)]
    assert [(m.xid, m.content) for m in logical] == [(xid, b"streamed")]

    commits = [m for m in messages if isinstance(m, po.StreamCommit)]
    assert [c.xid for c in commits] == [xid]
    assert commits[0].end_lsn > commits[0].commit_lsn
    assert messages.index(commits[0]) > messages.index(inserts[-1])
    if conn.info.server_version >= 180000:
        # PostgreSQL 18 drops a transaction it knows aborted before streaming any of it
        assert not any(getattr(m, "xid", None) == aborted_xid for m in messages)
    else:
        assert isinstance(messages[-1], po.StreamAbort)
        assert messages[-1] == po.StreamAbort(aborted_xid, aborted_xid)


def test_two_phase_proto_3(conn: psycopg.Connection) -> None:
    conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
    conn.execute("CREATE PUBLICATION pub FOR TABLE t")
    conn.execute("SELECT pg_create_logical_replication_slot('slot', 'pgoutput', false, true)")
    relid = conn.execute("SELECT 't'::regclass::oid::bigint").fetchone()[0]
    for gid, value, finish in (("g1", 1, "COMMIT"), ("g2", 2, "ROLLBACK")):
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t VALUES (%s)", (value,))
        conn.execute(f"PREPARE TRANSACTION '{gid}'")
        conn.execute(f"{finish} PREPARED '{gid}'")

    rows = get_changes(
        conn, "slot", "proto_version", "3", "publication_names", "pub", "two_phase", "on"
    )
    messages = decode_all(rows)
    kinds = [type(m).__name__ for m in messages]
    assert kinds == [
        "BeginPrepare", "Relation", "Insert", "Prepare", "CommitPrepared",
        "BeginPrepare", "Insert", "Prepare", "RollbackPrepared",
    ]
    bp1, _, ins1, p1, cp, bp2, ins2, p2, rp = messages
    assert ins1 == po.Insert(relid, ("1",)) and ins2 == po.Insert(relid, ("2",))
    assert (bp1.gid, p1.gid, cp.gid) == ("g1", "g1", "g1")  # type: ignore[union-attr]
    assert (bp2.gid, p2.gid, rp.gid) == ("g2", "g2", "g2")  # type: ignore[union-attr]
    assert bp1.prepare_lsn == p1.prepare_lsn and bp1.end_lsn == p1.end_lsn  # type: ignore[union-attr]
    assert bp1.xid == p1.xid == cp.xid  # type: ignore[union-attr]
    assert rp.prepare_end_lsn == p2.end_lsn and rp.prepare_ts == p2.prepare_ts  # type: ignore[union-attr]
    assert cp.commit_lsn >= p1.end_lsn and cp.end_lsn > cp.commit_lsn  # type: ignore[union-attr]
