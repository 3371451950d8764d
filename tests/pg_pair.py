"""A PostgreSQL 18 primary and its physical standby, made with pg_basebackup, for failover tests.

The standby keeps a synced copy of failover slots (sync_replication_slots, hot_standby_feedback,
primary_slot_name, dbname in primary_conninfo). With `wait_for_standby` the primary names the
standby's slot in synchronized_standby_slots, so nothing reaches a logical decoder before the
standby has it; without it, a bridge may publish what the standby lacks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

import psycopg
import redis

from cdc.demo.local import LocalPostgres, pg_bin_for
from conftest import Env

STANDBY_SLOT = "standby1"


class PrimaryStandby:
    def __init__(self, root, dbname: str, *, wait_for_standby: bool) -> None:
        bin_dir = pg_bin_for("18")
        self.dbname = dbname
        primary = {"wal_keep_size": "'256MB'"}
        if wait_for_standby:
            primary["synchronized_standby_slots"] = f"'{STANDBY_SLOT}'"
        self.primary = LocalPostgres(root / "primary", bin_dir=bin_dir, settings=primary)
        self.primary.start()
        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{dbname}"')
        standby = {
            "sync_replication_slots": "on",
            "hot_standby_feedback": "on",
            "primary_conninfo": f"'host=127.0.0.1 port={self.primary.port} user=postgres dbname={dbname}'",
        }
        if wait_for_standby:
            standby["synchronized_standby_slots"] = "''"  # names a slot of the primary; the standby has none
        self.standby = self.primary.make_standby(root / "standby", STANDBY_SLOT, settings=standby)
        self.standby.start()

    def dsn_for(self, server: LocalPostgres) -> str:
        return server.dsn_for("postgres", dbname=self.dbname)

    @property
    def dsn(self) -> str:
        """Both servers; libpq connects to the one that accepts writes."""
        return (f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} user=postgres "
                f"dbname={self.dbname} target_session_attrs=read-write connect_timeout=2")

    def _lsn(self, server: LocalPostgres, function: str) -> int:
        with psycopg.connect(self.dsn_for(server), autocommit=True) as conn:
            return int(conn.execute(f"SELECT {function}() - '0/0'::pg_lsn").fetchone()[0])

    def standby_replayed(self) -> int:
        return self._lsn(self.standby, "pg_last_wal_replay_lsn")

    def primary_wal(self) -> int:
        return self._lsn(self.primary, "pg_current_wal_lsn")

    def primary_wal_of_standby(self) -> int:
        """The WAL position of the standby once promoted."""
        return self._lsn(self.standby, "pg_current_wal_lsn")

    def standby_has_synced(self, slot: str) -> bool:
        """The standby holds a persistent, synced copy of `slot` (a promoted standby resumes from it)."""
        with psycopg.connect(self.dsn_for(self.standby), autocommit=True) as conn:
            row = conn.execute("SELECT synced, temporary FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
        return bool(row and row[0] and not row[1])

    def stop(self) -> None:
        self.standby.stop("immediate")
        self.primary.stop("immediate")


def pair_root(servers_root, tmp_path, prefix: str):
    """A folder for one test's pair, owned by the server's OS user."""
    root = servers_root / f"{prefix}-{os.getpid()}-{tmp_path.name}"
    root.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    return root


@contextlib.contextmanager
def running_pair(servers_root, tmp_path, prefix: str, *, wait_for_standby: bool) -> Iterator[PrimaryStandby]:
    """A pair for one test, stopped after it."""
    pair = PrimaryStandby(pair_root(servers_root, tmp_path, prefix), prefix, wait_for_standby=wait_for_standby)
    try:
        yield pair
    finally:
        pair.stop()


@contextlib.contextmanager
def env_on(pair: PrimaryStandby, redis_server, tmp_path) -> Iterator[Env]:
    """A test environment on the pair's primary and an emptied Redis."""
    redis.Redis.from_url(redis_server.url).flushall()
    env = Env(pair.primary, redis_server, pair.dbname, tmp_path)
    try:
        yield env
    finally:
        env.close()
