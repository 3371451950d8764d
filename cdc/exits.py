"""How a `cdc` command ends: one line on stderr and an exit code, never a traceback.

The exit codes are `EXIT_CODES` (docs/reference/exit-codes.md is generated from it).
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

#: every exit code and what ends with it (the documentation's table is generated from this)
EXIT_CODES = {
    0: "success; also when the reader of the output goes away (`cdc dlq list | head`)",
    1: "a failure of no other kind: an internal error (set `CDC_TRACEBACK=1` to see where) or a failed Spark job",
    2: "bad command line or config: an unknown option, a bad value, an unknown entity, a setting out of its range, an "
       "unknown `CDC_` variable, a malformed DSN or Redis URL (a keyword value such as `sslmode` or `port` too), a TLS "
       "mismatch (`rediss://` against a plain-text port or `redis://` against a TLS one; `sslmode=require` against a "
       "server without SSL); a consumer's handler that cannot work (its module missing or raising at import, not "
       "callable, the wrong signature); a stream, slot name or publication another bridge on the same Redis holds",
    3: "bad mapping, including its YAML syntax; a value a mapping's cast cannot write exactly (the bridge stops at its change)",
    4: "PostgreSQL not set up: `wal_level`, a missing slot or publication, a missing privilege; a mapped table changed "
       "under the bridge (dropped and re-created, renamed, out of the publication, a partition detached) or without a "
       "usable replica identity; a publication whose `publish` option leaves out an operation the mappings publish (or "
       "without `publish_via_partition_root` for a mapped partitioned table), or that a running bridge found so until "
       "`cdc recover`; for a consumer, a missing state table or grant, or its handler's SQL refused for a reason no "
       "entry caused; a refused login (password, `pg_hba.conf`)",
    5: "Redis refused a command (ACL, login), or a key of another type sits where a mapped stream or its high-water "
       "mark belongs, or an entry holds a value larger than Redis' `proto-max-bulk-len`; `cdc read` / `cdc dlq` found an "
       "entry the bridge or a consumer did not write (named by its ID, skipped)",
    6: "Redis lost entries the slot was told it holds, or a mapped stream's history vanished (deleted, replaced by "
       "another type, trimmed below what a consumer group had not consumed, or entries a group had not consumed "
       "deleted anywhere by someone other than the bridge, which a plain consumer reports too); for a consumer, its "
       "stream or group vanished while it ran; for a transaction-mode consumer, a source transaction whose END "
       "record was read and whose entries did not all arrive in time, or one of its "
       "entries deleted while pending (`IncompleteTransaction`; an END the bridge has not written yet is waited for)",
    7: "`cdc reconcile` left drift (a dry run, or a refused reset)",
    75: "transient: a server unreachable or restarting, or another bridge holds the slot (`cdc run`; see `--standby`); "
        "running again may succeed",
    130: "interrupted (Ctrl-C)",
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
