"""The bridge on a huge transaction with and without `postgres.streaming`, side by side in one run.

Two measurements, each with `streaming: true` and `false` alternating, `--rounds` times (best shown):

- backlog: one transaction of --rows inserts into items is committed first; then
  `cdc run --until-caught-up` drains it: changes per whole-process wall time, the bridge's peak
  RSS, and what spilled to disk on each side (the server's `spill_bytes` from
  pg_stat_replication_slots; the bridge's from its log);
- live: a running bridge (`cdc run`) while one transaction inserts --rows rows in 20 statements
  and commits: the time from COMMIT returning to the first entry in Redis, and to the last.

Usage: python bench/streamed_bridge.py [--rows 2000000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from servers import bench_servers, cdc_command, peak_rss  # noqa: E402
from items import ITEM_MAPPING, ITEM_ROWS, ITEMS_TABLE  # noqa: E402
from cdc.demo.local import wait_for  # noqa: E402

SCHEMA = ITEMS_TABLE + "CREATE PUBLICATION cdc FOR TABLE items;\n"
ROWS = "INSERT INTO items " + ITEM_ROWS
SPILLED = re.compile(r"(\d+) bytes spilled to disk")


def fresh_config(root: Path, slot: str, pg, rd, streaming: bool) -> Path:
    """An empty items table and Redis, and a bridge config with its slot created and registered."""
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE items")
    redis.Redis.from_url(rd.url).flushall()
    config = root / f"{slot}.yaml"
    config.write_text(f"postgres: {{dsn: '{pg.dsn}', slot: {slot}, publication: cdc, streaming: {str(streaming).lower()}}}\n"
                      f"redis: {{url: '{rd.url}'}}\nmappings: mappings/\nhttp: {{port: 0}}\n")
    subprocess.run(cdc_command("init", config), cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return config


def bridge(config: Path, *args: str) -> tuple[subprocess.Popen, list[int]]:
    """`cdc run` logging at info (for its spill line), its peak RSS sampled every 50 ms."""
    cmd = [sys.executable, "-m", "cdc", "--log-format", "text", "run", "--config", str(config), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, peak_rss(proc)


def spills(pg, slot: str, bridge_log: str) -> dict:
    """What spilled to disk on the server's side (its slot statistics) and the bridge's (its log); the
    slot is dropped then."""
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT spill_bytes FROM pg_stat_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    spilled = SPILLED.search(bridge_log)
    return {"server_spill": row[0] if row else 0, "bridge_spill": int(spilled.group(1)) if spilled else 0}


def backlog(root: Path, pg, rd, client: redis.Redis, rows: int, streaming: bool, n: int) -> dict:
    slot = f"backlog_{'on' if streaming else 'off'}_{n}"
    config = fresh_config(root, slot, pg, rd, streaming)
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute(ROWS.format(lo=1, hi=rows))
        conn.execute("CHECKPOINT")
    t0 = time.monotonic()
    proc, peak = bridge(config, "--until-caught-up")
    _, err = proc.communicate()
    wall = time.monotonic() - t0
    if proc.returncode != 0 or client.xlen("cdc:item") != rows:
        raise SystemExit(f"backlog drain failed:\n{err[-2000:]}")
    return {"rate": rows / wall, "wall": wall, "rss": peak[0], **spills(pg, slot, err)}


def live(root: Path, pg, rd, client: redis.Redis, rows: int, streaming: bool, n: int) -> dict:
    slot = f"live_{'on' if streaming else 'off'}_{n}"
    config = fresh_config(root, slot, pg, rd, streaming)
    proc, peak = bridge(config)
    try:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            wait_for(lambda: conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()[0],
                     30, "the bridge to attach to its slot")
        with psycopg.connect(pg.dsn) as conn:
            step = rows // 20
            t_write = time.monotonic()
            for i in range(20):
                conn.execute(ROWS.format(lo=i * step + 1, hi=(i + 1) * step))
            written = time.monotonic() - t_write
            conn.commit()
        committed = time.monotonic()
        first = None
        while True:
            count = client.xlen("cdc:item")
            if count and first is None:
                first = time.monotonic() - committed
            if count >= rows - rows % 20:
                break
            if proc.poll() is not None:
                raise SystemExit("the bridge stopped")
            time.sleep(0.005)
        last = time.monotonic() - committed
    finally:
        proc.terminate()
        _, err = proc.communicate()
    return {"write": written, "first": first, "last": last, "rss": peak[0], **spills(pg, slot, err)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="inserts in the one transaction")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each mode; the best is shown")
    args = parser.parse_args()
    settings = {"synchronous_commit": "off", "max_wal_size": "8GB", "max_replication_slots": "20"}
    results: dict[tuple[str, bool], dict] = {}
    with bench_servers("cdc-bench-streamed-", settings) as (root, pg, rd):
        client = redis.Redis.from_url(rd.url)
        (root / "mappings").mkdir()
        (root / "mappings" / "item.yaml").write_text(ITEM_MAPPING)
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute(SCHEMA)
        for n in range(args.rounds):
            for streaming in (True, False):
                b = backlog(root, pg, rd, client, args.rows, streaming, n)
                print(f"round {n + 1}: backlog, streaming {streaming}: {b['rate']:,.0f} changes/s ({b['wall']:.1f}s)", flush=True)
                if ("backlog", streaming) not in results or b["rate"] > results["backlog", streaming]["rate"]:
                    results["backlog", streaming] = b
                lv = live(root, pg, rd, client, args.rows, streaming, n)
                print(f"round {n + 1}: live, streaming {streaming}: commit -> first entry {lv['first']:.2f}s, "
                      f"-> last {lv['last']:.2f}s", flush=True)
                if ("live", streaming) not in results or lv["last"] < results["live", streaming]["last"]:
                    results["live", streaming] = lv
    print()
    print(f"one transaction of {args.rows:,} inserts; best of {args.rounds} round(s)")
    print(f"{'':<9} {'streaming':<9} {'changes/s':>10} {'wall s':>7} {'first s':>8} {'last s':>7} "
          f"{'peak RSS MiB':>12} {'server spill MiB':>16} {'bridge spill MiB':>16}")
    for streaming in (False, True):
        b = results["backlog", streaming]
        print(f"{'backlog':<9} {str(streaming).lower():<9} {b['rate']:>10,.0f} {b['wall']:>7.1f} {'':>8} {'':>7} "
              f"{b['rss'] / 2**20:>12.0f} {b['server_spill'] / 2**20:>16.0f} {b['bridge_spill'] / 2**20:>16.0f}")
    for streaming in (False, True):
        lv = results["live", streaming]
        print(f"{'live':<9} {str(streaming).lower():<9} {'':>10} {'':>7} {lv['first']:>8.2f} {lv['last']:>7.2f} "
              f"{lv['rss'] / 2**20:>12.0f} {lv['server_spill'] / 2**20:>16.0f} {lv['bridge_spill'] / 2**20:>16.0f}")
    print("live: seconds from COMMIT returning to the transaction's first and last entry in Redis")
    return 0


if __name__ == "__main__":
    sys.exit(main())
