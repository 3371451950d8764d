"""The consumer subcommands: `cdc consume`, `cdc replay`, `cdc read`, `cdc dlq`."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import signal
import sys
import time
from typing import TYPE_CHECKING

import orjson

from .. import redact
from .args import check_position, check_positive
from ..sink.redisconn import redis_for
from .common import entity_named, load_config
from ..errors import DataLossError, PublishError, TransientError, UsageError
from ..exits import as_cdc_error
from ..loader import load_callable
from ..consume.defaults import GC_YOUNG_THRESHOLD
from ..consume.failures import RETRY, SETUP, whose

if TYPE_CHECKING:
    from ..consume.checkpoint import TransactionalHandler
    from ..consume.table_sink import TableSink

__all__ = ["cmd_consume", "cmd_replay", "cmd_read", "cmd_dlq"]


def cmd_consume(args: argparse.Namespace) -> int:
    import threading

    import redis

    from ..consume.consumer import Consumer

    check_position(args.start, "--start")
    check_positive(args, "metrics_port", allow_zero=True)
    if args.metrics_port > 65535:
        raise UsageError(f"--metrics-port {args.metrics_port}: not a port", hint="give a port up to 65535, or 0")
    for option in ("count", "lease_ttl_ms", "claim_idle_ms", "max_deliveries", "transaction_wait_ms"):
        if getattr(args, option) < 1:
            raise UsageError(f"--{option.replace('_', '-')} {getattr(args, option)}: must be at least 1",
                             hint="see cdc consume --help for the defaults")
    redact.register(args.state_dsn)
    if args.state_dsn is not None:
        from ..config import check_dsn

        check_dsn(args.state_dsn, "--state-dsn")
    settings, mappings = load_config(args)
    if args.transactions == "":
        if not settings.transactions.stream:
            raise UsageError("--transactions without a stream, and the config sets no transactions.stream",
                             hint="set transactions: {stream: cdc:transactions} for the bridge, or give --transactions STREAM")
        args.transactions = settings.transactions.stream
    if len(args.entity) > 1 and not args.transactions:
        raise UsageError("--entity is given more than once: only with --transactions does one consumer read several entities",
                         hint="give one --entity, or add --transactions STREAM")
    if args.transactions and args.shared:
        raise UsageError("--shared with --transactions: one consumer must see every entry of a transaction",
                         hint="leave out --shared; standby consumers take over through the lease")
    chosen = [entity_named(mappings, name) for name in dict.fromkeys(args.entity)]
    streams = [key for mapping in chosen for key in mapping.stream_keys()]
    if args.transactions in streams:
        raise UsageError(f"--transactions {args.transactions} is a mapped entity's stream",
                         hint="give the bridge's transactions.stream (cdc:transactions by default in its docs)")
    if args.transactions:
        from ..keys import reserved_name

        reserved = reserved_name(args.transactions)
        if reserved is not None:
            raise UsageError(f"--transactions {args.transactions} is a reserved name: {reserved}",
                             hint="give the bridge's transactions.stream (cdc:transactions by default in its docs)")
    if args.sink is not None and len(chosen) > 1:
        raise UsageError("--sink mirrors one entity into one table: give one --entity with it",
                         hint="use --handler to keep several entities' state in step")
    if bool(args.handler) == bool(args.sink):
        raise UsageError("give exactly one of --handler module:function or --sink schema.table")
    if args.shared and args.handler:
        raise UsageError("--shared needs --sink: ordered, transactional state needs one consumer per stream")
    if args.sink is not None and not all(part.strip() for part in args.sink.split(".", 1)):
        raise UsageError(f"--sink {args.sink!r} is not a table name", hint="write it as schema.table, e.g. public.ride_mirror")
    apply = load_callable(args.handler) if args.handler else None  # exit 2 before any server is asked
    state_dsn = args.state_dsn or settings.postgres.dsn
    log = logging.getLogger("cdc.consume.consumer")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with redis_for(settings) as client:
        consumer = Consumer(
            client, streams, args.group, args.name, exclusive=not args.shared, count=args.count,
            claim_idle_ms=args.claim_idle_ms, max_deliveries=args.max_deliveries, lease_ttl_ms=args.lease_ttl_ms,
            transactions=args.transactions, transaction_wait_ms=args.transaction_wait_ms,
        )
        if apply is not None:
            from ..consume.checkpoint import TransactionalHandler

            handler: TransactionalHandler | TableSink = TransactionalHandler(
                state_dsn, args.group, apply, epoch_of=consumer.epoch,
                crash_before_commit=float(os.environ.get("CDC_FAULT_CRASH_BEFORE_COMMIT", 0)),
            )
        else:
            from ..consume.table_sink import TableSink

            handler = TableSink(state_dsn, args.sink)
        server = _serve_metrics(consumer, args, settings.postgres.slot, state_dsn if apply is not None else None)
        # as the bridge: the start-up's objects out of the collector's sight, the young ones collected less
        # often (with Python's 700, collections took a third of the consume loop's CPU per entry)
        gc.freeze()
        gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)
        try:
            _consume(consumer, handler, settings, chosen, args.start, stop, log)
        except redis.RedisError as exc:
            raise redis_refusal(exc) if whose(exc) == SETUP and not isinstance(exc, redis.AuthenticationError) else exc
        finally:
            handler.close()
            if server is not None:
                server.close()
            log.info("consumer stopped %r %r", consumer, handler)
    return 0


def _serve_metrics(consumer, args: argparse.Namespace, slot: str, state_dsn: str | None):
    """--metrics-port: serve /metrics, /healthz, /readyz (resets counted for a --handler consumer)."""
    if not args.metrics_port:
        return None
    from ..consume.checkpoint import ResetCount
    from ..errors import ConfigError

    resets = ResetCount(state_dsn, args.group) if state_dsn is not None else None
    try:
        return consumer.serve_metrics(args.metrics_port, args.metrics_host, slot=slot, resets=resets)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {args.metrics_host}:{args.metrics_port}: {exc.strerror}",
                          hint="give --metrics-port a free port, or 0") from None


def _consume(consumer, handler, settings, mappings, start: str, stop, log) -> None:
    """Check the setup (Redis ACL, the state database and its grants), then consume until `stop`.

    What is worth retrying (see `cdc.consume.failures`) is retried with the bridge's backoff, the
    setup checked again first; anything else stops the consumer, its entries still pending."""
    import psycopg
    import redis

    from ..bridge.backoff import Backoff

    backoff = Backoff()
    checked = False
    while not stop.is_set():
        consumer.metrics.tick()
        done = consumer.acked + consumer.dead_lettered
        backoff.streaming(time.monotonic())
        try:
            if not checked:
                check_redis_acl(consumer.client, settings, mappings, log)
                handler.check_setup()
                checked = True
            consumer.create_group(start)
            consumer.run(handler, stop)
        except Exception as exc:
            if whose(exc) != RETRY:
                raise
            if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, psycopg.OperationalError)):
                error = as_cdc_error(exc)
                if not isinstance(error, TransientError):  # a refused login, a TLS mismatch: retrying won't help
                    raise error from exc
            if consumer.acked + consumer.dead_lettered > done:
                backoff.progressed()
            delay = backoff.next(time.monotonic())
            consumer.metrics.state = "retrying"
            log.warning("transient failure, retrying in %.1fs: %s", delay, " ".join(str(exc).split()))
            stop.wait(delay)


def check_redis_acl(client, settings, mappings, log) -> None:
    """Every command the consumer sends, asked of the ACL with ACL DRYRUN (as `cdc check` does):
    a refused one stops it now (exit 5) rather than at its first entry."""
    from ..ops.preflight import CheckReport, _check_acl, _where, acl_probes

    if settings.redis.cluster:  # the nodes' ACLs are cdc check's to compare
        return
    report = CheckReport()
    probes = [("cdc consume", command) for who, command in acl_probes(settings, mappings) if who == "consumers"]
    _check_acl(client, _where(settings.redis.url), probes, report)
    for warning in report.warnings:
        log.info("%s", warning)
    if report.problems:
        first = report.problems[0]
        more = f" (and {len(report.problems) - 1} more: cdc check lists them)" if len(report.problems) > 1 else ""
        raise PublishError(first.message + more, hint=first.hint)


def redis_refusal(exc) -> PublishError:
    """Redis refused a consumer's command (not a server away): the fix, naming the command when the ACL did;
    a stream or group gone from under the consumer (deleted, Redis emptied or restored) is no refusal."""
    text = " ".join(str(exc).split())
    if text.startswith("NOGROUP") or text.startswith("UNBLOCKED the stream key no longer exists"):
        return DataLossError(
            f"a stream this consumer reads, or its group, vanished from Redis while it ran ({text}): the group's "
            "position and its pending entries are gone (the stream deleted, the group destroyed, or Redis emptied "
            "or restored)",
            hint="if the bridge's streams were lost too, cdc run stops naming it (exit 6): run cdc recover, which "
                 "rebuilds them behind a marker where consumers reset; then start this consumer again (its group "
                 "is created at --start)")
    command = re.search(r"permissions to run the '([^']+)' command", text)
    if command:
        hint = f"add +{command[1]} to the redis user's ACL (deploy/redis/redis.conf lists what consumers send)"
    elif "permissions to access" in text:
        hint = "allow the keys ~cdc:* ~{cdc:* in the redis user's ACL (see deploy/redis/redis.conf)"
    else:
        hint = "check the redis user's ACL and the keys it may use"
    return PublishError(f"redis refused a consumer's command: {text}", hint=hint)


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
    """Entries of an entity's streams as JSON lines. An entry the bridge did not write is skipped with a
    warning naming it, the others are shown, and the command ends with that entry's error (exit 5)."""
    from ..consume.replay import range_bound, read_range

    check_position(args.start, "--from")
    check_position(args.end, "--to")
    check_positive(args, "limit", allow_zero=True)
    settings, mappings = load_config(args)
    try:
        start, end = range_bound(args.start, "-"), range_bound(args.end, "+")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    foreign: list[PublishError] = []
    with redis_for(settings) as client:
        shown = 0
        for stream in entity_named(mappings, args.entity).stream_keys():
            for e in read_range(client, stream, start, end, on_foreign=lambda error: _skipped(error, foreign)):
                row = {"stream": e.stream, "id": e.id, **{k.decode(): v.decode() for k, v in e.fields.items()}}
                for name in ("key", "data", "before", "unchanged"):
                    if name in row:  # parsed already by read_range
                        row[name] = getattr(e, name)
                sys.stdout.write(orjson.dumps(row).decode() + "\n")
                shown += 1
                if args.limit and shown >= args.limit:
                    return _end_skipped(foreign)
    return _end_skipped(foreign)


