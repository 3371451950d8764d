"""Schema migrations on mapped columns, by the procedure docs/how-to/upgrading.md teaches: with the column
lists `cdc init` sets, PostgreSQL refuses `ALTER COLUMN ... TYPE` on a mapped column and a `DROP COLUMN`
without CASCADE (which would take the table out of the publication). Lifting the table's list in one
transaction lets the migration through while the bridge streams on, and no change is lost."""

from __future__ import annotations

import random
import threading

import psycopg
import pytest

from cdc.demo.local import wait_for
from conftest import read_stream

pytestmark = pytest.mark.integration

MAPPING = "entity: p\ntable: public.p\nkey: [id]\nfields: {id: id, amount: amount, note: note}\n"
WITHOUT_NOTE = "entity: p\ntable: public.p\nkey: [id]\nfields: {id: id, amount: amount}\n"
LIFT = ("BEGIN; ALTER PUBLICATION {pub} DROP TABLE public.p; ALTER PUBLICATION {pub} ADD TABLE public.p; COMMIT;")


class Writer(threading.Thread):
    """Inserts, updates and deletes rows of p until stopped, through whatever the migration does."""

    def __init__(self, env) -> None:
        super().__init__(daemon=True)
        self.env, self.stop, self.error = env, threading.Event(), None
        self.rounds = 0

    def run(self) -> None:
        rng = random.Random(7)
        try:
            with psycopg.connect(self.env.dsn, autocommit=True) as conn:
                while not self.stop.is_set():
                    n = rng.randrange(1, 60)
                    conn.execute("INSERT INTO p (id, amount) VALUES (%s, %s) ON CONFLICT (id) DO UPDATE "
                                 "SET amount = p.amount + 1", (n, rng.randrange(1000)))
                    if rng.random() < 0.2:
                        conn.execute("DELETE FROM p WHERE id = %s", (rng.randrange(1, 60),))
                    self.rounds += 1
        except psycopg.Error as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def table(env, fields: tuple[str, ...]) -> dict:
    rows = env.execute(f"SELECT id, {', '.join(fields)} FROM p")
    return {r[0]: dict(zip(("id", *fields), r)) for r in rows}


def stream(env) -> dict:
    out: dict = {}
    for e in read_stream(env.redis, "cdc:p"):
        if e["op"] in ("c", "u", "r"):
            out[e["key"]["id"]] = {**out.get(e["key"]["id"], {}), **e["data"]}
        elif e["op"] == "d":
            out.pop(e["key"]["id"], None)
    return out


def test_the_documented_migrations_go_through_while_the_bridge_streams_and_lose_nothing(env):
    env.execute("CREATE TABLE p (id int PRIMARY KEY, amount int, note text, extra text)")
    env.write_mapping("p.yaml", MAPPING)
    env.cdc("init", check=True)
    bridge = env.start_bridge()
    writer = Writer(env)
    writer.start()
    try:
        wait_for(lambda: writer.rounds > 50, 60, "the writer to write")
        # streaming (a bridge still starting up, its SIGTERM handler not yet set, dies of the stop below)
        wait_for(lambda: env.redis.xlen("cdc:p") > 0, 120, "the bridge to stream")
        # what the column list refuses, as the docs say
        with pytest.raises(psycopg.errors.FeatureNotSupported):
            env.execute("ALTER TABLE p ALTER COLUMN amount TYPE bigint")
        with pytest.raises(psycopg.errors.DependentObjectsStillExist):
            env.execute("ALTER TABLE p DROP COLUMN note")

        # 1. a type change: lift the list in one transaction, migrate, cdc init sets it again
        with env.connect() as conn:
            conn.execute(LIFT.format(pub=env.publication))
        env.execute("ALTER TABLE p ALTER COLUMN amount TYPE bigint")
        env.cdc("init", check=True)
        wait_for(lambda: writer.rounds > 150, 60, "the writer to write on")
        assert bridge.poll() is None, bridge.log_path.read_text()

        # 2. a mapped column dropped: stop the bridge, the field out of the mapping, cdc init, cdc run, then drop
        bridge.terminate()
        assert bridge.wait(60) == 0, bridge.log_path.read_text()
        env.write_mapping("p.yaml", WITHOUT_NOTE)
        env.cdc("init", check=True)
        bridge = env.start_bridge()
        env.execute("ALTER TABLE p DROP COLUMN note")  # no CASCADE needed: the list no longer names it
        wait_for(lambda: writer.rounds > 250, 60, "the writer to write on")
    finally:
        writer.stop.set()
        writer.join(30)
    assert writer.error is None, writer.error
    assert env.execute("SELECT count(*) FROM pg_publication_tables WHERE pubname = %s AND tablename = 'p'",
                       (env.publication,)) == [(1,)], "the table never left the publication"
    want = {i: {"id": i, "amount": a} for i, a in env.execute("SELECT id, amount FROM p")}
    try:
        wait_for(lambda: {i: {"id": r["id"], "amount": r["amount"]} for i, r in stream(env).items()} == want, 60,
                 "the stream to hold the table")
    finally:
        bridge.terminate()
        assert bridge.wait(60) == 0, bridge.log_path.read_text()
    assert "cdc: error" not in bridge.log_path.read_text()
