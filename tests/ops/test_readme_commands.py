"""Every shell example of the documentation (README.md, then the pages of docs/ in the order of
mkdocs.yml's nav) runs as written against the demo setup (sql/ applied, the example mappings,
`cdc init` done, as `make run` leaves it), in that order.
`cdc` is the package's entry point, `redis-cli` talks to the test's Redis; the few examples
that need something absent here are skipped, each with its reason below."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cdc.demo.local import wait_for
from conftest import ROOT, SQL

pytestmark = pytest.mark.integration

SKIPPED = {
    "make run": "starts its own servers and runs until Ctrl-C (tests/ops/test_cli.py runs the demo)",
    "cdc demo": "starts its own servers and runs until Ctrl-C (tests/ops/test_cli.py and tests/test_install.py run it)",
    "make test": "the whole test suite, of which this test is part",
    "make reconcile-deps": "installs system packages",
    "docker build -f deploy/": "needs a Docker engine (tests/ops/test_image.py builds and runs the same Dockerfiles with buildah)",
    "pip install pg-redis-cdc": "installs into an environment (tests/test_install.py installs the built wheel so)",
    "cd examples/node-consumer": "needs npm packages from the registry (tests/consume/test_node_consumer.py runs it)",
    "--master spark://": "needs a Spark cluster",
    'psql "$ADMIN_DSN"': "needs a superuser's connection string (tests/ops/test_least_privilege.py applies what cdc sql prints)",
    "MODEL_SEED=": "longer runs of tests/bridge/test_model.py, which make test runs",
}
LONG_RUNNING = ("cdc run ", "cdc consume ", ".venv/bin/cdc run ", ".venv/bin/cdc consume ")  # they run until SIGTERM: started, seen working, stopped
DEAD_LETTER = "1795394575651-0"  # the ID the dlq examples name


def documentation_pages() -> list[Path]:
    """README.md, then every page of the site in the order its nav lists them (each once)."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages: list[Path] = [ROOT / "README.md"]

    def walk(items) -> None:
        for item in items:
            for value in (item.values() if isinstance(item, dict) else [item]):
                if isinstance(value, list):
                    walk(value)
                elif (ROOT / "docs" / value) not in pages:
                    pages.append(ROOT / "docs" / value)

    walk(nav)
    return pages


