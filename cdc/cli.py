"""The ``cdc`` command: init, check, run, schema, status.

Errors the operator can fix are printed as one line (``cdc: error: ...``) with
an exit code per kind (see `cdc.errors`); logs are JSON lines on stderr.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Sequence

import orjson

from .errors import CdcError

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
        return orjson.dumps(entry).decode()


def _setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("cdc")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def _load(args: argparse.Namespace):
    from .config import Settings
    from .mapping import load_mappings

    settings = Settings.from_file(args.config)
    return settings, load_mappings(settings.mappings)


def cmd_init(args: argparse.Namespace) -> int:
    from .admin import init

    settings, mappings = _load(args)
    for line in init(settings, mappings):
        print(line)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from .admin import check

    settings, mappings = _load(args)
    report = check(settings, mappings)
    for line in report.ok:
        print(f"ok: {line}")
    for line in report.problems:
        print(f"problem: {line}", file=sys.stderr)
    if report.problems:
        print(f"cdc check: {len(report.problems)} problem(s)", file=sys.stderr)
        return 3
    print(f"cdc check: {len(mappings)} mapping(s) valid")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from .bridge import Bridge

    settings, mappings = _load(args)
    bridge = Bridge(settings, mappings, until_caught_up=args.until_caught_up)
    log = logging.getLogger("cdc.bridge")

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


def cmd_schema(args: argparse.Namespace) -> int:
    from .admin import json_schemas

    settings, mappings = _load(args)
    schemas = json_schemas(settings, mappings)
    if args.entity:
        if args.entity not in schemas:
            raise CdcError(f"no entity {args.entity!r}", hint=f"entities: {', '.join(schemas)}")
        schemas = schemas[args.entity]
    sys.stdout.write(orjson.dumps(schemas, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from .status import collect, render

    settings, mappings = _load(args)
    status = collect(settings, mappings)
    if args.json:
        sys.stdout.write(orjson.dumps(status, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(render(status))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cdc", description="PostgreSQL logical replication to Redis Streams")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="json", choices=["json", "text"])
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, func, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--config", "-c", default="cdc.yaml", help="config file (default: cdc.yaml)")
        p.set_defaults(func=func)
        return p

    command("init", cmd_init, "create the publication and the logical slot (idempotent)")
    command("check", cmd_check, "validate the server and every mapping against the live schema")
    run = command("run", cmd_run, "stream changes into Redis until SIGTERM/SIGINT")
    run.add_argument("--until-caught-up", action="store_true", help="exit once everything committed before start is in Redis")
    schema = command("schema", cmd_schema, "print a JSON Schema per entity")
    schema.add_argument("--entity", help="only this entity")
    status = command("status", cmd_status, "show the slot, lag and streams")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.log_level, args.log_format)
    try:
        return args.func(args)
    except CdcError as exc:
        print(f"cdc: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
