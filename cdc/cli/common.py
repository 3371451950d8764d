"""What the ``cdc`` subcommands share: loading the config and mappings, finding an entity, a Redis client."""

from __future__ import annotations

import argparse
import contextlib

from . import redact
from .errors import PublishError, TransientError, UsageError
from .keys import TRANSACTIONS_OWNER
from .sink.redisconn import connect_redis

__all__ = ["check_transactions_stream", "load_config", "entity_named", "redis_for", "written_streams"]


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
    mappings = load_mappings(settings.mappings, hash_key=settings.hash_key or None)
    check_transactions_stream(settings, mappings)
    return settings, mappings


def check_transactions_stream(settings, mappings) -> None:
    """Refuse a transactions stream whose key another stream or a key the bridge owns already uses."""
    from .errors import ConfigError
    from .keys import owned_key_clash

    stream = settings.transactions.stream
    if not stream:
        return
    reason = owned_key_clash(stream, {s: m.entity for m in mappings for s in m.stream_keys()})
    if reason is not None:
        raise ConfigError(f"{settings.transactions_origin}: transactions.stream {stream!r} cannot be used: {reason}",
                          hint="give the transactions stream a key of its own, such as cdc:transactions")


def written_streams(settings, mappings) -> dict[str, str]:
    """Every stream `cdc run` writes -> its entity (the transactions stream's owner: `cdc.keys.TRANSACTIONS_OWNER`)."""
    streams = {s: m.entity for m in mappings for s in m.stream_keys()}
    if settings.transactions.stream:
        streams[settings.transactions.stream] = TRANSACTIONS_OWNER
    return streams


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
