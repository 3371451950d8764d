"""Tests for cdc.source.pgoutput: exact wire layouts, round trips, truncation, fuzz."""

from __future__ import annotations

import copy
import pickle
import timeit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc.source import pgoutput as po
from cdc.source.lsn import Lsn
from cdc.source.pgoutput import UNCHANGED_TOAST, DecodeError, PgOutputDecoder
from pgoutput_encoder import encode, is_streamed

# cdc.source.pgoutput has no compiled twin and runs the same on both paths (the compiled code's own reading is held to
# it by tests/bridge/test_compiled.py): once is enough
pytestmark = pytest.mark.one_path

# 2024-01-02 03:04:05.678901 UTC in microseconds since 2000-01-01 UTC.
TS = 757479845678901
TS_HEX = "0002b0ec85204f35"


def h(text: str) -> bytes:
    """Hex with spaces and '|' allowed as separators, for readable layouts."""
    return bytes.fromhex(text.replace("|", " "))


def streaming_decoder(xid: int = 0x2E0) -> PgOutputDecoder:
    dec = PgOutputDecoder()
    dec.decode(b"S" + xid.to_bytes(4, "big") + b"\x01")
    return dec


# -- Exact wire layouts, written by hand -------------------------------------------


def test_begin_layout():
    data = b"B" + h("00000000 016B3748") + h(TS_HEX) + h("000002E0")
    assert po.decode(data) == po.Begin(Lsn.parse("0/16B3748"), TS, 736)
    assert str(po.decode(data).final_lsn) == "0/16B3748"


def test_commit_layout():
    data = b"C" + b"\x00" + h("00000000 016B3748") + h("00000000 016B3778") + h(TS_HEX)
    assert po.decode(data) == po.Commit(
        0, Lsn.parse("0/16B3748"), Lsn.parse("0/16B3778"), TS
    )


def test_relation_layout():
    data = (
        b"R"
        + h("00004001")
        + b"public\x00items\x00"
        + b"d"
        + h("0002")
        + b"\x01" + b"id\x00" + h("00000017") + h("FFFFFFFF")
        + b"\x00" + b"name\x00" + h("00000413") + h("0000000E")
    )
    assert po.decode(data) == po.Relation(
        relid=16385,
        namespace="public",
        name="items",
        replica_identity="d",
        columns=(
            po.Column(True, "id", 23, -1),
            po.Column(False, "name", 1043, 14),
        ),
    )


def test_insert_layout_all_value_kinds():
    data = (
        b"I"
        + h("00004001")
        + b"N"
        + h("0005")
        + b"t" + h("00000002") + b"42"
        + b"n"
        + b"u"
        + b"b" + h("00000003") + h("010203")
        + b"t" + h("00000005") + h("C3A9 E282AC")  # "é€" in UTF-8
    )
    assert po.decode(data) == po.Insert(16385, ("42", None, UNCHANGED_TOAST, b"\x01\x02\x03", "é€"))


def test_insert_empty_tuple_and_empty_strings():
    assert po.decode(b"I" + h("00000001") + b"N" + h("0000")) == po.Insert(1, ())
    data = b"I" + h("00000001") + b"N" + h("0002") + b"t" + h("00000000") + b"b" + h("00000000")
    assert po.decode(data) == po.Insert(1, ("", b""))


def test_update_layouts():
    plain = b"U" + h("00004001") + b"N" + h("0001") + b"t" + h("00000001") + b"x"
    assert po.decode(plain) == po.Update(16385, None, None, ("x",))
    key = (
        b"U" + h("00004001")
        + b"K" + h("0002") + b"t" + h("00000001") + b"1" + b"n"
        + b"N" + h("0002") + b"t" + h("00000001") + b"2" + b"u"
    )
    assert po.decode(key) == po.Update(16385, "K", ("1", None), ("2", UNCHANGED_TOAST))
    full = b"U" + h("00004001") + b"O" + h("0000") + b"N" + h("0000")
    assert po.decode(full) == po.Update(16385, "O", (), ())


