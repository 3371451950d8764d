"""The ``cdc`` command: init, check, run, schema, status.

Errors the operator can fix are printed as one line (``cdc: error: ...``) with
an exit code per kind (see `cdc.errors`); logs are JSON lines on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import orjson

from . import redact
from .cliargs import ABOUT, Formatter, Parser, check_position, check_positive, version
from .errors import PublishError, TransientError, UsageError
from .exits import RedactingFilter, report, silence_stdout
from .loader import load_callable
from .sink.redisconn import connect_redis

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


def _load(args: argparse.Namespace):
    from .config import Settings
    from .mapping.model import load_mappings

    settings = Settings.from_file(args.config)
    for secret in (settings.postgres.dsn, settings.redis.url, settings.reconcile.state_dsn):
        redact.register(secret)
    return settings, load_mappings(settings.mappings)


def cmd_init(args: argparse.Namespace) -> int:
    from .ops.admin import init

    settings, mappings = _load(args)
    for line in init(settings, mappings):
        print(line)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from .ops.preflight import check

    settings, mappings = _load(args)
    report = check(settings, mappings)
    for line in report.ok:
        print(f"ok: {line}")
    for line in report.warnings:
        print(redact.redact(f"warning: {line}"), file=sys.stderr)
    for problem in report.problems:
        print(redact.redact(f"problem: {problem}"), file=sys.stderr)
    if report.problems:
        print(f"cdc check: {len(report.problems)} problem(s)", file=sys.stderr)
        return report.exit_code
    print(f"cdc check: {len(mappings)} mapping(s) valid")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from .bridge.loop import Bridge

    settings, mappings = _load(args)
    bridge = Bridge(settings, mappings, until_caught_up=args.until_caught_up)
    log = logging.getLogger("cdc.bridge.loop")

    def on_signal(signum, frame):  # noqa: ARG001
        log.info("received %s, finishing the batch", signal.Signals(signum).name)
        bridge.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    started = time.monotonic()
    log.info("bridge starting slot=%s entities=%s", settings.postgres.slot, ",".join(m.entity for m in mappings))
    bridge.run()
    log.info(
        "bridge stopped entries_published=%d transactions=%d durable_lsn=%s seconds=%.1f",
        bridge.entries_published, bridge.transactions, bridge.durable_lsn, time.monotonic() - started,
    )
    return 0


def _entity(mappings, name: str):
    for m in mappings:
        if m.entity == name:
            return m
    raise UsageError(f"--entity: no entity {name!r}", hint=f"entities: {', '.join(m.entity for m in mappings)}")


@contextlib.contextmanager
def _redis(settings):
    """A Redis client for a command; an unreachable Redis becomes one clear line."""
    import redis

    client = connect_redis(settings.redis)
    try:
        yield client
    except redis.AuthenticationError as exc:  # a ConnectionError to redis-py, but retrying will not fix it
        raise PublishError(f"redis refused the login: {exc}", hint="check the user and password in redis.url") from exc
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise TransientError(f"redis unavailable: {exc}") from exc
    except redis.RedisError as exc:
        raise PublishError(f"redis refused: {exc}", hint="check the redis user's ACL and the keys it may use") from exc
    finally:
        client.close()


def cmd_consume(args: argparse.Namespace) -> int:
    import threading

    import psycopg
    import redis

    from .consume.consumer import Consumer

    check_position(args.start, "--start")
    check_positive(args, "count", "claim_idle_ms", "max_deliveries", "lease_ttl_ms")
    redact.register(args.state_dsn)
    if args.state_dsn is not None:
        from .config import check_dsn

        check_dsn(args.state_dsn, "--state-dsn")
    settings, mappings = _load(args)
    mapping = _entity(mappings, args.entity)
    if bool(args.handler) == bool(args.sink):
        raise UsageError("give exactly one of --handler module:function or --sink schema.table")
    if args.shared and args.handler:
        raise UsageError("--shared needs --sink: ordered, transactional state needs one consumer per stream")
    if args.sink is not None and not all(part.strip() for part in args.sink.split(".", 1)):
        raise UsageError(f"--sink {args.sink!r} is not a table name", hint="write it as schema.table, e.g. public.ride_mirror")
    state_dsn = args.state_dsn or settings.postgres.dsn
    log = logging.getLogger("cdc.consume.consumer")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with _redis(settings) as client:
        consumer = Consumer(
            client, mapping.stream_keys(), args.group, args.name, exclusive=not args.shared, count=args.count,
            claim_idle_ms=args.claim_idle_ms, max_deliveries=args.max_deliveries, lease_ttl_ms=args.lease_ttl_ms,
        )
        if args.handler:
            from .consume.checkpoint import TransactionalHandler

            handler = TransactionalHandler(
                state_dsn, args.group, load_callable(args.handler), epoch_of=consumer.epoch,
                crash_before_commit=float(os.environ.get("CDC_FAULT_CRASH_BEFORE_COMMIT", 0)),
            )
        else:
            from .consume.table_sink import TableSink

            handler = TableSink(state_dsn, args.sink)
        delay = 0.2
        try:
            while not stop.is_set():
                try:
                    consumer.create_group(args.start)
                    consumer.run(handler, stop)
                except (redis.ConnectionError, redis.TimeoutError, psycopg.OperationalError) as exc:
                    # a server restarting: what was not acknowledged comes back; retry with backoff
                    log.warning("transient failure, retrying in %.1fs: %s", delay, exc)
                    stop.wait(delay)
                    delay = min(delay * 2, 5.0)
        finally:
            handler.close()
            log.info("consumer stopped %r %r", consumer, handler)
    return 0


def cmd_trim(args: argparse.Namespace) -> int:
    from .sink.trim import TrimPolicy, trim_mapped

    check_positive(args, "max_len", "max_age_s", allow_zero=True)
    settings, mappings = _load(args)
    if args.entity is not None:
        _entity(mappings, args.entity)
    policy = TrimPolicy(
        max_len=settings.trim.max_len if args.max_len is None else args.max_len,
        max_age_s=settings.trim.max_age_s if args.max_age_s is None else args.max_age_s,
    )
    with _redis(settings) as client:
        for r in trim_mapped(client, mappings, policy, args.entity):
            note = f", {r.forced} UNCONSUMED entries dropped by the hard cap" if r.forced else ""
            where = f"kept from {r.safe_point}" if r.safe_point else "no consumer group: kept"
            print(f"{r.stream}: trimmed {r.trimmed} ({where}){note}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from .consume.replay import replay_group

    check_position(args.start, "--from")
    settings, mappings = _load(args)
    with _redis(settings) as client:
        try:
            for line in replay_group(client, _entity(mappings, args.entity).stream_keys(), args.group, args.start):
                print(line)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return 0


def cmd_read(args: argparse.Namespace) -> int:
    from .consume.replay import range_bound, read_range

    check_position(args.start, "--from")
    check_position(args.end, "--to")
    check_positive(args, "limit", allow_zero=True)
    settings, mappings = _load(args)
    try:
        start, end = range_bound(args.start, "-"), range_bound(args.end, "+")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with _redis(settings) as client:
        shown = 0
        for stream in _entity(mappings, args.entity).stream_keys():
            for e in read_range(client, stream, start, end):
                row = {"stream": e.stream, "id": e.id, **{k.decode(): v.decode() for k, v in e.fields.items()}}
                for name in ("key", "data", "before", "unchanged"):
                    if name in row:  # parsed already by read_range
                        row[name] = getattr(e, name)
                sys.stdout.write(orjson.dumps(row).decode() + "\n")
                shown += 1
                if args.limit and shown >= args.limit:
                    return 0
    return 0


def cmd_dlq(args: argparse.Namespace) -> int:
    from .consume.replay import dead_letters, replay_dead_letters

    settings, _ = _load(args)
    with _redis(settings) as client:
        if args.action == "list":
            rows = dead_letters(client, args.group)
            for row in rows:
                print(f"{row['id']}  {row['source_stream']} {row['source_id']}  deliveries={row['deliveries']}  {row['error']}")
            print(f"{len(rows)} dead letter(s) for group {args.group}")
        elif args.action == "show":
            rows = [r for r in dead_letters(client, args.group) if r["id"] in args.ids]
            if not rows:
                raise UsageError(f"no dead letter {', '.join(args.ids)} for group {args.group}",
                                 hint=f"cdc dlq list --group {args.group} shows them")
            for row in rows:
                if "entry" in row:
                    row["entry"] = orjson.loads(row["entry"])
                sys.stdout.write(orjson.dumps(row, option=orjson.OPT_INDENT_2).decode() + "\n")
        else:
            known = {r["id"] for r in dead_letters(client, args.group)}
            unknown = [i for i in args.ids if i not in known]
            if unknown:
                raise UsageError(f"no dead letter {', '.join(unknown)} for group {args.group}",
                                 hint=f"cdc dlq list --group {args.group} shows them")
            for line in replay_dead_letters(client, args.group, args.ids):
                print(line)
    return 0


def cmd_backfill(args: argparse.Namespace) -> int:
    from .ops.admin import connect
    from .bridge.backfill import enqueue, ensure_table

    settings, mappings = _load(args)
    with connect(settings) as conn:
        ensure_table(conn)
        if args.entity is not None:
            mapping = _entity(mappings, args.entity)
            backfill_id = enqueue(conn, settings.postgres.slot, mapping, args.where)
            print(f"backfill {backfill_id} of {mapping.entity} queued; the running bridge (cdc run) publishes it as op r")
            ids = [backfill_id]
        elif args.watch:
            ids = [r[0] for r in conn.execute(
                "SELECT id FROM cdc_backfills WHERE slot = %s AND status IN ('pending', 'running') ORDER BY id",
                (settings.postgres.slot,),
            )]
            if not ids:
                print("no snapshot or backfill in progress")
        else:
            raise UsageError("give --entity to queue a backfill, or --watch to follow the ones in progress")
        if args.wait or args.watch:
            for backfill_id in ids:
                _follow(conn, backfill_id)
    return 0


def _follow(conn, backfill_id: int) -> None:
    """Draw one backfill's progress until every chunk is read."""
    started = time.monotonic()
    first = None
    while True:
        entity, status, done, total = conn.execute(
            "SELECT entity, status, rows_done, rows_total FROM cdc_backfills WHERE id = %s", (backfill_id,)
        ).fetchone()
        first = done if first is None else first
        _progress(entity, done, total or 0, time.monotonic() - started, done - first)
        if status in ("done", "cancelled"):
            break
        time.sleep(0.2)  # polling the progress row: the work happens in the bridge
    sys.stderr.write("\n")
    print(f"backfill {backfill_id}: {status}, {done} row(s) read")


