"""Connecting to Redis the way the settings say: one server, or a cluster."""

from __future__ import annotations

import redis

from ..config import RedisSettings
from ..errors import ConfigError

__all__ = ["connect_redis"]


def connect_redis(settings: RedisSettings, **options) -> redis.Redis:
    """A client for `settings.url` (a `RedisCluster` when `settings.cluster`), same API for single keys."""
    options.setdefault("socket_connect_timeout", 5)
    options.setdefault("socket_timeout", 10)
    try:
        if settings.cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(settings.url, **options)
        return redis.Redis.from_url(settings.url, **options)
    except ValueError as exc:
        raise ConfigError(f"invalid redis url: {exc}", hint="use redis://host:port/db or rediss:// for TLS") from None
