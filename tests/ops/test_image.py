"""The bridge's container image (deploy/Dockerfile), built and run.

There is no Docker engine here and no Docker Hub: the image is built with buildah by deploy/buildah-build.sh
(what `make image` runs), on a Debian bookworm base made from Debian's packages with mmdebstrap (Python 3.11,
python3-venv), which stands in for the Dockerfile's default base python:3.11-slim (Debian bookworm with Python
3.11 too). It is built once per test session, or found built in buildah's layer cache. Its entrypoint and default
command then run with `buildah run --isolation chroot` (which shares the host's network) against the test suite's
own PostgreSQL and Redis, as the image's non-root user, with the image's own config and mappings and the
secrets mounted as files, as deploy/compose.yaml mounts them. The reconcile image (deploy/reconcile.Dockerfile)
is built the same way and its default command, `cdc reconcile` with Spark on its Java, repairs a drifted consumer.

buildah and mmdebstrap come from `make image-deps` (make test installs them): where they are missing the tests
fail and say so, they never skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import psutil
import pytest
import redis

from cdc.demo.local import free_port, wait_for

from ride_consumers import state, truth

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1500)]  # a cold build: 2.5 minutes here

ROOT = Path(__file__).resolve().parents[2]


def makefile_variable(name: str) -> str:
    found = re.search(rf"^{name}\s*:?=\s*(\S+)\s*$", (ROOT / "Makefile").read_text(), re.M)
    assert found, f"Makefile: no {name} := ..."
    return found.group(1)


IMAGE = makefile_variable("IMAGE")
RECONCILE_IMAGE = makefile_variable("RECONCILE_IMAGE")


def buildah(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"buildah {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
    return result


def built(dockerfile: str, tag: str) -> dict:
    """`tag` built (or found in the layer cache) from this tree as make does; its config (entrypoint, command, user)."""
    missing = [tool for tool in ("buildah", "mmdebstrap") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not installed: the image tests build deploy/'s Dockerfiles with them; "
                    "run make image-deps (apt-get install buildah mmdebstrap), which make test does", pytrace=False)
    build = subprocess.run([str(ROOT / "deploy" / "buildah-build.sh"), dockerfile, tag], capture_output=True, text=True, timeout=1500)
    assert build.returncode == 0, f"building {dockerfile} failed:\n{build.stdout}\n{build.stderr}"
    inspected = json.loads(buildah("inspect", "--type", "image", tag).stdout)
    return {**inspected["Docker"]["config"], "tag": tag}


@pytest.fixture(scope="session")
def image() -> dict:
    return built("deploy/Dockerfile", IMAGE)


@pytest.fixture(scope="session")
def reconcile_image() -> dict:
    return built("deploy/reconcile.Dockerfile", RECONCILE_IMAGE)


def working_container(image: dict):
    """A working container of `image`; removed at the end."""
    name = f"cdc-test-{os.getpid()}-{free_port()}"
    buildah("from", "--quiet", "--name", name, image["tag"])
    try:
        yield name
    finally:
        buildah("rm", name, check=False)


@pytest.fixture
def container(image):
    yield from working_container(image)


@pytest.fixture
def reconcile_container(reconcile_image):
    yield from working_container(reconcile_image)


def secrets_dir(env) -> Path:
    """The secrets as files, readable by the image's user (the test's tmp_path is root's alone)."""
    path = env.tmp / "secrets"
    path.mkdir()
    (path / "postgres_dsn").write_text(env.dsn)
    (path / "redis_url").write_text(env.redis_server.url)
    (path / "hash_key").write_text(os.environ["CDC_HASH_KEY"])
    for file in path.iterdir():
        file.chmod(0o644)
    return path


def in_container(container: str, secrets: Path, argv: list[str], *options: str, **env: str) -> list[str]:
    """`buildah run` of `argv` in `container`, with the secrets mounted and the variables set (as compose does)."""
    variables = {"CDC_POSTGRES_DSN_FILE": "/run/secrets/postgres_dsn", "CDC_REDIS_URL_FILE": "/run/secrets/redis_url",
                 "CDC_HASH_KEY_FILE": "/run/secrets/hash_key", **env}
    return ["buildah", "run", "--isolation", "chroot", *options, "--volume", f"{secrets}:/run/secrets:ro",
            *(f"--env={key}={value}" for key, value in variables.items()), container, "--", *argv]


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status, response.read().decode()


