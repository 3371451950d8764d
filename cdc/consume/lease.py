"""Leases: at most one consumer of a group reads a stream at a time.

Per-key order across many consumers comes from giving each partition stream to
one consumer at a time. A lease is a Redis key with a time to live, renewed by
its holder; each acquisition takes a new epoch from a counter, and consumers that
write state stamp it with their epoch so that an old holder that wakes up late
(a long pause, a partition) is fenced off instead of overwriting newer state.
"""

from __future__ import annotations

import logging
import time

import redis

from .. import keys

__all__ = ["Lease"]

log = logging.getLogger("cdc.lease")

ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return 0
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

    def __init__(self, client: redis.Redis, stream: str, group: str, owner: str, ttl_ms: int = 10_000) -> None:
        self.client = client
        self.stream = stream
        self.group = group
        self.owner = owner
        self.ttl_ms = ttl_ms
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
        epoch = int(self._acquire(keys=[self.key, self.epoch_key], args=[self.owner, self.ttl_ms]))
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
