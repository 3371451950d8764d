"""Leases: at most one consumer of a group reads a stream at a time.

Per-key order across many consumers comes from giving each partition stream to
one consumer at a time. A lease is a Redis key with a time to live, renewed by
its holder; each acquisition takes a new epoch from a counter, and consumers that
write state stamp it with their epoch so that an old holder that wakes up late
(a long pause, a partition) is fenced off instead of overwriting newer state.

The key holds ``<instance>:<name>``: the consumer's name and a random id of the
running process. A lease held under the same name by another instance is taken
back at once, once, when a process first asks for it: that is the same consumer
restarted after a crash, and it need not wait for the dead instance's TTL. The
take-back draws a new epoch like any acquisition, so the old instance, should it
still run, is fenced and can no longer renew.

A consumer of another name waits for the TTL to run out, unless the holder's name
is the default ``<this host>-<pid>`` of a process that no longer exists here: a
consumer that died on this machine, whose lease it takes over at once. Each
instance does that at most once per stream, so two processes that cannot see each
other's pids (separate PID namespaces under one host name) settle instead of
taking the lease from each other forever.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid

import redis

from .. import keys

__all__ = ["Lease"]

log = logging.getLogger("cdc.lease")

# ARGV: token, ttl, name, take back from the same name (1/0), a dead holder's token
# to replace ('' for none). The token is "<12 hex digits>:<name>", so the holder's
# name is the text from character 14.
ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[5] and not (ARGV[4] == '1' and string.sub(holder, 14) == ARGV[3]) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('INCR', KEYS[2])
"""
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def local_pid(name: str, hostname: str) -> int | None:
    """The pid in a default consumer name (`<hostname>-<pid>`) of this host; None for any other name."""
    prefix = hostname + "-"
    rest = name[len(prefix):]
    return int(rest) if name.startswith(prefix) and rest.isdigit() else None


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


class Lease:
    """One consumer's claim on one stream for one group."""

    def __init__(self, client: redis.Redis, stream: str, group: str, name: str, ttl_ms: int = 2_000,
                 instance: str | None = None) -> None:
        self.client = client
        self.stream = stream
        self.group = group
        self.name = name
        self.owner = f"{instance or uuid.uuid4().hex[:12]}:{name}"
        self.ttl_ms = ttl_ms
        self._took_back = False  # the one take-back from an earlier instance of the same name is spent
        self._took_over_dead = False  # the one takeover from a dead process of this host is spent
        self.key = keys.lease_key(stream, group)
        self.epoch_key = keys.lease_epoch_key(stream, group)
        self.epoch = 0
        self.expires_at = 0.0
        self._acquire = client.register_script(ACQUIRE)
        self._renew = client.register_script(RENEW)
        self._release = client.register_script(RELEASE)

    @property
    def held(self) -> bool:
        return self.epoch > 0 and time.monotonic() < self.expires_at

    def try_acquire(self) -> bool:
        started = time.monotonic()
        take_back = "0" if self._took_back else "1"
        dead = "" if self._took_over_dead else self._dead_local_holder()
        epoch = int(self._acquire(keys=[self.key, self.epoch_key],
                                  args=[self.owner, self.ttl_ms, self.name, take_back, dead]))
        self._took_back = True
        if epoch:
            self.epoch = epoch
            self.expires_at = started + self.ttl_ms / 1000
            self._took_over_dead = self._took_over_dead or bool(dead)
            how = f", from {dead[13:]} whose process is gone" if dead else ""
            log.info("lease on %s for group %s acquired by %s (epoch %d%s)", self.stream, self.group, self.owner, epoch, how)
            return True
        return False

    def _dead_local_holder(self) -> str:
        """The holder's token when it names a process of this host that no longer exists, else ''."""
        holder = self.client.get(self.key)
        if holder is None:
            return ""
        token = holder.decode() if isinstance(holder, bytes) else str(holder)
        pid = local_pid(token[13:], socket.gethostname())
        if pid is None or pid == os.getpid() or _process_exists(pid):
            return ""
        return token

    def renew(self) -> bool:
        """Extend the lease; False (and no longer held) if it was lost."""
        if not self.epoch:
            return False
        started = time.monotonic()
        if int(self._renew(keys=[self.key], args=[self.owner, self.ttl_ms])):
            self.expires_at = started + self.ttl_ms / 1000
            return True
        log.warning("lease on %s for group %s lost by %s", self.stream, self.group, self.owner)
        self.epoch = 0
        return False

    def release(self) -> None:
        if self.epoch:
            self._release(keys=[self.key], args=[self.owner])
            self.epoch = 0
