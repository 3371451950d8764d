"""`cdc reconcile`: the nightly reconciliation, run from the command line."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import orjson

from ..commands import load_config
from ..errors import CdcError

__all__ = ["cmd_reconcile"]


def cmd_reconcile(args: argparse.Namespace) -> int:
    import dataclasses

    from ..reconcile.drift import render_table
    from ..reconcile.job import describe, preflight, reconcile_spec
    from ..reconcile.spec import load_specs
    from ..reconcile.truth import start_spark

    settings, mappings = load_config(args)
    if args.master:
        settings = dataclasses.replace(settings, reconcile=dataclasses.replace(settings.reconcile, master=args.master))
    specs = load_specs(Path(settings.reconcile.specs))
    if args.spec:
        specs = [s for s in specs if s.name in args.spec]
        if not specs:
            raise CdcError(f"no spec named {', '.join(args.spec)}")

    targets = [preflight(settings, mappings, spec) for spec in specs]  # mistakes show before Spark starts

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    say(f"starting Spark ({settings.reconcile.master})")
    spark = start_spark(settings.reconcile.master, settings.reconcile.jdbc_jar, settings.reconcile.driver_memory)
    results = []
    try:
        for spec, spec_targets in zip(specs, targets):
            started = time.monotonic()
            results.append(reconcile_spec(
                settings, spec, spec_targets, spark, dry_run=args.dry_run, say=say,
                progress=lambda done, total, spec=spec, t=started: _progress(
                    f"{spec.name}: reading", done, total, time.monotonic() - t, unit="tasks"),
            ))
    finally:
        spark.stop()
    report = [r.as_json(args.dry_run) for r in results]
    if args.report:
        Path(args.report).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    if args.json:
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        for r in results:
            print(f"{r.spec.name}: position {r.position}, {r.source_rows} source rows, {r.truth_keys} keys, "
                  f"read {r.read_seconds:.1f}s, total {r.seconds:.1f}s")
            for o in r.outcomes:
                print(f"  {o.consumer}: {describe(o)}")
                if not o.drift.clean:
                    print("    " + render_table(o.drift, r.spec.key_columns).replace("\n", "\n    "))
    unrepaired = [o.consumer for r in results for o in r.outcomes if o.unrepaired]
    if unrepaired:
        print(f"drift left unrepaired in: {', '.join(unrepaired)}", file=sys.stderr)
        return 7
    return 0


def _progress(what: str, done: int, total: int, elapsed: float, since_start: int | None = None,
              unit: str = "rows") -> None:
    """One progress line (bar, count, rate, ETA), redrawn in place on a terminal."""
    moved = done if since_start is None else since_start
    rate = moved / elapsed if elapsed > 0 else 0.0
    share = min(1.0, done / total) if total else 1.0
    eta = f"{(total - done) / rate:.0f}s" if rate and total > done else "-"
    bar = "#" * int(share * 30)
    line = f"{what}: [{bar:<30}] {done}/{total} {unit}, {rate:,.0f} {unit}/s, ETA {eta}"
    sys.stderr.write(("\r" + line) if sys.stderr.isatty() else (line + "\n"))
    sys.stderr.flush()
