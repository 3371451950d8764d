"""A backfill chunk at its high watermark: its rows the stream did not change meanwhile, as op ``r`` entries.

Pure: the chunk's JSON, its projector and the window's changed keys in, entries
queued and counts out (see `cdc.bridge.backfill` for the watermark protocol).
"""

from __future__ import annotations

from ..mapping.projector import CastRefused, Projector
from .backfill import TRUNCATED
from .batcher import Batcher
from .introductions import Introduction
from .positions import Transaction

__all__ = ["queue_chunk"]


def queue_chunk(info: dict, projector: Projector, changed: set, batcher: Batcher, tx: Transaction,
                intro: Introduction | None = None) -> tuple[int, int]:
    """Queue the chunk's rows not in `changed` (none if the table was truncated), nor, during a resync
    (`intro`), already brought by the stream since its marker; (queued, skipped).

    Each queued row takes the transaction's next seq.
    """
    names = info["columns"]
    index = {n: i for i, n in enumerate(names)}
    order = [index.get(c.name) for c in projector.shape.columns]
    batches = [batcher.batch(s) for s in projector.mapping.stream_keys()]
    version = projector.mapping.version
    stale = TRUNCATED in changed
    queued = skipped = 0
    for row in info["rows"]:
        values = [None if i is None else row[i] for i in order]
        if stale or projector.key_values(values) in changed:
            skipped += 1
            continue
        try:
            out = projector.snapshot(values)
        except CastRefused as exc:
            raise projector.placed(exc, values, tx.lsn, tx.seq) from None
        if out is not None:
            if intro is not None and not intro.chunk_row(out.fields[3]):
                skipped += 1  # its seq taken all the same: the rows after keep their places whatever the
                tx.seq += 1  # stream brought (what a restart reads back from it may hold more)
                continue
            batcher.add(batches[out.partition], out.fields, version, tx)
            queued += 1
        tx.seq += 1
    return queued, skipped
