"""A Redis master, its replica and three sentinels on loopback ports, for failover tests.

The sentinels notice a dead master after `down_after_ms` and promote the replica;
with the small timeouts used here a failover completes in a few seconds. Every
wait is a condition polled with a deadline.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

import redis

from cdc.demo.local import LocalRedis, free_port, wait_for

SERVICE = "mymaster"


class LocalSentinel:
    """One `redis-server --sentinel` watching `service`, its config file (which it rewrites) in `root`."""

    def __init__(self, root: Path, master_port: int, *, service: str = SERVICE, down_after_ms: int = 1000,
                 failover_timeout_ms: int = 3000, quorum: int = 2, password: str = "", users: tuple[str, ...] = ()) -> None:
        self.root = Path(root)
        self.port = free_port()
        self.lines = [
            f"port {self.port}", "bind 127.0.0.1", f"dir {self.root}", f"logfile {self.root / 'sentinel.log'}",
            f"sentinel monitor {service} 127.0.0.1 {master_port} {quorum}",
            f"sentinel down-after-milliseconds {service} {down_after_ms}",
            f"sentinel failover-timeout {service} {failover_timeout_ms}",
            f"sentinel parallel-syncs {service} 1",
            *([f"requirepass {password}"] if password else []),
            *users,  # ACL users: "user <name> on >password <rules>"
        ]
        self.password = password
        self.proc: subprocess.Popen | None = None

    def start(self) -> "LocalSentinel":
        self.root.mkdir(parents=True, exist_ok=True)
        conf = self.root / "sentinel.conf"
        conf.write_text("\n".join(self.lines) + "\n")
        self.proc = subprocess.Popen([shutil.which("redis-server"), str(conf), "--sentinel"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(self.ready, 30, f"sentinel on port {self.port}")
        return self

    def ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            log = (self.root / "sentinel.log").read_text(errors="replace")[-1000:]
            raise RuntimeError(f"the sentinel exited with {self.proc.returncode}: {log}")
        return self.client().ping()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password or None, socket_timeout=2, decode_responses=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


class LocalSentinelGroup:
    """A master, its replicas (`replicaof`) and three sentinels; `url` names them the way cdc does."""

    def __init__(self, root: Path, *, replicas: int = 1, sentinels: int = 3, down_after_ms: int = 1000,
                 failover_timeout_ms: int = 3000, sentinel_password: str = "", sentinel_users: tuple[str, ...] = (),
                 redis_extra: tuple[str, ...] = ()) -> None:
        self.root = Path(root)
        self.master = LocalRedis(self.root / "node-a", extra=["--appendfsync", "always", *redis_extra])
        self.replicas = [LocalRedis(self.root / f"node-{chr(ord('b') + i)}", extra=["--appendfsync", "always", *redis_extra])
                         for i in range(replicas)]
        self.replica = self.replicas[0]
        self.sentinel_password = sentinel_password
        self.sentinels = [
            LocalSentinel(self.root / f"sentinel-{i}", self.master.port, down_after_ms=down_after_ms,
                          failover_timeout_ms=failover_timeout_ms, password=sentinel_password, users=sentinel_users)
            for i in range(sentinels)
        ]
        #: both data nodes, by port: the master changes at a failover
        self.nodes = {node.port: node for node in (self.master, *self.replicas)}

    @property
    def url(self) -> str:
        return f"redis+sentinel://{','.join(f'127.0.0.1:{s.port}' for s in self.sentinels)}/{SERVICE}/0"

    def start(self) -> "LocalSentinelGroup":
        self.master.start()
        for replica in self.replicas:
            replica.extra += ["--replicaof", "127.0.0.1", str(self.master.port)]
            replica.start()
            wait_for(lambda: self.link_up(replica), 30, "the replica to sync with the master")
        for s in self.sentinels:
            s.start()
        # every sentinel knows the replicas and the others before a failover can be tested
        wait_for(lambda: all(len(s.client().sentinel_slaves(SERVICE)) == len(self.replicas) and
                             s.client().sentinel_master(SERVICE)["num-other-sentinels"] == len(self.sentinels) - 1
                             for s in self.sentinels), 30, "the sentinels to discover the replica and each other")
        return self

    @staticmethod
    def client_of(node: LocalRedis) -> redis.Redis:
        return redis.Redis(port=node.port, socket_timeout=2, decode_responses=True)

    def link_up(self, node: LocalRedis) -> bool:
        return self.client_of(node).info("replication").get("master_link_status") == "up"

    def named_master(self) -> int | None:
        """The master port a majority of the live sentinels name (None while they disagree)."""
        ports = []
        for s in self.sentinels:
            try:
                ports.append(int(s.client().sentinel_get_master_addr_by_name(SERVICE)[1]))
            except (redis.RedisError, TypeError):
                continue
        best = max(set(ports), key=ports.count, default=None)
        return best if best is not None and ports.count(best) * 2 > len(self.sentinels) else None

    def current_master(self) -> LocalRedis:
        return self.nodes[self.named_master()]

    def kill_master(self) -> LocalRedis:
        """kill -9 the master the sentinels name; returns it (stopped)."""
        node = self.current_master()
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(10)
        node.proc = None
        return node

    def wait_promoted(self, old: LocalRedis, timeout: float = 60) -> LocalRedis:
        """Until the sentinels name a master other than `old` and it says it is one; returns it."""

        def promoted():
            port = self.named_master()
            if port is None or port == old.port:
                return None
            return self.nodes[port] if self.client_of(self.nodes[port]).role()[0] == "master" else None

        return wait_for(promoted, timeout, "the sentinels to promote the replica")

    def stop(self) -> None:
        for s in self.sentinels:
            s.stop()
        for node in self.nodes.values():
            node.stop()
