"""The publication sends what the mappings use: a column list per mapped table (PostgreSQL 15+).

Against real PostgreSQL and Redis: `cdc init` sets the lists (and again after a mapping
changes, in place, keeping other members), the server never sends an unmapped column (a raw
pgoutput read of the slot), a publication that sends less stops the bridge and fails `cdc
check` with the fix, one that sends more is a warning, and why no row filter is used.
"""

from __future__ import annotations

import select
import time

import psycopg
import pytest

from cdc.demo.local import wait_for
from cdc.mapping.model import parse_mapping
from cdc.mapping.projector import Projector
from cdc.source.shapes import ColumnShape, TableShape
from cdc.source.values import TypeCatalog
from cdc.yamlsrc import load_yaml_documents
from conftest import read_stream

pytestmark = pytest.mark.integration

ACCOUNTS = """
CREATE TABLE public.accounts (id bigint PRIMARY KEY, name text NOT NULL, score int, secret text);
CREATE TABLE public.other (id int PRIMARY KEY, a text, b text);
"""

MAPPING = """\
    entity: account
    table: public.accounts
    key: [id]
    ops: [c, t]
    filter: {score: {gte: 0}}
    fields: {id: id, name: name}
    """

SECRET = "UNMAPPED-7f3c9a-never-sent"


def published(env, table: str) -> list[str] | None:
    """The column list of `table` in publication cdc (None: every column)."""
    row = env.execute(
        "SELECT r.prattrs IS NULL, ARRAY(SELECT a.attname::text FROM pg_attribute a WHERE a.attrelid = r.prrelid "
        "AND a.attnum = ANY(r.prattrs::int2[]) ORDER BY a.attnum) FROM pg_publication_rel r "
        "JOIN pg_publication p ON p.oid = r.prpubid WHERE p.pubname = 'cdc' AND r.prrelid = %s::regclass", (table,))
    assert row, f"{table} is not in publication cdc"
    return None if row[0][0] else row[0][1]


def raw_changes(env, publication: str) -> bytes:
    """Every byte pgoutput sends for the slot's pending changes under `publication` (the slot is not moved)."""
    env.execute("SELECT pg_logical_emit_message(true, 'raw-read', 'end')")
    data = b""
    deadline = time.monotonic() + 30
    conn = psycopg.connect(env.dsn, replication="database", autocommit=True)
    try:
        conn.execute(f"START_REPLICATION SLOT {env.slot} LOGICAL 0/0 (proto_version '1', "
                     f"publication_names '{publication}', messages 'true')")
        pgconn = conn.pgconn
        pgconn.nonblocking = 1
        while b"raw-read" not in data:
            assert time.monotonic() < deadline, "the end marker never came"
            select.select([pgconn.socket], [], [], 1)
            pgconn.consume_input()
            while True:
                n, buf = pgconn.get_copy_data(1)
                if n <= 0:
                    break
                if bytes(buf[:1]) == b"w":
                    data += bytes(buf[25:])
    finally:
        conn.close()
    return data


@pytest.fixture
def accounts(env):
    env.execute(ACCOUNTS)
    env.write_mapping("account.yaml", MAPPING)
    return env


def test_init_sends_only_the_mapped_columns_and_updates_the_list_in_place(accounts):
    env = accounts
    # init runs as the owner of the publication and of the mapped table; another member is not its own
    owner = f"owner_{env.dbname}"
    env.execute(f'CREATE ROLE "{owner}" LOGIN REPLICATION')
    env.apply_sql("25_backfills.sql")
    env.execute(f'ALTER TABLE accounts OWNER TO "{owner}"')
    env.execute("CREATE PUBLICATION cdc FOR TABLE public.other (id, a)")  # another member, its own list
    env.execute(f'ALTER PUBLICATION cdc OWNER TO "{owner}"')
    env.write_config(dsn=env.postgres.dsn_for(owner, dbname=env.dbname))
    first = env.cdc("init", check=True).stdout
    assert "set the columns of 1 mapped table(s), 1 of them added" in first, first
    assert published(env, "accounts") == ["id", "name", "score"]  # fields, key, filter
    assert published(env, "other") == ["id", "a"]
    assert "already covers the mapped tables with the columns they need" in env.cdc("init", check=True).stdout

    # the same changes through a publication of every column: the test sees the value when it is sent
    env.execute("CREATE PUBLICATION everything FOR TABLE public.accounts")
    env.execute("INSERT INTO accounts VALUES (1, 'visible-name', 5, %s)", (SECRET,))
    env.execute("UPDATE accounts SET name = 'renamed' WHERE id = 1")
    sent = raw_changes(env, "cdc")
    assert b"visible-name" in sent and b"renamed" in sent
    assert SECRET.encode() not in sent
    assert SECRET.encode() in raw_changes(env, "everything")

    # the mapping reads one more column: init sets the list again, in place, and keeps the other member
    env.write_mapping("account.yaml", MAPPING.replace("name: name}", "name: name, secret: secret}"))
    assert "set the columns of 1 mapped table(s)" in env.cdc("init", check=True).stdout
    assert published(env, "accounts") == ["id", "name", "score", "secret"]
    assert published(env, "other") == ["id", "a"]
    env.execute(f'DROP OWNED BY "{owner}" CASCADE; DROP ROLE "{owner}"')


