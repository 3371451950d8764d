"""The stream entry contract for varied column types, TOAST, filters, partitions."""

from __future__ import annotations

import base64
import dataclasses
import importlib
import zlib

import orjson
import pytest

from cdc.mapping.model import load_mappings
from cdc.mapping.projector import Projector
from cdc.source.catalog import load_types, table_shape
from cdc.source.values import TypeCatalog
from conftest import ROOT, TEST_HASH_KEY, read_stream

pytestmark = pytest.mark.integration

ROCKET_ID = "6f1c2a7e-0000-4000-8000-000000000001"
INSERT_ROCKET = """
INSERT INTO rockets (id, name, class, dry_mass, thrust_kn, stages, launched_on, launch_window, burn_time,
                     countdown_at, built_at, updated_at, reusable, specs, tags, payload_kg, checksum, manual, owner_email)
VALUES (%s, 'Falcon 9', 'orbital', 22200.5, %s, 2, '2026-11-21',
        tstzrange('2026-11-21 10:00+00', '2026-11-21 12:00+00'), '2 minutes 42.5 seconds', '12:30:01.25',
        '2026-01-02 03:04:05.678', '2026-11-21 10:15:00.5+01', true,
        '{"engines": 9, "isp": 282.123456789012345678, "fuel": ["RP-1", "LOX"]}',
        ARRAY['crewed', 'quote"d', NULL, 'comma,tag', 'NULL'], ARRAY[1.5, NULL, 22800]::numeric[],
        %s, %s, 'owner@example.com')
"""


def partition_of(key_values: list, count: int) -> int:
    return zlib.crc32(orjson.dumps(key_values)) % count


@pytest.fixture
def rockets(env):
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("rocket.yaml")
    env.cdc("init", check=True)
    return env


def rocket_entries(env) -> list[dict]:
    entries = read_stream(env.redis, "cdc:rocket:p0") + read_stream(env.redis, "cdc:rocket:p1")
    return sorted(entries, key=lambda e: (int(e["lsn"]), int(e["seq"])))


def test_varied_types_follow_the_contract(rockets):
    manual = "x" * 300_000  # stored out of line (TOAST)
    rockets.execute(INSERT_ROCKET, (ROCKET_ID, float("nan"), bytes(range(256)), manual))
    rockets.execute(INSERT_ROCKET.replace("'Falcon 9'", "'test-article'"), ("6f1c2a7e-0000-4000-8000-000000000002", 1.0, b"", "m"))
    rockets.cdc("run", "--until-caught-up", check=True)

    entries = rocket_entries(rockets)
    assert len(entries) == 1, "the filter drops the test article"
    entry = entries[0]
    stream_of = {e["_id"]: s for s in ("cdc:rocket:p0", "cdc:rocket:p1") for e in read_stream(rockets.redis, s)}
    assert stream_of[entry["_id"]] == f"cdc:rocket:p{partition_of([ROCKET_ID], 2)}"
    assert entry["v"] == "2" and entry["op"] == "c" and entry["key"] == {"id": ROCKET_ID}
    data = entry["data"]
    assert data["id"] == ROCKET_ID
    assert data["class"] == "orbital"                      # enum by its label
    assert data["dry_mass"] == "22200.5"                   # domain over numeric: exact string
    assert data["thrust_kn"] == "NaN" and data["thrust"] == "NaN"
    assert data["stages"] == 2
    assert data["launched_on"] == "2026-11-21"
    assert data["launch_window"] == '["2026-11-21 10:00:00+00","2026-11-21 12:00:00+00")'  # unknown to JSON: its text
    assert data["burn_time"] == "PT2M42.5S"
    assert data["countdown_at"] == "12:30:01.25"
    assert data["built_at"] == "2026-01-02T03:04:05.678"
    assert data["updated_at"] == "2026-11-21T09:15:00.5Z"  # timestamptz in UTC
    assert data["updated_ms"] == 1795252500500
    assert data["reusable"] is True
    assert data["specs"] == {"engines": 9, "isp": 282.123456789012345678, "fuel": ["RP-1", "LOX"]}
    raw_data = rockets.redis.xrange(stream_of[entry["_id"]])[0][1][b"data"]
    assert b'"isp": 282.123456789012345678' in raw_data   # json embedded exactly, digits kept
    assert data["tags"] == ["crewed", 'quote"d', None, "comma,tag", "NULL"]
    assert data["payload_kg"] == ["1.5", None, "22800"]
    assert base64.b64decode(data["checksum"]) == bytes(range(256))
    assert data["manual"] == manual
    assert data["source"] == "rocket-rides"
    assert "owner_email" not in data and "owner@example.com" not in raw_data.decode()


