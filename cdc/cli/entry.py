"""The ``cdc`` command: its parser, logging and error reporting.

Each subcommand's implementation lives with its concern (`cdc.cli.ops`,
`cdc.cli.bridge`, `cdc.cli.consume`, `cdc.cli.reconcile`) and is imported only when
that command runs: the parser is whole (for --help and the generated reference), but
`cdc run` loads neither the consumer nor the progress display nor Spark's job.

Errors the operator can fix are printed as one line (``cdc: error: ...``) with
an exit code per kind (see `cdc.errors`); logs are JSON lines on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

import orjson

from .. import redact
from .args import ABOUT, Formatter, Parser, VersionAction, group_name, number
from ..consume import defaults as c
from ..exits import RedactingFilter, report, silence_stdout
from ..demo.options import add_arguments as add_demo_arguments
from ..ops.grants import packaged_names

__all__ = ["main"]


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc"] = record.exc_text
        return orjson.dumps(entry).decode()


def _setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RedactingFilter())
    root = logging.getLogger("cdc")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def _consume_options(consume: argparse.ArgumentParser) -> None:
    """`cdc consume`'s options; each help names its default (cdc.consume.defaults holds them)."""
    consume.add_argument("--entity", required=True, action="append",
                         help="the mapping whose streams to read (all its partitions); with --transactions, "
                              "give it once per entity whose transactions the consumer sees whole")
    consume.add_argument("--group", required=True, type=group_name, help="consumer group (also names the state and checkpoints it keeps)")
    consume.add_argument("--name", help="consumer name in the group (default: host-pid); a consumer restarted under "
                                        "the same name takes its streams back at once, and a consumer on this host "
                                        "takes a default-named one's streams at once when its pid is gone")
    consume.add_argument("--start", default="$", help="where a new group starts: $ (new entries only, the default), "
                                                      "0 (the whole stream), an entry ID or an ISO-8601 time")
    consume.add_argument("--handler", help="module:function applying entries in a PostgreSQL transaction with checkpoints")
    consume.add_argument("--sink", help="schema.table to mirror the entity into, idempotently")
    consume.add_argument("--shared", action="store_true",
                         help="many consumers per stream instead of one lease holder each (only with --sink)")
    consume.add_argument("--state-dsn", help="where state and checkpoints live (default: postgres.dsn)")
    consume.add_argument("--count", type=int, default=c.COUNT, help=f"entries per batch (default {c.COUNT})")
    consume.add_argument("--lease-ttl-ms", type=int, default=c.LEASE_TTL_MS,
                         help="a stream's lease lasts this long unless renewed; another consumer takes a dead one's "
                              f"streams after it (default {c.LEASE_TTL_MS})")
    consume.add_argument("--claim-idle-ms", type=int, default=c.CLAIM_IDLE_MS,
                         help="--shared: entries a consumer left pending this long are claimed by another "
                              f"(default {c.CLAIM_IDLE_MS})")
    consume.add_argument("--max-deliveries", type=int, default=c.MAX_DELIVERIES,
                         help="an entry that failed this many deliveries goes to the dead-letter stream "
                              f"cdc:dlq:<group> (default {c.MAX_DELIVERIES})")
    consume.add_argument("--metrics-port", type=int, default=0,
                         help="serve /metrics, /healthz and /readyz on this port (default 0: not served)")
    consume.add_argument("--metrics-host", default="0.0.0.0",
                         help="the address --metrics-port listens on (default 0.0.0.0)")
    consume.add_argument("--transactions", metavar="STREAM", nargs="?", const="",
                         help="transaction mode: hand the handler one source transaction at a time, whole, in commit "
                              "order, using the END records the bridge writes to STREAM (default: the config's "
                              "transactions.stream)")
    consume.add_argument("--transaction-wait-ms", type=int, default=c.TRANSACTION_WAIT_MS,
                         help="--transactions: how long a transaction whose END record was read may stay incomplete "
                              "before the consumer stops rather than hand over part of it; entries whose END the bridge "
                              "has not written yet are waited for as long as it takes, logged once past this "
                              f"(default {c.TRANSACTION_WAIT_MS})")


