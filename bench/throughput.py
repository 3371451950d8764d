"""Throughput, memory and latency of the bridge, side by side with pg_recvlogical, in one run.

Workloads (each committed after its own slots are created, so every reader drains the same WAL):

- small: N changes over riders and rides (20% rider inserts, 40% ride inserts, 25% ride
  updates, 15% ride deletes) in transactions of 1-20 changes (random sizes, seeded),
  committed by a procedure that COMMITs inside its loop;
- large: N changes to items (id bigint, qty int, price float8, name text, at timestamptz,
  and an unmapped column `secret`) in transactions of N/5 or more changes: 50% inserts
  (two transactions), 30% updates (one), 20% deletes (one);
- rss: one transaction of 2,000,000 inserts into items (--rss-changes), for the bridge's
  peak RSS through it.

Each workload is drained by pg_recvlogical (pgoutput, to /dev/null, --endpos at the end) and by
`cdc run --until-caught-up` once per implementation path (`compiled`, and `pure` with
CDC_PURE_PYTHON=1), append mode (`redis.append: script` and `transaction`) and
`postgres.streaming` (`on`: the server streams a transaction past its logical_decoding_work_mem
while decoding it, the bridge holds it until the commit; `off`: the server decodes it whole first), each from
its own slot into an emptied Redis, alternating, `--rounds` times; the best of each is shown.
Rates are changes over WHOLE-PROCESS WALL TIME (process start to exit) of each; every drain's
entry count in Redis is checked against the changes committed. Redis' CPU per entry comes from
INFO cpu (main thread) and INFO commandstats around each drain; the bridge's peak RSS is sampled
every 50 ms, its own CPU (start-up included) comes from its rusage when it exits.
BENCH_BRIDGE_WRAP (e.g. a profiler's command line ending in --) runs each bridge under it.

Latency: a bridge (compiled path, transaction append) runs continuously while writers commit a
steady 10,000 and then 50,000 changes/s (multi-row INSERTs in transactions of
--latency-tx-rows rows); each entry's latency is its Redis entry time minus its commit time
(ts_ms). The rate the writers actually achieved is printed beside p50/p99. `--latency-delays 1,5,20`
runs it once per `batch.max_delay_ms` value (a bridge each), for the latency each value buys.

Usage: python bench/throughput.py [--changes 1000000] [--workloads small,large,rss]
       [--paths compiled,pure] [--modes script,transaction] [--streaming off] [--rounds 2]
       [--boundaries off,on] [--latency-rates 10000,50000] [--latency-seconds 10]
       [--latency-delays 1,5,20]

`--boundaries off,on` drains each workload with and without transaction END records
(`transactions.stream`) side by side; with them on, the END records' counts are checked to add up
to the changes committed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from servers import WalsenderCpu, bench_servers, cdc_command, peak_rss, prepare  # noqa: E402
from items import ITEM_MAPPING, ITEM_ROWS, ITEMS_TABLE  # noqa: E402
from cdc.demo.local import pg_bin, wait_for  # noqa: E402

SCHEMA = ITEMS_TABLE + """
CREATE TABLE riders (id bigint PRIMARY KEY, name text NOT NULL, email text NOT NULL);
CREATE TABLE rides (id bigint PRIMARY KEY, rider_id bigint NOT NULL, distance_m numeric(12,3) NOT NULL,
                    status text NOT NULL DEFAULT 'done', internal_note text);
CREATE PUBLICATION cdc FOR TABLE riders, rides, items;

-- `total` changes over riders and rides in transactions of 1-20 changes (sizes from random(),
-- seeded): 20% rider inserts, 40% ride inserts, 25% updates and 15% deletes of live rides
CREATE PROCEDURE small_transactions(total bigint, seed float8, INOUT transactions bigint DEFAULT 0)
LANGUAGE plpgsql AS $$
DECLARE
    done bigint := 0;
    size int;
    r float8;
    next_rider bigint := 0;
    next_ride bigint := 0;
    oldest_ride bigint := 1;  -- rides are deleted oldest first: ids oldest_ride..next_ride are live
    target bigint;
