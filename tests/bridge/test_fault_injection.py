"""Faults at random moments during a workload: no false data-loss alarm, no entry lost or
duplicated, and the bridge streams again within seconds of each fault healing.

The bridge reaches PostgreSQL and Redis through proxies that can cut or freeze
every open connection. The faults: kill -9 and SIGSTOP/SIGCONT of the bridge,
kill -9 of Redis (AOF with appendfsync always), PostgreSQL stopped in immediate
mode (a crash) and started again, and cuts and silent freezes of either side's
connections. The workload keeps writing through them, including transactions of
tables no mapping reads, whose WAL moves the slot through keepalives only.
"""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from collections import defaultdict

import psycopg
import pytest
import redis

from cdc.demo.local import LocalPostgres, LocalRedis, wait_for
from cdc.source.lsn import Lsn
from conftest import Env, per_path
from proxy import FreezableProxy
from test_crash_recovery import RIDER_MAPPING, assert_streams_exact
from workload import ResilientWorkload

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RECEIVE_TIMEOUT_S = 3
ROUNDS = per_path(3, 1)  # each kind of fault, this many times, in a seeded random order
#: how soon after a fault healed a change committed after it must be in Redis
RECOVERY_BOUND_S = {"postgres freeze": RECEIVE_TIMEOUT_S + 5, "redis freeze": RECEIVE_TIMEOUT_S + 5}
DEFAULT_BOUND_S = 8
LOSS_MARKERS = ("redis lost entries", "redis has no record")


