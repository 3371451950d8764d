"""A transaction-mode consumer against END records written by hand, in the documented format: a failing
transaction is dead-lettered whole, an incomplete one stops the consumer with nothing of it applied, a
killed consumer loses and repeats nothing, and a group started at "$" cuts no transaction in two."""

from __future__ import annotations

import logging
import threading
import urllib.request

import orjson
import pytest

from cdc.consume import Consumer, TransactionalHandler
from cdc.consume.transactions import IncompleteTransaction
from cdc.demo.local import wait_for
from redis_cluster import three_node_cluster

# the consumer parses replies on the path the run picked (cdc.sink._entries or cdc.sink.entry): both run
pytestmark = [pytest.mark.integration, pytest.mark.both_paths]

TX, A, B, C = "cdc:transactions", "cdc:a", "cdc:b", "cdc:c"  # C: a stream the consumer does not read


class Source:
    """Writes entries and END records as the bridge does (commit LSNs going up)."""

    def __init__(self, client) -> None:
        self.client, self.lsn, self.xid = client, 1000, 500

    def transaction(self, *rows: tuple[str, dict], end: bool = True, counts: dict | None = None) -> int:
        self.lsn, self.xid = self.lsn + 100, self.xid + 1
        held: dict[str, int] = {}
        for seq, (stream, data) in enumerate(rows):
            self.client.xadd(stream, self.fields("c", data, seq))
            held[stream] = held.get(stream, 0) + 1
        if end:
            counts = counts or held
            self.client.xadd(TX, self.fields("e", {"count": sum(counts.values()), "streams": counts}, len(rows), key={}))
        return self.xid

    def grouped(self, *transactions: tuple[tuple[str, dict], ...]) -> list[int]:
        """Several transactions and one END record of format 2 covering them all (as a batch of the bridge with
        transactions.max_per_end above 1 writes them); their xids."""
        covered, totals = [], {}
        for rows in transactions:
            self.lsn, self.xid = self.lsn + 100, self.xid + 1
            for seq, (stream, data) in enumerate(rows):
                self.client.xadd(stream, self.fields("c", data, seq))
                totals[stream] = totals.get(stream, 0) + 1
            covered.append([self.xid, self.lsn, 1])
        fields = self.fields("e", {"count": sum(totals.values()), "streams": totals, "transactions": covered},
                             len(transactions[-1]), key={})
        self.client.xadd(TX, {**fields, "v": 2})
        return [xid for xid, _, _ in covered]

    def fields(self, op: str, data: dict, seq: int, key: dict | None = None) -> dict:
        return {"op": op, "key": orjson.dumps(key if key is not None else {"id": data.get("id", 0)}),
                "data": orjson.dumps(data), "lsn": self.lsn, "seq": seq, "xid": self.xid, "ts_ms": 1, "v": 1}


def apply(conn, entries, consumer: str) -> None:
    for e in entries:
        if e.data.get("poison"):
            raise ValueError(f"poisoned entry {e.id}")
    conn.cursor().executemany("INSERT INTO applied (stream, xid, id) VALUES (%s, %s, %s)",
                              [(e.stream, e.xid, e.data["id"]) for e in entries])


@pytest.fixture
def setup(env):
    env.apply_sql("20_consumer_state.sql")
    env.execute("CREATE TABLE applied (n bigserial, stream text, xid bigint, id bigint)")
    env.handlers = []
    yield env, Source(env.redis)
    for handler in env.handlers:
        handler.close()


def running(env, *, start: str = "0", wait_ms: int = 10_000, max_deliveries: int = 2):
    consumer = Consumer(env.redis, [A, B], "g", "c1", transactions=TX, transaction_wait_ms=wait_ms,
                        max_deliveries=max_deliveries, lease_ttl_ms=1000, block_ms=100)
    consumer.create_group(start)
    handler = TransactionalHandler(env.dsn, "g", apply, epoch_of=consumer.epoch)
    env.handlers.append(handler)
    stop, failure = threading.Event(), []

    def run() -> None:
        try:
            consumer.run(handler, stop)
        except Exception as exc:  # reported by the test
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return consumer, stop, thread, failure


def applied(env) -> list[tuple[str, int, int]]:
    return [tuple(r) for r in env.execute("SELECT stream, xid, id FROM applied ORDER BY n")]


def pending(env) -> int:
    return sum(g["pending"] for s in (A, B, TX) for g in env.redis.xinfo_groups(s))


