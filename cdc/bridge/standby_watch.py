"""The standbys' copies of the slot, read by the running bridge in a thread of its own.

A standby that does not answer would otherwise stall streaming for its connect timeout at
every slot check; here it only makes the reading late. A reading older than `STALE_AFTER`
intervals counts as none (readiness "unknown", never "yes").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..source.lsn import Lsn
from ..source.standbys import CONNECT_TIMEOUT_S, StandbyCopy, read_copy, standby_targets

__all__ = ["StandbyWatch"]

log = logging.getLogger("cdc.failover")

#: a reading older than this many check intervals (plus a connect timeout) is no reading
STALE_AFTER = 3


class StandbyWatch:
    def __init__(self, dsn: str, standbys: str, slot: str, interval_s: float,
                 redis_holds: Callable[[], Lsn | None]) -> None:
        self.dsn, self.standbys, self.slot, self.interval_s = dsn, standbys, slot, interval_s
        self.redis_holds = redis_holds
        self._lock = threading.Lock()
        self._primary: tuple[str, str] | None = None
        self._reading: tuple[float, tuple[StandbyCopy, ...], Lsn | None] | None = None
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def reading(self, primary_host: str, primary_port: str) -> tuple[tuple[StandbyCopy, ...] | None, Lsn | None]:
        """The last reading's copies and the Redis position they were held to (copies None: none recent);
        tells the watch which server is the primary now (it reads the others)."""
        with self._lock:
            if self._primary != (primary_host, primary_port):
                self._primary = (primary_host, primary_port)
                self._reading = None  # read for another primary
                self._wake.set()
            reading = self._reading
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cdc-standby-watch", daemon=True)
            self._thread.start()
        if reading is None or time.monotonic() - reading[0] > STALE_AFTER * self.interval_s + CONNECT_TIMEOUT_S:
            return None, None
        return reading[1], reading[2]

    def close(self) -> None:
        self._stopped.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            with self._lock:
                primary = self._primary
            if primary is not None:
                try:
                    targets = standby_targets(self.dsn, self.standbys, *primary)
                    held = self.redis_holds()  # before the standbys: each must have received at least this
                    copies = tuple(read_copy(t, self.slot, "cdc run failover check") for t in targets)
                except Exception as exc:  # a report, never a reason to stop the bridge
                    log.warning("standby copies of the slot not read: %s", exc)
                else:
                    with self._lock:
                        if self._primary == primary:
                            self._reading = (time.monotonic(), copies, held)
            self._wake.wait(self.interval_s)
            self._wake.clear()
