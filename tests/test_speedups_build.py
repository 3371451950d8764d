"""The compiled hot path is optional: the package builds and installs without a C compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_package_builds_as_pure_python_without_a_compiler(tmp_path):
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("*.so", "_*.c", "__pycache__", "*.egg-info", "build")
    shutil.copytree(ROOT / "cdc", source / "cdc", ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md", "MANIFEST.in"):
        shutil.copy(ROOT / name, source / name)
    # a compiler that fails on every file, as on a machine without one
    env = {**os.environ, "CC": "false", "LDSHARED": "false", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(tmp_path / "dist"),
                             str(source)], env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "not built" in output and "cdc runs it as pure Python" in output
    (wheel,) = (tmp_path / "dist").glob("pg_redis_cdc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "cdc/bridge/changes.py" in names and "cdc/sink/lane.py" in names
    assert {"cdc/bridge/_changes.pyi", "cdc/sink/_resp.pyi", "cdc/sink/_entries.pyi"} <= set(names)  # the interfaces, stated
    assert not [n for n in names if n.endswith((".so", ".c", ".pyx", ".pxd"))]
