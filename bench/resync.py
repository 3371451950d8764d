"""A mapping's resync (`on_unaccountable: resync`): the time from the break to its stream replaying to its
table again, and what it costs the other mappings' latency meanwhile.

A bridge (`cdc run`, compiled path, transaction append) streams rides (the default policy, `stop`) and a
table `big` of --rows rows (default 1,000,000) mapped with `on_unaccountable: resync`. Paced writers commit
--rate changes/s into rides throughout (multi-row INSERTs, as bench/throughput.py's latency run). Then, in
one transaction, `big` is dropped and re-created holding the same rows (the new table is another relation:
the bridge cannot account for the old one's changes), and `cdc init` puts it back in the publication, as
the concepts page tells an operator. The run prints:

- the time from the break's commit to the bridge's resync marker in `big`'s stream, to `cdc init` done, and
  to the resync's end (its record gone from Redis: the last backfill chunk is in the stream);
- whether `big`'s stream after the marker replays to the table (every row once, no other entry) and rides'
  stream holds every row written;
- the rides entries' commit-to-stream latency p50/p99/max over a run of the same length before the break
  and during the resync, and the bridge's CPU in each.

Usage: python bench/resync.py [--rows 1000000] [--rate 10000] [--seconds 10] [--chunk N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402
import psycopg  # noqa: E402
import redis  # noqa: E402

SLOT = "resync"
BIG_STREAM = "cdc:big"
SCHEMA = """
CREATE TABLE rides (id bigint PRIMARY KEY, rider_id bigint NOT NULL, distance_m numeric(12,3) NOT NULL,
                    status text NOT NULL DEFAULT 'done', internal_note text);
CREATE TABLE big (id bigint PRIMARY KEY, label text NOT NULL, amount numeric(12,2) NOT NULL);
CREATE PUBLICATION cdc FOR TABLE rides, big;
"""
MAPPINGS = {
    "ride.yaml": "entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id, distance: distance_m, rider: rider_id, status: status}\n",
    "big.yaml": "entity: big\ntable: public.big\nkey: [id]\nfields: {id: id, label: label, amount: amount}\n"
                "on_unaccountable: resync\n",
}


def one(conn: psycopg.Connection, query: str, params: tuple = ()):
    row = conn.execute(query, params).fetchone()  # type: ignore[arg-type]
    return row[0] if row else None


def percentile(sorted_values: list[int], q: float) -> float:
    return float(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]) if sorted_values else 0.0


def marker_after(client: redis.Redis, after: str) -> str | None:
    """The ID of the first resync marker (op x) in big's stream after `after`, or None."""
    for entry_id, fields in client.xrange(BIG_STREAM, "(" + after, "+"):
        if fields[b"op"] == b"x":
            return entry_id.decode()
    return None


def replays(client: redis.Redis, marker: str, rows: int) -> tuple[bool, str]:
    """Whether big's stream after `marker` replays to the table: `rows` snapshot rows, each key once."""
    seen: set[int] = set()
    other = 0
    start = "(" + marker
    while True:
        page = client.xrange(BIG_STREAM, start, "+", count=10_000)
        for _, fields in page:
            if fields[b"op"] == b"r":
                seen.add(orjson.loads(fields[b"key"])["id"])
            else:
                other += 1
        if len(page) < 10_000:
            break
        start = "(" + page[-1][0].decode()
    ok = len(seen) == rows and seen == set(range(1, rows + 1)) and other == 0
    return ok, f"{len(seen):,} rows of {rows:,}, {other} other entries"


def pace(dsn: str, rate: int, tx_rows: int, writers: int, stop: threading.Event) -> None:
    """`writers` connections commit `rate` changes/s into rides in all until `stop` is set."""
    interval = tx_rows * writers / rate

    def writer(w: int) -> None:
        next_id = 10**12 + w * 10**11
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SET synchronous_commit = on")  # commits reach the walsender at once
            start = time.monotonic()
            i = 0
            while not stop.is_set():
                values = ",".join(f"({k},1,1.5)" for k in range(next_id, next_id + tx_rows))
                conn.execute(f"INSERT INTO rides (id, rider_id, distance_m) VALUES {values}")
                next_id += tx_rows
                i += 1
                delay = start + i * interval - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # pacing the writer to the target rate

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def latencies(client: redis.Redis, since_ms: int, until_ms: int) -> list[int]:
    """Commit-to-stream latency (ms) of the rides entries committed in [since_ms, until_ms), sorted."""
    out = []
    start = "-"
    while True:
        page = client.xrange("cdc:ride", start, "+", count=10_000)
        for entry_id, fields in page:
            ts = int(fields[b"ts_ms"])
            if since_ms <= ts < until_ms:
                out.append(int(entry_id.split(b"-")[0]) - ts)
        if len(page) < 10_000:
            break
        start = "(" + page[-1][0].decode()
    return sorted(out)


