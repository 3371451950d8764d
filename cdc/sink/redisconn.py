"""Connecting to Redis the way the settings say: one server, or a cluster.

Every connection this module makes says why it failed when the cause is not transient, as the
connection is made (so wherever it is made: the bridge, the consumers, `cdc check`, `cdc status`):

- a refused login is a `PublishError` (exit 5) naming the server (``host:port``, never the
  password) and the fix: retrying it would only be refused again;
- a TLS mismatch (``rediss://`` against a plain-text port, or ``redis://`` against a TLS port) is a
  `ConfigError` (exit 2) naming the server and the scheme to use, found within the connect
  timeout: the TLS handshake is bounded by it, and a failed connection probes what the port speaks.

Anything else stays a redis-py error for the caller to retry (unreachable, timed out).
"""

from __future__ import annotations

import socket
import ssl

import redis
from redis.connection import Connection, SSLConnection, parse_url

from ..config import RedisSettings
from ..errors import ConfigError, PublishError

__all__ = ["connect_redis", "tls_mismatch"]

#: the longest a probe of what a port speaks may wait for an answer, in seconds
PROBE_TIMEOUT = 2.0


def connect_redis(settings: RedisSettings, **options) -> redis.Redis:
    """A client for `settings.url` (a `RedisCluster` when `settings.cluster`), same API for single keys."""
    options.setdefault("socket_connect_timeout", 5)
    options.setdefault("socket_timeout", 10)
    try:
        base = parse_url(settings.url).get("connection_class", Connection)
        options.setdefault("connection_class", _diagnosing(base))
        if settings.cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(settings.url, **options)
        return redis.Redis.from_url(settings.url, **options)
    except ValueError as exc:
        raise ConfigError(f"invalid redis url: {exc}", hint="use redis://host:port/db or rediss:// for TLS") from None


def _speaks_plain_redis(host: str, port: int) -> bool:
    """Whether `host:port` answers a plain-text PING (with +PONG, or an error such as NOAUTH)."""
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT) as raw:
            raw.sendall(b"PING\r\n")
            return raw.recv(1)[:1] in (b"+", b"-")
    except OSError:
        return False


def _speaks_tls(host: str, port: int) -> bool:
    """Whether `host:port` answers a TLS handshake (even to refuse it: no client certificate)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT) as raw:
            with context.wrap_socket(raw, server_hostname=host):
                return True
    except ssl.SSLError as exc:  # an alert is TLS; bytes that are no TLS record are not
        return not any(word in str(exc) for word in ("WRONG_VERSION_NUMBER", "wrong version number",
                                                     "record layer failure", "packet length too long",
                                                     "unknown protocol", "RECORD_LAYER_FAILURE"))
    except OSError:
        return False


def tls_mismatch(host: str, port: int, tls: bool) -> ConfigError | None:
    """The TLS mismatch that explains a failed connection to `host:port` (`tls`: the client used TLS), if any."""
    where = f"redis at {host}:{port}"
    if tls and _speaks_plain_redis(host, port):
        return ConfigError(f"{where} speaks plain text, but redis.url asks for TLS (rediss://)",
                           hint="use redis:// for this port, or the port Redis serves TLS on (its tls-port)")
    if not tls and _speaks_tls(host, port):
        return ConfigError(f"{where} speaks TLS only, but redis.url is plain text (redis://)",
                           hint="use rediss:// with the server's CA (?ssl_ca_certs=...&ssl_cert_reqs=required), "
                                "and ssl_certfile/ssl_keyfile if it asks for a client certificate")
    return None


def _looks_like_tls_mismatch(exc: Exception, tls: bool) -> bool:
    """Whether a failure to connect is the kind a TLS mismatch gives (worth probing the port), not
    a refused connection: a TLS handshake left unanswered by a plain-text port, or a plain-text
    command cut off by a TLS port."""
    text = str(exc).lower()
    cut = any(word in text for word in ("reset", "closed", "eof", "ssl", "tls"))
    return cut or (tls and isinstance(exc, redis.TimeoutError))


_DIAGNOSING: dict[type, type] = {}


def _diagnosing(base: type) -> type:
    """`base` (redis-py's connection class for the URL's scheme) whose failures to connect say why."""
    if base in _DIAGNOSING:
        return _DIAGNOSING[base]

    class DiagnosingConnection(base):  # type: ignore[valid-type, misc]
        def _connect(self):
            if not isinstance(self, SSLConnection):
                return super()._connect()
            # the TLS handshake is part of connecting: bounded by the connect timeout, not the read timeout
            timeout = self.socket_timeout
            self.socket_timeout = self.socket_connect_timeout
            try:
                sock = super()._connect()
            finally:
                self.socket_timeout = timeout
            sock.settimeout(timeout)
            return sock

        def connect_check_health(self, *args, **kwargs):
            try:
                return super().connect_check_health(*args, **kwargs)
            except redis.AuthenticationError as exc:
                raise PublishError(
                    f"redis at {self._host_error()} refused the login: {exc}",
                    hint="check the user and password in redis.url (percent-encoded; a file in CDC_REDIS_URL_FILE) "
                         "against the server's ACL users (deploy/redis/redis.conf)",
                ) from None
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                host, port = getattr(self, "host", None), getattr(self, "port", None)
                if host and port and _looks_like_tls_mismatch(exc, isinstance(self, SSLConnection)):
                    mismatch = tls_mismatch(host, int(port), isinstance(self, SSLConnection))
                    if mismatch is not None:
                        raise mismatch from None
                if isinstance(exc, redis.TimeoutError) and self._host_error() not in str(exc):
                    raise redis.TimeoutError(f"timeout connecting to redis at {self._host_error()} "
                                             f"(after {self.socket_connect_timeout:g}s)") from exc
                raise

    DiagnosingConnection.__name__ = DiagnosingConnection.__qualname__ = f"Diagnosing{base.__name__}"
    _DIAGNOSING[base] = DiagnosingConnection
    return DiagnosingConnection
