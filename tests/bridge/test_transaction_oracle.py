"""Transaction mode against the tables: a seeded random workload (inserts, updates that move a row into and out of
a filter and change its key, deletes, a truncate, transactions over two tables) through `cdc run`, consumed whole
transaction by whole transaction by a `TransactionalHandler` that keeps a read model in PostgreSQL; once the
consumer has caught up, the read model equals each mapping's projection of its table. The mappings filter, cast,
hash, redact, add a constant and key on a unique column other than the primary key (tests/bridge/
test_mapping_oracle.py's), and each handler call must hold only whole transactions, each committed at one LSN."""

from __future__ import annotations

import threading
import uuid

import orjson
import pytest

from cdc.consume import Consumer, TransactionalHandler
from cdc.demo.local import wait_for
from conftest import read_stream
from test_mapping_oracle import ACCOUNTS, SIGNUPS, Workload, projected

pytestmark = pytest.mark.integration

TX = "cdc:transactions"
ORDERS = """\
entity: ord
table: public.ord
key: [id]
filter: {qty: {gte: 3}}
fields:
  id: id
  acct: acct
  qty: {column: qty, cast: string}
  price: {column: price, cast: float}
  at: {column: at, cast: epoch_ms}
"""
STREAMS = {"cdc:acct": "mail", "cdc:ord": "id", "cdc:signup": "id"}


def orders(env) -> dict:
    return {i: {"id": i, "acct": a, "qty": str(q), "price": float(p), "at": ms} for i, a, q, p, ms in env.execute(
        "SELECT id, acct, qty, price::text, (extract(epoch FROM at) * 1000)::bigint FROM ord WHERE qty >= 3")}


class TwoTables(Workload):
    """test_mapping_oracle's workload on acct, and in the same transactions (or alone) changes of ord."""

    def __init__(self, env, seed: int) -> None:
        super().__init__(env, seed)
        self.next_order = 1
        self.truncated = False

    def large(self) -> None:
        """One transaction over both tables larger than logical_decoding_work_mem (the server streams it while it
        runs when the bridge asks)."""
        with self.env.connect() as conn, conn.transaction():
            first, self.next_order = self.next_order, self.next_order + 400
            conn.execute("INSERT INTO ord SELECT g, g %% 7, g %% 6, (g %% 1000) / 10.0, timestamptz '2026-01-01 00:00:00+00' "
                         "+ g * interval '1 second' FROM generate_series(%s::int, %s::int) g",
                         (first, first + 399))
            conn.execute("UPDATE ord SET qty = (qty + 1) % 6 WHERE id % 3 = 0")
            conn.execute("UPDATE acct SET status = 'active' WHERE id % 2 = 0")

    def transaction(self) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.6:
            super().transaction()
            if roll < 0.3:
                return
        with self.env.connect() as conn, conn.transaction():
            if roll >= 0.6:  # acct and ord in one transaction
                conn.execute("UPDATE acct SET status = CASE status WHEN 'active' THEN 'closed' ELSE 'active' END "
                             "WHERE id = (SELECT min(id) FROM acct)")
            ids = [i for (i,) in conn.execute("SELECT id FROM ord")]
            for _ in range(rng.randrange(1, 5)):
                step = rng.random()
                if step < 0.35 or not ids:
                    i, self.next_order = self.next_order, self.next_order + 1
                    conn.execute("INSERT INTO ord VALUES (%s, %s, %s, %s, timestamptz '2026-01-01 00:00:00+00' "
                                 "+ %s * interval '1 second')",
                                 (i, rng.randrange(1, 50), rng.randrange(6), f"{rng.randrange(10000) / 100:.2f}",
                                  rng.randrange(10**6)))
                    ids.append(i)
                    continue
                i = rng.choice(ids)
                if step < 0.65:  # into or out of the filter (or neither)
                    conn.execute("UPDATE ord SET qty = %s WHERE id = %s", (rng.randrange(6), i))
                elif step < 0.75:
                    conn.execute("UPDATE ord SET price = price + 0.01, at = at + interval '1 ms' WHERE id = %s", (i,))
                elif step < 0.87:  # the key, sometimes the filter too
                    new, self.next_order = self.next_order, self.next_order + 1
                    conn.execute("UPDATE ord SET id = %s, qty = %s WHERE id = %s", (new, rng.randrange(6), i))
                    ids[ids.index(i)] = new
                elif step < 0.97 or self.truncated:
                    conn.execute("DELETE FROM ord WHERE id = %s", (i,))
                    ids.remove(i)
                else:
                    conn.execute("TRUNCATE ord")
                    self.truncated = True
                    ids.clear()