def _skipped(error: PublishError, foreign: list[PublishError]) -> None:
    foreign.append(error)
    sys.stdout.flush()
    print(redact.redact(f"warning: skipped: {error.message}"), file=sys.stderr, flush=True)


def _end_skipped(foreign: list[PublishError]) -> int:
    """0, or the first skipped entry's error when any was skipped: a script must not take the output as whole."""
    if not foreign:
        return 0
    first = foreign[0]
    more = f" ({len(foreign)} entries skipped in all)" if len(foreign) > 1 else ""
    raise PublishError(first.message + more, hint=first.hint)


def cmd_dlq(args: argparse.Namespace) -> int:
    """Dead letters of a group. An entry of the dead-letter stream no consumer wrote is never shown or
    replayed: `list` skips it with a warning naming it and ends with its error (exit 5); `show` and
    `replay` naming it end with that error."""
    from ..consume.replay import dead_letters, replay_dead_letters

    settings, _ = load_config(args)
    with redis_for(settings) as client:
        if args.action == "list":
            rows = dead_letters(client, args.group)
            foreign: list[PublishError] = []
            for row in rows:
                if "foreign" in row:
                    _skipped(row["foreign"], foreign)
                    continue
                print(f"{row['id']}  {row['source_stream']} {row['source_id']}  deliveries={row['deliveries']}  "
                      f"{redact.redact(row['error'])}")
            print(f"{len(rows) - len(foreign)} dead letter(s) for group {args.group}")
            return _end_skipped(foreign)
        elif args.action == "show":
            rows = [r for r in dead_letters(client, args.group) if r["id"] in args.ids]
            if not rows:
                raise UsageError(f"no dead letter {', '.join(args.ids)} for group {args.group}",
                                 hint=f"cdc dlq list --group {args.group} shows them")
            foreign = []
            for row in rows:
                if "foreign" in row:
                    _skipped(row["foreign"], foreign)
                    continue
                row["error"] = redact.redact(row["error"])
                if "entry" in row:
                    row["entry"] = orjson.loads(row["entry"])
                sys.stdout.write(orjson.dumps(row, option=orjson.OPT_INDENT_2).decode() + "\n")
            return _end_skipped(foreign)
        else:
            rows = dead_letters(client, args.group)
            unknown = [i for i in args.ids if i not in {r["id"] for r in rows}]
            if unknown:
                raise UsageError(f"no dead letter {', '.join(unknown)} for group {args.group}",
                                 hint=f"cdc dlq list --group {args.group} shows them")
            named = [r for r in rows if "foreign" in r and (not args.ids or r["id"] in args.ids)]
            if named and args.ids:
                raise named[0]["foreign"]  # before anything is replayed
            foreign = []
            for row in named:
                _skipped(row["foreign"], foreign)
            for line in replay_dead_letters(client, args.group, args.ids):
                if "not a dead letter; skipped" not in line:
                    print(line)
            return _end_skipped(foreign)
