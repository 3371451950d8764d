"""Keeps the spare slot (`cdc.source.spare_slot`) behind what Redis holds, in a thread of its own.

Every `interval_s` it moves the spare up to the position the bridge last told the slot it
streams (Redis holds everything before it, and the ack gate vouched for it), never past it,
so the spare retains what the slot retains and no more, and could stand in for it with
nothing to skip but what it decodes again. Its server not answering only makes the reading
late: a report, never a reason to stop the bridge.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

from ..source import spare_slot
from ..source.lsn import Lsn
from ..source.replication import SESSION_OPTIONS

__all__ = ["SpareKeeper", "SpareState"]

log = logging.getLogger("cdc.spare")

#: seconds to wait for the spare's server to answer a connection
CONNECT_TIMEOUT_S = 5


@dataclass(frozen=True)
class SpareState:
    """The spare as last seen: `ready` when it could stand in for the slot now, else `reason` says why not."""

    ready: bool
    reason: str
    confirmed: Lsn | None = None
    #: bytes between the spare's confirmed position and what Redis holds (what a switch decodes again)
    behind: int | None = None
    at: float = 0.0


class SpareKeeper:
    def __init__(self, slot: str, interval_s: float, spare_dsn: Callable[[], str], told: Callable[[], Lsn],
                 held: Callable[[], Lsn]) -> None:
        self.slot, self.interval_s = slot, interval_s
        self.spare_dsn, self.told, self.held = spare_dsn, told, held
        self.state: SpareState | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cdc-spare-keeper", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stopped.set()

    def keep(self) -> SpareState:
        """Move the spare up to what the slot was told, then judge it against what Redis holds (one pass)."""
        to, dsn = self.told(), self.spare_dsn()
        try:
            with psycopg.connect(dsn, autocommit=True, options=SESSION_OPTIONS, connect_timeout=CONNECT_TIMEOUT_S) as conn:
                if int(to):
                    spare_slot.advance(conn, self.slot, to)
                reading = spare_slot.read(conn, self.slot)
        except psycopg.Error as exc:
            return SpareState(False, f"its server did not answer: {str(exc).strip().splitlines()[0]}", at=time.monotonic())
        held = self.held()
        why = spare_slot.judge(reading, held if int(held) else None)
        behind = None if reading.confirmed is None or not int(held) else max(0, int(held) - int(reading.confirmed))
        return SpareState(why is None, why or "ready", reading.confirmed, behind, time.monotonic())

    def _run(self) -> None:
        while not self._stopped.is_set():
            state = self.keep()
            before, self.state = self.state, state
            if before is None or before.ready != state.ready:
                (log.info if state.ready else log.warning)(
                    "spare slot %s %s: %s", self.slot, "ready" if state.ready else "not ready", state.reason)
            self._stopped.wait(self.interval_s)
