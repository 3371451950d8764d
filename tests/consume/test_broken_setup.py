"""A consumer refuses a broken setup instead of dead-lettering the stream.

A handler that cannot work, a missing grant, a refused Redis command: each stops `cdc consume`
at start (or at once while running) with its exit code and the fix, and nothing happens on the
servers: no dead letter, no acknowledgement, the entry still pending, its failure count unchanged.
A server away is retried, never counted. Only the handler's own failure on an entry counts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import orjson
import psycopg
import pytest
import redis

from cdc.consume.checkpoint import TransactionalHandler
from cdc.consume.consumer import Consumer
from cdc.consume.failures import ENTRY, RETRY, SETUP, whose
from cdc.consume.table_sink import TableSink
from cdc.demo.local import wait_for
from cdc.errors import ConfigError, PrivilegeError, SourceError, TransientError

from conftest import ROOT, SQL

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
STREAM, GROUP, FAILURES, DLQ = "cdc:ride", "g", "{cdc:ride}:failures:g", "cdc:dlq:g"
PASSWORD = "Cs-s3cret-8812"


def ride(client: redis.Redis, n: int, rider: int = 1, distance: str = "1.5") -> str:
    """Append ride `n` (op c) to cdc:ride as the bridge would; its entry ID."""
    return client.xadd(STREAM, {
        "op": "c", "key": orjson.dumps({"id": n}), "data": orjson.dumps({"id": n, "rider": rider, "distance": distance}),
        "lsn": str(1000 + n), "seq": "0",
    }).decode()


def pending(client: redis.Redis) -> list[tuple[str, str, int]]:
    """(entry ID, consumer, times delivered) of every entry the group has pending."""
    return [(p["message_id"].decode(), p["consumer"].decode(), p["times_delivered"])
            for p in client.xpending_range(STREAM, GROUP, "-", "+", 100)]


def last_delivered(client: redis.Redis) -> str:
    return next(g["last-delivered-id"].decode() for g in client.xinfo_groups(STREAM) if g["name"].decode() == GROUP)


def one_pending(env) -> tuple[list, str]:
    """Two rides in the stream; the first delivered to consumer c1 and pending, the second not delivered yet."""
    client = env.redis
    ride(client, 1)
    ride(client, 2)
    client.xgroup_create(STREAM, GROUP, id="0")
    client.xreadgroup(GROUP, "c1", {STREAM: ">"}, count=1)
    return pending(client), last_delivered(client)


def assert_untouched(env, before: tuple[list, str]) -> None:
    client = env.redis
    assert pending(client) == before[0], "the pending entry was not delivered again, nor acknowledged"
    assert last_delivered(client) == before[1], "nothing new was read"
    assert not client.exists(DLQ), "no dead letter"
    assert not client.exists(FAILURES), "no failure counted"


def consume(env, *args: str, cwd: Path | None = None, extra_env: dict | None = None, timeout: float = 60,
            program: tuple[str, ...] = (sys.executable, "-m", "cdc")) -> subprocess.CompletedProcess:
    if not env.config_path.exists():
        env.write_config()
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]), **(extra_env or {})}
    return subprocess.run([*program, "--log-format", "text", "consume", "--config", str(env.config_path),
                           "--entity", "ride", "--group", GROUP, "--name", "c1", *args],
                          capture_output=True, text=True, timeout=timeout, env=environ, cwd=cwd or env.tmp)


def error_line(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert lines and lines[-1].startswith("cdc: error: "), result.stderr
    return lines[-1]


@pytest.fixture
def stream_env(env):
    """The ride mapping and a config; nothing in PostgreSQL needed until a consumer gets that far."""
    env.copy_mappings("ride.yaml")
    env.write_config()
    return env


# -- the handler, checked before the first entry -----------------------------------------------------------

HANDLER_CASES = {
    "not callable": ("broken_handlers:not_callable",
                     "cdc: error: handler broken_handlers:not_callable (module broken_handlers, {here}/broken_handlers.py) "
                     "is not callable (type int); name a function taking (conn, entries, consumer)"),
    "wrong signature": ("broken_handlers:two_arguments",
                        "cdc: error: handler broken_handlers:two_arguments (module broken_handlers, {here}/broken_handlers.py) "
                        "has the signature (conn, entries), cannot be called with (conn, entries, consumer): too many "
                        "positional arguments; the function must take (conn, entries, consumer)"),
    "keyword-only": ("broken_handlers:keyword_only",
                     "cdc: error: handler broken_handlers:keyword_only (module broken_handlers, {here}/broken_handlers.py) "
                     "has the signature (*, conn, entries, consumer), cannot be called with (conn, entries, consumer): "
                     "too many positional arguments; the function must take (conn, entries, consumer)"),
    "os:system": ("os:system",
                  "cdc: error: handler os:system (module os, {os_file}) has the signature (command), cannot be called "
                  "with (conn, entries, consumer): too many positional arguments; the function must take (conn, entries, consumer)"),
    "raises at import": ("handler_raising_at_import:apply",
                         "cdc: error: handler handler_raising_at_import:apply: importing module handler_raising_at_import "
                         "failed: RuntimeError: RIDES_STATE_SCHEMA is not set (the handler reads it at import); "
                         "fix the module (CDC_TRACEBACK=1 shows where)"),
    "missing attribute": ("broken_handlers:apply",
                          "cdc: error: handler broken_handlers:apply: module broken_handlers ({here}/broken_handlers.py) "
                          "has no attribute apply; name a function defined in broken_handlers, as module:function"),
    "missing module": ("rides_handlers:apply",
                       "cdc: error: handler rides_handlers:apply: no module named rides_handlers, searched the current "
                       "directory ({cwd}), PYTHONPATH ({pythonpath}) and the installed packages ({site}); run from the "
                       "folder holding rides_handlers.py, add that folder to PYTHONPATH, or install its package"),
}


@pytest.mark.parametrize("case", list(HANDLER_CASES))
def test_a_handler_that_cannot_work_is_refused_at_start_and_nothing_happens(stream_env, case):
    import site

    env = stream_env
    before = one_pending(env)
    spec, expected = HANDLER_CASES[case]
    result = consume(env, "--handler", spec, "--max-deliveries", "1")
    assert result.returncode == 2, result.stderr
    packages = ", ".join(p for p in site.getsitepackages() if os.path.isdir(p))
    assert error_line(result) == expected.format(
        here=HERE, os_file=os.__file__, cwd=env.tmp, pythonpath=os.pathsep.join([str(HERE), str(ROOT)]), site=packages)
    assert_untouched(env, before)


def test_a_module_raising_at_import_shows_its_traceback_only_when_asked(stream_env):
    result = consume(stream_env, "--handler", "handler_raising_at_import:apply", extra_env={"CDC_TRACEBACK": "1"})
    assert result.returncode == 2
    assert "Traceback" in result.stderr and 'handler_raising_at_import.py", line 3' in result.stderr


def test_a_handler_in_the_current_directory_is_found_by_the_installed_script(stream_env, tmp_path):
    """`cdc` as installed (not python -m): the current directory is searched too."""
    script = Path(sys.executable).parent / "cdc"
    if not script.exists():
        pytest.skip("no installed cdc script next to this interpreter")
    (tmp_path / "here_handlers.py").write_text("def apply(conn, entries):\n    pass\n")
    result = consume(stream_env, "--handler", "here_handlers:apply", cwd=tmp_path, program=(str(script),),
                     extra_env={"PYTHONPATH": ""})
    assert result.returncode == 2
    assert "handler here_handlers:apply (module here_handlers, " + str(tmp_path / "here_handlers.py") in error_line(result)


def test_the_library_checks_its_handlers_before_reading(env):
    client = env.redis
    ride(client, 1)
    consumer = Consumer(client, [STREAM], GROUP, "c1", block_ms=10)
    consumer.create_group("0")
    with pytest.raises(ConfigError, match=r"the handler of consumer c1 has the signature \(\), cannot be called with \(entries\)"):
        consumer.run(lambda: None)
    with pytest.raises(ConfigError, match=r"is not callable \(type str\)"):
        consumer.run("ride_totals")
    with pytest.raises(ConfigError, match=r"the apply function of consumer g has the signature \(conn, entries\)"):
        TransactionalHandler(env.dsn, GROUP, lambda conn, entries: None)
    assert client.xinfo_groups(STREAM)[0]["pending"] == 0 and client.xinfo_groups(STREAM)[0]["lag"] == 1


# -- whose fault: the rule, and a handler's own SQL judged by it --------------------------------------------

def test_errors_are_judged_by_sqlstate_class_and_kind():
    e = psycopg.errors
    assert [whose(x) for x in (e.UniqueViolation(), e.CheckViolation(), e.InvalidTextRepresentation(),
                               e.DivisionByZero(), e.RaiseException(), e.QueryCanceled(), e.LockNotAvailable(),
                               e.ProgramLimitExceeded(), ValueError("bad ride"), KeyError("distance"))] == [ENTRY] * 10
    assert [whose(x) for x in (e.AdminShutdown(), e.CannotConnectNow(), e.SerializationFailure(), e.DeadlockDetected(),
                               e.DiskFull(), e.TooManyConnections(), e.ReadOnlySqlTransaction(),
                               psycopg.OperationalError("server closed the connection unexpectedly"),
                               psycopg.InterfaceError("the connection is closed"), redis.ConnectionError("refused"),
                               redis.TimeoutError(), redis.ResponseError("OOM command not allowed"),
                               TransientError("postgres unavailable"))] == [RETRY] * 13
    assert [whose(x) for x in (e.InsufficientPrivilege(), e.UndefinedTable(), e.UndefinedColumn(), e.SyntaxError(),
                               e.InvalidPassword(), e.InvalidCatalogName(), e.DatabaseDropped(), e.InternalError_(),
                               psycopg.OperationalError('password authentication failed for user "x"'),
                               redis.AuthenticationError(), redis.exceptions.NoPermissionError("no permissions"),
                               redis.ResponseError("WRONGTYPE"), PrivilegeError("x"))] == [SETUP] * 13


def test_a_handlers_own_sql_counts_when_the_entry_breaks_a_constraint_and_stops_when_a_table_is_missing(env):
    env.apply_sql("20_consumer_state.sql")
    env.execute("CREATE TABLE ride_ids (id bigint PRIMARY KEY CHECK (id < 100))")
    client = env.redis
    ride(client, 1)
    ride(client, 500)  # breaks the check constraint: the entry's fault

    def insert_ids(conn, entries, consumer):
        conn.cursor().executemany("INSERT INTO ride_ids (id) VALUES (%s)", [(e.key["id"],) for e in entries])

    def missing_table(conn, entries, consumer):
        conn.execute("INSERT INTO ride_idz (id) VALUES (1)")

    consumer = Consumer(client, [STREAM], GROUP, "c1", block_ms=10, max_deliveries=1)
    consumer.create_group("0")
    handler = TransactionalHandler(env.dsn, GROUP, insert_ids, epoch_of=consumer.epoch)
    handler.check_setup()
    consumer.process(consumer.read(), handler)
    assert env.execute("SELECT id FROM ride_ids") == [(1,)]
    [letter] = [f for _, f in client.xrange(DLQ)]
    assert letter[b"error"].startswith(b"CheckViolation: new row for relation \"ride_ids\" violates check constraint")

    n = ride(client, 2)
    broken = TransactionalHandler(env.dsn, GROUP, missing_table, epoch_of=consumer.epoch)
    with pytest.raises(SourceError) as raised:
        consumer.process(consumer.read(), broken)
    assert str(raised.value) == ('postgres: relation "ride_idz" does not exist in the consumer\'s state database '
                                 "(--state-dsn, else postgres.dsn); create it, or fix the handler's SQL")
    assert [p[0] for p in pending(client)] == [n] and not client.exists(FAILURES) and client.xlen(DLQ) == 1
    handler.close()
    broken.close()


def test_a_table_sink_checks_its_table_and_may_not_need_create_when_it_exists(env):
    sink = TableSink(env.dsn, "public.mirror")
    sink.check_setup()  # as the owner: created
    assert env.execute("SELECT to_regclass('public.mirror') IS NOT NULL") == [(True,)]
    sink.close()


# -- grants, as the README's cdc_bridge -------------------------------------------------------------------

@pytest.fixture
def bridge_role(stream_env, tmp_path):
    """sql/ applied as the owner; the environment that makes cdc_bridge the consumers' role."""
    env = stream_env
    for path in sorted(SQL.glob("*.sql")):
        env.execute(path.read_text())
    env.execute(f"ALTER ROLE cdc_bridge PASSWORD '{PASSWORD}'")
    secret = tmp_path / "bridge_dsn"
    secret.write_text(f"postgresql://cdc_bridge:{PASSWORD}@127.0.0.1:{env.postgres.port}/{env.dbname}\n")
    return {"CDC_POSTGRES_DSN_FILE": str(secret)}


