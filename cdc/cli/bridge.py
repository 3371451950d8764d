"""The bridge's subcommands: `cdc run` and `cdc backfill`."""

from __future__ import annotations

import argparse
import logging
import signal
import time

from .common import entity_named, load_config
from ..errors import CdcError, SlotTaken, UsageError

__all__ = ["cmd_run", "cmd_backfill"]


def cmd_run(args: argparse.Namespace) -> int:
    from ..bridge.loop import Bridge
    from ..bridge.slot_holder import wait_for_slot

    settings, mappings = load_config(args)
    bridge = Bridge(settings, mappings, until_caught_up=args.until_caught_up)
    log = logging.getLogger("cdc.bridge.loop")

    def on_signal(signum, frame):  # noqa: ARG001
        log.info("received %s, finishing the batch", signal.Signals(signum).name)
        bridge.stop()

    def on_hangup(signum, frame):  # noqa: ARG001
        # configuration and mappings are read once, at start: a reload is a restart, so stop cleanly and say so
        log.warning("received SIGHUP: the bridge reads its configuration and mappings only at start; finishing the "
                    "batch and stopping (exit 0): start cdc run again to apply changes")
        bridge.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    started = time.monotonic()
    while True:
        # before the metrics port is bound: a second bridge on the slot says so, or waits as the standby
        wait_for_slot(settings.postgres.slot_server, settings.postgres.slot, standby=args.standby,
                      stopping=lambda: bridge.stopping)
        if bridge.stopping:
            return 0
        log.info("bridge starting slot=%s entities=%s", settings.postgres.slot, ",".join(m.entity for m in mappings))
        try:
            bridge.run()
        except SlotTaken as exc:
            if not args.standby:
                raise
            log.info("standby: %s; waiting for the slot again", exc.message)
            continue
        break
    log.info(
        "bridge stopped entries_published=%d transactions=%d durable_lsn=%s seconds=%.1f",
        bridge.counters.entries_published, bridge.counters.transactions, bridge.durable_lsn, time.monotonic() - started,
    )
    return 0


def cmd_backfill(args: argparse.Namespace) -> int:
    from ..ops.admin import connect
    from ..bridge.backfill import enqueue, ensure_table

    settings, mappings = load_config(args)
    with connect(settings) as conn:
        ensure_table(conn)
        if args.entity is not None:
            mapping = entity_named(mappings, args.entity)
            backfill_id = enqueue(conn, settings.postgres.slot, mapping, args.where)
            print(f"backfill {backfill_id} of {mapping.entity} queued; the running bridge (cdc run) publishes it as op r")
            ids = [backfill_id]
        elif args.watch:
            ids = [r[0] for r in conn.execute(
                "SELECT id FROM cdc_backfills WHERE slot = %s AND status IN ('pending', 'running') ORDER BY id",
                (settings.postgres.slot,),
            )]
            if not ids:
                print("no snapshot or backfill in progress")
        else:
            raise UsageError("give --entity to queue a backfill, or --watch to follow the ones in progress")
        if args.wait or args.watch:
            failed = [f for f in (_follow(conn, backfill_id) for backfill_id in ids) if f is not None]
            if failed:
                raise failed[0]
    return 0


def _follow(conn, backfill_id: int) -> CdcError | None:
    """Show one backfill's progress until every chunk is read; its failure, if it failed."""
    from .progress import ProgressDisplay
    from ..bridge.backfill import has_error_column

    entity = conn.execute("SELECT entity FROM cdc_backfills WHERE id = %s", (backfill_id,)).fetchone()[0]
    error_sql = "error" if has_error_column(conn) else "NULL"
    with ProgressDisplay(f"backfill {backfill_id} of {entity}") as display:
        while True:
            status, done, total, error = conn.execute(
                f"SELECT status, rows_done, rows_total, {error_sql} FROM cdc_backfills WHERE id = %s", (backfill_id,)
            ).fetchone()
            display.update(done, total or 0)
            if status in ("done", "cancelled", "failed", "superseded"):
                break
            time.sleep(0.2)  # polling the progress row: the work happens in the bridge
    print(f"backfill {backfill_id}: {status}, {done} row(s) read" + (f" ({error})" if status == "superseded" else ""))
    if status == "failed":
        return CdcError(f"backfill {backfill_id} of {entity} failed after {done} row(s): {error or 'see the bridge log'}",
                        hint="fix the cause, then run cdc backfill again (streaming went on: no change was lost)")
    return None
