"""Whose fault is an error raised while handling entries: the entry's, or the setup's.

Only an entry's own failure counts towards `max_deliveries` and can dead-letter it. An error
of the infrastructure never does: the entry stays pending (not acknowledged, its failure
count unchanged) and the consumer either retries (``retry``: a server away, restarting, out
of resources) or stops with the fix (``setup``: a missing privilege or table, a refused
login, a Redis ACL). Pure: an exception in, a verdict out.

PostgreSQL errors are judged by their SQLSTATE, whoever sent the statement (the consumer's
checkpoint queries, a `TableSink`, or a handler's own SQL in the consumer's transaction):

- the entry's: class 22 (data exception: a bad value), 23 (integrity constraint violation:
  a duplicate key, a check or foreign key the entry's data breaks), 44 (WITH CHECK OPTION
  violation), 54 (program limit exceeded: a value too large), P0 (raised by PL/pgSQL, a
  trigger refusing the row), 57014 (query cancelled, a statement timeout) and 55P03 (lock
  not available, a lock timeout);
- ``retry``: class 08 (connection exception), 40 (serialization failure, deadlock), 53
  (insufficient resources: disk full, too many connections), 58 (system error), 57P01-57P03
  (a server shutting down, restarting or starting), 25006 (read-only transaction: a failover
  in progress), and a connection lost without a SQLSTATE;
- ``setup``: everything else, notably 42 (42501 insufficient privilege, 42P01 undefined
  table, a syntax error in the handler's SQL), 28 (login refused), 3D and 3F (no such
  database or schema), 0A, 57P04 (database dropped) and XX (internal error).

Any other exception from a handler (a Python error in its code) is the entry's, except Redis
errors: a connection lost or a server busy is ``retry``, a refused command (ACL, wrong key
type) is ``setup``. A `TransientError` is ``retry`` and any other `CdcError` ``setup``.
"""

from __future__ import annotations

from typing import Literal

import psycopg
import redis

from ..errors import CdcError, TransientError

__all__ = ["ENTRY", "RETRY", "SETUP", "whose"]

Verdict = Literal["entry", "retry", "setup"]
ENTRY: Verdict = "entry"
RETRY: Verdict = "retry"
SETUP: Verdict = "setup"

_ENTRY_CLASSES = ("22", "23", "44", "54", "P0")
_ENTRY_STATES = ("57014", "55P03")
_RETRY_CLASSES = ("08", "40", "53", "58")
_RETRY_STATES = ("57P01", "57P02", "57P03", "25006")
#: Redis replies that say "not now" rather than "never"
_REDIS_BUSY = ("OOM", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY", "LOADING", "BUSY")


def whose(exc: BaseException) -> Verdict:
    """The entry's failure, a failure worth retrying, or a setup to fix (see the module's rules)."""
    if isinstance(exc, TransientError):
        return RETRY
    if isinstance(exc, CdcError):
        return SETUP
    if isinstance(exc, psycopg.Error):
        return _postgres(exc)
    if isinstance(exc, redis.AuthenticationError):
        return SETUP
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return RETRY
    if isinstance(exc, redis.RedisError):
        return RETRY if str(exc).startswith(_REDIS_BUSY) else SETUP
    return ENTRY


def _postgres(exc: psycopg.Error) -> Verdict:
    state = exc.sqlstate or ""
    if not state:  # from the client: a connection failed or lost, or the handler misusing the API
        if isinstance(exc, psycopg.InterfaceError):
            return RETRY
        if isinstance(exc, psycopg.OperationalError):  # a refused login or a bad DSN is no server away
            from ..source.replication import classify_pg_error

            return RETRY if isinstance(classify_pg_error(exc), TransientError) else SETUP
        return ENTRY
    if state.startswith(_ENTRY_CLASSES) or state in _ENTRY_STATES:
        return ENTRY
    if state.startswith(_RETRY_CLASSES) or state in _RETRY_STATES:
        return RETRY
    return SETUP
