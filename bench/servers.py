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
