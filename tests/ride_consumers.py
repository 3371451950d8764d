"""The rocket-rides totals consumers as processes, and the totals they must reach."""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from decimal import Decimal

class Supervisor(threading.Thread):
    """Keeps `n` consumer processes of a group running; counts how they ended."""

    def __init__(self, env, group: str, n: int, extra_env: dict, *, named: bool = False,
                 args: tuple[str, ...] = ("--count", "50", "--lease-ttl-ms", "1500")) -> None:
        super().__init__(daemon=True)
        self.env, self.group, self.n, self.extra_env = env, group, n, extra_env
        self.named, self.args = named, args  # named: consumer i always restarts as --name <group>-<i>
        self.procs: list[subprocess.Popen] = []
        self.exits: list[int] = []
        self.exit_times: list[float] = []
        self.kills = 0
        self.stopped = threading.Event()
        self.lock = threading.Lock()

    def spawn(self, i: int) -> subprocess.Popen:
        name = ("--name", f"{self.group}-{i}") if self.named else ()
        return self.env.start_consumer(self.group, *self.args, "--max-deliveries", "1000", *name, env=self.extra_env)

    def run(self) -> None:
        with self.lock:
            self.procs = [self.spawn(i) for i in range(self.n)]
        while not self.stopped.is_set():
            with self.lock:
                for i, proc in enumerate(self.procs):
                    code = proc.poll()
                    if code is not None:
                        self.exits.append(code)
                        self.exit_times.append(time.monotonic())
                        self.procs[i] = self.spawn(i)
            self.stopped.wait(0.02)

    def kill_one(self, rng: random.Random) -> None:
        with self.lock:
            rng.choice(self.procs).send_signal(signal.SIGKILL)
            self.kills += 1

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            proc.wait(30)


def truth(env) -> dict[int, Decimal]:
    rows = env.execute("SELECT rider_id, sum(distance_m) FROM rides GROUP BY rider_id")
    totals = {rider: total for rider, total in rows}
    totals[0] = sum(totals.values(), Decimal(0))
    return totals


def state(env, consumer: str) -> dict[int, Decimal]:
    rows = env.execute("SELECT rider_id, total_distance FROM consumer_states WHERE consumer = %s AND total_distance <> 0", (consumer,))
    return {rider: total for rider, total in rows}


class RideTraffic(threading.Thread):
    """Inserts, updates (distance and rider) and deletes rides of riders 1..`riders` until stopped."""

    def __init__(self, dsn: str, riders: int = 20, seed: int = 7, pause_s: float = 0.005) -> None:
        super().__init__(name="ride-traffic", daemon=True)
        self.dsn, self.riders, self.rng, self.pause_s = dsn, riders, random.Random(seed), pause_s
        self.stopped = threading.Event()
        self.transactions = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        import psycopg

        rng = self.rng
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.stopped.is_set():
                    with conn.transaction():
                        for _ in range(rng.randint(1, 5)):
                            conn.execute("INSERT INTO rides (rider_id, distance_m) VALUES (%s, %s)",
                                         (rng.randint(1, self.riders), Decimal(rng.randint(1, 10**7)) / 1000))
                        roll = rng.random()
                        if roll < 0.3:
                            conn.execute("UPDATE rides SET distance_m = distance_m + 0.5, rider_id = %s "
                                         "WHERE id = (SELECT max(id) FROM rides)", (rng.randint(1, self.riders),))
                        elif roll < 0.45:
                            conn.execute("DELETE FROM rides WHERE id = (SELECT min(id) FROM rides)")
                    self.transactions += 1
                    self.stopped.wait(self.pause_s)
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def stop(self) -> None:
        self.stopped.set()
        self.join(30)
        if self.error is not None:
            raise self.error
