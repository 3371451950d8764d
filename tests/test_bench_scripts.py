"""Every benchmark of `make bench` starts: its imports resolve and its options parse (`--help`), so a renamed name in
the package cannot leave a benchmark broken until someone runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if "__main__" in p.read_text())


def test_every_benchmark_in_the_makefile_exists():
    makefile = (BENCH.parent / "Makefile").read_text()
    named = {line.split("bench/")[1].split()[0] for line in makefile.splitlines() if "python bench/" in line}
    assert named and named <= {p.name for p in SCRIPTS}, named


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_benchmark_starts(script):
    if script.name == "reconcile.py":
        pytest.importorskip("pyspark")
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