@pytest.mark.both_paths
def test_a_publication_sending_less_stops_the_bridge_and_check_until_init(accounts):
    env = accounts
    env.cdc("init", check=True)
    env.write_config("batch: {status_interval_s: 0.2}\n")
    proc = env.start_bridge()
    env.execute("INSERT INTO accounts VALUES (1, 'a', 1, %s)", (SECRET,))
    env.execute("ALTER TABLE accounts ADD COLUMN extra text")  # DDL while streaming: not published
    env.execute("INSERT INTO accounts VALUES (2, 'b', 1, 's', 'E2')")
    wait_for(lambda: env.redis.xlen("cdc:account") == 2, 30, "both rows")
    assert [e["data"] for e in read_stream(env.redis, "cdc:account")] == [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]
    assert published(env, "accounts") == ["id", "name", "score"]
    proc.terminate()
    assert proc.wait(30) == 0
    assert "entities account: a table takes one publication row filter, which several mappings" in proc.log_path.read_text()

    # the mapping now reads the new column, which the publication does not send
    env.write_mapping("account.yaml", MAPPING.replace("name: name}", "name: name, extra: extra}"))
    check = env.cdc("check")
    assert check.returncode == 4, check.stdout + check.stderr
    assert "does not send column(s) extra of mapped table public.accounts" in check.stderr
    assert "cdc init" in check.stderr
    proc = env.start_bridge()
    assert proc.wait(30) == 4
    log = proc.log_path.read_text()
    assert "does not send column(s) extra" in log and "run: cdc init" in log and "Traceback" not in log

    env.cdc("init", check=True)
    assert env.cdc("check").returncode == 0
    proc = env.start_bridge()
    env.execute("INSERT INTO accounts VALUES (3, 'c', 1, 's', 'E3')")
    wait_for(lambda: env.redis.xlen("cdc:account") == 3, 30, "the row with the new column")
    assert read_stream(env.redis, "cdc:account")[-1]["data"] == {"id": 3, "name": "c", "extra": "E3"}

    # someone narrows the publication while the bridge runs: it stops, no entry lacks a field
    env.execute("ALTER PUBLICATION cdc SET TABLE public.accounts (id, score, extra)")
    env.execute("INSERT INTO accounts VALUES (4, 'd', 1, 's', 'E4')")
    assert proc.wait(30) == 4
    log = proc.log_path.read_text()
    assert "column(s) name" in log and "cdc init" in log, log
    assert all("name" in e["data"] for e in read_stream(env.redis, "cdc:account"))

    # more than needed: a warning with the fix, not a problem
    env.execute("ALTER PUBLICATION cdc SET TABLE public.accounts")
    check = env.cdc("check")
    assert check.returncode == 0, check.stderr
    assert "sends column(s) secret of public.accounts that no mapping reads" in check.stdout + check.stderr


@pytest.mark.both_paths
def test_a_relation_lacking_a_mapped_column_stops_the_bridge(accounts):
    """The stream's own description of the table, not only the gate's reading, stops the bridge: the
    publication is narrowed and a row written in one transaction, before any gate reading sees it."""
    env = accounts
    env.cdc("init", check=True)
    env.write_config("batch: {status_interval_s: 60}\n")  # the gate reads at start only
    proc = env.start_bridge()
    env.execute("INSERT INTO accounts VALUES (1, 'a', 1, 's')")
    wait_for(lambda: env.redis.xlen("cdc:account") == 1, 30, "the first row")
    env.execute("BEGIN; ALTER PUBLICATION cdc SET TABLE public.accounts (id, score); "
                "INSERT INTO accounts VALUES (2, 'b', 1, 's'); COMMIT")
    assert proc.wait(30) == 4
    log = proc.log_path.read_text()
    assert "lacks column(s) name that entity 'account' reads" in log, log
    assert env.redis.xlen("cdc:account") == 1


