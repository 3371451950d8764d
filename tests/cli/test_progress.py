"""The one progress display (cdc backfill --wait, cdc reconcile), without servers: its wording, a bar on a
terminal, few plain lines elsewhere."""

from __future__ import annotations

import io

from cdc.cli.progress import ProgressDisplay, progress_text, rate_text


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_slow_rates_keep_their_digits_and_nothing_done_shows_no_rate():
    assert rate_text(1, 4.0, "partitions") == "0.25 partitions/s"
    assert rate_text(1, 130.0, "partitions") == "0.0077 partitions/s"
    assert rate_text(3, 2.0, "partitions") == "1.5 partitions/s"
    assert rate_text(5000, 2.0, "rows") == "2,500 rows/s"
    assert rate_text(0, 9.0, "partitions") == "- partitions/s"
    assert progress_text(1, 8, 4.0, "partitions") == "1/8 partitions (12%), 0.25 partitions/s, ETA 28s, 4.0s"
    assert progress_text(0, 8, 3.0, "partitions") == "0/8 partitions (0%), - partitions/s, ETA -, 3.0s"
    assert progress_text(700, 1000, 2.0, "rows", first=500) == "700/1000 rows (70%), 100 rows/s, ETA 3s, 2.0s"


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


def test_an_unchanged_count_prints_nothing_more_and_the_rate_counts_from_when_following_began():
    out, clock = io.StringIO(), Clock()
    with ProgressDisplay("snapshot", file=out, clock=clock, terminal=False) as display:
        for _ in range(100):
            clock.now += 5
            display.update(7, 10)
    assert out.getvalue() == "snapshot: 7/10 rows (70%), - rows/s, ETA -, 0.0s\n", "one line for 100 polls"
    out = io.StringIO()
    display = ProgressDisplay("b", file=out, clock=clock, terminal=False, every=0)
    display.update(500, 1000)
    clock.now += 2.0
    display.update(700, 1000)
    display.close()
    assert out.getvalue().splitlines()[-1] == "b: 700/1000 rows (70%), 100 rows/s, ETA 3s, 2.0s"


def test_an_exact_total_shows_its_end_at_once_and_an_update_between_lines_is_shown_by_close():
    out, clock = io.StringIO(), Clock()
    display = ProgressDisplay("totals: reading", "partitions", file=out, clock=clock, terminal=False, every=2.0,
                              ends_at_total=True)
    for done, at in [(0, 0.0), (1, 0.5), (2, 1.0), (3, 2.5), (4, 2.6), (5, 3.0)]:
        clock.now = at
        display.update(done, 8)
    clock.now = 4.0
    display.close()
    assert out.getvalue().splitlines() == [
        "totals: reading: 0/8 partitions (0%), - partitions/s, ETA -, 0.0s",
        "totals: reading: 3/8 partitions (38%), 1.2 partitions/s, ETA 4s, 2.5s",
        "totals: reading: 5/8 partitions (62%), 1.2 partitions/s, ETA 2s, 4.0s",  # shown by close()
    ]
    out = io.StringIO()
    display = ProgressDisplay("totals: reading", "partitions", file=out, clock=clock, terminal=False, every=2.0,
                              ends_at_total=True)
    display.update(0, 2)
    display.update(2, 2)  # the end is shown at once, and ends the display
    assert display.closed and out.getvalue().splitlines()[-1].startswith("totals: reading: 2/2 partitions (100%)")


def test_on_a_terminal_a_bar_is_redrawn_in_place_and_nothing_is_drawn_before_the_first_update():
    out, clock = io.StringIO(), Clock()
    with ProgressDisplay("backfill 2 of ride", file=out, clock=clock, terminal=True) as display:
        assert out.getvalue() == ""  # the snapshot and its checks come first: no empty bar meanwhile
        for done in range(0, 1001, 100):
            clock.now += 1
            display.update(done, 1000)
    text = out.getvalue()
    assert "backfill 2 of ride" in text and "1000/1000 rows" in text and "rows/s" in text
    assert "\x1b[" in text and "━" in text, "not drawn as a bar"
    assert text.count("\n") <= 2, "redrawn in place, not a line per update"


def test_on_a_terminal_an_exact_total_ends_the_bar_with_the_count():
    out = io.StringIO()
    display = ProgressDisplay("totals: reading", "partitions", file=out, terminal=True, ends_at_total=True)
    display.update(0, 2)
    display.update(2, 2)
    assert display.closed and "2/2 partitions" in out.getvalue()
    drawn = out.getvalue()
    display.update(2, 2)
    display.close()
    assert out.getvalue() == drawn
