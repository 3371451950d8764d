"""`cdc reconcile --metrics-file`: the run's outcome for Prometheus, in node_exporter's textfile format.

The job runs as a batch (cron, a CronJob) and is gone before any scrape: it leaves its
results in a file that node_exporter's textfile collector (``--collector.textfile.directory``)
serves. The file is replaced whole (written aside, then renamed), so a scrape never reads half
of it. A run that fails before its verdicts leaves the previous file: its timestamp then ages,
which is what the "did not run" alert watches.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import write_to_textfile

from ..metrics import Registry

__all__ = ["STATUSES", "render", "write_metrics_file"]

#: every verdict a consumer can get (`cdc.reconcile.reset.ResetOutcome.status`), each exported 0 or 1
STATUSES = ("clean", "repaired", "drift", "stale", "failed", "never")


def registry(results: Sequence, finished_at: float, dry_run: bool) -> Registry:
    """The families of one run: per spec, when it finished and what it read; per consumer, its verdict."""
    r = Registry()
    specs = {(("spec", res.spec.name),): res for res in results}
    outcomes = {(("spec", res.spec.name), ("consumer", o.consumer)): o for res in results for o in res.outcomes}
    r.gauge("cdc_reconcile_last_run_timestamp_seconds", "when the reconciliation of the spec last finished (Unix time)",
            lambda: {k: finished_at for k in specs})
    r.gauge("cdc_reconcile_dry_run", "1 when the last run was a dry run (drift reported, nothing repaired)",
            lambda: {k: int(dry_run) for k in specs})
    r.gauge("cdc_reconcile_source_rows", "source rows the last run aggregated", lambda: {k: v.source_rows for k, v in specs.items()})
    r.gauge("cdc_reconcile_duration_seconds", "the spec's whole job, Spark's start included for the first spec",
            lambda: {k: v.seconds for k, v in specs.items()})
    r.gauge("cdc_reconcile_keys_drifted", "keys whose state differed from the truth in the last run (repaired or not)",
            lambda: {k: o.drift.keys_drifted for k, o in outcomes.items()})
    r.gauge("cdc_reconcile_status", "the consumer's verdict in the last run: 1 for its status, 0 for the others",
            lambda: {(*k, ("status", s)): int(o.status == s) for k, o in outcomes.items() for s in STATUSES})
    r.gauge("cdc_reconcile_consumer_paused_seconds", "how long the reset held the consumer's checkpoints locked",
            lambda: {k: o.locked_seconds for k, o in outcomes.items()})
    return r


def render(results: Sequence, finished_at: float, dry_run: bool) -> str:
    return registry(results, finished_at, dry_run).render()


def write_metrics_file(path: str | Path, results: Sequence, dry_run: bool, finished_at: float | None = None) -> None:
    """Replace `path` with the run's metrics (atomically: written aside, then renamed)."""
    stamp = time.time() if finished_at is None else finished_at
    write_to_textfile(str(path), registry(results, stamp, dry_run).collectors)
