"""Tests for cdc.source.framing: CopyData framing of streaming replication."""

from __future__ import annotations

import datetime as dt
import struct
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdc.source import framing as wp
from cdc.source.lsn import Lsn

# cdc.source.framing has no compiled twin and runs the same on both paths (the compiled code's own reading is held to
# it by tests/bridge/test_compiled.py): once is enough
pytestmark = pytest.mark.one_path

# 2024-01-02 03:04:05.678901 UTC in microseconds since 2000-01-01 UTC.
TS = 757479845678901
TS_HEX = "0002b0ec85204f35"


def test_parse_xlogdata():
    payload = b"B" + bytes(20)
    buf = (
        b"w"
        + bytes.fromhex("00000000016B3748")
        + bytes.fromhex("00000001000000FF")
        + bytes.fromhex(TS_HEX)
        + payload
    )
    msg = wp.parse_copy_data(buf)
    assert msg == wp.XLogData(Lsn.parse("0/16B3748"), Lsn.parse("1/FF"), TS, payload)
    assert type(msg.data_start) is Lsn and type(msg.wal_end) is Lsn
    assert type(msg.payload) is bytes


def test_parse_xlogdata_from_memoryview_and_empty_payload():
    buf = b"w" + bytes(8) + bytes(8) + bytes(8)
    msg = wp.parse_copy_data(memoryview(buf))
    assert msg == wp.XLogData(Lsn(0), Lsn(0), 0, b"")
    assert type(msg.payload) is bytes


@pytest.mark.parametrize("reply", [0, 1])
def test_parse_keepalive(reply):
    buf = b"k" + bytes.fromhex("00000000016B3778") + bytes.fromhex(TS_HEX) + bytes([reply])
    assert wp.parse_copy_data(buf) == wp.PrimaryKeepalive(
        Lsn.parse("0/16B3778"), TS, bool(reply)
    )


@pytest.mark.parametrize(
    ("buf", "pattern"),
    [
        (b"", r"^empty copy data message$"),
        (b"w" + bytes(23), r"^truncated xlogdata message: expected at least 25 bytes, got 24$"),
        (b"k" + bytes(16), r"^invalid keepalive message: expected 18 bytes, got 17$"),
        (b"k" + bytes(18), r"^invalid keepalive message: expected 18 bytes, got 19$"),
        (b"x" + bytes(30), r"^unknown replication message type 'x' \(0x78\)$"),
    ],
)
def test_parse_errors(buf, pattern):
    with pytest.raises(wp.WalProtocolError, match=pattern):
        wp.parse_copy_data(buf)
    assert issubclass(wp.WalProtocolError, ValueError)


@given(st.binary(max_size=40))
def test_random_bytes_parse_or_raise_protocol_error(buf):
    try:
        wp.parse_copy_data(buf)
    except wp.WalProtocolError:
        pass


def test_standby_status_update_layout():
    buf = wp.standby_status_update(
        Lsn.parse("0/16B3748"),
        Lsn.parse("0/16B3740"),
        Lsn.parse("0/16B3700"),
        now_ts=TS,
        reply_requested=True,
    )
    assert buf == (
        b"r"
        + bytes.fromhex("00000000016B3748")
        + bytes.fromhex("00000000016B3740")
        + bytes.fromhex("00000000016B3700")
        + bytes.fromhex(TS_HEX)
        + b"\x01"
    )
    assert len(buf) == 34


def test_standby_status_update_defaults_to_now_and_no_reply():
    before = wp.pg_now_us()
    buf = wp.standby_status_update(1, 2, 3)
    after = wp.pg_now_us()
    tag, write, flush, apply, clock, reply = struct.unpack(">cQQQqB", buf)
    assert (tag, write, flush, apply, reply) == (b"r", 1, 2, 3, 0)
    assert before <= clock <= after


def test_standby_status_update_rejects_out_of_range():
    with pytest.raises(ValueError):
        wp.standby_status_update(-1, 0, 0, now_ts=0)
    with pytest.raises(ValueError):
        wp.standby_status_update(2**64, 0, 0, now_ts=0)


def test_timestamp_conversions():
    assert wp.pg_ts_to_unix_ms(0) == 946_684_800_000
    expected = dt.datetime(2024, 1, 2, 3, 4, 5, 678000, tzinfo=dt.timezone.utc)
    assert wp.pg_ts_to_unix_ms(TS) == int(expected.timestamp() * 1000) == 1704164645678
    # Before 2000 the timestamp is negative; the conversion floors.
    assert wp.pg_ts_to_unix_ms(-1) == 946_684_799_999
    assert wp.unix_ms_to_pg_ts(1704164645678) == TS - 901
    assert wp.pg_ts_to_unix_ms(wp.unix_ms_to_pg_ts(1704164645678)) == 1704164645678


def test_pg_now_is_current_time():
    now_ms = time.time() * 1000
    assert abs(wp.pg_ts_to_unix_ms(wp.pg_now_us()) - now_ms) < 5_000
