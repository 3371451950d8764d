"""Sentinel URLs, ``redis+sentinel://[user:password@]host1:26379,host2:26379/<service>/<db>``, read.

Pure parsing, shared by the settings (which check a URL as they load) and `cdc.sink.redisconn`
(which connects to the master it names).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import unquote

from redis.connection import parse_url

from .errors import ConfigError

__all__ = ["SENTINEL_SCHEMES", "SentinelTarget", "is_sentinel_url", "parse_sentinel_url"]

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_SENTINEL_HINT = "write it as redis+sentinel://user:password@host1:26379,host2:26379/<service>/0 (rediss+sentinel:// for TLS)"


@dataclass(frozen=True)
class SentinelTarget:
    """What a Sentinel URL names: the sentinels, the service, and how to log in to its data nodes."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    #: the query's options (TLS files, timeouts), as redis-py reads them from a URL
    options: dict = field(default_factory=dict, repr=False)

    def describe(self) -> str:
        """For messages: the service and the sentinels, never a password."""
        return f"redis master {self.service!r} (sentinels {', '.join(f'{h}:{p}' for h, p in self.sentinels)})"


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str, what: str = "redis.url") -> SentinelTarget:
    """The parts of a ``redis+sentinel://`` URL; a malformed one is a ConfigError naming `what`."""
    scheme, _, rest = url.partition("://")
    userinfo, _, rest = rest.rpartition("@")  # the login first: a password may hold '/' or ','
    hosts, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    sentinels: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep:
            host, port = item.strip(), "26379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{what}: sentinel address {item.strip()!r} is not host:port", hint=_SENTINEL_HINT)
        sentinels.append((host, int(port)))
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise ConfigError(f"{what} names no sentinel service (the master's name, as in sentinel.conf)", hint=_SENTINEL_HINT)
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ConfigError(f"{what}: {'/'.join(parts)!r} is not <service>/<database number>", hint=_SENTINEL_HINT)
    tls = scheme.lower() == "rediss+sentinel"
    try:  # the query options (ssl_ca_certs, socket timeouts, ...) exactly as redis-py reads them
        options = parse_url(f"{'rediss' if tls else 'redis'}://placeholder/0{'?' + query if query else ''}")
    except ValueError as exc:
        raise ConfigError(f"{what}: {exc}", hint=_SENTINEL_HINT) from None
    for key in ("host", "port", "db", "connection_class", "username", "password"):
        options.pop(key, None)
    username, _, password = userinfo.partition(":")
    return SentinelTarget(tuple(sentinels), unquote(parts[0]), int(parts[1]) if len(parts) == 2 else 0, tls,
                          unquote(username) or None, unquote(password) or None, options)
