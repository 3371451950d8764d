"""Progress of a long job (a backfill, a reconciliation's read): a bar on a terminal, a few plain lines elsewhere.

On a terminal `rich` draws the bar with the count, rate and time left. When the output
is not a terminal (a log, a pipe, CI) an update that changed the count prints one plain
line, at most one per `every` seconds, and the last count is always shown: a log of a
long job stays short. `rate_text` and `progress_text` are the pure wording, the same in
both forms: "3/8 partitions (38%), 1.2 partitions/s, ETA 4s, 2.5s".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn

__all__ = ["ProgressDisplay", "progress_text", "rate_text"]


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


def progress_text(done: int, total: int, seconds: float, unit: str, first: int = 0) -> str:
    """Count (and share of the total), rate and time left since the count was `first`, time spent."""
    share = f" ({min(100.0, 100.0 * done / total):.0f}%)" if total else ""
    moved = done - first
    eta = "-"
    if total and done >= total:
        eta = "0s"
    elif moved > 0 and seconds > 0 and total:
        eta = f"{(total - done) * seconds / moved:.0f}s"
    return f"{done}/{total} {unit}{share}, {rate_text(moved, seconds, unit)}, ETA {eta}, {seconds:.1f}s"


class ProgressDisplay:
    """Follows one count towards a total on `file` (stderr): use as a context manager, call `update`.

    The rate counts from the first update (a job followed midway is not credited with what
    was done before). `ends_at_total`: the total is exact, so reaching it ends the display at
    once (the bar stays as it ends and later output goes below it); without it the total
    may be an estimate the count overtakes, and only `close` ends the display.
    """

    def __init__(self, what: str, unit: str = "rows", *, file: TextIO | None = None, every: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, terminal: bool | None = None,
                 ends_at_total: bool = False) -> None:
        self.what, self.unit, self.every, self.clock = what, unit, every, clock
        self.ends_at_total = ends_at_total
        self.file = sys.stderr if file is None else file
        self.console = Console(file=self.file, force_terminal=terminal, highlight=False)
        self.started: float | None = None  # when following began: the rate counts from there
        self.first = 0  # the count then
        self.latest: tuple[int, int] | None = None
        self.shown: tuple[int, int] | None = None  # (done, total) of the last plain line
        self.last_line_at = float("-inf")
        self.closed = False
        self.bar: Progress | None = None
        self.task: TaskID | None = None
        if self.console.is_terminal:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[stats]}"),
                                console=self.console)

    def __enter__(self) -> ProgressDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def text(self, done: int, total: int) -> str:
        seconds = self.clock() - self.started if self.started is not None else 0.0
        return progress_text(done, total, seconds, self.unit, self.first)

    def update(self, done: int, total: int) -> None:
        if self.closed:
            return
        if self.started is None:
            self.started, self.first = self.clock(), done
            if self.bar is not None:
                self.bar.start()
                self.task = self.bar.add_task(self.what, total=total or None, completed=done, stats="")
        self.latest = (done, total)
        at_end = self.ends_at_total and bool(total) and done >= total
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, total=total or None, completed=done, stats=self.text(done, total))
        elif self.latest != self.shown and (at_end or self.clock() - self.last_line_at >= self.every):
            self._line(done, total)
        if at_end:
            self.close()

    def _line(self, done: int, total: int) -> None:
        self.file.write(f"{self.what}: {self.text(done, total)}\n")
        self.file.flush()
        self.shown, self.last_line_at = (done, total), self.clock()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            if self.started is not None:
                self.bar.stop()
        elif self.latest is not None and self.latest != self.shown:
            self._line(*self.latest)