def test_a_missing_grant_on_the_checkpoints_stops_at_start_with_the_grant(stream_env, bridge_role):
    env = stream_env
    before = one_pending(env)
    result = consume(env, "--handler", "cdc.demo.rocketrides:ride_totals", "--max-deliveries", "1", extra_env=bridge_role)
    assert result.returncode == 4, result.stderr
    assert error_line(result) == (
        "cdc: error: role cdc_bridge lacks privileges the consumer needs in the consumer's state database (--state-dsn, "
        "else postgres.dsn); run: GRANT SELECT, INSERT, UPDATE ON TABLE public.cdc_checkpoints TO cdc_bridge; "
        "GRANT INSERT ON TABLE public.cdc_replays TO cdc_bridge")
    assert_untouched(env, before)
    assert PASSWORD not in result.stderr

    env.execute("GRANT SELECT, INSERT, UPDATE ON public.cdc_checkpoints TO cdc_bridge")
    result = consume(env, "--sink", "public.ride_mirror", extra_env=bridge_role)
    assert result.returncode == 4, result.stderr
    assert error_line(result) == (
        "cdc: error: table public.ride_mirror does not exist and role cdc_bridge may not create it in the consumer's "
        "state database (--state-dsn, else postgres.dsn); run: GRANT CREATE ON SCHEMA public TO cdc_bridge, or create "
        "the table as the owner (cdc.consume.table_sink has its definition)")
    assert_untouched(env, before)


