"""Nightly reconciliation: Spark's truth and reset over N rides (default 5,000,000), beside PostgreSQL's own aggregate.

Creates R riders and N rides, then `cdc init` and the bridge (`cdc run`), so the
rides are already in the table but not in the WAL the bridge reads. The
ride-totals consumer's state starts empty, so the first `reconcile_spec` reports
every key (R riders and the overall row) as drift and writes the truth; a second
run right after must find the state exact. As a baseline, PostgreSQL computes
the same totals in one query (GROUPING SETS: one process, no parallel workers). Prints the
Spark start-up time, both runs (wall time, read time, rows/s of the read), the
baseline's rows/s and the ratio of the two, and checks that the state the reset
wrote equals the baseline exactly.
Usage: python bench/reconcile.py [--rows 5000000] [--partitions 8] [--riders 100000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cdc.config import Settings  # noqa: E402
from cdc.demo.local import wait_for  # noqa: E402
from cdc.mapping.model import load_mappings  # noqa: E402
from cdc.reconcile.job import SpecResult, preflight, reconcile_spec  # noqa: E402
from cdc.reconcile.spec import load_specs  # noqa: E402
from cdc.reconcile.truth import start_spark  # noqa: E402
from servers import bench_servers, cdc_command  # noqa: E402

JAR = "/usr/share/java/postgresql.jar"
CONSUMER = "ride-totals"
SPEC = """name: ride-totals
source: {{table: public.rides, partition_column: id, partitions: {partitions}, fetch_size: 10000}}
truth:
  group_by: [rider_id]
  overall: {{rider_id: 0}}
  values: {{total_distance: sum(distance_m)}}
consumers:
  - name: ride-totals
    entity: ride
    handler: cdc.demo.rocketrides:ride_totals
    state: {{table: consumer_states, scope: {{consumer: ride-totals}}}}
"""
# the same totals as the spec: per rider, and over all rides under rider_id 0
BASELINE = ("SELECT CASE WHEN grouping(rider_id) = 1 THEN 0 ELSE rider_id END, sum(distance_m), count(*) "
            "FROM rides GROUP BY GROUPING SETS ((rider_id), ())")


def load(dsn: str, rows: int, riders: int) -> None:
    """Riders 1..R and N rides spread over them, each in one server-side statement."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in ("10_rocket_rides.sql", "20_consumer_state.sql"):
            conn.execute((ROOT / "sql" / name).read_text())
        print(f"loading {riders:,} riders and {rows:,} rides ...", flush=True)
        t0 = time.monotonic()
        conn.execute(f"INSERT INTO riders (id, name, email) SELECT g, 'rider ' || g, 'r' || g || '@example.com' "
                     f"FROM generate_series(1, {riders}) g")
        # distances with three decimals, from 0.001 to 99999.999 m
        conn.execute(f"INSERT INTO rides (id, rider_id, distance_m) "
                     f"SELECT g, 1 + g % {riders}, ((g::bigint * 7919) % 100000000 + 1) / 1000.0 "
                     f"FROM generate_series(1, {rows}) g")
        conn.execute("SELECT setval('riders_id_seq', %s), setval('rides_id_seq', %s)", (riders, rows))
        conn.execute("VACUUM ANALYZE riders, rides")  # hint bits and statistics: both readers find the same table
        print(f"  loaded in {time.monotonic() - t0:.1f}s", flush=True)


def write_config(root: Path, dsn: str, redis_url: str, partitions: int) -> Path:
    (root / "mappings").mkdir()
    (root / "mappings" / "ride.yaml").write_text((ROOT / "mappings" / "ride.yaml").read_text())
    (root / "reconcile").mkdir()
    (root / "reconcile" / "ride_totals.yaml").write_text(SPEC.format(partitions=partitions))
    config = root / "cdc.yaml"
    config.write_text(
        f"postgres: {{dsn: '{dsn}', slot: cdc, publication: cdc}}\nredis: {{url: '{redis_url}'}}\n"
        f"mappings: mappings/\nhttp: {{port: 0}}\n"
        f"reconcile: {{specs: reconcile/, master: 'local[*]', jdbc_jar: {JAR}, driver_memory: 4g}}\n"
    )
    return config


def bridge_caught_up(dsn: str) -> bool:
    """The bridge is attached to its slot and has confirmed everything written so far."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT active AND confirmed_flush_lsn >= pg_current_wal_lsn() FROM pg_replication_slots "
                            "WHERE slot_name = 'cdc'").fetchone()[0]


def baseline(dsn: str) -> tuple[dict[int, object], int, float, int]:
    """(total per key, source rows, seconds, parallel workers planned) of PostgreSQL's one query."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        [[plan]] = conn.execute("EXPLAIN (FORMAT JSON) " + BASELINE).fetchone()
        workers = max([int(m) for m in _plan_values(plan, "Workers Planned")], default=0)
        t0 = time.monotonic()
        result = conn.execute(BASELINE).fetchall()
        seconds = time.monotonic() - t0
    totals = {rider: total for rider, total, _ in result}
    source_rows = next(n for rider, _, n in result if rider == 0)
    return totals, source_rows, seconds, workers


