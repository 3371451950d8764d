"""The consumer subcommands: `cdc consume`, `cdc replay`, `cdc read`, `cdc dlq`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import orjson

from .. import redact
from ..cliargs import check_position, check_positive
from ..commands import entity_named, load_config, redis_for
from ..errors import TransientError, UsageError
from ..exits import as_cdc_error
from ..loader import load_callable

__all__ = ["cmd_consume", "cmd_replay", "cmd_read", "cmd_dlq"]


def cmd_consume(args: argparse.Namespace) -> int:
    import threading

    import psycopg
    import redis

    from ..consume.consumer import Consumer

    check_position(args.start, "--start")
    for option in ("count", "lease_ttl_ms", "claim_idle_ms", "max_deliveries"):
        if getattr(args, option) < 1:
            raise UsageError(f"--{option.replace('_', '-')} {getattr(args, option)}: must be at least 1",
                             hint="see cdc consume --help for the defaults")
    redact.register(args.state_dsn)
    if args.state_dsn is not None:
        from ..config import check_dsn

        check_dsn(args.state_dsn, "--state-dsn")
    settings, mappings = load_config(args)
    mapping = entity_named(mappings, args.entity)
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
    with redis_for(settings) as client:
        consumer = Consumer(
            client, mapping.stream_keys(), args.group, args.name, exclusive=not args.shared, count=args.count,
            claim_idle_ms=args.claim_idle_ms, max_deliveries=args.max_deliveries, lease_ttl_ms=args.lease_ttl_ms,
        )
        if args.handler:
            from ..consume.checkpoint import TransactionalHandler

            handler = TransactionalHandler(
                state_dsn, args.group, load_callable(args.handler), epoch_of=consumer.epoch,
                crash_before_commit=float(os.environ.get("CDC_FAULT_CRASH_BEFORE_COMMIT", 0)),
            )
        else:
            from ..consume.table_sink import TableSink

            handler = TableSink(state_dsn, args.sink)
        delay = 0.2
        try:
            while not stop.is_set():
                try:
                    handler.connection()  # the state database first: a refused login stops here, not at the first entry
                    consumer.create_group(args.start)
                    consumer.run(handler, stop)
                except (redis.ConnectionError, redis.TimeoutError, psycopg.OperationalError) as exc:
                    error = as_cdc_error(exc)
                    if not isinstance(error, TransientError):  # a refused login, a TLS mismatch: retrying won't help
                        raise error from exc
                    # a server restarting: what was not acknowledged comes back; retry with backoff
                    log.warning("transient failure, retrying in %.1fs: %s", delay, exc)
                    stop.wait(delay)
                    delay = min(delay * 2, 5.0)
        finally:
            handler.close()
            log.info("consumer stopped %r %r", consumer, handler)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from ..consume.replay import replay_group

    check_position(args.start, "--from")
    settings, mappings = load_config(args)
    with redis_for(settings) as client:
        try:
            for line in replay_group(client, entity_named(mappings, args.entity).stream_keys(), args.group, args.start):
                print(line)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return 0


def cmd_read(args: argparse.Namespace) -> int:
    from ..consume.replay import range_bound, read_range

    check_position(args.start, "--from")
    check_position(args.end, "--to")
    check_positive(args, "limit", allow_zero=True)
    settings, mappings = load_config(args)
    try:
        start, end = range_bound(args.start, "-"), range_bound(args.end, "+")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with redis_for(settings) as client:
        shown = 0
        for stream in entity_named(mappings, args.entity).stream_keys():
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
    from ..consume.replay import dead_letters, replay_dead_letters

    settings, _ = load_config(args)
    with redis_for(settings) as client:
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
