"""The deployment files: they parse, the commands they run exist, the config they mount is
accepted by `cdc check`, and the server configs start real servers that the bridge can use."""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from cdc.cli import build_parser
from cdc.demo.local import LocalPostgres, free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def parses_as_cdc(argv: list[str]) -> None:
    """A command line the cdc CLI accepts (argparse exits on anything else)."""
    build_parser().parse_args(argv)


def conf_settings(path: Path) -> dict[str, str]:
    settings = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings


def test_compose_services_run_real_cdc_commands_with_secrets_that_exist():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "cdc", "cdc-init", "consumer"} <= set(services)
    for name in ("cdc", "cdc-init", "consumer"):
        service = services[name]
        parses_as_cdc(service["command"])
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"
        for secret in service.get("secrets", []):
            assert secret in compose["secrets"]
        for key, value in service.get("environment", {}).items():
            if key.endswith("_FILE"):
                assert value.startswith("/run/secrets/") and value.rsplit("/", 1)[1] in service["secrets"]
    assert services["cdc"]["command"][:1] == ["run"] and services["cdc"]["stop_signal"] == "SIGTERM"
    assert "appendonly" in (DEPLOY / "redis" / "redis.conf").read_text()
    assert (ROOT / "sql").is_dir() and (DEPLOY / "postgres" / "postgresql.conf").is_file()


def test_kubernetes_pod_wires_probes_to_the_served_port():
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "pod.yaml").read_text()))
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    pod = next(d for d in docs if d["kind"] == "Pod")
    cdc_config = yaml.safe_load(config_map["data"]["cdc.yaml"])
    port = cdc_config["http"]["port"]
    sidecar = next(c for c in pod["spec"]["containers"] if c["name"] == "cdc")
    parses_as_cdc(sidecar["args"])
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert {c["name"] for c in pod["spec"]["containers"]} == {"postgres", "cdc"}
    mounted = {m["subPath"] for m in sidecar["volumeMounts"] if "subPath" in m}
    assert mounted <= set(config_map["data"])


def test_systemd_unit_and_dockerfile_run_real_commands():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(DEPLOY / "systemd" / "cdc.service")
    service = unit["Service"]
    for key in ("ExecStart", "ExecStartPre"):
        argv = shlex.split(service[key])
        assert argv[0].endswith("/cdc")
        parses_as_cdc(argv[1:])
    assert service["KillSignal"] == "SIGTERM"
    assert set(service["RestartPreventExitStatus"].split()) == {"2", "3", "4", "5", "6"}
    docker = (DEPLOY / "Dockerfile").read_text()
    entry = re.search(r'^ENTRYPOINT \["cdc"\]$', docker, re.M)
    cmd = re.search(r"^CMD (\[.*\])$", docker, re.M)
    assert entry and cmd
    parses_as_cdc(yaml.safe_load(cmd.group(1)))
    for sources in re.findall(r"^COPY (?!--from=)(.+) \S+$", docker, re.M):  # from the repository, not a stage
        for source in sources.split():
            assert (ROOT / source).exists(), source


