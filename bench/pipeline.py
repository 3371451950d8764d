"""The whole pipeline at a fixed rate: writers -> bridge -> a consumer, commit to applied.

A bridge (`cdc run`, compiled path, transaction append) runs continuously while paced writers commit
a steady rate of changes (default 10,000 and then 50,000 changes/s, for --seconds each: multi-row
INSERTs into rides of --tx-rows rows per transaction over --writers connections, as
bench/throughput.py's latency run, whose writers this reuses). One consumer process reads the ride
stream with a new consumer group per run (`Consumer`, its batch size and collector settings as
`cdc consume`'s) and a handler of --handlers:

- ``trivial``: does nothing: the pipeline's own latency;
- ``totals``: `TransactionalHandler` with the rocket-rides totals (`cdc.demo.rocketrides`), the state
  and the checkpoint committed in one PostgreSQL transaction per batch (its totals are checked after
  the run).

Per rate and handler it prints: the rate the writers achieved, the rate the consumer applied at
(entries over the span from its first to its last applied entry), the commit-to-applied latency
(the entry's commit time, ``ts_ms``, to the moment the handler returned on its batch) p50/p99/max,
the commit-to-stream latency of the same entries (the Redis entry ID's time) for comparison, the CPU
per change of the bridge, of the consumer process and of Redis' main thread (over the run, from the
first write until the consumer had everything), and whether the consumer kept up: how many entries
were committed but not yet applied when the writers' last transaction committed (and the largest such
backlog during the run), and how long after that commit the consumer had applied everything.

Usage: python bench/pipeline.py [--rates 10000,50000] [--seconds 10] [--handlers trivial,totals]
       [--tx-rows 100] [--writers 2] [--count N]
"""

from __future__ import annotations

import argparse
import bisect
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import redis  # noqa: E402

STREAM = "cdc:ride"
HANDLERS = ("trivial", "totals")


# -- the consumer (a process of its own) ----------------------------------------------------------------------

def worker(args) -> int:
    """Consume STREAM with `args.group` until SIGTERM; then write (commit ms, applied ms) per entry to
    `args.out` as two arrays of doubles, and print how many entries it applied."""
    import gc

    from cdc.consume.consumer import Consumer
    from cdc.consume.defaults import GC_YOUNG_THRESHOLD

    client = redis.Redis.from_url(args.redis)
    consumer = Consumer(client, [STREAM], args.group, "bench", count=args.count)
    consumer.create_group("$")
    inner = None
    if args.worker == "totals":
        from cdc.consume.checkpoint import TransactionalHandler
        from cdc.demo.rocketrides import ride_totals

        inner = TransactionalHandler(args.dsn, args.group, ride_totals, epoch_of=consumer.epoch)
    committed, applied = array("d"), array("d")

    def handle(entries: list) -> None:
        if inner is not None:
            inner(entries)
        now = time.time() * 1000
        for e in entries:
            committed.append(e.ts_ms)
            applied.append(now)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    gc.freeze()  # as `cdc consume`
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)
    print("ready", flush=True)
    consumer.run(handle, stop)
    if inner is not None:
        inner.close()
    with open(args.out, "wb") as f:
        committed.tofile(f)
        applied.tofile(f)
    print(json.dumps({"entries": len(committed)}), flush=True)
    return 0


# -- the driver -------------------------------------------------------------------------------------------------

def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def one(conn: psycopg.Connection, sql: str, params: tuple = ()):
    """The first column of a query's one row."""
    row = conn.execute(sql, params).fetchone()  # type: ignore[arg-type]
    assert row is not None
    return row[0]


def caught_up(client: redis.Redis, group: str) -> bool:
    """The group has been delivered the stream's last entry and has nothing pending."""
    last: list = client.xrevrange(STREAM, count=1)  # type: ignore[assignment]
    for g in client.xinfo_groups(STREAM):  # type: ignore[union-attr]
        if g["name"].decode() == group:
            return g["pending"] == 0 and bool(last) and g["last-delivered-id"] == last[0][0]
    return False


