"""`cdc sql`: the least-privilege SQL for the config's mappings, and the packaged SQL files, printed from the
package (no checkout needed: tests/test_install.py runs it from an installed wheel). tests/ops/test_least_privilege.py
applies its output and runs the bridge as the role it grants to."""

from __future__ import annotations

import pytest

from cdc import cli
from cdc.ops.grants import SQL_DIR, least_privilege, packaged_names

from conftest import ROOT

RIDE = "entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id}\n"
ODD = "entity: odd\ntable: 'Sales.Order Lines'\nkey: [id]\nfields: {id: id}\n"
MESSAGES = "entity: ride_event\nmessage_prefix: ride_events\n"


def _config(tmp_path, **mappings: str):
    (tmp_path / "mappings").mkdir()
    for name, text in mappings.items():
        (tmp_path / "mappings" / f"{name}.yaml").write_text(text)
    config = tmp_path / "cdc.yaml"
    config.write_text("postgres: {dsn: 'postgresql://postgres@127.0.0.1:5432/app'}\nredis: {url: 'redis://127.0.0.1:6379/0'}\n"
                      "mappings: mappings/\n")
    return config


def test_the_grants_name_the_mapped_tables_and_the_role_given(tmp_path, capsys):
    config = _config(tmp_path, ride=RIDE, events=MESSAGES)
    assert cli.main(["sql", "--config", str(config), "--role", "bridge_a"]) == 0
    out = capsys.readouterr().out
    assert "CREATE ROLE bridge_a WITH LOGIN REPLICATION;" in out
    assert "GRANT SELECT ON public.rides TO bridge_a;" in out
    assert "CREATE TABLE IF NOT EXISTS public.cdc_backfills" in out  # the bookkeeping the grants below need
    assert "GRANT SELECT, INSERT, UPDATE ON public.cdc_backfills TO bridge_a;" in out
    assert "cdc_bridge" not in out and "riders" not in out and "rockets" not in out  # nothing of the demo's


def test_odd_names_are_quoted(tmp_path, capsys):
    assert cli.main(["sql", "--config", str(_config(tmp_path, odd=ODD)), "--role", 'Odd "Role']) == 0
    out = capsys.readouterr().out
    assert 'GRANT SELECT ON "Sales"."Order Lines" TO "Odd ""Role";' in out
    assert 'GRANT USAGE ON SCHEMA "Sales" TO "Odd ""Role";' in out
    assert "WHERE rolname = 'Odd \"Role'" in out


@pytest.mark.parametrize("role", ["", "x" * 64, "two\nlines"])
def test_a_role_postgres_would_refuse_or_that_breaks_a_comment_is_refused(tmp_path, capsys, role):
    assert cli.main(["sql", "--config", str(_config(tmp_path, ride=RIDE)), "--role", role]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cdc: error: --role: ") and err.count("\n") == 1


def test_file_prints_a_packaged_file_as_it_is(capsys):
    assert packaged_names() == ["00_roles.sql", "10_rocket_rides.sql", "20_consumer_state.sql", "25_backfills.sql", "30_grants.sql"]
    for name in packaged_names():
        assert cli.main(["sql", "--file", name, "--config", "/nonexistent/cdc.yaml"]) == 0  # no config read
        assert capsys.readouterr().out == (SQL_DIR / name).read_text()
    assert cli.main(["sql", "--file", "nosuch.sql"]) == 2
    assert "invalid choice: 'nosuch.sql'" in capsys.readouterr().err


def test_the_checkout_paths_are_the_packaged_files():
    """sql/, mappings/ and reconcile/ at the top of a checkout (named by the docs and deploy/) are the package's."""
    assert (ROOT / "sql").resolve() == SQL_DIR
    assert (ROOT / "mappings").resolve() == ROOT / "cdc" / "demo" / "mappings"
    assert (ROOT / "reconcile").resolve() == ROOT / "cdc" / "demo" / "reconcile"


def test_the_demo_grants_are_what_cdc_sql_writes_for_the_demo_tables():
    """30_grants.sql (the demo's, and the compose file's) says what `cdc sql` says for the demo's three tables."""
    written = least_privilege([("public", "riders"), ("public", "rides"), ("public", "rockets")])
    for line in (SQL_DIR / "30_grants.sql").read_text().splitlines():
        if line.startswith("GRANT") and "cdc_reconcile_runs" not in line:
            assert line in written, line
