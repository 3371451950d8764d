"""A SQL_ASCII database holding text that is not valid UTF-8: `cdc check` warns of the encoding; the bridge
stops at the transaction the server cannot send, naming it, the query that finds the rows and the way past,
and following that literally leads back to an exact stream."""

from __future__ import annotations

import re

import psycopg
import pytest

from conftest import read_stream

pytestmark = pytest.mark.integration


@pytest.fixture
def ascii_env(env):
    first = env.dbname
    db = first + "_ascii"
    with psycopg.connect(env.postgres.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE \"{db}\" ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    env.dbname = db
    env.slot = f"slot_{db}"
    yield env
    env.close()
    env.dbname = first
    with psycopg.connect(env.postgres.dsn, autocommit=True) as conn:
        for (slot,) in conn.execute("SELECT slot_name FROM pg_replication_slots WHERE database = %s", (db,)).fetchall():
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def rows(env) -> dict:
    return {i: {"id": i, "name": n.decode()} for i, n in env.execute("SELECT id, name FROM t")}  # SQL_ASCII: bytes


def replay_tail(entries: list[dict]) -> dict:
    marker = max((i for i, e in enumerate(entries) if e["op"] == "x"), default=-1)
    out: dict = {}
    for e in entries[marker + 1:]:
        if e["op"] in ("c", "u", "r"):
            out[e["key"]["id"]] = e["data"]
        elif e["op"] == "d":
            out.pop(e["key"]["id"], None)
    return out


def test_text_that_is_not_utf8_stops_the_bridge_with_the_way_past_and_it_works(ascii_env):
    env = ascii_env
    env.execute("CREATE TABLE t (id int PRIMARY KEY, name text)")
    env.write_mapping("t.yaml", "entity: t\ntable: public.t\nkey: [id]\nfields: {id: id, name: name}\n")
    env.write_config()
    env.cdc("init", check=True)
    check = env.cdc("check")
    assert check.returncode == 0 and "uses encoding SQL_ASCII" in check.stdout + check.stderr, check.stdout
    env.execute("INSERT INTO t VALUES (1, 'plain')")
    env.execute("INSERT INTO t VALUES (2, convert_from('\\x636166e9'::bytea, 'SQL_ASCII'))")  # 'caf' + Latin-1 e-acute
    env.execute("INSERT INTO t VALUES (3, 'after')")

    run = env.cdc("run", "--until-caught-up")
    assert run.returncode == 4, run.stderr
    assert "Traceback" not in run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert "a text value in it is not valid UTF-8" in line and "0xe9" in line and "committed at" in line, line
    assert [e["key"]["id"] for e in read_stream(env.redis, "cdc:t")] == [1], "what came before is published"

    # the way past, literally: the query names the row, repair it, drop the slot, cdc init, cdc recover, cdc run
    query = re.search(r"bytes beyond ASCII with `([^`]+)`", line)
    assert query, line
    assert env.execute(query.group(1)) == [(2,)]
    env.execute("UPDATE t SET name = 'cafe' WHERE id = 2")
    slot = re.search(r"SELECT pg_drop_replication_slot\('([^']+)'\)", line).group(1)
    env.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    env.cdc("init", check=True)
    recovered = env.cdc("recover")
    assert recovered.returncode == 0, recovered.stderr
    env.execute("INSERT INTO t VALUES (4, 'later')")
    env.cdc("run", "--until-caught-up", check=True)
    assert replay_tail(read_stream(env.redis, "cdc:t")) == rows(env)
