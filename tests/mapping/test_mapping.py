"""Mapping loading and validation, and projection of rows (pure: no server)."""

from __future__ import annotations

import hashlib
import hmac
import zlib

import orjson
import pytest

from cdc import keys
from cdc.config import Settings
from cdc.errors import ConfigError, MappingError
from cdc.mapping.model import load_mappings, parse_mapping
from cdc.source.pgoutput import UNCHANGED_TOAST
from cdc.mapping.projector import Projector
from cdc.source.shapes import ColumnShape, TableShape
from cdc.source.values import TypeCatalog
from cdc.yamlsrc import load_yaml_documents

RIDES = TableShape("public", "rides", (
    ColumnShape("id", 20, key=True), ColumnShape("rider_id", 20), ColumnShape("distance_m", 1700),
    ColumnShape("status", 25), ColumnShape("created_at", 1184), ColumnShape("note", 25),
))


KEY = b"k" * 32


def mapping(text: str, env=None, hash_key=KEY):
    return parse_mapping(load_yaml_documents(text, "m.yaml")[0], env or {}, hash_key)


def fields_dict(projected) -> dict:
    it = iter(projected.fields)
    return {k.decode(): v for k, v in zip(it, it)}


MINIMAL = """\
entity: ride
table: public.rides
key: [id]
fields:
  id: id
  distance: distance_m
  rider: rider_id
"""


def test_minimal_mapping_projects_only_named_fields():
    m = mapping(MINIMAL)
    assert m.stream_keys() == ["cdc:ride"] and m.version == 1 and m.ops == {"c", "u", "d", "t", "r"}
    p = Projector(m, RIDES, TypeCatalog())
    out = fields_dict(p.insert(("7", "3", "12.500", "done", "2026-01-01 00:00:00+00", "secret")))
    assert out["op"] == b"c"
    assert orjson.loads(out["key"]) == {"id": 7}
    assert orjson.loads(out["data"]) == {"id": 7, "distance": "12.500", "rider": 3}
    assert b"secret" not in b"".join(v for v in projected_values(out))


def projected_values(out: dict):
    return [v for v in out.values() if isinstance(v, bytes)]


@pytest.mark.parametrize("text, message, line", [
    ("entity: ride\ntable: public.rides\nkey: [idx]\nfields: {id: id}\n", "key field 'idx' is not one of the mapping's fields", 3),
    ("entity: ride\ntable: public.rides\nkey: [id]\nfields:\n  id: id\n  d: {column: distance_m, cast: sideways}\n", "unknown cast 'sideways'", 6),
    ("entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id}\nopz: [c]\n", "unknown mapping key 'opz'", 5),
    ("entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id}\nops: [c, x]\n", "unknown operation 'x'", 5),
    ("entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id}\nfilter: {status: {like: x}}\n", "unknown filter operator 'like'", 5),
    ("entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id, r: rider_id}\npartitions: {count: 2, by: [r]}\n", "partitions.by field 'r' is not a key field", 5),
    ("entity: ride\ntable: public.rides\nfields: {id: id}\n", "has no 'key'", 1),
    ("entity: ride\ntable: a.b.c\nkey: [id]\nfields: {id: id}\n", "is not 'schema.table'", 2),
    ("entity: ride\ntable: public.rides\nkey: [id]\nfields:\n  id: id\n  e: {column: email, hash: sha256, unkeyed: true, salt_env: NOPE}\n", "'NOPE' (the hash salt) is not set", 6),
    ("entity: ride\ntable: public.rides\nkey: [id]\nfields:\n  id: id\n  e: {column: email, hash: sha256}\n", "hash sha256 is unkeyed, so anyone can reverse it", 6),
    ("entity: ride\ntable: public.rides\nkey: [id]\nfields:\n  id: id\n  e: {column: email, hash: hmac-sha256, unkeyed: true}\n", "unkeyed only applies with hash: sha256", 6),
    ("entity: ride\ntable: public.rides\nkey: [id]\nfields:\n  id: id\n  e: {column: email, hash: hmac-sha256, salt_env: S}\n", "salt_env only applies with hash: sha256", 6),
])
def test_invalid_mappings_name_file_line_and_fix(text, message, line):
    with pytest.raises(MappingError) as info:
        mapping(text)
    assert message in str(info.value)
    assert str(info.value).startswith(f"m.yaml:{line}:")