def readme_commands() -> list[str]:
    lines = []
    text = "\n".join(page.read_text() for page in documentation_pages())
    for block in re.findall(r"```(?:sh|bash|shell)\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def as_run(line: str) -> str:
    """The line as the shell gets it: a trailing comment dropped, `[optional]` parts taken, `[ID ...]` left out."""
    line = re.sub(r"\s+#[^'\"]*$", "", line)
    line = re.sub(r"\s*\[[A-Z]+ \.\.\.\]", "", line)
    return re.sub(r"\[(--[^\]]*)\]", r"\1", line)


def handles_sigterm(pid: int) -> bool:
    """The process has its own SIGTERM handler installed (SigCgt in /proc/PID/status)."""
    caught = re.search(r"^SigCgt:\s*([0-9a-f]+)$", Path(f"/proc/{pid}/status").read_text(), re.M)
    return bool(caught and int(caught[1], 16) & (1 << (signal.SIGTERM - 1)))


def _wrapper(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + text + "\n")
    path.chmod(0o755)


@pytest.fixture
def demo(env):
    """The demo's state after `make run` set it up, in a folder laid out like the documentation assumes."""
    for path in sorted(SQL.glob("*.sql")):
        env.execute(path.read_text())
    env.copy_mappings(*(p.name for p in (ROOT / "mappings").glob("*.yaml")))
    shutil.copytree(ROOT / "reconcile", env.tmp / "reconcile")
    env.write_config()
    for demo_root in (".local", "cdc-demo"):  # make run's, cdc demo's
        (env.tmp / demo_root).mkdir()
        (env.tmp / demo_root / "cdc.yaml").write_text(
            env.config_path.read_text().replace("mappings: mappings/", f"mappings: {env.mappings_dir}"))
    env.cdc("init", check=True)
    env.execute("INSERT INTO riders (id, name, email) SELECT g, 'r' || g, 'e' FROM generate_series(1, 3) g")
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 3, g FROM generate_series(1, 20) g")
    cdc = f'PYTHONPATH={ROOT} exec {sys.executable} -m cdc "$@"'
    _wrapper(env.tmp / "bin" / "cdc", cdc)
    _wrapper(env.tmp / ".venv" / "bin" / "cdc", cdc)
    _wrapper(env.tmp / "bin" / "redis-cli", f'exec {shutil.which("redis-cli")} -p {env.redis_server.port} "$@"')
    put_dead_letter(env)
    return env


def put_dead_letter(env) -> None:
    """The dead letter the dlq examples name (again, once an earlier example replayed it away)."""
    if env.redis.xrange("cdc:dlq:billing", DEAD_LETTER, DEAD_LETTER):
        return
    env.redis.delete("cdc:dlq:billing")  # its ID is below the stream's last one: the stream starts over
    env.redis.xadd("cdc:dlq:billing", {"source_stream": "cdc:ride", "source_id": "1-0", "deliveries": "5",
                                       "error": "ValueError: example",
                                       "entry": '{"op": "c", "key": "{\\"id\\": 999}", "lsn": "1", "seq": "0"}'},
                   id=DEAD_LETTER)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_documented_shell_example_runs_as_written(demo):
    shell_env = {**os.environ, "PATH": f"{demo.tmp / 'bin'}:{os.environ['PATH']}"}
    ran, skipped, background = [], [], []
    try:
        for line in readme_commands():
            rule = next((start for start in SKIPPED if start in line), None)
            if rule:
                skipped.append(rule)
                continue
            command = as_run(line)
            if command.startswith("cdc dlq "):
                put_dead_letter(demo)
            if command.startswith(LONG_RUNNING) and "--until-caught-up" not in command:  # that one exits by itself
                proc = subprocess.Popen(["bash", "-c", "exec " + command], cwd=demo.tmp, env=shell_env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                background.append(proc)
                if command.startswith(("cdc run ", ".venv/bin/cdc run ")):
                    wait_for(demo.slot_active, 60, f"{command} to attach to the slot")
                    wait_for(lambda: demo.redis.xlen("cdc:ride") >= 20, 60, "the rides in the stream")
                else:
                    group = re.search(r"--group (\S+)", command)[1]
                    wait_for(lambda: any(g["name"].decode() == group for g in demo.redis.xinfo_groups("cdc:ride")),
                             60, f"{command} to create its group")
                    # an example repeated for an existing group: seen working once it handles SIGTERM itself
                    wait_for(lambda: handles_sigterm(proc.pid), 60, f"{command} to handle SIGTERM")
                    proc.send_signal(signal.SIGTERM)
                    out, _ = proc.communicate(timeout=60)
                    assert proc.returncode == 0, f"{command}\n{out}"
                ran.append(line)
                continue
            if command.startswith("cdc recover "):  # as its section says: with the bridge stopped
                for proc in background:
                    if proc.poll() is None and "cdc run " in " ".join(proc.args):
                        proc.send_signal(signal.SIGTERM)
                        out, _ = proc.communicate(timeout=60)
                        assert proc.returncode == 0, out
                demo.wait_slot_inactive()
            result = subprocess.run(["bash", "-c", command], cwd=demo.tmp, env=shell_env, capture_output=True,
                                    text=True, timeout=600)
            allowed = (0, 7) if "reconcile" in command and "--dry-run" in command else (0,)  # 7: drift reported
            assert result.returncode in allowed, f"{command} -> {result.returncode}\n{result.stdout}\n{result.stderr}"
            assert "Traceback" not in result.stderr, command
            ran.append(line)
    finally:
        for proc in background:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                out, _ = proc.communicate(timeout=60)
                assert proc.returncode == 0, out
    assert set(skipped) == set(SKIPPED), skipped  # every skip rule still names a documented line
    assert len(ran) + len(skipped) == len(readme_commands())
    assert demo.execute("SELECT count(*) FROM cdc_backfills WHERE status = 'done'")[0][0] >= 1


def test_optional_parts_are_taken_and_placeholders_dropped():
    assert as_run('cdc backfill --entity ride [--where "x > 1"] [--wait]') == 'cdc backfill --entity ride --where "x > 1" --wait'
    assert as_run("cdc dlq replay --config cdc.yaml --group billing [ID ...]") == "cdc dlq replay --config cdc.yaml --group billing"
    assert as_run("cdc replay --from 0  # create, or XGROUP SETID") == "cdc replay --from 0"