def test_nightly_reconciliation_schedules_run_real_commands_on_valid_specs():
    from cdc.config import Settings
    from cdc.reconcile.spec import load_specs, parse_spec

    # cron.d: environment lines, then "m h dom mon dow user command"
    lines = [ln for ln in (DEPLOY / "cron" / "cdc-reconcile").read_text().splitlines() if ln and not ln.startswith("#")]
    env_lines = dict(ln.split("=", 1) for ln in lines if re.match(r"^[A-Z_]+=", ln))
    jobs = [ln for ln in lines if not re.match(r"^[A-Z_]+=", ln)]
    assert len(jobs) == 1
    fields = jobs[0].split(None, 6)
    assert fields[:5] == ["30", "2", "*", "*", "*"]
    argv = shlex.split(fields[6])
    assert argv[0].endswith("/cdc")
    parses_as_cdc(argv[1:])
    assert "reconcile" in argv and "CDC_RECONCILE_STATE_DSN_FILE" in env_lines
    # the CronJob: its args, its mounted config and spec
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "reconcile-cronjob.yaml").read_text()))
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    cron = next(d for d in docs if d["kind"] == "CronJob")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    container = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    parses_as_cdc(container["args"])
    mounted = {m["subPath"] for m in container["volumeMounts"] if "subPath" in m}
    assert mounted <= set(config_map["data"])
    settings = Settings.from_dict(yaml.safe_load(config_map["data"]["cdc.yaml"]))
    assert settings.reconcile.specs == "/etc/cdc/reconcile"
    spec = parse_spec(yaml.safe_load(config_map["data"]["ride_totals.yaml"]))
    assert spec == parse_spec(yaml.safe_load((ROOT / "reconcile" / "ride_totals.yaml").read_text())), \
        "the CronJob mounts the repository's spec"
    # compose's nightly service and the image it builds
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    parses_as_cdc(compose["services"]["reconcile"]["command"])
    docker = (DEPLOY / "reconcile.Dockerfile").read_text()
    parses_as_cdc(yaml.safe_load(re.search(r"^CMD (\[.*\])$", docker, re.M).group(1)))
    for sources in re.findall(r"^COPY (?!--from=)(.+) \S+$", docker, re.M):  # from the repository, not a stage
        for source in sources.split():
            assert (ROOT / source).exists(), source
    assert [s.name for s in load_specs(ROOT / "reconcile")] == ["ride-totals"]


@pytest.mark.integration
def test_mounted_configs_pass_cdc_check(env):
    env.init_rides("ride.yaml")
    overrides = {"CDC_POSTGRES_DSN": env.dsn, "CDC_REDIS_URL": env.redis_server.url, "CDC_POSTGRES_SLOT": env.slot}
    cmd = [sys.executable, "-m", "cdc", "check"]
    # the container's config with the repository's mappings
    result = subprocess.run([*cmd, "--config", str(DEPLOY / "cdc.yaml")], capture_output=True, text=True,
                            env={**os.environ, **overrides, "CDC_MAPPINGS": str(ROOT / "mappings")})
    assert "ok: entity ride" in result.stdout and "entity rocket" in result.stdout
    # the Kubernetes ConfigMap's config and mapping, as mounted
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "pod.yaml").read_text()))
    data = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    (env.tmp / "k8s" / "mappings").mkdir(parents=True)
    (env.tmp / "k8s" / "cdc.yaml").write_text(data["cdc.yaml"])
    (env.tmp / "k8s" / "mappings" / "ride.yaml").write_text(data["ride.yaml"])
    result = subprocess.run([*cmd, "--config", str(env.tmp / "k8s" / "cdc.yaml")], capture_output=True, text=True,
                            env={**os.environ, **overrides, "CDC_MAPPINGS": str(env.tmp / "k8s" / "mappings")})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cdc check: 1 mapping(s) valid" in result.stdout


@pytest.mark.integration
def test_postgres_snippet_starts_a_server_the_bridge_accepts(servers_root):
    settings = conf_settings(DEPLOY / "postgres" / "postgresql.conf")
    assert settings["wal_level"] == "logical"
    server = LocalPostgres(servers_root / "deploy-snippet", settings=settings)
    server.start()
    try:
        import psycopg

        with psycopg.connect(server.dsn) as conn:
            for key, value in settings.items():
                shown = conn.execute(f"SHOW {key}").fetchone()[0]
                assert shown.lower() == value.strip("'").lower(), (key, shown, value)
    finally:
        server.stop("immediate")


