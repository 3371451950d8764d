"""Progress of a long job (a backfill): a bar redrawn in place on a terminal, a few plain lines elsewhere.

On a terminal `rich` draws the bar, count, rate and time left. When the output is
not a terminal (a log, a pipe, CI) each update that changed the count prints one
plain line, at most one per `every` seconds, and the final count always: a log
of a long backfill stays short.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

__all__ = ["ProgressDisplay"]


class ProgressDisplay:
    """Follows one count towards a total; use as a context manager, call `update`."""

    def __init__(self, what: str, unit: str = "rows", *, file: TextIO | None = None, every: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, terminal: bool | None = None) -> None:
        self.what, self.unit, self.every, self.clock = what, unit, every, clock
        self.file = sys.stderr if file is None else file
        self.console = Console(file=self.file, force_terminal=terminal, highlight=False)
        self.started = clock()
        self.first: int | None = None  # the count when following began: the rate counts from there
        self.shown: tuple[int, int] | None = None  # (done, total) of the last plain line
        self.last_line_at = float("-inf")
        self.latest: tuple[int, int] | None = None
        self.bar: Progress | None = None
        self.task: TaskID | None = None
        if self.console.is_terminal:
            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn(f"{unit}, {{task.fields[rate]}} {unit}/s"), TimeRemainingColumn(),
                console=self.console,
            )

    def __enter__(self) -> ProgressDisplay:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def rate(self, done: int) -> float:
        elapsed = self.clock() - self.started
        return (done - (self.first or 0)) / elapsed if elapsed > 0 else 0.0

    def update(self, done: int, total: int) -> None:
        if self.first is None:
            self.first = done
        self.latest = (done, total)
        if self.bar is not None:
            if self.task is None:
                self.task = self.bar.add_task(self.what, total=total or None, completed=done, rate="0")
            self.bar.update(self.task, total=total or None, completed=done, rate=f"{self.rate(done):,.0f}")
            return
        now = self.clock()
        if self.latest != self.shown and now - self.last_line_at >= self.every:
            self._line(done, total)
            self.last_line_at = now

    def _line(self, done: int, total: int) -> None:
        rate = self.rate(done)
        share = f" ({min(100.0, 100.0 * done / total):.0f}%)" if total else ""
        eta = f", ETA {(total - done) / rate:.0f}s" if rate > 0 and total > done else ""
        self.file.write(f"{self.what}: {done}/{total} {self.unit}{share}, {rate:,.0f} {self.unit}/s{eta}\n")
        self.file.flush()
        self.shown = (done, total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        elif self.latest is not None and self.latest != self.shown:
            self._line(*self.latest)
