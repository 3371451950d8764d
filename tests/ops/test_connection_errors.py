"""Exit codes by cause, for every command that connects: a refused login is 4 (PostgreSQL) or
5 (Redis) with the server and the fix, never 75 (which a supervisor retries forever); a malformed
connection setting is 2 before anything connects; a TLS mismatch is 2, named as such, within the
connect timeout. No password in any of it, and nothing created on the servers by a command that failed."""

from __future__ import annotations

import subprocess
import time
from types import SimpleNamespace

import pytest

from cdc.demo.local import LocalPostgres, LocalRedis
from certs import make_certs

pytestmark = pytest.mark.integration

SECRET = "S3cret-Conn-4x9"
#: every command that connects to PostgreSQL and Redis first (run retries only what is transient)
COMMANDS = [("init",), ("check",), ("run", "--until-caught-up"), ("status",), ("trim",), ("schema",),
            ("read", "--entity", "ride"), ("backfill", "--entity", "ride"),
            ("consume", "--entity", "ride", "--group", "g", "--handler", "cdc.demo.rocketrides:ride_totals")]
#: the commands that reach PostgreSQL (trim and read only need Redis), and those that reach Redis
PG_COMMANDS = [c for c in COMMANDS if c[0] not in ("trim", "read")]
REDIS_COMMANDS = [c for c in COMMANDS if c[0] not in ("schema", "backfill")]


