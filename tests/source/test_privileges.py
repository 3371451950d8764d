"""The fix for a refused privilege, from the server's message (pure)."""

from __future__ import annotations

import pytest

from cdc.source.privileges import fix_for

pytestmark = pytest.mark.one_path


@pytest.mark.parametrize("message, need, fix", [
    ('permission denied for table rides', "SELECT", "run: GRANT SELECT ON TABLE rides TO cdc_bridge"),
    ('permission denied for table cdc_backfills', "INSERT",
     "run: GRANT SELECT, INSERT, UPDATE ON public.cdc_backfills TO cdc_bridge; "
     "GRANT USAGE ON SEQUENCE public.cdc_backfills_id_seq TO cdc_bridge"),
    ('permission denied for sequence cdc_backfills_id_seq', "INSERT",
     "run: GRANT SELECT, INSERT, UPDATE ON public.cdc_backfills TO cdc_bridge; "
     "GRANT USAGE ON SEQUENCE public.cdc_backfills_id_seq TO cdc_bridge"),
    ('permission denied for sequence other_seq', "SELECT", "run: GRANT USAGE ON SEQUENCE other_seq TO cdc_bridge"),
    ('permission denied for schema app', "SELECT", "run: GRANT USAGE ON SCHEMA app TO cdc_bridge"),
    ('permission denied for schema public', "CREATE", "run: GRANT CREATE ON SCHEMA public TO cdc_bridge"),
    ('permission denied for database app', "SELECT", "run: GRANT CREATE ON DATABASE app TO cdc_bridge"),
    ('permission denied for function pg_logical_emit_message', "SELECT",
     "run: GRANT EXECUTE ON FUNCTION pg_logical_emit_message TO cdc_bridge"),
    ('must be superuser or replication role to use replication slots', "SELECT", "run: ALTER ROLE cdc_bridge REPLICATION"),
    ('something else entirely', "SELECT", "grant cdc_bridge what cdc sql --role cdc_bridge prints"),
])
def test_the_fix_is_the_exact_statement(message, need, fix):
    assert fix_for(message, "cdc_bridge", need) == fix


def test_ownership_says_who_runs_init():
    fix = fix_for("must be owner of publication cdc", "cdc_bridge")
    assert fix.startswith("run cdc init as the owner of publication cdc and of the mapped tables")
    assert "cdc_bridge runs cdc run" in fix


def test_an_unknown_role_is_a_placeholder():
    assert fix_for("permission denied for table rides", "") == "run: GRANT SELECT ON TABLE rides TO <role>"
