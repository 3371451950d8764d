"""A three-node Redis Cluster for one test, started and stopped by the test's fixture."""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import time
from collections.abc import Iterator

import redis

from cdc.demo.local import LocalRedis, ServerExited, wait_for


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 50000)
        if all(_free(p) for p in (port, port + 10000)):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _start_node(servers_root, name: str) -> LocalRedis:
    """A cluster node on a free port pair; a port taken between the check and the start (another test's
    server starting at once) is given up for another."""
    for attempt in range(5):
        root = servers_root / f"{name}-{time.monotonic_ns()}"
        node = LocalRedis(root, cluster_port(), extra=["--cluster-enabled", "yes", "--cluster-config-file",
                                                       str(root / "nodes.conf"), "--cluster-node-timeout", "5000"])
        try:
            return node.start()
        except ServerExited:
            if attempt == 4 or not node.port_taken():
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def three_node_cluster(servers_root, prefix: str = "cluster") -> Iterator[list[LocalRedis]]:
    """Three nodes, the hash slots spread over them, every node ok."""
    nodes: list[LocalRedis] = []
    try:
        for i in range(3):
            nodes.append(_start_node(servers_root, f"{prefix}-{i}"))
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        for n in nodes:
            wait_for(lambda n=n: redis.Redis(port=n.port).cluster("info")["cluster_state"] == "ok",
                     30, f"cluster node {n.port} to be ok")
        yield nodes
    finally:
        for n in nodes:
            n.stop()
