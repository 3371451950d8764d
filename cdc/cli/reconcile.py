"""`cdc reconcile`: the nightly reconciliation, run from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import orjson

from .common import load_config
from .progress import ProgressDisplay
from ..errors import UsageError

__all__ = ["cmd_reconcile"]


def cmd_reconcile(args: argparse.Namespace) -> int:
    from ..reconcile.job import preflight

    for option, path in (("--report", args.report), ("--metrics-file", args.metrics_file)):
        if path and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"{option} {path}: folder {Path(path).resolve().parent} does not exist",
                             hint="give a file in an existing folder")  # checked before Spark spends minutes
    settings, mappings = load_config(args)
    if args.master:
        settings = dataclasses.replace(settings, reconcile=dataclasses.replace(settings.reconcile, master=args.master))
    specs = _chosen_specs(settings, args.spec)
    targets = [preflight(settings, mappings, spec) for spec in specs]  # mistakes show before Spark starts
    results = _run_specs(settings, specs, targets, args.dry_run)
    _write_outcome(results, args)
    unrepaired = [o.consumer for r in results for o in r.outcomes if o.unrepaired]
    if unrepaired:
        print(f"drift left unrepaired in: {', '.join(unrepaired)}", file=sys.stderr)
        return 7
    return 0


def _chosen_specs(settings, names: list[str] | None) -> list:
    """The specs to run: all of them, or those --spec names (one at least)."""
    from ..reconcile.spec import load_specs

    specs = load_specs(Path(settings.reconcile.specs))
    if not names:
        return specs
    chosen = [s for s in specs if s.name in names]
    if not chosen:
        raise UsageError(f"--spec: no spec named {', '.join(names)}", hint=f"specs: {', '.join(s.name for s in specs)}")
    return chosen


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run_specs(settings, specs: list, targets: list, dry_run: bool) -> list:
    """Start Spark once and reconcile each spec with it, its read's progress shown; the results."""
    from ..reconcile.job import reconcile_spec
    from ..reconcile.truth import start_spark

    _say(f"starting Spark ({settings.reconcile.master})")
    spark_started = time.monotonic()
    rc = settings.reconcile
    spark = start_spark(rc.master, rc.jdbc_jar, rc.driver_memory, rc.executor_memory, rc.executor_cores)
    spark_seconds = time.monotonic() - spark_started
    _say(f"Spark started in {spark_seconds:.1f}s")
    results: list = []
    try:
        for spec, spec_targets in zip(specs, targets):
            display = ProgressDisplay(f"{spec.name}: reading", "partitions", every=2.0, ends_at_total=True)
            try:
                result = reconcile_spec(settings, spec, spec_targets, spark, dry_run=dry_run, say=_say,
                                        progress=display.update)
            finally:
                display.close()
            if not results:  # the first spec waited for the session: its time includes the start
                result.spark_start_seconds, result.seconds = spark_seconds, result.seconds + spark_seconds
            results.append(result)
    finally:
        spark.stop()
    return results


def _write_outcome(results: list, args: argparse.Namespace) -> None:
    """The report (--report, --json or text on stdout) and the metrics file (--metrics-file)."""
    from ..reconcile.drift import render_table
    from ..reconcile.job import describe

    report = [r.as_json(args.dry_run) for r in results]
    if args.report:
        Path(args.report).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    if args.metrics_file:
        from ..reconcile.metrics_file import write_metrics_file

        write_metrics_file(args.metrics_file, results, args.dry_run)
    if args.json:
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
        return
    for r in results:
        start = f"Spark start {r.spark_start_seconds:.1f}s, " if r.spark_start_seconds else ""
        print(f"{r.spec.name}: position {r.position}, {r.source_rows} source rows, {r.truth_keys} keys, "
              f"{start}read {r.read_seconds:.1f}s, total {r.seconds:.1f}s")
        for o in r.outcomes:
            print(f"  {o.consumer}: {describe(o)}")
            if not o.drift.clean:
                print("    " + render_table(o.drift, r.spec.key_columns).replace("\n", "\n    "))