def test_yaml_syntax_and_duplicate_keys_are_located():
    with pytest.raises(ConfigError, match=r"m.yaml:2: invalid YAML"):
        load_yaml_documents("entity: ride\n  table: [\n", "m.yaml")
    with pytest.raises(ConfigError, match=r"m.yaml:2: duplicate key 'entity'"):
        load_yaml_documents("entity: a\nentity: b\n", "m.yaml")


def test_casts_hash_redact_const_and_filter():
    m = mapping("""\
        entity: ride
        table: rides
        key: [id]
        ops: [c]
        filter: {status: {ne: test}, distance_m: {gte: 1}}
        fields:
          id: id
          km: {column: distance_m, cast: float}
          whole: {column: distance_m, cast: integer}
          at: {column: created_at, cast: epoch_ms}
          day: {column: created_at, cast: date}
          note: {column: note, hash: sha256, unkeyed: true, salt_env: SALT}
          keyed: {column: note, hash: hmac-sha256}
          status: {column: status, redact: true}
          source: {const: pg}
        """.replace("        ", ""), {"SALT": "s"})
    p = Projector(m, RIDES, TypeCatalog())
    row = ("1", "2", "1500.000", "done", "2026-11-21 00:00:00+00", "n")
    data = orjson.loads(fields_dict(p.insert(row))["data"])
    assert data == {
        "id": 1, "km": 1500.0, "whole": 1500, "at": 1795219200000, "day": "2026-11-21",
        "note": hashlib.sha256(b"sn").hexdigest(), "keyed": hmac.new(KEY, b"n", hashlib.sha256).hexdigest(),
        "status": "***", "source": "pg",
    }
    assert p.insert(("1", "2", "1500", "test", "2026-11-21 10:15:00+00", None)) is None
    assert p.insert(("1", "2", "0.5", "done", "2026-11-21 10:15:00+00", None)) is None
    assert p.insert(("1", "2", "10", None, "2026-11-21 00:00:00+00", None)) is not None  # NULL != test


def test_cast_that_does_not_fit_the_column_type_is_rejected_on_binding():
    m = mapping("entity: r\ntable: rides\nkey: [id]\nfields:\n  id: id\n  s: {column: status, cast: float}\n")
    with pytest.raises(MappingError, match=r"m.yaml:6: entity 'r': cast 'float' does not apply to column 'status' of type text"):
        Projector(m, RIDES, TypeCatalog())


def test_missing_column_and_key_outside_replica_identity():
    with pytest.raises(MappingError, match="column 'distance_m' is not in table public.rides.*dropped or renamed"):
        Projector(mapping(MINIMAL), TableShape("public", "rides", (ColumnShape("id", 20, True), ColumnShape("rider_id", 20))), TypeCatalog())
    m = mapping("entity: r\ntable: rides\nkey: [rider]\nfields: {rider: rider_id}\n")
    with pytest.raises(MappingError, match="REPLICA IDENTITY FULL"):
        Projector(m, RIDES, TypeCatalog())
    # an update changing the key must carry the old one, which the server sends only for identity columns
    m = mapping("entity: r\ntable: rides\nkey: [rider]\nops: [c, u]\nfields: {rider: rider_id}\n")
    with pytest.raises(MappingError, match="an update changing it would carry no old key.*REPLICA IDENTITY FULL"):
        Projector(m, RIDES, TypeCatalog())
    m = mapping("entity: r\ntable: rides\nkey: [rider]\nops: [c, t]\nfields: {rider: rider_id}\n")
    Projector(m, RIDES, TypeCatalog())  # no updates or deletes emitted: no identity needed


