"""After a resync marker the stream brings each row once, before any change of it (`cdc.bridge.introductions`).

A model of a resync: a table keyed by id, random live inserts, updates (some moving a row to another key, some
without the row's TOASTed value) and deletes, truncates, and an online backfill reading the table in keyset chunks
whose rows are published at their high watermark, minus the keys changed inside the chunk's window (as
`cdc.bridge.snapshot` drops them). The entries the introduction lets through, applied strictly as differences (a
c or r only for a row not held, a u or d only for one held, its before-image the row held), make the table once
the backfill is done; at every point, the state read back from the entries so far (a restarted bridge's) is the
live one.
"""

from __future__ import annotations

import orjson
from hypothesis import given, settings, strategies as st

from cdc.bridge.introductions import Introduction, canonical_key


def key(i: int) -> bytes:
    return orjson.dumps({"id": i})


def entry(op: str, i: int, value: int | None = None, before: tuple[int, int] | None = None,
          unchanged: bool = False) -> list:
    fields = [b"op", op.encode(), b"key", key(i)]
    if value is not None:
        fields += [b"data", orjson.dumps({"id": i, "v": value})]
    if before is not None:
        fields += [b"before", orjson.dumps({"id": before[0], "v": before[1]})]
    if unchanged:
        fields += [b"unchanged", b'["v"]']
    return fields


def strict(entries: list[list]) -> dict[int, int]:
    rows: dict[int, int] = {}
    for fields in entries:
        f = dict(zip(fields[::2], fields[1::2]))
        op, k = f[b"op"], orjson.loads(f[b"key"]).get("id")
        if op in (b"c", b"r"):
            assert k not in rows, f"{fields}: brought twice"
            rows[k] = orjson.loads(f[b"data"])["v"]
        elif op in (b"u", b"d"):
            before = orjson.loads(f[b"before"])
            assert rows.get(before["id"]) == before["v"], f"{fields}: a row the stream does not hold as its before-image"
            del rows[before["id"]]
            if op == b"u":
                assert k not in rows
                rows[k] = orjson.loads(f[b"data"])["v"]
        elif op == b"t":
            rows.clear()
    return rows


step = st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 40), st.integers(0, 9)),
    st.tuples(st.just("update"), st.integers(0, 40), st.integers(0, 9)),
    st.tuples(st.just("move"), st.integers(0, 40), st.integers(41, 60)),
    st.tuples(st.just("delete"), st.integers(0, 60), st.just(0)),
    st.tuples(st.just("low"), st.integers(1, 8), st.just(0)),
    st.tuples(st.just("high"), st.just(0), st.just(0)),
    st.tuples(st.just("truncate"), st.just(0), st.just(0)),
)


