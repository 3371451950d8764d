"""The replication transport: the one place that touches the replication connection.

Opens a ``replication=database`` connection with psycopg, starts pgoutput on the
slot, hands raw CopyData payloads to the caller and sends standby status updates.
Decoding lives in `cdc.source.framing` and `cdc.source.pgoutput`; this module only moves bytes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import select
import socket
import time

import psycopg
from psycopg import errors as pgerrors

from ..errors import CdcError, ConfigError, PrivilegeError, SlotError, SourceError, TransientError
from ..redact import redact
from .deadline import ConnectionSilent, bounded
from .framing import standby_status_update
from .privileges import fix_for

__all__ = ["SESSION_OPTIONS", "ReplicationStream", "classify_pg_error", "quote_ident", "quote_literal", "proto_version_for"]

log = logging.getLogger("cdc.replication")

#: Session settings that fix the text form of values pgoutput sends (see cdc.source.values).
SESSION_OPTIONS = (
    "-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=iso_8601 "
    "-c extra_float_digits=3 -c bytea_output=hex -c client_encoding=UTF8"
)


@functools.cache
def libpq_copy_functions() -> tuple[int, int] | None:
    """The addresses of PQgetCopyData and PQfreemem in the libpq psycopg runs on: the one libpq mapped in
    this process (Linux's /proc/self/maps; opened with RTLD_NOLOAD, never loaded again). None where that
    cannot be told: psycopg's own calls are used then."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libpq" in line}
        paths = {p for p in paths if p.startswith("/") and os.path.basename(p).startswith("libpq")}
        if len(paths) != 1:
            return None
        lib = ctypes.CDLL(paths.pop(), mode=os.RTLD_NOLOAD)
        return (ctypes.cast(lib.PQgetCopyData, ctypes.c_void_p).value,
                ctypes.cast(lib.PQfreemem, ctypes.c_void_p).value)
    except (OSError, AttributeError, ValueError):
        return None


def quote_ident(name: str) -> str:
    """Quote an identifier: the replication connection accepts no parameters."""
    return '"' + name.replace('"', '""') + '"'


def quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def proto_version_for(server_version: int) -> int:
    """Highest pgoutput protocol the server speaks (PG 14: 2, 15: 3, 16+: 4)."""
    if server_version >= 160000:
        return 4
    if server_version >= 150000:
        return 3
    if server_version >= 140000:
        return 2
    return 1


_PERMANENT_CONNECT = (
    ("password authentication failed", PrivilegeError, "check the user and password in postgres.dsn"),
    ("no password supplied", PrivilegeError,
     "give the password in postgres.dsn (from a file: CDC_POSTGRES_DSN_FILE), or in ~/.pgpass"),
    # a plain-text connection where pg_hba.conf has only hostssl lines for it
    ("no encryption", PrivilegeError,
     "the server accepts this user only over TLS: set sslmode=verify-full (with sslrootcert) or sslmode=require in postgres.dsn"),
    ("no pg_hba.conf entry", PrivilegeError, "allow replication connections for this user in pg_hba.conf"),
    ("does not support SSL", ConfigError,
     "the server has ssl = off: turn it on (with a certificate), or set sslmode=prefer or disable in postgres.dsn"),
    ("certificate verify failed", ConfigError,
     "set sslrootcert in postgres.dsn to the CA that signed the server's certificate"),
    ("root certificate file", ConfigError, "set sslrootcert in postgres.dsn to a readable CA certificate file"),
    ("does not exist", ConfigError, "check the database and user names in postgres.dsn"),
    ("must be superuser or replication role", PrivilegeError, "run: ALTER ROLE <user> REPLICATION"),
    ("permission denied to start WAL sender", PrivilegeError, "run: ALTER ROLE <user> REPLICATION"),
    ("invalid connection option", ConfigError, "fix postgres.dsn"),
    ("invalid dsn", ConfigError, "fix postgres.dsn"),
    ("missing \"=\" after", ConfigError, "fix postgres.dsn"),
    # libpq checks these keyword values only when connecting (cdc.config.check_dsn does at load)
    ("invalid integer value", ConfigError, "fix the number in postgres.dsn"),
    ("invalid port number", ConfigError, "fix the port in postgres.dsn"),
    (" value: \"", ConfigError, "fix that keyword's value in postgres.dsn"),
)


def classify_pg_error(exc: BaseException, *, slot: str = "", publication: str = "", role: str = "",
                      need: str = "SELECT") -> CdcError:
    """Turn a psycopg error into what the operator must do: retry it, or fix something.

    A refused privilege names the exact GRANT for `role` (`need`: the privilege the caller used).
    """
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, CdcError):
        return exc
    if "wal_level" in text and "logical" in text:
        return SourceError(
            f"postgres is not configured for logical decoding: {text}",
            hint="set wal_level = logical in postgresql.conf and restart PostgreSQL",
        )
    if isinstance(exc, pgerrors.UndefinedObject) or ("replication slot" in text and "does not exist" in text):
        if "publication" in text:
            return SlotError(f"publication {publication!r} does not exist", hint="run: cdc init --config <file>")
        return SlotError(f"replication slot {slot!r} does not exist", hint="run: cdc init --config <file>")
    if "publication" in text and "does not exist" in text:
        return SlotError(f"publication {publication!r} does not exist", hint="run: cdc init --config <file>")
    if isinstance(exc, pgerrors.InsufficientPrivilege):
        if not role and getattr(exc, "pgconn", None) is not None and exc.pgconn.user:
            role = exc.pgconn.user.decode()  # the role the refused statement ran as
        return PrivilegeError(f"postgres refused: {text}", hint=fix_for(text, role, need))
    if "was not created in this database" in text:  # a slot of another database: never better on retry
        return SlotError(f"postgres refused slot {slot!r}: {text}",
                         hint="point postgres.dsn at the slot's database, or see cdc check")
    if isinstance(exc, pgerrors.ObjectInUse):
        return TransientError(f"{text} (another bridge may be running on this slot)")
    if isinstance(exc, (pgerrors.AdminShutdown, pgerrors.CannotConnectNow, pgerrors.CrashShutdown)):
        return TransientError(f"postgres restarting: {text}")
    if isinstance(exc, psycopg.OperationalError):
        for needle, kind, hint in _PERMANENT_CONNECT:
            if needle in text:
                return kind(f"cannot connect to postgres: {redact(text)}", hint=hint)
        return TransientError(f"postgres unavailable: {text}")
    if isinstance(exc, psycopg.ProgrammingError) and ("connection info string" in text or "invalid dsn" in text
                                                        or "invalid connection option" in text or "invalid URI" in text):
        return ConfigError(f"invalid postgres connection string: {text}", hint="fix postgres.dsn (or --state-dsn)")
    if isinstance(exc, psycopg.Error):
        return SourceError(f"postgres error: {text}")
    if isinstance(exc, OSError):
        return TransientError(f"postgres connection lost: {exc}")
    return SourceError(f"unexpected postgres failure: {text}")


