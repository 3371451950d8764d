"""No password in any output: every error path reachable with a password-bearing DSN or URL,
given in the config file, the environment or a secret file, mistyped or merely wrong."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from cdc.demo.local import free_port
from cdc.redact import redact, secrets_of

SECRET = "S3cret-9f2Kq"

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("text, shown", [
    ("postgresql:/cdc_bridge:S3cret@db/app", "postgresql:/cdc_bridge:***@db/app"),
    ("missing \"=\" after \"postgresql:/u:S3cret@db/app\" in connection info string",
     "missing \"=\" after \"postgresql:/u:***@db/app\" in connection info string"),
    ("postgresql//u:S3cret@db/app", "postgresql//u:***@db/app"),
    ("redis://:S3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("rediss://user:S3%40cret@h:6380/0?ssl_cert_reqs=required", "rediss://user:***@h:6380/0?ssl_cert_reqs=required"),
    ("host=db user=u password=S3cret dbname=app", "host=db user=u password=*** dbname=app"),
    ("host=db password='S3 cret' dbname=app", "host=db password=*** dbname=app"),
    ("postgresql://u@db/app?password=S3cret&sslmode=require", "postgresql://u@db/app?password=***&sslmode=require"),
    ("postgresql://u@db:5432/app lsn 0/16B3748 at 2026-11-21T09:00:00Z", None),  # nothing to hide
])
def test_redact_hides_passwords_however_written(text, shown):
    assert redact(text) == (text if shown is None else shown)


def test_the_secrets_of_a_url_include_the_decoded_password():
    assert {"S3%40cret", "S3@cret"} <= secrets_of("redis://u:S3%40cret@h/0")


def _commands(env) -> list[tuple[str, ...]]:
    return [("init",), ("check",), ("run", "--until-caught-up"), ("status",), ("schema",), ("trim",),
            ("backfill", "--entity", "ride"), ("read", "--entity", "ride"), ("dlq", "list", "--group", "g"),
            ("replay", "--entity", "ride", "--group", "g", "--from", "0"),
            ("consume", "--entity", "ride", "--group", "g", "--handler", "cdc.demo.rocketrides:ride_totals",
             "--state-dsn", f"postgresql:/u:{SECRET}@db/app")]


def _cdc(env, *command: str, extra_env: dict | None = None):
    """Run a cdc command; one that retries forever (run, consume against a server that is down) is
    stopped after a while and judged on what it printed until then."""
    try:
        return env.cdc(*command, env=extra_env, timeout=10)
    except subprocess.TimeoutExpired as exc:
        text = [(b or b"").decode() if isinstance(b, bytes) else (b or "") for b in (exc.stdout, exc.stderr)]
        return SimpleNamespace(returncode=None, stdout=text[0], stderr=text[1])


@pytest.mark.slow
def test_no_command_shows_a_password_on_any_error_path(env, tmp_path):
    env.init_rides("ride.yaml")
    port, pg = free_port(), env.postgres.port
    bad_dsns = {
        "mistyped": f"postgresql:/cdc_bridge:{SECRET}@127.0.0.1/{env.dbname}",
        "wrong password": f"postgresql://cdc_bridge:{SECRET}@127.0.0.1:{pg}/{env.dbname}",
        "unreachable": f"postgresql://cdc_bridge:{SECRET}@127.0.0.1:{port}/{env.dbname}?connect_timeout=2",
        "bad option": f"postgresql://cdc_bridge:{SECRET}@127.0.0.1:{pg}/{env.dbname}?nosuch=1",
    }
    bad_urls = {
        "http scheme": f"http://u:{SECRET}@127.0.0.1:{env.redis_server.port}/0",
        "wrong password": f"redis://nosuchuser:{SECRET}@127.0.0.1:{env.redis_server.port}/0",
        "unreachable": f"redis://:{SECRET}@127.0.0.1:{port}/0",
        "bad port": f"redis://:{SECRET}@127.0.0.1:port/0",
    }
    runs = []
    for what, dsn in bad_dsns.items():
        env.write_config(dsn=dsn)  # in the config file
        for command in _commands(env)[:6]:
            runs.append((f"config dsn {what}", command, _cdc(env, *command)))
        secret = tmp_path / "dsn"
        secret.write_text(dsn)
        runs.append((f"file dsn {what}", ("check",), _cdc(env, "check", extra_env={"CDC_POSTGRES_DSN_FILE": str(secret)})))
        runs.append((f"env dsn {what}", ("run",), _cdc(env, "run", extra_env={"CDC_POSTGRES_DSN": dsn})))
    env.write_config()
    for what, url in bad_urls.items():
        for command in _commands(env):
            runs.append((f"env url {what}", command, _cdc(env, *command, extra_env={"CDC_REDIS_URL": url})))
    failures = []
    for what, command, result in runs:
        output = result.stdout + result.stderr
        if SECRET not in output and "Traceback" not in output:
            continue
        failures.append(f"{what}: cdc {' '.join(command)} -> {result.returncode}\n{output}")
    assert not failures, "\n".join(failures)
    assert len(runs) == 4 * 8 + 4 * len(_commands(env))
