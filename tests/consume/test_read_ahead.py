"""`Consumer.run` reads the next batch while one is handled: the order of the stream, each entry handled once,
a failing entry retried before anything behind it (the batch read ahead is dropped and read again from the
pending list), and on stop the batch read ahead stays pending, handed over first at the next start."""

from __future__ import annotations

import threading
import time

import pytest

from cdc.consume.consumer import Consumer
from cdc.demo.local import wait_for

pytestmark = pytest.mark.integration

N = 1000


def backlog(client, n: int = N) -> None:
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd("s", {"op": "c", "key": '{"i": %d}' % i, "data": '{"i": %d}' % i, "lsn": str(100 + i), "seq": "0"})
    pipe.execute()


def consumer(client, name: str = "c1") -> Consumer:
    return Consumer(client, ["s"], "g", name, count=100, block_ms=50, max_deliveries=3)


def pending(client) -> int:
    return client.xpending("s", "g")["pending"]


def read_ahead(client, stop: threading.Event) -> bool:
    """Inside the handler of the first batch: True once the next batch was read meanwhile (else the run stops)."""
    try:
        wait_for(lambda: pending(client) == 200, 20, "the next batch to be read while this one is handled")
        return True
    except TimeoutError:
        stop.set()
        return False


def recording(seen: list[int], stop: threading.Event, first=None):
    """A handler that records each entry's number in `seen` and stops the run once all N are seen;
    `first(entries)` runs before it records a batch (to wait for the read ahead, or to fail)."""
    def handle(entries):
        if first is not None:
            first(entries)
        seen.extend(e.key["i"] for e in entries)
        if len(seen) >= N:
            stop.set()

    return handle


def test_the_next_batch_is_read_while_one_is_handled_in_the_streams_order(env):
    client = env.redis
    backlog(client)
    c = consumer(client)
    c.create_group("0")
    seen: list[int] = []
    stop = threading.Event()

    ahead: list[bool] = []

    def first_batch_waits(entries):
        if not seen:  # the first batch in hand: the next one is read meanwhile
            ahead.append(read_ahead(client, stop))

    c.run(recording(seen, stop, first_batch_waits), stop)
    assert ahead == [True]
    assert seen == list(range(N))
    assert pending(client) == 0 and c.acked == N


def test_a_failure_drops_the_batch_read_ahead_and_nothing_overtakes_the_failing_entry(env):
    client = env.redis
    backlog(client)
    c = consumer(client)
    c.create_group("0")
    seen: list[int] = []
    failed: list[int] = []
    stop = threading.Event()

    def work_or_fail(entries):
        time.sleep(0.005)  # a handler's work on a batch, as a database's (long enough for the read ahead to pay)
        for e in entries:
            if e.key["i"] in (150, 420) and failed.count(e.key["i"]) < 2:  # fails twice, then works
                failed.append(e.key["i"])
                raise ValueError(f"entry {e.key['i']}")

    c.run(recording(seen, stop, work_or_fail), stop)
    assert seen == list(range(N)), "each once, in the stream's order"
    assert failed == [150, 150, 420, 420] and client.xlen("cdc:dlq:g") == 0
    assert pending(client) == 0


def test_on_stop_the_batch_read_ahead_stays_pending_and_comes_first_at_the_next_start(env):
    client = env.redis
    backlog(client)
    first = consumer(client)
    first.create_group("0")
    seen: list[int] = []
    stop = threading.Event()

    ahead: list[bool] = []

    def handle_one(entries):
        ahead.append(read_ahead(client, stop))
        seen.extend(e.key["i"] for e in entries)
        stop.set()

    first.run(handle_one, stop)
    assert ahead == [True]
    assert seen == list(range(100)) and pending(client) == 100, "the batch read ahead, not handled, is pending"
    second = consumer(client)  # the same name, as `cdc consume` restarted
    stop = threading.Event()
    second.run(recording(seen, stop), stop)
    assert seen == list(range(N)) and pending(client) == 0