def test_update_delete_before_images_and_unchanged_toast():
    p = Projector(mapping(MINIMAL + "  note: note\n"), RIDES, TypeCatalog())
    new = ("1", "2", "3.000", "done", "x", UNCHANGED_TOAST)
    # no before-image: the field is omitted and listed
    out = fields_dict(p.update(new, None, False))
    assert orjson.loads(out["data"]) == {"id": 1, "distance": "3.000", "rider": 2}
    assert orjson.loads(out["unchanged"]) == ["note"] and "before" not in out
    # full before-image: its value fills the hole
    old = ("1", "2", "1.000", "done", "x", "long text")
    out = fields_dict(p.update(new, old, True))
    assert orjson.loads(out["data"])["note"] == "long text" and "unchanged" not in out
    assert orjson.loads(out["before"])["distance"] == "1.000"
    # key-only old tuple (key changed): before holds the key fields
    out = fields_dict(p.update(("5",) + new[1:], ("1", None, None, None, None, None), False))
    assert orjson.loads(out["before"]) == {"id": 1} and orjson.loads(out["key"]) == {"id": 5}
    out = fields_dict(p.delete(("1", None, None, None, None, None), False))
    assert out["op"] == b"d" and orjson.loads(out["key"]) == {"id": 1} and "data" not in out and "before" not in out
    assert [fields_dict(t)["op"] for t in p.truncate()] == [b"t"]


def test_partitions_follow_a_documented_hash_and_truncate_reaches_every_partition():
    m = mapping(MINIMAL + "partitions: {count: 4}\n")
    assert m.stream_keys() == ["cdc:ride:0", "cdc:ride:1", "cdc:ride:2", "cdc:ride:3"]
    p = Projector(m, RIDES, TypeCatalog())
    for ride in range(50):
        out = p.insert((str(ride), "2", "1", "d", "x", None))
        assert out.partition == zlib.crc32(orjson.dumps([ride])) % 4
    assert sorted(t.partition for t in p.truncate()) == [0, 1, 2, 3]


def test_ops_and_before_switches():
    p = Projector(mapping(MINIMAL + "ops: [c]\nbefore: false\n"), RIDES, TypeCatalog())
    row = ("1", "2", "3", "d", "x", None)
    assert p.insert(row) is not None
    assert p.update(row, row, True) is None and p.delete(row, True) is None and p.truncate() == []
    p = Projector(mapping(MINIMAL + "before: false\n"), RIDES, TypeCatalog())
    assert "before" not in fields_dict(p.update(row, row, True))
    assert "before" not in fields_dict(p.update(row, ("1", None, None, None, None, None), False))
    # an update that changed the key carries the old key all the same: without it the old key's row would live on
    moved = fields_dict(p.update(("7",) + row[1:], ("1", None, None, None, None, None), False))
    assert orjson.loads(moved["key"]) == {"id": 7} and orjson.loads(moved["before"]) == {"id": 1}
    moved = fields_dict(p.update(("7",) + row[1:], row, True))
    assert orjson.loads(moved["before"]) == {"id": 1}


def test_mark_keys_share_the_stream_cluster_slot():
    assert keys.mark_key("cdc:ride") == "{cdc:ride}:hwm"
    assert keys.mark_key("cdc:{ride}:0") == "cdc:{ride}:0:hwm"
    assert keys.stream_key("cdc:{{entity}}:{partition}", entity="ride", partition=3) == "cdc:{ride}:3"
    assert not keys.has_hash_tag("cdc:{}:x") and keys.has_hash_tag("a{b}")


def test_load_mappings_rejects_duplicates(tmp_path):
    (tmp_path / "a.yaml").write_text(MINIMAL)
    (tmp_path / "b.yaml").write_text(MINIMAL.replace("entity: ride", "entity: other").replace("key: [id]", "key: [id]\nstream: cdc:ride"))
    with pytest.raises(MappingError, match="stream 'cdc:ride' is already written by entity 'ride'"):
        load_mappings(tmp_path)
    (tmp_path / "b.yaml").write_text("- " + MINIMAL.replace("\n", "\n  "))
    with pytest.raises(MappingError, match="entity 'ride' is already defined at .*a.yaml:1"):
        load_mappings(tmp_path)


