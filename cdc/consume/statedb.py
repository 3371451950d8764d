"""The PostgreSQL connection a consumer keeps its state in: opened lazily, reopened after a failure.

Before the first entry, `check_setup` connects and checks every table the handler writes and
the privileges it needs there, so that a missing table or grant stops the consumer at once
(exit 4, with the exact GRANT) instead of failing on each entry. While running, an error of
the database that is not the entry's fault (see `cdc.consume.failures`) is raised as what
the operator must do (`setup_error`), or, when worth retrying, drops the connection.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
from psycopg import errors as pgerrors
from psycopg.pq import TransactionStatus

from ..errors import CdcError, PrivilegeError, SourceError
from ..source.privileges import fix_for
from ..source.replication import classify_pg_error
from .failures import RETRY, SETUP, whose

__all__ = ["StateConnection", "StateTable"]

_DENIED_TABLE = re.compile(r'permission denied for (?:table|relation) "?([^"\s]+)')
_UNDEFINED_TABLE = re.compile(r'relation "([^"]+)" does not exist')

WHERE = "in the consumer's state database (--state-dsn, else postgres.dsn)"


@dataclass(frozen=True)
class StateTable:
    """A table a handler writes: its name as the handler's SQL names it, the privileges it needs
    there, and how it comes to exist (the fix when it does not)."""

    name: str
    privileges: tuple[str, ...]
    created_by: str


_OPEN = (TransactionStatus.INTRANS, TransactionStatus.INERROR)


class StateConnection:
    """Base of the handlers that write consumer state (`cdc.consume.checkpoint`, `cdc.consume.table_sink`)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn: psycopg.Connection | None = None

    def state_tables(self) -> list[StateTable]:
        """The tables this handler writes (checked by `check_setup`, named in its errors)."""
        return []

    def on_connect(self, conn: psycopg.Connection) -> None:
        """Called once per new connection (create tables, set session options)."""

    def connection(self) -> psycopg.Connection:
        if self.conn is None or self.conn.closed:
            try:
                self.conn = psycopg.connect(self.dsn, autocommit=True)
                self.on_connect(self.conn)
            except Exception as exc:
                error = self._judged(exc) if isinstance(exc, psycopg.Error) else exc  # while the role is known
                self.forget()
                if error is exc:
                    raise
                raise error from exc
        return self.conn

    def check_setup(self) -> None:
        """Connect and check that every table of `state_tables` exists with the privileges needed:
        a `SourceError`/`PrivilegeError` (exit 4) naming the fix, for all of them at once."""
        conn = self.connection()
        role = conn.info.user
        missing: list[tuple[str, str]] = []  # (what, the fix)
        grants: list[str] = []
        try:
            for table in self.state_tables():
                name = _qualified(conn, table.name)
                if name is None:
                    missing.append((f"table {table.name} does not exist", table.created_by))
                    continue
                lacking = [p for p in table.privileges
                           if not conn.execute("SELECT has_table_privilege(%s::regclass, %s)", (name, p)).fetchone()[0]]
                if lacking:
                    grants.append(f"GRANT {', '.join(lacking)} ON TABLE {name} TO {role}")
        except psycopg.Error as exc:
            error = self._judged(exc)
            self.forget()
            if error is exc:
                raise
            raise error from exc
        if missing:
            raise SourceError(f"{', '.join(what for what, _ in missing)} {WHERE}",
                              hint="; ".join(dict.fromkeys(fix for _, fix in missing)))
        if grants:
            raise PrivilegeError(f"role {role} lacks privileges the consumer needs {WHERE}",
                                 hint="run: " + "; ".join(grants))

    @contextmanager
    def transaction(self, opened: bool = False) -> Iterator[psycopg.Connection]:
        """One transaction on the state connection. An error that is not the entry's (see
        `cdc.consume.failures`) drops the connection; a setup error becomes the fix to make.

        With `opened`, the caller's own statements begin and commit it (BEGIN and COMMIT sent with its
        first and last statements: two round trips fewer); left open, it is committed at the end, and
        rolled back on any error."""
        conn = self.connection()
        try:
            if not opened:
                with conn.transaction():
                    yield conn
                return
            try:
                # as inside conn.transaction(), psycopg refuses the caller's conn.commit() and conn.rollback()
                # (they would end the transaction that must hold the caller's writes with its checkpoint)
                conn._num_transactions += 1
                try:
                    yield conn
                finally:
                    conn._num_transactions -= 1
                if conn.info.transaction_status != TransactionStatus.IDLE:
                    conn.commit()
            except BaseException:
                if not conn.closed and conn.info.transaction_status in _OPEN:
                    try:
                        conn.rollback()
                    except psycopg.Error:  # (the connection broke: dropped, the error raised is the first one)
                        self.forget()
                raise
        except psycopg.Error as exc:
            error = self._judged(exc)
            if error is exc:
                raise
            raise error from exc

    def _judged(self, exc: psycopg.Error) -> BaseException:
        """`exc` itself when it is the entry's fault or worth retrying (the connection dropped);
        the operator's fix (`setup_error`) when the setup is wrong."""
        verdict = whose(exc)
        if verdict == SETUP:
            error = self.setup_error(exc, self.conn.info.user if self.conn is not None else "")
            self.forget()
            return error
        if verdict == RETRY:
            self.forget()
        return exc

    def setup_error(self, exc: psycopg.Error, role: str = "") -> CdcError:
        """What the operator must do about a database error that no entry caused (exit 4 or 2)."""
        lines = str(exc).strip().splitlines()
        text = exc.diag.message_primary or (lines[0] if lines else type(exc).__name__)  # not the LINE/DETAIL lines
        if isinstance(exc, pgerrors.InsufficientPrivilege):
            role = role or "<role>"
            denied = _DENIED_TABLE.search(text)
            for table in self.state_tables():
                if denied and _bare(denied[1]) == _bare(table.name):
                    return PrivilegeError(f"postgres refused: {text} {WHERE}",
                                          hint=f"run: GRANT {', '.join(table.privileges)} ON TABLE {table.name} TO {role}")
            hint = fix_for(text, role, "SELECT, INSERT, UPDATE")
            if hint.startswith("run: GRANT SELECT, INSERT, UPDATE ON TABLE"):
                hint = f"grant {role} what the handler does there, e.g. {hint}"
            return PrivilegeError(f"postgres refused: {text} {WHERE}", hint=hint)
        if isinstance(exc, pgerrors.UndefinedTable):
            undefined = _UNDEFINED_TABLE.search(text)
            for table in self.state_tables():
                if undefined and _bare(undefined[1]) == _bare(table.name):
                    return SourceError(f"postgres: {text} {WHERE}", hint=table.created_by)
            return SourceError(f"postgres: {text} {WHERE}", hint="create it, or fix the handler's SQL")
        if exc.sqlstate and exc.sqlstate.startswith("42"):
            return SourceError(f"postgres refused the handler's SQL: {text} {WHERE}",
                               hint="fix the handler's SQL or the database's schema")
        error = classify_pg_error(exc)
        return error if error.hint else type(error)(f"{error.message} {WHERE}", hint="fix the state database")

    def forget(self) -> None:
        """Drop a broken connection; the next batch reconnects (its entries are still pending)."""
        if self.conn is not None:
            self.conn.close()
        self.conn = None

    def close(self) -> None:
        self.forget()


def _qualified(conn: psycopg.Connection, name: str) -> str | None:
    """`name` (resolved on the search path if not qualified) as schema.table, or None when missing."""
    row = conn.execute(
        "SELECT format('%%I.%%I', n.nspname, c.relname) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.oid = to_regclass(%s)", (name,)).fetchone()
    return row[0] if row else None


def _bare(name: str) -> str:
    return name.rpartition(".")[2].strip('"')
