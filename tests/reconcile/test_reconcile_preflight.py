"""What `cdc reconcile` checks before Spark starts, and a consumer that never consumed."""

from __future__ import annotations

import os
import time
from decimal import Decimal

import pytest

from cdc.demo.rocketrides import ride_totals
from cdc.reconcile.job import describe
from cdc.reconcile.reset import reset_consumer
from cdc.reconcile.spec import load_specs

from test_reconcile import setup, spec_yaml

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("change, line, message", [
    ("sum(distance_m)", "sum(distance_mm)", "6: the source (public.rides) has no column 'distance_mm'"),
    ("[rider_id]\n  overall: {rider_id: 0}", "[rider]\n  overall: {rider: 0}", "4: the source (public.rides) has no column 'rider'"),
    ("partition_column: id,", "partition_column: ride_id,", "2: the source (public.rides) has no column 'ride_id'"),
    ("table: public.rides,", "table: public.ridez,", "2: source.table public.ridez does not exist in the source database"),
    ("{total_distance: sum", "{total: sum", "8: consumer ride-totals's state table consumer_states has no column total"),
])
def test_unknown_tables_and_columns_are_named_with_the_spec_line_before_spark_starts(env, change, line, message):
    setup(env, "ride-totals")
    spec = env.tmp / "reconcile" / "totals.yaml"
    text = spec.read_text()
    assert change in text
    spec.write_text(text.replace(change, line))
    started = time.monotonic()
    result = env.cdc("reconcile", "--dry-run")
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"cdc: error: {spec}:{message}"), result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "starting Spark" not in result.stderr and elapsed < 15  # Spark alone takes ~5-20 s to start


def test_a_query_source_is_checked_before_spark_starts(env):
    setup(env, "ride-totals")
    spec = env.tmp / "reconcile" / "totals.yaml"
    spec.write_text(spec_yaml("ride-totals").replace(
        "table: public.rides,", 'query: "SELECT id, rider_id, distance_m FROM rides WHERE status = \'done\' AND",'))
    result = env.cdc("reconcile", "--dry-run")
    assert result.returncode == 2 and result.stderr.startswith(f"cdc: error: {spec}:2: source.query: syntax error")
    spec.write_text(spec_yaml("ride-totals").replace(
        "table: public.rides,", 'query: "SELECT id, rider_id FROM rides",'))
    result = env.cdc("reconcile", "--dry-run")
    assert result.returncode == 2
    assert result.stderr.startswith(f"cdc: error: {spec}:6: the source (source.query) has no column 'distance_m'")
    assert "its columns: id, rider_id" in result.stderr and "starting Spark" not in result.stderr


def test_a_consumer_that_never_consumed_is_reported_as_such_not_as_drift(env):
    setup(env, "ride-totals")
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 20, g FROM generate_series(1, 600) g")
    env.cdc("run", "--until-caught-up", check=True)
    [spec] = load_specs(env.tmp / "reconcile")
    position = env.current_wal()
    truth_at = {(r,): (Decimal(t),) for r, t in env.execute("SELECT rider_id, sum(distance_m) FROM rides GROUP BY 1")}
    with env.connect() as conn:
        outcome = reset_consumer(conn, env.redis, spec, spec.consumers[0], ["cdc:ride"], position,
                                 {"cdc:ride": "0-0"}, truth_at, ride_totals)
    assert outcome.status == "never" and not outcome.unrepaired
    assert outcome.drift.keys_compared == 0 and outcome.drift.clean
    text = describe(outcome)
    assert text.startswith("never consumed: no checkpoint in cdc_checkpoints and no state in consumer_states")
    assert "cdc consume --group ride-totals" in text and "drifted" not in text
    assert env.execute("SELECT count(*) FROM consumer_states")[0][0] == 0, "nothing written"
    # a consumer with state but no checkpoint is not 'never consumed': that is drift to report
    env.execute("INSERT INTO consumer_states VALUES ('ride-totals', 0, 42)")
    with env.connect() as conn:
        outcome = reset_consumer(conn, env.redis, spec, spec.consumers[0], ["cdc:ride"], position,
                                 {"cdc:ride": "0-0"}, truth_at, ride_totals, dry_run=True)
    assert outcome.status == "drift"


def test_a_missing_pyspark_names_the_make_target_that_installs_it(env, tmp_path):
    setup(env, "ride-totals")
    env.cdc("run", "--until-caught-up", check=True)
    fake = tmp_path / "no-pyspark" / "pyspark"  # shadows the installed pyspark: importing it fails
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named pyspark')\n")
    path = os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")]))
    result = env.cdc("reconcile", "--dry-run", env={"PYTHONPATH": path})
    error = result.stderr.splitlines()[-1]  # after the progress line "starting Spark"
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert error.startswith("cdc: error: pyspark is not installed; run: make reconcile-deps"), result.stderr
    assert "make install" not in result.stderr


