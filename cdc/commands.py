"""What the ``cdc`` subcommands share: loading the config and mappings, finding an entity, a Redis client."""

from __future__ import annotations

import argparse
import contextlib

from . import redact
from .errors import PublishError, TransientError, UsageError
from .sink.redisconn import connect_redis

__all__ = ["load_config", "entity_named", "redis_for"]


def load_config(args: argparse.Namespace):
    from .config import Settings
    from .mapping.model import load_mappings

    settings = Settings.from_file(args.config)
    for secret in (settings.postgres.dsn, settings.redis.url, settings.reconcile.state_dsn):
        redact.register(secret)
    if settings.hash_key:
        redact.register_secret(settings.hash_key.decode())
    if settings.redis.sentinel_password:
        redact.register_secret(settings.redis.sentinel_password)
    return settings, load_mappings(settings.mappings, hash_key=settings.hash_key or None)


def entity_named(mappings, name: str):
    for m in mappings:
        if m.entity == name:
            return m
    raise UsageError(f"--entity: no entity {name!r}", hint=f"entities: {', '.join(m.entity for m in mappings)}")


@contextlib.contextmanager
def redis_for(settings):
    """A Redis client for a command; an unreachable Redis becomes one clear line."""
    import redis

    client = connect_redis(settings.redis)
    try:
        yield client
    except redis.AuthenticationError as exc:  # a ConnectionError to redis-py, but retrying will not fix it
        raise PublishError(f"redis refused the login: {exc}", hint="check the user and password in redis.url") from exc
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise TransientError(f"redis unavailable: {exc}") from exc
    except redis.RedisError as exc:
        raise PublishError(f"redis refused: {exc}", hint="check the redis user's ACL and the keys it may use") from exc
    finally:
        client.close()