def memory_mib(pid: int, field: str) -> float:
    """A process's VmRSS (now) or VmHWM (its peak), MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the table that resyncs")
    parser.add_argument("--rate", type=int, default=10_000, help="changes/s the writers commit into rides")
    parser.add_argument("--seconds", type=float, default=10.0, help="the baseline's length, before the break")
    parser.add_argument("--tx-rows", type=int, default=100, help="rows per multi-row INSERT (one transaction)")
    parser.add_argument("--writers", type=int, default=2, help="writer connections")
    parser.add_argument("--chunk", type=int, default=None, help="batch.backfill_chunk_rows (default: the bridge's)")
    args = parser.parse_args()

    from servers import bench_servers, cdc_command, cpu_seconds, prepare
    from throughput import run_bridge, write_config
    from cdc.demo.local import wait_for

    settings = {"synchronous_commit": "off", "max_wal_size": "8GB"}
    with bench_servers("cdc-bench-resync-", settings) as (root, pg, rd):
        client = redis.Redis.from_url(rd.url)
        prepare(root, pg.dsn, MAPPINGS, SCHEMA)
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO big SELECT g, 'row ' || g, g %% 100000 / 7.0 FROM generate_series(1, %s) g",
                         (args.rows,))
        extra = f"batch: {{backfill_chunk_rows: {args.chunk}}}\n" if args.chunk else ""
        config = write_config(root, "cdc-resync.yaml", pg.dsn, rd.url, SLOT, "transaction", "off", extra=extra)
        subprocess.run(cdc_command("init", config), cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        bridge, _ = run_bridge(config, [], "compiled")
        stop = threading.Event()
        writers = threading.Thread(target=pace, args=(pg.dsn, args.rate, args.tx_rows, args.writers, stop))
        try:
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                now_lsn = one(conn, "SELECT pg_current_wal_lsn()")
                wait_for(lambda: one(conn, "SELECT active AND confirmed_flush_lsn >= %s FROM pg_replication_slots "
                                           "WHERE slot_name = %s", (now_lsn, SLOT)),
                         120, "the bridge to attach and catch up")
            time.sleep(2)  # past its first seconds, as the latency benchmark
            print(f"[resync] rides at {args.rate:,} changes/s: {args.seconds:.0f}s before the break ...", flush=True)
            writers.start()
            time.sleep(1)
            base_from = int(time.time() * 1000)
            cpu0 = cpu_seconds(bridge.pid)
            time.sleep(args.seconds)
            base_cpu = cpu_seconds(bridge.pid) - cpu0
            last = client.xrevrange(BIG_STREAM, count=1)
            after = last[0][0].decode() if last else "0-0"
            print(f"[resync] big ({args.rows:,} rows) dropped and re-created, cdc init ...", flush=True)
            broke_ms = int(time.time() * 1000)
            rss_before = memory_mib(bridge.pid, "VmRSS")
            cpu0 = cpu_seconds(bridge.pid)
            with psycopg.connect(pg.dsn) as conn:
                conn.execute("ALTER TABLE big RENAME TO big_old")
                conn.execute("CREATE TABLE big (LIKE big_old INCLUDING ALL)")
                conn.execute("INSERT INTO big SELECT * FROM big_old")
                conn.execute("DROP TABLE big_old")
            broke = time.monotonic()
            subprocess.run(cdc_command("init", config), cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            init_done = time.monotonic() - broke
            resync_key = f"cdc:bridge:{SLOT}:resync"
            wait_for(lambda: marker_after(client, after) is not None, 600, "the resync marker")
            marked = time.monotonic() - broke
            wait_for(lambda: not client.exists(resync_key), 3600, "the resync to end")
            ended = time.monotonic() - broke
            ended_ms = int(time.time() * 1000)
            during_cpu = cpu_seconds(bridge.pid) - cpu0
            rss_peak = memory_mib(bridge.pid, "VmHWM")
            stop.set()
            writers.join()
            if bridge.poll() is not None:
                raise SystemExit(f"the bridge exited ({bridge.returncode}) during the resync")
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                written = one(conn, "SELECT count(*) FROM rides")
            wait_for(lambda: client.xlen("cdc:ride") >= written, 120, "every ride in the stream")
        finally:
            stop.set()
            bridge.terminate()
            bridge.wait(30)
        marker = marker_after(client, after)
        assert marker is not None
        ok, said = replays(client, marker, args.rows)
        rides_ok = client.xlen("cdc:ride") == written
        base = latencies(client, base_from, broke_ms)
        lat = latencies(client, broke_ms, ended_ms)

    print()
    print(f"a resync of {args.rows:,} rows (drop and re-create, then cdc init), rides written at {args.rate:,} changes/s")
    print(f"  break -> cdc init done:        {init_done:6.1f} s")
    print(f"  break -> marker in the stream: {marked:6.1f} s")
    print(f"  break -> stream replays again: {ended:6.1f} s   ({args.rows / max(ended, 1e-3):,.0f} rows/s)")
    print(f"  big's stream after the marker: {'replays to the table' if ok else 'WRONG'}: {said}")
    print(f"  rides' stream: {written:,} rows written, {'all' if rides_ok else 'NOT all'} in the stream")
    print(f"  bridge memory: {rss_before:.0f} MiB before the break, peak {rss_peak:.0f} MiB (the rows brought are "
          "held until the resync ends)")
    print(f"{'rides, commit-to-stream ms':<28} {'p50':>5} {'p99':>5} {'max':>6} {'entries':>9} {'bridge CPU/s':>12}")
    for name, lats, cpu, span in (("before the break", base, base_cpu, (broke_ms - base_from) / 1000),
                                  ("during the resync", lat, during_cpu, ended)):
        print(f"{name:<28} {percentile(lats, 0.5):>5.0f} {percentile(lats, 0.99):>5.0f} {lats[-1] if lats else 0:>6} "
              f"{len(lats):>9,} {cpu / max(span, 1e-3):>12.2f}")
    return 0 if ok and rides_ok else 1


if __name__ == "__main__":
    sys.exit(main())