def test_settings_from_file_and_environment(tmp_path):
    cfg = tmp_path / "cdc.yaml"
    cfg.write_text("postgres: {dsn: 'postgresql://a/b', slot: s1}\nredis: {url: 'redis://x:1/0'}\nmappings: maps/\n")
    secret = tmp_path / "dsn"
    secret.write_text("postgresql://user:pw@h/db\n")
    s = Settings.from_file(cfg, env={"CDC_REDIS_URL": "redis://y:2/0", "CDC_POSTGRES_DSN_FILE": str(secret), "CDC_BATCH_MAX_ENTRIES": "10"})
    assert s.postgres.dsn == "postgresql://user:pw@h/db" and s.postgres.slot == "s1"
    assert s.redis.url == "redis://y:2/0" and s.batch.max_entries == 10
    assert s.mappings == tmp_path / "maps"
    cfg.write_text("postgres: {dsn: x, slots: 2}\n")
    with pytest.raises(ConfigError, match=r"cdc.yaml:1: unknown setting postgres.slots; postgres accepts: dsn, slot, publication"):
        Settings.from_file(cfg, env={})
    cfg.write_text("batch: {max_entries: many}\n")
    with pytest.raises(ConfigError, match=r"cdc.yaml:1: batch.max_entries must be an integer, got 'many'"):
        Settings.from_file(cfg, env={})


def test_streaming_settings(tmp_path):
    cfg = tmp_path / "cdc.yaml"
    cfg.write_text("postgres: {streaming: true}\nbatch: {stream_buffer_mb: 8, spill_dir: spill}\n")
    s = Settings.from_file(cfg, env={})
    assert s.postgres.streaming and s.batch.stream_buffer_mb == 8
    assert s.batch.spill_dir == str(tmp_path / "spill")  # relative to the config file
    assert not Settings.from_dict({}).postgres.streaming  # off unless asked
    cfg.write_text("batch:\n  stream_buffer_mb: 0\n")
    with pytest.raises(ConfigError, match=r"cdc.yaml:2: batch.stream_buffer_mb must be from 1 to 1048576, got 0"):
        Settings.from_file(cfg, env={})
    with pytest.raises(ConfigError, match=r"CDC_POSTGRES_STREAMING: postgres.streaming must be true or false, got 'maybe'"):
        Settings.from_file(cfg, env={"CDC_POSTGRES_STREAMING": "maybe"})


def test_an_unkeyed_hash_is_refused_with_the_fix():
    with pytest.raises(MappingError) as info:
        mapping("entity: rider\ntable: riders\nkey: [id]\nfields:\n  id: id\n  email: {column: email, hash: sha256}\n")
    assert info.value.exit_code == 3 and str(info.value).startswith("m.yaml:6: field 'email': hash sha256 is unkeyed")
    assert "use hash: hmac-sha256" in info.value.hint and "unkeyed: true" in info.value.hint


def test_a_keyed_hash_without_a_key_names_the_setting():
    with pytest.raises(ConfigError) as info:
        mapping("entity: rider\ntable: riders\nkey: [id]\nfields:\n  id: id\n  email: {column: email, hash: hmac-sha256}\n",
                hash_key=None)
    assert info.value.exit_code == 2 and not isinstance(info.value, MappingError)
    assert str(info.value).startswith("m.yaml:6: field 'email' is hashed with hmac-sha256, and no hash key is set; ")
    assert "CDC_HASH_KEY_FILE" in info.value.hint and "hash_key_file" in info.value.hint


def test_the_hash_key_comes_from_the_environment_or_a_file_and_is_never_shown(tmp_path):
    (tmp_path / "hash.key").write_text("  file-key-0123456789abcdef\n")
    from_file = Settings.from_dict({"hash_key_file": "hash.key"}, base_dir=tmp_path, env={})
    assert from_file.hash_key == b"file-key-0123456789abcdef" and from_file.hash_key_file == str(tmp_path / "hash.key")
    assert "file-key" not in repr(from_file)
    by_env = Settings.from_dict({"hash_key_file": "hash.key"}, base_dir=tmp_path,
                                env={"CDC_HASH_KEY_FILE": str(tmp_path / "other.key")} | {"CDC_HASH_KEY": "env-key-0123456789abcdef"})
    assert by_env.hash_key == b"env-key-0123456789abcdef"
    assert Settings.from_dict({}, env={}).hash_key == b""
    with pytest.raises(ConfigError) as info:
        Settings.from_dict({}, base_dir=tmp_path, env={"CDC_HASH_KEY_FILE": str(tmp_path / "missing.key")})
    assert str(info.value).startswith(f"CDC_HASH_KEY_FILE: cannot read the hash key file {tmp_path / 'missing.key'}: "
                                      "No such file or directory; ")
    (tmp_path / "short.key").write_text("s3cret\n")
    with pytest.raises(ConfigError) as info:
        Settings.from_dict({}, base_dir=tmp_path, env={"CDC_HASH_KEY_FILE": str(tmp_path / "short.key")})
    assert "the hash key is 6 bytes, shorter than 16" in str(info.value) and "s3cret" not in str(info.value) + info.value.hint


