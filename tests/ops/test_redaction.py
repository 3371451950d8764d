"""No password in any output: every error path reachable with a password-bearing DSN or URL,
given in the config file, the environment or a secret file, mistyped or merely wrong."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote, unquote

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict
from redis.connection import parse_url

from cdc import redact as redact_module
from cdc.config import Settings
from cdc.demo.local import free_port
from cdc.errors import CdcError
from cdc.exits import report
from cdc.redact import redact, secrets_of

SECRET = "S3cret-9f2Kq"
HALVES = ("S3cret-A1", "9f2Kq-B2")  # a password some parsers cut in two: neither half may show

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
    ("RuntimeError: connection failed: token=S3cret, retrying", "RuntimeError: connection failed: token=***, retrying"),
    ("secret=S3cret access_token=S3cret2 client_secret='S3 cret' api_key=S3cret3",
     "secret=*** access_token=*** client_secret=*** api_key=***"),
    ("HTTP 401: Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.S3cret", "HTTP 401: Authorization: Bearer ***"),
    ("Authorization: Basic dXNlcjpTM2NyZXQ=", "Authorization: Basic ***"),
    ("sent bearer eyJhbGciOiJIUzI1NiJ9.S3cret", "sent bearer ***"),
    ("postgresql://u:S3cret@h/db and redis://user:S3cret@host", "postgresql://u:***@h/db and redis://user:***@host"),
    ("missing \"=\" after \"password:S3cret\" in connection info string",
     "missing \"=\" after \"password:***\" in connection info string"),
    ("basic authentication failed for user cdc", None),  # words, not credentials
])
def test_redact_hides_passwords_however_written(text, shown):
    assert redact(text) == (text if shown is None else shown)


@pytest.mark.parametrize("message, value, shown", [
    ('missing "=" after "ss" in connection info string', "host=db password=pa ss dbname=x",
     'missing "=" after "***" in connection info string'),
    ('invalid percent-encoded token: "p%zzss"', "postgresql://u:p%zzss@h/db", 'invalid percent-encoded token: "***"'),
    ('unexpected spaces found in "pa ss", use percent-encoded spaces (%20) instead', "postgresql://u:pa ss@h/db",
     'unexpected spaces found in "***", use percent-encoded spaces (%20) instead'),
    ('end of string reached when looking for matching "]" in IPv6 host address in URI: "postgresql://u:pw@[h/db"',
     "postgresql://u:pw@[h/db", 'end of string reached when looking for matching "]" in IPv6 host address in URI: '
                                '"postgresql://u:***@[h/db"'),
    ("Port could not be cast to integer value as 'pa'", "redis://u:pa/ss@h:6379/0",
     "Port could not be cast to integer value as '***'"),
    ('invalid connection option "nosuch"', "host=db nosuch=1 password=pw", 'invalid connection option "nosuch"'),
    # after an unquoted password, a word that is no keyword may be part of it (password=a b=c): hidden
    ('invalid connection option "b"', "host=db password=a b=c", 'invalid connection option "***"'),
])
def test_a_parser_s_quoted_fragment_shows_without_the_password(message, value, shown):
    assert redact_module.mask_quoted(message, value) == shown


@pytest.mark.parametrize("value, spans", [
    ("postgresql://u:p@ss@h/db", ["p@ss"]),
    ("postgresql://u:pa/ss@h/db", ["pa/ss"]),
    ("redis://:p?ss#x@h:6379/0", ["p?ss#x"]),
    ("host=db password=pa ss dbname=x", ["pa ss"]),
    ("host=db password='pa ss dbname=x", ["'pa ss dbname=x"]),
    ("host=db password='pa' ss dbname=x", ["'pa' ss"]),
    ("postgresql://u@h/db?password=a&b&sslmode=require", ["a&b"]),
    ("postgresql://u@h:5432/db", []),
])
def test_a_password_is_read_generously(value, spans):
    assert [value[a:b] for a, b in redact_module.password_spans(value)] == spans


def test_pgpassword_is_hidden_too(monkeypatch, capsys, tmp_path):
    from cdc import cli

    monkeypatch.setenv("PGPASSWORD", "S3cret-pgpass")
    monkeypatch.setattr("cdc.cli.ops.cmd_status", lambda args: (_ for _ in ()).throw(RuntimeError("auth S3cret-pgpass")))
    assert cli.main(["status", "--config", str(tmp_path / "x.yaml")]) == 1
    assert "S3cret-pgpass" not in capsys.readouterr().err


def test_the_secrets_of_a_url_include_the_decoded_password():
    assert {"S3%40cret", "S3@cret"} <= secrets_of("redis://u:S3%40cret@h/0")


# -- every way a password can be malformed, from every source ---------------------------------------

#: what a generated password is made of: marker words (which must never show) between characters
#: that break parsers: spaces, @, %, quotes, backslashes, :, /, ?, #, =, &, non-ASCII letters
MARKERS = ("Qz7kW", "Jx4vR", "Pm9tY")
BREAKERS = (" ", "@", "%", "%zz", "%40", "'", '"', "\\", ":", "/", "?", "#", "=", "&", "\u00e9", "\u00df", "\u20ac", "\t", "\n", "@@", "''", "\\'")
passwords = st.lists(st.sampled_from(BREAKERS + MARKERS), min_size=0, max_size=6).map(
    lambda parts: MARKERS[0] + "".join(parts) + MARKERS[1])


def _quoted(password: str) -> str:
    return "'" + password.replace("\\", "\\\\").replace("'", "\\'") + "'"


#: how a DSN can hold the password: written raw (often malformed) or properly encoded (valid)
DSN_FORMS = {
    "url raw": lambda pw: f"postgresql://cdc_bridge:{pw}@127.0.0.1:5432/app",
    "url mistyped scheme": lambda pw: f"postgresql:/cdc_bridge:{pw}@127.0.0.1/app",
    "url encoded": lambda pw: f"postgresql://cdc_bridge:{quote(pw, safe='')}@127.0.0.1:5432/app",
    "url query": lambda pw: f"postgresql://cdc_bridge@127.0.0.1:5432/app?password={pw}",
    "key=value raw": lambda pw: f"host=127.0.0.1 user=cdc_bridge password={pw} dbname=app",
    "key=value quoted": lambda pw: f"host=127.0.0.1 user=cdc_bridge password={_quoted(pw)} dbname=app",
    "key=value unterminated quote": lambda pw: f"host=127.0.0.1 user=cdc_bridge password='{pw} dbname=app",
    "key=value bad sslmode": lambda pw: f"host=127.0.0.1 password={_quoted(pw)} sslmode=bogus",
    # a colon typed for the = sign: libpq's complaint quotes the whole pair
    "key=value colon": lambda pw: f"host=127.0.0.1 user=cdc_bridge password:{pw} dbname=app",
}
URL_FORMS = {
    "raw": lambda pw: f"redis://cdc-bridge:{pw}@127.0.0.1:6379/0",
    "encoded": lambda pw: f"redis://cdc-bridge:{quote(pw, safe='')}@127.0.0.1:6379/0",
    "raw, bad port": lambda pw: f"rediss://:{pw}@127.0.0.1:port/0",
    "raw, bad option": lambda pw: f"redis://:{pw}@127.0.0.1:6379/0?ssl_cert_reqs=maybe",
}


def _load(tmp: Path, setting: str, value: str, source: str) -> tuple[int | None, str, str]:
    """Load a config with `setting` (postgres.dsn or redis.url) = `value` given by `source`;
    (exit code or None when it loaded, what `cdc` printed, where the message must point)."""
    section, key = setting.split(".")
    variable = f"CDC_{section}_{key}".upper()
    cfg = tmp / "cdc.yaml"
    env: dict[str, str] = {}
    if source == "file":
        cfg.write_text(f"# the {setting}\n{section}:\n  {key}: {json.dumps(value)}\n")
        where = f"{cfg}:3"
    else:
        cfg.write_text("mappings: mappings/\n")
        if source == "env":
            env[variable], where = value, f"env {variable}"
        else:
            (tmp / "secret").write_text(value + "\n")
            env[variable + "_FILE"], where = str(tmp / "secret"), f"file {tmp / 'secret'} named by {variable}_FILE"
    saved = set(redact_module._registered)
    redact_module._registered.clear()  # what this load registers, and nothing else, hides the password
    try:
        try:
            Settings.from_file(cfg, env=env)
            return None, "", where
        except CdcError as exc:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = report(exc)
            return code, err.getvalue(), where
    finally:
        redact_module._registered.clear()
        redact_module._registered.update(saved)


#: the typo: a colon for the = after password; libpq's complaint quotes the whole pair
TYPO_PASSWORD = "Bs5Hy\\Qk7Jw"


def test_a_dsn_typo_names_where_it_came_from_and_never_the_password(env):
    """A colon for an = sign, in the config file, the environment or a _FILE: cdc check and cdc run say
    where the string came from and libpq's reason without what it quotes."""
    env.copy_mappings("ride.yaml")
    pg = env.postgres.port
    dsn = f"host=127.0.0.1 port={pg} dbname={env.dbname} user=cdc_bridge password:{TYPO_PASSWORD}"
    secret = env.tmp / "dsn"
    secret.write_text(dsn + "\n")
    reason = 'is not a valid connection string: missing "=" after (a part of it, not shown) in connection info string; fix:'
    for command in ("check", "run"):
        env.write_config(dsn=dsn)  # single-quoted YAML: the backslash is kept as written
        sources = [(f"{env.config_path}:1", {}), ("env CDC_POSTGRES_DSN", {"CDC_POSTGRES_DSN": dsn}),
                   (f"file {secret} named by CDC_POSTGRES_DSN_FILE", {"CDC_POSTGRES_DSN_FILE": str(secret)})]
        for source, extra in sources:
            result = env.cdc(command, env=extra, timeout=60)
            output = result.stdout + result.stderr
            assert "Bs5Hy" not in output and "Qk7Jw" not in output, (command, source, output)
            assert result.returncode == 2 and result.stderr.count("\n") == 1 and not result.stdout, (command, source, output)
            assert result.stderr.startswith(f"cdc: error: postgres.dsn (from {source}) {reason}"), (command, source, output)
    # the advice works: with an = sign the string parses, and check goes on to the server (the login is refused)
    env.write_config(dsn=dsn.replace("password:", "password="))
    result = env.cdc("check", timeout=60)
    assert "is not a valid connection string" not in result.stderr and "Bs5Hy" not in result.stdout + result.stderr


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(password=passwords, form=st.sampled_from(sorted(DSN_FORMS)), source=st.sampled_from(["file", "env", "env file"]))
@example(password="Qz7kW pa ss@Jx4vR", form="key=value raw", source="env")
@example(password="Qz7kW@Jx4vR", form="url raw", source="file")
@example(password="Qz7kW'Jx4vR", form="key=value unterminated quote", source="env file")
def test_a_dsn_password_never_shows_however_malformed(password, form, source, tmp_path):
    dsn = DSN_FORMS[form](password)
    code, printed, where = _load(tmp_path, "postgres.dsn", dsn, source)
    if code is None:  # accepted: then libpq reads the password as written (percent-decoded in a URL)
        written = (password if "encoded" in form else unquote(password) if "url" in form
                   else re.sub(r"\\(.)", r"\1", password) if "raw" in form else password)
        assert conninfo_to_dict(dsn).get("password") == written, (form, dsn)  # (libpq's escapes unescaped)
        return
    assert not any(marker in printed for marker in MARKERS), printed
    assert code == 2 and printed.count("\n") == 1, printed
    assert printed.startswith(f"cdc: error: postgres.dsn (from {where})"), printed


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(password=passwords, form=st.sampled_from(sorted(URL_FORMS)), source=st.sampled_from(["file", "env", "env file"]))
@example(password="Qz7kW/Jx4vR", form="raw", source="env")
def test_a_redis_url_password_never_shows_however_malformed(password, form, source, tmp_path):
    url = URL_FORMS[form](password)
    code, printed, where = _load(tmp_path, "redis.url", url, source)
    if code is None:  # accepted: then redis-py reads the password as written (percent-decoded)
        assert parse_url(url).get("password") == (password if "encoded" in form else unquote(password)), (form, url)
        return
    assert not any(marker in printed for marker in MARKERS), printed
    assert code == 2 and printed.count("\n") == 1, printed
    assert printed.startswith(f"cdc: error: redis.url (from {where})"), printed


