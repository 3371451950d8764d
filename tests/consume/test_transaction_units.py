"""The transaction assembler (pure): whole transactions in commit order, units of their own for what no
END covers, duplicates never handed over, and an incomplete transaction stopping the consumer in time."""

from __future__ import annotations

import orjson
import pytest

from cdc.consume.transactions import IncompleteTransaction, TransactionAssembler
from cdc.sink.entry import parse_entry

TX = "cdc:transactions"
_ids: dict[str, int] = {}


def entry(stream: str, lsn: int, seq: int, xid: int, op: str = "c", **data) -> object:
    _ids[stream] = _ids.get(stream, 0) + 1
    fields = {b"op": op.encode(), b"key": b'{"id":1}', b"data": orjson.dumps(data or {"id": 1}),
              b"lsn": str(lsn).encode(), b"seq": str(seq).encode(), b"xid": str(xid).encode(), b"ts_ms": b"1", b"v": b"1"}
    return parse_entry(stream, f"{_ids[stream]}-0", fields)


def end(lsn: int, seq: int, xid: int, **streams: int):
    counts = {k.replace("_", ":"): v for k, v in streams.items()}
    return entry(TX, lsn, seq, xid, "e", count=sum(counts.values()), streams=counts)


def positions(units) -> list[list[tuple[str, int, int]]]:
    return [[(e.stream, e.lsn, e.seq) for e in u.entries] for u in units]


def test_whole_transactions_in_commit_order_across_streams_only_once_complete():
    a = TransactionAssembler(["cdc:ride", "cdc:rider"], TX, wait_s=5)
    a.add([entry("cdc:ride", 100, 0, 7), entry("cdc:ride", 200, 0, 8)])
    a.add([end(100, 2, 7, cdc_ride=1, cdc_rider=1), end(200, 1, 8, cdc_ride=1)])
    assert a.take(0.0) == []  # the rider entry of 100 is still on its way (another cluster node)
    a.add([entry("cdc:rider", 100, 1, 7)])
    units = a.take(1.0)
    assert positions(units) == [[("cdc:ride", 100, 0), ("cdc:rider", 100, 1)], [("cdc:ride", 200, 0)]]
    assert [u.end.lsn for u in units] == [100, 200]
    assert not a.pending()


def test_streams_not_subscribed_are_ignored_and_an_end_of_none_is_acknowledged_alone():
    a = TransactionAssembler(["cdc:ride"], TX, wait_s=5)
    a.add([end(50, 3, 5, cdc_other=3), entry("cdc:ride", 60, 0, 6), end(60, 2, 6, cdc_ride=1, cdc_other=1)])
    units = a.take(0.0)
    assert positions(units) == [[], [("cdc:ride", 60, 0)]]
    assert [u.end.lsn for u in units] == [50, 60]


def test_snapshot_reads_rebuild_markers_and_messages_are_units_of_their_own_in_stream_order():
    a = TransactionAssembler(["cdc:ride"], TX, wait_s=5)
    a.add([entry("cdc:ride", 10, 0, 0, "r"), entry("cdc:ride", 10, 1, 0, "r"), entry("cdc:ride", 0, 0, 0, "x"),
           entry("cdc:ride", 30, 0, 9), entry("cdc:ride", 31, 0, 0, "m")])
    units = a.take(0.0)
    assert positions(units) == [[("cdc:ride", 10, 0)], [("cdc:ride", 10, 1)], [("cdc:ride", 0, 0)]]
    a.add([end(30, 1, 9, cdc_ride=1)])
    units = a.take(0.1)
    assert positions(units) == [[("cdc:ride", 30, 0)], [("cdc:ride", 31, 0)]]
    assert [u.end is None for u in units] == [False, True]


def test_double_sends_are_acknowledged_never_handed_over_again():
    a = TransactionAssembler(["cdc:ride"], TX, wait_s=5)
    first = [entry("cdc:ride", 100, 0, 7), entry("cdc:ride", 100, 1, 7)]
    again = [entry("cdc:ride", 100, 0, 7), entry("cdc:ride", 100, 1, 7)]
    a.add(first + again + [end(100, 2, 7, cdc_ride=2), end(100, 2, 7, cdc_ride=2)])
    units = a.take(0.0)
    assert positions(units)[0] == [("cdc:ride", 100, 0), ("cdc:ride", 100, 1)]
    assert sum(len(u.entries) for u in units) == 2
    assert sum(len(u.records) for u in units) == 6  # all acknowledged
    assert not a.pending()


def test_an_entry_whose_end_is_behind_is_handed_over_alone():
    """Its END was acknowledged already (a cluster's acknowledgement cut in two): the checkpoint skips it."""
    a = TransactionAssembler(["cdc:ride"], TX, wait_s=5)
    a.add([entry("cdc:ride", 90, 0, 6), entry("cdc:ride", 100, 0, 7), end(100, 1, 7, cdc_ride=1)])
    units = a.take(0.0)
    assert positions(units) == [[("cdc:ride", 90, 0)], [("cdc:ride", 100, 0)]]
    assert units[0].end is None


