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
still run, is fenced and can no longer renew. A consumer of another name waits
for the TTL to run out.
"""

from __future__ import annotations

import logging
import time
import uuid

import redis

from .. import keys

__all__ = ["Lease"]

log = logging.getLogger("cdc.lease")

# ARGV: token, ttl, name, take back from the same name (1/0). The token is
# "<12 hex digits>:<name>", so the holder's name is the text from character 14.
ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder and not (ARGV[4] == '1' and string.sub(holder, 14) == ARGV[3]) then
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
        epoch = int(self._acquire(keys=[self.key, self.epoch_key], args=[self.owner, self.ttl_ms, self.name, take_back]))
        self._took_back = True
        if epoch:
            self.epoch = epoch
            self.expires_at = started + self.ttl_ms / 1000
            log.info("lease on %s for group %s acquired by %s (epoch %d)", self.stream, self.group, self.owner, epoch)
            return True
        return False

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
