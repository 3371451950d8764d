"""What pgoutput's ``binary 'true'`` saves PostgreSQL's walsender, per column type.

For each type, a table of four columns of that type (and one `mixed` table of every type) gets
--rows inserted rows; each is drained --rounds times in text and in binary, alternating, each drain
from its own slot created before the rows were committed, by a psycopg replication reader that
only counts Insert messages. The walsender's CPU (utime+stime from /proc/<pid>/stat, the pid being
the replication connection's backend) is read before START_REPLICATION and after the last Insert.
Printed per table: the best and median CPU per change in text and in binary, and the difference.

Usage: python bench/binary_walsender.py [--rows 200000] [--rounds 3] [--types int8,numeric]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import psycopg

from servers import bench_servers, cpu_seconds  # noqa: E402
from cdc.demo.local import wait_for  # noqa: E402

COLUMN_VALUES = {
    "int8": "g::int8 * 7919",
    "int4": "(g %% 2000000000)::int4",
    "float8": "g * 1.37",
    "numeric": "(g * 13.701)::numeric(14,3)",
    "timestamptz": "'2026-01-01 00:00:00+00'::timestamptz + g * interval '1.25 second'",
    "timestamp": "'2026-01-01 00:00:00'::timestamp + g * interval '1.25 second'",
    "bool": "g %% 3 = 0",
    "uuid": "md5(g::text)::uuid",
    "text": "'name-' || g",
}
def table_sql(name: str, types: list[str]) -> tuple[str, str]:
    """(CREATE TABLE, INSERT of generate_series(1, %s)) for a table of `types`."""
    columns = ", ".join(f"c{i} {t}" for i, t in enumerate(types))
    values = ", ".join(COLUMN_VALUES[t] for t in types)
    return (f"CREATE TABLE {name} ({columns}); CREATE PUBLICATION p_{name} FOR TABLE {name}",
            f"INSERT INTO {name} SELECT {values} FROM generate_series(1, %s) g")


def drain(pg, slot: str, publication: str, binary: bool, rows: int) -> float:
    """The walsender's CPU seconds to send `rows` Inserts from `slot`."""
    conn = psycopg.connect(pg.dsn, replication="database", autocommit=True)
    try:
        pid = conn.pgconn.backend_pid
        before = cpu_seconds(pid)
        options = f"proto_version '1', publication_names '{publication}'" + (", binary 'true'" if binary else "")
        conn.execute(f"START_REPLICATION SLOT {slot} LOGICAL 0/0 ({options})")
        pgconn = conn.pgconn
        seen = 0
        while seen < rows:
            n, data = pgconn.get_copy_data(0)
            if n > 0:
                if data[0] == 0x77 and data[25] == 0x49:  # XLogData carrying an Insert
                    seen += 1
            elif n < 0:
                raise RuntimeError("the server ended the stream early")
        after = cpu_seconds(pid)
        return after - before
    finally:
        conn.pgconn.finish()


def measure(pg, name: str, types: list[str], rows: int, rounds: int) -> dict[str, list[float]]:
    create, insert = table_sql(name, types)
    slots = {(mode, r): f"s_{name}_{mode}_{r}" for mode in ("text", "binary") for r in range(rounds)}
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute(create)
        for slot in slots.values():
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute(insert, (rows,))
    result: dict[str, list[float]] = {"text": [], "binary": []}
    for r in range(rounds):
        order = ("text", "binary") if r % 2 == 0 else ("binary", "text")
        for mode in order:
            seconds = drain(pg, slots[(mode, r)], f"p_{name}", mode == "binary", rows)
            result[mode].append(seconds / rows * 1e6)
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        for slot in slots.values():  # its walsender may still be exiting
            wait_for(lambda: conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,)), 30, f"slot {slot} dropped")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--types", default=",".join([*COLUMN_VALUES, "mixed"]))
    args = parser.parse_args()
    tables = {t: ([list(COLUMN_VALUES)] if t == "mixed" else [[t] * 4]) for t in args.types.split(",")}
    print(f"walsender CPU per change (µs), {args.rows} rows, {args.rounds} rounds; best / median")
    print(f"{'table':<22}{'text':>16}{'binary':>16}{'saved (best)':>14}")
    with bench_servers("cdc-binary-") as (_root, pg, _rd):
        for t, (types,) in tables.items():
            res = measure(pg, f"t_{t}", types, args.rows, args.rounds)
            label = t if t == "mixed" else f"4 x {t}"
            text, binary = res["text"], res["binary"]
            print(f"{label:<22}{min(text):>8.2f} /{statistics.median(text):>5.2f}"
                  f"{min(binary):>8.2f} /{statistics.median(binary):>5.2f}{min(text) - min(binary):>+12.2f}",
                  flush=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"({time.time() - t0:.0f} s)", file=sys.stderr)
