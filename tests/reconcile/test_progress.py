"""The reconciliation's progress wording and its line-per-change display off a terminal."""

from __future__ import annotations

import io

from cdc.reconcile import progress
from cdc.reconcile.progress import ProgressDisplay, progress_text, rate_text


def test_slow_rates_keep_their_digits_and_nothing_done_shows_no_rate():
    assert rate_text(1, 4.0, "partitions") == "0.25 partitions/s"
    assert rate_text(1, 130.0, "partitions") == "0.0077 partitions/s"
    assert rate_text(3, 2.0, "partitions") == "1.5 partitions/s"
    assert rate_text(5000, 2.0, "rows") == "2,500 rows/s"
    assert rate_text(0, 9.0, "partitions") == "- partitions/s"
    assert progress_text(1, 8, 4.0, "partitions") == "1/8 partitions, 0.25 partitions/s, ETA 28s, 4.0s"
    assert progress_text(0, 8, 3.0, "partitions") == "0/8 partitions, - partitions/s, ETA -, 3.0s"


class Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_off_a_terminal_it_prints_one_line_per_change_at_most_every_two_seconds_and_always_the_last(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    out = Pipe()
    display = ProgressDisplay("totals: reading", "partitions", out)
    for done, at in [(0, 100.0), (1, 100.5), (2, 101.0), (3, 102.5), (4, 102.6), (5, 103.0)]:
        now[0] = at
        display.update(done, 8)
    now[0] = 104.0
    display.close()
    assert out.getvalue().splitlines() == [
        "totals: reading: 0/8 partitions, - partitions/s, ETA -, 0.0s",
        "totals: reading: 3/8 partitions, 1.2 partitions/s, ETA 4s, 2.5s",
        "totals: reading: 5/8 partitions, 1.7 partitions/s, ETA 2s, 3.0s",  # as it was at its update
    ]
    out = Pipe()
    display = ProgressDisplay("totals: reading", "partitions", out)
    display.update(0, 2)
    display.update(2, 2)  # the end is always shown at once
    display.close()
    assert out.getvalue().splitlines()[-1].startswith("totals: reading: 2/2 partitions")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_it_draws_a_rich_bar_with_the_same_wording():
    out = Terminal()
    display = ProgressDisplay("totals: reading", "partitions", out)
    display.update(0, 8)
    display.update(3, 8)
    display.close()
    text = out.getvalue()
    assert "\x1b[" in text and "━" in text, "not drawn as a bar"
    assert "totals: reading" in text and "3/8 partitions" in text and "partitions/s" in text


def test_on_a_terminal_the_bar_ends_with_the_read_and_nothing_is_drawn_before_it():
    out = Terminal()
    display = ProgressDisplay("totals: reading", "partitions", out)
    assert out.getvalue() == ""  # the snapshot and its checks come first: no empty bar meanwhile
    display.update(0, 2)
    display.update(2, 2)
    assert display.closed and "2/2 partitions" in out.getvalue()
    drawn = out.getvalue()
    display.update(2, 2)
    display.close()
    assert out.getvalue() == drawn
