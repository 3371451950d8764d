"""`cdc sql`: the SQL the package carries (``cdc/sql/``), and the least-privilege SQL for a deployment.

`least_privilege` writes what docs/how-to/least-privilege.md has an operator apply before `cdc init`: the
bridge's role (LOGIN REPLICATION, no password), the snapshot and backfill bookkeeping table (as
``25_backfills.sql``), and the grants `cdc run`, `cdc check`, `cdc backfill`, `cdc status` and `cdc trim` need,
on the tables the mappings name (``30_grants.sql`` grants the same on the demo's tables). Pure: no connection.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from ..errors import UsageError

__all__ = ["SQL_DIR", "least_privilege", "packaged", "packaged_names"]

#: the SQL files the package carries: role, the demo's schema, consumer state, backfill bookkeeping, grants
SQL_DIR = Path(__file__).resolve().parent.parent / "sql"

_PLAIN = re.compile(r"[a-z_][a-z0-9_$]*")


def packaged_names() -> list[str]:
    """The names of the packaged SQL files, in the order they are applied."""
    return sorted(p.name for p in SQL_DIR.glob("*.sql"))


def packaged(name: str) -> str:
    """One packaged SQL file's text, by its name (with or without ``.sql``)."""
    name = name if name.endswith(".sql") else f"{name}.sql"
    if name not in packaged_names():
        raise UsageError(f"--file: no packaged SQL file {name!r}", hint=f"files: {', '.join(packaged_names())}")
    return (SQL_DIR / name).read_text()


def ident(name: str) -> str:
    """`name` as an SQL identifier: as it is when PostgreSQL would read it unchanged, else double-quoted."""
    return name if _PLAIN.fullmatch(name) else '"' + name.replace('"', '""') + '"'


def literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def check_role(name: str) -> str:
    """A role name `cdc sql --role` accepts: 1 to 63 bytes (PostgreSQL's limit), no control character."""
    if not name or len(name.encode()) > 63 or any(c < " " for c in name):  # a line break would end an SQL comment
        raise UsageError(f"--role: {name!r} is not a role name PostgreSQL accepts",
                         hint="give 1 to 63 characters, no control character, e.g. --role cdc_bridge")
    return name


def least_privilege(tables: Iterable[tuple[str, str]], role: str = "cdc_bridge") -> str:
    """The SQL giving `role` what the bridge needs on the mapped `tables` ((schema, table) pairs), and nothing more."""
    role = check_role(role)
    who, named = ident(role), literal(role)
    ordered = sorted(set(tables))
    schemas = sorted({schema for schema, _ in ordered} | {"public"})
    backfills = packaged("25_backfills.sql")
    lines = [
        f"-- Least privilege for the bridge's role {role} (docs/how-to/least-privilege.md), written by cdc sql.",
        "-- Apply it as a superuser, before `cdc init` (which runs as the mapped tables' owner);",
        f"-- `cdc run`, `cdc check`, `cdc backfill`, `cdc status` and `cdc trim` then run as {role}.",
        "",
        "-- the role: LOGIN REPLICATION, nothing else; give it a password (ALTER ROLE ... PASSWORD) or a certificate",
        "DO $$",
        "BEGIN",
        f"    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = {named}) THEN",
        f"        CREATE ROLE {who} WITH LOGIN REPLICATION;",
        "    END IF;",
        "END",
        "$$;",
        "",
        backfills.rstrip("\n"),
        "",
        "-- read the mapped tables (the publication's checks, snapshots, backfills, cdc check)",
        *(f"GRANT USAGE ON SCHEMA {ident(schema)} TO {who};" for schema in schemas),
    ]
    if ordered:
        lines.append(f"GRANT SELECT ON {', '.join(f'{ident(s)}.{ident(t)}' for s, t in ordered)} TO {who};")
    else:
        lines.append("-- (the mappings name no table: nothing to read)")
    lines += [
        "-- snapshots and backfills: `cdc backfill` queues (INSERT), `cdc run` reads and records progress (SELECT, UPDATE),",
        "-- `cdc status` shows it",
        f"GRANT SELECT, INSERT, UPDATE ON public.cdc_backfills TO {who};",
        f"GRANT USAGE ON SEQUENCE public.cdc_backfills_id_seq TO {who};",
        "-- `cdc status` shows each consumer's last reconciliation when the consumers' tables are in this database",
        "-- (cdc sql --file 20_consumer_state.sql creates them)",
        "DO $$",
        "BEGIN",
        "    IF to_regclass('public.cdc_reconcile_runs') IS NOT NULL THEN",
        f"        GRANT SELECT ON public.cdc_reconcile_runs TO {who};",
        "    END IF;",
        "END",
        "$$;",
    ]
    return "\n".join(lines) + "\n"