def test_a_failing_transaction_is_dead_lettered_whole_and_nothing_overtakes_it(setup):
    env, src = setup
    ok1 = src.transaction((A, {"id": 1}), (B, {"id": 2}), (C, {"id": 3}), (A, {"id": 4}))
    src.transaction((A, {"id": 5}), (B, {"id": 6, "poison": True}))
    env.redis.xadd(A, {"op": "r", "key": b'{"id":7}', "data": b'{"id":7}', "lsn": src.lsn + 1, "seq": 0, "xid": 0, "ts_ms": 1, "v": 1})
    ok2 = src.transaction((B, {"id": 8}))
    consumer, stop, thread, failure = running(env)
    try:
        try:
            wait_for(lambda: pending(env) == 0 and len(applied(env)) == 5 or failure, 30, "the consumer to settle")
        except TimeoutError:
            print(applied(env), [env.redis.xinfo_groups(s) for s in (A, B, TX)], consumer)
            raise
    finally:
        stop.set()
        thread.join(10)
    assert not failure
    assert applied(env) == [(A, ok1, 1), (B, ok1, 2), (A, ok1, 4), (A, 0, 7), (B, ok2, 8)], \
        "whole transactions in commit order, the poisoned one not at all"
    letters = [{k.decode(): v.decode() for k, v in f.items()} for _, f in env.redis.xrange("cdc:dlq:g")]
    assert [(d["source_stream"], orjson.loads(orjson.loads(d["entry"])["data"]).get("id")) for d in letters] == \
        [(A, 5), (B, 6), (TX, None)], "the transaction's entries and its END, together"
    end_id = letters[-1]["source_id"]
    assert {d["transaction"] for d in letters} == {end_id} and {d["deliveries"] for d in letters} == {"2"}
    assert all(d["error"].startswith("ValueError: poisoned entry") for d in letters)
    assert consumer.dead_lettered == 3 and not env.redis.exists(f"{{{TX}}}:failures:g")
    m = consumer.metrics  # what /metrics would serve: entries handled, failures counted on the END, dead letters
    assert (dict(m.handled), dict(m.failures), dict(m.dead_letters)) == ({A: 3, B: 2}, {TX: 2}, {A: 1, B: 1, TX: 1})
    assert m.handler_seconds.count >= 4


def test_an_end_covering_several_transactions_hands_them_over_together_in_commit_order(setup):
    env, src = setup
    first = src.transaction((A, {"id": 1}))
    group = src.grouped(((A, {"id": 2}), (B, {"id": 3}), (C, {"id": 4})), ((B, {"id": 5}),), ((C, {"id": 6}),),
                        ((A, {"id": 7}), (A, {"id": 8})))
    env.redis.xadd(A, {"op": "r", "key": b'{"id":9}', "data": b'{"id":9}', "lsn": src.lsn + 1, "seq": 0, "xid": 0,
                       "ts_ms": 1, "v": 1})
    poisoned = src.grouped(((A, {"id": 10}),), ((B, {"id": 11, "poison": True}),))
    last = src.transaction((B, {"id": 12}))
    consumer, stop, thread, failure = running(env)
    try:
        wait_for(lambda: pending(env) == 0 and len(applied(env)) == 8 or failure, 30, "the consumer to settle")
    finally:
        stop.set()
        thread.join(10)
    assert not failure
    assert applied(env) == [(A, first, 1), (A, group[0], 2), (B, group[0], 3), (B, group[1], 5), (A, group[3], 7),
                            (A, group[3], 8), (A, 0, 9), (B, last, 12)], \
        "the transactions of an END in commit order, a snapshot row after them; a failing one dead-letters its END's"
    letters = [{k.decode(): v.decode() for k, v in f.items()} for _, f in env.redis.xrange("cdc:dlq:g")]
    assert [(d["source_stream"], orjson.loads(orjson.loads(d["entry"])["data"]).get("id")) for d in letters] == \
        [(A, 10), (B, 11), (TX, None)], "the transactions one END covers are dead-lettered together"
    assert {d["transaction"] for d in letters} == {letters[-1]["source_id"]}
    assert consumer.transactions_handled == 1 + 4 + 1, "each transaction an END covers counts"
    assert poisoned[0] not in {xid for _, xid, _ in applied(env)}


def test_an_incomplete_transaction_stops_the_consumer_with_none_of_it_applied(setup):
    env, src = setup
    ok = src.transaction((A, {"id": 1}))
    src.transaction((A, {"id": 2}), counts={A: 1, B: 1})  # its B entry was trimmed by hand, say
    src.transaction((B, {"id": 3}))
    consumer, stop, thread, failure = running(env, wait_ms=500)
    thread.join(30)
    assert applied(env) == [(A, ok, 1)]
    [error] = failure
    assert isinstance(error, IncompleteTransaction) and error.exit_code == 6
    assert "counts 1 entries in cdc:b, 0 arrived after waiting 0.5s" in str(error)
    assert pending(env) == 4, "what was not applied stays pending: the entry, its END, and the next transaction"