def test_the_sample_mappings_hash_with_a_key():
    from pathlib import Path

    sample = Path(__file__).resolve().parents[2] / "mappings"
    rider = next(m for m in load_mappings(sample, {}, KEY) if m.entity == "rider")
    assert next(f for f in rider.fields if f.name == "email").hash == "hmac-sha256"
    with pytest.raises(ConfigError, match="no hash key is set"):
        load_mappings(sample, {}, None)


@pytest.mark.parametrize("key", [b"k" * 16, b"k" * 64, b"k" * 65, "kéy-ünïcode-0123456789".encode(), bytes(range(200))])
@pytest.mark.parametrize("text", ["", "ann@example.com", "ünïcode ✓", "x" * 1000])
def test_the_keyed_hash_is_rfc_2104_hmac_sha256(key, text):
    from cdc.mapping.projector import hmac_sha256

    assert hmac_sha256(key)(text) == hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


FULL_RIDES = TableShape("public", "rides", RIDES.columns, replica_identity="f")
ACTIVE = "entity: ride\ntable: rides\nkey: [id]\nfilter: {status: active}\nfields: {id: id, status: status}\n"


def test_a_filter_on_a_column_deletes_do_not_carry_is_refused_with_the_fixes():
    """Without REPLICA IDENTITY FULL a delete carries only the key: a filter on another column would drop it."""
    with pytest.raises(MappingError) as err:
        Projector(mapping(ACTIVE), RIDES, TypeCatalog())
    assert str(err.value) == (
        "m.yaml:4: entity 'ride': filter on column 'status' cannot be judged on the updates and deletes of public.rides: "
        "its replica identity (default: the primary key) does not carry the column, so the bridge cannot tell whether "
        "the row passed the filter before the change; run: ALTER TABLE public.rides REPLICA IDENTITY FULL; or filter "
        "only on replica identity columns (id); or publish only inserts (ops: [c])")
    # each fix binds
    Projector(mapping(ACTIVE), FULL_RIDES, TypeCatalog())
    Projector(mapping(ACTIVE.replace("{status: active}", "{id: {gt: 3}}")), RIDES, TypeCatalog())
    Projector(mapping(ACTIVE + "ops: [c, t, r]\n"), RIDES, TypeCatalog())
    with pytest.raises(MappingError, match="filter on column 'status' cannot be judged on the deletes of"):
        Projector(mapping(ACTIVE + "ops: [c, d]\n"), RIDES, TypeCatalog())


def _op(projected):
    return None if projected is None else (fields_dict(projected)["op"].decode(), orjson.loads(fields_dict(projected)["key"]))


