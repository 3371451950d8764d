"""Transaction mode end to end: writers commit transactions over three tables while the bridge and a
transaction-mode consumer are killed at random; the consumer's read model never shows part of a
transaction, and ends equal to the tables."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import orjson
import psycopg
import pytest

from cdc.demo.local import wait_for
from tx_readmodel import BROKEN, SCHEMA

pytestmark = pytest.mark.integration

TX = "cdc:transactions"
TABLES = """
CREATE TABLE orders (id bigint PRIMARY KEY, total bigint NOT NULL);
CREATE TABLE order_lines (id bigint PRIMARY KEY, order_id bigint NOT NULL REFERENCES orders ON DELETE CASCADE,
                          amount bigint NOT NULL);
CREATE TABLE audit (id bigserial PRIMARY KEY, note text NOT NULL);
"""
MAPPINGS = {
    "order.yaml": "entity: order\ntable: public.orders\nkey: [id]\nfields: {id: id, total: total}\n",
    "order_line.yaml": "entity: order_line\ntable: public.order_lines\nkey: [id]\nfields: {id: id, order_id: order_id, amount: amount}\n",
    "audit.yaml": "entity: audit\ntable: public.audit\nkey: [id]\nfields: {id: id, note: note}\n",
}
HERE = str(Path(__file__).parent)
KILLS = int(os.environ.get("TEST_KILLS", "20"))


class Writer(threading.Thread):
    """Commits transactions of random mixes: a new order with its lines, an amount moved between two lines,
    a line added, an order deleted with its lines, an audit row alone or with any of these."""

    def __init__(self, dsn: str, seed: int, ids: range) -> None:
        super().__init__(daemon=True)
        self.dsn, self.rng, self.ids = dsn, random.Random(seed), iter(ids)
        self.stopped = threading.Event()
        self.committed = 0
        self.orders: dict[int, list[int]] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.stopped.wait(self.rng.uniform(0.01, 0.05)):  # paced, until the kills are over
                    with conn.transaction():
                        self.one(conn)
                    self.committed += 1
        except BaseException as exc:  # reported by the test
            self.error = exc

    def one(self, conn) -> None:
        rng, kind = self.rng, self.rng.random()
        if rng.random() < 0.2:
            conn.execute("INSERT INTO audit (note) VALUES ('x')")
        if kind < 0.35 or len(self.orders) < 3:
            order, amounts = next(self.ids), [rng.randint(1, 100) for _ in range(rng.randint(1, 3))]
            conn.execute("INSERT INTO orders (id, total) VALUES (%s, %s)", (order, sum(amounts)))
            self.orders[order] = []
            for amount in amounts:
                line = next(self.ids)
                conn.execute("INSERT INTO order_lines (id, order_id, amount) VALUES (%s, %s, %s)", (line, order, amount))
                self.orders[order].append(line)
        elif kind < 0.65:
            order = rng.choice([o for o, lines in self.orders.items() if lines] or [None])
            if order is not None and len(self.orders[order]) > 1:
                a, b = rng.sample(self.orders[order], 2)
                conn.execute("UPDATE order_lines SET amount = amount - 1 WHERE id = %s", (a,))
                conn.execute("UPDATE order_lines SET amount = amount + 1 WHERE id = %s", (b,))
        elif kind < 0.85:
            order, line, amount = rng.choice(list(self.orders)), next(self.ids), rng.randint(1, 100)
            conn.execute("INSERT INTO order_lines (id, order_id, amount) VALUES (%s, %s, %s)", (line, order, amount))
            conn.execute("UPDATE orders SET total = total + %s WHERE id = %s", (amount, order))
            self.orders[order].append(line)
        elif kind < 0.95:
            order = rng.choice(list(self.orders))
            conn.execute("DELETE FROM order_lines WHERE order_id = %s", (order,))
            conn.execute("DELETE FROM orders WHERE id = %s", (order,))
            del self.orders[order]
        else:
            conn.execute("INSERT INTO audit (note) VALUES ('alone')")


class Checker(threading.Thread):
    """Reads the read model at random moments: every reading must be whole transactions."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn, self.stopped, self.readings, self.broken = dsn, threading.Event(), 0, []

    def run(self) -> None:
        rng = random.Random(7)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stopped.wait(rng.uniform(0.005, 0.05)):
                rows = conn.execute(BROKEN).fetchall()
                self.readings += 1
                if rows:
                    self.broken.append(rows[:5])


def tables_equal_read_model(env) -> bool:
    return env.execute("""
        SELECT (SELECT count(*) FROM ((SELECT id, total FROM orders EXCEPT SELECT id, total FROM rm_orders)
                                      UNION ALL (SELECT id, total FROM rm_orders EXCEPT SELECT id, total FROM orders)) d)
             + (SELECT count(*) FROM ((SELECT id, order_id, amount FROM order_lines
                                       EXCEPT SELECT id, order_id, amount FROM rm_lines)
                                      UNION ALL (SELECT id, order_id, amount FROM rm_lines
                                                 EXCEPT SELECT id, order_id, amount FROM order_lines)) d)""")[0][0] == 0


