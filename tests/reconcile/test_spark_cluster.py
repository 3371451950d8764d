"""`cdc reconcile` on a Spark standalone cluster: a master and a worker started from the installed pyspark."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import orjson
import pytest

from cdc.demo.local import free_port, wait_for

from ride_consumers import state, truth
from test_reconcile import exact_consumer

pytestmark = pytest.mark.integration


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def cluster(tmp_path):
    """A standalone master and one worker (1 core, 1 GiB) on loopback; yields (master URL, worker dir)."""
    import pyspark

    spark_class = Path(pyspark.__file__).parent / "bin" / "spark-class"
    work = tmp_path / "spark-worker"
    work.mkdir()
    env = {**os.environ, "SPARK_HOME": str(spark_class.parent.parent), "SPARK_LOCAL_IP": "127.0.0.1",
           "SPARK_LOG_DIR": str(tmp_path), "SPARK_DAEMON_MEMORY": "256m"}
    env.pop("SPARK_CONF_DIR", None)
    port = free_port()
    procs = []
    with open(tmp_path / "spark-master.log", "w") as log:
        procs.append(subprocess.Popen(
            [str(spark_class), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
             "--webui-port", str(free_port())], stdout=log, stderr=subprocess.STDOUT, env=env))
    try:
        wait_for(lambda: _listening(port), 60, "the Spark master to listen")
        url = f"spark://127.0.0.1:{port}"
        with open(tmp_path / "spark-worker.log", "w") as log:
            procs.append(subprocess.Popen(
                [str(spark_class), "org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1",
                 "--cores", "1", "--memory", "1g", "--work-dir", str(work), "--webui-port", str(free_port())],
                stdout=log, stderr=subprocess.STDOUT, env=env))
        master_log = tmp_path / "spark-master.log"
        wait_for(lambda: "Registering worker" in master_log.read_text(), 60, "the worker to register")
        yield url, work
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.mark.slow
def test_cdc_reconcile_runs_on_a_standalone_cluster_and_its_worker_does_the_read(env, cluster):
    master, work = cluster
    bridge, consumers = exact_consumer(env, rides=200, seed=11)
    try:
        env.execute("UPDATE consumer_states SET total_distance = total_distance + 7 "
                    "WHERE consumer = 'ride-totals' AND rider_id = 3")
        result = env.cdc("reconcile", "--master", master, "--json", timeout=600,
                         env={"CDC_RECONCILE_EXECUTOR_MEMORY": "512m", "CDC_RECONCILE_EXECUTOR_CORES": "1",
                              "CDC_RECONCILE_DRIVER_MEMORY": "512m"})
        assert result.returncode == 0, result.stderr
        [report] = orjson.loads(result.stdout)
        [consumer] = report["consumers"]
        assert consumer["status"] == "repaired"
        assert {tuple(d["key"].values()) for d in consumer["drift"]} == {(3,)}
        assert report["spark_start_seconds"] > 0 and report["seconds"] >= report["spark_start_seconds"] + report["read_seconds"]
        wait_for(lambda: state(env, "ride-totals") == truth(env), 60, "the consumer to carry on exactly")
    finally:
        consumers.stop()
        bridge.terminate()
        bridge.wait(30)
    print(result.stderr)
    assert f"starting Spark ({master})" in result.stderr and "Traceback" not in result.stderr
    assert "totals: reading: 4/4 partitions" in result.stderr
    # the worker launched an executor for the job: it fetched the JDBC driver from the driver and ran the read
    logs = list(work.glob("app-*/*/stderr"))
    assert logs, f"no executor ran on the worker: {sorted(p.name for p in work.iterdir())}"
    executor_log = "\n".join(p.read_text() for p in logs)
    assert re.search(r"Fetching spark://\S+/jars/postgresql\.jar", executor_log), executor_log[-3000:]
    assert re.search(r"Running task \d+\.\d+ in stage", executor_log), executor_log[-3000:]
