"""Every mapping feature against the table, as the core is: a seeded random workload (inserts, updates that keep
and change the key, the filtered column and the primary key, deletes, truncates, in random transactions) through
the bridge, and what a consumer rebuilds from each stream compared with the table projected by hand. One mapping
renames fields, keys on a unique column other than the primary key, filters, casts, hashes, redacts and adds a
constant; another publishes inserts only."""

from __future__ import annotations

import hashlib
import random

import pytest

from conftest import read_stream

pytestmark = pytest.mark.integration

ACCOUNTS = """\
entity: acct
table: public.acct
key: [mail]
filter: {status: active}
fields:
  mail: email
  n: id
  amt: {column: amount, cast: string}
  country_h: {column: country, hash: sha256, unkeyed: true}
  phone: {column: phone, redact: true}
  src: {const: bank}
"""
SIGNUPS = "entity: signup\ntable: public.acct\nkey: [id]\nops: [c]\nfields: {id: id, email: email}\n"


def rebuild(entries: list[dict], key: str) -> dict:
    """What a consumer keeps by key: c/u/r write, an update whose before names another key removes that one,
    d removes, t empties."""
    rows: dict = {}
    for e in entries:
        op = e["op"]
        if op in ("c", "u", "r"):
            old = e.get("before", {}).get(key)
            if op == "u" and old is not None and old != e["key"][key]:
                rows.pop(old, None)
            rows[e["key"][key]] = e["data"]
        elif op == "d":
            rows.pop(e["key"][key], None)
        elif op == "t":
            rows.clear()
    return rows


def projected(env) -> dict:
    rows = env.execute("SELECT email, id, amount::text, country, phone FROM acct WHERE status = 'active'")
    return {email: {"mail": email, "n": i, "amt": amount,
                    "country_h": None if country is None else hashlib.sha256(country.encode()).hexdigest(),
                    "phone": None if phone is None else "***", "src": "bank"}
            for email, i, amount, country, phone in rows}


class Workload:
    def __init__(self, env, seed: int) -> None:
        self.env, self.rng = env, random.Random(seed)
        self.next_id = 1
        self.serial = 0
        self.inserted: dict[int, dict] = {}  # what the inserts-only stream must hold: every row as inserted

    def _email(self) -> str:
        self.serial += 1
        return f"u{self.serial}@x"

    def transaction(self) -> None:
        rng = self.rng
        with self.env.connect() as conn, conn.transaction():
            ids = [i for (i,) in conn.execute("SELECT id FROM acct")]
            for _ in range(rng.randrange(1, 6)):
                roll = rng.random()
                if roll < 0.35 or not ids:
                    i, email = self.next_id, self._email()
                    self.next_id += 1
                    conn.execute("INSERT INTO acct VALUES (%s, %s, %s, %s, %s, %s)",
                                 (i, email, rng.choice(["active", "closed"]), f"{rng.randrange(100000) / 100:.2f}",
                                  rng.choice([None, "FR", "DE", "ÉIRE"]), rng.choice([None, "555"])))
                    self.inserted[i] = {"id": i, "email": email}
                    ids.append(i)
                    continue
                i = rng.choice(ids)
                if roll < 0.55:
                    conn.execute("UPDATE acct SET status = %s WHERE id = %s", (rng.choice(["active", "closed"]), i))
                elif roll < 0.7:
                    conn.execute("UPDATE acct SET amount = amount + 1, country = %s WHERE id = %s",
                                 (rng.choice([None, "FR", "US"]), i))
                elif roll < 0.8:
                    conn.execute("UPDATE acct SET email = %s WHERE id = %s", (self._email(), i))  # acct's key
                elif roll < 0.87:
                    new = self.next_id
                    self.next_id += 1
                    conn.execute("UPDATE acct SET id = %s WHERE id = %s", (new, i))  # the primary key
                    ids[ids.index(i)] = new
                elif roll < 0.98:
                    conn.execute("DELETE FROM acct WHERE id = %s", (i,))
                    ids.remove(i)
                else:
                    conn.execute("TRUNCATE acct")
                    ids.clear()


@pytest.mark.parametrize("seed", [3, 11])
def test_a_consumer_rebuilds_each_mapped_projection_of_the_table_exactly(env, seed):
    env.execute("CREATE TABLE acct (id int PRIMARY KEY, email text NOT NULL UNIQUE, status text, "
                "amount numeric(12,2), country text, phone text)")
    env.execute("ALTER TABLE acct REPLICA IDENTITY FULL")  # the filter's column is carried by updates and deletes
    env.write_mapping("acct.yaml", ACCOUNTS)
    env.write_mapping("signup.yaml", SIGNUPS)
    env.cdc("init", check=True)
    work = Workload(env, seed)
    for _ in range(3):  # each round ends in a restart of the bridge
        for _ in range(40):
            work.transaction()
        env.cdc("run", "--until-caught-up", check=True)
        assert rebuild(read_stream(env.redis, "cdc:acct"), "mail") == projected(env)
        signups = read_stream(env.redis, "cdc:signup")
        assert {e["op"] for e in signups} <= {"c"}
        assert rebuild(signups, "id") == work.inserted
