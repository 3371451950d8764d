"""The reconciliation's progress: which Spark tasks are the read.

`ReadTasks` watches Spark's status tracker for the JDBC read's tasks (one per
partition, a total known before it starts) and reports (finished, total) to a
callback; `cdc reconcile` shows it with `cdc.cli.progress.ProgressDisplay`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["ReadTasks"]


class ReadTasks(threading.Thread):
    """Reports (finished, total) read tasks until stopped: one task per partition of the JDBC read.

    The read is the query's first stage (its lowest stage ID with one task per partition); the
    aggregation's later stages and the driver's fetches are left out, so the total never moves.
    """

    def __init__(self, spark, report: Callable[[int, int], None], partitions: int) -> None:
        super().__init__(name="spark-progress", daemon=True)
        self.tracker = spark.sparkContext.statusTracker()
        self.report = report
        self.partitions = partitions
        self.done = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        read_stage: int | None = None
        self.report(0, self.partitions)
        while not self.stopped.wait(0.25):
            active = set(self.tracker.getActiveStageIds())
            if read_stage is None:
                infos = [self.tracker.getStageInfo(i) for i in sorted(active)]
                reads = [i for i in infos if i is not None and i.numTasks == self.partitions]
                if not reads:
                    continue
                read_stage = reads[0].stageId
            info = self.tracker.getStageInfo(read_stage)
            now = self.partitions if read_stage not in active or info is None else info.numCompletedTasks
            if now != self.done:
                self.done = now
                self.report(now, self.partitions)

    def finish(self, read: bool) -> None:
        """Stop watching; `read`: the query succeeded, so every read task finished (even unseen)."""
        self.stopped.set()
        self.join()
        if read and self.done != self.partitions:
            self.done = self.partitions
            self.report(self.partitions, self.partitions)