def _progress(what: str, done: int, total: int, elapsed: float, since_start: int | None = None,
              unit: str = "rows") -> None:
    """One progress line (bar, count, rate, ETA), redrawn in place on a terminal."""
    moved = done if since_start is None else since_start
    rate = moved / elapsed if elapsed > 0 else 0.0
    share = min(1.0, done / total) if total else 1.0
    eta = f"{(total - done) / rate:.0f}s" if rate and total > done else "-"
    bar = "#" * int(share * 30)
    line = f"{what}: [{bar:<30}] {done}/{total} {unit}, {rate:,.0f} {unit}/s, ETA {eta}"
    sys.stderr.write(("\r" + line) if sys.stderr.isatty() else (line + "\n"))
    sys.stderr.flush()


def cmd_schema(args: argparse.Namespace) -> int:
    from .ops.admin import json_schemas

    settings, mappings = _load(args)
    if args.entity is not None:
        mappings = [_entity(mappings, args.entity)]
    schemas = json_schemas(settings, mappings)
    if args.entity is not None:
        if args.entity not in schemas:
            raise UsageError(f"--entity: no entity {args.entity!r}", hint=f"entities: {', '.join(schemas)}")
        schemas = schemas[args.entity]
    sys.stdout.write(orjson.dumps(schemas, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


def cmd_reconcile(args: argparse.Namespace) -> int:
    import dataclasses

    from .reconcile.drift import render_table
    from .reconcile.job import describe, preflight, reconcile_spec
    from .reconcile.spec import load_specs
    from .reconcile.truth import start_spark

    if args.report and not Path(args.report).resolve().parent.is_dir():
        raise UsageError(f"--report {args.report}: folder {Path(args.report).resolve().parent} does not exist",
                         hint="give a file in an existing folder")  # checked before Spark spends minutes
    settings, mappings = _load(args)
    if args.master:
        settings = dataclasses.replace(settings, reconcile=dataclasses.replace(settings.reconcile, master=args.master))
    specs = load_specs(Path(settings.reconcile.specs))
    if args.spec:
        specs = [s for s in specs if s.name in args.spec]
        if not specs:
            raise UsageError(f"--spec: no spec named {', '.join(args.spec)}",
                             hint=f"specs: {', '.join(s.name for s in load_specs(Path(settings.reconcile.specs)))}")

    targets = [preflight(settings, mappings, spec) for spec in specs]  # mistakes show before Spark starts

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    say(f"starting Spark ({settings.reconcile.master})")
    spark = start_spark(settings.reconcile.master, settings.reconcile.jdbc_jar, settings.reconcile.driver_memory)
    results = []
    try:
        for spec, spec_targets in zip(specs, targets):
            started = time.monotonic()
            results.append(reconcile_spec(
                settings, spec, spec_targets, spark, dry_run=args.dry_run, say=say,
                progress=lambda done, total, spec=spec, t=started: _progress(
                    f"{spec.name}: reading", done, total, time.monotonic() - t, unit="tasks"),
            ))
    finally:
        spark.stop()
    report = [r.as_json(args.dry_run) for r in results]
    if args.report:
        Path(args.report).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    if args.json:
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        for r in results:
            print(f"{r.spec.name}: position {r.position}, {r.source_rows} source rows, {r.truth_keys} keys, "
                  f"read {r.read_seconds:.1f}s, total {r.seconds:.1f}s")
            for o in r.outcomes:
                print(f"  {o.consumer}: {describe(o)}")
                if not o.drift.clean:
                    print("    " + render_table(o.drift, r.spec.key_columns).replace("\n", "\n    "))
    unrepaired = [o.consumer for r in results for o in r.outcomes if o.unrepaired]
    if unrepaired:
        print(f"drift left unrepaired in: {', '.join(unrepaired)}", file=sys.stderr)
        return 7
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from .ops.status import collect, render

    settings, mappings = _load(args)
    status = collect(settings, mappings)
    if args.json:
        sys.stdout.write(orjson.dumps(status, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(render(status))
    return 0


def build_parser() -> argparse.ArgumentParser:
    # One flat declaration of the whole command line, read top to bottom: long, but splitting it
    # would scatter each command's options away from its siblings'.
    parser = Parser(prog="cdc", description="PostgreSQL logical replication to Redis Streams, exactly once.",
                    epilog="example: cdc --log-format text check --config cdc.yaml\n"
                           "exit codes: see the README, section \"Exit codes\"", formatter_class=Formatter)
    parser.add_argument("--version", action="version", version=f"cdc {version()}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="least severe log events shown on stderr")
    parser.add_argument("--log-format", default="json", choices=["json", "text"],
                        help="json: one JSON object per line; text: for people")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    def command(name: str, func, help: str, parent=sub, about: tuple[str, str] | None = None,
                config_default: str = "cdc.yaml") -> argparse.ArgumentParser:
        description, example = about or ABOUT[name]
        p = parent.add_parser(name, help=help, description=description, epilog=f"example:\n  {example}",
                              formatter_class=Formatter)
        p.add_argument("--config", "-c", default=config_default, help="config file (default: cdc.yaml)")
        p.set_defaults(func=func)
        return p

    command("init", cmd_init, "create the publication and the logical slot (idempotent)")
    command("check", cmd_check, "validate the server and every mapping against the live schema")
    run = command("run", cmd_run, "stream changes into Redis until SIGTERM/SIGINT")
    run.add_argument("--until-caught-up", action="store_true", help="exit once everything committed before start is in Redis")
    consume = command("consume", cmd_consume, "run a consumer of one entity's streams")
    consume.add_argument("--entity", required=True)
    consume.add_argument("--group", required=True, help="consumer group (also names the state it keeps)")
    consume.add_argument("--name", help="consumer name (default: host-pid)")
    consume.add_argument("--start", default="$", help="where a new group starts: $, 0, an entry ID or an ISO-8601 time")
    consume.add_argument("--handler", help="module:function applying entries in a PostgreSQL transaction with checkpoints")
    consume.add_argument("--sink", help="schema.table to mirror the entity into, idempotently")
    consume.add_argument("--shared", action="store_true", help="many consumers per stream (only with --sink)")
    consume.add_argument("--state-dsn", help="where state and checkpoints live (default: postgres.dsn)")
    consume.add_argument("--count", type=int, default=100, help="entries per batch")
    consume.add_argument("--claim-idle-ms", type=int, default=30_000)
    consume.add_argument("--max-deliveries", type=int, default=5)
    consume.add_argument("--lease-ttl-ms", type=int, default=10_000)
    trim = command("trim", cmd_trim, "trim streams up to what every consumer group has consumed")
    trim.add_argument("--entity", help="only this entity's streams")
    trim.add_argument("--max-len", type=int, help="hard cap on length (drops unconsumed entries, loudly)")
    trim.add_argument("--max-age-s", type=float, help="hard cap on age in seconds (drops unconsumed entries, loudly)")
    replay = command("replay", cmd_replay, "start a group at, or rewind it to, a time or an entry ID")
    replay.add_argument("--entity", required=True)
    replay.add_argument("--group", required=True)
    replay.add_argument("--from", dest="start", required=True, help="ISO-8601 time (e.g. 2026-11-21T00:00:00Z), entry ID, 0 or $")
    read = command("read", cmd_read, "print an entity's entries in a time or ID range as JSON lines")
    read.add_argument("--entity", required=True)
    read.add_argument("--from", dest="start", help="ISO-8601 time or entry ID (default: the beginning)")
    read.add_argument("--to", dest="end", help="ISO-8601 time or entry ID, inclusive (default: the end)")
    read.add_argument("--limit", type=int, default=0, help="stop after this many entries")
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
        p = command(action, cmd_dlq, text, parent=actions, about=(f"{ABOUT['dlq'][0]} {action}: {text}.", example),
                    config_default=argparse.SUPPRESS)
        p.add_argument("--group", required=True, help="the consumer group")
        if ids_help:
            p.add_argument("ids", nargs="+" if action == "show" else "*", help=ids_help)
        else:
            p.set_defaults(ids=[])
    backfill = command("backfill", cmd_backfill, "re-publish an entity's table (op r) while streaming continues")
    backfill.add_argument("--entity", help="the entity to re-publish")
    backfill.add_argument("--where", help="SQL condition selecting part of the table")
    backfill.add_argument("--wait", action="store_true", help="show progress until every chunk is read")
    backfill.add_argument("--watch", action="store_true", help="follow the snapshots and backfills in progress")
    schema = command("schema", cmd_schema, "print a JSON Schema per entity")
    schema.add_argument("--entity", help="only this entity")
    reconcile = command("reconcile", cmd_reconcile, "recompute consumer state with Spark and reset it exactly")
    reconcile.add_argument("--spec", action="append", help="only this spec (by name; repeatable)")
    reconcile.add_argument("--dry-run", action="store_true", help="report drift, change nothing")
    reconcile.add_argument("--master", help="Spark master URL (default: reconcile.master, local[*])")
    reconcile.add_argument("--json", action="store_true", help="print the report as JSON")
    reconcile.add_argument("--report", help="also write the JSON report to this file")
    status = command("status", cmd_status, "show the slot, lag and streams")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every way it can end is an exit code from `cdc.exits` (never a traceback)."""
    for name, value in os.environ.items():  # secrets given by environment: hidden from every message
        if name.startswith("CDC_") and name.endswith(("_DSN", "_URL")):
            redact.register(value)
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
