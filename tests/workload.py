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
        self.rides: dict[int, tuple[int, Decimal]] = {}
        self.next_ride = 1
        self.attempt: tuple | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.done.set()

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            self._first_rider(conn)
            for n in range(self.transactions):
                if self._attempt(conn, n):
                    self._apply()
                if self.rate:
                    self.stopped.wait(1.0 / self.rate)  # pacing, so the workload spans the test

    def _first_rider(self, conn: psycopg.Connection) -> None:
        conn.execute("INSERT INTO riders (id, name, email) VALUES (1, 'r1', 'e1')")
        self.expected["cdc:rider"].append(("c", {"id": 1}, {"id": 1, "name": "r1"}))

    def _attempt(self, conn: psycopg.Connection, n: int) -> bool:
        """Run transaction `n`; True if it committed. What it wrote waits in `self.attempt` until `_apply()`."""
        rng = self.rng
        pending: dict[str, list] = {"cdc:ride": [], "cdc:rider": []}
        new_rides = dict(self.rides)
        next_ride = self.next_ride
        rollback = rng.random() < 0.05
        self.attempt = None
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
                self._extra(conn, n)
                if rollback:
                    raise _Rollback()
                self.attempt = (pending, new_rides, next_ride)
        except _Rollback:
            return False
        return True

    def _extra(self, conn: psycopg.Connection, n: int) -> None:
        """More statements in transaction `n` (none here)."""

    def _apply(self) -> None:
        """Transaction `self.attempt` committed: record what the streams must hold."""
        pending, self.rides, self.next_ride = self.attempt
        self.attempt = None
        for stream, items in pending.items():
            self.expected[stream].extend(items)


class _Rollback(Exception):
    pass


class ResilientWorkload(MixedWorkload):
    """The mixed workload through server crashes and broken connections.

    Each transaction also writes its number to a ledger table. When the connection
    breaks, the workload reconnects and looks the number up: a transaction that
    committed is recorded, one that did not is run again. Every third transaction is
    followed by `noise_rows` rows into a table no mapping reads, as other
    applications' traffic would (its WAL moves the slot through keepalives only).
    """

    CONNECT_TIMEOUT_S = 90

    def __init__(self, dsn: str, transactions: int, *, noise_rows: int = 0, **kwargs) -> None:
        super().__init__(dsn, transactions, **kwargs)
        self.noise_rows = noise_rows
        self.reconnects = 0
        self.committed = 0

    def _connect(self) -> psycopg.Connection:
        from cdc.demo.local import wait_for

        return wait_for(lambda: psycopg.connect(self.dsn, autocommit=True, connect_timeout=2),
                        self.CONNECT_TIMEOUT_S, "postgres to accept the workload again", interval=0.1)

    def _run(self) -> None:
        conn = self._connect()
        conn.execute("CREATE TABLE IF NOT EXISTS workload_ledger (n int PRIMARY KEY)")
        conn.execute("CREATE TABLE IF NOT EXISTS workload_noise (id bigserial PRIMARY KEY, pad text)")
        self._first_rider(conn)
        try:
            for n in range(self.transactions):
                if self.stopped.is_set():
                    break
                conn = self._commit(conn, n)
                if self.noise_rows and n % 3 == 0:
                    try:
                        conn.execute("INSERT INTO workload_noise (pad) SELECT repeat('x', 200) FROM generate_series(1, %s)",
                                     (self.noise_rows,))
                    except (psycopg.OperationalError, psycopg.InterfaceError):
                        conn = self._reconnect(conn)
                if self.rate:
                    self.stopped.wait(1.0 / self.rate)
        finally:
            conn.close()

    def _commit(self, conn: psycopg.Connection, n: int) -> psycopg.Connection:
        """Run transaction `n` until it is known to have committed or rolled back."""
        while True:
            try:
                # an attempt left by a broken connection: did its commit reach the server?
                if self.attempt is not None and conn.execute("SELECT 1 FROM workload_ledger WHERE n = %s", (n,)).fetchone():
                    self._apply()
                    return conn
                if self._attempt(conn, n):
                    self._apply()
                return conn
            except (psycopg.OperationalError, psycopg.InterfaceError):
                conn = self._reconnect(conn)

    def _reconnect(self, conn: psycopg.Connection) -> psycopg.Connection:
        conn.close()
        self.reconnects += 1
        return self._connect()

    def _extra(self, conn: psycopg.Connection, n: int) -> None:
        conn.execute("INSERT INTO workload_ledger (n) VALUES (%s)", (n,))

    def _apply(self) -> None:
        super()._apply()
        self.committed += 1
