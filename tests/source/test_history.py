"""Whose history Redis' positions belong to: the pure judgement (`cdc.source.history.divergence`)."""

from __future__ import annotations

import pytest

from cdc.source.history import ServerHistory, divergence, parse_history
from cdc.source.lsn import Lsn

pytestmark = pytest.mark.one_path

HISTORY_3 = "1\t0/3000110\tno recovery target specified\n\n2\t0/5000000\tat restore point \"x\"\n"


def test_parse_history_gives_each_ancestor_timelines_switch_point():
    assert parse_history(HISTORY_3) == {1: Lsn.parse("0/3000110"), 2: Lsn.parse("0/5000000")}
    assert parse_history("") == {}


def server(timeline: int = 3, wal: str | None = "0/6000000", system_id: str = "7") -> ServerHistory:
    return ServerHistory(system_id, timeline, parse_history(HISTORY_3), None if wal is None else Lsn.parse(wal))


def test_the_same_history_has_nothing_diverged():
    assert divergence("7", 3, Lsn.parse("0/5FFFFFF"), server()) is None
    assert divergence("7", 3, Lsn.parse("0/6000000"), server()) is None


def test_a_timeline_that_branched_off_at_or_above_redis_record_diverged_nothing():
    assert divergence("7", 1, Lsn.parse("0/3000110"), server()) is None
    assert divergence("7", 2, Lsn.parse("0/4000000"), server()) is None


def test_a_timeline_that_branched_off_below_redis_record_names_the_range():
    found = divergence("7", 1, Lsn.parse("0/3000111"), server())
    assert (found.since, found.held) == (Lsn.parse("0/3000110"), Lsn.parse("0/3000111"))
    assert "timeline 3 branched off timeline 1 at 0/3000110" in found.cause
    found = divergence("7", 2, Lsn.parse("0/5000200"), server())
    assert found.since == Lsn.parse("0/5000000")


def test_another_system_an_older_timeline_or_a_timeline_outside_the_history_diverged_from_an_unknown_point():
    for recorded in (("8", 3), ("7", 4)):
        found = divergence(*recorded, Lsn.parse("0/100"), server())
        assert found is not None and found.since is None, recorded
    found = divergence("7", 2, Lsn.parse("0/100"), ServerHistory("7", 3, {1: Lsn.parse("0/50")}, None))
    assert found is not None and "not in the history" in found.cause


def test_a_server_whose_wal_has_not_reached_redis_record_diverged():
    found = divergence("7", 3, Lsn.parse("0/6000001"), server())
    assert (found.since, found.held) == (Lsn.parse("0/6000000"), Lsn.parse("0/6000001"))
    assert divergence("7", 3, Lsn.parse("0/7000000"), server(wal=None)) is None  # a standby: no insert position