def test_a_filter_is_judged_as_transitions_on_the_old_and_new_rows():
    p = Projector(mapping(ACTIVE), FULL_RIDES, TypeCatalog())
    row = lambda i, status: (str(i), "2", "1.000", status, "x", "n")  # noqa: E731
    assert _op(p.update(row(5, "active"), row(5, "active"), True)) == ("u", {"id": 5})
    assert _op(p.update(row(5, "gone"), row(5, "active"), True)) == ("d", {"id": 5})
    assert _op(p.update(row(5, "active"), row(5, "gone"), True)) == ("c", {"id": 5})
    assert p.update(row(5, "gone"), row(5, "new"), True) is None
    # the key moved as well: the delete names the old key, the create the new one
    assert _op(p.update(row(6, "gone"), row(5, "active"), True)) == ("d", {"id": 5})
    assert _op(p.update(row(6, "active"), row(5, "gone"), True)) == ("c", {"id": 6})
    # a create carries the whole row: an unchanged TOASTed value is taken from the old row
    new = (*row(5, "active")[:5], UNCHANGED_TOAST)
    assert orjson.loads(fields_dict(p.update(new, row(5, "gone"), True))["data"]) == {"id": 5, "status": "active"}
    assert _op(p.delete(row(5, "active"), True)) == ("d", {"id": 5})
    assert p.delete(row(5, "gone"), True) is None
    # each only when its op is published
    no_delete = Projector(mapping(ACTIVE + "ops: [c, u]\n"), FULL_RIDES, TypeCatalog())
    assert no_delete.update(row(5, "gone"), row(5, "active"), True) is None
    assert _op(no_delete.update(row(5, "active"), row(5, "gone"), True)) == ("c", {"id": 5})
    no_create = Projector(mapping(ACTIVE + "ops: [u, d]\n"), FULL_RIDES, TypeCatalog())
    assert no_create.update(row(5, "active"), row(5, "gone"), True) is None
    inserts_only = Projector(mapping(ACTIVE + "ops: [c]\n"), RIDES, TypeCatalog())
    assert inserts_only.update(row(5, "active"), None, False) is None


def test_a_filter_on_the_key_is_judged_on_the_old_key():
    p = Projector(mapping(ACTIVE.replace("{status: active}", "{id: {gt: 3}}")), RIDES, TypeCatalog())
    key = lambda i: (str(i), None, None, None, None, None)  # noqa: E731  what a delete carries without FULL
    row = lambda i: (str(i), "2", "1.000", "s", "x", "n")  # noqa: E731
    assert _op(p.delete(key(5), False)) == ("d", {"id": 5})
    assert p.delete(key(2), False) is None
    assert _op(p.update(row(5), None, False)) == ("u", {"id": 5})
    assert p.update(row(2), None, False) is None
    assert _op(p.update(row(2), key(5), False)) == ("d", {"id": 5})
    assert _op(p.update(row(7), key(2), False)) == ("c", {"id": 7})


def test_a_change_lacking_a_value_the_filter_or_a_create_needs_stops_rather_than_guess():
    from cdc.mapping.projector import Unjudgeable

    p = Projector(mapping(ACTIVE.replace("{status: active}", "{id: {gt: 3}}").replace("status: status}", "note: note}")),
                  RIDES, TypeCatalog())
    with pytest.raises(Unjudgeable, match="an update brought a row of public.rides into the filter without resending "
                                          "field 'note'.*ALTER TABLE public.rides REPLICA IDENTITY FULL"):
        p.update(("7", "2", "1.000", "s", "x", UNCHANGED_TOAST), ("2", None, None, None, None, None), False)
    q = Projector(mapping(ACTIVE.replace("{status: active}", "{id: {gt: 3}}")), RIDES, TypeCatalog())
    with pytest.raises(Unjudgeable, match="filter on column 'id': a change of public.rides did not carry"):
        q.update((UNCHANGED_TOAST, "2", "1.000", "s", "x", "n"), None, False)


@pytest.mark.parametrize("stream", [
    "cdc:dlq:g1", "cdc:dlq:{entity}", "cdc:bridge:x", "cdc:stats:trim", "cdc:stats:{entity}", "'{cdc:bridge}:streams'",
    "'{cdc:t}:hwm'", "'cdc:{{entity}}:hwm'", "'{cdc:t}:holds'", "'{cdc:t}:removed'", "'{cdc:ride}:lease:g1'", "'cdc:{{entity}}:lease:g:epoch'",
    "'{cdc:ride}:failures:g1'",
])
def test_a_stream_named_like_a_key_the_bridge_keeps_is_refused_at_its_line(stream):
    """Dead letters, the bridge's records and statistics, and the keys kept beside a stream (mark, holds,
    leases, failure counts) are never a mapped stream, whether or not such a key exists yet."""
    text = MINIMAL + f"stream: {stream}\n"
    with pytest.raises(MappingError) as info:
        mapping(text)
    message = str(info.value)
    assert message.startswith("m.yaml:8: stream ") and "is a reserved name" in message, message
    assert "give the mapping a stream of its own, such as stream: 'cdc:{entity}'" in message
    assert mapping(MINIMAL + "stream: 'cdc:{entity}'\n").stream_key() == "cdc:ride"  # the advice loads


