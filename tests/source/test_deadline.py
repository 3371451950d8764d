"""Deadlines on PostgreSQL connections, against a real server behind a proxy that can go silent."""

from __future__ import annotations

import time

import psycopg
import pytest

from cdc.source.deadline import ConnectionSilent, bounded
from proxy import FreezableProxy

pytestmark = [pytest.mark.integration, pytest.mark.one_path]


@pytest.fixture
def proxied(postgres):
    proxy = FreezableProxy(postgres.port)
    conn = psycopg.connect(f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres", autocommit=True)
    yield proxy, conn
    conn.close()
    proxy.close()


def test_a_call_that_gets_no_answer_is_cut_at_its_deadline(proxied):
    proxy, conn = proxied
    proxy.freeze()  # the query's bytes are dropped; nothing is closed
    started = time.monotonic()
    with pytest.raises(ConnectionSilent, match=r"no answer from postgres in 1s \(a probe\)"):
        with bounded(conn, 1.0, "a probe"):
            conn.execute("SELECT 1")
    assert 0.9 <= time.monotonic() - started < 3


def test_a_call_that_is_answered_in_time_is_left_alone(proxied):
    _, conn = proxied
    with bounded(conn, 1.0, "a probe"):
        assert conn.execute("SELECT 1").fetchone() == (1,)
    time.sleep(1.2)  # past the deadline: the expired timer must not cut the connection afterwards
    assert conn.execute("SELECT 2").fetchone() == (2,)


def test_other_errors_pass_through(proxied):
    _, conn = proxied
    with pytest.raises(psycopg.errors.UndefinedTable):
        with bounded(conn, 5.0, "a probe"):
            conn.execute("SELECT * FROM no_such_table")