def test_a_transaction_missing_an_entry_stops_after_the_wait_never_handed_over_in_part():
    a = TransactionAssembler(["cdc:ride", "cdc:rider"], TX, wait_s=2)
    a.add([entry("cdc:ride", 100, 0, 7), end(100, 2, 7, cdc_ride=1, cdc_rider=1),
           entry("cdc:rider", 200, 0, 8), end(200, 1, 8, cdc_rider=1)])
    assert a.take(10.0) == [] and a.take(11.9) == []
    with pytest.raises(IncompleteTransaction) as caught:
        a.take(12.1)
    assert "transaction 7 (commit LSN 100) is incomplete" in str(caught.value)
    assert "counts 1 entries in cdc:rider, 0 arrived" in str(caught.value)
    assert caught.value.exit_code == 6


def test_entries_whose_end_is_not_written_yet_wait_for_it_past_the_wait_until_the_mark_passes_them():
    """The END can come in the bridge's next batch, after a restart: no loss while the transactions stream's
    high-water mark is below the entries (the consumer sets `ends_written` from it); once it passes them
    with no END read, their END is behind (acknowledged, or written before END records were): alone."""
    a = TransactionAssembler(["cdc:ride", "cdc:rider"], TX, wait_s=1)
    a.add([entry("cdc:rider", 101, 1, 7), entry("cdc:ride", 100, 0, 6)])
    assert a.take(0.0) == [] and a.take(600.0) == [], "no END yet: waiting, never a loss"
    assert (a.unended.stream, a.unended.lsn, a.since) == ("cdc:ride", 100, 0.0)
    assert a.waiting_for_end(0.6, 0.5) and not a.waiting_for_end(0.4, 0.5)
    a.ends_written = 100  # the mark passed the first, not the second
    assert positions(a.take(601.0)) == [[("cdc:ride", 100, 0)]]
    assert (a.unended.lsn, a.since) == (101, 601.0), "the second waits on, its wait starting now"
    a.add([end(101, 2, 7, cdc_rider=1)])
    assert positions(a.take(602.0)) == [[("cdc:rider", 101, 1)]] and a.unended is None and a.since is None


def test_a_wait_for_an_end_does_not_count_towards_the_wait_for_an_incomplete_transaction():
    a = TransactionAssembler(["cdc:ride", "cdc:rider"], TX, wait_s=1)
    a.add([entry("cdc:ride", 100, 0, 7)])
    assert a.take(0.0) == [] and a.take(300.0) == []
    a.add([end(100, 2, 7, cdc_ride=1, cdc_rider=1)])  # its rider entry is on its way (another cluster node)
    assert a.take(300.5) == [] and a.take(301.0) == []
    with pytest.raises(IncompleteTransaction):
        a.take(301.6)


def test_progress_restarts_the_wait():
    a = TransactionAssembler(["cdc:ride"], TX, wait_s=1)
    for t in range(10):
        a.add([entry("cdc:ride", 100 + t, 0, 7 + t)])
        assert a.take(t * 0.9) == []
        a.add([end(100 + t, 1, 7 + t, cdc_ride=1)])
        assert len(a.take(t * 0.9 + 0.5)) == 1


def test_an_end_the_rebuild_of_cdc_recover_left_incomplete_is_acknowledged_at_its_marker():
    a = TransactionAssembler(["cdc:ride", "cdc:rider"], TX, wait_s=1)
    a.add([entry("cdc:ride", 100, 0, 7), end(100, 2, 7, cdc_ride=1, cdc_rider=1)])  # the rider entry was lost
    assert a.take(0.0) == []
    a.add([entry(TX, 150, 0, 0, "x"), entry("cdc:ride", 150, 0, 0, "x"), entry("cdc:rider", 150, 0, 0, "x")])
    units = a.take(0.5)
    handed = [p for unit in positions(units) for p in unit]
    assert [p for p in handed if p[0] == "cdc:ride"] == [("cdc:ride", 100, 0), ("cdc:ride", 150, 0)], "each stream in order"
    assert ("cdc:rider", 150, 0) in handed and len(units) == 5  # and the END and the marker, acknowledged
    assert a.superseded == 1 and not a.pending()


def test_a_stream_is_read_again_while_fewer_than_a_batch_of_its_entries_wait_or_while_the_first_end_waits_for_it():
    """Reads stay few and full (each stream topped up to about `limit`), and no buffer runs far ahead."""
    a = TransactionAssembler(["cdc:ride", "cdc:rider"], TX, wait_s=5)
    assert a.wanted(2) == ["cdc:ride", "cdc:rider", TX]
    a.add([entry("cdc:ride", 100 + i, 0, 7 + i) for i in range(3)] + [entry("cdc:rider", 100, 1, 7)])
    assert a.wanted(2) == ["cdc:rider", TX], "the ride stream has a batch waiting: not read"
    a.add([end(100, 2, 7, cdc_ride=1, cdc_rider=2), end(101, 1, 8, cdc_ride=1)])
    assert a.take(0.0) == [] and a.short == "cdc:rider"
    assert a.wanted(1) == ["cdc:rider"], "END records enough; the one the first END waits for is read"
