"""The bridge's per-change work without I/O: pgoutput bytes in, packed XADD commands out.

Replays XLogData messages built in memory (the shapes of bench/throughput.py's workloads) through
the loop's inner part (`burst`, compiled or its pure twin, as `cdc.speedups` picks) into batches
that pack their entries as they are queued where the compiled packer is built (`StreamBatch.packed`,
as the bridge's transaction lane has them), and takes each batch of 1,000 entries as the lane does
(`Packed.past`, `pack_past` for entries still in lists). Meant for instruction counts, repeatable on
a busy machine:

    valgrind --tool=callgrind --collect-atstart=no \\
        --toggle-collect=__pyx_pw_3cdc_6bridge_8_changes_5burst \\
        --toggle-collect=__pyx_pw_3cdc_4sink_5_resp_6Packed_7past \\
        --toggle-collect=__pyx_pw_3cdc_4sink_5_resp_3pack_past \\
        python bench/per_change.py --workload large --changes 10000

(divide the instructions by the changes). Without valgrind it prints CPU µs per change.

Usage: python bench/per_change.py [--workload small|large] [--changes 20000] [--repeat 1]
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from cdc.bridge import changes  # noqa: E402
from cdc.bridge.backfill import Windows  # noqa: E402
from cdc.bridge.batcher import Batcher  # noqa: E402
from cdc.bridge.positions import Transaction  # noqa: E402
from cdc.mapping.model import parse_mapping  # noqa: E402
from cdc.sink.lane import pack_entries as pack_past, packer  # noqa: E402
from cdc.source import pgoutput as po  # noqa: E402
from cdc.source.values import TypeCatalog  # noqa: E402
from cdc.yamlsrc import load_yaml_documents  # noqa: E402
from pgoutput_encoder import encode  # noqa: E402

INT8, INT4, FLOAT8, NUMERIC, TEXT, TIMESTAMPTZ = 20, 23, 701, 1700, 25, 1184
HEADER = b"w" + bytes(24)


def relation(relid: int, name: str, columns: list[tuple[str, int, bool]]) -> po.Relation:
    return po.Relation(relid, "public", name, "d", tuple(po.Column(k, n, t, -1) for n, t, k in columns))


RELATIONS = {
    "items": relation(1, "items", [("id", INT8, True), ("qty", INT4, False), ("price", FLOAT8, False),
                                   ("name", TEXT, False), ("at", TIMESTAMPTZ, False), ("secret", TEXT, False)]),
    "riders": relation(2, "riders", [("id", INT8, True), ("name", TEXT, False), ("email", TEXT, False)]),
    "rides": relation(3, "rides", [("id", INT8, True), ("rider_id", INT8, False), ("distance_m", NUMERIC, False),
                                   ("status", TEXT, False), ("internal_note", TEXT, False)]),
}
MAPPINGS = {
    "items": "entity: item\ntable: public.items\nkey: [id]\nfields: {id: id, qty: qty, price: price, name: name, at: at}\n",
    "riders": "entity: rider\ntable: public.riders\nkey: [id]\nfields: {id: id, name: name, email: email}\n",
    "rides": "entity: ride\ntable: public.rides\nkey: [id]\nfields: {id: id, distance: distance_m, rider: rider_id, status: status}\n",
}


def item(g: int) -> tuple:
    return (str(g), str(g % 1000), repr(g * 0.25).removesuffix(".0"), f"item {g}",
            f"2026-01-01 {g // 3600 % 24:02d}:{g // 60 % 60:02d}:{g % 60:02d}+00", f"secret {g}")


def ride(g: int) -> tuple:
    return (str(g), str(g // 3 + 1), f"{g * 1.7:.3f}", "done", None)


def messages(workload: str, total: int) -> list[bytes]:
    """XLogData messages: Begin, changes, Commit, in transactions of 1-20 (small) or 1,000 (large) changes."""
    rnd = random.Random(7)
    out, lsn, n = [], 0x1000000, 0
    while n < total:
        size = min(rnd.randint(1, 20) if workload == "small" else 1000, total - n)
        lsn += 0x100
        out.append(HEADER + encode(po.Begin(lsn + 0x80, 0, 1000 + n)))
        for _ in range(size):
            n += 1
            if workload == "large":
                out.append(HEADER + encode(po.Insert(1, item(n))))
                continue
            r = rnd.random()
            if r < 0.2:
                out.append(HEADER + encode(po.Insert(2, (str(n), f"rider {n}", f"rider{n}@example.com"))))
            elif r < 0.6:
                out.append(HEADER + encode(po.Insert(3, ride(n))))
            elif r < 0.85:
                out.append(HEADER + encode(po.Update(3, None, None, ride(n))))
            else:
                out.append(HEADER + encode(po.Delete(3, "K", (str(n), None, None, None, None))))
        out.append(HEADER + encode(po.Commit(0, lsn, lsn + 0x80, 0)))
    return out


class Stream:
    """What `burst` reads: `get_copy_data` over the messages, then (0, ...) once: a C-level callable, like
    libpq's, so the harness adds no Python call per message."""

    def __init__(self, msgs: list[bytes]) -> None:
        items = [(len(raw), memoryview(raw)) for raw in msgs] + [(0, memoryview(b""))]
        self.get_copy_data = functools.partial(next, iter(items))


class Streams:  # nothing held: the decoder is in no streamed block
    pass


def setup():
    batcher = Batcher(max_entries=1000, max_delay_s=1e9, packer=packer)
    decoder = po.PgOutputDecoder()
    targets = {}
    for name, rel in RELATIONS.items():
        mapping = parse_mapping(load_yaml_documents(MAPPINGS[name], name)[0])
        rel = decoder.decode(encode(rel))
        targets[rel.relid] = changes.bind(rel, [mapping], TypeCatalog(), batcher, {mapping.entity: [0]})
    return batcher, decoder, targets


def replay(msgs: list[bytes], stream: Stream, batcher, decoder, targets) -> int:
    """Every message routed, every full batch packed; the bytes packed."""
    tx, windows, packed = Transaction(), Windows(), 0
    burst = changes.burst_changes

    def flush() -> int:
        size = 0
        for b in batcher.batches.values():
            if b.packed is not None and b.packed.count:
                size += len(b.packed.past("")[0])
            if b.entries:
                size += len(pack_past(b.stream.encode(), b.entries, "")[0])
        batcher.clear()
        return size

    while True:
        count, raw = burst(stream, targets, tx, batcher, windows, decoder, lambda end: None, Streams)
        if raw is None and not count:
            break
        if raw is not None:
            raise SystemExit(f"unexpected message {raw[25:26]!r}")
        packed += flush()
    return packed + flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("small", "large"), default="large")
    parser.add_argument("--changes", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    msgs = messages(args.workload, args.changes)
    best = None
    for _ in range(args.repeat):
        batcher, decoder, targets = setup()
        stream = Stream(msgs)
        t0 = time.process_time()
        size = replay(msgs, stream, batcher, decoder, targets)
        spent = time.process_time() - t0
        best = spent if best is None else min(best, spent)
    path = "compiled" if changes.burst_changes is not changes.burst else "pure"
    print(f"{args.workload} ({path}): {args.changes:,} changes, {size:,} bytes packed, "
          f"best {best / args.changes * 1e6:.2f} µs CPU per change")


if __name__ == "__main__":
    main()
