"""SQL an operator writes stays data: `cdc backfill --where` is one condition on the mapped table's
columns, parsed into an allowlisted grammar and composed back with every name quoted; everything
else is refused (exit 2, the token's position) before anything runs, as the table's owner and as
cdc_bridge, and nothing happens on the server: the secret table is still there, no backfill is
queued and no logical message reaches the slot. The accepted forms still backfill the right rows.
A reconcile `source.query` (tests/reconcile/test_reconcile_preflight.py runs it live) is checked
here without a server."""

from __future__ import annotations

import signal

import pytest

from cdc.demo.local import wait_for
from cdc.operator_sql import SqlRefused, check_select, parse_where

from conftest import SQL, read_stream

PASSWORD = "Op-s3cret-5521"
COLUMNS = ["id", "rider_id", "distance_m", "status", "created_at", "internal_note"]
RIDE = "entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id, distance: distance_m, rider: rider_id}\n"

#: (the --where, what the refusal says, the character it points at)
REFUSED = [
    ("1=1; DROP TABLE public.secret_tbl", "a statement separator ';'", 4),
    ("(SELECT pg_logical_emit_message(true,'ride_events','{}')) IS NOT NULL", "a subquery", 2),
    ("id IN (SELECT id FROM public.secret_tbl)", "a subquery", 8),
    ("EXISTS (SELECT 1 FROM public.secret_tbl)", "function 'exists' is not allowed", 1),
    ("id > 0) OR (1=1", "unexpected ')' after the condition", 7),
    ("id > 0 -- ignore the rest", "a comment", 8),
    ("id > 0 /* */ OR true", "a comment", 8),
    ("id > $$0$$", "a dollar quote or parameter", 6),
    ("id > $1", "a dollar quote or parameter", 6),
    ("status = $q$done$q$", "a dollar quote or parameter", 10),
    ('U&"\\0069d" > 0', "a unicode escape", 1),
    ("status = U&'d\\006Fne'", "a unicode escape", 10),
    ("status = E'done\\''", "an escape, bit or national string", 10),
    ("pg_logical_emit_message(true, 'ride_events', '{}') IS NOT NULL", "function 'pg_logical_emit_message' is not allowed", 1),
    ("pg_catalog.pg_logical_emit_message(true, 'x', 'y') IS NULL", "function 'pg_logical_emit_message' is not allowed", 12),
    ('"pg_logical_emit_message"(true, \'x\', \'y\') IS NULL', "function 'pg_logical_emit_message' is not allowed", 1),
    ("setval('rides_id_seq', 1) > 0", "function 'setval' is not allowed", 1),
    ("nextval('rides_id_seq') > 0", "function 'nextval' is not allowed", 1),
    ("lo_import('/etc/passwd') > 0", "function 'lo_import' is not allowed", 1),
    ("dblink_exec('dbname=x', 'DROP TABLE t') IS NULL", "function 'dblink_exec' is not allowed", 1),
    ("pg_sleep(5) IS NULL", "function 'pg_sleep' is not allowed", 1),
    ("set_config('role', 'postgres', false) IS NULL", "function 'set_config' is not allowed", 1),
    ("secret_tbl.id > 0", "a qualified name", 1),
    ("secret > 0", "'secret' is not a column of public.rides", 1),
    ("id::regclass IS NULL", "type 'regclass' is not one a condition may cast to", 5),
    ("status = 'done'' OR 1=1", "an unterminated quote", 10),
    ("", "the condition is empty", 1),
    ("id >", "the condition ends too early", 5),
]
ACCEPTED = [
    ("id <= 3", [1, 2, 3]),
    ("id IN (2, 4) OR distance_m BETWEEN 5 AND 5.5 OR (id % 100 = 11)", [2, 4, 5]),
    ("NOT (id > 2) AND internal_note IS NULL", [1, 2]),
    ("lower(status) LIKE 'don%' AND id::text = '6'", [6]),
    ("coalesce(internal_note, 'x') = 'n' AND created_at > now() - interval '1 day' AND id BETWEEN 7 AND 8", [7, 8]),
    ("\"id\" = 9 OR status ILIKE 'OPEN'", [9, 10]),
    ("distance_m::numeric(12,1) = 1.0 OR CAST(id AS bigint) = -(-3)", [1, 3]),
]


