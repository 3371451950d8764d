"""The operator subcommands: `cdc init`, `cdc check`, `cdc schema`, `cdc sql`, `cdc status`, `cdc trim`, `cdc recover`."""

from __future__ import annotations

import argparse
import sys

import orjson

from .. import redact
from .args import check_positive
from ..sink.redisconn import redis_for
from .common import entity_named, load_config
from ..errors import SlotError, UsageError

__all__ = ["cmd_init", "cmd_check", "cmd_schema", "cmd_sql", "cmd_status", "cmd_trim", "cmd_recover"]


def cmd_init(args: argparse.Namespace) -> int:
    from ..ops.admin import init

    settings, mappings = load_config(args)
    for line in init(settings, mappings):
        print(redact.redact(line))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from ..ops.preflight import check

    settings, mappings = load_config(args)
    report = check(settings, mappings)
    for line in report.ok:
        print(redact.redact(f"ok: {line}"))
    for line in report.warnings:
        print(redact.redact(f"warning: {line}"), file=sys.stderr)
    for problem in report.problems:
        print(redact.redact(f"problem: {problem}"), file=sys.stderr)
    if report.problems:
        print(f"cdc check: {len(report.problems)} problem(s)", file=sys.stderr)
        return report.exit_code
    print(f"cdc check: {len(mappings)} mapping(s) valid")
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    from ..ops.grants import check_role, least_privilege, packaged

    check_role(args.role)
    if args.file:
        sys.stdout.write(packaged(args.file))
        return 0
    _, mappings = load_config(args)
    sys.stdout.write(least_privilege((m.table for m in mappings if m.table), args.role))
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from ..ops.admin import json_schemas

    settings, mappings = load_config(args)
    if args.entity is not None:
        mappings = [entity_named(mappings, args.entity)]
    schemas = json_schemas(settings, mappings)
    if args.entity is not None:
        if args.entity not in schemas:
            raise UsageError(f"--entity: no entity {args.entity!r}", hint=f"entities: {', '.join(schemas)}")
        schemas = schemas[args.entity]
    sys.stdout.write(orjson.dumps(schemas, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import shutil

    from ..ops.status import collect
    from ..ops.status_view import render

    check_positive(args, "stale_after_s")
    settings, mappings = load_config(args)
    status = collect(settings, mappings, args.stale_after_s)
    if args.json:
        sys.stdout.write(redact.redact(orjson.dumps(status, option=orjson.OPT_INDENT_2).decode()) + "\n")
    else:
        terminal = sys.stdout.isatty()  # errors recorded by others (a backfill's, the slot's) may quote a secret
        sys.stdout.write(redact.redact(render(status, color=terminal,
                                              width=shutil.get_terminal_size().columns if terminal else None)))
    alarm = status.get("slot_alarm")
    if alarm:  # a missing or invalidated slot: shown above, and the exit code says it (4)
        sys.stdout.flush()
        raise SlotError(alarm["error"], hint=alarm["fix"])
    return 0


def cmd_trim(args: argparse.Namespace) -> int:
    from ..sink.trim import TrimPolicy, trim_mapped

    check_positive(args, "max_len", "max_age_s", allow_zero=True)
    settings, mappings = load_config(args)
    if args.entity is not None:
        entity_named(mappings, args.entity)
    policy = TrimPolicy(
        max_len=settings.trim.max_len if args.max_len is None else args.max_len,
        max_age_s=settings.trim.max_age_s if args.max_age_s is None else args.max_age_s,
    )
    with redis_for(settings) as client:
        for r in trim_mapped(client, mappings, policy, args.entity, also=[settings.transactions.stream]):
            note = f", {r.forced} UNCONSUMED entries dropped by the hard cap" if r.forced else ""
            where = f"kept from {r.safe_point}" if r.safe_point else "no consumer group: kept"
            print(f"{r.stream}: trimmed {r.trimmed} ({where}){note}")
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    from ..ops.recover import recover

    settings, mappings = load_config(args)
    recover(settings, mappings, lambda line: print(line, flush=True))
    return 0