def test_a_partitioned_or_message_mapping_s_reserved_stream_is_refused_too():
    partitioned = MINIMAL.replace("key: [id]", "key: [id]\npartitions: {count: 2, by: [id]}") + "stream: 'cdc:{{entity}}:{partition}:holds'\n"
    with pytest.raises(MappingError, match=r"^m.yaml:9: stream 'cdc:\{ride\}:0:holds' of entity 'ride' is a reserved name"):
        mapping(partitioned)
    with pytest.raises(MappingError, match=r"^m.yaml:3: stream 'cdc:dlq:audit' of entity 'audit' is a reserved name"):
        mapping("entity: audit\nmessage_prefix: audit\nstream: 'cdc:dlq:{entity}'\n")
    # names that only look alike stay allowed: no hash tag before :hwm, a partition of an entity called lease
    assert mapping(MINIMAL + "stream: 'cdc:ride:hwm'\n").stream_key() == "cdc:ride:hwm"
    assert mapping(MINIMAL.replace("entity: ride", "entity: lease").replace("key: [id]", "key: [id]\npartitions: {count: 2, by: [id]}")
                   ).stream_keys() == ["cdc:lease:0", "cdc:lease:1"]


def test_a_reserved_transactions_stream_is_refused(tmp_path):
    (tmp_path / "mappings").mkdir()
    (tmp_path / "mappings" / "ride.yaml").write_text(MINIMAL)
    for stream in ("cdc:dlq:tx", "'{cdc:tx}:hwm'", "'{cdc:bridge}:slots'"):
        cfg = tmp_path / "cdc.yaml"
        cfg.write_text(f"mappings: mappings/\ntransactions:\n  stream: {stream}\n")
        settings = Settings.from_file(cfg, env={})
        from cdc.cli.common import check_transactions_stream

        with pytest.raises(ConfigError, match=f"^{cfg}:3: transactions.stream .* cannot be used: names "):
            check_transactions_stream(settings, load_mappings(settings.mappings))


def test_an_update_without_its_old_row_under_a_full_table_stops_rather_than_judge_the_new_row():
    """REPLICA IDENTITY FULL always sends the old row: an update without one comes from a partition whose own
    identity is not full (the server describes a partitioned table by its parent), and the filter cannot be
    judged on it; the same update on a table whose identity carries the filter column keeps its verdict."""
    from cdc.mapping.judge import OldRowMissing

    row = ("5", "2", "1.000", "gone", "x", "n")
    p = Projector(mapping(ACTIVE), FULL_RIDES, TypeCatalog())
    with pytest.raises(OldRowMissing, match="filter on column 'status' cannot be judged on the updates and deletes of "
                                            "public.rides: an update came without its old row"):
        p.update(row, None, False)
    assert p.update(row, row, True) is None  # with its old row: judged (neither passes)
    assert Projector(mapping(ACTIVE + "ops: [c]\n"), FULL_RIDES, TypeCatalog()).update(row, None, False) is None
    key_filter = Projector(mapping(ACTIVE.replace("{status: active}", "{id: {gt: 3}}")), RIDES, TypeCatalog())
    assert _op(key_filter.update(row, None, False)) == ("u", {"id": 5})
    # under FULL, once the partitions not FULL the server described are known to carry the filter's columns
    p.carried[0] = frozenset({"id"})
    with pytest.raises(OldRowMissing):
        p.update(row, None, False)
    full_key = Projector(mapping(ACTIVE.replace("{status: active}", "{id: {gt: 3}}")), FULL_RIDES, TypeCatalog())
    with pytest.raises(OldRowMissing):
        full_key.update(row, None, False)
    full_key.carried[0] = frozenset({"id"})
    assert _op(full_key.update(row, None, False)) == ("u", {"id": 5})