BEGIN
    PERFORM setseed(seed);
    WHILE done < total LOOP
        size := least(1 + floor(random() * 20)::int, total - done);
        FOR k IN 1..size LOOP
            r := random();
            IF r < 0.20 THEN
                next_rider := next_rider + 1;
                INSERT INTO riders VALUES (next_rider, 'rider ' || next_rider, 'r' || next_rider || '@example.com');
            ELSIF r < 0.60 OR next_ride < oldest_ride THEN
                next_ride := next_ride + 1;
                INSERT INTO rides (id, rider_id, distance_m, internal_note)
                    VALUES (next_ride, 1 + next_ride % 1000, (next_ride % 100000) / 7.0, 'private');
            ELSIF r < 0.85 THEN
                target := oldest_ride + floor(random() * (next_ride - oldest_ride + 1))::bigint;
                UPDATE rides SET distance_m = distance_m + 1 WHERE id = target;
            ELSE
                DELETE FROM rides WHERE id = oldest_ride;
                oldest_ride := oldest_ride + 1;
            END IF;
        END LOOP;
        done := done + size;
        transactions := transactions + 1;
        COMMIT;
    END LOOP;
END $$;
"""
MAPPINGS = {
    "ride.yaml": "entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id, distance: distance_m, rider: rider_id, status: status}\n",
    "rider.yaml": "entity: rider\ntable: public.riders\nkey: [id]\nfields: {id: id, name: name, email: email}\n",
    "item.yaml": ITEM_MAPPING,
}
STREAMS = {"small": ("cdc:ride", "cdc:rider"), "large": ("cdc:item",), "rss": ("cdc:item",)}
#: the transactions stream of the drains with transaction boundaries on (`transactions.stream`)
TX_STREAM = "cdc:transactions"
WORKLOADS = ("small", "large", "rss")
#: the command that appends a batch, whose INFO commandstats time includes the XADDs it runs
APPEND_COMMAND = {"script": "cmdstat_evalsha", "transaction": "cmdstat_exec"}


def workload_small(conn: psycopg.Connection, changes: int, seed: float) -> tuple[int, str]:
    transactions = conn.execute("CALL small_transactions(%s, %s)", (changes, seed)).fetchone()[0]
    return changes, f"{transactions:,} transactions of 1-20 changes (mean {changes / transactions:.1f})"


def workload_large(conn: psycopg.Connection, changes: int) -> tuple[int, str]:
    """Inserts in two transactions, updates in one, deletes in one: each at least changes/5."""
    n_ins = changes * 50 // 100
    n_upd = changes * 30 // 100
    n_del = changes - n_ins - n_upd
    half = n_ins // 2
    sizes = []
    for lo, hi in ((1, half), (half + 1, n_ins)):
        conn.execute("INSERT INTO items " + ITEM_ROWS.format(lo=lo, hi=hi))
        sizes.append(hi - lo + 1)
    conn.execute(f"UPDATE items SET qty = qty + 1, price = price * 1.5, name = name || '+', at = at + interval '1 hour', "
                 f"secret = 'changed' WHERE id BETWEEN 1 AND {n_upd}")
    sizes.append(n_upd)
    conn.execute(f"DELETE FROM items WHERE id BETWEEN {n_ins - n_del + 1} AND {n_ins}")
    sizes.append(n_del)
    return n_ins + n_upd + n_del, "transactions of " + " (insert), ".join(f"{s:,}" for s in sizes[:2]) + \
        f" (insert), {sizes[2]:,} (update), {sizes[3]:,} (delete)"


def workload_rss(conn: psycopg.Connection, changes: int) -> tuple[int, str]:
    base = 1_000_000_000
    conn.execute("INSERT INTO items " + ITEM_ROWS.format(lo=base + 1, hi=base + changes))
    return changes, f"one transaction of {changes:,} inserts"


def stream_total(client: redis.Redis, streams: tuple[str, ...]) -> int:
    return sum(client.xlen(s) for s in streams)


def id_ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-")[0])


def register(config: Path) -> None:
    """`cdc init`: the slot exists already; this records in Redis that it holds the slot's changes."""
    subprocess.run(cdc_command("init", config), cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def redis_cpu_us(client: redis.Redis) -> float:
    """Redis' main-thread CPU so far, in µs (INFO cpu): commands, parsing and network."""
    cpu = client.info("cpu")
    return (cpu.get("used_cpu_sys_main_thread", cpu["used_cpu_sys"])
            + cpu.get("used_cpu_user_main_thread", cpu["used_cpu_user"])) * 1e6


def bridge_env(path: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CDC_PURE_PYTHON", None)
    if path == "pure":
        env["CDC_PURE_PYTHON"] = "1"
    return env


def run_bridge(config: Path, args: list[str], path: str) -> tuple[subprocess.Popen, list[int]]:
    wrap = os.environ.get("BENCH_BRIDGE_WRAP", "").split()  # e.g. a profiler's command line, ending in --
    proc = subprocess.Popen([*wrap, *cdc_command("run", config, *args)], cwd=ROOT, env=bridge_env(path))
    return proc, peak_rss(proc)


def end_records(client: redis.Redis) -> tuple[int, int]:
    """(END records, the entries they count) in the transactions stream."""
    import orjson

    ends = counted = 0
    start = "-"
    while True:
        page = client.xrange(TX_STREAM, start, "+", count=10_000)
        for entry_id, fields in page:
            ends += 1
            counted += orjson.loads(fields[b"data"])["count"]
        if len(page) < 10_000:
            return ends, counted
        start = "(" + page[-1][0].decode()


def drain_bridge(config: Path, client: redis.Redis, total: int, streams: tuple[str, ...], mode: str, path: str,
                 streaming: str, boundaries: str = "off", walsender: tuple[str, str] | None = None) -> dict:
    """`cdc run --until-caught-up` into an empty Redis: whole-process wall time, peak RSS, Redis CPU per entry,
    and with `walsender` (dsn, slot) the CPU its walsender spent."""
    client.flushall()
    register(config)
    client.config_resetstat()
    cpu0 = redis_cpu_us(client)
    t0 = time.monotonic()
    proc, peak = run_bridge(config, ["--until-caught-up"], path)
    sender = WalsenderCpu(*walsender) if walsender else None
    _, status, usage = os.wait4(proc.pid, 0)  # its rusage: the bridge's own CPU, start to exit
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"bridge failed ({config.name})")
    wall_s = time.monotonic() - t0
    cpu1 = redis_cpu_us(client)
    command_us = client.info("commandstats").get(APPEND_COMMAND[mode], {}).get("usec", 0)
    got = stream_total(client, streams)
    if got != total:
        raise SystemExit(f"bridge ({path}, {mode}, streaming {streaming}) published {got:,} entries, expected {total:,}")
    ends = 0
    if boundaries == "on":
        ends, counted = end_records(client)
        if not ends or counted != total:
            raise SystemExit(f"bridge ({path}, {mode}): {ends:,} END records counting {counted:,} entries, expected {total:,}")
    return {"rate": total / wall_s, "wall": wall_s, "rss": peak[0], "cpu_per_entry": (cpu1 - cpu0) / total,
            "command_per_entry": command_us / total, "ends": ends,
            "bridge_cpu_per_change": (usage.ru_utime + usage.ru_stime) / total * 1e6,
            "walsender_cpu_per_change": sender.stop() / total * 1e6 if sender else float("nan")}


def drain_recvlogical(dsn: str, slot: str, end_lsn: str, total: int) -> dict:
    t0 = time.monotonic()
    sender = WalsenderCpu(dsn, slot)
    subprocess.run(
        [str(pg_bin() / "pg_recvlogical"), "-d", dsn, "--slot", slot, "--start", "--endpos", end_lsn,
         "-o", "proto_version=1", "-o", "publication_names=cdc", "-o", "messages=true", "-f", "/dev/null",
         "--no-loop"],
        check=True,
    )
    wall_s = time.monotonic() - t0
    return {"rate": total / wall_s, "wall": wall_s, "walsender_cpu_per_change": sender.stop() / total * 1e6}


def write_config(root: Path, name: str, pg_dsn: str, redis_url: str, slot: str, append: str, streaming: str,
                 boundaries: str = "off", extra: str = "") -> Path:
    config = root / name
    config.write_text(f"postgres: {{dsn: '{pg_dsn}', slot: {slot}, publication: cdc, "
                      f"streaming: {'true' if streaming == 'on' else 'false'}}}\n"
                      f"redis: {{url: '{redis_url}', append: {append}}}\nmappings: mappings/\nhttp: {{port: 0}}\n"
                      + (f"transactions: {{stream: '{TX_STREAM}'}}\n" if boundaries == "on" else "") + extra)
    return config


@dataclass
class WorkloadResult:
    name: str
    total: int
    shape: str
    recv: dict = field(default_factory=dict)
    bridge: dict = field(default_factory=dict)  # (path, mode, streaming, boundaries) -> the best drain


def best(kept: dict | None, new: dict, least: tuple[str, ...]) -> dict:
    """Of two drains, the faster one, with the least of each of the CPU figures `least` of either."""
    if not kept:
        return new
    faster = new if new["rate"] > kept["rate"] else kept
    return faster | {k: min(kept[k], new[k]) for k in least}


def run_workload(name: str, args, root: Path, pg, rd, client: redis.Redis) -> WorkloadResult:
    rounds = 1 if name == "rss" else args.rounds
    variants = [(path, mode, streaming, tx) for path in args.paths for mode in args.modes for streaming in args.streaming
                for tx in args.boundaries]
    slots = {(i, v): f"b_{name}_{v[0]}_{v[1]}_{v[2]}_{v[3]}_{i}" for i in range(rounds) for v in variants}
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        for i in range(rounds):
            conn.execute(f"SELECT pg_create_logical_replication_slot('recv_{name}_{i}', 'pgoutput')")
        for slot in slots.values():
            conn.execute(f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')")
        size = args.rss_changes if name == "rss" else args.changes
        print(f"[{name}] committing {size:,} changes ...", flush=True)
        t0 = time.monotonic()
        if name == "small":
            total, shape = workload_small(conn, size, args.seed)
        elif name == "large":
            total, shape = workload_large(conn, size)
        else:
            total, shape = workload_rss(conn, size)
        end_lsn = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]
        # a message past the end, so that pg_recvlogical sees it has reached --endpos at once instead of
        # waiting for a keepalive (which can take seconds); the bridge reads it too, and skips it
        conn.execute("SELECT pg_logical_emit_message(false, 'bench-end', '')")
        print(f"[{name}]   committed {total:,} changes in {time.monotonic() - t0:.1f}s: {shape} (end {end_lsn})", flush=True)
        conn.execute("CHECKPOINT")

    result = WorkloadResult(name, total, shape)
    for i in range(rounds):
        # the readers alternate within each round, so that they share the machine's noise
        r = drain_recvlogical(pg.dsn, f"recv_{name}_{i}", end_lsn, total)
        print(f"[{name}]   round {i + 1}: pg_recvlogical {r['rate']:,.0f} changes/s ({r['wall']:.1f}s, "
              f"walsender CPU {r['walsender_cpu_per_change']:.2f} µs/change)", flush=True)
        result.recv = best(result.recv, r, ("walsender_cpu_per_change",))
        for v in variants:
            path, mode, streaming, tx = v
            config = write_config(root, f"cdc-{slots[i, v]}.yaml", pg.dsn, rd.url, slots[i, v], mode, streaming, tx)
            b = drain_bridge(config, client, total, STREAMS[name], mode, path, streaming, tx, (pg.dsn, slots[i, v]))
            ends = f", {b['ends']:,} END records" if tx == "on" else ""
            print(f"[{name}]   round {i + 1}: bridge {path}/{mode}/streaming {streaming}/tx ends {tx} {b['rate']:,.0f} "
                  f"changes/s ({b['wall']:.1f}s, bridge CPU {b['bridge_cpu_per_change']:.2f} µs/change, "
                  f"walsender CPU {b['walsender_cpu_per_change']:.2f} µs/change, "
                  f"peak RSS {b['rss'] / 2**20:.0f} MiB{ends})", flush=True)
            result.bridge[v] = best(result.bridge.get(v), b, ("bridge_cpu_per_change", "walsender_cpu_per_change"))
    client.flushall()
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        # free the WAL and spill files the slots held
        for slot in [f"recv_{name}_{i}" for i in range(rounds)] + list(slots.values()):
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        conn.execute("VACUUM ANALYZE")
        conn.execute("CHECKPOINT")
    return result


def steady_latency(dsn: str, client: redis.Redis, rate: int, seconds: float, first_id: int, tx_rows: int,
                   writers: int) -> tuple[list[int], float]:
    """`writers` connections commit `rate` changes/s in all for `seconds` (multi-row INSERTs of `tx_rows`
    rows, one per transaction); return per-entry latency in ms and the rate actually achieved."""
    n_tx = max(1, int(seconds * rate / tx_rows / writers))  # per writer
    interval = tx_rows * writers / rate
    last = client.xrevrange("cdc:ride", count=1)
    after = last[0][0].decode() if last else "0-0"
    before = client.xlen("cdc:ride")
    spans: list[tuple[float, float]] = []

    def writer(w: int) -> None:
        next_id = first_id + w * 10**9
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SET synchronous_commit = on")  # commits reach the walsender at once
            start = time.monotonic()
            for i in range(n_tx):
                values = ",".join(f"({k},1,1.5)" for k in range(next_id, next_id + tx_rows))
                conn.execute(f"INSERT INTO rides (id, rider_id, distance_m) VALUES {values}")
                next_id += tx_rows
                delay = start + (i + 1) * interval - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # pacing the writer to the target rate
            spans.append((start, time.monotonic()))

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = n_tx * tx_rows * writers
    achieved = expected / (max(e for _, e in spans) - min(s for s, _ in spans))
    wait_for(lambda: client.xlen("cdc:ride") >= before + expected, 120, "the latency run to arrive")
    ms, seq = after.split("-")
    start_id = f"{ms}-{int(seq) + 1}"
    latencies = []
    while True:
        page = client.xrange("cdc:ride", min=start_id, count=10_000)
        for entry_id, fields in page:
            latencies.append(id_ms(entry_id) - int(fields[b"ts_ms"]))
        if len(page) < 10_000:
            break
        ms, seq = page[-1][0].decode().split("-")
        start_id = f"{ms}-{int(seq) + 1}"
    if os.environ.get("BENCH_LATENCY_DUMP"):
        Path(f"{os.environ['BENCH_LATENCY_DUMP']}.{rate}").write_text("\n".join(map(str, latencies)))
    return latencies, achieved


def latency_runs(args, root: Path, pg, rd, client: redis.Redis) -> list[tuple[int | None, int, float, list[int]]]:
    """(batch.max_delay_ms or None for the default, target rate, achieved rate, sorted latencies) per run."""
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot('latency', 'pgoutput')")
    client.flushall()
    out = []
    first_id = 10**12
    for delay in args.latency_delays or [None]:
        extra = f"batch: {{max_delay_ms: {delay}}}\n" if delay is not None else ""
        config = write_config(root, "cdc-latency.yaml", pg.dsn, rd.url, "latency", "transaction", "off", extra=extra)
        register(config)
        proc, _ = run_bridge(config, [], "compiled")
        try:
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                now_lsn = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
                wait_for(lambda: conn.execute("SELECT active AND confirmed_flush_lsn >= %s FROM pg_replication_slots "
                                              "WHERE slot_name = 'latency'", (now_lsn,)).fetchone()[0],
                         120, "the bridge to attach and catch up")
            # past its first seconds (a bridge just started delayed the first few transactions by 40-200 ms in
            # runs that began at once): the figures are those of a bridge that has been running
            time.sleep(2)
            for rate in args.latency_rates:
                shown = "default" if delay is None else f"{delay} ms"
                print(f"[latency] max_delay_ms {shown}: {rate:,} changes/s for {args.latency_seconds:.0f}s ...", flush=True)
                latencies, achieved = steady_latency(pg.dsn, client, rate, args.latency_seconds, first_id,
                                                     args.latency_tx_rows, args.latency_writers)
                first_id += 10**11
                out.append((delay, rate, achieved, sorted(latencies)))
                time.sleep(1)
        finally:
            proc.terminate()
            proc.wait(30)
    return out


def csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=1_000_000, help="changes of the small and large workloads")
    parser.add_argument("--rss-changes", type=int, default=2_000_000, help="changes in the rss workload's one transaction")
    parser.add_argument("--workloads", type=csv(str), default=list(WORKLOADS), help="of small,large,rss")
    parser.add_argument("--paths", type=csv(str), default=["compiled", "pure"],
                        help="the bridge's implementation: compiled (default), pure (CDC_PURE_PYTHON=1)")
    parser.add_argument("--modes", type=csv(str), default=["script", "transaction"], help="redis.append modes")
    parser.add_argument("--streaming", type=csv(str), default=["off"], help="postgres.streaming: on, off (default: off)")
    parser.add_argument("--boundaries", type=csv(str), default=["off"],
                        help="transaction END records (transactions.stream): on, off (default: off)")
    parser.add_argument("--rounds", type=int, default=2, help="drains of each reader, alternating; the best is shown")
    parser.add_argument("--seed", type=float, default=0.42, help="setseed() of the small transactions' sizes")
    parser.add_argument("--latency-rates", type=csv(int), default=[10_000, 50_000], help="changes/s; empty: no latency run")
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--latency-delays", type=csv(int), default=[],
                        help="batch.max_delay_ms values of the latency runs (default: the bridge's default only)")
    parser.add_argument("--latency-tx-rows", type=int, default=100, help="rows per multi-row INSERT (one transaction)")
    parser.add_argument("--latency-writers", type=int, default=2, help="writer connections")
    args = parser.parse_args()
    for w in args.workloads:
        if w not in WORKLOADS:
            parser.error(f"unknown workload {w!r}")
    for p in args.paths:
        if p not in ("compiled", "pure"):
            parser.error(f"unknown path {p!r}")
    for m in args.modes:
        if m not in APPEND_COMMAND:
            parser.error(f"unknown append mode {m!r}")
    for m in args.streaming:
        if m not in ("on", "off"):
            parser.error(f"--streaming takes on and off, not {m!r}")
    for m in args.boundaries:
        if m not in ("on", "off"):
            parser.error(f"--boundaries takes on and off, not {m!r}")

    started = time.monotonic()
    settings = {"synchronous_commit": "off", "max_wal_size": "8GB", "max_replication_slots": "40", "max_wal_senders": "40"}
    with bench_servers("cdc-bench-", settings) as (root, pg, rd):
        client = redis.Redis.from_url(rd.url)
        prepare(root, pg.dsn, MAPPINGS, SCHEMA)
        results = [run_workload(name, args, root, pg, rd, client) for name in args.workloads]
        latencies = latency_runs(args, root, pg, rd, client) if args.latency_rates else []

    print()
    print("rates: changes / whole-process wall time (start to exit), each reader from its own slot on the same WAL;")
    print("ratio: to pg_recvlogical (pgoutput proto 1, to /dev/null) in the same run; best of the rounds")
    print()
    header = (f"{'workload':<8} {'reader':<44} {'changes':>10} {'changes/s':>10} {'wall s':>7} {'ratio':>6} "
              f"{'redis CPU µs/entry':>18} {'append cmd µs/entry':>19} {'bridge CPU µs/change':>20} "
              f"{'walsender CPU µs/change':>23} {'peak RSS MiB':>12}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.name:<8} {'pg_recvlogical':<44} {r.total:>10,} {r.recv['rate']:>10,.0f} {r.recv['wall']:>7.1f} "
              f"{1:>6.2f} {'':>18} {'':>19} {'':>20} {r.recv['walsender_cpu_per_change']:>23.2f} {'':>12}")
        for (path, mode, streaming, tx), b in r.bridge.items():
            cmd = f"{APPEND_COMMAND[mode][8:].upper()} {b['command_per_entry']:.2f}"
            reader = f"bridge {path}/{mode}/streaming {streaming}/tx ends {tx}"
            print(f"{'':<8} {reader:<44} {r.total:>10,} {b['rate']:>10,.0f} {b['wall']:>7.1f} "
                  f"{b['rate'] / r.recv['rate']:>6.2f} {b['cpu_per_entry']:>18.2f} {cmd:>19} "
                  f"{b['bridge_cpu_per_change']:>20.2f} {b['walsender_cpu_per_change']:>23.2f} {b['rss'] / 2**20:>12.1f}")
    for r in results:
        print(f"{r.name}: {r.shape}")
    if latencies:
        print()
        print(f"commit-to-stream latency (bridge compiled/transaction; {args.latency_writers} writer(s), "
              f"multi-row INSERTs of {args.latency_tx_rows} rows per transaction):")
        for delay, rate, achieved, lat in latencies:
            if not lat:
                continue
            p50 = lat[len(lat) // 2]
            p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
            shown = "default" if delay is None else f"{delay} ms"
            print(f"  max_delay_ms {shown:>7}, target {rate:>7,} changes/s, achieved {achieved:>9,.0f}: p50 {p50} ms, "
                  f"p99 {p99} ms, max {lat[-1]} ms ({len(lat):,} entries)")
    print(f"\nwhole benchmark: {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