def _cdc(env, *command: str, extra_env: dict | None = None, timeout: float = 30):
    """Run a cdc command; one still running after `timeout` (retrying what it should not) is a failure."""
    started = time.monotonic()
    try:
        result = env.cdc(*command, env=extra_env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        text = [b.decode() if isinstance(b, bytes) else (b or "") for b in (exc.stdout, exc.stderr)]
        result = SimpleNamespace(returncode=None, stdout=text[0], stderr=text[1] + f"\n(still running after {timeout}s)")
    result.seconds = time.monotonic() - started
    return result


def _server_objects(env) -> tuple:
    """What a failed command must not have created: slots, publications, the backfills table."""
    return (env.execute("SELECT slot_name FROM pg_replication_slots ORDER BY 1"),
            env.execute("SELECT pubname FROM pg_publication ORDER BY 1"),
            env.execute("SELECT to_regclass('public.cdc_backfills') IS NOT NULL"))


def _one_line(result, code: int, *says: str) -> str | None:
    """What is wrong with `result`, or None when it is one error line with `code` saying each of `says`."""
    lines = result.stderr.strip().splitlines()
    problems = []
    if result.returncode != code:
        problems.append(f"exit {result.returncode}, not {code}")
    if SECRET in result.stdout + result.stderr or "Traceback" in result.stderr:
        problems.append("a secret or a traceback")
    if not any(line.startswith(("cdc: error: ", "problem: ")) and all(s in line for s in says) for line in lines):
        problems.append(f"no line saying {says}")
    return "; ".join(problems) or None


@pytest.mark.slow
def test_a_refused_login_is_4_or_5_with_the_server_and_the_fix_in_every_command(env):
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    pg, rd = env.postgres.port, env.redis_server.port
    before = _server_objects(env)
    bad = []
    env.write_config(dsn=f"postgresql://cdc_bridge:{SECRET}@127.0.0.1:{pg}/{env.dbname}")
    for command in PG_COMMANDS:
        result = _cdc(env, *command)
        problem = _one_line(result, 4, "password authentication failed", "127.0.0.1", "check the user and password")
        if problem:
            bad.append(f"postgres login: cdc {' '.join(command)}: {problem}\n{result.stderr}")
    assert _server_objects(env) == before  # init created nothing
    env.write_config()
    env.init_rides()
    for user in ("nosuchuser", "cdc-bridge"):  # the server has neither: a wrong user, or a wrong password
        env.write_config(redis_url=f"redis://{user}:{SECRET}@127.0.0.1:{rd}/0")
        for command in REDIS_COMMANDS:
            result = _cdc(env, *command)
            problem = _one_line(result, 5, f"redis at 127.0.0.1:{rd} refused the login", "check the user and password")
            if problem:
                bad.append(f"redis login as {user}: cdc {' '.join(command)}: {problem}\n{result.stderr}")
    assert not bad, "\n".join(bad)


MALFORMED_DSNS = {
    "unknown sslmode": ("host=127.0.0.1 port={pg} dbname={db} sslmode=bogus", "sslmode='bogus' is not one of"),
    "port not a number": ("host=127.0.0.1 port=nope dbname={db}", "port 'nope' is not a port number"),
    "port out of range": ("postgresql://127.0.0.1:99999/{db}", "port '99999' is not a port number"),
    "connect_timeout not a number": ("host=127.0.0.1 port={pg} dbname={db} connect_timeout=soon",
                                     "connect_timeout='soon' is not a whole number"),
    "@ in the password": ("postgresql://cdc_bridge:" + SECRET + "@x@127.0.0.1:{pg}/{db}",
                          "would not read its password as written"),
    "space in the password": ("host=127.0.0.1 port={pg} dbname={db} password=" + SECRET + " x",
                              "is not a valid connection string"),
}
MALFORMED_URLS = {
    "port not a number": ("redis://127.0.0.1:port/0", "is not a valid URL"),
    "unknown ssl_cert_reqs": ("rediss://127.0.0.1:{rd}/0?ssl_cert_reqs=maybe", "ssl_cert_reqs='maybe' is not one of"),
    "/ in the password": ("redis://u:" + SECRET + "/x@127.0.0.1:{rd}/0", "password would not be read as written"),
    "database not a number": ("redis://127.0.0.1:{rd}/zero", "database 'zero' is not a number"),
}


def test_a_malformed_connection_setting_is_2_before_anything_connects(env):
    """From the file and the environment, in the commands that connect; init creates nothing."""
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    before = _server_objects(env)
    bad = []
    for what, (dsn, says) in MALFORMED_DSNS.items():
        dsn = dsn.format(pg=env.postgres.port, db=env.dbname)
        env.write_config()
        for command in (("init",), ("check",), ("run",)):
            result = _cdc(env, *command, extra_env={"CDC_POSTGRES_DSN": dsn})
            if problem := _one_line(result, 2, "postgres.dsn (from env CDC_POSTGRES_DSN)", says):
                bad.append(f"dsn {what}: cdc {' '.join(command)}: {problem}\n{result.stderr}")
    for what, (url, says) in MALFORMED_URLS.items():
        url = url.format(rd=env.redis_server.port)
        env.write_config(redis_url=url)
        for command in (("init",), ("check",), ("status",)):
            result = _cdc(env, *command)
            if problem := _one_line(result, 2, f"redis.url (from {env.config_path}:2)", says):
                bad.append(f"url {what}: cdc {' '.join(command)}: {problem}\n{result.stderr}")
    assert not bad, "\n".join(bad)
    assert _server_objects(env) == before


@pytest.mark.parametrize("setting, value, says", [
    ("CDC_HTTP_PORT", "99999", "CDC_HTTP_PORT: http.port must be from 0 to 65535, got '99999'"),
    ("CDC_POSTGRES_RECEIVE_TIMEOUT_S", "nan", "postgres.receive_timeout_s must be from 1 to 3600, got 'nan'"),
    ("CDC_TRIM_MAX_LEN", "-1", "trim.max_len must be from 0 to"),
    ("CDC_BATCH_MAX_ENTRIES", "-5", "batch.max_entries must be from 1 to 1000000"),
    ("CDC_POSTGRES_DNS", "postgresql://u:" + SECRET + "@h/db", "did you mean CDC_POSTGRES_DSN?"),
])
def test_a_bad_setting_stops_check_and_init_with_2_and_creates_nothing(env, setting, value, says):
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    before = _server_objects(env)
    for command in ("check", "init", "run"):
        result = _cdc(env, command, extra_env={setting: value})
        assert _one_line(result, 2, says) is None, (command, result.stderr)
    assert _server_objects(env) == before


@pytest.fixture(scope="module")
def tls_servers(servers_root):
    """A PostgreSQL accepting only TLS over TCP (hostssl) and a TLS-only Redis, with their CA."""
    certs = make_certs(servers_root / "conn-certs")
    pg = LocalPostgres(servers_root / "conn-tls-pg", ssl_files=(certs.server_cert, certs.server_key)).start()
    rd = LocalRedis(servers_root / "conn-tls-redis", tls_files=(certs.ca, certs.server_cert, certs.server_key)).start()
    yield pg, rd, certs
    rd.stop()
    pg.stop("immediate")


def test_a_tls_mismatch_is_named_with_the_server_and_the_fix_within_the_connect_timeout(env, tls_servers):
    tls_pg, tls_redis, certs = tls_servers
    env.init_rides("ride.yaml")
    plain = env.redis_server.port
    bad = []
    cases = [
        # rediss:// against a plain-text port: no TLS answer ever comes; probed, not waited out
        ({"CDC_REDIS_URL": f"rediss://:{SECRET}@127.0.0.1:{plain}/0?ssl_cert_reqs=none"}, 2,
         (f"redis at 127.0.0.1:{plain} speaks plain text, but redis.url asks for TLS (rediss://)", "use redis://")),
        # redis:// against a TLS-only port
        ({"CDC_REDIS_URL": f"redis://:{SECRET}@127.0.0.1:{tls_redis.port}/0"}, 2,
         (f"redis at 127.0.0.1:{tls_redis.port} speaks TLS only, but redis.url is plain text", "use rediss://")),
        # sslmode=require against a server without SSL
        ({"CDC_POSTGRES_DSN": f"postgresql://postgres:{SECRET}@127.0.0.1:{env.postgres.port}/{env.dbname}?sslmode=require"},
         2, ("does not support SSL", "127.0.0.1", "turn it on", "sslmode=prefer")),
        # plain text against a server that accepts this client only over TLS (hostssl)
        ({"CDC_POSTGRES_DSN": f"postgresql://postgres:{SECRET}@127.0.0.1:{tls_pg.port}/postgres?sslmode=disable"},
         4, ("no pg_hba.conf entry", "no encryption", "127.0.0.1", "only over TLS: set sslmode=verify-full")),
    ]
    for extra, code, says in cases:
        for command in (("check",), ("run",), ("status",)):
            result = _cdc(env, *command, extra_env=extra)
            problem = _one_line(result, code, *says)
            if result.seconds > 5 + 2 + 5:  # the connect timeout, the probe, starting Python
                problem = f"{problem or ''}; took {result.seconds:.1f}s"
            if problem:
                bad.append(f"{extra}: cdc {command[0]}: {problem}\n{result.stderr}")
    assert not bad, "\n".join(bad)
