"""Consumer throughput: a transactional consumer and an idempotent one, side by side.

Fills a ride stream with N entries (default 1,000,000) through the bridge's own
publisher, then drains it twice, each time with a new consumer group:
(a) the rocket-rides totals handler in PostgreSQL transactions with checkpoints,
(b) the idempotent table sink mirroring every ride. Prints entries/s for both.
Usage: python bench/consume.py [--entries 1000000] [--batch 1000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cdc.consume.checkpoint import TransactionalHandler  # noqa: E402
from cdc.consume.consumer import Consumer  # noqa: E402
from servers import bench_servers  # noqa: E402
from cdc.sink.publisher import Publisher, StreamBatch, position  # noqa: E402
from cdc.demo.rocketrides import ride_totals  # noqa: E402
from cdc.consume.table_sink import TableSink  # noqa: E402

STREAM = "cdc:ride"


def fill(url: str, n: int) -> None:
    publisher = Publisher(url)
    try:
        for start in range(0, n, 5000):
            batch = StreamBatch(STREAM)
            for i in range(start, min(start + 5000, n)):
                lsn = 10_000 + i // 10
                batch.add(position(lsn, i % 10), [
                    b"op", b"c", b"key", b'{"id":%d}' % i,
                    b"data", b'{"id":%d,"distance":"%d.%03d","rider":%d}' % (i, i % 5000, i % 1000, i % 100),
                    b"lsn", str(lsn), b"seq", i % 10, b"xid", b"1", b"ts_ms", b"0", b"v", 1,
                ])
            publisher.publish([batch])
    finally:
        publisher.close()


def drain(client: redis.Redis, group: str, handler, n: int, batch: int) -> float:
    consumer = Consumer(client, [STREAM], group, "bench", count=batch, block_ms=100)
    consumer.create_group("0")
    if isinstance(handler, TransactionalHandler):
        handler.epoch_of = consumer.epoch
    started = time.perf_counter()
    while consumer.acked < n:
        entries = consumer.read()
        if entries:
            consumer.process(entries, handler)
    elapsed = time.perf_counter() - started
    for lease in consumer.leases.values():
        lease.release()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1000)
    args = parser.parse_args()
    with bench_servers("cdc-bench-consume-", None) as (root, pg, rd):
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute((ROOT / "sql" / "20_consumer_state.sql").read_text())
        print(f"filling {STREAM} with {args.entries:,} entries ...", flush=True)
        t0 = time.perf_counter()
        fill(rd.url, args.entries)
        print(f"  filled in {time.perf_counter() - t0:.1f}s", flush=True)
        client = redis.Redis.from_url(rd.url)
        transactional = TransactionalHandler(pg.dsn, "bench-totals", ride_totals)
        t_tx = drain(client, "bench-totals", transactional, args.entries, args.batch)
        transactional.close()
        sink = TableSink(pg.dsn, "public.ride_mirror")
        t_idem = drain(client, "bench-mirror", sink, args.entries, args.batch)
        sink.close()
        with psycopg.connect(pg.dsn) as conn:
            mirrored = conn.execute("SELECT count(*) FROM ride_mirror").fetchone()[0]
            overall = conn.execute("SELECT total_distance FROM consumer_states WHERE consumer = 'bench-totals' AND rider_id = 0").fetchone()[0]
        assert mirrored == args.entries, mirrored
        print()
        print(f"entries                          {args.entries:>12,}  (batches of {args.batch})")
        print(f"transactional (totals+checkpoint) {args.entries / t_tx:>11,.0f} entries/s  ({t_tx:.1f}s; total {overall})")
        print(f"idempotent (table sink upserts)   {args.entries / t_idem:>11,.0f} entries/s  ({t_idem:.1f}s)")
        print(f"ratio idempotent / transactional  {t_tx / t_idem:>11.2f}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