def test_a_killed_consumer_and_a_group_started_at_dollar_cut_no_transaction(setup):
    env, src = setup
    src.transaction((A, {"id": 1}), (B, {"id": 2}))  # before the group: not for it
    late = src.transaction((A, {"id": 3}), (B, {"id": 4}), end=False)  # entries before the group, END after
    consumer, stop, thread, failure = running(env, start="$")
    env.redis.xadd(TX, src.fields("e", {"count": 2, "streams": {A: 1, B: 1}}, 2, key={}))
    wait_for(lambda: len(applied(env)) == 2, 30, "the transaction ended after the group's start")
    # a consumer killed mid-way: its successor (another name) takes over once the lease expires
    for n in range(10, 30):
        src.transaction((A, {"id": n}), (B, {"id": 100 + n}), (A, {"id": 200 + n}))
    consumer._refresh_leases = lambda: None  # stops renewing: as good as dead for the others
    wait_for(lambda: len(applied(env)) >= 5, 30, "the first consumer to apply some")
    stop.set()
    thread.join(10)
    second = Consumer(env.redis, [A, B], "g", "c2", transactions=TX, lease_ttl_ms=1000, block_ms=100)
    handler = TransactionalHandler(env.dsn, "g", apply, epoch_of=second.epoch)
    env.handlers.append(handler)
    stop2 = threading.Event()
    thread2 = threading.Thread(target=second.run, args=(handler, stop2), daemon=True)
    thread2.start()
    try:
        wait_for(lambda: len(applied(env)) == 2 + 60 and pending(env) == 0, 30, "the second consumer to finish")
    finally:
        stop2.set()
        thread2.join(10)
    rows = applied(env)
    assert rows[:2] == [(A, late, 3), (B, late, 4)]
    assert len(set(rows)) == len(rows) == 62, "nothing applied twice"
    xids = [x for _, x, _ in rows]
    assert xids == sorted(xids), "commit order"


def test_entries_whose_end_was_acknowledged_are_handed_over_on_a_quiet_stream(setup):
    """A consumer killed between acknowledging an END and its entries (a cluster's acknowledgement is two
    calls): the transactions stream's high-water mark shows no END is missing, so they go alone."""
    env, src = setup
    xid = src.transaction((A, {"id": 1}), (B, {"id": 2}))
    Consumer(env.redis, [A, B], "g", "c0", transactions=TX).create_group("0")
    [[_, [(end_id, _)]]] = env.redis.xreadgroup("g", "c0", {TX: ">"})
    env.redis.xack(TX, "g", end_id)
    env.redis.set("{%s}:hwm" % TX, f"{src.lsn:020d}2")  # as the bridge keeps it
    consumer, stop, thread, failure = running(env, wait_ms=3000)
    try:
        wait_for(lambda: len(applied(env)) == 2 or failure, 30, "the entries to be handed over")
    finally:
        stop.set()
        thread.join(10)
    assert not failure and applied(env) == [(A, xid, 1), (B, xid, 2)] and pending(env) == 0


