"""`TableSink` writes a batch with a few set-based statements (each key's changes folded first), and the table
it leaves is the one writing the changes one by one in the batch's order leaves: checked against a model of
that on seeded random batches of few keys (each key changed many times per batch), with key changes,
deletes, truncates, updates listing `unchanged` fields, redeliveries, duplicates and any order; and a batch
whose keys the fold tells apart but the table does not (equal as jsonb) is written row by row instead."""

from __future__ import annotations

import random

import orjson
import pytest

from cdc.consume.table_sink import TableSink
from cdc.sink.entry import Entry

pytestmark = pytest.mark.integration


def entry(op: str, key: dict, data: dict | None, before: dict | None, lsn: int, seq: int, unchanged=()) -> Entry:
    """An entry as read from its stream: the fields carry the JSON the parsed values come from (every other
    one, key and data written in another order and spacing than the sink's own, as any writer may)."""
    fields = {}
    if lsn % 2:
        fields[b"key"] = orjson.dumps(key)
        if data is not None:
            fields[b"data"] = b"{ " + orjson.dumps(dict(reversed(data.items())))[1:]
    return Entry(stream="cdc:person", id=f"{lsn}-{seq}", op=op, key=key, data=data, before=before,
                 unchanged=tuple(unchanged), lsn=lsn, seq=seq, xid=lsn, ts_ms=0, v=1, fields=fields)


def workload(seed: int, n: int) -> list[Entry]:
    """Changes to ids 1..6 in source order: inserts, updates (a third listing `big` unchanged), key changes,
    deletes, a truncate now and then."""
    rng = random.Random(seed)
    rows: dict[int, dict] = {}
    out = []
    for i in range(n):
        lsn, seq = 100 + i // 3, i % 3
        roll = rng.random()
        if roll < 0.03:
            out.append(entry("t", {}, None, None, lsn, seq))
            rows.clear()
            continue
        free = [k for k in range(1, 7) if k not in rows]
        if not rows or (free and roll < 0.3):
            k = rng.choice(free)
            rows[k] = {"id": k, "n": i, "big": f"b{i}"}
            out.append(entry(rng.choice("cr"), {"id": k}, rows[k], None, lsn, seq))
            continue
        k = rng.choice(sorted(rows))
        before = rows[k]
        if roll < 0.75:
            new = dict(before, n=i)
            if rng.random() < 0.5:
                new["big"] = f"b{i}"
            if free and roll > 0.6:  # the key changed
                new["id"] = rng.choice(free)
                del rows[k]
            rows[new["id"]] = new
            if new["big"] == before["big"] and new["id"] == k and rng.random() < 0.7:  # the server did not resend big
                out.append(entry("u", {"id": new["id"]}, {x: v for x, v in new.items() if x != "big"}, before, lsn, seq, ["big"]))
            else:
                out.append(entry("u", {"id": new["id"]}, new, before, lsn, seq))
        else:
            del rows[k]
            out.append(entry("d", {"id": k}, None, {"id": k}, lsn, seq))
    return out


def model(batches: list[list[Entry]]) -> dict[str, tuple]:
    """The table after writing every change one by one, in order: key -> (data, (lsn, seq), deleted)."""
    table: dict[str, tuple] = {}

    def write(key: dict, data, pos, deleted: bool, merge: bool) -> None:
        text = orjson.dumps(key, option=orjson.OPT_SORT_KEYS).decode()
        held = table.get(text)
        if held is None:
            table[text] = (data, pos, deleted)
        elif held[1] < pos:
            table[text] = ({**held[0], **data} if merge and not held[2] else data, pos, deleted)

    for batch in batches:
        for e in batch:
            pos = (e.lsn, e.seq)
            if e.op == "t":
                for text, (data, at, deleted) in list(table.items()):
                    if at < pos:
                        table[text] = (None, pos, True)
                continue
            if e.op == "u" and e.before and {k: e.before[k] for k in e.key} != e.key:
                write({k: e.before[k] for k in e.key}, None, pos, True, False)
            write(e.key, None if e.op == "d" else e.data, pos, e.op == "d", bool(e.unchanged))
    return table


def table(env, name: str) -> dict[str, tuple]:
    return {orjson.dumps(k, option=orjson.OPT_SORT_KEYS).decode(): (d, (int(lsn), seq), deleted)
            for k, d, lsn, seq, deleted in env.execute(f"SELECT key, data, lsn, seq, deleted FROM {name}")}


