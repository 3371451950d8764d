"""A mapping's key must name at most one row, as the catalog proves it: `cdc init`, `cdc check` and `cdc run`
refuse any other key in one line with the mapping's file:line and the fix, and the fix, followed, works."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from cdc.demo.local import wait_for
from cdc.mapping.model import load_mappings
from cdc.mapping.uniqueness import key_uniqueness_problem

pytestmark = pytest.mark.integration

MAPPINGS_DOC = Path(__file__).resolve().parents[2] / "docs" / "reference" / "mappings.md"
ACCT = "entity: acct\ntable: public.acct\nkey: [a]\nfields: {a: a, b: b}\n"


def error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("cdc: error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def the_fix(line: str) -> str:
    """The SQL the error says to run."""
    return re.search(r"; run: (ALTER TABLE .*?), or ", line)[1]


def slots(env) -> list:
    return env.execute("SELECT slot_name FROM pg_replication_slots WHERE slot_name = %s", (env.slot,))


def test_init_check_and_run_refuse_a_key_that_may_name_several_rows_and_the_fix_works(env):
    env.execute("CREATE TABLE public.acct (a int, b text); ALTER TABLE public.acct REPLICA IDENTITY FULL")
    env.execute("INSERT INTO acct VALUES (1, 'x'), (2, 'y')")
    path = env.write_mapping("acct.yaml", ACCT)

    init = env.cdc("init")
    line = error_line(init)
    assert init.returncode == 3
    assert line.startswith(f"cdc: error: {path}:3: entity 'acct': key [a] may name several rows of public.acct: "), line
    assert "run: ALTER TABLE public.acct ALTER COLUMN a SET NOT NULL, ADD UNIQUE (a), or choose a key" in line, line
    assert slots(env) == []  # refused before anything was created
    documented = [x for x in MAPPINGS_DOC.read_text().splitlines() if x.startswith("cdc: error: mappings/acct.yaml:3:")]
    assert documented == [line.replace(str(path), "mappings/acct.yaml")]  # docs/reference/mappings.md shows it as it is

    check = env.cdc("check")
    assert check.returncode == 3 and line.removeprefix("cdc: error: ") in check.stderr, check.stderr

    env.execute(the_fix(line))  # as the message says
    env.cdc("init", check=True)
    assert env.cdc("check").returncode == 0

    # the constraint dropped while the bridge was stopped: cdc run refuses to stream
    env.execute("ALTER TABLE acct DROP CONSTRAINT acct_a_key")
    env.execute("INSERT INTO acct VALUES (1, 'dup')")
    run = env.cdc("run", "--until-caught-up")
    again = error_line(run)
    assert run.returncode == 3 and again.startswith(f"cdc: error: {path}:3: entity 'acct': key [a] may name several"), run.stderr
    assert "run: ALTER TABLE public.acct ADD UNIQUE (a), or " in again, again  # a is NOT NULL by now
    env.execute("DELETE FROM acct WHERE b = 'dup'")
    env.execute(the_fix(again))
    env.execute("INSERT INTO acct VALUES (3, 'z'); UPDATE acct SET a = 10 WHERE a = 1; UPDATE acct SET b = 'w' WHERE a = 2")
    env.execute("UPDATE acct SET a = 1 WHERE a = 3; DELETE FROM acct WHERE a = 2")
    env.cdc("run", "--until-caught-up", check=True)

    sink = env._start("sink", "consume", "--entity", "acct", "--group", "m", "--start", "0", "--sink", "public.mirror", env=None)
    client = env.redis

    def done():
        assert sink.poll() is None, sink.log_path.read_text()
        (group,) = client.xinfo_groups("cdc:acct")
        return group["entries-read"] == client.xlen("cdc:acct") and group["pending"] == 0

    wait_for(done, 60, "the sink to consume the stream", fatal=(AssertionError,))
    mirror = {orjson.dumps(k).decode(): d for k, d in env.execute("SELECT key, data FROM mirror WHERE NOT deleted")}
    source = {orjson.dumps({"a": a}).decode(): {"a": a, "b": b} for a, b in env.execute("SELECT a, b FROM acct")}
    assert mirror == source == {'{"a":1}': {"a": 1, "b": "z"}, '{"a":10}': {"a": 10, "b": "x"}}


def test_a_key_over_duplicate_rows_is_refused_and_the_primary_key_is_offered(env):
    env.execute("CREATE TABLE public.acct (id int PRIMARY KEY, a int NOT NULL, b text)")
    env.execute("INSERT INTO acct VALUES (1, 7, 'x'), (2, 7, 'y')")
    path = env.write_mapping("acct.yaml", "entity: acct\ntable: public.acct\nkey: [a]\nops: [c, t]\nfields: {id: id, a: a, b: b}\n")
    init = env.cdc("init")
    line = error_line(init)
    assert init.returncode == 3 and line.startswith(f"cdc: error: {path}:3: entity 'acct': key [a] may name several rows"), line
    assert line.endswith("run: ALTER TABLE public.acct ADD UNIQUE (a), or key on the primary key (id)"), line
    env.write_mapping("acct.yaml", "entity: acct\ntable: public.acct\nkey: [id]\nfields: {id: id, a: a, b: b}\n")
    env.cdc("init", check=True)


@pytest.mark.parametrize(
    ("ddl", "key", "fields", "problem"),
    [
        ("id int PRIMARY KEY, a int", "[id]", "{id: id, a: a}", None),
        ("id int PRIMARY KEY, a int", "[id, a]", "{id: id, a: a}", None),  # covers the primary key
        ("id int, a int NOT NULL UNIQUE", "[a]", "{a: a, id: id}", None),
        ("id int, a int UNIQUE", "[a]", "{a: a}", "allows NULLs"),
        ("id int PRIMARY KEY DEFERRABLE, a int", "[id]", "{id: id}", "is deferrable"),
        ("id int, a int NOT NULL, b int NOT NULL, UNIQUE (a, b)", "[a]", "{a: a}", "no primary key or unique index"),
        ("t timestamp PRIMARY KEY", "[t]", "{t: {column: t, cast: date}}", "cast other than to string"),
        ("t timestamp PRIMARY KEY", "[t]", "{t: {column: t, cast: string}}", None),
    ],
)
def test_what_proves_a_key_unique(env, ddl, key, fields, problem):
    env.execute(f"CREATE TABLE public.k ({ddl})")
    env.write_mapping("k.yaml", f"entity: k\ntable: public.k\nkey: {key}\nfields: {fields}\n")
    (mapping,) = load_mappings(env.mappings_dir)
    with env.connect() as conn:
        found = key_uniqueness_problem(conn, mapping)
    if problem is None:
        assert found is None, str(found)
    else:
        assert found is not None and problem in str(found) and found.exit_code == 3, str(found)


def test_a_unique_index_as_replica_identity_proves_the_key(env):
    env.execute("CREATE TABLE public.k (id int, a int NOT NULL); CREATE UNIQUE INDEX k_a ON k (a); ALTER TABLE k REPLICA IDENTITY USING INDEX k_a")
    env.write_mapping("k.yaml", "entity: k\ntable: public.k\nkey: [a]\nfields: {a: a, id: id}\n")
    (mapping,) = load_mappings(env.mappings_dir)
    with env.connect() as conn:
        assert key_uniqueness_problem(conn, mapping) is None