def apply(conn, entries, consumer: str) -> None:
    """The read model: one row per stream and key, as a consumer applies the stream by key."""
    seen: dict[int, int] = {}
    for e in entries:
        assert e.lsn == seen.setdefault(e.xid, e.lsn), f"a transaction's entries at two LSNs: {e}"
        if e.op in ("t", "x"):
            conn.execute("DELETE FROM rm WHERE stream = %s", (e.stream,))
            continue
        name = STREAMS[e.stream]
        key = orjson.dumps(e.key[name]).decode()
        if e.op in ("c", "u", "r"):
            old = (e.before or {}).get(name)
            if e.op == "u" and old is not None and old != e.key[name]:
                conn.execute("DELETE FROM rm WHERE stream = %s AND k = %s", (e.stream, orjson.dumps(old).decode()))
            conn.execute("INSERT INTO rm VALUES (%s, %s, %s) ON CONFLICT (stream, k) DO UPDATE SET data = excluded.data",
                         (e.stream, key, orjson.dumps(e.data).decode()))
        elif e.op == "d":
            conn.execute("DELETE FROM rm WHERE stream = %s AND k = %s", (e.stream, key))
        else:
            raise AssertionError(f"unexpected entry {e}")
    call = str(uuid.uuid4())
    conn.cursor().executemany("INSERT INTO calls VALUES (%s, %s)", [(call, xid) for xid in seen])


def read_model(env, stream: str) -> dict:
    return {orjson.loads(k): orjson.loads(d) for k, d in env.execute("SELECT k, data::text FROM rm WHERE stream = %s",
                                                                        (stream,))}


def caught_up(env) -> bool:
    """Every entry of the three streams and every END read and acknowledged by the group."""
    for stream in (*STREAMS, TX):
        groups = env.redis.xinfo_groups(stream) if env.redis.exists(stream) else []
        if not groups or groups[0]["pending"] or groups[0]["lag"]:
            return False
    return True


@pytest.mark.parametrize("seed, streaming", [(5, False), (8, True)])
def test_a_transaction_mode_read_model_equals_the_tables_projections(env, seed, streaming):
    env.apply_sql("20_consumer_state.sql")
    env.execute("CREATE TABLE rm (stream text, k text, data jsonb, PRIMARY KEY (stream, k))")
    env.execute("CREATE TABLE calls (call text, xid bigint)")
    env.execute("CREATE TABLE acct (id int PRIMARY KEY, email text NOT NULL UNIQUE, status text, "
                "amount numeric(12,2), country text, phone text)")
    env.execute("CREATE TABLE ord (id int PRIMARY KEY, acct int, qty int, price numeric(8,2), at timestamptz)")
    env.execute("ALTER TABLE acct REPLICA IDENTITY FULL; ALTER TABLE ord REPLICA IDENTITY FULL")
    env.write_mapping("acct.yaml", ACCOUNTS)
    env.write_mapping("signup.yaml", SIGNUPS)
    env.write_mapping("ord.yaml", ORDERS)
    # small batches: a transaction's entries and its END often in different ones
    env.write_config(f"batch: {{max_entries: 7, stream_buffer_mb: 1}}\ntransactions: {{stream: '{TX}'}}\n",
                     postgres=f", streaming: {str(streaming).lower()}")
    if streaming:  # large transactions streamed while they run, held by the bridge until their commit
        env.execute(f'ALTER DATABASE "{env.dbname}" SET logical_decoding_work_mem = \'64kB\'')
    env.cdc("init", check=True)
    consumer = Consumer(env.redis, list(STREAMS), "rm", "c1", transactions=TX, lease_ttl_ms=1000, block_ms=100)
    consumer.create_group("0")
    stop, failure = threading.Event(), []

    def applying(conn, entries, name: str) -> None:
        try:
            apply(conn, entries, name)
        except Exception as exc:  # the consumer would retry and dead-letter it: reported below
            failure.append(exc)
            raise

    handler = TransactionalHandler(env.dsn, "rm", applying, epoch_of=consumer.epoch)

    def run() -> None:
        try:
            consumer.run(handler, stop)
        except Exception as exc:  # reported below
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    work = TwoTables(env, seed)
    try:
        for _ in range(3):  # each round ends in a restart of the bridge
            for n in range(50):
                work.large() if n == 25 else work.transaction()
            env.cdc("run", "--until-caught-up", check=True)
            wait_for(lambda: caught_up(env) or bool(failure), 30, "the consumer to apply every transaction")
            assert not failure, failure
            assert read_model(env, "cdc:acct") == projected(env)
            assert read_model(env, "cdc:ord") == orders(env)
            assert read_model(env, "cdc:signup") == work.inserted
    finally:
        stop.set()
        thread.join(30)
        handler.close()
    entries = {s: read_stream(env.redis, s) for s in ("cdc:ord", "cdc:acct")}
    assert {e["op"] for s in entries.values() for e in s} == {"c", "u", "d", "t"}
    assert any(e["op"] == "u" and e.get("before", {}).get("id", e["key"]["id"]) != e["key"]["id"]
               for e in entries["cdc:ord"]), "a key changed"
    assert {e["xid"] for e in entries["cdc:ord"]} & {e["xid"] for e in entries["cdc:acct"]}, "two tables in one"
    if streaming:
        assert env.execute("SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = %s",
                           (env.slot,))[0][0] > 0
    # no transaction split over two calls
    assert env.execute("SELECT xid FROM calls GROUP BY xid HAVING count(DISTINCT call) > 1") == []
