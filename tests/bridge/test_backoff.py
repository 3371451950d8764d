"""The wait between sessions: exponential within a burst of failures, from the start again after streaming."""

from __future__ import annotations

import pytest

from cdc.bridge.backoff import Backoff

pytestmark = pytest.mark.one_path


def test_failures_in_a_row_back_off_up_to_the_maximum():
    backoff = Backoff(rng=lambda: 0.0)
    assert [backoff.next(float(t)) for t in range(7)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]


def test_jitter_never_passes_the_maximum():
    backoff = Backoff(rng=lambda: 1.0)
    assert backoff.next(0.0) == 1.2
    assert max(backoff.next(float(t)) for t in range(10)) == 5.0


def test_a_session_that_streamed_a_while_starts_the_count_over():
    backoff = Backoff(rng=lambda: 0.0)
    for t in range(6):
        backoff.next(float(t))
    backoff.streaming(100.0)
    assert backoff.next(104.0) == 5.0, "streamed less than the longest wait: a repeating failure still backs off"
    backoff.streaming(200.0)
    assert backoff.next(205.0) == 0.2, "streamed long enough: the next fault is retried at once"
    assert backoff.next(205.5) == 0.4


def test_a_session_that_published_starts_the_count_over():
    backoff = Backoff(rng=lambda: 0.0)
    for t in range(6):
        backoff.next(float(t))
    backoff.streaming(100.0)
    backoff.progressed()
    assert backoff.next(100.5) == 0.2
    backoff.progressed()  # a confirmation outside a streaming session counts for nothing
    assert backoff.next(101.0) == 0.4