def one_run(args, pg, rd, client: redis.Redis, bridge: subprocess.Popen, rate: int, handler: str,
            first_id: int, work: Path) -> dict:
    from throughput import redis_cpu_us, steady_latency
    from servers import cpu_seconds
    from cdc.demo.local import wait_for

    group = f"p{rate}_{handler}"
    out = work / f"{group}.bin"
    proc = subprocess.Popen([sys.executable, __file__, "--worker", handler, "--redis", rd.url, "--dsn", pg.dsn,
                             "--group", group, "--out", str(out), "--count", str(args.count)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"the {handler} consumer did not start")
        time.sleep(0.5)  # its first XREADGROUP is waiting
        bridge0, consumer0, redis0 = cpu_seconds(bridge.pid), cpu_seconds(proc.pid), redis_cpu_us(client)
        stream_lat, achieved = steady_latency(pg.dsn, client, rate, args.seconds, first_id, args.tx_rows, args.writers)
        wait_for(lambda: caught_up(client, group), 600, f"the {handler} consumer to catch up")
        bridge_cpu = cpu_seconds(bridge.pid) - bridge0
        consumer_cpu = cpu_seconds(proc.pid) - consumer0
        redis_cpu = (redis_cpu_us(client) - redis0) / 1e6
        proc.send_signal(signal.SIGTERM)
        got = json.loads(proc.communicate(timeout=60)[0].strip().splitlines()[-1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    n = len(stream_lat)
    if got["entries"] != n:
        raise SystemExit(f"the {handler} consumer applied {got['entries']:,} entries, the writers made {n:,}")
    committed, applied = array("d"), array("d")
    with open(out, "rb") as f:
        committed.fromfile(f, n)
        applied.fromfile(f, n)
    out.unlink()
    if handler == "totals":
        with psycopg.connect(pg.dsn) as conn:
            total = one(conn, "SELECT total_distance FROM consumer_states WHERE consumer = %s AND rider_id = 0", (group,))
        if total != Decimal("1.5") * n:
            raise SystemExit(f"the totals consumer's overall distance is {total}, expected {Decimal('1.5') * n}")
    last_commit = max(committed)
    commits, applies = sorted(committed), sorted(applied)
    # the backlog (committed, not yet applied) just before each batch was applied
    backlog = max(bisect.bisect_right(commits, t) - bisect.bisect_left(applies, t) for t in set(applies))
    return {
        "rate": rate, "handler": handler, "entries": n, "achieved": achieved,
        "applied_rate": n / max(1e-3, (max(applied) - min(applied)) / 1000),
        "applied": sorted(a - c for a, c in zip(applied, committed)),
        "stream": sorted(stream_lat),
        "max_backlog": backlog,
        "lag_at_end": sum(1 for a in applied if a > last_commit),
        "caught_up_ms": max(applied) - last_commit,
        "bridge_us": bridge_cpu / n * 1e6, "consumer_us": consumer_cpu / n * 1e6, "redis_us": redis_cpu / n * 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="10000,50000", help="changes/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the writers write at each rate")
    parser.add_argument("--handlers", default="trivial,totals", help=f"of {','.join(HANDLERS)}")
    parser.add_argument("--tx-rows", type=int, default=100, help="rows per multi-row INSERT (one transaction)")
    parser.add_argument("--writers", type=int, default=2, help="writer connections")
    parser.add_argument("--count", type=int, default=None, help="the consumer's entries per batch (default: cdc consume's)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    for hidden in ("--redis", "--dsn", "--group", "--out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count is None:
        from cdc.consume.defaults import COUNT

        args.count = COUNT
    if args.worker:
        return worker(args)
    rates = [int(x) for x in args.rates.split(",") if x]
    handlers = [h for h in args.handlers.split(",") if h]
    for h in handlers:
        if h not in HANDLERS:
            parser.error(f"unknown handler {h!r}")

    from servers import bench_servers, prepare
    from throughput import MAPPINGS, SCHEMA, register, run_bridge, write_config
    from cdc.demo.local import wait_for

    started = time.monotonic()
    settings = {"synchronous_commit": "off", "max_wal_size": "8GB"}
    results = []
    with bench_servers("cdc-bench-pipeline-", settings) as (root, pg, rd):
        client = redis.Redis.from_url(rd.url)
        prepare(root, pg.dsn, MAPPINGS, SCHEMA)
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute((ROOT / "sql" / "20_consumer_state.sql").read_text())
            conn.execute("SELECT pg_create_logical_replication_slot('pipeline', 'pgoutput')")
        config = write_config(root, "cdc-pipeline.yaml", pg.dsn, rd.url, "pipeline", "transaction", "off")
        register(config)
        bridge, _ = run_bridge(config, [], "compiled")
        work = Path(tempfile.mkdtemp(prefix="cdc-bench-pipeline-out-"))
        try:
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                now_lsn = one(conn, "SELECT pg_current_wal_lsn()")
                wait_for(lambda: one(conn, "SELECT active AND confirmed_flush_lsn >= %s FROM pg_replication_slots "
                                           "WHERE slot_name = 'pipeline'", (now_lsn,)),
                         120, "the bridge to attach and catch up")
            first_id = 10**12
            for rate in rates:
                for handler in handlers:
                    print(f"[pipeline] {rate:,} changes/s for {args.seconds:.0f}s, {handler} handler ...", flush=True)
                    r = one_run(args, pg, rd, client, bridge, rate, handler, first_id, work)
                    first_id += 10**11
                    results.append(r)
                    lat = r["applied"]
                    print(f"[pipeline]   writers {r['achieved']:,.0f}/s, applied {r['applied_rate']:,.0f}/s, "
                          f"commit-to-applied p50 {percentile(lat, 0.5):.0f} ms, p99 {percentile(lat, 0.99):.0f} ms, "
                          f"max {lat[-1]:.0f} ms", flush=True)
                    time.sleep(1)
        finally:
            bridge.terminate()
            bridge.wait(30)
            for leftover in work.iterdir():
                leftover.unlink()
            work.rmdir()

    print()
    print(f"the whole pipeline: {args.writers} writer(s), multi-row INSERTs of {args.tx_rows} rows per transaction, "
          f"{args.seconds:.0f}s per run; bridge compiled/transaction append; one consumer, batches of {args.count}")
    print("latencies in ms from the commit (ts_ms); CPU in µs per change over the run; "
          "backlog: entries committed, not yet applied (the largest just before a batch was applied; "
          "lag at end: when the writers' last transaction committed)")
    header = (f"{'target/s':>8} {'handler':<8} {'writers/s':>9} {'applied/s':>9} {'applied p50':>11} {'p99':>5} "
              f"{'max':>5} {'stream p50':>10} {'p99':>5} {'max':>5} {'bridge CPU':>10} {'consumer CPU':>12} "
              f"{'redis CPU':>9} {'max backlog':>11} {'lag at end':>10} {'all applied after':>17}")
    print(header)
    print("-" * len(header))
    for r in results:
        a, s = r["applied"], r["stream"]
        print(f"{r['rate']:>8,} {r['handler']:<8} {r['achieved']:>9,.0f} {r['applied_rate']:>9,.0f} "
              f"{percentile(a, 0.5):>11.0f} {percentile(a, 0.99):>5.0f} {a[-1]:>5.0f} "
              f"{percentile(s, 0.5):>10.0f} {percentile(s, 0.99):>5.0f} {s[-1]:>5.0f} "
              f"{r['bridge_us']:>10.2f} {r['consumer_us']:>12.2f} {r['redis_us']:>9.2f} {r['max_backlog']:>11,} "
              f"{r['lag_at_end']:>10,} {r['caught_up_ms']:>14.0f} ms")
    print(f"\nwhole benchmark: {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
