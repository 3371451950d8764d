"""The compiled XADD packer against its specification: the same entries, the same command bytes.

`cdc.sink._resp.xadd_command` must give exactly the bytes of
`cdc.sink.lane.xadd_command` (the pure-Python reference) for any entry the
bridge queues: field names as bytes or str, values as bytes, str, int or anything
else (written as its str), unicode, empty values, '%' anywhere; and, for what
cannot be packed, the same exception.
"""

from __future__ import annotations

import importlib
from decimal import Decimal

import hiredis
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cdc import speedups
from cdc.sink import lane

# both twins side by side in one process, whichever path the run picked: once is enough (make test's pure pass
# runs only the tests marked both_paths: those that read the path the run picked)
pytestmark = pytest.mark.one_path

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def compiled_resp():
    try:
        return importlib.import_module("cdc.sink._resp")
    except ImportError as exc:
        pytest.skip(f"the compiled hot path is not built ({exc})")


def outcome(pack, stream, entry):
    try:
        return pack(stream, entry)
    except Exception as exc:
        return (type(exc), str(exc))


def assert_same(stream, entry):
    compiled = compiled_resp()
    want = outcome(lane.xadd_command, stream, list(entry) if isinstance(entry, list) else entry)
    got = outcome(compiled.xadd_command, stream, list(entry) if isinstance(entry, list) else entry)
    assert got == want
    return want


text = st.text(st.characters(codec="utf-8"), max_size=12)
names = st.one_of(
    st.sampled_from([b"op", b"key", b"data", b"before", b"unchanged", b"lsn", b"seq", b"xid", b"ts_ms", b"v"]),
    st.binary(max_size=8),
    text,
    st.sampled_from(["%", "%s", "%%", "%d", b"%", b"%s", b"%%d", "caf\u00e9", "\U0001f600", ""]),
)
other_names = st.one_of(st.integers(-3, 3), st.booleans(), st.floats(), st.none(), st.binary(max_size=4).map(bytearray))
values = st.one_of(
    st.binary(max_size=40),
    text,
    st.integers(),
    st.integers(-(2**63), 2**63),
    st.floats(),
    st.booleans(),
    st.none(),
    st.decimals(allow_nan=False),
    st.binary(max_size=8).map(bytearray),
    st.sampled_from([b"", "", 0, -1, "%d", b"%s", "\x00\r\n", b"\r\n"]),
)
streams = st.one_of(
    st.sampled_from([b"cdc:ride", b"cdc:{ride}:0", b""]),
    st.binary(max_size=16),
    st.text(st.characters(codec="utf-8"), max_size=8).map(str.encode),
)
positions = st.one_of(st.just("00000000000000001234" + "0000000007"), text)


@st.composite
def entries(draw, names=names):
    pairs = draw(st.lists(st.tuples(names, values), max_size=12))
    entry = [x for pair in pairs for x in pair]
    entry.append(draw(positions))
    return entry


@settings(max_examples=500, **SETTINGS)
@given(streams, entries())
@example(b"s", [b"op", b"c", "position"])
@example(b"s", ["position"])
@example(b"s%d", ["na%me", "va%lue", "%s", b"%d", "p"])
@example(b"s", [b"k", "", b"n", b"", b"i", 0, "p"])
@example(b"s", ["caf\u00e9", "\U0001f600 \x00", b"v", -(2**70), "p"])
@example(b"s", [b"seq", 7, b"v", 1, b"f", 1.5, b"b", True, b"n", None, b"d", Decimal("1.10"), "p"])
@example(b"s", [b"bad", "\ud800", "p"])
@example(b"s", ["\udc00", b"v", "p"])
@example(b"s", [b"a", "\ud800", "\udc00", b"v", "p"])
@example(b"s", [b"a", b"1", b"b"])  # an even count: no position
@example(b"s", [])
def test_compiled_xadd_command_packs_what_the_reference_packs(stream, entry):
    assert_same(stream, entry)


