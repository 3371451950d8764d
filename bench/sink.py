"""Consumers side by side: the table sink against a hand-written COPY mirror, and the consume loop's own CPU.

Fills one ride stream with N entries (default 300,000) as the bridge writes them: inserts, updates,
updates that change the key (the old key must become a tombstone) and deletes, with full before-images,
in source transactions of 10. Then, in alternating rounds, each contestant drains the stream with a new
consumer group, in a process of its own:

- ``copy``: a hand-written mirror: XREADGROUP COUNT <batch>, the last position per key (old keys of key
  changes as tombstones) COPY'd into a temporary table, one INSERT ... ON CONFLICT ... DO UPDATE ...
  WHERE (lsn, seq) < EXCLUDED, XACK; as idempotent as the table sink on this workload;
- ``sink``: `Consumer` + `TableSink`;
- ``trivial``: `Consumer` with a handler that does nothing: the consume loop's own CPU;
- ``totals``: `Consumer` + `TransactionalHandler` with the rocket-rides totals (cdc.demo.rocketrides).

Every mirror is checked against the workload's final table (live rows and tombstones) after its run.
With ``--baseline REV`` the consumer contestants also run on the package as it was at git revision REV,
in the same rounds, so that before and after come from one run on the same machine.
With ``--transactions`` transaction mode runs too: the same number of changes over 3 streams plus the
transactions stream, in source transactions of 1, 10 and 1,000 changes, each against plain mode on the
same entries (trivial handler); with ``--baseline REV`` both on REV's package too, in the same rounds; and
transaction mode again with END records each covering up to ``--per-end`` of a batch's transactions (format 2,
the bridge's ``transactions.max_per_end``), on this tree.
``--tx-only`` runs that part alone (``--tx-sizes`` picks the transaction sizes).

Usage: python bench/sink.py [--entries 300000] [--batch 1000] [--rounds 3] [--baseline REV]
       [--transactions [--tx-entries 100000] [--tx-sizes 1,10,1000] [--tx-only] [--per-end 100]] [--cli-gc]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = Path(os.environ.get("BENCH_TREE", ROOT))  # the package under test (a worker of --baseline: the old one)
sys.path.insert(0, str(TREE))

import orjson  # noqa: E402
import psycopg  # noqa: E402
import redis  # noqa: E402

STREAM = "cdc:ride"
TX_STREAMS = ["cdc:ride:0", "cdc:ride:1", "cdc:ride:2"]
TX_END = "cdc:transactions"
TX_END_SHARED = "cdc:transactions:shared"  # the same transactions, END records shared as with transactions.max_per_end
_SCHEMA = ("CREATE TABLE {t} (key jsonb PRIMARY KEY, data jsonb, lsn numeric(20) NOT NULL, seq bigint NOT NULL, "
           "deleted boolean NOT NULL DEFAULT false)")


# -- the workload -----------------------------------------------------------------------------------------

def workload(n: int, seed: int = 7, per_tx: int = 10):
    """(entries as (fields, partition), the final table: key text -> data or None for a tombstone).
    45% inserts, 35% updates keeping the key, 8% updates changing it, 12% deletes."""
    rng = random.Random(seed)
    rows: dict[int, dict] = {}
    final: dict[str, dict | None] = {}
    ids: list[int] = []  # live ids (with holes: removed lazily)
    next_id = 1
    out = []

    def key_text(i: int) -> str:
        return '{"id":%d}' % i

    for i in range(n):
        lsn, seq, xid = 10_000 + i // per_tx, i % per_tx, 1 + i // per_tx
        roll = rng.random()
        while ids and ids[-1] not in rows:
            ids.pop()
        if not rows or roll < 0.45:
            row = {"id": next_id, "distance": "%d.%03d" % (rng.randrange(5000), rng.randrange(1000)), "rider": rng.randrange(1, 100)}
            next_id += 1
            rows[row["id"]] = row
            ids.append(row["id"])
            op, before = "c", None
        else:
            old_id = rng.choice(ids)
            while old_id not in rows:
                old_id = rng.choice(ids)
            before = rows[old_id]
            if roll < 0.88:
                row = dict(before, distance="%d.%03d" % (rng.randrange(5000), rng.randrange(1000)))
                if roll >= 0.80:  # the key changed
                    row["id"] = next_id
                    next_id += 1
                    del rows[old_id]
                    final[key_text(old_id)] = None
                    ids.append(row["id"])
                rows[row["id"]] = row
                op = "u"
            else:
                del rows[old_id]
                row, op = None, "d"
        key = row["id"] if row is not None else before["id"]
        final[key_text(key)] = row
        fields = [b"op", op, b"key", key_text(key)]
        if row is not None:
            fields += [b"data", orjson.dumps(row)]
        if before is not None:
            fields += [b"before", orjson.dumps(before)]
        fields += [b"lsn", str(lsn), b"seq", seq, b"xid", xid, b"ts_ms", b"0", b"v", 1]
        out.append((fields, key % 3, (lsn, seq, xid)))
    return out, final


def fill(url: str, entries, streams: list[str] | None = None, ends: str | None = None, per_end: int = 100) -> None:
    """Publish `entries` to STREAM, or partitioned over `streams` with an END record per source transaction
    in `ends` (transaction mode) and, in TX_END_SHARED, END records each covering up to `per_end` of a batch's
    transactions (format 2, as the bridge writes them with transactions.max_per_end), through the bridge's
    publisher, in batches of 2000 changes (the bridge's default batch.max_entries)."""
    from cdc.sink.publisher import Publisher, StreamBatch, position

    publisher = Publisher(url)
    step = 2000
    try:
        for start in range(0, len(entries), step):
            chunk = entries[start:start + step]
            batches = {s: StreamBatch(s) for s in (streams or [STREAM])}
            end_batch = StreamBatch(ends) if ends else None
            shared_batch = StreamBatch(TX_END_SHARED) if ends else None
            tx: dict[str, int] = {}
            shared: list[list] = []  # the transactions the next shared END covers
            totals: dict[str, int] = {}
            for j, (fields, part, (lsn, seq, xid)) in enumerate(chunk):
                stream = streams[part] if streams else STREAM
                batches[stream].add(position(lsn, seq), fields)
                if end_batch is not None:
                    tx[stream] = tx.get(stream, 0) + 1
                    nxt = chunk[j + 1][2] if j + 1 < len(chunk) else (entries[start + step][2] if start + step < len(entries) else None)
                    if nxt is None or nxt[0] != lsn:
                        end_batch.add(position(lsn, seq + 1), [b"op", "e", b"key", b"{}",
                                                               b"data", orjson.dumps({"count": sum(tx.values()), "streams": tx}),
                                                               b"lsn", str(lsn), b"seq", seq + 1, b"xid", xid,
                                                               b"ts_ms", b"0", b"v", 1])
                        shared.append([xid, lsn, 0, seq + 1])
                        for s_, n_ in tx.items():
                            totals[s_] = totals.get(s_, 0) + n_
                        if len(shared) == per_end:
                            add_shared(shared_batch, shared, totals)
                            shared, totals = [], {}
                        tx = {}
            if shared:  # a batch's last END closes with it
                add_shared(shared_batch, shared, totals)
            publisher.publish(list(batches.values()) + ([end_batch, shared_batch] if end_batch is not None else []))
    finally:
        publisher.close()


def add_shared(batch, shared: list[list], totals: dict[str, int]) -> None:
    """An END record of format 2 covering `shared` ([xid, lsn, ts_ms, its END's seq] each)."""
    from cdc.bridge.txends import GROUPED_VERSION, grouped_data
    from cdc.sink.publisher import position

    xid, lsn, _, seq = shared[-1]
    batch.add(position(lsn, seq), [b"op", "e", b"key", b"{}", b"data", grouped_data([t[:3] for t in shared], totals),
                                   b"lsn", str(lsn), b"seq", seq, b"xid", xid, b"ts_ms", b"0", b"v", GROUPED_VERSION])


# -- the workers (each in a process of its own) -------------------------------------------------------------

def copy_mirror(client: redis.Redis, dsn: str, group: str, table: str, n: int, batch: int) -> None:
    """The hand-written mirror: last position per key, COPY into a temporary table, one upsert, XACK."""
    with psycopg.connect(dsn) as conn:
        conn.execute(_SCHEMA.format(t=table))
        conn.execute("CREATE TEMP TABLE stage (key jsonb, data jsonb, lsn numeric(20), seq bigint, deleted boolean) "
                     "ON COMMIT DELETE ROWS")
        conn.commit()
        upsert = (f"INSERT INTO {table} AS t SELECT * FROM stage ON CONFLICT (key) DO UPDATE SET data = EXCLUDED.data, "
                  "lsn = EXCLUDED.lsn, seq = EXCLUDED.seq, deleted = EXCLUDED.deleted "
                  "WHERE (t.lsn, t.seq) < (EXCLUDED.lsn, EXCLUDED.seq)")
        client.xgroup_create(STREAM, group, id="0")
        done = 0
        while done < n:
            reply = client.xreadgroup(group, "bench", {STREAM: ">"}, count=batch, block=100)
            if not reply:
                continue
            items = reply[0][1]
            last: dict[str, tuple] = {}

            def put(key: str, data, pos: tuple[int, int], deleted: bool) -> None:
                held = last.get(key)
                if held is None or held[1] < pos:
                    last[key] = (data, pos, deleted)

            for _, f in items:
                op, pos = f[b"op"], (int(f[b"lsn"]), int(f[b"seq"]))
                key = orjson.loads(f[b"key"])
                if op == b"u" and b"before" in f:
                    before = orjson.loads(f[b"before"])
                    old = {k: before[k] for k in key}
                    if old != key:
                        put(orjson.dumps(old, option=orjson.OPT_SORT_KEYS).decode(), None, pos, True)
                data = f[b"data"].decode() if op != b"d" else None
                put(orjson.dumps(key, option=orjson.OPT_SORT_KEYS).decode(), data, pos, op == b"d")
            with conn.cursor() as cur:
                with cur.copy("COPY stage FROM STDIN") as copy:
                    for key, (data, (lsn, seq), deleted) in last.items():
                        copy.write_row((key, data, lsn, seq, deleted))
                cur.execute(upsert)
            conn.commit()
            client.xack(STREAM, group, *(i for i, _ in items))
            done += len(items)


def consume(client: redis.Redis, dsn: str, group: str, table: str, n: int, batch: int, kind: str,
            streams: list[str] | None = None, ends: str | None = None) -> None:
    from cdc.consume.consumer import Consumer

    handler = None
    if kind == "sink":
        from cdc.consume.table_sink import TableSink

        handler = TableSink(dsn, table)
    elif kind == "totals":
        from cdc.consume.checkpoint import TransactionalHandler
        from cdc.demo.rocketrides import ride_totals

        handler = TransactionalHandler(dsn, group, ride_totals)
    consumer = Consumer(client, streams or [STREAM], group, "bench", count=batch, block_ms=100, transactions=ends)
    consumer.create_group("0")
    if kind == "totals":
        handler.epoch_of = consumer.epoch
    handle = handler if handler is not None else (lambda entries: None)
    total = n + (client.xlen(ends) if ends else 0)  # transaction mode acknowledges the END records too
    if ends:
        while consumer.acked < total:
            consumer._step_transactions(handle)
    else:  # the consumer's own loop (it reads the next batch while one is handled)
        stop = threading.Event()
        handled = [0]

        def counted(entries) -> None:
            handle(entries)
            handled[0] += len(entries)
            if handled[0] >= n:
                stop.set()

        consumer.run(counted, stop)
    for lease in consumer.leases.values():
        lease.release()
    if handler is not None:
        handler.close()


def worker(args) -> int:
    if args.cli_gc:  # as `cdc consume` (and the bridge) sets the collector, for every contestant alike
        import gc

        gc.freeze()
        gc.set_threshold(20_000, 20, 20)
    client = redis.Redis.from_url(args.redis)
    wall, cpu = time.perf_counter(), time.process_time()
    if args.worker == "copy":
        copy_mirror(client, args.dsn, args.group, args.table, args.entries, args.batch)
    elif args.worker == "tx":
        consume(client, args.dsn, args.group, args.table, args.entries, args.batch, "trivial", TX_STREAMS, TX_END)
    elif args.worker == "txg":
        consume(client, args.dsn, args.group, args.table, args.entries, args.batch, "trivial", TX_STREAMS, TX_END_SHARED)
    elif args.worker == "plain3":
        consume(client, args.dsn, args.group, args.table, args.entries, args.batch, "trivial", TX_STREAMS)
    else:
        consume(client, args.dsn, args.group, args.table, args.entries, args.batch, args.worker)
    print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}))
    return 0