def test_delete_layouts():
    data = b"D" + h("00004001") + b"K" + h("0002") + b"t" + h("00000001") + b"7" + b"n"
    assert po.decode(data) == po.Delete(16385, "K", ("7", None))
    data = b"D" + h("00004001") + b"O" + h("0001") + b"n"
    assert po.decode(data) == po.Delete(16385, "O", (None,))


def test_truncate_layout():
    data = b"T" + h("00000002") + b"\x03" + h("00004001 00004002")
    assert po.decode(data) == po.Truncate(True, True, (16385, 16386))
    data = b"T" + h("00000001") + b"\x02" + h("00004001")
    assert po.decode(data) == po.Truncate(False, True, (16385,))


def test_message_layout():
    data = b"M" + b"\x01" + h("00000000 016B3750") + b"pfx\x00" + h("00000005") + b"hello"
    assert po.decode(data) == po.Message(True, Lsn.parse("0/16B3750"), "pfx", b"hello")
    data = b"M" + b"\x00" + h("00000001 00000000") + b"\x00" + h("00000000")
    assert po.decode(data) == po.Message(False, Lsn.parse("1/0"), "", b"")


def test_origin_and_type_layouts():
    data = b"O" + h("00000000 0000ABCD") + b"node_a\x00"
    assert po.decode(data) == po.Origin(Lsn(0xABCD), "node_a")
    data = b"Y" + h("00004005") + b"public\x00mood\x00"
    assert po.decode(data) == po.Type(16389, "public", "mood")


def test_streamed_layouts():
    dec = PgOutputDecoder()
    assert dec.decode(b"S" + h("000002E0") + b"\x01") == po.StreamStart(736, True)
    assert dec.streaming and dec.stream_xid == 736
    insert = b"I" + h("000002E0") + h("00004001") + b"N" + h("0001") + b"t" + h("00000001") + b"a"
    assert dec.decode(insert) == po.Insert(16385, ("a",), xid=736)
    message = b"M" + h("000002E0") + b"\x01" + h("00000000 00000010") + b"p\x00" + h("00000001") + b"z"
    assert dec.decode(message) == po.Message(True, Lsn(16), "p", b"z", xid=736)
    relation = b"R" + h("000002E0") + h("00004001") + b"\x00t\x00f" + h("0000")
    assert dec.decode(relation) == po.Relation(16385, "", "t", "f", (), xid=736)
    truncate = b"T" + h("000002E0") + h("00000001") + b"\x01" + h("00004001")
    assert dec.decode(truncate) == po.Truncate(True, False, (16385,), xid=736)
    assert dec.decode(b"E") == po.StreamStop()
    assert not dec.streaming and dec.stream_xid is None
    # Outside the block the same bytes mean something else: the xid is read as the relid.
    assert dec.decode(b"S" + h("000002E0") + b"\x00") == po.StreamStart(736, False)
    commit = b"c" + h("000002E0") + b"\x00" + h("00000000 00000100 00000000 00000128") + h(TS_HEX)
    assert dec.decode(commit) == po.StreamCommit(736, 0, Lsn(0x100), Lsn(0x128), TS)
    assert dec.decode(b"A" + h("000002E0 000002E1")) == po.StreamAbort(736, 737)


