"""What to run when PostgreSQL refuses a privilege (pure: server message in, the fix out).

PostgreSQL names the object it refused ("permission denied for table rides"), not the
privilege, so the caller says what it was doing (`need`): the fix is then the exact
GRANT, or who must run the command instead.
"""

from __future__ import annotations

import re

__all__ = ["BACKFILL_GRANTS", "fix_for"]

#: what the bridge's role needs on the snapshot/backfill bookkeeping (cdc sql, cdc/ops/grants.py)
BACKFILL_GRANTS = (
    "GRANT SELECT, INSERT, UPDATE ON public.cdc_backfills TO {role}; "
    "GRANT USAGE ON SEQUENCE public.cdc_backfills_id_seq TO {role}"
)

_DENIED = re.compile(r'permission denied for (?P<kind>table|sequence|schema|database|function|relation) "?(?P<name>[^"\s]+)"?')
_OWNER = re.compile(r'must be owner of (?P<kind>table|relation|publication|database|schema) "?(?P<name>[^"\s]+)"?')


def fix_for(message: str, role: str, need: str = "SELECT") -> str:
    """The hint for an operator: "run: <the GRANT>", or which role must run the command."""
    role = role or "<role>"
    if m := _OWNER.search(message):
        return (f"run cdc init as the owner of {m['kind']} {m['name']} and of the mapped tables (a publication "
                f"needs ownership); {role} runs cdc run, cdc check, cdc backfill, cdc status and cdc trim")
    if any(text in message for text in ("superuser or replication role", "start WAL sender", "replication slots")):
        return f"run: ALTER ROLE {role} REPLICATION"
    m = _DENIED.search(message)
    if m is None:
        return f"grant {role} what cdc sql --role {role} prints"
    return "run: " + _grant(m["kind"], m["name"], role, need)


def _grant(kind: str, name: str, role: str, need: str) -> str:
    if kind in ("table", "relation") and name.endswith("cdc_backfills"):
        return BACKFILL_GRANTS.format(role=role)
    if kind == "sequence" and name.endswith("cdc_backfills_id_seq"):
        return BACKFILL_GRANTS.format(role=role)
    if kind in ("table", "relation"):
        return f"GRANT {need} ON TABLE {name} TO {role}"
    if kind == "sequence":
        return f"GRANT USAGE ON SEQUENCE {name} TO {role}"
    if kind == "schema":
        if need == "CREATE":
            return f"GRANT CREATE ON SCHEMA {name} TO {role}"
        return f"GRANT USAGE ON SCHEMA {name} TO {role}"
    if kind == "database":
        return f"GRANT CREATE ON DATABASE {name} TO {role}"
    return f"GRANT EXECUTE ON FUNCTION {name} TO {role}"
