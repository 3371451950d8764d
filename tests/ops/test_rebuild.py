"""What a rebuild must say, from what a stream says (pure: no servers)."""

from __future__ import annotations

import orjson

from cdc.ops.rebuild import KnownRows, marker, tombstone


def entry(op: str, key: int | None = None, data: dict | None = None, **extra) -> dict:
    fields = {b"op": op.encode(), b"key": b"{}" if key is None else orjson.dumps({"id": key})}
    if data is not None:
        fields[b"data"] = orjson.dumps(data)
    fields.update({k.encode(): v for k, v in extra.items()})
    return fields


def test_known_rows_replays_the_stream_to_its_alive_keys_and_last_records():
    known = KnownRows()
    known.extend([
        entry("r", 1, {"id": 1, "note": "a", "n": 1}),
        entry("c", 2, {"id": 2, "note": "b", "n": 2}),
        entry("t"),                                   # a truncate forgets everything before it
        entry("c", 3, {"id": 3, "note": "long", "n": 3}),
        entry("c", 4, {"id": 4, "note": "x", "n": 4}),
        entry("u", 3, {"id": 3, "n": 30}, unchanged=b'["note"]'),  # note keeps what the stream told
        entry("d", 4),
        entry("m", data={"prefix": "p", "content": 1}),
        entry("x", data={"rebuilt": True}),            # an earlier rebuild's marker changes nothing by itself
        entry("c", 5, {"id": 5, "note": "e", "n": 5}),
    ])
    assert known.entries == 10
    assert {orjson.loads(k)["id"]: orjson.loads(v) for k, v in known.rows.items()} == {
        3: {"id": 3, "note": "long", "n": 30}, 5: {"id": 5, "note": "e", "n": 5}}


def test_a_tombstone_carries_the_last_record_only_when_the_mapping_sends_before_images():
    last = orjson.dumps({"id": 3, "n": 30})
    assert tombstone(b'{"id":3}', last, True) == [b"op", b"d", b"key", b'{"id":3}', b"before", last]
    assert tombstone(b'{"id":3}', last, False) == [b"op", b"d", b"key", b'{"id":3}']
    fields = marker("0/199F680", None, "0/1993F48")
    assert fields[:4] == [b"op", b"x", b"key", b"{}"]
    assert orjson.loads(fields[5]) == {"rebuilt": True, "snapshot": "0/199F680", "lost_from": None, "lost_to": "0/1993F48"}