def test_two_phase_layouts():
    lsns = h("00000000 00000100") + h("00000000 00000200")
    gid = b"gid-1\x00"
    assert po.decode(b"b" + lsns + h(TS_HEX) + h("00000007") + gid) == po.BeginPrepare(
        Lsn(0x100), Lsn(0x200), TS, 7, "gid-1"
    )
    assert po.decode(b"P" + b"\x00" + lsns + h(TS_HEX) + h("00000007") + gid) == po.Prepare(
        0, Lsn(0x100), Lsn(0x200), TS, 7, "gid-1"
    )
    assert po.decode(b"K" + b"\x00" + lsns + h(TS_HEX) + h("00000007") + gid) == po.CommitPrepared(
        0, Lsn(0x100), Lsn(0x200), TS, 7, "gid-1"
    )
    assert po.decode(b"p" + b"\x00" + lsns + h(TS_HEX) + h("00000007") + gid) == po.StreamPrepare(
        0, Lsn(0x100), Lsn(0x200), TS, 7, "gid-1"
    )
    data = b"r" + b"\x00" + lsns + h(TS_HEX) + h("0000000000000001") + h("00000007") + gid
    assert po.decode(data) == po.RollbackPrepared(0, Lsn(0x100), Lsn(0x200), TS, 1, 7, "gid-1")


def test_accepts_bytearray_and_memoryview():
    data = b"I" + h("00000001") + b"N" + h("0001") + b"t" + h("00000001") + b"a"
    assert po.decode(bytearray(data)) == po.decode(memoryview(data)) == po.Insert(1, ("a",))


# -- Errors -----------------------------------------------------------------------


def test_error_names_message_and_position():
    data = b"I" + h("00004001") + b"N" + h("0001") + b"t" + h("0000")
    with pytest.raises(DecodeError) as exc:
        po.decode(data)
    assert str(exc.value) == "truncated insert message: expected 4 bytes at offset 9, got 2"
    assert isinstance(exc.value, ValueError)


def test_error_value_cut_short():
    data = b"I" + h("00004001") + b"N" + h("0001") + b"t" + h("00000010") + b"abc"
    with pytest.raises(DecodeError, match=r"^truncated insert message: expected 16 bytes at offset 13, got 3$"):
        po.decode(data)


def test_error_fixed_fields_name_the_cut_field():
    data = b"B" + h("00000000 016B3748") + h("0002")
    with pytest.raises(DecodeError, match=r"^truncated begin message: expected 8 bytes at offset 9, got 2$"):
        po.decode(data)


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        (b"", r"^empty pgoutput message$"),
        (b"Z\x00", r"^unknown pgoutput message type 'Z' \(0x5a\)$"),
        (b"\xff", r"^unknown pgoutput message type"),
        (b"I" + h("00000001") + b"X" + h("0000"), r"^invalid insert message: expected 'N' at offset 5, got 'X'$"),
        (b"U" + h("00000001") + b"Q", r"^invalid update message: expected 'K', 'O' or 'N' at offset 5"),
        (b"U" + h("00000001") + b"K" + h("0000") + b"K" + h("0000"), r"^invalid update message: expected 'N' at offset 8"),
        (b"D" + h("00000001") + b"N" + h("0000"), r"^invalid delete message: expected 'K' or 'O' at offset 5"),
        (b"I" + h("00000001") + b"N" + h("0001") + b"x", r"^invalid insert message: expected a column kind"),
        (b"E\x00", r"^stream stop message has 1 unexpected trailing bytes at offset 1$"),
        (b"I" + h("00000001") + b"N" + h("0000") + b"\x00", r"^insert message has 1 unexpected trailing bytes"),
        (b"O" + h("0000000000000001") + b"abc", r"^truncated origin message: origin name string at offset 9 has no terminating NUL$"),
        (b"I" + h("00000001") + b"N" + h("0001") + b"t" + h("00000001") + b"\xff", r"^invalid insert message: invalid start byte in utf-8 string"),
        (b"Y" + h("00000001") + b"\xc3\x28\x00x\x00", r"^invalid type message: .*utf-8"),
    ],
)
def test_malformed_messages(data, pattern):
    with pytest.raises(DecodeError, match=pattern):
        po.decode(data)


def test_failed_stream_start_leaves_state_alone():
    dec = PgOutputDecoder()
    with pytest.raises(DecodeError):
        dec.decode(b"S\x00\x00")
    assert not dec.streaming
    dec = streaming_decoder()
    with pytest.raises(DecodeError):
        dec.decode(b"E\x00")
    assert dec.streaming