@pytest.mark.slow
@pytest.mark.parametrize("per_end, delay_ms", [(1, 5), (20, 60)], ids=["an-end-each", "shared-ends"])
def test_killed_bridge_and_consumer_never_show_part_of_a_transaction(env, per_end, delay_ms):
    env.apply_sql("20_consumer_state.sql")
    env.execute(TABLES + SCHEMA)
    for name, text in MAPPINGS.items():
        env.write_mapping(name, text)
    env.write_config(f"batch: {{max_entries: 7, max_delay_ms: {delay_ms}}}\n"
                     f"transactions: {{stream: '{TX}', max_per_end: {per_end}}}\n")
    env.cdc("init", check=True)
    extra = {"PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])),
             "CDC_FAULT_CRASH_BEFORE_COMMIT": "0.01", "PYTHONUNBUFFERED": "1"}
    consume = ("consume", "--entity", "order", "--entity", "order_line", "--group", "rm", "--start", "0",
               "--transactions", "--handler", "tx_readmodel:apply", "--count", "50", "--lease-ttl-ms", "1000")
    writers = [Writer(env.dsn, seed, range(1 + seed * 10**6, (seed + 1) * 10**6)) for seed in (1, 2)]
    checker = Checker(env.dsn)
    for thread in (*writers, checker):
        thread.start()
    rng = random.Random(99)
    procs = {"bridge": env._start("bridge", "run", env=None), "consumer": env._start("consumer", *consume, env=extra)}
    kills = {"bridge": 0, "consumer": 0}
    exits = []
    unexpected: list[str] = []
    for _ in range(KILLS):
        wait_for(lambda: env.slot_active() or procs["bridge"].poll() is not None, 30, "the bridge to attach to the slot")
        wait_for(lambda: env.redis.exists("{cdc:transactions}:lease:rm") or procs["consumer"].poll() is not None, 30,
                 "the consumer to take its lease")
        time.sleep(rng.uniform(0.1, 1.0))  # a random crash instant, not a wait for a condition
        victim = rng.choice(list(procs))
        for name, proc in procs.items():
            if proc.poll() is not None:  # a consumer crashing before commit (exit 86)
                exits.append((name, proc.returncode))
                if proc.returncode != 86:
                    unexpected.append(f"{name} exited {proc.returncode}: {proc.log_path.read_text()[-3000:]}")
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait(10)
        kills[victim] += 1
        for name, proc in procs.items():
            if proc.poll() is not None:
                if name == "bridge":
                    env.wait_slot_inactive()
                procs[name] = env._start(name, "run", env=None) if name == "bridge" else env._start(name, *consume, env=extra)
    for w in writers:
        w.stopped.set()
        w.join(30)
    assert not [w.error for w in writers if w.error]
    try:
        def caught_up() -> bool:
            if procs["consumer"].poll() == 86:  # crashed before a commit, as injected: restart it
                exits.append(("consumer", 86))
                procs["consumer"] = env._start("consumer", *consume, env=extra)
            for proc in procs.values():
                assert proc.poll() is None, proc.log_path.read_text()[-3000:]
            return tables_equal_read_model(env)

        try:
            wait_for(caught_up, 120, "the read model to equal the tables", interval=0.2)
        except TimeoutError:
            print(procs["consumer"].log_path.read_text()[-5000:])
            print({s: env.redis.xinfo_groups(s) for s in ("cdc:order", "cdc:order_line", TX)})
            raise
    finally:
        checker.stopped.set()
        checker.join(10)
    assert checker.broken == [], f"the read model showed part of a transaction: {checker.broken[:3]}"
    assert checker.readings > 100 and min(kills.values()) >= 3, (checker.readings, kills)
    assert {code for _, code in exits} <= {86, -9}, f"{exits}\n" + "\n".join(unexpected)
    assert env.redis.xlen("cdc:dlq:rm") == 0
    pending = sum(g["pending"] for s in ("cdc:order", "cdc:order_line", TX) for g in env.redis.xinfo_groups(s))
    assert pending == 0
    ends = env.redis.xinfo_stream(TX)["entries-added"]
    covered = sum(len(orjson.loads(f[b"data"]).get("transactions") or [0]) for _, f in env.redis.xrange(TX)
                  if f[b"op"] == b"e")
    print(f"kills {kills}, crashes before commit {sum(code == 86 for _, code in exits)}, readings {checker.readings}, "
          f"transactions committed {sum(w.committed for w in writers)}, END records {ends} covering {covered}")
    assert covered >= sum(w.committed for w in writers) * 0.9
    if per_end > 1:
        assert ends < covered, "transactions shared END records"