@pytest.mark.integration
def test_redis_conf_acl_user_can_run_the_bridge_and_nothing_else(env, servers_root):
    root = servers_root / "deploy-redis"
    root.mkdir(exist_ok=True)
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server"), str(DEPLOY / "redis" / "redis.conf"), "--port", str(port),
         "--bind", "127.0.0.1", "--dir", str(root), "--save", ""],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        url = f"redis://cdc-bridge:change-me-bridge@127.0.0.1:{port}/0"
        wait_for(lambda: redis.Redis.from_url(url).ping(), 30, "redis with the deploy config")
        env.write_config(redis_url=url)
        env.init_rides("ride.yaml", sql=("10_rocket_rides.sql", "20_consumer_state.sql"), riders=1)
        env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1, g FROM generate_series(1, 10) g")
        env.cdc("run", "--until-caught-up", check=True)
        client = redis.Redis.from_url(url)
        assert client.xlen("cdc:ride") == 10
        consumer = env.start_consumer("g")
        try:
            wait_for(lambda: env.execute("SELECT total_distance FROM consumer_states WHERE rider_id = 0") == [(55,)],
                     30, "the consumer, under the ACL user, to total the rides")
        finally:
            consumer.terminate()
            consumer.wait(30)
        # what a consumer does with an entry its handler keeps failing on: count, retry it alone, dead-letter
        from cdc.consume.consumer import Consumer

        def fail_on_the_first(entries):
            if entries and entries[0].id == first_id:
                raise ValueError("no")

        first_id = client.xrange("cdc:ride", count=1)[0][0].decode()
        failing = Consumer(client, ["cdc:ride"], "acl", "c", exclusive=False, max_deliveries=2, block_ms=10)
        failing.create_group("0")
        wait_for(lambda: failing.process(failing.read(), fail_on_the_first) or failing.acked == 9, 30,
                 "the other nine rides acknowledged")
        wait_for(lambda: failing.process(failing.read(), fail_on_the_first) or client.xlen("cdc:dlq:acl") == 1, 30,
                 "the failing ride dead-lettered")
        assert failing.failed == 2 and client.xpending("cdc:ride", "acl")["pending"] == 0
        for command in ("status", "trim"):
            env.cdc(command, check=True)
        # what cdc reconcile does in Redis: hold the stream, re-read it and the group, release
        from cdc.reconcile.job import _hold, _release
        from cdc.reconcile.reset import plan_stream

        holds = _hold(client, ["cdc:ride"], "reconcile:acl")
        plan = plan_stream(client, "cdc:ride", "g", (0, -1), "0-0", 2**63, holds["cdc:ride"])
        assert plan.behind and plan.catch_up == []
        _release(client, holds, "reconcile:acl")
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set("other:key", "x")
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=port).ping()  # the default user is off
        client.close()
    finally:
        proc.terminate()
        proc.wait(30)