def test_unchanged_toast_uses_before_image_or_is_listed_as_unchanged(rockets):
    manual = "y" * 300_000
    rockets.execute(INSERT_ROCKET, (ROCKET_ID, 1.0, b"\x00", manual))
    # rockets has REPLICA IDENTITY FULL: the before-image supplies the unchanged value
    rockets.execute("UPDATE rockets SET stages = 3 WHERE id = %s", (ROCKET_ID,))
    rockets.execute("DELETE FROM rockets WHERE id = %s", (ROCKET_ID,))
    # a table with the default identity: the value is not available, so it is omitted and listed
    rockets.execute("CREATE TABLE notes (id int PRIMARY KEY, title text, body text)")
    rockets.execute("ALTER TABLE notes ALTER COLUMN body SET STORAGE EXTERNAL")
    rockets.write_mapping("note.yaml", "entity: note\ntable: public.notes\nkey: [id]\nfields: {id: id, title: title, body: body}\n")
    rockets.cdc("init", check=True)
    body = "".join(chr(65 + i % 26) for i in range(100_000))
    rockets.execute("INSERT INTO notes VALUES (1, 'first', %s)", (body,))
    rockets.execute("UPDATE notes SET title = 'second' WHERE id = 1")
    rockets.cdc("run", "--until-caught-up", check=True)

    create, update, delete = rocket_entries(rockets)
    assert update["op"] == "u" and update["data"]["stages"] == 3
    assert update["data"]["manual"] == manual
    assert "unchanged" not in update
    assert update["before"]["stages"] == 2
    assert delete["op"] == "d" and "data" not in delete and delete["before"]["manual"] == manual

    notes = read_stream(rockets.redis, "cdc:note")
    assert [n["op"] for n in notes] == ["c", "u"]
    assert notes[0]["data"]["body"] == body
    assert notes[1]["data"] == {"id": 1, "title": "second"}
    assert notes[1]["unchanged"] == ["body"]
    assert "before" not in notes[1]


def test_the_compiled_path_takes_every_mapping_of_the_mappings_folder(env):
    """The compiled module writes the changes of each shipped mapping (rocket's types, casts, constants,
    partitions and before-image included) itself, reading only `Projector.plan`: a renamed plan attribute
    or a newly refused form would otherwise send every change down the reference path unnoticed."""
    try:
        compiled = importlib.import_module("cdc.bridge._changes")
    except ImportError as exc:
        pytest.skip(f"the compiled hot path is not built ({exc})")
    env.apply_sql("10_rocket_rides.sql")
    catalog, seen = TypeCatalog(), set()
    with env.connect() as conn:
        for mapping in load_mappings(ROOT / "mappings", hash_key=TEST_HASH_KEY.encode()):
            if mapping.table is None:
                continue  # a logical-message outbox: no row changes
            shape = table_shape(conn, *mapping.table)
            load_types(conn, catalog, [c.type_oid for c in shape.columns])
            unfiltered = dataclasses.replace(mapping, filter=())
            assert compiled.refusal(Projector(unfiltered, shape, catalog)) is None, mapping.entity
            if mapping.filter:  # the one form it leaves to the reference, said so
                assert compiled.refusal(Projector(mapping, shape, catalog)) == "the mapping has filters"
            seen.add(mapping.entity)
    assert seen == {"ride", "rider", "rocket"}