class Command:
    """A subcommand's implementation, ``cmd_<name>`` of ``cdc.cli.<module>``, imported when the command runs."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name

    def __repr__(self) -> str:
        return f"<Command cdc.cli.{self.module}.{self.name}>"

    def __call__(self, args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(f"{__package__}.{self.module}"), self.name)(args)


def _command_maker(sub):
    """`command(name, module, help, ...)`: adds one subcommand with its --config, description and example;
    ``cmd_<name>`` of ``cdc.cli.<module>`` runs it."""

    def command(name: str, module: str, help: str, parent=sub, about: tuple[str, str] | None = None,
                config_default: str = "cdc.yaml", func: str | None = None) -> argparse.ArgumentParser:
        description, example = about or ABOUT[name]
        p = parent.add_parser(name, help=help, description=description, epilog=f"example:\n  {example}",
                              formatter_class=Formatter)
        p.add_argument("--config", "-c", default=config_default, help="config file (default: cdc.yaml)")
        p.set_defaults(func=Command(module, func or f"cmd_{name}"))
        return p

    return command


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, in the order --help lists it."""
    parser = Parser(prog="cdc", description="PostgreSQL logical replication to Redis Streams, exactly once.",
                    epilog="example: cdc --log-format text check --config cdc.yaml\n"
                           "exit codes: see docs/reference/exit-codes.md", formatter_class=Formatter)
    parser.add_argument("--version", action=VersionAction)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="least severe log events shown on stderr")
    parser.add_argument("--log-format", default="json", choices=["json", "text"],
                        help="json: one JSON object per line; text: for people")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    command = _command_maker(sub)
    _setup_and_stream_commands(command)
    _reading_commands(sub, command)
    _maintenance_commands(command)
    _demo_command(sub)
    return parser


def _demo_command(sub) -> None:
    """demo: the one command without a config (it writes its own)."""
    demo = sub.add_parser("demo", help="the bridge on a throwaway local PostgreSQL and Redis, with a sample writer",
                          description=ABOUT["demo"][0], epilog=f"example:\n  {ABOUT['demo'][1]}", formatter_class=Formatter)
    add_demo_arguments(demo)
    demo.set_defaults(func=Command("demo", "cmd_demo"))


def _setup_and_stream_commands(command) -> None:
    """init, recover, check, run, consume, trim."""
    command("init", "ops", "create the publication and the logical slot (idempotent)")
    command("recover", "ops", "after Redis lost data: rebuild every mapped stream to replay to its table (bridge stopped)")
    command("check", "ops", "validate the server and every mapping against the live schema")
    run = command("run", "bridge", "stream changes into Redis until SIGTERM/SIGINT")
    run.add_argument("--until-caught-up", action="store_true", help="exit once everything committed before start is in Redis")
    run.add_argument("--standby", action="store_true",
                     help="when another bridge holds the slot, wait and take over once it is free (default: exit 75 "
                          "naming the holder)")
    consume = command("consume", "consume", "run a consumer of one entity's streams")
    _consume_options(consume)
    trim = command("trim", "ops", "trim streams up to what every consumer group has consumed")
    trim.add_argument("--entity", help="only this entity's streams")
    trim.add_argument("--max-len", type=int, help="hard cap on length (drops unconsumed entries, loudly; "
                                                   "default: trim.max_len, 0: none)")
    trim.add_argument("--max-age-s", type=number, help="hard cap on age in seconds (drops unconsumed entries, "
                                                       "loudly; default: trim.max_age_s, 0: none)")