@pytest.mark.parametrize(("where", "reason", "at"), REFUSED)
def test_a_condition_outside_the_grammar_is_refused_with_its_position(where, reason, at):
    with pytest.raises(SqlRefused) as refused:
        parse_where(where, COLUMNS, "public.rides")
    message = str(refused.value)
    assert message.startswith("--where on public.rides: ") and reason in message, message
    assert f"at character {at} " in message, message
    assert "GRANT" not in message + refused.value.hint


def test_what_runs_is_composed_from_the_parse_every_name_quoted():
    condition = parse_where("lower(status) = 'it''s' AND (id IN (1, 2) OR NOT distance_m % 2 > -1.5) "
                            "AND created_at > date '2026-01-01'", COLUMNS, "t")
    assert condition.sql.as_string(None) == (
        "((pg_catalog.\"lower\"(\"status\") = %s) AND ((\"id\" IN (1, 2)) OR (NOT (pg_catalog.mod(\"distance_m\", 2) > (-1.5))))"
        " AND (\"created_at\" > CAST(%s AS date)))"
    )
    assert condition.params == ("it's", "2026-01-01")
    assert condition.columns == {"status", "id", "distance_m", "created_at"}


SELECT_REFUSED = [
    ("SELECT id FROM public.rides) AS q; CREATE TABLE public.pwned (x int); SELECT (1", "a statement separator ';'"),
    ("SELECT id FROM public.rides) AS q, (SELECT 1", "a ')' closing more than the query opened"),
    ("SELECT id FROM public.rides WHERE (id > 0", "an unclosed '('"),
    ("SELECT id FROM public.rides -- x", "a comment"),
    ("SELECT $$x$$ AS id", "a dollar quote or parameter"),
    ('SELECT U&"\\0069d" FROM public.rides', "a unicode escape"),
    ("SELECT * INTO public.copy FROM public.rides", "INTO has no place in a read-only query"),
    ("SELECT * FROM public.rides FOR UPDATE", "a row lock"),
    ("SELECT * FROM public.rides FOR NO KEY UPDATE", "a row lock"),
    ("WITH gone AS (DELETE FROM public.rides RETURNING *) SELECT * FROM gone", "DELETE has no place"),
    ("DROP TABLE public.rides", "the query must start with SELECT"),
]


@pytest.mark.parametrize(("query", "reason"), SELECT_REFUSED)
def test_a_reconcile_query_that_is_not_one_contained_select_is_refused(query, reason):
    with pytest.raises(SqlRefused) as refused:
        check_select(query)
    assert reason in str(refused.value) and "at character" in str(refused.value), str(refused.value)


def test_a_reconcile_query_lists_what_it_calls():
    check = check_select("SELECT rider_id, sum(distance_m) AS d FROM public.rides r WHERE data ->> 'k' ~ 'x' "
                         "AND \"pg_logical_emit_message\"(true, 'a', 'b') IS NOT NULL GROUP BY rider_id")
    assert check.functions == {"sum", "pg_logical_emit_message", "rides"}  # a name after a dot may be a function
    assert check_select("SELECT r.id, r.some_function FROM rides r").functions == {"id", "some_function"}
    assert check.operators == {"->>", "~", "="} - {"="}


# -- against the server, as the owner and as cdc_bridge ---------------------------------------------

def _setup(env, tmp_path) -> dict[str, dict]:
    """The rides tables and a secret table; the environments of the owner and of cdc_bridge."""
    for path in sorted(SQL.glob("*.sql")):
        env.execute(path.read_text())
    env.execute(f"ALTER ROLE cdc_bridge PASSWORD '{PASSWORD}'")
    env.execute("CREATE TABLE public.secret_tbl (id int, secret text)")
    env.execute("INSERT INTO public.secret_tbl VALUES (1, 'hidden')")
    env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'a', 'e')")
    env.execute("INSERT INTO rides (id, rider_id, distance_m, status, internal_note) "
                "SELECT g, 1, g, CASE WHEN g = 10 THEN 'open' ELSE 'done' END, CASE WHEN g > 2 THEN 'n' END "
                "FROM generate_series(1, 10) g")
    env.write_mapping("ride.yaml", RIDE)
    env.write_config("batch: {backfill_chunk_rows: 2}\n")
    env.cdc("init", check=True)
    secret = tmp_path / "bridge_dsn"
    secret.write_text(f"postgresql://cdc_bridge:{PASSWORD}@127.0.0.1:{env.postgres.port}/{env.dbname}\n")
    return {"owner": {}, "cdc_bridge": {"CDC_POSTGRES_DSN_FILE": str(secret)}}


