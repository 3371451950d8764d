"""Initial snapshot throughput: rows/s from table to stream entries (op r), N rows (default 5,000,000).

Creates a rides table with N rows, `cdc init` with `snapshot: initial`, then times
`cdc run --until-caught-up` (which returns once the snapshot is in Redis).
Usage: python bench/snapshot.py [--rows 5000000] [--chunk 5000]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from servers import bench_servers, cdc_command  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--chunk", type=int, default=5000)
    args = parser.parse_args()
    with bench_servers("cdc-bench-snapshot-", {"max_wal_size": "8GB"}) as (root, pg, rd):
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE rides (id bigint PRIMARY KEY, rider_id bigint NOT NULL, distance_m numeric(12,3) NOT NULL)")
            print(f"loading {args.rows:,} rows ...", flush=True)
            t0 = time.monotonic()
            conn.execute(f"INSERT INTO rides SELECT g, g % 1000, (g % 100000) / 7.0 FROM generate_series(1, {args.rows}) g")
            conn.execute("VACUUM ANALYZE rides")
            print(f"  loaded in {time.monotonic() - t0:.1f}s", flush=True)
        (root / "mappings").mkdir()
        (root / "mappings" / "ride.yaml").write_text(
            "entity: ride\ntable: public.rides\nkey: [id]\nsnapshot: initial\nfields: {id: id, distance: distance_m, rider: rider_id}\n"
        )
        config = root / "cdc.yaml"
        config.write_text(
            f"postgres: {{dsn: '{pg.dsn}', slot: cdc, publication: cdc}}\nredis: {{url: '{rd.url}'}}\n"
            f"mappings: mappings/\nhttp: {{port: 0}}\nbatch: {{backfill_chunk_rows: {args.chunk}}}\n"
        )
        subprocess.run(cdc_command("init", config), check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        t0 = time.monotonic()
        subprocess.run(cdc_command("run", config, "--until-caught-up"), check=True, cwd=ROOT)
        elapsed = time.monotonic() - t0
        entries = redis.Redis.from_url(rd.url).xlen("cdc:ride")
        assert entries == args.rows, f"{entries} entries for {args.rows} rows"
        print()
        print(f"rows                 {args.rows:>12,}  (chunks of {args.chunk})")
        print(f"snapshot, wall time  {elapsed:>12.1f} s (bridge start to every row in Redis)")
        print(f"snapshot rate        {args.rows / elapsed:>12,.0f} rows/s")
        return 0


if __name__ == "__main__":
    sys.exit(main())
