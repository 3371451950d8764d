"""Connecting to Redis the way the settings say: one server, a cluster, or a master named by Sentinel.

A Sentinel URL, ``redis+sentinel://[user:password@]host1:26379,host2:26379/<service>/<db>``
(``rediss+sentinel://`` for TLS), names the sentinels to ask and the service whose
master to use. The user and password in it are the data nodes' (master and
replicas); the sentinels' own login is ``redis.sentinel_username`` and
``redis.sentinel_password``. Every connection asks the sentinels for the master's
address (``SENTINEL get-master-addr-by-name``) and then checks with ``ROLE`` that
the server it reached is a master: after a failover a reconnection finds the
promoted replica, and a demoted master is never written to.

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

import contextlib
import socket
import ssl

import redis
from redis.connection import Connection, SSLConnection, parse_url
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool, SentinelManagedConnection

from ..config import RedisSettings
from ..errors import ConfigError, PublishError, TransientError
from ..sentinel_url import SENTINEL_SCHEMES, SentinelTarget, is_sentinel_url, parse_sentinel_url

__all__ = ["SENTINEL_SCHEMES", "SentinelTarget", "connect_redis", "connect_sentinels", "is_sentinel_url",
           "parse_sentinel_url", "redis_for", "tls_mismatch"]

#: the longest a probe of what a port speaks may wait for an answer, in seconds
PROBE_TIMEOUT = 2.0

class _MasterConnection(SentinelManagedConnection):
    """A connection to the master the sentinels name, refused unless the server says it is one.

    Sentinels can name a master that has just been demoted (their view lags a
    failover by up to its timeout); writing there would be refused (READONLY) or,
    worse, accepted by a stale master cut off from the others. ``ROLE`` settles it
    on every new connection; anything but ``master`` is a connection error, which
    every caller treats as transient (reconnect, resolve again).
    """

    def on_connect_check_health(self, check_health: bool = True) -> None:
        super().on_connect_check_health(check_health=check_health)
        if not self.connection_pool.is_master:
            return
        self.send_command("ROLE")
        try:
            reply = self.read_response()
        except redis.ResponseError as exc:
            if "NOPERM" not in str(exc):
                raise
            self.disconnect()
            raise redis.ResponseError(f"{exc} (with a sentinel url every connection checks ROLE: grant the user "
                                      "+role)") from None
        role = reply[0] if isinstance(reply, (list, tuple)) and reply else reply
        if isinstance(role, bytes):
            role = role.decode()
        if role != "master":
            self.disconnect()
            raise redis.ConnectionError(
                f"redis at {self.host}:{self.port} is a {role}, not the master of "
                f"{self.connection_pool.service_name!r} (a failover in progress); resolving again")


class _MasterSSLConnection(_MasterConnection, SSLConnection):
    pass


class _Sentinels(Sentinel):
    """The sentinels, asked the way a client should: ``SENTINEL get-master-addr-by-name``.

    (redis-py's own lookup reads ``SENTINEL MASTERS``, which needs more of the
    sentinels' ACL and answers for every service.)
    """

    def discover_master(self, service_name):
        errors = []
        refused = False
        for i, sentinel in enumerate(self.sentinels):
            try:
                reply = sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", service_name)
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
                refused |= isinstance(exc, redis.AuthenticationError)
                kwargs = sentinel.connection_pool.connection_kwargs
                errors.append(f"{kwargs['host']}:{kwargs['port']}: {exc}")
                continue
            if reply:
                host, port = (p.decode() if isinstance(p, bytes) else p for p in reply)
                self.sentinels[0], self.sentinels[i] = sentinel, self.sentinels[0]  # ask it first next time
                return host, int(port)
            errors.append(f"{sentinel.connection_pool.connection_kwargs['host']}:"
                          f"{sentinel.connection_pool.connection_kwargs['port']}: no master named {service_name!r}")
        message = f"no sentinel named the master of {service_name!r}: {'; '.join(errors)}"
        if refused:  # not a failover: retrying will not fix a wrong sentinel login
            raise redis.AuthenticationError(f"{message} (check redis.sentinel_username and redis.sentinel_password)")
        raise MasterNotFoundError(message)


def connect_sentinels(settings: RedisSettings, target: SentinelTarget | None = None, **options) -> _Sentinels:
    """A client of the sentinels themselves (with their own login), for `cdc check` and the master lookup."""
    target = target or parse_sentinel_url(settings.url)
    socket = {k: options.get(k, v) for k, v in (("socket_connect_timeout", 5), ("socket_timeout", 10))}
    sentinel_kwargs = dict(socket)
    if settings.sentinel_username:
        sentinel_kwargs["username"] = settings.sentinel_username
    if settings.sentinel_password:
        sentinel_kwargs["password"] = settings.sentinel_password
    if target.tls:
        sentinel_kwargs.update(ssl=True, **{k: v for k, v in target.options.items() if k.startswith("ssl_")})
    data_kwargs = {**target.options, **options}
    return _Sentinels(list(target.sentinels), sentinel_kwargs=sentinel_kwargs, **data_kwargs)


def _connect_master(settings: RedisSettings, **options) -> redis.Redis:
    target = parse_sentinel_url(settings.url)
    sentinels = connect_sentinels(settings, target, **options)
    login = {k: v for k, v in (("username", target.username), ("password", target.password)) if v}
    return sentinels.master_for(
        target.service, redis_class=redis.Redis, connection_pool_class=SentinelConnectionPool,
        connection_class=_MasterSSLConnection if target.tls else _MasterConnection,
        db=target.db, **login, **{**target.options, **options})


def connect_redis(settings: RedisSettings, **options) -> redis.Redis:
    """A client for `settings.url` (a `RedisCluster` when `settings.cluster`, the sentinels' master for a
    ``redis+sentinel://`` URL), same API for single keys."""
    options.setdefault("socket_connect_timeout", 5)
    options.setdefault("socket_timeout", 10)
    try:
        if is_sentinel_url(settings.url):
            return _connect_master(settings, **options)
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


@contextlib.contextmanager
def redis_for(settings):
    """A Redis client for a command; an unreachable Redis becomes one clear line."""
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