def application_name(dsn: str) -> dict[str, str]:
    """Name the replication connection after this process ("cdc run on <host> pid <pid>", shown by
    pg_stat_replication, so a second bridge can say who holds the slot), unless the DSN or PGAPPNAME
    names it already."""
    if os.environ.get("PGAPPNAME") or "application_name" in psycopg.conninfo.conninfo_to_dict(dsn):
        return {}
    return {"application_name": f"cdc run on {socket.gethostname()} pid {os.getpid()}"[:63]}


class ReplicationStream:
    """A started pgoutput stream: `read()` CopyData payloads, `send_status()` feedback."""

    def __init__(self, dsn: str, slot: str, publication: str, timeout: float = 30.0) -> None:
        self.dsn = dsn
        #: how long starting, or sending feedback, may wait on a server that does not answer
        self.timeout = timeout
        self.slot = slot
        self.publication = publication
        self.conn: psycopg.Connection | None = None
        self.proto_version = 0
        self.streaming = False  # the server streams transactions in progress
        self.server_version = 0
        self.backend_pid = 0

    def _fail(self, exc: BaseException) -> CdcError:
        return classify_pg_error(exc, slot=self.slot, publication=self.publication)

    def start(self, start_lsn: int = 0, *, messages: bool = True, streaming: bool = False) -> None:
        """Start pgoutput; `streaming`: ask for large transactions while they run (protocol 2+, else ignored)."""
        try:
            self.conn = psycopg.connect(
                self.dsn, replication="database", autocommit=True, options=SESSION_OPTIONS, connect_timeout=10,
                **application_name(self.dsn),
            )
            self.server_version = self.conn.info.server_version
            self.backend_pid = self.conn.info.backend_pid
            self.proto_version = proto_version_for(self.server_version)
            options = [
                f"proto_version '{self.proto_version}'",
                f"publication_names {quote_literal(quote_ident(self.publication))}",
            ]
            if messages:
                options.append("messages 'true'")
            self.streaming = streaming and self.proto_version >= 2
            if self.streaming:
                options.append("streaming 'on'")
            lsn = f"{start_lsn >> 32:X}/{start_lsn & 0xFFFFFFFF:X}"
            with bounded(self.conn, self.timeout, "starting replication"):
                self.conn.execute(
                    f"START_REPLICATION SLOT {quote_ident(self.slot)} LOGICAL {lsn} ({', '.join(options)})"
                )
            self.conn.pgconn.nonblocking = 1
        except Exception as exc:
            self.close()
            raise self._fail(exc) from exc
        log.info("replication started slot=%s publication=%s proto=%d%s", self.slot, self.publication,
                 self.proto_version, " streaming" if self.streaming else "")

    @property
    def copy_reader(self) -> tuple[int, int, int] | None:
        """(PGconn*, PQgetCopyData, PQfreemem) as addresses, for compiled code that calls libpq itself
        instead of `get_copy_data` (no Python objects per message); None where they cannot be known."""
        functions = libpq_copy_functions()
        ptr = getattr(self.conn.pgconn, "pgconn_ptr", None) if self.conn is not None else None
        if functions is None or not ptr:
            return None
        return ptr, *functions

    @property
    def get_copy_data(self):
        """libpq's PQgetCopyData on this connection: (size, message), (0, ...) when no whole message is
        buffered, a negative size when COPY ended or failed (`failure` says which)."""
        return self.conn.pgconn.get_copy_data

    def failure(self, outcome: int | BaseException) -> CdcError:
        """The error for what `get_copy_data` gave instead of a message: -1 (the server ended
        COPY), another negative status (a failure), or the exception it raised."""
        if isinstance(outcome, BaseException):
            return self._fail(outcome)
        if outcome == -1:
            return self._ended()
        return self._fail(psycopg.OperationalError(self.conn.pgconn.get_error_message()))

    def read(self, timeout: float) -> bytes | None:
        """The next CopyData payload, or None when nothing arrived within `timeout` seconds."""
        pgconn = self.conn.pgconn
        waited = False
        while True:
            try:
                n, data = pgconn.get_copy_data(1)
            except psycopg.Error as exc:
                raise self._fail(exc) from exc
            if n > 0:
                return bytes(data)
            if n == -1:
                raise self._ended()
            if n < -1:
                raise self._fail(psycopg.OperationalError(pgconn.get_error_message()))
            if waited and timeout <= 0:
                return None
            try:
                ready, _, _ = select.select([pgconn.socket], [], [], max(timeout, 0))
            except (OSError, ValueError) as exc:
                raise TransientError(f"postgres connection lost: {exc}") from exc
            if not ready:
                return None
            try:
                pgconn.consume_input()
            except psycopg.Error as exc:
                raise self._fail(exc) from exc
            waited = True
            timeout = 0

    def _ended(self) -> CdcError:
        """The server ended COPY: find out why from its final result."""
        pgconn = self.conn.pgconn
        message = ""
        res = pgconn.get_result()
        while res is not None:
            if res.error_message:
                message = res.error_message.decode(errors="replace").strip()
                sqlstate = res.error_field(psycopg.pq.DiagnosticField.SQLSTATE)
                if sqlstate:
                    cls = pgerrors.lookup(sqlstate.decode())
                    return self._fail(cls(message))
            res = pgconn.get_result()
        return TransientError(f"postgres ended replication: {message or 'stream closed'}")

    def send_status(self, write: int, flush: int, apply: int, reply: bool = False) -> None:
        pgconn = self.conn.pgconn
        try:
            pgconn.put_copy_data(standby_status_update(write, flush, apply, reply_requested=reply))
            deadline = time.monotonic() + self.timeout
            while pgconn.flush() == 1:
                if time.monotonic() >= deadline:
                    raise ConnectionSilent(f"postgres took no feedback in {self.timeout:g}s; reconnecting")
                select.select([], [pgconn.socket], [], 1.0)
        except psycopg.Error as exc:
            raise self._fail(exc) from exc

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # closing a broken connection: nothing left to save
                pass
            self.conn = None