@settings(max_examples=200, **SETTINGS)
@given(streams, entries(names | other_names))
@example(b"s", [1, b"a", True, b"b", "p"])
@example(b"s", [1.0, b"a", "p"])
@example(b"s", [[1], b"a", "p"])
def test_names_of_other_types_pack_alike(stream, entry):
    assert_same(stream, entry)


@settings(max_examples=100, **SETTINGS)
@given(streams, entries())
def test_tuples_and_other_sequences_pack_alike(stream, entry):
    assert_same(stream, tuple(entry))


@settings(max_examples=100, **SETTINGS)
@given(streams, st.lists(st.tuples(st.binary(max_size=8), st.binary(max_size=16)), max_size=6))
def test_the_command_is_what_hiredis_packs(stream, pairs):
    entry = [x for pair in pairs for x in pair] + ["pos"]
    want = hiredis.pack_command((b"XADD", stream, b"*", *entry[:-1]))
    assert compiled_resp().xadd_command(stream, entry) == want == lane.xadd_command(stream, entry)


@pytest.mark.both_paths
def test_the_lane_packs_with_the_compiled_code_unless_pure_is_forced(monkeypatch):
    compiled = compiled_resp()
    if speedups._forced_pure():
        assert lane.pack_entries is lane.pack_past
    else:
        assert lane.pack_entries is compiled.pack_past
    monkeypatch.setenv(speedups.PURE_ENV, "1")
    assert speedups.load("cdc.sink._resp") is None
    monkeypatch.setenv(speedups.PURE_ENV, "0")
    assert speedups.load("cdc.sink._resp") is compiled


def test_equal_names_of_other_types_pack_as_the_reference_packs_them():
    """The reference keeps one format per (stream, names): 1 and True, 1 and 1.0 are the same key to it."""
    compiled = compiled_resp()
    for entry in ([1, b"a", "p"], [True, b"a", "p"], [1.0, b"a", "p"], [b"x", b"a", "p"], [[1], b"a", "p"]):
        assert outcome(compiled.xadd_command, b"quirk", entry) == outcome(lane.xadd_command, b"quirk", entry)


def reply_item():
    """One reply inside an EXEC's array, as Redis writes it: entry IDs and OKs, and what must be parsed."""
    return st.one_of(st.binary(max_size=12).map(lambda b: b"$%d\r\n%s\r\n" % (len(b), b)),
                     st.sampled_from([b"+OK\r\n", b"+QUEUED\r\n", b"$-1\r\n", b":7\r\n", b"*0\r\n",
                                      b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
                                      b"$1\r\n\r\n\r\n", b"$2\r\n\r\n\r\n", b"$03\r\nabc\r\n"]))


@settings(max_examples=300, **SETTINGS)
@given(st.lists(reply_item(), max_size=6), st.integers(0, 7), st.integers(0, 200), st.binary(max_size=6))
def test_an_exec_reply_is_checked_unparsed_only_when_all_its_replies_are_strings(items, count, cut, more):
    """`plain_array_end`, compiled and pure, agree; an end is given only where hiredis reads exactly
    `count` bulk or simple strings and ends there, and -2 (read on) only where hiredis needs more too."""
    data = b"*%d\r\n" % len(items) + b"".join(items) + more
    for sample in (data, data[:cut]):
        got = lane.plain_array_end(sample, count)
        assert compiled_resp().plain_array_end(sample, count) == got
        reader = hiredis.Reader()
        reader.feed(sample)
        try:
            parsed = reader.gets()
        except hiredis.ProtocolError:
            parsed = "bad"
        if got >= 0:
            assert type(parsed) is list and len(parsed) == count and all(type(r) is bytes for r in parsed)
            rest = hiredis.Reader()
            rest.feed(sample[:got])
            assert rest.gets() == parsed and rest.gets() is False  # it ends exactly there
        elif got == -2:
            assert parsed is False  # hiredis too needs more
        # -1: parsed as before, whatever it holds


