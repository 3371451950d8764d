"""The sample "rocket rides" workload: riders, rides with a distance, and rockets
with wide and varied column types. Used by the demo, the tests and the benchmarks."""

from __future__ import annotations

import random
import threading
import uuid
from decimal import Decimal

import psycopg

__all__ = ["RideWriter", "insert_rocket"]

CLASSES = ("suborbital", "orbital", "lunar")


def insert_rocket(conn: psycopg.Connection, rng: random.Random) -> str:
    rocket_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    conn.execute(
        """
        INSERT INTO rockets (id, name, class, dry_mass, thrust_kn, stages, launched_on, launch_window,
                             burn_time, countdown_at, built_at, reusable, specs, tags, payload_kg,
                             checksum, manual, owner_email)
        VALUES (%s, %s, %s, %s, %s, %s, current_date, tstzrange(now(), now() + interval '2 hours'),
                %s::interval, '12:30:00', now()::timestamp, %s, %s::jsonb, %s, %s, %s, %s, %s)
        """,
        (
            rocket_id, f"Falcon {rng.randint(1, 99)}", rng.choice(CLASSES), Decimal(rng.randint(1000, 90000)),
            rng.choice([float("nan"), float("inf"), 7607.0, 845.5]), rng.randint(1, 3),
            f"{rng.randint(1, 600)} seconds", rng.random() < 0.5,
            '{"engines": 9, "fuel": "RP-1/LOX", "isp": 282.123456789012345678}',
            ["crewed", 'quote"d', None, "comma,tag"], [Decimal("1.5"), None, Decimal("22800")],
            bytes(range(16)), "manual " * rng.randint(10, 3000), "owner@example.com",
        ),
    )
    return rocket_id


class RideWriter(threading.Thread):
    """Inserts riders and rides, updates and deletes some, at `rate` transactions per second."""

    def __init__(self, dsn: str, rate: float = 5.0, seed: int | None = None) -> None:
        super().__init__(name="ride-writer", daemon=True)
        self.dsn = dsn
        self.rate = rate
        self.rng = random.Random(seed)
        self.stopped = threading.Event()
        self.transactions = 0

    def stop(self) -> None:
        self.stopped.set()

    def run(self) -> None:
        rng = self.rng
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stopped.is_set():
                with conn.transaction():
                    rider = conn.execute(
                        "INSERT INTO riders (name, email, phone) VALUES (%s, %s, %s) RETURNING id",
                        (f"rider-{rng.randint(1, 10**6)}", f"r{rng.randint(1, 10**6)}@example.com", "555-0100"),
                    ).fetchone()[0]
                    for _ in range(rng.randint(1, 3)):
                        conn.execute(
                            "INSERT INTO rides (rider_id, distance_m, internal_note) VALUES (%s, %s, 'not public')",
                            (rider, Decimal(rng.randint(100, 500000)) / 1000),
                        )
                    roll = rng.random()
                    if roll < 0.3:
                        conn.execute("UPDATE rides SET distance_m = distance_m + 1 WHERE id = (SELECT max(id) FROM rides)")
                    elif roll < 0.4:
                        conn.execute("DELETE FROM rides WHERE id = (SELECT min(id) FROM rides)")
                    elif roll < 0.5:
                        insert_rocket(conn, rng)
                    else:
                        conn.execute(
                            "SELECT pg_logical_emit_message(true, 'ride_events', %s)",
                            (f'{{"rider": {rider}, "event": "booked"}}',),
                        )
                self.transactions += 1
                self.stopped.wait(1.0 / self.rate)


def ride_totals(conn: psycopg.Connection, entries: list, consumer: str) -> None:
    """The example consumer: total distance per rider and overall (rider 0) in consumer_states.

    An apply function for `cdc.consume.checkpoint.TransactionalHandler` (run it with
    ``cdc consume --handler cdc.demo.rocketrides:ride_totals``). Updates and deletes
    need the before-image, so rides has REPLICA IDENTITY FULL.
    """
    deltas: dict[int, Decimal] = {}
    get = deltas.get
    zero = Decimal(0)
    for e in entries:
        op = e.op
        if op == "c" or op == "r":
            data = e.data
            rider = int(data["rider"])
            deltas[rider] = get(rider, zero) + Decimal(data["distance"])
        elif op == "u" or op == "d":
            before = e.before
            if before is None or "distance" not in before:
                raise ValueError(f"{e.stream} {e.id}: a {op} without a before-image; rides needs REPLICA IDENTITY FULL")
            rider = int(before["rider"])
            deltas[rider] = get(rider, zero) - Decimal(before["distance"])
            if op == "u":
                data = e.data
                rider = int(data["rider"])
                deltas[rider] = get(rider, zero) + Decimal(data["distance"])
        elif op == "t" or op == "x":  # x: the stream was rebuilt (cdc recover); its rows follow as r
            deltas.clear()
            conn.execute("DELETE FROM consumer_states WHERE consumer = %s", (consumer,))
    if deltas:
        # the overall total (rider 0) moves by what every rider's did, rider 0's own rides included
        deltas[0] = get(0, zero) + sum(deltas.values(), zero)
        riders = sorted(deltas)
        # one statement for the whole batch, the riders in one order (their rows are locked in it)
        conn.execute(
            "INSERT INTO consumer_states (consumer, rider_id, total_distance) "
            "SELECT %s, r, d FROM unnest(%s::bigint[], %s::numeric[]) AS u (r, d) "
            "ON CONFLICT (consumer, rider_id) DO UPDATE "
            "SET total_distance = consumer_states.total_distance + EXCLUDED.total_distance",
            (consumer, riders, [deltas[r] for r in riders]),
        )
