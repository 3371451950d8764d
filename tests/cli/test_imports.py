"""What a command loads before its first change: `cdc run` pays for every module it imports on every start (the
bench counts it in the bridge's CPU per change), so the other commands' implementations stay out of it."""

from __future__ import annotations

import subprocess
import sys

from cdc.errors import ConfigError

#: `cdc run` needs none of these: the other commands' implementations (consumer, reconcile, progress display),
#: and what only they use. (redis.asyncio cannot be among them: `import redis` imports it.)
NOT_FOR_RUN = ("cdc.cli.consume", "cdc.cli.ops", "cdc.cli.reconcile", "cdc.cli.progress", "cdc.consume.consumer",
               "cdc.consume.checkpoint", "cdc.consume.metrics", "cdc.reconcile", "rich.progress", "pyspark",
               "psycopg_pool", "prometheus_client", "http.server")


def _modules_after(argv: list[str]) -> tuple[int, set[str]]:
    """(exit code of `cdc <argv>`, every module loaded by then), in a fresh interpreter."""
    code = ("import sys\nfrom cdc.cli import main\ncode = main(sys.argv[1:])\n"
            "print(code, *sorted(sys.modules), sep='\\n', file=sys.stderr)\n")
    err = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True).stderr
    lines = err.splitlines()
    start = next(i for i, line in enumerate(lines) if line.isdigit())  # after the command's own error line
    return int(lines[start]), set(lines[start + 1:])


def test_cdc_run_loads_the_bridge_and_no_other_command(tmp_path):
    # cdc run imports the bridge, then reads its config: a missing file ends it there, without servers
    code, modules = _modules_after(["run", "--config", str(tmp_path / "missing.yaml"), "--until-caught-up"])
    assert code == ConfigError.exit_code
    assert {"cdc.bridge.loop", "cdc.bridge.slot_holder", "cdc.config", "cdc.mapping.model"} <= modules
    loaded = sorted(m for m in modules for heavy in NOT_FOR_RUN if m == heavy or m.startswith(heavy + "."))
    assert loaded == []


def test_help_loads_no_command_nor_driver():
    code, modules = _modules_after(["--help"])
    assert code == 0
    assert not {m for m in modules if m.split(".")[0] in ("psycopg", "redis", "rich", "yaml", "prometheus_client")}
    assert not {m for m in modules if m.startswith("cdc.cli.") and m not in ("cdc.cli.entry", "cdc.cli.args")}
