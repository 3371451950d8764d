"""The primary's cost of the bridge with the slot on the primary and on a standby, side by side in one run.

A PostgreSQL 18 primary and a physical standby (hot_standby_feedback, a physical slot). Each
round writes a backlog of --changes inserts into items (transactions of --tx-rows rows) on the
primary, waits until the standby replayed it, then drains it with `cdc run --until-caught-up`,
once with the slot on the primary and once with the slot on the standby (`postgres.slot_dsn`),
alternating, --rounds times. Printed per round: changes per second of the drain, and the CPU
each server's processes (every child of its postmaster: walsenders, backends, background
workers) spent during the drain, per change.

Usage: python bench/standby_decoding.py [--changes 200000] [--tx-rows 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from servers import cdc_command, compile_package  # noqa: E402
from items import ITEM_MAPPING, ITEM_ROWS, ITEMS_TABLE  # noqa: E402
from cdc.demo.local import LocalPostgres, LocalRedis, pg_bin_for, wait_for  # noqa: E402


def cluster_cpu(server: LocalPostgres) -> float:
    """CPU seconds of a server's postmaster and every process under it so far: those that ended (a walsender
    when its reader left) count in the postmaster's children times once it reaped them."""
    pid = int((server.data / "postmaster.pid").read_text().split()[0])
    root = psutil.Process(pid)
    own = root.cpu_times()
    total = own.user + own.system + own.children_user + own.children_system
    for proc in root.children(recursive=True):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def replayed(standby_dsn: str, primary_dsn: str) -> bool:
    with psycopg.connect(primary_dsn, autocommit=True) as p, psycopg.connect(standby_dsn, autocommit=True) as s:
        target = p.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        return s.execute("SELECT pg_last_wal_replay_lsn() >= %s", (target,)).fetchone()[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=200_000)
    parser.add_argument("--tx-rows", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    compile_package()
    root = Path(tempfile.mkdtemp(prefix="cdc-bench-standby-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    bin_dir = pg_bin_for("18")
    primary = LocalPostgres(root / "primary", bin_dir=bin_dir, settings={"wal_keep_size": "'1GB'"})
    rd = LocalRedis(root / "redis", appendonly=False)
    standby = None
    results: list[tuple[str, int, float, float, float]] = []
    try:
        primary.start()
        rd.start()
        standby = primary.make_standby(root / "standby", "standby1", settings={"hot_standby_feedback": "on"})
        standby.start()
        pdsn, sdsn = primary.dsn_for("postgres"), standby.dsn_for("postgres")
        with psycopg.connect(pdsn, autocommit=True) as conn:
            conn.execute(ITEMS_TABLE)
        (root / "mappings").mkdir()
        (root / "mappings" / "item.yaml").write_text(ITEM_MAPPING)
        client = redis.Redis.from_url(rd.url)
        next_id = 1
        for r in range(args.rounds):
            for where in ("primary", "standby"):
                slot = f"bench_{where}_{r}"
                config = root / f"{slot}.yaml"
                extra = f', slot_dsn: "{sdsn}"' if where == "standby" else ""
                config.write_text(f'postgres: {{dsn: "{pdsn}", slot: {slot}, publication: cdc{extra}}}\n'
                                  f"redis: {{url: \"{rd.url}\"}}\nmappings: {root / 'mappings'}\nhttp: {{port: 0}}\n")
                client.flushall()
                subprocess.run(cdc_command("init", config), cwd=ROOT, check=True, capture_output=True)
                with psycopg.connect(pdsn, autocommit=True) as conn:
                    for lo in range(next_id, next_id + args.changes, args.tx_rows):
                        hi = min(lo + args.tx_rows, next_id + args.changes) - 1
                        conn.execute("INSERT INTO items " + ITEM_ROWS.format(lo=lo, hi=hi))
                next_id += args.changes
                wait_for(lambda: replayed(sdsn, pdsn), 300, "the standby to replay the backlog")
                cpu_p, cpu_s = cluster_cpu(primary), cluster_cpu(standby)
                started = time.monotonic()
                subprocess.run(cdc_command("run", config, "--until-caught-up"), cwd=ROOT, check=True,
                               capture_output=True, timeout=1800)
                elapsed = time.monotonic() - started
                cpu_p, cpu_s = cluster_cpu(primary) - cpu_p, cluster_cpu(standby) - cpu_s
                assert client.xlen("cdc:item") == args.changes, client.xlen("cdc:item")
                results.append((where, r, args.changes / elapsed, cpu_p / args.changes * 1e6, cpu_s / args.changes * 1e6))
                print(f"round {r} slot on the {where}: {args.changes / elapsed:,.0f} changes/s, primary "
                      f"{cpu_p / args.changes * 1e6:.2f} us/change, standby {cpu_s / args.changes * 1e6:.2f} us/change",
                      flush=True)
                with psycopg.connect(sdsn if where == "standby" else pdsn, autocommit=True) as conn:
                    conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    finally:
        rd.stop()
        if standby is not None:
            standby.stop("immediate")
        primary.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)

    def best(where: str, index: int, low: bool) -> float:
        values = [row[index] for row in results if row[0] == where]
        return min(values) if low else max(values)

    rate_p, rate_s = best("primary", 2, False), best("standby", 2, False)
    cost_p, cost_s = best("primary", 3, True), best("standby", 3, True)
    print(f"\n{args.changes:,} changes in transactions of {args.tx_rows}, best of {args.rounds} round(s):")
    print("| slot on | changes/s | primary CPU per change | standby CPU per change |")
    print("|---|---|---|---|")
    for where in ("primary", "standby"):
        print(f"| {where} | {best(where, 2, False):,.0f} | {best(where, 3, True):.2f} us | {best(where, 4, True):.2f} us |")
    print(f"primary's CPU with the slot on the standby: {cost_s / cost_p:.3f}x; throughput from the standby: "
          f"{rate_s / rate_p:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
