"""Walsender CPU per change with and without publication column lists, side by side in one run.

The throughput benchmark's schema and small and large workloads (bench/throughput.py: rides carry an
unmapped `internal_note`, items an unmapped `secret`), committed once after two slots are created:
one read through publication `whole` (every column, as before column lists), one through
publication `listed`, which `cdc init` makes for the benchmark's mappings (only the mapped columns,
key and replica identity). Each slot is drained by a raw pgoutput reader (psycopg replication
connection, proto 1, no parsing) until a marker past the end; the walsender's CPU (utime + stime
from /proc/PID/stat, the pid from pg_replication_slots.active_pid) and the bytes it sent are counted.

Usage: python bench/publication_columns.py [--changes 1000000] [--workloads small,large] [--rounds 1]
"""

from __future__ import annotations

import argparse
import select
import subprocess
import sys
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from servers import bench_servers, cdc_command, cpu_seconds as cpu_s  # noqa: E402
from throughput import MAPPINGS, SCHEMA, workload_large, workload_small  # noqa: E402

def drain(dsn: str, slot: str, publication: str) -> tuple[float, int]:
    """(walsender CPU seconds, bytes of XLogData) to read every pending change of `slot`."""
    conn = psycopg.connect(dsn, replication="database", autocommit=True)
    try:
        conn.execute(f"START_REPLICATION SLOT {slot} LOGICAL 0/0 (proto_version '1', "
                     f"publication_names '{publication}', messages 'true')")
        with psycopg.connect(dsn, autocommit=True) as other:
            pid = other.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()[0]
        cpu0 = cpu_s(pid)
        pgconn = conn.pgconn
        pgconn.nonblocking = 1
        sent, done = 0, False
        while not done:
            select.select([pgconn.socket], [], [], 1)
            pgconn.consume_input()
            while True:
                n, buf = pgconn.get_copy_data(1)
                if n <= 0:
                    break
                if buf[0] == ord("w"):
                    sent += n - 25
                    if buf[25] == ord("M") and b"bench-end" in bytes(buf[25:60]):
                        done = True
        return cpu_s(pid) - cpu0, sent
    finally:
        conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=1_000_000)
    parser.add_argument("--workloads", default="small,large")
    parser.add_argument("--rounds", type=int, default=1, help="drains of each publication, alternating")
    args = parser.parse_args()
    settings = {"synchronous_commit": "off", "max_wal_size": "8GB"}
    rows = []
    with bench_servers("cdc-bench-pubcols-", settings) as (root, pg, rd):
        (root / "mappings").mkdir()
        for name, text in MAPPINGS.items():
            (root / "mappings" / name).write_text(text)
        config = root / "cdc.yaml"
        config.write_text(f"postgres: {{dsn: '{pg.dsn}', slot: listed_0, publication: listed}}\n"
                          f"redis: {{url: '{rd.url}'}}\nmappings: mappings/\nhttp: {{port: 0}}\n")
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute(SCHEMA.replace("CREATE PUBLICATION cdc", "CREATE PUBLICATION whole"))
        print(subprocess.run(cdc_command("init", config), cwd=ROOT, check=True, capture_output=True, text=True).stdout)
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            for name in args.workloads.split(","):
                for i in range(args.rounds):
                    conn.execute(f"SELECT pg_create_logical_replication_slot('whole_{i}', 'pgoutput')")
                    if i:
                        conn.execute(f"SELECT pg_create_logical_replication_slot('listed_{i}', 'pgoutput')")
                total, shape = (workload_small(conn, args.changes, 0.42) if name == "small"
                                else workload_large(conn, args.changes))
                conn.execute("SELECT pg_logical_emit_message(false, 'bench-end', '')")
                conn.execute("CHECKPOINT")
                print(f"[{name}] {total:,} changes: {shape}", flush=True)
                for i in range(args.rounds):
                    for pub in ("whole", "listed"):
                        cpu, sent = drain(pg.dsn, f"{pub}_{i}", pub)
                        rows.append((name, i + 1, pub, total, cpu, sent))
                        print(f"[{name}] round {i + 1} {pub}: walsender {cpu * 1e6 / total:.2f} µs/change, "
                              f"{sent / total:.1f} bytes/change", flush=True)
                for i in range(args.rounds):
                    for pub in ("whole", "listed"):
                        conn.execute("SELECT pg_drop_replication_slot(%s)", (f"{pub}_{i}",))
                conn.execute("SELECT pg_create_logical_replication_slot('listed_0', 'pgoutput')")
    print()
    print(f"{'workload':<9} {'round':>5} {'publication':<12} {'walsender µs/change':>20} {'bytes/change':>13}")
    for name, rnd, pub, total, cpu, sent in rows:
        print(f"{name:<9} {rnd:>5} {pub:<12} {cpu * 1e6 / total:>20.2f} {sent / total:>13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