# -- the driver ---------------------------------------------------------------------------------------------

def baseline_tree(rev: str) -> Path:
    """The package as at `rev`, with this tree's compiled extensions."""
    where = Path(tempfile.mkdtemp(prefix="cdc-bench-baseline-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "cdc"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    for so in ROOT.glob("cdc/**/*.so"):
        shutil.copy(so, where / so.relative_to(ROOT))
    return where


def run_worker(kind: str, tree: Path, pg, rd, group: str, table: str, n: int, batch: int, cli_gc: bool = False) -> dict:
    env = dict(os.environ, BENCH_TREE=str(tree), PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, __file__, "--worker", kind, *(["--cli-gc"] if cli_gc else []),
                          "--redis", rd.url, "--dsn", pg.dsn, "--group", group,
                          "--table", table, "--entries", str(n), "--batch", str(batch)],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"worker {kind} ({tree}) failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_mirror(pg, table: str, final: dict) -> None:
    with psycopg.connect(pg.dsn) as conn:
        got = {orjson.dumps(k, option=orjson.OPT_SORT_KEYS).decode(): (None if deleted else d)
               for k, d, deleted in conn.execute(f"SELECT key, data, deleted FROM {table}")}
    if got != final:
        wrong = [k for k in final if got.get(k, "missing") != final[k]] + [k for k in got if k not in final]
        raise SystemExit(f"{table} is not the workload's table: {len(wrong)} keys differ, e.g. {wrong[:3]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=300_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="a git revision to measure the consumers of too, in the same rounds")
    parser.add_argument("--only", default="copy,sink,trivial,totals", help="the contestants, comma-separated")
    parser.add_argument("--transactions", action="store_true", help="also transaction mode against plain mode")
    parser.add_argument("--tx-entries", type=int, default=100_000, help="changes per transaction-mode run")
    parser.add_argument("--tx-sizes", default="1,10,1000", help="the source transactions' sizes (changes), comma-separated")
    parser.add_argument("--tx-only", action="store_true", help="only transaction mode against plain mode (--transactions)")
    parser.add_argument("--per-end", type=int, default=100,
                        help="transaction mode with shared END records too: the most transactions one covers")
    parser.add_argument("--cli-gc", action="store_true",
                        help="every contestant sets Python's collector as cdc consume does (gc.freeze, young threshold 20,000)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    for hidden in ("--redis", "--dsn", "--group", "--table"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from servers import bench_servers

    trees = {"": ROOT}
    if args.baseline:
        trees[f"@{args.baseline}"] = baseline_tree(args.baseline)
    if args.tx_only:
        args.transactions, args.only = True, ""
    kinds = [k for k in args.only.split(",") if k]
    contestants = [(k, "") for k in kinds] + [(k, t) for t in trees if t for k in kinds if k != "copy"]
    results: dict[str, list[dict]] = {}
    entries, final = [], {}
    if contestants:
        print(f"building the workload ({args.entries:,} entries) ...", flush=True)
        entries, final = workload(args.entries)
        ops = {}
        for fields, _, _ in entries:
            op = fields[1] if fields[1] != "u" or orjson.loads(fields[3]) == {"id": orjson.loads(fields[7])["id"]} else "u (key changed)"
            ops[op] = ops.get(op, 0) + 1
        print("  " + ", ".join(f"{op}: {count:,}" for op, count in sorted(ops.items())), flush=True)
    with bench_servers("cdc-bench-sink-", None) as (root, pg, rd):
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute((ROOT / "sql" / "20_consumer_state.sql").read_text())
        if entries:
            fill(rd.url, entries)
        client = redis.Redis.from_url(rd.url)
        for r in range(args.rounds):
            order = contestants if r % 2 == 0 else contestants[::-1]
            for kind, tag in order:
                name = kind + tag
                group = table = f"b{r}_{kind}_{list(trees).index(tag)}"
                with psycopg.connect(pg.dsn, autocommit=True) as conn:
                    conn.execute(f"DROP TABLE IF EXISTS {table}")
                    conn.execute("TRUNCATE consumer_states, cdc_checkpoints")
                    conn.execute("CHECKPOINT")
                got = run_worker(kind, trees[tag], pg, rd, group, table, args.entries, args.batch, args.cli_gc)
                client.xgroup_destroy(STREAM, group)
                if kind in ("copy", "sink"):
                    check_mirror(pg, table, final)
                results.setdefault(name, []).append(got)
                print(f"  round {r + 1} {name:<24} {args.entries / got['wall']:>9,.0f} entries/s  "
                      f"{args.entries / got['cpu']:>9,.0f} per CPU-second of its process", flush=True)
        tx_results = transaction_rounds(args, pg, rd, trees) if args.transactions else {}

    def median(name: str, what: str) -> float:
        return statistics.median(args.entries / x[what] for x in results[name])

    print()
    if results:
        print(f"{args.entries:,} entries, batches of {args.batch}, {args.rounds} rounds; medians (entries/s)")
        print(f"{'consumer':<26} {'wall':>10} {'per process CPU-s':>18}")
    for name in results:
        print(f"{name:<26} {median(name, 'wall'):>10,.0f} {median(name, 'cpu'):>18,.0f}")
    if "copy" in results:
        for name in results:
            if name.startswith("sink"):
                ratios = [c["wall"] / s["wall"] for c, s in zip(results["copy"], results[name])]
                print(f"ratio {name} / copy (wall): {statistics.median(ratios):.2f} "
                      f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
    for tag in trees:
        if tag and "trivial" in results:
            print(f"trivial handler, CPU per entry: {1e6 / median('trivial' + tag, 'cpu'):.2f} us ({tag}) -> "
                  f"{1e6 / median('trivial', 'cpu'):.2f} us (this tree)")
    if tx_results:
        print(f"transaction mode against plain mode, {args.tx_entries:,} changes, {args.rounds} rounds; medians (entries/s)")
    for (size, tag), (tx, plain, ratios) in tx_results.items():
        print(f"transactions of {size:>5}{tag:<10}: transaction mode {tx:>9,.0f} entries/s, plain {plain:>9,.0f}, "
              f"ratio {tx / plain:.2f} (rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
    for tree in trees.values():
        if tree != ROOT:
            shutil.rmtree(tree, ignore_errors=True)
    return 0


def transaction_rounds(args, pg, rd, trees) -> dict[tuple[int, str], tuple[float, float, list[float]]]:
    """Transaction mode against plain mode (trivial handler) on the same entries, per transaction size and tree
    (this one, and --baseline's in the same rounds): (median tx, median plain, the rounds' ratios)."""
    out = {}
    client = redis.Redis.from_url(rd.url)
    for size in (int(x) for x in args.tx_sizes.split(",")):
        client.flushall()  # the streams and their marks (the publisher refuses a stream gone under its mark)
        entries, _ = workload(args.tx_entries, per_tx=size)
        fill(rd.url, entries, TX_STREAMS, TX_END, args.per_end)
        del entries
        runs = [(kind, tag) for tag in trees for kind in ("tx", "plain3")] + [("txg", "")]
        got_by: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
        for r in range(args.rounds):
            for kind, tag in (runs if r % 2 == 0 else runs[::-1]):
                group = f"t{size}_{r}_{kind}_{list(trees).index(tag)}"
                got = run_worker(kind, trees[tag], pg, rd, group, "none", args.tx_entries, args.batch, args.cli_gc)
                for s in TX_STREAMS + {"tx": [TX_END], "txg": [TX_END_SHARED]}.get(kind, []):
                    client.xgroup_destroy(s, group)
                got_by[kind, tag].append(args.tx_entries / got["wall"])
                print(f"  transactions of {size}, round {r + 1} {kind + tag:<16} {args.tx_entries / got['wall']:>9,.0f} entries/s",
                      flush=True)
        for tag in trees:
            tx, plain = got_by["tx", tag], got_by["plain3", tag]
            out[size, tag] = (statistics.median(tx), statistics.median(plain), [t / p for t, p in zip(tx, plain)])
        tx, plain = got_by["txg", ""], got_by["plain3", ""]
        out[size, f" shared ENDs (max_per_end {args.per_end})"] = (
            statistics.median(tx), statistics.median(plain), [t / p for t, p in zip(tx, plain)])
    return out


if __name__ == "__main__":
    sys.exit(main())