def _reading_commands(sub, command) -> None:
    """replay, read, dlq."""
    replay = command("replay", "consume", "start a group at, or rewind it to, a time or an entry ID")
    replay.add_argument("--entity", required=True, help="the mapping whose streams the group reads")
    replay.add_argument("--group", required=True, type=group_name, help="the consumer group to create or rewind")
    replay.add_argument("--from", dest="start", required=True, help="ISO-8601 time (e.g. 2026-11-21T00:00:00Z), entry ID, 0 or $")
    read = command("read", "consume", "print an entity's entries in a time or ID range as JSON lines")
    read.add_argument("--entity", required=True, help="the mapping whose streams to read")
    read.add_argument("--from", dest="start", help="ISO-8601 time or entry ID (default: the beginning)")
    read.add_argument("--to", dest="end", help="ISO-8601 time or entry ID, inclusive (default: the end)")
    read.add_argument("--limit", type=int, default=0, help="stop after this many entries (0: no limit)")
    dlq = sub.add_parser("dlq", help="list, show or replay a group's dead letters", description=ABOUT["dlq"][0],
                         epilog=f"example:\n  {ABOUT['dlq'][1]}", formatter_class=Formatter)
    # --config is accepted before the action (cdc dlq --config F list) and after it (cdc dlq list --config F)
    dlq.add_argument("--config", "-c", default="cdc.yaml", help="config file (default: cdc.yaml)")
    actions = dlq.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=Parser)
    for action, text, ids_help, example in (
        ("list", "list the group's dead letters", None, "cdc dlq list --config cdc.yaml --group billing"),
        ("show", "print dead letters as JSON", "dead-letter IDs", "cdc dlq show --config cdc.yaml --group billing 1795394575651-0"),
        ("replay", "send dead letters back to their stream, for this group only", "dead-letter IDs (default: all)",
         "cdc dlq replay --config cdc.yaml --group billing 1795394575651-0"),
    ):
        p = command(action, "consume", text, parent=actions, about=(f"{ABOUT['dlq'][0]} {action}: {text}.", example),
                    config_default=argparse.SUPPRESS, func="cmd_dlq")
        p.add_argument("--group", required=True, type=group_name, help="the consumer group")
        if ids_help:
            p.add_argument("ids", nargs="+" if action == "show" else "*", help=ids_help)
        else:
            p.set_defaults(ids=[])


def _maintenance_commands(command) -> None:
    """backfill, schema, reconcile, sql, status."""
    backfill = command("backfill", "bridge", "re-publish an entity's table (op r) while streaming continues")
    backfill.add_argument("--entity", help="the entity to re-publish")
    backfill.add_argument("--where", help="a condition on the table's columns selecting part of it "
                                          "(a small SQL subset: docs/how-to/snapshots-and-backfills.md)")
    backfill.add_argument("--wait", action="store_true", help="show progress until every chunk is read")
    backfill.add_argument("--watch", action="store_true", help="follow the snapshots and backfills in progress")
    schema = command("schema", "ops", "print a JSON Schema per entity")
    schema.add_argument("--entity", help="only this entity")
    reconcile = command("reconcile", "reconcile", "recompute consumer state with Spark and reset it exactly")
    reconcile.add_argument("--spec", action="append", help="only this spec (by name; repeatable)")
    reconcile.add_argument("--dry-run", action="store_true", help="report drift, change nothing")
    reconcile.add_argument("--master", help="Spark master URL (default: reconcile.master, local[*])")
    reconcile.add_argument("--json", action="store_true", help="print the report as JSON")
    reconcile.add_argument("--report", help="also write the JSON report to this file")
    reconcile.add_argument("--metrics-file", help="also write the run's outcome as Prometheus metrics to this file "
                                                  "(node_exporter's textfile format; name it *.prom)")
    sql = command("sql", "ops", "print the role and grants the bridge needs, or a packaged SQL file")
    sql.add_argument("--role", default="cdc_bridge", help="the bridge's role: created, and granted to")
    sql.add_argument("--file", choices=packaged_names(),
                     help="print this packaged SQL file instead (20_consumer_state.sql: the consumers' checkpoints "
                          "and reconciliation history; 10_rocket_rides.sql: the demo's schema)")
    status = command("status", "ops", "show the slot, lag and streams")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--stale-after-s", type=number, default=3600.0, help="list consumers idle this long as stale")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every way it can end is an exit code from `cdc.exits` (never a traceback)."""
    for name, value in os.environ.items():  # secrets given by environment: hidden from every message
        if name.startswith("CDC_") and name.endswith(("_DSN", "_URL")):
            redact.register(value)
    redact.register_password(os.environ.get("PGPASSWORD"))  # libpq's, and the JDBC reads of cdc reconcile
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # --help, --version
            return exc.code if isinstance(exc.code, int) else 0
        _setup_logging(args.log_level, args.log_format)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        silence_stdout()  # the reader went away (| head): what it read is what it wanted
        return 0
    except Exception as exc:
        return report(exc)


if __name__ == "__main__":
    sys.exit(main())