def dockerfile_instructions(path: Path) -> dict[str, list[str]]:
    """Each instruction's arguments, by instruction (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            found.setdefault(word.upper(), []).append(rest.strip())
    return found


def makefile_variable(name: str) -> str:
    found = re.search(rf"^{name}\s*:?=\s*(\S+)\s*$", (ROOT / "Makefile").read_text(), re.M)
    assert found, f"Makefile: no {name} := ..."
    return found.group(1)


def makefile_recipe(target: str) -> list[str]:
    found = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert found, f"Makefile: no recipe for {target}"
    return [line.strip() for line in found.group(1).splitlines()]


def image_contract(dockerfile: str, target: str, variable: str) -> dict:
    """What `make <target>` builds from deploy/<dockerfile>: its tag, user, config path, command, port, probe."""
    tag = makefile_variable(variable)
    assert f"deploy/buildah-build.sh deploy/{dockerfile} $({variable})" in makefile_recipe(target)
    docker = dockerfile_instructions(DEPLOY / dockerfile)
    assert f"docker build -f deploy/{dockerfile} -t {tag} ." in (DEPLOY / dockerfile).read_text(), \
        "the Dockerfile's own build command tags it as make does"
    assert docker["ARG"][0] == "BASE=python:3.11-slim" and all(f == "${BASE}" or f.startswith("${BASE} AS ") for f in docker["FROM"])
    user = docker["USER"][-1]
    # Kubernetes' runAsNonRoot can only check a numeric user
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) != 0, user
    copied = {source: copy.split()[-1] for copy in docker["COPY"] if not copy.startswith("--from=") for source in copy.split()[:-1]}
    config, mappings = copied["deploy/cdc.yaml"], copied["cdc/demo/mappings"]
    assert yaml.safe_load(docker["ENTRYPOINT"][-1]) == ["cdc"]
    cmd = yaml.safe_load(docker["CMD"][-1])
    assert cmd[cmd.index("--config") + 1] == config
    return {"tag": tag, "config": config, "mappings": mappings, "cmd": cmd, "docker": docker}


def test_compose_and_kubernetes_run_the_images_the_build_makes():
    """The image names, config path, port and probes that compose and Kubernetes use are the ones the Dockerfiles
    and the Makefile build (tests/ops/test_image.py builds and runs the bridge's image)."""
    bridge = image_contract("Dockerfile", "image", "IMAGE")
    reconcile = image_contract("reconcile.Dockerfile", "reconcile-image", "RECONCILE_IMAGE")
    assert bridge["tag"] == "cdc:latest" and reconcile["tag"] == "cdc-reconcile:latest"
    assert bridge["config"] == reconcile["config"] == "/etc/cdc/cdc.yaml"
    config = yaml.safe_load((DEPLOY / "cdc.yaml").read_text())
    assert config["mappings"] == bridge["mappings"] == reconcile["mappings"]
    port = config["http"]["port"]
    assert port == 9187 and bridge["docker"]["EXPOSE"] == [str(port)]
    healthcheck = bridge["docker"]["HEALTHCHECK"][-1]
    assert f"http://127.0.0.1:{port}/healthz" in healthcheck
    # compose: each service builds and names the image its Dockerfile makes, and runs it on its config
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    images = {"deploy/Dockerfile": bridge, "deploy/reconcile.Dockerfile": reconcile}
    built = {name: s for name, s in compose["services"].items() if "build" in s}
    assert set(built) == {"cdc-init", "cdc", "consumer", "reconcile"}
    for name, service in built.items():
        image = images[service["build"]["dockerfile"]]
        assert service["build"]["context"] == ".." and service["image"] == image["tag"], name
        command = service["command"]
        assert command[command.index("--config") + 1] == image["config"], name
    assert compose["services"]["cdc"]["ports"] == [f"{port}:{port}"]
    assert built["cdc"]["command"] == bridge["cmd"] and built["reconcile"]["command"] == reconcile["cmd"]
    # the pod's sidecar: the image, its config mounted where the image reads it, the port, the probes
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "pod.yaml").read_text()))
    pod = next(d for d in docs if d["kind"] == "Pod")
    sidecar = next(c for c in pod["spec"]["containers"] if c["name"] == "cdc")
    assert sidecar["image"] == bridge["tag"] and sidecar["args"] == bridge["cmd"]
    mounts = {m["mountPath"]: m.get("subPath") for m in sidecar["volumeMounts"]}
    assert mounts[bridge["config"]] == "cdc.yaml"
    assert all(path == bridge["config"] or path.startswith(bridge["mappings"] + "/") or path.startswith("/var/run/secrets/")
               for path in mounts)
    assert sidecar["ports"] == [{"name": "metrics", "containerPort": port}]
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    assert sidecar["securityContext"]["runAsNonRoot"] is True
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    assert yaml.safe_load(config_map["data"]["cdc.yaml"])["http"]["port"] == port
    # the nightly CronJob: the reconcile image on its config
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "reconcile-cronjob.yaml").read_text()))
    cron = next(d for d in docs if d["kind"] == "CronJob")
    container = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == reconcile["tag"] and container["args"] == reconcile["cmd"]
    assert {m["mountPath"]: m.get("subPath") for m in container["volumeMounts"]}[reconcile["config"]] == "cdc.yaml"
    assert container["securityContext"]["runAsNonRoot"] is True