class Rig:
    """Own servers (one of them is crashed), proxies in front of them, the bridge, and the faults."""

    def __init__(self, root, tmp) -> None:
        self.pg = LocalPostgres(root / "faults-pg").start()
        self.redis = LocalRedis(root / "faults-redis", extra=["--appendfsync", "always"]).start()
        with psycopg.connect(self.pg.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE faults")
        self.pg_proxy = FreezableProxy(self.pg.port)
        self.redis_proxy = FreezableProxy(self.redis.port)
        self.env = Env(self.pg, self.redis, "faults", tmp)
        self.bridge: subprocess.Popen | None = None
        self.logs: list = []
        self.rng = random.Random(20261123)

    def configure(self) -> None:
        env = self.env
        env.apply_sql("10_rocket_rides.sql")
        env.copy_mappings("ride.yaml")
        env.write_mapping("rider.yaml", RIDER_MAPPING)
        env.write_config(
            "batch: {max_entries: 40, max_delay_ms: 5, status_interval_s: 0.5}\n",
            dsn=f"postgresql://postgres@127.0.0.1:{self.pg_proxy.port}/faults",
            redis_url=f"redis://127.0.0.1:{self.redis_proxy.port}/0",
            postgres=f", receive_timeout_s: {RECEIVE_TIMEOUT_S}, heartbeat_interval_s: 1, slot_check_interval_s: 1",
        )
        env.cdc("init", check=True)

    def start_bridge(self) -> None:
        self.bridge = self.env.start_bridge()
        self.logs.append(self.bridge.log_path)

    def mark_lsn(self) -> int:
        """The commit LSN of the last ride entry in Redis (read directly, not through the proxy)."""
        raw = self.env.redis.get("{cdc:ride}:hwm")
        return int(raw[:20]) if raw else 0

    def wait_streaming(self, timeout: float, workload: ResilientWorkload) -> None:
        """Until a change committed now is in Redis; at once if the bridge exited or the workload ended
        (it would commit nothing new). A failure shows the end of the bridge's log."""
        target = self.env.current_wal()
        try:
            wait_for(lambda: self.bridge.poll() is not None or workload.done.is_set() or self.mark_lsn() > target,
                     timeout, "a change committed after the fault to reach redis")
        except TimeoutError as exc:
            raise AssertionError(f"{exc} (workload: {workload.committed} transactions committed); bridge log:\n"
                                 f"{self.bridge.log_path.read_text()[-3000:]}") from None
        assert workload.error is None and not workload.done.is_set(), f"the workload ended: {workload.error!r}"
        assert self.bridge.poll() is None, \
            f"the bridge exited {self.bridge.returncode}: {self.bridge.log_path.read_text()[-3000:]}"

    def assert_no_alarm(self) -> None:
        assert self.bridge.poll() is None, f"the bridge exited {self.bridge.returncode}: {self.bridge.log_path.read_text()[-3000:]}"
        for path in self.logs:
            text = path.read_text()
            assert not any(m in text for m in LOSS_MARKERS), f"false data-loss alarm in {path}"
        state = self.env.redis.hgetall("cdc:bridge:slot_faults:state")
        assert b"data_loss" not in state, state

    # -- the faults: each returns when it has healed ---------------------------------------

    def bridge_kill(self) -> None:
        self.bridge.send_signal(signal.SIGKILL)
        self.bridge.wait(10)
        self.start_bridge()

    def bridge_stop(self) -> None:
        self.bridge.send_signal(signal.SIGSTOP)
        time.sleep(self.rng.uniform(0.5, 2 * RECEIVE_TIMEOUT_S))  # a random fault length, not a wait for a condition
        self.bridge.send_signal(signal.SIGCONT)

    def redis_kill(self) -> None:
        self.redis.proc.send_signal(signal.SIGKILL)
        self.redis.proc.wait(10)
        self.redis.proc = None
        self.redis.start()  # replays its append-only file

    def postgres_crash(self) -> None:
        self.pg.stop("immediate")
        self.pg.start()

    def faults(self) -> dict:
        return {
            "bridge kill -9": self.bridge_kill,
            "bridge SIGSTOP/SIGCONT": self.bridge_stop,
            "redis kill -9": self.redis_kill,
            "postgres crash": self.postgres_crash,
            "postgres cut": self.pg_proxy.cut,
            "postgres freeze": self.pg_proxy.freeze,
            "redis cut": self.redis_proxy.cut,
            "redis freeze": self.redis_proxy.freeze,
        }

    def close(self) -> None:
        if self.bridge is not None and self.bridge.poll() is None:
            self.bridge.send_signal(signal.SIGCONT)
        self.env.close()
        self.pg_proxy.close()
        self.redis_proxy.close()
        self.pg.stop("immediate")
        self.redis.stop()


@pytest.fixture
def rig(servers_root, tmp_path):
    r = Rig(servers_root, tmp_path)
    yield r
    r.close()


def test_faults_at_random_moments_raise_no_false_alarm_and_lose_nothing(rig):
    rig.configure()
    assert rig.env.slot == "slot_faults"
    workload = ResilientWorkload(rig.env.dsn, transactions=10**6, seed=11, big_every=50, big_size=300, rate=100,
                                 noise_rows=200)
    rig.start_bridge()
    workload.start()
    rig.wait_streaming(60, workload)
    faults = rig.faults()
    plan = [name for name in faults for _ in range(ROUNDS)]
    rig.rng.shuffle(plan)
    recovery: dict[str, list[float]] = defaultdict(list)
    try:
        for name in plan:
            time.sleep(rig.rng.uniform(0.05, 1.5))  # a random fault instant, not a wait for a condition
            faults[name]()
            healed = time.monotonic()
            bound = RECOVERY_BOUND_S.get(name, DEFAULT_BOUND_S)
            rig.wait_streaming(bound + 30, workload)  # measured below against the bound, so a slow one shows its time
            recovery[name].append(time.monotonic() - healed)
            rig.assert_no_alarm()
            assert workload.error is None, workload.error
    finally:
        workload.stopped.set()
        assert workload.done.wait(120)
    assert workload.error is None, workload.error
    print("\nrecovery after each fault healed (s):")
    for name, times in sorted(recovery.items()):
        print(f"  {name:24} " + " ".join(f"{t:.2f}" for t in times) + f"  (max {max(times):.2f})")
    print(f"workload: {workload.committed} transactions committed, {workload.reconnects} reconnections")
    for name, times in recovery.items():
        assert max(times) <= RECOVERY_BOUND_S.get(name, DEFAULT_BOUND_S), (name, times)
    logs = "".join(path.read_text() for path in rig.logs)
    assert f"no message from postgres in {RECEIVE_TIMEOUT_S}s" in logs or "no answer from postgres" in logs
    assert "ended our stale walsender" in logs, "a frozen replication connection's walsender is released"
    assert f"no answer from redis in {RECEIVE_TIMEOUT_S}s" in logs

    # everything committed reaches Redis, once, in order; the bridge stops cleanly
    end = rig.env.current_wal()
    wait_for(lambda: rig.env.confirmed_flush() >= end, 60, "the slot to pass the last change")
    rig.assert_no_alarm()
    rig.bridge.send_signal(signal.SIGTERM)
    assert rig.bridge.wait(30) == 0
    assert_streams_exact(rig.env, workload)
    assert sum(len(v) for v in workload.expected.values()) > 5000


@pytest.mark.one_path
def test_cuts_while_only_unpublished_tables_change_raise_no_false_alarm(env):
    """While only a table no mapping reads changes, the slot moves through keepalives alone, and a
    session can end before it recorded how far they took it. Cuts at random instants right after
    each reconnection: the next session must not tell the slot more than Redis records."""
    env.init_rides("ride.yaml")
    env.execute("CREATE TABLE noise (id bigserial PRIMARY KEY, pad text)")
    proxy = FreezableProxy(env.postgres.port)
    stop = threading.Event()

    def noise() -> None:
        with psycopg.connect(env.dsn, autocommit=True) as conn:
            while not stop.is_set():
                conn.execute("INSERT INTO noise (pad) SELECT repeat('x', 200) FROM generate_series(1, 100)")
                stop.wait(0.01)  # pacing

    writer = threading.Thread(target=noise, daemon=True)
    try:
        env.write_config("batch: {status_interval_s: 0.5}\n", dsn=f"postgresql://postgres@127.0.0.1:{proxy.port}/{env.dbname}",
                         postgres=f", receive_timeout_s: {RECEIVE_TIMEOUT_S}, heartbeat_interval_s: 1")
        proc = env.start_bridge()
        writer.start()
        rng = random.Random(7)
        pid = None

        def attached_again(old: int | None) -> int:
            pid = wait_for(lambda: proc.poll() is not None or _new_walsender(env, old), 30, "the bridge to attach again")
            assert proc.poll() is None, f"the bridge exited {proc.returncode}: {proc.log_path.read_text()[-2000:]}"
            return pid

        for _ in range(12):
            pid = attached_again(pid)
            time.sleep(rng.uniform(0.05, 1.2))  # a random fault instant, not a wait for a condition
            proxy.cut()
        attached_again(pid)
        stop.set()
        writer.join(10)
        env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'a', 'b')")
        env.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (1, 1, 1)")
        wait_for(lambda: env.redis.xlen("cdc:ride") == 1, 30, "the ride written after the cuts")
        end = env.current_wal()
        wait_for(lambda: env.confirmed_flush() >= end, 30, "the slot to pass the ride")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        log = proc.log_path.read_text()
        assert not any(m in log for m in LOSS_MARKERS), log[-3000:]
        assert env.cdc("run", "--until-caught-up").returncode == 0, "a restart finds Redis whole"
    finally:
        stop.set()
        proxy.close()


