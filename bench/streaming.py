"""Does pgoutput's streaming of in-progress transactions help a huge transaction? Measured in one run.

Commits ONE transaction of 1,000,000 inserts into items (and, with --update-rows, a second one
updating that many rows), after creating one slot per drain. Then, alternating, `--rounds` times,
for each logical_decoding_work_mem (--work-mem, set on the replication connection) and each mode:

- proto1:  pgoutput proto_version 1, whole transactions (what the bridge asks for today: the
           walsender decodes the whole transaction, spilling past logical_decoding_work_mem,
           before it sends its first change);
- stream:  proto_version 2 with streaming on (changes of the in-progress transaction are sent
           in blocks once logical_decoding_work_mem is exceeded; the commit follows at the end)

it drains the slot with each consumer:

- recvlogical: pg_recvlogical -f - (to a pipe read by a thread that counts bytes), --endpos at
               the end LSN; the whole process' wall time and the time until its first output byte;
- py<N>:       a Python consumer of the replication protocol (pg_recvlogical's output is not
               framed, so a reader of it cannot tell its messages apart) that busy-waits N µs per
               message: a consumer slower than the server's decoding. Time to its first message
               and to the last commit.

Prints, per work_mem × mode × consumer, the best of the rounds: time to first output, total
wall time, and the slot's spill and stream figures (pg_stat_replication_slots).
Usage: python bench/streaming.py [--rows 1000000] [--update-rows 0] [--work-mem 64MB,8MB]
       [--consumer-us 0,3,10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from servers import bench_servers  # noqa: E402
from items import ITEM_ROWS, ITEMS_TABLE  # noqa: E402
from cdc.demo.local import pg_bin  # noqa: E402
from cdc.source.framing import standby_status_update  # noqa: E402

SCHEMA = ITEMS_TABLE + "CREATE PUBLICATION cdc FOR TABLE items;\n"
MODES = {
    "proto1": ["proto_version=1", "publication_names=cdc"],
    "stream": ["proto_version=2", "streaming=on", "publication_names=cdc"],
}


def conninfo(pg, work_mem: str) -> str:
    return (f"host=127.0.0.1 port={pg.port} user=postgres dbname=postgres "
            f"options='-c logical_decoding_work_mem={work_mem}'")


def drain_recvlogical(dsn: str, slot: str, mode: str, end_lsn: str) -> dict:
    """pg_recvlogical into a pipe: whole-process wall time and the time to its first output byte."""
    cmd = [str(pg_bin() / "pg_recvlogical"), "-d", dsn, "--slot", slot, "--start", "--endpos", end_lsn, "--no-loop", "-f", "-"]
    for opt in MODES[mode]:
        cmd += ["-o", opt]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    first = [None]
    nbytes = [0]

    def reader() -> None:
        fd = proc.stdout.fileno()
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return
            if first[0] is None:
                first[0] = time.monotonic()
            nbytes[0] += len(chunk)

    t = threading.Thread(target=reader)
    t.start()
    if proc.wait() != 0:
        raise SystemExit(f"pg_recvlogical failed on {slot}")
    total = time.monotonic() - t0
    t.join()
    return {"first": (first[0] or time.monotonic()) - t0, "total": total, "bytes": nbytes[0]}


def spin(ns: int) -> None:
    deadline = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < deadline:
        pass


def drain_python(dsn: str, slot: str, mode: str, commits: int, cost_us: float) -> dict:
    """A consumer of the replication protocol spending `cost_us` per message; time to its first
    message and to the `commits`-th commit (C, or c of a streamed transaction)."""
    cost_ns = int(cost_us * 1000)
    options = ", ".join(f"{k} '{v}'" for k, v in (o.split("=", 1) for o in MODES[mode]))
    t0 = time.monotonic()
    conn = psycopg.connect(dsn, replication="database", autocommit=True)
    try:
        conn.execute(f"START_REPLICATION SLOT {slot} LOGICAL 0/0 ({options})")
        pgconn = conn.pgconn
        first = None
        seen = messages = nbytes = 0
        last_end = 0
        while seen < commits:
            n, data = pgconn.get_copy_data(0)
            if n <= 0:
                raise SystemExit(f"replication ended early on {slot}: {pgconn.get_error_message()!r}")
            kind = data[0]
            if kind == 0x77:  # 'w' XLogData: 1 + 8 start + 8 end + 8 time, then the pgoutput message
                if first is None:
                    first = time.monotonic()
                messages += 1
                nbytes += n - 25
                last_end = int.from_bytes(data[9:17], "big")
                tag = data[25]
                if tag == 0x43 or tag == 0x63:  # 'C' commit, 'c' stream commit
                    seen += 1
                if cost_ns:
                    spin(cost_ns)
            elif kind == 0x6B and data[17]:  # 'k' keepalive asking for a reply
                pgconn.put_copy_data(standby_status_update(last_end, last_end, last_end))
                pgconn.flush()
        total = time.monotonic() - t0
    finally:
        conn.close()
    return {"first": first - t0, "total": total, "bytes": nbytes, "messages": messages}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="inserts in the one transaction")
    parser.add_argument("--update-rows", type=int, default=0, help="rows of a second transaction's UPDATE (0: none)")
    parser.add_argument("--work-mem", default="64MB,8MB", help="logical_decoding_work_mem values, comma-separated")
    parser.add_argument("--consumer-us", default="0,3,10", help="the Python consumers' µs per message, comma-separated")
    parser.add_argument("--no-recvlogical", action="store_true", help="only the Python consumers")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    work_mems = [w for w in args.work_mem.split(",") if w]
    consumers = ([] if args.no_recvlogical else ["recvlogical"]) + [f"py{c}" for c in args.consumer_us.split(",") if c]
    commits = 1 + (1 if args.update_rows else 0)
    changes = args.rows + args.update_rows
    runs = [(r, wm, c, mode) for r in range(args.rounds) for wm in work_mems for c in consumers for mode in MODES]
    slot_of = {run: f"s{i}" for i, run in enumerate(runs)}

    settings = {"synchronous_commit": "off", "max_wal_size": "8GB",
                "max_replication_slots": str(len(runs) + 5), "max_wal_senders": str(len(runs) + 5)}
    started = time.monotonic()
    results: dict[tuple, list[dict]] = {}
    with bench_servers("cdc-streaming-", settings) as (_root, pg, _rd):
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute(SCHEMA)
            for slot in slot_of.values():
                conn.execute(f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')")
            t0 = time.monotonic()
            conn.execute("INSERT INTO items " + ITEM_ROWS.format(lo=1, hi=args.rows))
            if args.update_rows:
                conn.execute(f"UPDATE items SET qty = qty + 1, price = price * 1.5 WHERE id <= {args.update_rows}")
            end_lsn = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]
            wal = conn.execute("SELECT pg_size_pretty(pg_current_wal_lsn() - '0/0'::pg_lsn)").fetchone()[0]
            print(f"committed {args.rows:,} inserts in one transaction"
                  + (f" and an UPDATE of {args.update_rows:,} rows in another" if args.update_rows else "")
                  + f" in {time.monotonic() - t0:.1f}s (end {end_lsn}, WAL {wal})", flush=True)
            conn.execute("CHECKPOINT")
        for run in runs:
            r, wm, consumer, mode = run
            dsn = conninfo(pg, wm)
            if consumer == "recvlogical":
                res = drain_recvlogical(dsn, slot_of[run], mode, end_lsn)
            else:
                res = drain_python(dsn, slot_of[run], mode, commits, float(consumer[2:]))
            print(f"round {r + 1} work_mem {wm:>5} {consumer:<11} {mode:<6}: first output {res['first']:6.2f}s, "
                  f"total {res['total']:6.2f}s, {res['bytes'] / 2**20:6.1f} MiB", flush=True)
            results.setdefault((wm, consumer, mode), []).append(res)
        time.sleep(1)  # the walsenders' last statistics
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            stats = {row[0]: row[1:] for row in conn.execute(
                "SELECT slot_name, spill_txns, spill_bytes, stream_txns, stream_count, stream_bytes FROM pg_stat_replication_slots")}

    print()
    print(f"one transaction of {args.rows:,} inserts" + (f" + one of {args.update_rows:,} updates" if args.update_rows else "")
          + f" ({changes:,} changes); best of {args.rounds} round(s), each drain from its own slot")
    header = (f"{'work_mem':>8} {'consumer':<11} {'mode':<6} {'first output s':>14} {'total s':>8} {'changes/s':>10} "
              f"{'spilled MiB':>11} {'streamed MiB (blocks)':>21}  {'stream/proto1 total':>19}")
    print(header)
    print("-" * len(header))
    for wm in work_mems:
        for consumer in consumers:
            base = min(x["total"] for x in results[wm, consumer, "proto1"])
            for mode in MODES:
                rs = results[wm, consumer, mode]
                first = min(x["first"] for x in rs)
                total = min(x["total"] for x in rs)
                st = stats.get(slot_of[0, wm, consumer, mode], (0, 0, 0, 0, 0))
                print(f"{wm:>8} {consumer:<11} {mode:<6} {first:>14.2f} {total:>8.2f} {changes / total:>10,.0f} "
                      f"{st[1] / 2**20:>11.1f} {st[4] / 2**20:>12.1f} ({st[3]:>6,})  {total / base:>19.2f}")
    print(f"\nwhole benchmark: {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