# -- Tuple values --------------------------------------------------------------------


def test_unchanged_toast_is_a_singleton_sentinel():
    assert repr(UNCHANGED_TOAST) == "UNCHANGED_TOAST"
    assert type(UNCHANGED_TOAST)() is UNCHANGED_TOAST
    assert copy.copy(UNCHANGED_TOAST) is UNCHANGED_TOAST
    assert copy.deepcopy(UNCHANGED_TOAST) is UNCHANGED_TOAST
    assert pickle.loads(pickle.dumps(UNCHANGED_TOAST)) is UNCHANGED_TOAST
    insert = po.Insert(1, ("a", UNCHANGED_TOAST))
    assert pickle.loads(pickle.dumps(insert)).new[1] is UNCHANGED_TOAST
    assert copy.deepcopy(insert).new[1] is UNCHANGED_TOAST
    assert UNCHANGED_TOAST != "" and UNCHANGED_TOAST is not None


def test_messages_are_frozen():
    insert = po.Insert(1, ("a",))
    with pytest.raises(AttributeError):
        insert.relid = 2  # type: ignore[misc]


# -- RelationCache -------------------------------------------------------------------


def test_relation_cache():
    cache = po.RelationCache()
    rel = po.Relation(16385, "public", "items", "d", (po.Column(True, "id", 23, -1),))
    cache.update(rel)
    cache.update(po.Type(16389, "public", "mood"))
    assert cache.get(16385) is rel
    assert cache.types[16389].name == "mood"
    assert len(cache) == 1
    newer = po.Relation(16385, "public", "items", "f", ())
    cache.update(newer)
    assert cache.get(16385) is newer
    with pytest.raises(po.UnknownRelationError, match="no relation message seen for relid 99"):
        cache.get(99)
    with pytest.raises(LookupError):
        cache.get(99)
    with pytest.raises(TypeError):
        cache.update(po.Insert(1, ()))  # type: ignore[arg-type]


# -- Hypothesis: every message type round trips --------------------------------------

u32 = st.integers(0, 2**32 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)
u8 = st.integers(0, 255)
lsns = st.integers(0, 2**64 - 1).map(Lsn)
timestamps = st.integers(-(2**63), 2**63 - 1)
cstrings = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20)
xids = st.one_of(st.none(), u32)
values = st.one_of(
    st.none(),
    st.just(UNCHANGED_TOAST),
    st.text(st.characters(codec="utf-8"), max_size=30),
    st.binary(max_size=30),
)
tuples = st.lists(values, max_size=12).map(tuple)

MESSAGES = {
    "begin": st.builds(po.Begin, lsns, timestamps, u32),
    "message": st.builds(po.Message, st.booleans(), lsns, cstrings, st.binary(max_size=50), xids),
    "commit": st.builds(po.Commit, st.just(0), lsns, lsns, timestamps),
    "origin": st.builds(po.Origin, lsns, cstrings),
    "relation": st.builds(
        po.Relation,
        u32,
        cstrings,
        cstrings,
        st.sampled_from("dnfi"),
        st.lists(st.builds(po.Column, st.booleans(), cstrings, u32, i32), max_size=8).map(tuple),
        xids,
    ),
    "type": st.builds(po.Type, u32, cstrings, cstrings, xids),
    "insert": st.builds(po.Insert, u32, tuples, xids),
    "update": st.one_of(
        st.builds(po.Update, u32, st.none(), st.none(), tuples, xids),
        st.builds(po.Update, u32, st.sampled_from(["K", "O"]), tuples, tuples, xids),
    ),
    "delete": st.builds(po.Delete, u32, st.sampled_from(["K", "O"]), tuples, xids),
    "truncate": st.builds(
        po.Truncate, st.booleans(), st.booleans(), st.lists(u32, max_size=6).map(tuple), xids
    ),
    "stream start": st.builds(po.StreamStart, u32, st.booleans()),
    "stream stop": st.just(po.StreamStop()),
    "stream commit": st.builds(po.StreamCommit, u32, st.just(0), lsns, lsns, timestamps),
    "stream abort": st.builds(po.StreamAbort, u32, u32),
    "begin prepare": st.builds(po.BeginPrepare, lsns, lsns, timestamps, u32, cstrings),
    "prepare": st.builds(po.Prepare, st.just(0), lsns, lsns, timestamps, u32, cstrings),
    "commit prepared": st.builds(po.CommitPrepared, st.just(0), lsns, lsns, timestamps, u32, cstrings),
    "rollback prepared": st.builds(
        po.RollbackPrepared, st.just(0), lsns, lsns, timestamps, timestamps, u32, cstrings
    ),
    "stream prepare": st.builds(po.StreamPrepare, st.just(0), lsns, lsns, timestamps, u32, cstrings),
}
ANY_MESSAGE = st.one_of(*MESSAGES.values())


