"""Throwaway PostgreSQL and Redis for a benchmark run, removed afterwards."""

from __future__ import annotations

import compileall
import contextlib
import os
import shutil
import sys
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cdc.demo.local import LocalPostgres, LocalRedis  # noqa: E402


def cdc_command(command: str, config: Path, *args: str) -> list[str]:
    """The command line of `cdc <command>` on `config`, logging warnings only (run it with cwd=ROOT)."""
    return [sys.executable, "-m", "cdc", "--log-level", "warning", command, "--config", str(config), *args]


def peak_rss(proc: subprocess.Popen) -> list[int]:
    """[the process' peak RSS in bytes], sampled every 50 ms until it exits."""
    import psutil

    peak = [0]

    def sample() -> None:
        try:
            p = psutil.Process(proc.pid)
            while proc.poll() is None:
                peak[0] = max(peak[0], p.memory_info().rss)
                time.sleep(0.05)
        except psutil.Error:
            return

    threading.Thread(target=sample, daemon=True).start()
    return peak


TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """A process' CPU so far (utime + stime from /proc/PID/stat), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class WalsenderCpu:
    """The CPU a slot's walsender spends for a reader: sampled every 20 ms from when the slot turns active
    until its walsender exits (or `stop`); `stop()` returns the last sample, in seconds."""

    def __init__(self, dsn: str, slot: str) -> None:
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(dsn, slot), daemon=True)
        self._thread.start()

    def _sample(self, dsn: str, slot: str) -> None:
        import psycopg

        pid = None
        with psycopg.connect(dsn, autocommit=True) as conn:
            while pid is None and not self._stop.is_set():
                pid = conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                                   (slot,)).fetchone()[0]
                if pid is None:
                    time.sleep(0.01)
        while pid is not None:
            try:
                self.seconds = cpu_seconds(pid)
            except OSError:
                return  # the walsender exited: its last sample stands
            if self._stop.wait(0.02):
                pid = None

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.seconds


def compile_package() -> None:
    """Byte-compile cdc, as installing it does: from a checkout under PYTHONDONTWRITEBYTECODE=1, every `cdc`
    process would compile the modules it imports (about 0.1 s of CPU for `cdc run`), and the benchmarks count a
    command's whole process."""
    compileall.compile_dir(ROOT / "cdc", quiet=1)


@contextlib.contextmanager
def bench_servers(prefix: str, pg_settings: dict[str, str] | None = None) -> Iterator[tuple[Path, LocalPostgres, LocalRedis]]:
    """(work folder, PostgreSQL, Redis without persistence), started; stopped and deleted on exit."""
    compile_package()
    root = Path(tempfile.mkdtemp(prefix=prefix))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    pg = LocalPostgres(root / "pg", settings=pg_settings)
    rd = LocalRedis(root / "redis", appendonly=False)
    try:
        pg.start()
        rd.start()
        yield root, pg, rd
    finally:
        rd.stop()
        pg.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


def prepare(root: Path, dsn: str, mappings: dict[str, str], schema: str) -> None:
    """The benchmark's mappings written into `root`/mappings, and its schema created."""
    import psycopg

    (root / "mappings").mkdir()
    for name, text in mappings.items():
        (root / "mappings" / name).write_text(text)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(schema)  # type: ignore[arg-type]
