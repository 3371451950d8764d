"""How a `cdc` command ends: one line on stderr and an exit code, never a traceback.

The exit codes (the README's "Exit codes" table):

====  ==========================================================================
0     success (also when the reader of the output went away, as in ``| head``)
1     a failure of no listed kind: an internal error (a bug) or a failed Spark job
2     the command line or the config is wrong (a setting out of range, an unknown CDC_ variable,
      a malformed DSN or URL, a TLS mismatch)
3     a mapping is wrong (its YAML too), or `cdc check` found a mapping problem
4     PostgreSQL is not set up: wal_level, slot, publication, a missing privilege, a refused login
5     Redis refused a command (ACL, login, wrong key type where a stream or its mark belongs)
6     Redis lost entries the slot was told it holds, or a mapped stream's history vanished
7     `cdc reconcile` left drift (a dry run, or a refused reset)
75    a server is unreachable or restarting (transient: run again)
130   interrupted (Ctrl-C)
====  ==========================================================================

Every message passes through `cdc.redact` first.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

from .errors import CdcError, PublishError, TransientError
from .redact import redact

__all__ = ["EXIT_CODES", "RedactingFilter", "as_cdc_error", "report", "silence_stdout"]

EXIT_CODES = {
    0: "success",
    1: "a failure of no listed kind (an internal error, a failed Spark job)",
    2: "bad command line or config",
    3: "bad mapping",
    4: "PostgreSQL not set up (wal_level, slot, publication, privilege)",
    5: "Redis refused a command",
    6: "Redis data loss",
    7: "cdc reconcile left drift",
    75: "transient: a server unreachable or restarting",
    130: "interrupted",
}


def as_cdc_error(exc: BaseException) -> CdcError:
    """The operator's view of any failure that reached the top of a command."""
    if isinstance(exc, CdcError):
        return exc
    import psycopg
    import redis

    if isinstance(exc, redis.AuthenticationError):  # a ConnectionError to redis-py, but retrying will not fix it
        return PublishError(f"redis refused the login: {exc}", hint="check the user and password in redis.url")
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return TransientError(f"redis unavailable: {exc}", hint="check redis.url and that Redis is running")
    if isinstance(exc, redis.RedisError):
        return PublishError(f"redis refused: {exc}", hint="check the redis user's ACL and the keys it may use")
    if isinstance(exc, psycopg.Error):
        from .source.replication import classify_pg_error

        return classify_pg_error(exc)
    error = CdcError(f"internal error: {type(exc).__name__}: {exc}", hint="set CDC_TRACEBACK=1 to see where")
    return error


def report(exc: BaseException) -> int:
    """Print `exc` as one redacted line on stderr; its exit code."""
    error = as_cdc_error(exc)
    if os.environ.get("CDC_TRACEBACK"):
        sys.stderr.write(redact("".join(traceback.format_exception(exc))))
    line = " ".join(str(error).split())  # one line, whatever the server's message held
    try:
        print(f"cdc: error: {redact(line)}", file=sys.stderr, flush=True)
    except OSError:
        pass  # stderr is gone too: the exit code is all that is left
    return error.exit_code


def silence_stdout() -> None:
    """The reader of stdout went away (``cdc dlq list | head``): drop what is still buffered."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


class RedactingFilter(logging.Filter):
    """Hides passwords in every log record (its message and its traceback text)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = redact(record.getMessage())
        record.args = None
        if record.exc_info:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True
