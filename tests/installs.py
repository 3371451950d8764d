"""What the install tests share (tests/test_install.py, tests/test_upgrade.py): building a wheel, the wheelhouse of
its dependencies kept in pytest's cache, a fresh virtualenv with a pip user's environment, and the commands run
in it as a shell would."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tracked_copy(target: Path) -> Path:
    """The checkout's files (tracked, and new ones not ignored) as they are now: nothing a build left behind."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_symlink() or source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            if source.is_symlink():
                os.symlink(os.readlink(source), target / name)
            else:
                shutil.copy2(source, target / name)
    return target


def build_wheel(source: Path, dist: Path, pattern: str, env: dict | None = None) -> Path:
    """`pip wheel --no-deps` of the project in `source` into `dist`: the one wheel matching `pattern`."""
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(dist), str(source)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = dist.glob(pattern)
    return wheel


def requirements(wheel: Path) -> list[str]:
    """The wheel's own requirements (Requires-Dist without an extra), sorted."""
    with zipfile.ZipFile(wheel) as z:
        (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        return sorted(line for line in z.read(metadata).decode().splitlines()
                      if line.startswith("Requires-Dist:") and "extra ==" not in line)


def wheelhouse(cache, wheel: Path) -> Path:
    """The wheels of `wheel`'s dependencies, in pytest's cache (`cache`: config.cache), fetched once per set of
    requirements; every later install takes them with --no-index."""
    key = hashlib.sha256("\n".join(requirements(wheel)).encode()).hexdigest()[:16]
    house = Path(cache.mkdir(f"install-wheelhouse-{key}"))
    if not (house / "complete").exists():
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary", ":all:", "-d", str(house),
                              str(wheel)], capture_output=True, text=True, timeout=600)
        assert got.returncode == 0, got.stdout + got.stderr
        (house / wheel.name).unlink(missing_ok=True)  # the project's own wheel, which pip copies beside them
        (house / "complete").touch()
    return house


def fresh_venv(venv: Path) -> dict:
    """A new virtualenv at `venv`, and the environment of a user who activated it: no PYTHON*, CDC_* or
    VIRTUAL_ENV variables of the test run, the checkout's .venv off PATH."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    user = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "CDC_", "VIRTUAL_ENV"))}
    user["PATH"] = f"{venv / 'bin'}:" + ":".join(p for p in os.environ["PATH"].split(":") if ".venv" not in p)
    user["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return user


def run(line: str, cwd: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """A shell line that must exit 0 without a traceback."""
    result = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{line} -> {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr, line
    return result


def start(line: str, cwd: Path, env: dict, log: Path | None = None) -> subprocess.Popen:
    """A shell line in the background, its output piped (read it, or it blocks once the pipe is full), or written
    to `log` (`stop` returns it either way)."""
    out = subprocess.PIPE if log is None else open(log, "w")
    try:
        proc = subprocess.Popen(["bash", "-c", "exec " + line], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    finally:
        if log is not None:
            out.close()  # type: ignore[union-attr]
    proc.log_path = log  # type: ignore[attr-defined]
    return proc


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> str:
    """Signal a process `start` started; it must exit 0 without a traceback. Its output."""
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    if proc.log_path is not None:  # type: ignore[attr-defined]
        out = proc.log_path.read_text()  # type: ignore[attr-defined]
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    return out