def decoder_for(m: po.PgOutputMessage) -> PgOutputDecoder:
    return streaming_decoder(m.xid) if is_streamed(m) else PgOutputDecoder()  # type: ignore[union-attr]


def test_every_message_type_has_a_strategy():
    assert set(MESSAGES) == set(po._NAMES.values()) - {"logical decoding"} | {"message"}


@pytest.mark.parametrize("kind", sorted(MESSAGES))
@given(data=st.data())
def test_round_trip(kind, data):
    m = data.draw(MESSAGES[kind])
    decoded = decoder_for(m).decode(encode(m))
    assert decoded == m
    assert type(decoded) is type(m)
    for name in getattr(type(m), "__slots__", ()):
        if name.endswith("lsn"):
            assert type(getattr(decoded, name)) is Lsn


@given(ANY_MESSAGE)
def test_every_prefix_is_rejected(m):
    wire = encode(m)
    for i in range(len(wire)):
        dec = decoder_for(m)
        before = dec.streaming
        with pytest.raises(DecodeError):
            dec.decode(wire[:i])
        assert dec.streaming == before


@given(ANY_MESSAGE, st.binary(min_size=1, max_size=8))
def test_trailing_bytes_are_rejected(m, extra):
    with pytest.raises(DecodeError, match="trailing"):
        decoder_for(m).decode(encode(m) + extra)


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=64), st.booleans())
def test_random_bytes_decode_or_raise_decode_error(data, streaming):
    dec = streaming_decoder() if streaming else PgOutputDecoder()
    try:
        dec.decode(data)
    except DecodeError:
        pass


@settings(max_examples=300)
@given(st.sampled_from(sorted(po._DECODERS)), st.binary(max_size=64), st.booleans())
def test_random_bodies_decode_or_raise_decode_error(code, body, streaming):
    dec = streaming_decoder() if streaming else PgOutputDecoder()
    try:
        dec.decode(bytes([code]) + body)
    except DecodeError:
        pass


@settings(max_examples=300)
@given(ANY_MESSAGE, st.data())
def test_corrupted_messages_decode_or_raise_decode_error(m, data):
    wire = bytearray(encode(m))
    i = data.draw(st.integers(0, len(wire) - 1))
    wire[i] = data.draw(u8)
    try:
        decoder_for(m).decode(bytes(wire))
    except DecodeError:
        pass


# -- Speed (reported, not asserted) -------------------------------------------------------


def test_insert_decode_speed(capsys):
    wire = encode(po.Insert(16385, ("12345", "Widget, large", "19.99", "2024-01-02 03:04:05+00", None)))
    dec = PgOutputDecoder()
    assert dec.decode(wire).new[0] == "12345"
    n = 100_000
    best = min(timeit.repeat(lambda: dec.decode(wire), number=n, repeat=5)) / n
    with capsys.disabled():
        print(f"\npgoutput: 5-column insert decodes in {best * 1e6:.2f} us ({1 / best:,.0f}/s)")