def ordered_positions():
    """Positions as the bridge writes them (commit LSN, seq; increasing in a batch), and odd ones."""
    return st.one_of(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 10**10 - 1)).map(
        lambda p: f"{p[0]:020d}{p[1]:010d}"), text)


@settings(max_examples=300, **SETTINGS)
@given(streams, st.lists(st.tuples(entries(), ordered_positions()), max_size=8), st.lists(ordered_positions(), max_size=4))
@example(b"s", [([b"a", b"1", "p"], "00000000000000000100" + "0000000000")], ["00000000000000000100" + "0000000000"])
@example(b"s", [([b"bad", "\ud800", "p"], "1"), ([b"a", b"1", "p"], "2")], ["1", ""])
@example(b"s", [([b"a", b"1", "p"], "5"), ([b"a", b"2", "p"], "3"), ([b"a", b"3", "p"], "6")], ["4", "2"])
def test_packed_entries_are_what_the_reference_packs_from_the_entries(stream, appended, helds):
    """The compiled `Packed` packs each entry as it is appended and lets it go; the pure one keeps the
    entries and packs them when asked: the same commands and positions past any mark, the same count and
    last position, and an entry neither can pack is refused alike, leaving what was appended before."""
    compiled = compiled_resp().Packed(stream)
    pure = lane.Packed(stream)
    for entry, pos in appended:
        entry = [*entry[:-1], pos]
        outcomes = []
        for packed in (compiled, pure):
            try:
                packed.append(list(entry))
                outcomes.append(None)
            except Exception as exc:
                outcomes.append((type(exc), str(exc)))
        if outcomes[1] is not None and outcomes[0] is None:
            # the reference only packs when asked: it refuses there; the compiled one refused at once
            pytest.fail(f"the compiled Packed took what the reference cannot pack: {entry!r}")
        if outcomes[0] is not None:
            assert outcomes[0] == outcome(lane.xadd_command, stream, entry)
            if outcomes[1] is None:
                pure._entries.pop()  # the reference would refuse it when packing: it was never appended
        entry[0:0] = [b"mutated", b"after"]  # appended as it was: a later change to the list is not seen
    assert compiled.count == pure.count and compiled.last == pure.last
    for held in ["", *helds]:
        assert compiled.past(held) == pure.past(held)
    copy = compiled.copy()
    compiled.clear()
    assert (compiled.count, compiled.last, compiled.past("")) == (0, "", (b"", []))
    assert copy.past("") == pure.past("") and copy.count == pure.count
    compiled.append([b"a", b"b", "p"])
    assert compiled.past("") == (lane.xadd_command(stream, [b"a", b"b", "p"]), ["p"]), "cleared: filled again"


def test_a_packed_entry_needs_a_str_position_alike():
    for packed in (compiled_resp().Packed(b"s"), lane.Packed(b"s")):
        with pytest.raises(TypeError, match="position is a str, not int"):
            packed.append([b"a", b"b", 7])
        assert packed.count == 0


def test_a_packed_batch_packs_alike_after_its_buffers_grew_and_shrank():
    """A batch of many large entries grows the buffers; clearing a quiet batch again and again halves them
    back: what is appended after either is packed as the reference packs it."""
    compiled, pure = compiled_resp().Packed(b"s"), lane.Packed(b"s")
    for rounds, size in ((1, 3000), (12, 0), (1, 5), (1, 3000), (1, 2)):
        for _ in range(rounds):
            for packed in (compiled, pure):
                packed.clear()
        for i in range(size):
            entry = [b"data", b"x" * (i % 2000), b"seq", i, f"{i:030d}"]
            compiled.append(entry)
            pure.append(entry)
        assert compiled.past("") == pure.past("") and compiled.past(f"{size // 2:030d}") == pure.past(f"{size // 2:030d}")
        assert compiled.count == pure.count == size and compiled.last == pure.last
