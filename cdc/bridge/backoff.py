"""How long the bridge waits before the next session after a transient failure.

Jittered exponential backoff: 0.2 s, doubling up to 5 s, plus up to 1 s of
jitter (never past 5 s). The count starts over after a session that got
somewhere: Redis confirmed a write of it (a batch, or the record of how far it
holds the source), or it streamed for at least the longest wait. So a fault in a
working bridge is retried at once, while a failure that repeats before anything
is written still backs off. Pure: the caller says when a session started
streaming and when it wrote, and asks for each wait.
"""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["Backoff"]


class Backoff:
    def __init__(self, initial: float = 0.2, maximum: float = 5.0, jitter: float = 1.0,
                 rng: Callable[[], float] = random.random) -> None:
        self.initial, self.maximum, self.jitter, self.rng = initial, maximum, jitter, rng
        self.failures = 0
        self.streaming_since: float | None = None
        self.published = False

    def streaming(self, now: float) -> None:
        """A session started streaming at `now`."""
        self.streaming_since = now
        self.published = False

    def progressed(self) -> None:
        """Redis confirmed a write of this session: a batch, or the record of a position."""
        self.published = True

    def next(self, now: float) -> float:
        """A session failed at `now`: the seconds to wait before the next one."""
        if self.streaming_since is not None and (self.published or now - self.streaming_since >= self.maximum):
            self.failures = 0
        self.streaming_since, self.published = None, False
        self.failures += 1
        return min(self.initial * 2 ** (self.failures - 1) + self.rng() * self.jitter, self.maximum)
