"""What the ``cdc`` subcommands share: loading the config and mappings, finding an entity."""

from __future__ import annotations

import argparse

from .. import redact
from ..errors import UsageError

__all__ = ["check_transactions_stream", "load_config", "entity_named"]


def load_config(args: argparse.Namespace):
    from ..config import Settings
    from ..mapping.model import load_mappings

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
    from ..errors import ConfigError
    from ..keys import owned_key_clash

    stream = settings.transactions.stream
    if not stream:
        return
    reason = owned_key_clash(stream, {s: m.entity for m in mappings for s in m.stream_keys()})
    if reason is not None:
        raise ConfigError(f"{settings.transactions_origin}: transactions.stream {stream!r} cannot be used: {reason}",
                          hint="give the transactions stream a key of its own, such as cdc:transactions")


def entity_named(mappings, name: str):
    for m in mappings:
        if m.entity == name:
            return m
    raise UsageError(f"--entity: no entity {name!r}", hint=f"entities: {', '.join(m.entity for m in mappings)}")