def run(steps, table: dict[int, int], toast: bool = False):
    """Replay `steps` with the introduction; (entries, the introduction, the backfill done)."""
    intro = Introduction()
    out: list[list] = []
    cursor, done = -1, False
    window: tuple[list[tuple[int, int]], set[int], bool] | None = None  # rows read, keys changed, truncated

    def live(fields, old: int | None = None) -> None:
        if window is not None:
            window[1].update(orjson.loads(f)["id"] for f in fields[3:4])
            if old is not None:
                window[1].add(old)
        got = intro.live(fields, key(old) if old is not None else None)
        if got is not None:
            out.append(got)

    for what, a, b in steps:
        if what == "insert" and a not in table:
            table[a] = b
            live(entry("c", a, b))
        elif what == "update" and a in table:
            old, table[a] = table[a], b
            # without the full old row an unchanged TOASTed value stays out of the entry; here only when asked
            live(entry("u", a, b, before=(a, old), unchanged=toast and b % 3 == 0))
        elif what == "move" and a in table and b not in table:
            v = table.pop(a)
            table[b] = v
            live(entry("u", b, v, before=(a, v)), old=a)
        elif what == "delete" and a in table:
            v = table.pop(a)
            live(entry("d", a, before=(a, v)))
        elif what == "truncate":
            table.clear()
            intro.truncated()
            out.append([b"op", b"t", b"key", b"{}"])
            if window is not None:
                window = (window[0], window[1], True)
        elif what == "low" and window is None and not done:
            rows = sorted((k, v) for k, v in table.items() if k > cursor)[:a]
            window = (rows, set(), False)
            cursor = rows[-1][0] if rows else cursor
            done = len(rows) < a
            if done:
                cursor = 10**6
        elif what == "high" and window is not None:
            rows, changed, truncated = window
            window = None
            for k, v in rows:
                if not truncated and k not in changed and intro.chunk_row(key(k)):
                    out.append(entry("r", k, v))
        read_back = Introduction.from_entries(
            (dict(zip(f[::2], f[1::2]))[b"op"], f[3], b"unchanged" in f[::2]) for f in out)
        assert read_back.keys == intro.keys, (what, a, b)
    return out, intro, done and window is None


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.integers(0, 40), st.integers(0, 9), max_size=25), st.lists(step, max_size=80))
def test_every_row_is_brought_once_before_its_changes_and_the_backfill_ends_at_the_table(start, steps):
    table = dict(start)
    # the backfill always ends: whatever the steps, chunks are read until one comes short
    steps = steps + [("high", 0, 0)] + [s for _ in range(50) for s in (("low", 8, 0), ("high", 0, 0))]
    out, intro, done = run(steps, table)
    assert done
    assert strict(out) == table


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 40), st.integers(0, 9), max_size=25), st.lists(step, max_size=80))
def test_an_update_that_cannot_bring_its_row_leaves_it_to_its_chunk(start, steps):
    """Updates lacking a value (no full old row) pass as they are; every row still ends as the table has it."""
    table = dict(start)
    steps = steps + [("high", 0, 0)] + [s for _ in range(50) for s in (("low", 8, 0), ("high", 0, 0))]
    out, _, _ = run(steps, table, toast=True)
    rows: dict[int, int] = {}
    for fields in out:  # applied by key, as a read model does
        f = dict(zip(fields[::2], fields[1::2]))
        k = orjson.loads(f[b"key"]).get("id")
        if f[b"op"] == b"t":
            rows.clear()
        elif f[b"op"] == b"d":
            rows.pop(k, None)
        else:
            if b"before" in f:
                rows.pop(orjson.loads(f[b"before"])["id"], None)
            rows[k] = orjson.loads(f[b"data"])["v"]
    assert rows == table


def test_a_live_change_before_the_chunk_of_its_row_is_brought_by_it_and_the_chunk_leaves_the_row_out():
    intro = Introduction()
    assert intro.live(entry("u", 5, 2, before=(5, 1))) == [b"op", b"c", b"key", key(5), b"data", b'{"id":5,"v":2}']
    assert intro.live(entry("u", 5, 3, before=(5, 2)))[1] == b"u"  # brought: as it is
    assert intro.live(entry("d", 6, before=(6, 1))) is None  # never brought: nothing to delete
    assert not intro.chunk_row(key(5)) and intro.chunk_row(key(7)) and not intro.chunk_row(key(7))
    assert (intro.converted, intro.left_out) == (1, 3)
    intro.truncated()
    assert intro.chunk_row(key(5))


def test_without_creates_an_update_passes_as_it_is_and_its_chunk_brings_the_row():
    intro = Introduction(creates=False)
    fields = entry("u", 5, 2, before=(5, 1))
    assert intro.live(fields) is fields and intro.chunk_row(key(5))
    assert Introduction.from_entries([(b"u", key(5), False)], creates=False).keys == set()


def test_a_key_of_several_fields_is_compared_whatever_the_order_its_entry_lists_them():
    intro = Introduction(several=True)
    assert intro.live([b"op", b"c", b"key", b'{"b":1,"a":2}', b"data", b"{}"]) is not None
    assert intro.live([b"op", b"d", b"key", b'{"a":2,"b":1}']) is not None  # held: the delete passes
    assert canonical_key(b'{"b":1,"a":2}', True) == canonical_key(b'{"a":2,"b":1}', True) == b'{"a":2,"b":1}'
    assert not intro.chunk_row(b'{"a":2,"b":1}')


def test_the_keys_held_take_about_a_hundred_bytes_a_row():
    """What a resync of a big table holds until it ends: compact copies of the keys, not orjson's buffers (kilobytes
    each, which made a resync of 1,000,000 rows hold 4 GB)."""
    import tracemalloc

    keys = [orjson.dumps({"id": i}) for i in range(20_000)]
    intro = Introduction()
    tracemalloc.start()
    try:
        for k in keys:
            intro.chunk_row(k)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 400 * len(keys), held  # about 100 bytes a row at a million (the set grows in steps)