def _messages_in_slot(env) -> list[bytes]:
    """The logical messages (pgoutput 'M') waiting in the slot, read without consuming them."""
    rows = env.execute(
        "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1', "
        "'publication_names', %s, 'messages', 'true')", (env.slot, env.publication))
    return [bytes(data) for (data,) in rows if bytes(data)[:1] == b"M"]


@pytest.mark.integration
@pytest.mark.parametrize("role", ["owner", "cdc_bridge"])
def test_refused_conditions_do_nothing_on_the_server(env, tmp_path, role):
    envs = _setup(env, tmp_path)
    before = _messages_in_slot(env)
    for where, reason, at in REFUSED:
        result = env.cdc("backfill", "--entity", "ride", "--where", where, env=envs[role])
        assert result.returncode == 2, (where, result.stderr)
        assert result.stderr.startswith("cdc: error: --where on public.rides: ") and result.stderr.count("\n") == 1, result.stderr
        assert reason in result.stderr and f"at character {at} " in result.stderr, result.stderr
        assert "GRANT" not in result.stderr and "owner" not in result.stderr and "Traceback" not in result.stderr
    assert env.execute("SELECT secret FROM public.secret_tbl") == [("hidden",)]
    assert env.execute("SELECT count(*) FROM cdc_backfills WHERE where_sql IS NOT NULL") == [(0,)]
    assert _messages_in_slot(env) == before, "no logical message was emitted"
    assert not any(b"ride_events" in m for m in _messages_in_slot(env))


@pytest.mark.integration
def test_a_type_error_is_a_usage_error_and_runs_nothing(env, tmp_path):
    envs = _setup(env, tmp_path)
    result = env.cdc("backfill", "--entity", "ride", "--where", "id = 'x'", env=envs["cdc_bridge"])
    assert result.returncode == 2 and "invalid input syntax for type bigint" in result.stderr, result.stderr
    assert env.execute("SELECT count(*) FROM cdc_backfills WHERE where_sql IS NOT NULL") == [(0,)]


@pytest.mark.integration
@pytest.mark.slow
def test_accepted_conditions_backfill_exactly_their_rows_as_cdc_bridge(env, tmp_path):
    envs = _setup(env, tmp_path)
    for where, _ in ACCEPTED:  # queued before the bridge starts: it takes them in order
        result = env.cdc("backfill", "--entity", "ride", "--where", where, env=envs["cdc_bridge"])
        assert result.returncode == 0, (where, result.stderr)
    # a row written straight into cdc_backfills is parsed again by the bridge: refused, cancelled, never run
    env.execute("INSERT INTO cdc_backfills (slot, entity, where_sql) VALUES (%s, 'ride', %s)",
                (env.slot, "(SELECT pg_logical_emit_message(true, 'ride_events', '{}')) IS NOT NULL"))
    bridge = env.start_bridge(env=envs["cdc_bridge"])
    wait_for(lambda: env.execute("SELECT count(*) FROM cdc_backfills WHERE status IN ('pending', 'running')") == [(0,)],
             60, "every backfill to finish")
    statuses = env.execute("SELECT status, rows_done, rows_total FROM cdc_backfills ORDER BY id")
    assert statuses == [("done", len(ids), len(ids)) for _, ids in ACCEPTED] + [("cancelled", 0, None)]
    expected = [i for _, ids in ACCEPTED for i in ids]
    wait_for(lambda: env.redis.xlen("cdc:ride") >= len(expected), 30, "every backfilled row in the stream")
    bridge.send_signal(signal.SIGTERM)
    assert bridge.wait(30) == 0
    reads = [e["key"]["id"] for e in read_stream(env.redis, "cdc:ride") if e["op"] == "r"]
    assert reads == expected
    # the condition is recorded as written and evaluated by the bridge only
    assert [r[0] for r in env.execute("SELECT where_sql FROM cdc_backfills ORDER BY id")][:-1] == [w for w, _ in ACCEPTED]
    assert "a subquery at character 2" in bridge.log_path.read_text()
    assert not any(b"ride_events" in m for m in _messages_in_slot(env))
