"""A primary key moved to another column and back: the slot decodes the changes written in between with the
table as it was then (its key out of the replica identity), whatever the table is now. The bridge says so and
names `cdc recover`, and following that, the stream is exact; while the key is still out of the identity, the
error's own fix (the primary key back, or REPLICA IDENTITY FULL) comes first."""

from __future__ import annotations

import pytest

from conftest import read_stream
from replay import replay

pytestmark = pytest.mark.integration

MAPPING = "entity: p\ntable: public.p\nkey: [id]\nfields: {id: id, email: email, v: v}\n"


def rows(env) -> dict:
    return {i: {"id": i, "email": e, "v": v} for i, e, v in env.execute("SELECT id, email, v FROM p")}


def streamed_then_key_moved(env, count: int) -> None:
    """Table p keyed on id, `count` rows streamed, then its primary key moved to email and one row updated."""
    env.execute("CREATE TABLE p (id int PRIMARY KEY, email text NOT NULL, v int)")
    env.write_mapping("p.yaml", MAPPING)
    env.cdc("init", check=True)
    env.execute("INSERT INTO p SELECT g, 'e' || g, g FROM generate_series(1, %s) g", (count,))
    env.cdc("run", "--until-caught-up", check=True)
    env.execute("ALTER TABLE p DROP CONSTRAINT p_pkey, ADD PRIMARY KEY (email)")
    env.execute("UPDATE p SET v = 10 WHERE id = 1")


def test_a_primary_key_moved_and_back_names_recover_and_recover_makes_the_stream_exact(env):
    streamed_then_key_moved(env, 6)
    env.execute("DELETE FROM p WHERE id = 5")
    run = env.cdc("run", "--until-caught-up")  # the key is out of the identity now: the table's fix first
    assert run.returncode == 3, run.stderr
    # the key no longer names one row for sure (no unique index on id), and deletes would not carry it
    assert "ADD UNIQUE (id)" in run.stderr or "is not in the replica identity of public.p" in run.stderr, run.stderr
    assert "cdc recover" not in run.stderr

    env.execute("ALTER TABLE p DROP CONSTRAINT p_pkey, ADD PRIMARY KEY (id)")  # back
    env.execute("UPDATE p SET v = 20 WHERE id = 2")
    env.execute("DELETE FROM p WHERE id = 6")
    run = env.cdc("run", "--until-caught-up")
    assert run.returncode == 3, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert "when its changes still to stream were written" in line and "run cdc recover" in line, line

    recovered = env.cdc("recover")  # the message, literally
    assert recovered.returncode == 0, recovered.stderr
    env.execute("UPDATE p SET v = 30 WHERE id = 3")
    env.execute("DELETE FROM p WHERE id = 4")
    run = env.cdc("run", "--until-caught-up")
    assert run.returncode == 0, run.stderr
    assert replay(read_stream(env.redis, "cdc:p")) == rows(env)
    assert [e["op"] for e in read_stream(env.redis, "cdc:p")][-2:] == ["u", "d"]


def test_recover_refuses_while_the_key_is_out_of_the_identity(env):
    """`cdc recover` rebuilds only a table its mappings bind to: the table's own fix comes first."""
    streamed_then_key_moved(env, 3)
    recovered = env.cdc("recover")
    assert recovered.returncode == 3, recovered.stderr
    assert "is not in the replica identity of public.p" in recovered.stderr