def test_image_runs_the_bridge_as_its_non_root_user_on_the_suites_servers(image, container, env):
    assert image["Entrypoint"] == ["cdc"] and image["Cmd"] == ["run", "--config", "/etc/cdc/cdc.yaml"]
    assert image["User"] not in ("", "0", "root")
    assert "9187/tcp" in image["ExposedPorts"]
    env.apply_sql("10_rocket_rides.sql")
    env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'r1', 'e1')")
    secrets = secrets_dir(env)
    # cdc init, as compose's cdc-init service runs it: the image's config, its mappings, the suite's servers
    # (chroot isolation shares the host's network: 127.0.0.1 is the host's)
    overrides = {"CDC_POSTGRES_SLOT": env.slot}
    init = subprocess.run(in_container(container, secrets, [*image["Entrypoint"], "init", "--config", "/etc/cdc/cdc.yaml"],
                                       **overrides), capture_output=True, text=True, timeout=120)
    assert init.returncode == 0, init.stdout + init.stderr
    # the image's default command, on a free metrics port (the image's config says 9187)
    port = free_port()
    log_path = env.tmp / "image-bridge.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(in_container(container, secrets, image["Entrypoint"] + image["Cmd"],
                                             CDC_HTTP_PORT=str(port), **overrides),
                                stdout=log, stderr=subprocess.STDOUT)
    env.procs.append(proc)

    def bridge_process() -> psutil.Process | None:
        """The entrypoint's process: the image's python running the cdc script (not buildah's own helpers)."""
        for child in psutil.Process(proc.pid).children(recursive=True):
            cmd = child.cmdline()
            if cmd[-4:] == ["/opt/cdc/bin/cdc", *image["Cmd"]] and Path(cmd[0]).name.startswith("python"):
                return child
        return None

    wait_for(lambda: proc.poll() is not None or bridge_process() is not None, 60, "the bridge to start in the container")
    assert proc.poll() is None, log_path.read_text()
    bridge = bridge_process()
    assert bridge is not None and bridge.uids().real == bridge.uids().effective == int(image["User"].split(":")[0])
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1, g FROM generate_series(1, 5) g")
    client = redis.Redis.from_url(env.redis_server.url)
    wait_for(lambda: proc.poll() is not None or client.xlen("cdc:ride") == 5, 60, "the rides in Redis")
    assert proc.poll() is None, log_path.read_text()
    status, body = get(f"http://127.0.0.1:{port}/healthz")
    assert status == 200, body
    status, body = get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200 and re.search(r'^cdc_changes_read_total\{entity="ride"\} 5\.0$', body, re.M), body
    # stopped as `docker stop` or Kubernetes stops it: SIGTERM to the container's command (buildah itself would
    # kill it: it does not pass SIGTERM on), which exits 0, so buildah does, and lets the slot go
    bridge.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log_path.read_text()
    env.wait_slot_inactive()
    assert "hot path: compiled" in log_path.read_text()


def test_reconcile_image_repairs_a_drifted_consumer_on_the_suites_servers(reconcile_image, reconcile_container, env):
    """The nightly job's image: its default command (cdc reconcile on its config, its spec of the ride totals, Spark
    local[*] on its Java, the JDBC driver where its config says) against the suite's servers, as its non-root user."""
    assert reconcile_image["Entrypoint"] == ["cdc"] and reconcile_image["Cmd"] == ["reconcile", "--config", "/etc/cdc/cdc.yaml"]
    assert reconcile_image["User"] not in ("", "0", "root")
    env.apply_sql("10_rocket_rides.sql", "20_consumer_state.sql")
    env.copy_mappings("ride.yaml", "ride_event.yaml", "rider.yaml", "rocket.yaml")  # the image's mappings
    env.cdc("init", check=True)
    env.execute("INSERT INTO riders (id, name, email) SELECT g, 'r' || g, 'e' FROM generate_series(1, 3) g")
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 3, g FROM generate_series(1, 30) g")
    env.start_bridge()
    env.start_consumer("ride-totals")  # the group the image's spec (reconcile/ride_totals.yaml) reconciles
    wait_for(lambda: state(env, "ride-totals") == truth(env), 60, "the consumer to reach the totals")
    env.execute("UPDATE consumer_states SET total_distance = total_distance - 1 WHERE consumer = 'ride-totals' AND rider_id = 2")
    secrets = secrets_dir(env)
    (secrets / "state_dsn").write_text(env.dsn)
    (secrets / "state_dsn").chmod(0o644)
    # --uts host: Spark looks its host name up; Docker and Kubernetes put the container's in its /etc/hosts,
    # buildah's chroot isolation does not
    job = subprocess.run(in_container(reconcile_container, secrets, reconcile_image["Entrypoint"] + reconcile_image["Cmd"],
                                      "--uts", "host", CDC_POSTGRES_SLOT=env.slot,
                                      CDC_RECONCILE_STATE_DSN_FILE="/run/secrets/state_dsn"),
                         capture_output=True, text=True, timeout=400)
    assert job.returncode == 0, job.stdout + job.stderr
    assert "repaired" in job.stdout and "Traceback" not in job.stderr
    assert state(env, "ride-totals") == truth(env)
