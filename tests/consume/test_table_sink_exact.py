"""`cdc consume --sink` mirrors a table exactly: a seeded random workload of inserts, updates that keep
and that change the key, deletes and truncates goes through the bridge and the table sink, and the
mirror's live rows are compared with the source table projected by the mapping."""

from __future__ import annotations

import random

import orjson
import pytest

from cdc.demo.local import wait_for

# the consumer parses replies on the path the run picked (cdc.sink._entries or cdc.sink.entry): both run
pytestmark = [pytest.mark.integration, pytest.mark.both_paths]

TABLE = """
CREATE TABLE public.people (
    id    int PRIMARY KEY,
    email text NOT NULL UNIQUE,
    name  text,
    n     int
);
"""

#: (mapping, table set-up): the key, and how the server sends the old key of an update that changed it
CASES = {
    # the primary key, default replica identity (a key-only old tuple); before: false must not hide the old key
    "primary_key": ("key: [id]\nbefore: false\n", ""),
    # a unique NOT NULL column, every column in the old tuple
    "email_full": ("key: [email]\n", "ALTER TABLE public.people REPLICA IDENTITY FULL"),
    # a unique NOT NULL column as the replica identity, before: false
    "email_identity": ("key: [email]\nbefore: false\n", "ALTER TABLE public.people REPLICA IDENTITY USING INDEX people_email_key"),
}


class Workload:
    """Random changes to public.people, ids and emails reused after they were freed."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.rows: dict[int, str] = {}  # id -> email
        self.next = 1
        self.free_ids: list[int] = []
        self.free_emails: list[str] = []

    def _id(self) -> int:
        if self.free_ids and self.rng.random() < 0.3:
            return self.free_ids.pop(self.rng.randrange(len(self.free_ids)))
        self.next += 1
        return self.next

    def _email(self) -> str:
        if self.free_emails and self.rng.random() < 0.3:
            return self.free_emails.pop(self.rng.randrange(len(self.free_emails)))
        self.next += 1
        return f"u{self.next}@example.com"

    def statement(self) -> tuple[str, tuple]:
        rng = self.rng
        roll = rng.random()
        if not self.rows or roll < 0.3:
            row_id, email = self._id(), self._email()
            self.rows[row_id] = email
            return "INSERT INTO people VALUES (%s, %s, %s, %s)", (row_id, email, f"n{rng.randrange(100)}", rng.randrange(1000))
        row_id = rng.choice(sorted(self.rows))
        if roll < 0.5:  # the key kept
            return "UPDATE people SET name = %s, n = n + 1 WHERE id = %s", (f"m{rng.randrange(100)}", row_id)
        if roll < 0.62:  # the id changed
            new = self._id()
            self.rows[new] = self.rows.pop(row_id)
            self.free_ids.append(row_id)
            return "UPDATE people SET id = %s WHERE id = %s", (new, row_id)
        if roll < 0.74:  # the email changed
            new_email = self._email()
            self.free_emails.append(self.rows[row_id])
            self.rows[row_id] = new_email
            return "UPDATE people SET email = %s, n = %s WHERE id = %s", (new_email, rng.randrange(1000), row_id)
        if roll < 0.82:  # both changed
            new, new_email = self._id(), self._email()
            self.free_emails.append(self.rows.pop(row_id))
            self.free_ids.append(row_id)
            self.rows[new] = new_email
            return "UPDATE people SET id = %s, email = %s WHERE id = %s", (new, new_email, row_id)
        if roll < 0.99:
            self.free_emails.append(self.rows.pop(row_id))
            self.free_ids.append(row_id)
            return "DELETE FROM people WHERE id = %s", (row_id,)
        self.free_ids.extend(self.rows)
        self.free_emails.extend(self.rows.values())
        self.rows.clear()
        return "TRUNCATE people", ()

    def run(self, conn, transactions: int) -> None:
        for _ in range(transactions):
            with conn.transaction():
                for _ in range(self.rng.randint(1, 5)):
                    conn.execute(*self.statement())


def source(env, key: list[str]) -> dict[str, dict]:
    """The mapping's projection of public.people: sorted key JSON -> data."""
    rows = env.execute("SELECT id, email, name, n FROM people")
    out = {}
    for id_, email, name, n in rows:
        data = {"id": id_, "email": email, "name": name, "n": n}
        out[orjson.dumps({k: data[k] for k in key}, option=orjson.OPT_SORT_KEYS).decode()] = data
    return out


def mirror(env) -> dict[str, dict]:
    rows = env.execute("SELECT key, data FROM mirror WHERE NOT deleted")
    return {orjson.dumps(k, option=orjson.OPT_SORT_KEYS).decode(): d for k, d in rows}


def caught_up(env, group: str) -> bool:
    client = env.redis
    length = client.xlen("cdc:person")
    (info,) = [g for g in client.xinfo_groups("cdc:person") if g["name"] == group.encode()]
    return info["entries-read"] == length and info["pending"] == 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_mirror_holds_exactly_the_projected_table(env, case):
    mapping, setup = CASES[case]
    key = ["id"] if "[id]" in mapping else ["email"]
    env.execute(TABLE)
    if setup:
        env.execute(setup)
    env.write_mapping("person.yaml", "entity: person\ntable: public.people\n" + mapping + "fields: {id: id, email: email, name: name, n: n}\n")
    env.cdc("init", check=True)
    work = Workload(seed=sum(map(ord, case)))
    consumer = None
    with env.connect() as conn:
        for round_ in range(4):
            work.run(conn, 60)
            env.cdc("run", "--until-caught-up", check=True)
            if consumer is None:
                consumer = env._start(
                    "sink", "consume", "--entity", "person", "--group", "mirror", "--start", "0", "--sink", "public.mirror", env=None
                )
            wait_for(lambda: consumer.poll() is not None or caught_up(env, "mirror"), 60, "the sink to consume the stream")
            assert consumer.poll() is None, consumer.log_path.read_text()
            expected, got = source(env, key), mirror(env)
            assert got == expected, (
                f"round {round_}: missing {sorted(set(expected) - set(got))[:5]}, "
                f"extra {sorted(set(got) - set(expected))[:5]}, "
                f"differing {[k for k in expected if k in got and got[k] != expected[k]][:5]}"
            )
    client = env.redis
    entries = [{k.decode(): v for k, v in f.items()} for _, f in client.xrange("cdc:person")]
    moved = [e for e in entries if e["op"] == b"u" and "before" in e and orjson.loads(e["key"]) != {k: orjson.loads(e["before"])[k] for k in key}]
    assert moved, "the workload changed no key"
    if "before: false" in mapping:  # only the old key: nothing more of the old row
        assert all(set(orjson.loads(e["before"])) == set(key) for e in entries if "before" in e)
