"""The command line's grammar: a parser whose mistakes are `UsageError`s, help with
defaults and an example per command, and checks of option values.
"""

from __future__ import annotations

import argparse
import math
import re

from ..errors import UsageError

__all__ = ["ABOUT", "Formatter", "Parser", "VersionAction", "check_position", "check_positive", "number", "version"]

#: per command: what it does (its --help description) and one example (its epilog)
ABOUT: dict[str, tuple[str, str]] = {
    "init": ("Create the publication for the mapped tables, the pgoutput slot and the cdc_backfills table, queue "
             "initial snapshots and register the Redis. Safe to run again. Run it as the mapped tables' owner.",
             "cdc init --config cdc.yaml"),
    "check": ("The complete preflight: the server (wal_level, publication, slot), the role's privileges, every "
              "mapping against the live schema, Redis (reachable, ACL, persistence, eviction). Reports every "
              "problem at once; the exit code is that of the first kind of problem (see docs/reference/exit-codes.md).",
              "cdc check --config cdc.yaml"),
    "run": ("Stream committed changes into Redis until SIGTERM/SIGINT/SIGHUP, then finish the batch in flight and exit 0 "
                "(configuration and mappings are read at start only: SIGHUP stops, start it again to apply changes).",
            "cdc run --config cdc.yaml"),
    "consume": ("Run a consumer of one entity's streams, exactly once: a transactional handler with checkpoints "
                "(--handler) or an idempotent table mirror (--sink). With --transactions, of several entities' "
                "streams, one whole source transaction at a time, in commit order.",
                "cdc consume --config cdc.yaml --entity ride --group totals-a --start 0 "
                "--handler cdc.demo.rocketrides:ride_totals"),
    "trim": ("Trim each stream up to the oldest entry any consumer group still needs; optional hard caps "
             "drop unconsumed entries, loudly.",
             "cdc trim --config cdc.yaml --entity ride"),
    "recover": ("After Redis lost data: rebuild every mapped stream (deletes for vanished keys, a rebuilt marker "
                "op x, then every row as op r) so that replaying it gives exactly its table. The bridge must be "
                "stopped.",
                "cdc recover --config cdc.yaml"),
    "replay": ("Create a consumer group at, or rewind it to, a time or an entry ID (XGROUP SETID).",
               "cdc replay --config cdc.yaml --entity ride --group audit --from 2026-11-21T00:00:00Z"),
    "read": ("Print an entity's entries between two times or entry IDs (inclusive) as JSON lines.",
             "cdc read --config cdc.yaml --entity ride --from 2026-11-21T09:00:00Z --to 2026-11-21T10:00:00Z"),
    "dlq": ("List, show or replay a consumer group's dead letters (cdc:dlq:<group>).",
            "cdc dlq show --config cdc.yaml --group billing 1795394575651-0"),
    "backfill": ("Re-publish an entity's table, or the rows --where selects, as op r while streaming goes on; "
                 "the running bridge (cdc run) does the work.",
                 "cdc backfill --config cdc.yaml --entity ride --where \"created_at > now() - interval '1 day'\" --wait"),
    "schema": ("Print a JSON Schema (draft 2020-12) per entity, with column types read from the live database.",
               "cdc schema --config cdc.yaml --entity ride"),
    "reconcile": ("Recompute consumer state from the canonical tables with Spark, report drift and reset it exactly.",
                  "cdc reconcile --config cdc.yaml --dry-run"),
    "demo": ("Start a throwaway PostgreSQL and Redis on loopback ports (their files in --root, kept between runs), "
             "the sample rocket-rides tables, mappings and writer, and the bridge; print each stream entry as it "
             "arrives, until Ctrl-C. Needs PostgreSQL's server (Debian's postgresql-15, or pip install "
             "'pg-redis-cdc[demo]') and redis-server; needs no checkout and no config.",
             "cdc demo --root /tmp/cdc-demo --seconds 60"),
    "sql": ("Print the SQL that gives the bridge's role least privilege (docs/how-to/least-privilege.md): the role "
            "(LOGIN REPLICATION), the snapshot and backfill bookkeeping table, and the grants on the tables the "
            "config's mappings name; apply it as a superuser before cdc init. With --file, one of the SQL files the "
            "package carries instead (the consumers' tables, the demo's schema). Connects to nothing.",
            "cdc sql --config cdc.yaml --role cdc_bridge > cdc-grants.sql"),
    "status": ("Show the slot (lag, retained WAL), each stream, the consumer groups, backfills and reconciliations.",
               "cdc status --config cdc.yaml --json"),
}


def version() -> str:
    """The package's version (cdc.__version__, which the build reads too): right in a checkout as in a wheel, and
    never another distribution's (PyPI's "cdc" is another project; this one is pg-redis-cdc)."""
    from .. import __version__

    return __version__


class VersionAction(argparse._VersionAction):
    """``--version``, reading the installed version only when asked."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        self.version = f"cdc {version()}"
        super().__call__(parser, namespace, values, option_string)


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the example's line breaks and states every option's default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default not in (None, False, argparse.SUPPRESS) and "default" not in text
                and action.option_strings and action.nargs != 0):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """An argument parser whose mistakes end as one `cdc: error:` line (exit 2), never a usage dump."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}", hint=f"see {self.prog} --help")


def number(text: str) -> float:
    """An option's number of seconds: finite (``nan`` or ``inf`` would pass every later comparison)."""
    value = float(text)  # a ValueError: argparse says "invalid number value: 'abc'"
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def group_name(text: str) -> str:
    """A consumer group name (`cdc.keys.group_problem`)."""
    from ..keys import group_problem

    problem = group_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


_POSITION = re.compile(r"^(\$|\d+|\d+-\d+)$")


def check_position(value: str | None, option: str) -> None:
    """`value` is '$', '0', an entry ID, epoch milliseconds or an ISO-8601 time with a zone."""
    from ..sink.entry import stream_id_for

    if value is None or value in ("-", "+"):
        return
    if value.strip().replace("-", "").isdigit() and not _POSITION.match(value.strip()):
        raise UsageError(f"{option} {value!r} is not an entry ID", hint="an entry ID is MS or MS-SEQ, e.g. 1795394575651-0")
    try:
        stream_id_for(value)
    except ValueError as exc:
        raise UsageError(f"{option}: {exc}", hint="for example 0, $, 1795394575651-0 or 2026-11-21T09:00:00Z") from None


def check_positive(args: argparse.Namespace, *names: str, allow_zero: bool = False) -> None:
    """Each named numeric option is > 0 (or >= 0)."""
    for name in names:
        value = getattr(args, name, None)
        if value is None:
            continue
        if value < 0 or (value == 0 and not allow_zero):
            option = "--" + name.replace("_", "-")
            bound = "0 or more" if allow_zero else "more than 0"
            raise UsageError(f"{option} must be {bound}, got {value}")
