"""The reconciliation's progress: which Spark tasks are the read, and how to show them.

`ReadTasks` watches Spark's status tracker for the JDBC read's tasks (one per
partition, a total known before it starts). `rate_text` and `progress_text` are
the pure wording. `ProgressDisplay` draws it on stderr: a rich bar on a terminal,
else one line per change (at most one every `LINE_EVERY_S`, and always the last).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["ProgressDisplay", "ReadTasks", "progress_text", "rate_text"]

LINE_EVERY_S = 2.0


def rate_text(done: float, seconds: float, unit: str) -> str:
    """`done` per second, with the digits a slow rate needs ("0.25 tasks/s"); "-" before any."""
    if done <= 0 or seconds <= 0:
        return f"- {unit}/s"
    rate = done / seconds
    if rate >= 100:
        return f"{rate:,.0f} {unit}/s"
    if rate >= 1:
        return f"{rate:.1f} {unit}/s"
    return f"{rate:.2g} {unit}/s"


def progress_text(done: int, total: int, seconds: float, unit: str) -> str:
    """"3/8 tasks, 0.75 tasks/s, ETA 7s, 4.0s": count, rate, time left and time spent."""
    eta = "-"
    if 0 < done < total and seconds > 0:
        eta = f"{(total - done) * seconds / done:.0f}s"
    elif total and done >= total:
        eta = "0s"
    return f"{done}/{total} {unit}, {rate_text(done, seconds, unit)}, ETA {eta}, {seconds:.1f}s"


class ProgressDisplay:
    """One labelled progress display on `stream` (stderr); `update(done, total)`, then `close()`."""

    def __init__(self, label: str, unit: str, stream: TextIO | None = None) -> None:
        self.label, self.unit = label, unit
        self.stream = stream or sys.stderr
        self.started: float | None = None  # the first update: rates count from the read's start
        self.closed = False
        self._last_line = float("-inf")
        self._pending: tuple[int, int, float] | None = None  # the last update not yet shown
        self._bar = None
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[stats]}"),
                                 console=Console(file=self.stream), transient=False)
            self._task = self._bar.add_task(label, total=None, stats="")

    def update(self, done: int, total: int) -> None:
        if self.closed:
            return
        if self.started is None:  # the read began: show the bar from now on
            self.started = time.monotonic()
            if self._bar is not None:
                self._bar.start()
        seconds = time.monotonic() - self.started
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total,
                             stats=progress_text(done, total, seconds, self.unit))
            if done >= total:  # the read is over: the bar stays as it ends, later lines go below it
                self.close()
            return
        if done < total and time.monotonic() - self._last_line < LINE_EVERY_S:
            self._pending = (done, total, seconds)  # shown by a later update, or by close()
            return
        self._line(done, total, seconds)

    def _line(self, done: int, total: int, seconds: float) -> None:
        self._last_line, self._pending = time.monotonic(), None
        self.stream.write(f"{self.label}: {progress_text(done, total, seconds, self.unit)}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._bar is not None and self.started is not None:
            self._bar.stop()
        elif self._pending is not None:
            self._line(*self._pending)


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


