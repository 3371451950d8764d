"""A deterministic mixed workload that records, in commit order, what each stream must hold."""

from __future__ import annotations

import random
import threading
from decimal import Decimal

import psycopg


class MixedWorkload(threading.Thread):
    """Inserts, updates and deletes over riders and rides from one connection, so commit
    order is program order; rolled-back transactions are recorded as nothing."""

    def __init__(self, dsn: str, transactions: int, seed: int = 1, big_every: int = 0, big_size: int = 300, rate: float = 0) -> None:
        super().__init__(name="workload", daemon=True)
        self.dsn = dsn
        self.transactions = transactions
        self.rng = random.Random(seed)
        self.big_every = big_every
        self.big_size = big_size
        self.rate = rate
        self.stopped = threading.Event()
        self.expected: dict[str, list[tuple[str, dict, dict | None]]] = {"cdc:ride": [], "cdc:rider": []}
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.done.set()

    def _run(self) -> None:
        rng = self.rng
        rides: dict[int, tuple[int, Decimal]] = {}
        next_ride = 1
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO riders (id, name, email) VALUES (1, 'r1', 'e1')")
            self.expected["cdc:rider"].append(("c", {"id": 1}, {"id": 1, "name": "r1"}))
            for n in range(self.transactions):
                pending: dict[str, list] = {"cdc:ride": [], "cdc:rider": []}
                new_rides = dict(rides)
                rollback = rng.random() < 0.05
                try:
                    with conn.transaction():
                        size = self.big_size if self.big_every and n % self.big_every == self.big_every - 1 else rng.randint(1, 4)
                        for _ in range(size):
                            roll = rng.random()
                            if roll < 0.6 or not new_rides:
                                rid, dist = next_ride, Decimal(rng.randint(1, 10**6)) / 1000
                                next_ride += 1
                                conn.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (%s, 1, %s)", (rid, dist))
                                new_rides[rid] = (1, dist)
                                pending["cdc:ride"].append(("c", {"id": rid}, {"id": rid, "distance": f"{dist:.3f}", "rider": 1}))
                            elif roll < 0.85:
                                rid = rng.choice(list(new_rides))
                                dist = new_rides[rid][1] + 1
                                conn.execute("UPDATE rides SET distance_m = %s WHERE id = %s", (dist, rid))
                                new_rides[rid] = (1, dist)
                                pending["cdc:ride"].append(("u", {"id": rid}, {"id": rid, "distance": f"{dist:.3f}", "rider": 1}))
                            elif roll < 0.95:
                                rid = rng.choice(list(new_rides))
                                conn.execute("DELETE FROM rides WHERE id = %s", (rid,))
                                del new_rides[rid]
                                pending["cdc:ride"].append(("d", {"id": rid}, None))
                            else:
                                name = f"r1-{n}"
                                conn.execute("UPDATE riders SET name = %s WHERE id = 1", (name,))
                                pending["cdc:rider"].append(("u", {"id": 1}, {"id": 1, "name": name}))
                        if rollback:
                            raise _Rollback()
                except _Rollback:
                    continue
                rides = new_rides
                for stream, items in pending.items():
                    self.expected[stream].extend(items)
                if self.rate:
                    self.stopped.wait(1.0 / self.rate)  # pacing, so the workload spans the test


class _Rollback(Exception):
    pass
