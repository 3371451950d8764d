"""The backfill progress display, without servers: a bar on a terminal, few plain lines elsewhere."""

from __future__ import annotations

import io

from cdc.ops.progress import ProgressDisplay


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_only_changes_print_and_at_most_one_line_a_second():
    out, clock = io.StringIO(), Clock()
    with ProgressDisplay("backfill 1 of ride", file=out, clock=clock, terminal=False) as display:
        for _ in range(50):  # a poll every 0.2 s, the count moving every 5th poll
            clock.now += 0.2
            display.update(int(clock.now) * 100, 1000)
        clock.now += 0.2
        display.update(1000, 1000)
    lines = out.getvalue().splitlines()
    assert len(lines) <= 11, lines
    assert lines[0].startswith("backfill 1 of ride: 0/1000 rows (0%)")
    assert lines[-1].startswith("backfill 1 of ride: 1000/1000 rows (100%)"), "the final count is always shown"
    assert "ETA" in lines[1] and "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_an_unchanged_count_prints_nothing_more():
    out, clock = io.StringIO(), Clock()
    with ProgressDisplay("snapshot", file=out, clock=clock, terminal=False) as display:
        for _ in range(100):
            clock.now += 5
            display.update(7, 10)
    assert out.getvalue() == "snapshot: 7/10 rows (70%), 0 rows/s\n", "one line for 100 polls of the same count"


def test_the_rate_counts_from_when_following_began():
    out, clock = io.StringIO(), Clock()
    display = ProgressDisplay("b", file=out, clock=clock, terminal=False, every=0)
    display.update(500, 1000)
    clock.now = 2.0
    display.update(700, 1000)
    display.close()
    assert out.getvalue().splitlines()[-1] == "b: 700/1000 rows (70%), 100 rows/s, ETA 3s"


def test_on_a_terminal_a_bar_is_redrawn_in_place():
    out, clock = io.StringIO(), Clock()
    with ProgressDisplay("backfill 2 of ride", file=out, clock=clock, terminal=True) as display:
        for done in range(0, 1001, 100):
            clock.now += 1
            display.update(done, 1000)
    text = out.getvalue()
    assert "backfill 2 of ride" in text and "1000/1000" in text and "\x1b[" in text
    assert text.count("\n") <= 2, "redrawn in place, not a line per update"
