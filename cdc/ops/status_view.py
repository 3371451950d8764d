"""How `cdc status` looks: `cdc.ops.status.collect()`'s data as text, in `rich` tables.

The slot on one line, what the server decoded for it on the next (spilled to its disk,
streamed in progress), then one table per subject (streams, consumer groups,
consumers, backfills, reconciliations), each left out when empty. Colour only
on a terminal; off a terminal the tables are wide enough never to cut a value.
"""

from __future__ import annotations

import io

from rich import box
from rich.console import Console
from rich.table import Table

from ..source.lsn import lsn_text

__all__ = ["render"]

_WIDE = 250  # columns off a terminal: a table is as wide as its content, up to this


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in columns:
        table.add_column(name, justify="right" if name in _NUMERIC else "left", no_wrap=True)
    return table


_NUMERIC = {"length", "trimmed", "force-trimmed", "lag", "pending", "dead letters", "rows done", "rows total", "rows/s",
            "keys compared", "keys drifted"}


def _dash(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def _slot_line(slot: dict | None, alarm: dict | None = None) -> str:
    if slot is None:
        return f"slot: MISSING: {alarm['error']}; {alarm['fix']}" if alarm else "slot: missing (run cdc init)"
    if alarm:  # invalidated: it holds no WAL, so it has no retained size to show
        return (f"slot {slot['name']}: INVALIDATED (wal_status {slot['wal_status']}), "
                f"{'active' if slot['active'] else 'inactive'}: {alarm['error']}; {alarm['fix']}")
    lag_s = "" if slot["lag_seconds"] is None else f" ({slot['lag_seconds']:.2f}s)"
    return (
        f"slot {slot['name']}: {'active' if slot['active'] else 'inactive'}, confirmed {slot['confirmed_flush_lsn']}, "
        f"current {slot['current_wal_lsn']}, lag {slot['lag_bytes']} bytes{lag_s}, "
        f"retained WAL {_dash(slot['retained_wal_bytes'])} bytes of max_slot_wal_keep_size {slot['max_slot_wal_keep_size']}, "
        f"wal_status {slot['wal_status']}"
    )


def _decoding_line(decoding: dict | None) -> str | None:
    """What the server decoded for the slot, and what of it went to its disk or was streamed."""
    if decoding is None:
        return None
    since = f" since {decoding['since']}" if decoding["since"] else ""
    return (
        f"decoded{since}: {decoding['transactions']:,} transactions, {_mib(decoding['bytes'])}; "
        f"spilled to the server's disk: {decoding['spilled_transactions']:,} transactions, {_mib(decoding['spilled_bytes'])}; "
        f"streamed in progress (postgres.streaming {'on' if decoding['streaming'] else 'off'}): "
        f"{decoding['streamed_transactions']:,} transactions, {_mib(decoding['streamed_bytes'])}"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _stream_tables(streams: list[dict]) -> list[Table]:
    table = _table("streams", "entity", "stream", "length", "first entry", "last entry", "last lsn", "trimmed",
                   "force-trimmed")
    groups = _table("consumer groups", "stream", "group", "lag", "pending", "oldest pending idle", "dead letters")
    consumers = _table("consumers", "stream", "group", "consumer", "pending", "idle", "")
    for s in streams:
        table.add_row(s["entity"], s["stream"], str(s["length"]), _dash(s["first_time"]), _dash(s["last_time"]),
                      _dash(lsn_text(s["last_lsn"])), str(s["trimmed"]), str(s["force_trimmed"]))
        for g in s["groups"]:
            idle = None if g["oldest_pending_idle_ms"] is None else f"{g['oldest_pending_idle_ms'] / 1000:.1f}s"
            groups.add_row(s["stream"], g["group"], "?" if g["lag"] is None else str(g["lag"]), str(g["pending"]),
                           _dash(idle), str(g["dead_letters"]))
            for c in g["consumers"]:
                stale = "STALE: has not read for a long time (remove it: XGROUP DELCONSUMER)" if c.get("stale") else ""
                consumers.add_row(s["stream"], g["group"], c["name"], str(c["pending"]), f"{c['idle_ms'] / 1000:.1f}s",
                                  stale)
    return [t for t in (table, groups, consumers) if t.row_count]


def _backfill_table(backfills: list[dict]) -> Table:
    errors = any(b.get("error") for b in backfills)  # why one failed or was superseded: a column only then
    table = _table("backfills", "id", "entity", "where", "status", "rows done", "rows total", "rows/s",
                   *(["error"] if errors else []))
    for b in backfills:
        status = b["status"].upper() if b["status"] == "failed" else b["status"]
        table.add_row(str(b["id"]), b["entity"], _dash(b["where"]), status, str(b["rows_done"]),
                      _dash(b["rows_total"]), f"{b['rows_per_s']:,.0f}" if b["rows_per_s"] else "-",
                      *([_dash(b.get("error"))] if errors else []))
    return table


def _reconciliation_table(runs: list[dict]) -> Table:
    table = _table("last reconciliations", "spec", "consumer", "status", "finished at", "keys compared",
                   "keys drifted", "position", "reason")
    for r in runs:
        status = r["status"] + (" (dry run)" if r["dry_run"] else "")
        table.add_row(r["spec"], r["consumer"], status, _dash(r["finished_at"]), str(r["keys_compared"]),
                      str(r["keys_drifted"]), _dash(r["position"]), _dash(r["reason"]))
    return table


def _bridge_lines(bridge: dict) -> list[str]:
    """What the bridge recorded: a pause for Redis memory, a detected data loss."""
    lines = []
    if bridge.get("paused_for_memory"):
        ratio = (f" at {bridge['memory_ratio']:.0%} of maxmemory with room for the next batch"
                 if bridge.get("memory_ratio") is not None else "")
        lines.append(f"bridge: PAUSED for Redis memory{ratio} since {bridge.get('paused_since') or '?'}: "
                     "nothing is read until Redis has room (raise maxmemory, trim, or let consumers catch up)")
    loss = bridge.get("data_loss")
    if loss:
        lines.append(f"bridge: REDIS DATA LOSS detected at {loss['detected_at'] or '?'}: entries of transactions committed in "
                     f"({loss['from_lsn'] or 'unknown'}, {loss['to_lsn']}] are missing; the bridge stopped (exit 6)")
    return lines


def _others_line(others: list[dict]) -> str | None:
    """The other bridges writing into the same Redis (each with its own `cdc status --config`)."""
    if not others:
        return None
    return "other bridges on this redis: " + "; ".join(
        f"slot {o['slot']} (publication {o['publication']}, {len(o['streams'])} stream(s))" for o in others)


def render(status: dict, *, color: bool = False, width: int | None = None) -> str:
    """The status as text; `color` and `width` for a terminal (default: plain, wide)."""
    out = io.StringIO()
    console = Console(file=out, width=width or _WIDE, force_terminal=color, no_color=not color, highlight=False,
                      emoji=False, markup=False)
    console.print(_slot_line(status["slot"], status.get("slot_alarm")), soft_wrap=True)
    decoding = _decoding_line((status["slot"] or {}).get("decoding"))
    if decoding:
        console.print(decoding, soft_wrap=True)
    failover = (status["slot"] or {}).get("failover")
    if failover:
        console.print(f"failover-ready: {failover['state']}: {failover['reason']}", soft_wrap=True)
    spare = status.get("spare")
    if spare:
        where = f" on the {spare['on']}" if spare["on"] else ""
        behind = f", {spare['behind_bytes']:,} bytes behind Redis" if spare["behind_bytes"] is not None else ""
        console.print(f"spare slot{where}: {'ready' if spare['ready'] else 'not ready'}{behind}: {spare['reason']}",
                      soft_wrap=True)
    for line in _bridge_lines(status.get("bridge") or {}):
        console.print(line, soft_wrap=True)
    for r in status.get("resyncing") or []:
        backfills = f" (backfill {', '.join(map(str, r['backfills']))})" if r["backfills"] else ""
        console.print(f"{r['entity']}: resyncing{backfills}: {r['cause']} after {r['vouched']}, the last position "
                      f"vouched for; {r['fix']}", soft_wrap=True)
    others = _others_line(status.get("other_bridges") or [])
    if others:
        console.print(others, soft_wrap=True)
    for s in status["streams"]:
        if s["force_trimmed"]:
            console.print(f"WARNING: {s['stream']}: {s['force_trimmed']} unconsumed entries dropped by the hard trim cap",
                          soft_wrap=True)
    for table in _stream_tables(status["streams"]):
        console.print(table)
    if status.get("backfills"):
        console.print(_backfill_table(status["backfills"]))
    if status.get("reconciliations"):
        console.print(_reconciliation_table(status["reconciliations"]))
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()) + "\n"