def test_init_sets_no_row_filter_and_the_bridge_judges_a_crossing_update_as_postgresql_would(accounts):
    """PostgreSQL turns an update crossing a row filter into a DELETE or an INSERT; the bridge's own filter
    (which init leaves to the bridge: one row filter per table could not serve several mappings) judges the
    old and new rows alike: an update leaving the filter gives op d, one entering it op c."""
    env = accounts
    mapping = parse_mapping(load_yaml_documents(MAPPING.replace("{score: {gte: 0}}", "{id: {gt: 10}}")
                                                .replace("ops: [c, t]", "ops: [c, u, d]"), "account.yaml")[0])
    env.cdc("init", check=True)
    assert env.execute("SELECT count(*) FROM pg_publication_rel WHERE prqual IS NOT NULL")[0][0] == 0
    env.execute("CREATE PUBLICATION filtered FOR TABLE public.accounts WHERE (id > 10)")  # the key: identity
    env.execute("INSERT INTO accounts VALUES (4, 'a', 1, 's'), (12, 'b', 1, 's')")
    with env.connect() as conn:
        conn.execute("SELECT pg_create_logical_replication_slot('rowfilter', 'pgoutput', true)")
        conn.execute("UPDATE accounts SET id = 11 WHERE id = 4")  # enters: INSERT
        conn.execute("UPDATE accounts SET id = 5 WHERE id = 12")  # leaves: DELETE
        kinds = [bytes(d)[:1] for (d,) in conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes('rowfilter', NULL, NULL, "
            "'proto_version', '1', 'publication_names', 'filtered')").fetchall()]
    assert [k for k in kinds if k in b"IUD"] == [b"I", b"D"]
    # the bridge's entries for the same two updates (the projector the stream uses)
    shape = TableShape("public", "accounts", (ColumnShape("id", 20, True), ColumnShape("name", 25),
                                              ColumnShape("score", 23), ColumnShape("secret", 25)))
    projector = Projector(mapping, shape, TypeCatalog())
    entering = projector.update(["11", "a", "1", "s"], ["4", None, None, None], old_full=False)
    leaving = projector.update(["5", "a", "1", "s"], ["12", None, None, None], old_full=False)
    assert entering.fields[:4] == [b"op", b"c", b"key", b'{"id":11}']
    assert leaving.fields[:4] == [b"op", b"d", b"key", b'{"id":12}']


def test_a_partitioned_table_lists_its_partitions_identity_and_full_identity_takes_every_column(env):
    """The list covers every partition's replica identity (PostgreSQL refuses their updates otherwise); a partition
    turned REPLICA IDENTITY FULL needs every column: check and the gate report it, init removes the list."""
    env.execute("""
        CREATE TABLE public.meas (id bigint NOT NULL, at date NOT NULL, v int, note text, PRIMARY KEY (id, at))
            PARTITION BY RANGE (at);
        CREATE TABLE public.meas_2025 PARTITION OF public.meas FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');
        CREATE TABLE public.meas_2026 PARTITION OF public.meas FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');
        INSERT INTO public.meas VALUES (1, '2025-05-01', 1, 'n'), (2, '2026-05-01', 2, 'n');
        """)
    env.write_mapping("meas.yaml", "entity: meas\ntable: public.meas\nkey: [id, at]\nops: [c, u]\nfields: {id: id, at: at, v: v}\n")
    env.cdc("init", check=True)
    assert published(env, "meas") == ["id", "at", "v"]  # `at`: the partitions' primary key
    env.execute("UPDATE meas SET v = 3")

    env.execute("ALTER TABLE meas_2026 REPLICA IDENTITY FULL")
    with pytest.raises(psycopg.errors.InvalidColumnReference):  # PostgreSQL: the list must cover it now
        env.execute("UPDATE meas SET v = 4 WHERE id = 2")
    check = env.cdc("check")
    assert check.returncode == 4 and "does not send column(s) note of mapped table public.meas" in check.stderr
    init = env.cdc("init", check=True).stdout
    assert "sends every column of public.meas (REPLICA IDENTITY FULL" in init, init
    assert published(env, "meas") is None
    env.execute("UPDATE meas SET v = 4 WHERE id = 2")
    assert env.cdc("check").returncode == 0
    run = env.cdc("run", "--until-caught-up")
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("publication cdc sends every column of public.meas (REPLICA IDENTITY FULL") == 1, run.stderr