@pytest.mark.parametrize("seed", range(6))
def test_a_batch_leaves_the_table_writing_its_changes_one_by_one_leaves(env, seed):
    rng = random.Random(seed)
    changes = workload(seed, 400)
    batches: list[list[Entry]] = []
    for _ in range(3):  # delivered in order, then twice more in any order (redeliveries), in batches of any size
        start = 0
        while start < len(changes):
            size = rng.choice((1, 7, 40, 150))
            batch = changes[start:start + size]
            if batches and rng.random() < 0.5:
                batch = batch + rng.sample(batch, len(batch) // 3)  # some sent twice
                rng.shuffle(batch)
            batches.append(batch)
            start += size
        changes = rng.sample(changes, len(changes))
    sink = TableSink(env.dsn, "public.mirror")
    try:
        for batch in batches:
            sink(batch)
    finally:
        sink.close()
    assert table(env, "mirror") == model(batches)


def test_keys_equal_as_jsonb_in_one_batch_are_written_row_by_row(env):
    sink = TableSink(env.dsn, "public.mirror")
    try:
        sink([entry("c", {"id": 1}, {"id": 1, "n": 1}, None, 100, 0),
              entry("u", {"id": 1.0}, {"id": 1.0, "n": 2}, {"id": 1.0}, 100, 1),
              entry("c", {"id": 2}, {"id": 2, "n": 3}, None, 100, 2)])
    finally:
        sink.close()
    assert table(env, "mirror") == {'{"id":1}': ({"id": 1.0, "n": 2}, (100, 1), False),
                                    '{"id":2}': ({"id": 2, "n": 3}, (100, 2), False)}

    # the same as read from a stream: one key spelt two ways by whatever wrote the entries
    spelt = [entry("c", {"id": 3}, {"id": 3, "n": 4}, None, 101, 0), entry("u", {"id": 3}, {"id": 3, "n": 5}, {"id": 3}, 101, 1)]
    spelt[1].fields[b"key"] = b'{"id": 3}'
    sink = TableSink(env.dsn, "public.mirror")
    try:
        sink(spelt)
    finally:
        sink.close()
    assert table(env, "mirror")['{"id":3}'] == ({"id": 3, "n": 5}, (101, 1), False)


def test_a_parsed_entry_is_a_frozen_entry_with_every_field():
    import dataclasses

    from cdc.sink.entry import ForeignEntryError, parse_entry

    fields = {b"op": b"u", b"key": b'{"id":1}', b"data": b'{"id":1,"n":2}', b"before": b'{"id":1,"n":1}',
              b"unchanged": b'["big"]', b"lsn": b"18446744073709551615", b"seq": b"3", b"xid": b"9", b"ts_ms": b"5", b"v": b"1"}
    e = parse_entry(b"cdc:person", b"1-0", fields)
    assert type(e) is Entry and e == Entry("cdc:person", "1-0", "u", {"id": 1}, {"id": 1, "n": 2}, {"id": 1, "n": 1},
                                           ("big",), 2**64 - 1, 3, 9, 5, 1, fields)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.op = "d"  # type: ignore[misc]
    bare = parse_entry("s", "2-0", {b"op": b"t", b"lsn": b"7", b"seq": b"0"})
    assert (bare.key, bare.data, bare.before, bare.unchanged, bare.xid, bare.ts_ms, bare.v) == ({}, None, None, (), 0, 0, 1)
    for broken in ({b"op": b"c", b"lsn": b"7"}, {b"op": b"c", b"lsn": b"x7", b"seq": b"0"}):
        with pytest.raises(ForeignEntryError):
            parse_entry("s", "3-0", broken)
    # JSON fields are parsed when first read (a handler passing the text on never pays for them), once
    lazy = parse_entry("cdc:person", "1-0", dict(fields))
    assert lazy.data is lazy.data and lazy.key == {"id": 1} and lazy == e
    for name, broken_field in (("data", {b"data": b"{"}), ("key", {b"key": b"nope"}), ("before", {b"before": b"["}),
                               ("unchanged", {b"unchanged": b"5"}), ("unchanged", {b"unchanged": b"]"})):
        entry = parse_entry("s", "3-0", {b"op": b"c", b"lsn": b"7", b"seq": b"0", **broken_field})
        assert entry.op == "c" and entry.position == (7, 0)
        with pytest.raises(ForeignEntryError, match=f"s 3-0 is not a bridge entry .*{name}"):
            getattr(entry, name)
        assert f"{name}=<not JSON>" in repr(entry)  # (a log line naming it never fails)
        with pytest.raises(ForeignEntryError):
            entry.parsed()
    with pytest.raises(dataclasses.FrozenInstanceError):
        del e.key
