"""The compiled reply parser against its specification: the same entries, the same errors.

`cdc.sink._entries.parse_reply` must give exactly what `cdc.sink.entry.parse_reply` (the pure-Python
reference) gives for any XREADGROUP reply: RESP2 lists and RESP3 maps, entries the bridge wrote, entries
deleted while pending (no fields: reported as gone), and entries it did not write (missing or odd
fields, numbers that are not plain digits, odd field lists), whose error must be the same.
"""

from __future__ import annotations

import importlib

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cdc.sink import entry as spec
from cdc.sink.entry import ForeignEntryError

# both twins side by side in one process, whichever path the run picked: once is enough
pytestmark = pytest.mark.one_path

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=400)


def compiled():
    try:
        return importlib.import_module("cdc.sink._entries")
    except ImportError as exc:
        pytest.skip(f"the compiled hot path is not built ({exc})")


def seen(e) -> tuple:
    """What an entry holds, without parsing its JSON (a field may not parse: that is raised when read)."""
    return (e.__class__, e.stream, e.id, e.op, e.lsn, e.seq, e.xid, e.ts_ms, e.v, e.fields,
            e._key is spec._UNREAD, e._data is spec._UNREAD, e._before is None, e._unchanged == ())


def outcome(parse, reply, with_gone: bool):
    gone: list | None = [("earlier", "1-1")] if with_gone else None
    try:
        got = [seen(e) for e in parse(reply, gone)]
    except ForeignEntryError as exc:
        return ("error", str(exc), exc.hint, gone)
    return (got, gone)


def assert_same(reply, with_gone: bool = True):
    want = outcome(spec.parse_reply, reply, with_gone)
    assert outcome(compiled().parse_reply, reply, with_gone) == want
    return want


numbers = st.one_of(
    st.integers(0, 10**18 - 1).map(lambda n: str(n).encode()),
    st.integers(0, 2**64).map(lambda n: str(n).encode()),
    st.sampled_from([b"", b" 7", b"7 ", b"+7", b"-7", b"1_000", b"0x10", b"07", b"x", b"\xd9\xa3", b"1.5",
                     b"123456789012345678", b"1234567890123456789", "7"]),
)
ops = st.one_of(st.sampled_from([b"c", b"u", b"d", b"r", b"t", b"x", b"m", b"e", b"s"]),
                st.binary(max_size=3), st.sampled_from(["c", b"\xff"]))
json = st.sampled_from([b'{"id":1}', b'{"id":2,"name":"caf\xc3\xa9"}', b"[]", b"not json", b""])


@st.composite
def fields(draw) -> list:
    present = {
        b"op": ops, b"key": json, b"data": json, b"before": json, b"unchanged": st.sampled_from([b'["a"]', b"{}"]),
        b"lsn": numbers, b"seq": numbers, b"xid": numbers, b"ts_ms": numbers, b"v": numbers,
    }
    # the bridge's fields mostly all there, sometimes one missing
    names = [n for n in present if draw(st.integers(0, 9)) or n in (b"key",)]
    flat: list = []
    for name in names:
        flat += [name, draw(present[name])]
    if draw(st.integers(0, 15)) == 0:
        flat += [draw(st.binary(max_size=4)), draw(st.binary(max_size=4))]  # a field of its own
    if draw(st.integers(0, 20)) == 0:
        flat.append(b"odd")  # an odd list: the last name has no value
    if draw(st.integers(0, 20)) == 0:
        flat += [b"lsn", draw(numbers)]  # a field twice: the last wins
    return flat


items = st.lists(st.tuples(st.one_of(st.integers(1, 9**9).map(lambda n: f"{n}-0".encode()), st.just("5-5")),
                           st.one_of(fields(), fields(), fields(), st.none(), st.just([]))), max_size=6)
streams = st.sampled_from([b"cdc:ride", b"cdc:person", "cdc:str"])


@settings(**SETTINGS)
@given(st.lists(st.tuples(streams, items), max_size=3), st.booleans(), st.booleans())
@example([(b"s", [(b"1-0", [b"op", b"c", b"lsn", b"7", b"seq", b"0"])])], False, True)
@example([(b"s", [(b"1-0", None), (b"2-0", [b"op", b"c", b"lsn", b"7", b"seq", b"0"])])], True, True)
@example([(b"s", [(b"1-0", [b"op", b"c", b"lsn", b"99999999999999999999", b"seq", b"0"])])], False, True)
@example([(b"s", [(b"1-0", [b"op", b"c", b"lsn", b"x", b"seq", b"0"])])], False, True)
def test_the_same_entries_or_the_same_error(reply, resp3, with_gone):
    if resp3:
        merged: dict = {}
        for stream, listed in reply:
            merged.setdefault(stream, []).extend(listed)
        reply = merged
    else:
        reply = [[stream, listed] for stream, listed in reply]
    assert_same(reply, with_gone)


def test_a_reply_of_bridge_entries_is_read_whole():
    reply = [[b"cdc:ride", [(b"1-0", [b"op", b"c", b"key", b'{"id":1}', b"data", b'{"id":1}', b"lsn", b"123",
                                      b"seq", b"4", b"xid", b"9", b"ts_ms", b"1700000000000", b"v", b"1"]),
                            (b"2-0", None),
                            (b"3-0", [b"op", b"u", b"key", b'{"id":1}', b"before", b'{"id":1}', b"lsn", b"124",
                                      b"seq", b"0"])]]]
    got, gone = assert_same(reply)
    assert [(g[2], g[3], g[4], g[5], g[6], g[7], g[8]) for g in got] == [
        ("1-0", "c", 123, 4, 9, 1700000000000, 1), ("3-0", "u", 124, 0, 0, 0, 1)]
    assert gone == [("earlier", "1-1"), ("cdc:ride", "2-0")]
    entries = compiled().parse_reply(reply)
    assert entries[1].before == {"id": 1} and entries[0].before is None and entries[0].data == {"id": 1}


def test_a_foreign_entry_is_named_alike():
    reply = [[b"cdc:ride", [(b"1-0", [b"op", b"c", b"lsn", b"1", b"seq", b"0"]), (b"2-0", [b"op", b"c", b"seq", b"0"])]]]
    want = assert_same(reply)
    assert want[0] == "error" and "cdc:ride 2-0" in want[1] and "no lsn field" in want[1]


def test_nothing_read_is_no_entries():
    for reply in (None, [], {}):
        assert compiled().parse_reply(reply) == spec.parse_reply(reply) == []