def test_a_grant_revoked_while_running_stops_the_consumer_with_the_entry_pending(stream_env, bridge_role):
    env = stream_env
    env.execute("GRANT SELECT, INSERT, UPDATE ON public.cdc_checkpoints, public.consumer_states TO cdc_bridge; "
                "GRANT INSERT ON public.cdc_replays TO cdc_bridge")
    client = env.redis
    ride(client, 1, distance="2")
    proc = env._start("consumer", "consume", "--entity", "ride", "--group", GROUP, "--name", "c1", "--start", "0",
                      "--handler", "cdc.demo.rocketrides:ride_totals", "--max-deliveries", "1", env=bridge_role)
    totals = "SELECT total_distance FROM consumer_states WHERE consumer = 'g' AND rider_id = 0"
    wait_for(lambda: env.execute(totals) == [(Decimal("2"),)], 60, "the first ride applied")
    wait_for(lambda: not pending(client), 30, "the first ride acknowledged")
    env.execute("REVOKE UPDATE ON public.cdc_checkpoints FROM cdc_bridge")
    second = ride(client, 2, distance="3")
    assert proc.wait(60) == 4, proc.log_path.read_text()
    log = proc.log_path.read_text()
    assert log.splitlines()[-1] == (
        "cdc: error: postgres refused: permission denied for table cdc_checkpoints in the consumer's state database "
        "(--state-dsn, else postgres.dsn); run: GRANT SELECT, INSERT, UPDATE ON TABLE cdc_checkpoints TO cdc_bridge")
    assert [(i, c) for i, c, _ in pending(client)] == [(second, "c1")], "the entry stays pending"
    assert not client.exists(DLQ) and not client.exists(FAILURES)
    assert env.execute(totals) == [(Decimal("2"),)]

    env.execute("GRANT UPDATE ON public.cdc_checkpoints TO cdc_bridge")  # the fix: the entry is applied, once
    again = env._start("consumer", "consume", "--entity", "ride", "--group", GROUP, "--name", "c1",
                       "--handler", "cdc.demo.rocketrides:ride_totals", "--max-deliveries", "1", env=bridge_role)
    wait_for(lambda: env.execute(totals) == [(Decimal("5"),)] and not pending(client), 60, "the second ride applied")
    again.send_signal(signal.SIGTERM)
    assert again.wait(30) == 0