#: (source.query, what the refusal says): each refused before anything runs on the server
HOSTILE_QUERIES = [
    ("SELECT id, rider_id, distance_m FROM rides) AS q; CREATE TABLE public.pwned (x int); SELECT (1",
     "a statement separator ';' at character"),
    ("SELECT id, rider_id, distance_m FROM rides) AS q, (SELECT 1", "a ')' closing more than the query opened"),
    ("SELECT id, rider_id, distance_m FROM rides -- ) AS q", "a comment at character"),
    ("SELECT id, rider_id, distance_m FROM rides /* */", "a comment at character"),
    ("SELECT id, rider_id, distance_m FROM rides WHERE status = $$done$$", "a dollar quote or parameter"),
    ('SELECT U&"\\0069d", rider_id, distance_m FROM rides', "a unicode escape"),
    ("SELECT id, rider_id, distance_m INTO public.pwned FROM rides", "INTO has no place in a read-only query"),
    ("SELECT id, rider_id, distance_m FROM rides FOR UPDATE", "a row lock (FOR UPDATE/SHARE)"),
    ("WITH gone AS (DELETE FROM rides RETURNING *) SELECT id, rider_id, distance_m FROM gone", "DELETE has no place"),
    ("SELECT id, rider_id, distance_m FROM rides WHERE pg_logical_emit_message(true, 'ride_events', '{}') IS NOT NULL",
     "source.query calls pg_logical_emit_message, which may change the database"),
    ("SELECT id, rider_id, distance_m FROM rides WHERE setval('rides_id_seq', 1) > 0", "source.query calls setval"),
    ("SELECT nextval('rides_id_seq') AS id, rider_id, distance_m FROM rides", "source.query calls nextval"),
    ("SELECT id, rider_id, distance_m FROM rides WHERE pg_sleep(5) IS NOT NULL", "source.query calls pg_sleep"),
    ("SELECT id, rider_id, distance_m, set_config('default_transaction_read_only', 'off', false) FROM rides",
     "source.query calls set_config"),
    ("SELECT id, rider_id, distance_m FROM rides WHERE lo_import('/etc/hostname') > 0", "source.query calls lo_import"),
    ('SELECT id, rider_id, distance_m FROM rides WHERE "pg_logical_emit_message"(true, \'x\', \'y\') IS NULL',
     "source.query calls pg_logical_emit_message"),
]


def test_a_hostile_query_is_refused_before_anything_runs(env):
    import json

    setup(env, "ride-totals")
    env.execute("CREATE TABLE public.secret_tbl (id int)")
    sequence = env.execute("SELECT last_value, is_called FROM rides_id_seq")
    messages = _messages_in_slot(env)
    spec = env.tmp / "reconcile" / "totals.yaml"
    for query, message in HOSTILE_QUERIES:
        spec.write_text(spec_yaml("ride-totals").replace("table: public.rides,", f"query: {json.dumps(query)},"))
        started = time.monotonic()
        result = env.cdc("reconcile", "--dry-run")
        assert result.returncode == 2, (query, result.stderr)
        assert result.stderr.startswith(f"cdc: error: {spec}:2: "), result.stderr
        assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr
        assert "GRANT" not in result.stderr and "starting Spark" not in result.stderr
        assert time.monotonic() - started < 15
    assert env.execute("SELECT to_regclass('public.pwned'), to_regclass('public.secret_tbl')") == [(None, "secret_tbl")]
    assert env.execute("SELECT last_value, is_called FROM rides_id_seq") == sequence
    assert env.execute("SELECT count(*) FROM pg_largeobject_metadata") == [(0,)]
    assert _messages_in_slot(env) == messages, "no logical message was emitted"


def _messages_in_slot(env) -> list[bytes]:
    rows = env.execute("SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1', "
                       "'publication_names', %s, 'messages', 'true')", (env.slot, env.publication))
    return [bytes(d) for (d,) in rows if bytes(d)[:1] == b"M"]


def test_an_accepted_query_passes_and_is_read_in_read_only_transactions(env):
    from pathlib import Path

    from cdc.config import Settings
    from cdc.mapping.model import load_mappings
    from cdc.reconcile.exported_snapshot import session_init_statement
    from cdc.reconcile.job import preflight

    assert session_init_statement("s").startswith("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY;")
    setup(env, "ride-totals")
    spec = env.tmp / "reconcile" / "totals.yaml"
    spec.write_text(spec_yaml("ride-totals").replace(
        "table: public.rides,", "query: \"SELECT id, rider_id, distance_m FROM rides WHERE lower(status) = 'done' "
                                "AND (id > 0 OR id IN (SELECT 1)) AND created_at < now()\","))
    settings = Settings.from_file(env.config_path)
    [loaded] = load_specs(Path(settings.reconcile.specs))
    assert preflight(settings, load_mappings(settings.mappings), loaded)