def test_entries_whose_end_the_bridge_has_not_written_yet_wait_for_it_however_long(setup, caplog):
    """The bridge stopped (or crashed) between a batch holding a transaction's last entries and the next
    with its END, or it wrote entries before its END records were turned on: no loss while the transactions
    stream's high-water mark is below them. The consumer waits past --transaction-wait-ms, says so once in
    its log, in /readyz and in cdc_consumer_end_wait_seconds, then hands the transaction over whole."""
    env, src = setup
    mark = "{%s}:hwm" % TX

    def write_end(rows: int, counts: dict) -> None:  # as the bridge does: the END and its stream's mark together
        env.redis.xadd(TX, src.fields("e", {"count": rows, "streams": counts}, rows, key={}))
        env.redis.set(mark, f"{src.lsn:020d}{rows:010d}")

    def told(text: str) -> bool:
        return any(text in r.getMessage() for r in caplog.records)

    def readyz() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/readyz", timeout=5) as reply:
            return reply.read().decode()

    caplog.set_level(logging.INFO, logger="cdc.consumer")
    before = src.transaction((A, {"id": 1}), end=False)  # written before END records were turned on
    consumer, stop, thread, failure = running(env, wait_ms=500)
    server = consumer.serve_metrics(0, "127.0.0.1", refresh_s=0.1)
    try:
        wait_for(lambda: told(f"transaction {before} (commit LSN {src.lsn}) of {A}") or failure, 30, "the wait logged")
        assert not failure and thread.is_alive() and applied(env) == []
        assert told(f"the bridge has not written yet (it has written no END record to {TX} yet: check that its "
                    f"config sets transactions: {{stream: {TX}}})")
        wait_for(lambda: "waiting" in readyz(), 10, "/readyz to tell the wait")
        assert readyz().startswith(f"ready: reading 2 of 2 stream(s) and the transactions stream {TX} for group g; "
                                   "waiting ")
        assert consumer.metrics.end_wait_s() > 0.5
        first = src.transaction((A, {"id": 2}), (B, {"id": 3}), end=False)  # the bridge turned them on
        write_end(2, {A: 1, B: 1})
        wait_for(lambda: len(applied(env)) == 3 or failure, 30, "the entries from before alone, then the transaction")
        assert applied(env) == [(A, before, 1), (A, first, 2), (B, first, 3)]

        cut = src.transaction((A, {"id": 4}), (B, {"id": 5}), end=False)  # its END in the next batch: the bridge stops
        lsn = src.lsn
        wait_for(lambda: told(f"transaction {cut} (commit LSN {lsn}) of {A}") or failure, 30, "the second wait logged")
        assert told(f"(its last END record in {TX} is at commit LSN {lsn - 100});")
        assert not failure and thread.is_alive() and len(applied(env)) == 3, "nothing of it yet, and no loss"
        assert sum("waits for its END record" in r.getMessage() for r in caplog.records) == 2, "once per wait"
        write_end(2, {A: 1, B: 1})  # the bridge runs again
        wait_for(lambda: len(applied(env)) == 5 or failure, 30, "the transaction, whole")
        wait_for(lambda: "waiting" not in readyz() and pending(env) == 0, 10, "the wait to end")
        assert sum("waits no more: the bridge wrote past it" in r.getMessage() for r in caplog.records) == 2
        assert not failure and applied(env)[3:] == [(A, cut, 4), (B, cut, 5)] and consumer.metrics.end_wait_s() == 0
    finally:
        stop.set()
        thread.join(10)
        server.close()


@pytest.fixture
def cluster(servers_root):
    """Three Redis Cluster nodes."""
    with three_node_cluster(servers_root, "txcluster") as nodes:
        yield nodes


def test_on_a_cluster_an_end_seen_before_an_entry_on_another_node_waits_for_it(env, cluster):
    from redis.cluster import RedisCluster

    client = RedisCluster(host="127.0.0.1", port=cluster[0].port)
    assert len({client.get_node_from_key(s).name for s in (A, B, TX)}) > 1, "the streams on different nodes"
    env.apply_sql("20_consumer_state.sql")
    env.execute("CREATE TABLE applied (n bigserial, stream text, xid bigint, id bigint)")
    src = Source(client)
    first = src.transaction((A, {"id": 1}), (B, {"id": 2}))
    consumer = Consumer(client, [A, B], "g", "c1", transactions=TX, lease_ttl_ms=1000, block_ms=100)
    consumer.create_group("0")
    handler = TransactionalHandler(env.dsn, "g", apply, epoch_of=consumer.epoch)
    stop = threading.Event()
    thread = threading.Thread(target=consumer.run, args=(handler, stop), daemon=True)
    thread.start()
    try:
        wait_for(lambda: len(applied(env)) == 2, 30, "the first transaction")
        # the next one's END and first entry are visible, its entry on the other node not yet
        src.lsn, src.xid = src.lsn + 100, src.xid + 1
        client.xadd(A, src.fields("c", {"id": 3}, 0))
        client.xadd(TX, src.fields("e", {"count": 2, "streams": {A: 1, B: 1}}, 2, key={}))
        wait_for(lambda: consumer.delivered >= 5, 30, "the END to be read")
        assert len(applied(env)) == 2, "nothing of an incomplete transaction"
        client.xadd(B, src.fields("c", {"id": 4}, 1))
        wait_for(lambda: len(applied(env)) == 4, 30, "the straggler, then the whole transaction")
        wait_for(lambda: sum(g["pending"] for s in (A, B, TX) for g in client.xinfo_groups(s)) == 0, 30, "the acks")
    finally:
        stop.set()
        thread.join(10)
        handler.close()
        client.close()
    assert applied(env) == [(A, first, 1), (B, first, 2), (A, src.xid, 3), (B, src.xid, 4)]