# -- servers away, and Redis refusing --------------------------------------------------------------------------

@pytest.mark.slow
def test_postgres_restarted_while_a_consumer_runs_is_retried_and_the_totals_are_exact(stream_env):
    env = stream_env
    env.apply_sql("20_consumer_state.sql")
    client = env.redis
    for n in range(1, 11):
        ride(client, n, rider=1 + n % 3, distance=f"{n}.25")
    proc = env._start("consumer", "consume", "--entity", "ride", "--group", GROUP, "--start", "0",
                      "--handler", "cdc.demo.rocketrides:ride_totals", "--max-deliveries", "1", env={})
    try:
        total = "SELECT total_distance FROM consumer_states WHERE consumer = 'g' AND rider_id = 0"
        wait_for(lambda: env.execute(total) == [(Decimal("57.50"),)], 60, "the first ten rides")
        env.postgres.stop("fast")
        try:
            for n in range(11, 21):
                ride(client, n, rider=1 + n % 3, distance=f"{n}.25")
            wait_for(lambda: proc.log_path.read_text().count("transient failure, retrying") >= 2, 60,
                     "the consumer to retry while postgres is down")
            assert pending(client), "the rides read while postgres is down stay pending"
            assert not client.exists(DLQ) and not client.exists(FAILURES), "a server away is no failure of an entry"
        finally:
            env.postgres.start()
        wait_for(lambda: env.execute(total) == [(Decimal("215.00"),)] and not pending(client), 90,
                 "every ride applied once postgres is back")
        per_rider = dict(env.execute("SELECT rider_id, total_distance FROM consumer_states WHERE consumer = 'g'"))
        expected = {r: sum(Decimal(f"{n}.25") for n in range(1, 21) if 1 + n % 3 == r) for r in (1, 2, 3)}
        assert per_rider == {0: Decimal("215.00"), **expected}
        assert not client.exists(DLQ) and not client.exists(FAILURES)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.log_path.read_text()