def _new_walsender(env, old: int | None) -> int | None:
    """The pid of the walsender holding the slot, if it is not `old`."""
    pid = env.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (env.slot,))[0][0]
    return pid if pid and pid != old else None


@pytest.mark.one_path
def test_a_redis_restored_from_an_older_snapshot_is_a_real_loss_named_exactly(env, servers_root):
    """The other side of the rule: a real loss is still caught, with the range it lost."""
    snapshotted = LocalRedis(servers_root / "snapshot-redis", appendonly=False)
    snapshotted.start()
    try:
        env.write_config(redis_url=snapshotted.url)
        env.init_rides("ride.yaml", riders=1)
        client = redis.Redis.from_url(snapshotted.url)
        env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1, g FROM generate_series(1, 10) g")
        env.cdc("run", "--until-caught-up", check=True)
        client.save()  # the snapshot Redis will come back from
        held = int(client.get(f"cdc:bridge:{env.slot}:flushed"))
        env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1, g FROM generate_series(1, 5) g")
        env.cdc("run", "--until-caught-up", check=True)
        assert client.xlen("cdc:ride") == 15
        acked = env.confirmed_flush()
        assert acked > held
        client.close()
        snapshotted.proc.send_signal(signal.SIGKILL)
        snapshotted.proc.wait(10)
        snapshotted.proc = None
        snapshotted.start()  # from the snapshot: the last 5 rides and the record after them are gone
        client = redis.Redis.from_url(snapshotted.url)
        assert client.xlen("cdc:ride") == 10
        result = env.cdc("run", "--until-caught-up")
        assert result.returncode == 6, result.stderr
        held_text, acked_text = str(Lsn(held)), str(Lsn(acked))
        assert f"redis lost entries: it holds changes up to {held_text}, but slot '{env.slot}' was acknowledged " \
               f"up to {acked_text}; entries of transactions committed in ({held_text}, {acked_text}]" in result.stderr
        assert client.xlen("cdc:ride") == 10, "nothing is written past a detected loss"
        client.close()
    finally:
        snapshotted.stop()
