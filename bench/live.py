"""Live traffic: pgbench's TPC-B-like script with no reader, with the bridge streaming, with pg_recvlogical.

pgbench (`-c 4 -j 2 -T 15` by default) runs its built-in TPC-B-like script against a scale-10 database
(`--scale`), whose four tables are mapped and published (pgbench_history gets a bigserial primary key,
`hid`, so that it can be mapped). Each round runs pgbench once per reader, alternating, in one run:

- `none`: no reader (each TPS ratio is to the `none` run of the same round);
- `bridge`: `cdc run` streaming the publication (one run per `--delays` value of `batch.max_delay_ms`),
  from its own slot into an emptied Redis;
- `recvlogical`: pg_recvlogical reading its own slot (pgoutput proto 1, to /dev/null);
- with `--compare DIR`, also `cdc run` from the checkout DIR (its compiled extensions built or copied in),
  with the default `batch.max_delay_ms`: the code before a change, side by side with this one.

Printed per run: pgbench's TPS and its ratio; the CPU per source transaction
of the bridge, its walsender, redis-server and pg_recvlogical (from /proc/PID/stat, from pgbench's start to
when the reader has everything: Redis holds every transaction, or the walsender has sent the last one);
EXECs and Redis commands per transaction (INFO commandstats); commit-to-stream latency p50/p99 (each
pgbench_history entry's Redis ID time minus its commit time `ts_ms`, millisecond resolution); how long
after pgbench ended Redis held everything and the slot confirmed it; and the WAL the slot retains then
(current WAL - restart_lsn) and still to confirm (current WAL - confirmed_flush_lsn). The machine may be
busy with other work: compare the ratios side by side, within one run.

Usage: python bench/live.py [--seconds 15] [--rounds 2] [--clients 4] [--jobs 2] [--scale 10]
       [--delays 5] [--readers none,bridge,recvlogical] [--compare DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from servers import bench_servers, cdc_command, cpu_seconds  # noqa: E402
from cdc.demo.local import pg_bin, wait_for  # noqa: E402

TABLES = ("pgbench_accounts", "pgbench_branches", "pgbench_tellers", "pgbench_history")
MAPPINGS = {
    "account.yaml": "entity: account\ntable: public.pgbench_accounts\nkey: [aid]\n"
                    "fields: {aid: aid, bid: bid, balance: abalance}\n",
    "branch.yaml": "entity: branch\ntable: public.pgbench_branches\nkey: [bid]\nfields: {bid: bid, balance: bbalance}\n",
    "teller.yaml": "entity: teller\ntable: public.pgbench_tellers\nkey: [tid]\n"
                   "fields: {tid: tid, bid: bid, balance: tbalance}\n",
    "history.yaml": "entity: history\ntable: public.pgbench_history\nkey: [hid]\n"
                    "fields: {hid: hid, tid: tid, bid: bid, aid: aid, delta: delta, mtime: mtime}\n",
}
HISTORY = "cdc:history"


def write_config(root: Path, slot: str, pg_dsn: str, redis_url: str, delay_ms: int | None) -> Path:
    config = root / f"cdc-{slot}.yaml"
    batch = f"batch: {{max_delay_ms: {delay_ms}}}\n" if delay_ms is not None else ""
    config.write_text(f"postgres: {{dsn: '{pg_dsn}', slot: {slot}, publication: cdc}}\n"
                      f"redis: {{url: '{redis_url}'}}\nmappings: {root / 'mappings'}\nhttp: {{port: 0}}\n" + batch)
    return config


def pgbench(dsn: str, args) -> tuple[float, int]:
    """Run the TPC-B-like script: (TPS, transactions processed)."""
    out = subprocess.run([str(pg_bin() / "pgbench"), "-n", "-c", str(args.clients), "-j", str(args.jobs),
                          "-T", str(args.seconds), dsn], check=True, capture_output=True, text=True).stdout
    tps = float(re.search(r"tps = ([\d.]+)", out).group(1))
    done = int(re.search(r"number of transactions actually processed: (\d+)", out).group(1))
    return tps, done


def lsn(conn: psycopg.Connection, query: str, *params) -> int:
    text = conn.execute(query, params).fetchone()[0]
    if text is None:
        return 0
    hi, lo = str(text).split("/")
    return (int(hi, 16) << 32) + int(lo, 16)


def commandstats(client: redis.Redis) -> tuple[int, int]:
    """(EXEC calls, every command's calls) so far."""
    stats = client.info("commandstats")
    return stats.get("cmdstat_exec", {}).get("calls", 0), sum(v.get("calls", 0) for v in stats.values())


def latencies(client: redis.Redis) -> list[int]:
    """Each history entry's Redis ID time minus its commit time, in ms, sorted."""
    out = []
    start = "-"
    while True:
        page = client.xrange(HISTORY, start, "+", count=10_000)
        for entry_id, fields in page:
            out.append(int(entry_id.split(b"-")[0]) - int(fields[b"ts_ms"]))
        if len(page) < 10_000:
            return sorted(out)
        start = "(" + page[-1][0].decode()


def walsender_pid(conn: psycopg.Connection, slot: str) -> int | None:
    return conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()[0]


def round_none(pg, args) -> dict:
    tps, done = pgbench(pg.dsn, args)
    return {"tps": tps, "tx": done}


def round_bridge(root: Path, pg, rd, client: redis.Redis, conn: psycopg.Connection, args, slot: str,
                 delay_ms: int | None, tree: Path) -> dict:
    conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    config = write_config(root, slot, pg.dsn, rd.url, delay_ms)
    client.flushall()
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("CDC_PURE_PYTHON", None)
    subprocess.run(cdc_command("init", config), cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    proc = subprocess.Popen(cdc_command("run", config), cwd=tree, env=env)
    try:
        wait_for(lambda: walsender_pid(conn, slot) is not None or proc.poll() is not None, 60, "the bridge to stream")
        start = lsn(conn, "SELECT pg_current_wal_lsn()")
        wait_for(lambda: lsn(conn, "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s", slot)
                 >= start or proc.poll() is not None, 60, "the bridge to catch up")
        if proc.poll() is not None:
            raise SystemExit(f"the bridge exited ({proc.returncode})")
        sender = walsender_pid(conn, slot)
        redis_pid = int(client.info("server")["process_id"])
        client.config_resetstat()
        cpu0 = {"bridge": cpu_seconds(proc.pid), "walsender": cpu_seconds(sender), "redis": cpu_seconds(redis_pid)}
        execs0, commands0 = commandstats(client)
        tps, done = pgbench(pg.dsn, args)
        ended = time.monotonic()
        end = lsn(conn, "SELECT pg_current_wal_lsn()")
        wait_for(lambda: client.xlen(HISTORY) >= done or proc.poll() is not None, 120, "Redis to hold every transaction")
        held_after = time.monotonic() - ended
        cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in
               (("bridge", proc.pid), ("walsender", sender), ("redis", redis_pid))}
        execs1, commands1 = commandstats(client)
        wait_for(lambda: lsn(conn, "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s", slot)
                 >= end or proc.poll() is not None, 120, "the slot to confirm the last transaction")
        confirmed_after = time.monotonic() - ended
        now = lsn(conn, "SELECT pg_current_wal_lsn()")
        retained = now - lsn(conn, "SELECT restart_lsn FROM pg_replication_slots WHERE slot_name = %s", slot)
        unconfirmed = now - lsn(conn, "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s", slot)
        if proc.poll() is not None:
            raise SystemExit(f"the bridge exited ({proc.returncode})")
        got = client.xlen(HISTORY)
        if got != done:
            raise SystemExit(f"the bridge published {got:,} history entries for {done:,} transactions")
        lat = latencies(client)
    finally:
        proc.terminate()
        proc.wait(60)
    wait_for(lambda: walsender_pid(conn, slot) is None, 60, "the slot to be released")
    conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    return {"tps": tps, "tx": done, "cpu": cpu, "execs": execs1 - execs0, "commands": commands1 - commands0,
            "p50": lat[len(lat) // 2], "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
            "held_after": held_after, "confirmed_after": confirmed_after, "retained": retained,
            "unconfirmed": unconfirmed}


def round_recvlogical(pg, conn: psycopg.Connection, args, slot: str) -> dict:
    conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    proc = subprocess.Popen([str(pg_bin() / "pg_recvlogical"), "-d", pg.dsn, "--slot", slot, "--start",
                             "-o", "proto_version=1", "-o", "publication_names=cdc", "-f", "/dev/null"])
    try:
        wait_for(lambda: walsender_pid(conn, slot) is not None or proc.poll() is not None, 60, "pg_recvlogical to stream")
        sender = walsender_pid(conn, slot)
        cpu0 = {"walsender": cpu_seconds(sender), "recvlogical": cpu_seconds(proc.pid)}
        tps, done = pgbench(pg.dsn, args)
        end = lsn(conn, "SELECT pg_current_wal_lsn()")
        wait_for(lambda: lsn(conn, "SELECT sent_lsn FROM pg_stat_replication WHERE pid = %s", sender) >= end
                 or proc.poll() is not None, 120, "the walsender to send everything")
        time.sleep(0.2)  # pg_recvlogical reads what was sent
        cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in (("walsender", sender), ("recvlogical", proc.pid))}
        now = lsn(conn, "SELECT pg_current_wal_lsn()")
        retained = now - lsn(conn, "SELECT restart_lsn FROM pg_replication_slots WHERE slot_name = %s", slot)
        unconfirmed = now - lsn(conn, "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s", slot)
    finally:
        proc.terminate()
        proc.wait(60)
    wait_for(lambda: walsender_pid(conn, slot) is None, 60, "the slot to be released")
    conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    return {"tps": tps, "tx": done, "cpu": cpu, "retained": retained, "unconfirmed": unconfirmed}


def label_of(reader: str, delay: int | None) -> str:
    return {"bridge": f"bridge max_delay {delay}", "compare": "bridge (--compare)"}.get(reader, reader)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=15, help="pgbench -T of each run (e.g. 30 for steadier figures)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each reader, alternating")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--delays", default="5", help="batch.max_delay_ms of the bridge's runs, comma-separated")
    parser.add_argument("--readers", default="none,bridge,recvlogical", help="of none,bridge,recvlogical")
    parser.add_argument("--compare", type=Path, help="a checkout whose `cdc run` also streams (default settings)")
    args = parser.parse_args()
    delays = [int(d) for d in args.delays.split(",") if d]
    readers: list[tuple[str, int | None]] = []
    for r in args.readers.split(","):
        if r == "bridge":
            readers += [("bridge", d) for d in delays]
            if args.compare:
                readers.append(("compare", None))
        elif r in ("none", "recvlogical"):
            readers.append((r, None))
        else:
            parser.error(f"unknown reader {r!r}")

    started = time.monotonic()
    results: dict[tuple[str, int | None], list[dict]] = {r: [] for r in readers}
    with bench_servers("cdc-live-", {"max_wal_size": "4GB"}) as (root, pg, rd):
        client = redis.Redis.from_url(rd.url)
        (root / "mappings").mkdir()
        for name, text in MAPPINGS.items():
            (root / "mappings" / name).write_text(text)
        subprocess.run([str(pg_bin() / "pgbench"), "-i", "-q", "-s", str(args.scale), pg.dsn], check=True,
                       capture_output=True)
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute("ALTER TABLE pgbench_history ADD COLUMN hid bigserial PRIMARY KEY")
            conn.execute(f"CREATE PUBLICATION cdc FOR TABLE {', '.join(TABLES)}")
            conn.execute("CHECKPOINT")
            for i in range(args.rounds):
                for reader, delay in readers:
                    conn.execute("VACUUM pgbench_branches, pgbench_tellers")
                    label = reader if delay is None else f"{reader} {delay} ms"
                    print(f"[round {i + 1}] {label} ...", flush=True)
                    if reader == "none":
                        r = round_none(pg, args)
                    elif reader == "recvlogical":
                        r = round_recvlogical(pg, conn, args, f"recv_{i}")
                    else:
                        tree = args.compare.resolve() if reader == "compare" else ROOT
                        r = round_bridge(root, pg, rd, client, conn, args, f"{reader}_{delay or 0}_{i}", delay, tree)
                    results[reader, delay].append(r)
    nones = results.get(("none", None), [])

    print()
    print(f"pgbench TPC-B-like, scale {args.scale}, -c {args.clients} -j {args.jobs} -T {args.seconds}; "
          "CPU µs per source transaction (pgbench's start to the reader having everything)")
    header = (f"{'reader':<22} {'round':>5} {'TPS':>8} {'ratio':>6} {'bridge':>7} {'walsndr':>7} {'redis':>6} "
              f"{'recvlog':>7} {'EXEC/tx':>7} {'cmds/tx':>7} {'p50 ms':>6} {'p99 ms':>6} {'held s':>6} "
              f"{'conf s':>6} {'retained':>9} {'unconf':>9}")
    print(header)
    print("-" * len(header))
    for (reader, delay), runs in results.items():
        label = label_of(reader, delay)
        for i, r in enumerate(runs):
            cpu = r.get("cpu", {})

            def per_tx(name: str) -> str:
                return f"{cpu[name] / r['tx'] * 1e6:.0f}" if name in cpu else ""
            ratio = f"{r['tps'] / nones[i]['tps']:.2f}" if i < len(nones) else ""
            execs = f"{r['execs'] / r['tx']:.3f}" if "execs" in r else ""
            commands = f"{r['commands'] / r['tx']:.2f}" if "commands" in r else ""
            print(f"{label:<22} {i + 1:>5} {r['tps']:>8.0f} {ratio:>6} {per_tx('bridge'):>7} {per_tx('walsender'):>7} "
                  f"{per_tx('redis'):>6} {per_tx('recvlogical'):>7} {execs:>7} {commands:>7} "
                  f"{r.get('p50', ''):>6} {r.get('p99', ''):>6} "
                  f"{format(r['held_after'], '.2f') if 'held_after' in r else '':>6} "
                  f"{format(r['confirmed_after'], '.2f') if 'confirmed_after' in r else '':>6} "
                  f"{format(r['retained'], ',') if 'retained' in r else '':>9} "
                  f"{format(r['unconfirmed'], ',') if 'unconfirmed' in r else '':>9}")
    if nones:
        print("mean ratio: " + ", ".join(
            f"{label_of(reader, delay)} {statistics.mean(r['tps'] / n['tps'] for r, n in zip(runs, nones)):.2f}"
            for (reader, delay), runs in results.items() if reader != "none"))
    print("ratio: TPS over the no-reader run's of the same round; held s / conf s: after pgbench ended, until Redis held "
          "every transaction / the slot confirmed the last one; retained / unconf: bytes of WAL the slot retains "
          "(restart_lsn) / has not confirmed, then")
    print(f"\nwhole benchmark: {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
