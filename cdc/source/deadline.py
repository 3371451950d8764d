"""Deadlines on PostgreSQL connections: a peer that goes silent is declared dead, never waited for.

A network that drops packets without closing anything (a frozen proxy, a lost
route) leaves a blocking call waiting for an answer that never comes: TCP sees
nothing wrong while the kernel on our side accepts the bytes. `bounded` gives
such a call a deadline: when it passes, the connection's socket is shut down, the
blocked call fails at once, and the failure is reported as `ConnectionSilent`, a
transient error after which the bridge reconnects.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from ..errors import TransientError

__all__ = ["ConnectionSilent", "bounded", "cut"]


class ConnectionSilent(TransientError):
    """A PostgreSQL connection went quiet past the receive timeout: deemed dead."""


def cut(conn: psycopg.Connection | None) -> None:
    """Shut the connection's socket down in both directions (safe from another thread)."""
    if conn is None or conn.closed:
        return
    try:
        fd = conn.pgconn.socket
        sock = socket.socket(fileno=fd)
    except (psycopg.Error, OSError, ValueError):
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()  # the descriptor stays libpq's


@contextmanager
def bounded(conn: psycopg.Connection | None, seconds: float, what: str) -> Iterator[None]:
    """Run the block; if it takes longer than `seconds`, cut `conn` and raise `ConnectionSilent`."""
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def expire() -> None:
        with lock:  # never cut a connection whose call already returned
            if state["done"]:
                return
            state["fired"] = True
        cut(conn)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    except Exception as exc:
        if state["fired"]:
            raise ConnectionSilent(f"no answer from postgres in {seconds:g}s ({what}); reconnecting") from exc
        raise
    finally:
        with lock:
            state["done"] = True
        timer.cancel()