def _commands(env) -> list[tuple[str, ...]]:
    return [("init",), ("check",), ("run", "--until-caught-up"), ("status",), ("schema",), ("trim",), ("recover",),
            ("reconcile", "--dry-run"),
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
        # passwords a parser cuts short: each half must stay hidden
        "@ in the password": f"postgresql://cdc_bridge:{HALVES[0]}@{HALVES[1]}@127.0.0.1:{pg}/{env.dbname}",
        "/ in the password": f"postgresql://cdc_bridge:{HALVES[0]}/{HALVES[1]}@127.0.0.1:{pg}/{env.dbname}",
        "% in the password": f"postgresql://cdc_bridge:{HALVES[0]}%zz{HALVES[1]}@127.0.0.1:{pg}/{env.dbname}",
        "space, key=value": f"host=127.0.0.1 port={pg} user=cdc_bridge password={HALVES[0]} {HALVES[1]} dbname={env.dbname}",
        "unterminated quote": f"host=127.0.0.1 port={pg} user=cdc_bridge password='{HALVES[0]} {HALVES[1]} dbname={env.dbname}",
        "quoted, wrong": f"host=127.0.0.1 port={pg} user=cdc_bridge password='{HALVES[0]}\\'\\\\ {HALVES[1]}' dbname={env.dbname}",
        "bad sslmode": f"postgresql://cdc_bridge:{SECRET}@127.0.0.1:{pg}/{env.dbname}?sslmode=bogus",
        "colon for =": f"host=127.0.0.1 port={pg} user=cdc_bridge password:{SECRET} dbname={env.dbname}",
        "sslmode=require, no SSL": f"postgresql://cdc_bridge:{SECRET}@127.0.0.1:{pg}/{env.dbname}?sslmode=require",
    }
    bad_urls = {
        "http scheme": f"http://u:{SECRET}@127.0.0.1:{env.redis_server.port}/0",
        "wrong password": f"redis://nosuchuser:{SECRET}@127.0.0.1:{env.redis_server.port}/0",
        "unreachable": f"redis://:{SECRET}@127.0.0.1:{port}/0",
        "bad port": f"redis://:{SECRET}@127.0.0.1:port/0",
        "@ and a space in the password": f"redis://nosuchuser:{HALVES[0]}@ {HALVES[1]}@127.0.0.1:{env.redis_server.port}/0",
        "/ in the password": f"redis://nosuchuser:{HALVES[0]}/{HALVES[1]}@127.0.0.1:{env.redis_server.port}/0",
        "TLS against a plain port": f"rediss://:{SECRET}@127.0.0.1:{env.redis_server.port}/0?ssl_cert_reqs=none",
    }
    runs = []
    # each of a DSN's commands stops at its PostgreSQL connection, before anything they could share: side by side
    with ThreadPoolExecutor(4) as pool:
        for what, dsn in bad_dsns.items():
            env.config_path.write_text(f"postgres: {{dsn: {json.dumps(dsn)}, slot: {env.slot}}}\n"  # in the config file
                                       f"redis: {{url: '{env.redis_server.url}'}}\nmappings: mappings/\nhttp: {{port: 0}}\n")
            secret = tmp_path / "dsn"
            secret.write_text(dsn)
            calls = [(f"config dsn {what}", command, None) for command in _commands(env)[:8]]  # those that connect to PostgreSQL first
            calls += [(f"file dsn {what}", ("check",), {"CDC_POSTGRES_DSN_FILE": str(secret)}),
                      (f"env dsn {what}", ("run",), {"CDC_POSTGRES_DSN": dsn})]
            results = list(pool.map(lambda call: _cdc(env, *call[1], extra_env=call[2]), calls))
            runs += [(label, command, result) for (label, command, _), result in zip(calls, results)]
    env.write_config()
    for what, url in bad_urls.items():
        for command in _commands(env):
            runs.append((f"env url {what}", command, _cdc(env, *command, extra_env={"CDC_REDIS_URL": url})))
    failures = []
    for what, command, result in runs:
        output = result.stdout + result.stderr
        if not any(secret in output for secret in (SECRET, *HALVES)) and "Traceback" not in output:
            continue
        failures.append(f"{what}: cdc {' '.join(command)} -> {result.returncode}\n{output}")
    assert not failures, "\n".join(failures)
    assert len(runs) == len(bad_dsns) * 10 + len(bad_urls) * len(_commands(env))


def test_metric_labels_and_readiness_never_show_a_secret():
    """A label value or a /readyz answer that quotes a secret (a stream or error named from an outside value)."""
    import urllib.request

    from cdc.metrics import Registry, serve

    registry = Registry()
    registry.gauge("cdc_test_up", "a test gauge", lambda: {(("error", "auth failed: password=S3cret token=T0ken"),): 1.0})
    rendered = registry.render()
    assert "password=***" in rendered and "token=***" in rendered
    assert "S3cret" not in rendered and "T0ken" not in rendered
    server = serve(registry, lambda: (False, "redis: cannot connect to redis://u:S3cret@h:6379/0"), "127.0.0.1", 0)
    try:
        port = server.server_address[1]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10)
        body = refused.value.read().decode()
        assert refused.value.code == 503 and body == "redis: cannot connect to redis://u:***@h:6379/0\n", body
    finally:
        server.shutdown()
        server.server_close()
