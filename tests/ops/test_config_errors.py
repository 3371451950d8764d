"""Every setting in its range, every override read: each numeric setting given values outside its
declared range (NaN and infinities too) from the file and from the environment, malformed connection
settings, and misspelt, doubled or empty ``CDC_`` variables end in one `cdc: error:` line naming the
place (file:line or the variable) and the fix, exit 2, before anything connects; the README's
"Configuration" table is the code's."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
from pathlib import Path

import pytest

from cdc import cli, config
from cdc.config import OTHER_VARIABLES, RANGES, Settings, check_environment, setting_variables
from cdc.errors import ConfigError
from cdc.exits import report

ROOT = Path(__file__).resolve().parents[2]


def numeric_settings() -> list[tuple[str, str, type, object]]:
    """(section, key, type, default) of every int and float setting."""
    found = []
    for section, cls in config._SECTIONS.items():
        for f in dataclasses.fields(cls):
            if type(f.default) in (int, float):
                found.append((section, f.name, type(f.default), f.default))
    return found


def outside(section: str, key: str) -> list[object]:
    """Values `section.key` must refuse: just past each end, NaN, the infinities, and a word."""
    limits = RANGES[(section, key)]
    step = 1 if isinstance(limits.least, int) and isinstance(limits.most, int) else max(limits.least / 2, 0.0005)
    values: list[object] = [limits.most + step, float("nan"), float("inf"), float("-inf"), "lots"]
    below = limits.least - step
    if below != limits.off:
        values.append(below)
    if limits.off is not None and limits.off + step < limits.least:
        values.append(limits.off + step)  # between "off" and the range
    return values


def inside(section: str, key: str) -> list[object]:
    limits = RANGES[(section, key)]
    return [v for v in (limits.least, limits.most, limits.off) if v is not None]


def test_every_numeric_setting_declares_its_range():
    assert {(s, k) for s, k, _, _ in numeric_settings()} == set(RANGES)
    for section, key, kind, default in numeric_settings():
        assert RANGES[(section, key)].admits(default), (section, key, default)


def _error(raw: dict, env: dict | None = None, tmp_path: Path | None = None) -> tuple[str, ConfigError]:
    with pytest.raises(ConfigError) as caught:
        Settings.from_dict(raw, env=env or {})
    return str(caught.value), caught.value


@pytest.mark.parametrize("section, key, kind, default", numeric_settings())
def test_a_value_outside_the_range_is_refused_from_the_file_and_the_environment(section, key, kind, default, tmp_path):
    limits = RANGES[(section, key)]
    cfg = tmp_path / "cdc.yaml"
    variable = f"CDC_{section}_{key}".upper()
    for value in outside(section, key):
        text = value if isinstance(value, str) else (repr(value) if math.isfinite(value) else
                                                     {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}[repr(value)])
        text = str(int(value)) if kind is int and isinstance(value, float) and value.is_integer() else text
        cfg.write_text(f"# settings\n{section}:\n  {key}: {text}\n")
        with pytest.raises(ConfigError) as caught:
            Settings.from_file(cfg, env={})
        message = str(caught.value)
        assert message.startswith(f"{cfg}:3: {section}.{key} must be "), (value, message)
        assert str(limits) in message or _KIND[kind] in message, (value, message)
        assert f"the default is {default!r}" in message
        env_value = "nan" if isinstance(value, float) and math.isnan(value) else str(value)
        empty = tmp_path / "empty.yaml"
        empty.write_text("")
        with pytest.raises(ConfigError) as caught:
            Settings.from_file(empty, env={variable: env_value})
        assert str(caught.value).startswith(f"{variable}: {section}.{key} must be "), (value, str(caught.value))
    for value in inside(section, key):
        companion = COMPANIONS.get((section, key), {})  # so that a rule across two settings holds
        settings = Settings.from_dict({section: {key: kind(value), **companion}}, env={})
        assert getattr(getattr(settings, section), key) == value


_KIND = {int: "an integer", float: "a number"}
COMPANIONS = {("redis", "resume_at_memory_fraction"): {"pause_at_memory_fraction": 0},
              ("redis", "pause_at_memory_fraction"): {"resume_at_memory_fraction": 0},
              ("postgres", "retained_wal_warn_bytes"): {"retained_wal_critical_bytes": 0},
              ("postgres", "retained_wal_critical_bytes"): {"retained_wal_warn_bytes": 0}}


@pytest.mark.parametrize("section, key, bad, good", [
    ("postgres", "slot", ["My-Slot", "", "x" * 64, "slot name"], ["cdc", "slot_2", "x" * 63]),
    ("postgres", "publication", ["", "p" * 64], ["cdc", "My Pub"]),
    ("reconcile", "driver_memory", ["2 gigs", "", "-1g"], ["2g", "512M", "1024"]),
    ("reconcile", "executor_memory", ["lots"], ["", "4g"]),
])
def test_a_text_setting_out_of_its_form_is_refused(section, key, bad, good):
    variable = f"CDC_{section}_{key}".upper()
    for value in bad:
        message, _ = _error({}, {variable: value})
        assert message.startswith(f"{variable}: {section}.{key} must be "), message
    for value in good:
        assert getattr(getattr(Settings.from_dict({}, env={variable: value}), section), key) == value


@pytest.mark.parametrize("yaml_value, says", [
    ("null", "must be a string, got nothing (null)"), ("[a, b]", "must be a string, got ['a', 'b']"),
    ("''", "postgres.dsn is empty"), ("['postgresql://u:S3cret-list@h/db']", "must be a string, got"),
])
def test_a_connection_string_of_the_wrong_type_or_empty_is_refused(yaml_value, says, tmp_path):
    cfg = tmp_path / "cdc.yaml"
    cfg.write_text(f"postgres:\n  dsn: {yaml_value}\n")
    with pytest.raises(ConfigError) as caught:
        Settings.from_file(cfg, env={})
    assert str(caught.value).startswith(f"{cfg}:2: postgres.dsn") and says in str(caught.value), str(caught.value)
    assert "S3cret" not in str(caught.value)


@pytest.mark.parametrize("section, key, value", [
    ("postgres", "streaming", "[yes]"), ("redis", "cluster", "null"), ("trim", "max_len", "true"),
    ("batch", "max_entries", "1.5"), ("postgres", "slot", "true"),
])
def test_nothing_silently_becomes_a_boolean_a_number_or_text(section, key, value, tmp_path):
    cfg = tmp_path / "cdc.yaml"
    cfg.write_text(f"{section}:\n  {key}: {value}\n")
    with pytest.raises(ConfigError, match=rf"cdc.yaml:2: {section}.{key} must be "):
        Settings.from_file(cfg, env={})


def test_cross_setting_rules_name_both():
    message, _ = _error({"redis": {"pause_at_memory_fraction": 0.5, "resume_at_memory_fraction": 0.6}})
    assert "redis.resume_at_memory_fraction (0.6) must be below redis.pause_at_memory_fraction (0.5)" in message
    assert Settings.from_dict({"redis": {"pause_at_memory_fraction": 0, "resume_at_memory_fraction": 0.8}})
    message, _ = _error({"postgres": {"retained_wal_warn_bytes": 10, "retained_wal_critical_bytes": 5}})
    assert "postgres.retained_wal_warn_bytes (10) must be below postgres.retained_wal_critical_bytes (5)" in message


def test_the_metrics_port_out_of_range_is_exit_2_naming_the_variable(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "cdc.yaml"
    cfg.write_text("postgres: {dsn: 'postgresql://u@127.0.0.1:1/db'}\n")
    monkeypatch.setenv("CDC_HTTP_PORT", "99999")
    assert cli.main(["--log-format", "text", "run", "--config", str(cfg)]) == 2
    assert capsys.readouterr().err == (
        "cdc: error: CDC_HTTP_PORT: http.port must be from 0 to 65535, got '99999'; the default is 9187; "
        "see docs/reference/configuration.md\n")


# -- the environment ----------------------------------------------------------------------------

@pytest.mark.parametrize("name, guess", [
    ("CDC_POSTGRES_DNS", "CDC_POSTGRES_DSN"),
    ("CDC_POSTGRES_DNS_FILE", "CDC_POSTGRES_DSN_FILE"),
    ("CDC_REDIS_ULR", "CDC_REDIS_URL"),
    ("CDC_BATCH_MAX_ENTRY", "CDC_BATCH_MAX_ENTRIES"),
    ("CDC_MAPPING", "CDC_MAPPINGS"),
    ("CDC_PURE_PYTON", "CDC_PURE_PYTHON"),
    ("CDC_SOMETHING_ELSE", None),
])
def test_an_unknown_cdc_variable_is_an_error_listing_the_accepted_ones(name, guess, tmp_path):
    cfg = tmp_path / "cdc.yaml"
    cfg.write_text("postgres: {dsn: 'postgresql://u@h/db'}\n")
    with pytest.raises(ConfigError) as caught:
        Settings.from_file(cfg, env={name: "postgresql://u:S3cret-typo@h/db", "PATH": "/bin"})
    message = str(caught.value)
    assert message.startswith(f"environment variable {name}: not a cdc setting")
    assert (f"(did you mean {guess}?)" in message) if guess else "did you mean" not in message
    assert "CDC_POSTGRES_{DSN," in message and "CDC_PURE_PYTHON" in message and "_FILE" in message
    assert "S3cret" not in message


def test_a_lower_case_cdc_variable_is_an_error_too():
    message, _ = _error({}, {"cdc_postgres_dsn": "postgresql://u@h/db"})
    assert message == "environment variable cdc_postgres_dsn: cdc's variables are upper-case; rename it CDC_POSTGRES_DSN"


def test_both_a_variable_and_its_file_or_an_empty_file_variable_are_errors(tmp_path):
    secret = tmp_path / "dsn"
    secret.write_text("postgresql://u:S3cret-both@h/db\n")
    message, _ = _error({}, {"CDC_POSTGRES_DSN": "postgresql://u@h/db", "CDC_POSTGRES_DSN_FILE": str(secret)})
    assert message == "CDC_POSTGRES_DSN and CDC_POSTGRES_DSN_FILE are both set; keep one: unset CDC_POSTGRES_DSN or CDC_POSTGRES_DSN_FILE"
    message, _ = _error({}, {"CDC_REDIS_URL_FILE": " "})
    assert message.startswith("CDC_REDIS_URL_FILE is empty; ")
    message, _ = _error({}, {"CDC_REDIS_URL_FILE": str(tmp_path / "missing")})
    assert message.startswith(f"CDC_REDIS_URL_FILE: cannot read {tmp_path / 'missing'}: No such file or directory")


def test_the_project_s_own_variables_are_accepted():
    check_environment({"CDC_PURE_PYTHON": "1", "CDC_TRACEBACK": "1", "CDC_HASH_KEY": "k", "CDC_HASH_KEY_FILE": "/k",
                       "CDC_PG_BIN": "/usr/lib/postgresql/15/bin", "CDC_DEMO_PG_PORT": "5432",
                       "CDC_FAULT_DOUBLE_SEND": "0.1", "CDC_POSTGRES_DSN_FILE": "/x", "CDC_MAPPINGS": "m",
                       "CDC_PII_SALT": "pepper"})


def test_every_cdc_variable_the_project_names_is_a_setting_or_listed_in_one_place():
    """A new CDC_ variable read anywhere must be added to config.OTHER_VARIABLES (or be a setting)."""
    found = subprocess.run(["grep", "-rhoE", r"CDC_[A-Z0-9_]*[A-Z0-9]", "cdc", "tests", "Makefile", "deploy", "README.md", "docs"],
                           cwd=ROOT, capture_output=True, text=True).stdout.split()
    settings = setting_variables()
    unknown = set()
    for name in set(found):
        base = name.removesuffix("_FILE")
        if base in settings or config._other_variable(name):
            continue
        if any(s.startswith(name) for s in settings) or any(o.rstrip("*").startswith(name) for o in OTHER_VARIABLES):
            continue  # a prefix written in prose (CDC_POSTGRES_...)
        unknown.add(name)
    # names the tests use on purpose: misspellings
    unknown -= {"CDC_POSTGRES_DNS", "CDC_POSTGRES_DNS_FILE", "CDC_REDIS_ULR", "CDC_BATCH_MAX_ENTRY", "CDC_MAPPING",
                "CDC_PURE_PYTON", "CDC_SOMETHING_ELSE"}
    assert not unknown, f"add these to cdc.config.OTHER_VARIABLES or make them settings: {sorted(unknown)}"


# -- malformed connection settings ------------------------------------------------------------

@pytest.mark.parametrize("dsn, says", [
    ("host=127.0.0.1 sslmode=bogus", "sslmode='bogus' is not one of disable, allow, prefer, require, verify-ca, verify-full"),
    ("postgresql://u@127.0.0.1/db?sslmode=Require", "sslmode='Require' is not one of"),
    ("host=127.0.0.1 port=nope", "port 'nope' is not a port number (1 to 65535)"),
    ("postgresql://u@127.0.0.1:70000/db", "port '70000' is not a port number"),
    ("host=a,b port=5432,x", "port 'x' is not a port number"),
    ("host=h connect_timeout=soon", "connect_timeout='soon' is not a whole number of at least 0"),
    ("host=h target_session_attrs=primary-ish", "target_session_attrs='primary-ish' is not one of"),
    ("host=h gssencmode=maybe", "gssencmode='maybe' is not one of disable, prefer, require"),
    ("host=h nosuch=1", 'invalid connection option (a part of it, not shown)'),
    ("postgresql://u@[::1/db", "is not a valid connection string"),
])
def test_a_malformed_dsn_keyword_is_refused_at_load(dsn, says):
    message, error = _error({}, {"CDC_POSTGRES_DSN": dsn})
    assert message.startswith("postgres.dsn (from env CDC_POSTGRES_DSN)") and says in message and error.exit_code == 2, message


@pytest.mark.parametrize("url, says", [
    ("redis://127.0.0.1:port/0", "is not a valid URL"),
    ("redis://127.0.0.1:99999/0", "is not a valid URL"),
    ("redis://127.0.0.1:6379/zero", "database 'zero' is not a number"),
    ("redis://127.0.0.1:6379/0?ssl_cert_reqs=bogus", "ssl_cert_reqs='bogus' is not one of none, optional, required"),
    ("redis://127.0.0.1:6379/0?socket_timeout=soon", "Invalid value for (a part of it, not shown)"),
    ("http://127.0.0.1:6379/0", "has scheme 'http://'"),
    ("redis:///0", "names no host"),
])
def test_a_malformed_redis_url_is_refused_at_load(url, says):
    message, error = _error({}, {"CDC_REDIS_URL": url})
    assert message.startswith("redis.url (from env CDC_REDIS_URL)") and says in message and error.exit_code == 2, message


def test_the_configuration_table_is_the_code():
    page = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    rows = {m[1]: (m[2], m[3], m[4] or "") for m in re.finditer(
        r"^- \*\*`([a-z_]+\.[a-z_]+)`\*\* \((\w+), default `([^`]*)`, (?:(.*), )?`CDC_[A-Z_]+`\): ", page, re.M)}
    expected = {}
    for name, cls in config._SECTIONS.items():
        for f in dataclasses.fields(cls):
            limits = RANGES.get((name, f.name))
            choices = config._CHOICES.get((name, f.name))
            form = config._FORMS.get((name, f.name))
            shown = str(limits) if limits else ", ".join(choices) if choices else form[1] if form else ""
            expected[f"{name}.{f.name}"] = (type(f.default).__name__, _yaml(f.default), shown)
    assert rows == expected


def _yaml(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def test_an_error_is_reported_as_one_line_with_exit_2(capsys):
    _, error = _error({"trim": {"max_len": -1}})
    assert report(error) == 2
    assert capsys.readouterr().err == ("cdc: error: <unknown>: trim.max_len must be from 0 to 9223372036854775807, "
                                       "got -1; the default is 0; see docs/reference/configuration.md\n")


def test_a_transactions_stream_that_is_no_plain_key_is_refused_with_its_line(tmp_path):
    cfg = tmp_path / "cdc.yaml"
    for value, says in (("'cdc: tx'", "transactions.stream must be empty, or a Redis key"), ("[a]", "must be a string")):
        cfg.write_text(f"postgres: {{dsn: 'postgresql://x@h/db'}}\nredis: {{url: 'redis://h:6379/0'}}\n"
                       f"transactions:\n  stream: {value}\n")
        with pytest.raises(ConfigError) as caught:
            Settings.from_file(cfg)
        assert str(caught.value).startswith(f"{cfg}:4: transactions.stream") and says in str(caught.value), caught.value
    cfg.write_text("transactions: {stream: 'cdc:transactions'}\n")
    assert Settings.from_file(cfg).transactions.stream == "cdc:transactions"
