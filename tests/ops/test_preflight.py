"""`cdc check` is the complete preflight: each thing `cdc run` or a consumer would reject is
reported first, with what, where and the fix, and the exit code of its kind; all at once."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest

from cdc import keys
from cdc.demo.local import free_port, wait_for
from workload import MixedWorkload

pytestmark = pytest.mark.integration


@pytest.fixture
def rides(env):
    env.init_rides("ride.yaml", sql=("00_roles.sql", "10_rocket_rides.sql", "25_backfills.sql"))
    return env


def role(env, name: str, *, replication: bool = True, select: bool = True) -> str:
    """A login role of this test (trusted on loopback) with the grants of sql/30_grants.sql, or fewer."""
    name = f"{name}_{env.dbname}"
    env.execute(f'CREATE ROLE "{name}" LOGIN {"REPLICATION" if replication else ""}')
    env.execute(f'GRANT USAGE ON SCHEMA public TO "{name}"')
    env.execute(f'GRANT SELECT, INSERT, UPDATE ON public.cdc_backfills TO "{name}"')
    env.execute(f'GRANT USAGE ON SEQUENCE public.cdc_backfills_id_seq TO "{name}"')
    if select:
        env.execute(f'GRANT SELECT ON public.rides TO "{name}"')
    return name


@pytest.fixture
def roles(env):
    made: list[str] = []

    def make(name: str, **kwargs) -> str:
        made.append(role(env, name, **kwargs))
        return made[-1]

    yield make
    for name in made:
        env.execute(f'DROP OWNED BY "{name}"')
        env.execute(f'DROP ROLE "{name}"')


def check_as(env, user: str | None = None, redis_url: str | None = None, extra: str = ""):
    dsn = env.postgres.dsn_for(user, dbname=env.dbname) if user else None
    env.write_config(extra, dsn=dsn, redis_url=redis_url)
    return env.cdc("check")


def problems(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("problem: ")]


@contextlib.contextmanager
def redis_config(env, name: str, value: str):
    old = env.redis.config_get(name)[name]
    env.redis.config_set(name, value)
    try:
        yield
    finally:
        env.redis.config_set(name, old)


@contextlib.contextmanager
def acl_user(env, name: str, *rules: str):
    env.redis.acl_setuser(name, enabled=True, passwords=["+pw-" + name], keys=["cdc:*", "{cdc:*"],
                          commands=list(rules), reset=True)
    try:
        yield f"redis://{name}:pw-{name}@127.0.0.1:{env.redis_server.port}/0"
    finally:
        env.redis.acl_deluser(name)


def test_a_valid_setup_passes_with_every_check_named(rides, roles):
    result = check_as(rides, roles("ok"))
    assert result.returncode == 0, result.stderr
    for expected in ("wal_level is logical", "may replicate", "entity ride: public.rides", "slot", "may use cdc_backfills",
                     "answers", "may run the", "holds the source up to slot"):
        assert expected in result.stdout, expected
    assert "warning:" not in result.stderr  # the test Redis has AOF and noeviction


def test_a_role_without_replication(rides, roles):
    user = roles("norep", replication=False)
    result = check_as(rides, user)
    assert result.returncode == 4
    assert problems(result) == [f"problem: postgres role {user} lacks the REPLICATION attribute: cdc run cannot read "
                                f"the slot; run: ALTER ROLE {user} REPLICATION"]


def test_a_role_without_select_on_a_mapped_table(rides, roles):
    user = roles("nosel", select=False)
    result = check_as(rides, user)
    assert result.returncode == 4
    (line,) = problems(result)
    assert "mappings/ride.yaml:1: entity ride" in line and f"role {user} may not read public.rides" in line
    assert line.endswith(f"run: GRANT SELECT ON TABLE public.rides TO {user}")


def test_what_snapshots_and_backfills_need(rides, roles):
    user = roles("nobf")
    rides.execute(f'REVOKE UPDATE ON public.cdc_backfills FROM "{user}"')
    result = check_as(rides, user)
    assert result.returncode == 4
    (line,) = problems(result)
    assert "may not read and update public.cdc_backfills" in line
    assert f"GRANT SELECT, INSERT, UPDATE ON public.cdc_backfills TO {user}" in line
    rides.execute("DROP TABLE public.cdc_backfills")
    result = check_as(rides, user)
    assert result.returncode == 4 and "table public.cdc_backfills does not exist" in result.stderr
    assert "cdc init" in result.stderr


def test_an_unreachable_redis(rides):
    port = free_port()
    result = check_as(rides, redis_url=f"redis://127.0.0.1:{port}/0")
    assert result.returncode == 75
    (line,) = problems(result)
    assert f"redis at 127.0.0.1:{port} is unreachable" in line and "check redis.url" in line
    assert "ok: slot" in result.stdout  # PostgreSQL was still checked


def test_a_redis_url_with_an_http_scheme(rides):
    result = check_as(rides, redis_url="http://127.0.0.1:6379/0")
    assert result.returncode == 2
    assert result.stderr == (f"cdc: error: redis.url (from {rides.config_path}:2) has scheme 'http://'; Redis URLs start "
                             "with redis://, rediss:// or unix://; write it as redis://user:***@host:6379/0, or "
                             "rediss:// for TLS, unix:///path.sock for a socket\n")


def test_an_acl_user_without_evalsha(rides):
    with acl_user(rides, "noevalsha", "+@all", "-evalsha") as url:
        result = check_as(rides, redis_url=url)
    assert result.returncode == 5
    lines = problems(result)
    assert lines and all("may not run EVALSHA" in line for line in lines)
    assert all("(consumers sends it)" in line for line in lines)  # the bridge appends with MULTI/EXEC, no script
    assert "add +evalsha" in lines[0] and "pw-noevalsha" not in result.stderr


def test_an_acl_user_without_watch_cannot_append(rides):
    with acl_user(rides, "nowatch", "+@all", "-watch") as url:
        result = check_as(rides, redis_url=url)
    assert result.returncode == 5
    lines = problems(result)
    assert lines and all("may not run WATCH" in line and "(cdc run sends it)" in line for line in lines)
    assert "add +watch" in lines[0]


def test_an_acl_user_whose_keys_are_elsewhere(rides):
    rides.redis.acl_setuser("otherkeys", enabled=True, passwords=["+pw-ok"], keys=["app:*"], commands=["+@all"], reset=True)
    try:
        result = check_as(rides, redis_url=f"redis://otherkeys:pw-ok@127.0.0.1:{rides.redis_server.port}/0")
    finally:
        rides.redis.acl_deluser("otherkeys")
    assert result.returncode == 5
    assert any("may not run XADD" in line and "no permissions to access the 'cdc:" in line
               for line in problems(result))


def test_the_deployed_acl_passes(rides):
    conf = (Path(__file__).resolve().parents[2] / "deploy" / "redis" / "redis.conf").read_text()
    rules = next(line for line in conf.splitlines() if line.startswith("user cdc-bridge"))
    rides.redis.execute_command("ACL", "SETUSER", "cdc-bridge-check", "reset", *rules.split()[2:])
    try:
        result = check_as(rides, redis_url=f"redis://cdc-bridge-check:change-me-bridge@127.0.0.1:{rides.redis_server.port}/0")
    finally:
        rides.redis.acl_deluser("cdc-bridge-check")
    assert result.returncode == 0, result.stderr
    assert "may run the" in result.stdout


def test_a_user_that_may_not_ask_the_acl_gets_a_warning(rides):
    with acl_user(rides, "noacl", "+@all", "-acl") as url:
        result = check_as(rides, redis_url=url)
    assert result.returncode == 0, result.stderr
    assert "cannot ask the ACL" in result.stderr and "+acl|whoami +acl|dryrun" in result.stderr


def test_warnings_for_a_redis_that_would_lose_or_evict_data(rides):
    with redis_config(rides, "appendonly", "no"), redis_config(rides, "maxmemory-policy", "allkeys-lru"):
        result = check_as(rides)
    assert result.returncode == 0, result.stderr  # warnings, not problems
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2
    assert "runs without AOF (appendonly no)" in warnings[0] and "set appendonly yes" in warnings[0]
    assert "maxmemory-policy allkeys-lru" in warnings[1] and "evicts stream keys" in warnings[1]
    assert "set maxmemory-policy noeviction" in warnings[1]


def test_a_redis_that_lost_what_the_slot_was_told(rides):
    rides.redis.delete(f"cdc:bridge:{rides.slot}:flushed")  # as after a restart without persistence
    result = check_as(rides)
    assert result.returncode == 6
    (line,) = problems(result)
    assert "redis" in line and rides.slot in line


def test_a_metrics_port_in_use_is_a_warning(rides):
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):
        result = check_as(rides, extra=f"http: {{host: 127.0.0.1, port: {port}}}\n")
    assert result.returncode == 0, result.stderr  # the running bridge may be what holds it
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert f"http 127.0.0.1:{port}" in line and "cdc run will stop (exit 2)" in line and "set http.port" in line


def test_every_problem_at_once(rides, roles):
    user = roles("many", replication=False, select=False)
    result = check_as(rides, user, redis_url=f"redis://127.0.0.1:{free_port()}/0")
    found = "\n".join(problems(result))
    assert len(problems(result)) == 3, result.stderr
    assert "REPLICATION" in found and "GRANT SELECT ON TABLE public.rides" in found and "unreachable" in found
    assert result.returncode == 4  # the smallest exit code among the kinds found
    assert "cdc check: 3 problem(s)" in result.stderr


def test_a_spill_directory_that_cannot_be_written_is_refused_by_check_and_run(rides):
    missing = rides.tmp / "no-such-dir"
    rides.write_config(f"batch: {{spill_dir: {missing}}}\n", postgres=", streaming: true")
    result = rides.cdc("check")
    assert result.returncode == 2, result.stderr
    (line,) = problems(result)
    assert f"batch.spill_dir: cannot write spill files in {missing}" in line and "create the directory" in line
    run = rides.cdc("run", "--until-caught-up")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert f"batch.spill_dir: cannot write spill files in {missing}" in run.stderr
    missing.mkdir()
    ok = rides.cdc("check")
    assert ok.returncode == 0, ok.stderr
    assert f"spill to {missing}" in ok.stdout


@pytest.mark.slow
def test_checks_beside_a_streaming_bridge_find_nothing_diverged(env):
    """`cdc check` while the bridge streams, as an operator runs it: it reads the server's WAL position, then
    Redis' record, which the bridge moves past that position in between. No check may report a divergence, nor
    record one that would stop the bridge's next start."""
    env.init_rides("ride.yaml", config="batch: {max_entries: 40, max_delay_ms: 1}\n")
    workload = MixedWorkload(env.dsn, transactions=100_000, seed=3, rate=400)
    workload.start()
    bridge = env.start_bridge()
    flushed = keys.flushed_key(env.slot)
    try:
        wait_for(lambda: int(env.redis.get(flushed) or 0) > 0 or bridge.poll() is not None, 30, "the bridge to record")
        for _ in range(12):
            result = env.cdc("check")
            assert "diverged" not in result.stdout + result.stderr and "WAL is at" not in result.stderr, result.stderr
            assert result.returncode == 0, result.stdout + result.stderr
            assert not env.redis.hget(keys.bridge_state_key(env.slot), "data_loss"), "a check recorded a loss"
        assert bridge.poll() is None
    finally:
        workload.stopped.set()
        workload.join(30)
    assert workload.error is None, workload.error
    bridge.terminate()
    assert bridge.wait(30) == 0
    env.cdc("run", "--until-caught-up", check=True)