def _acl_user(client: redis.Redis, name: str, *extra: str) -> None:
    """The deployed consumer ACL (deploy/redis/redis.conf), changed by `extra`."""
    line = next(text for text in (ROOT / "deploy/redis/redis.conf").read_text().splitlines() if text.startswith("user cdc-bridge"))
    rules = [r for r in line.split()[3:] if not r.startswith(">")]
    client.execute_command("ACL", "SETUSER", name, "reset", "on", f">{PASSWORD}", *rules, *extra)


@pytest.fixture
def acl_env(stream_env):
    env = stream_env
    env.apply_sql("20_consumer_state.sql")
    name = f"consumer-{env.dbname}"
    url = env.redis_server.url.replace("redis://", f"redis://{name}:{PASSWORD}@")
    env.write_config(redis_url=url)
    env.acl_user = name
    yield env
    env.redis.execute_command("ACL", "DELUSER", name)


def test_redis_refusing_a_command_by_acl_stops_at_start_with_the_command(acl_env):
    env = acl_env
    _acl_user(env.redis, env.acl_user, "-hincrby")
    before = one_pending(env)
    result = consume(env, "--handler", "cdc.demo.rocketrides:ride_totals")
    assert result.returncode == 5, result.stderr
    line = error_line(result)
    assert line.startswith(f"cdc: error: redis at 127.0.0.1:{env.redis_server.port}: redis user '{env.acl_user}' "
                           "may not run HINCRBY (cdc consume sends it): ")
    assert line.endswith("; add +hincrby and the keys ~cdc:* ~{cdc:* to the user's ACL (see deploy/redis/redis.conf)")
    assert PASSWORD not in result.stderr
    assert_untouched(env, before)


def test_redis_refusing_a_command_while_running_stops_with_the_entry_pending(acl_env):
    env = acl_env
    client = env.redis
    _acl_user(client, env.acl_user)
    ride(client, 1, distance="2")
    proc = env._start("consumer", "consume", "--entity", "ride", "--group", GROUP, "--name", "c1", "--start", "0",
                      "--handler", "cdc.demo.rocketrides:ride_totals", "--max-deliveries", "1", env={})
    total = "SELECT total_distance FROM consumer_states WHERE consumer = 'g' AND rider_id = 0"
    wait_for(lambda: env.execute(total) == [(Decimal("2"),)] and not pending(client), 60, "the first ride")
    client.execute_command("ACL", "SETUSER", env.acl_user, "-xack")
    second = ride(client, 2, distance="3")
    assert proc.wait(60) == 5, proc.log_path.read_text()
    assert proc.log_path.read_text().splitlines()[-1] == (
        f"cdc: error: redis refused a consumer's command: Command # 1 (XACK cdc:ride g {second}) of pipeline caused "
        "error: this user has no permissions to run the 'xack' command; "
        "add +xack to the redis user's ACL (deploy/redis/redis.conf lists what consumers send)")
    assert [(i, c) for i, c, _ in pending(client)] == [(second, "c1")], "not acknowledged: still pending"
    assert not client.exists(DLQ) and not client.exists(FAILURES)
    assert env.execute(total) == [(Decimal("5"),)], "applied, with its checkpoint, in one transaction"

    client.execute_command("ACL", "SETUSER", env.acl_user, "+xack")  # the fix: skipped by its checkpoint, acknowledged
    again = env._start("consumer", "consume", "--entity", "ride", "--group", GROUP, "--name", "c1",
                       "--handler", "cdc.demo.rocketrides:ride_totals", "--max-deliveries", "1", env={})
    wait_for(lambda: not pending(client), 60, "the second ride acknowledged")
    again.send_signal(signal.SIGTERM)
    assert again.wait(30) == 0
    assert env.execute(total) == [(Decimal("5"),)], "applied once"