def _plan_values(node: object, key: str) -> list:
    """Every value of `key` anywhere in an EXPLAIN (FORMAT JSON) plan."""
    if isinstance(node, dict):
        return ([node[key]] if key in node else []) + [v for child in node.values() for v in _plan_values(child, key)]
    if isinstance(node, list):
        return [v for child in node for v in _plan_values(child, key)]
    return []


def state(dsn: str) -> dict[int, object]:
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute("SELECT rider_id, total_distance FROM consumer_states WHERE consumer = %s", (CONSUMER,)))


def run(settings: Settings, spark) -> SpecResult:
    [spec] = load_specs(Path(settings.reconcile.specs))
    return reconcile_spec(settings, spec, preflight(settings, load_mappings(settings.mappings), spec), spark)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--riders", type=int, default=100_000)
    args = parser.parse_args()
    with bench_servers("cdc-bench-reconcile-", {"max_wal_size": "8GB"}) as (root, pg, rd):
        # the rides exist before the slot does: the bridge starts at the end of the load
        load(pg.dsn, args.rows, args.riders)
        config = write_config(root, pg.dsn, rd.url, args.partitions)
        subprocess.run(cdc_command("init", config), check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        bridge = subprocess.Popen(cdc_command("run", config), cwd=ROOT)
        spark = None
        try:
            settings = Settings.from_file(config)
            rc = settings.reconcile
            t0 = time.monotonic()
            spark = start_spark(rc.master, rc.jdbc_jar, rc.driver_memory)
            spark_s = time.monotonic() - t0
            spark_cores = spark.sparkContext.defaultParallelism
            # a run's wall time then holds no bridge start-up: only its wait for the snapshot's position
            wait_for(lambda: bridge_caught_up(pg.dsn), 120, "the bridge to attach to its slot")

            print(f"reconciling {args.rows:,} rides in {args.partitions} partition(s) ...", flush=True)
            first = run(settings, spark)
            second = run(settings, spark)
            tracemalloc.start()  # a third, traced run: how much the job itself holds in Python
            run(settings, spark)
            heap_peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            print("baseline: the same totals in one PostgreSQL query ...", flush=True)
            expected, pg_rows, pg_s, workers = baseline(pg.dsn)
            actual = state(pg.dsn)
        finally:
            if spark is not None:
                spark.stop()
            bridge.terminate()
            bridge.wait(30)

        statuses = ([o.status for o in first.outcomes], [o.status for o in second.outcomes])
        exact = actual == expected and first.source_rows == pg_rows == args.rows
        spark_rate = first.source_rows / first.read_seconds
        pg_rate = pg_rows / pg_s

        def row(label: str, wall: float, read: float | str, rate: float | str, keys: int | str, note: str) -> str:
            read = f"{read:.2f}" if isinstance(read, float) else read
            rate = f"{rate:,.0f}" if isinstance(rate, float) else rate
            keys = f"{keys:,}" if isinstance(keys, int) else keys
            return f"{label:<26} {wall:>8.2f} {read:>8} {rate:>11} {keys:>9}  {note}".rstrip()

        def spark_row(label: str, r: SpecResult) -> str:
            status = ", ".join(o.status for o in r.outcomes)
            drift = sum(o.drift.keys_drifted for o in r.outcomes)
            paused = max(o.locked_seconds for o in r.outcomes)
            return row(label, r.seconds, r.read_seconds, r.source_rows / r.read_seconds, r.truth_keys,
                       f"{status} ({drift:,} keys drifted; consumer paused {paused:.2f}s)")

        print()
        print(f"{args.rows:,} rides of {args.riders:,} riders; Spark local[*] on {spark_cores} core(s), "
              f"{first.partitions} partition(s)")
        print(f"{'':<26} {'wall s':>8} {'read s':>8} {'read rows/s':>11} {'keys':>9}  outcome")
        print(row("Spark session start", spark_s, "", "", "", ""))
        print(spark_row("reconcile (empty state)", first))
        print(spark_row("reconcile again", second))
        print(row("PostgreSQL, one query", pg_s, pg_s, pg_rate, len(expected), f"({workers} parallel worker(s) planned)"))
        print(f"{'Spark read / PostgreSQL':<26} {spark_rate / pg_rate:>8.2f}  (first run; "
              f"{second.source_rows / second.read_seconds / pg_rate:.2f} again)")
        print(f"{'Python heap peak, a run':<26} {heap_peak / 2**20:>8.1f}  MiB (tracemalloc; {second.truth_keys:,} keys)")
        print(f"{'state equals PostgreSQL':<26} {'yes' if exact else 'NO':>8}  ({len(actual):,} state rows)")
        if not exact:
            wrong = sorted(k for k in expected.keys() | actual.keys() if expected.get(k) != actual.get(k))
            print(f"mismatch: source rows spark {first.source_rows}, postgres {pg_rows}, expected {args.rows}; "
                  f"{len(wrong)} key(s) differ, first: " + json.dumps([str(k) for k in wrong[:10]]), file=sys.stderr)
            return 1
        if statuses != (["repaired"], ["clean"]):
            print(f"unexpected outcomes: first {statuses[0]}, second {statuses[1]} (expected repaired, then clean)",
                  file=sys.stderr)
            return 1
        return 0


if __name__ == "__main__":
    sys.exit(main())
