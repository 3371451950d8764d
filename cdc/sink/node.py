"""One connection to one Redis server, spoken to in raw pipelines, and what its errors mean.

The publisher writes whole pipelines of packed commands and reads their replies
with its own hiredis reader: a batch can hold thousands of replies (one per
queued command in a transaction), and reading them through redis-py's
per-reply Python path would cost more than Redis spends appending. Error
replies are returned as exception objects in the reply list, never raised, so
a caller can tell which command of a pipeline failed.
"""

from __future__ import annotations

from collections.abc import Callable

import hiredis
import orjson
import redis
from redis._parsers.base import BaseParser
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    ConnectionError as RedisConnectionError,
    MovedError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TimeoutError as RedisTimeoutError,
    TryAgainError,
)

from ..errors import PublishError, TransientError
from ..source.lsn import lsn_text

__all__ = ["DEFAULT_BULK_LIMIT", "Node", "PLAIN", "classify", "coalesce", "largest_argument", "oversize_error"]

TRANSIENT_REPLIES = ("OOM", "LOADING", "BUSY", "READONLY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "NOREPLICAS")
#: every command the bridge's writes may send (its ACL user needs each; `cdc check` asks for them)
WRITE_COMMANDS = ("multi", "exec", "watch", "mget", "type", "xadd", "set", "get", "wait", "ping", "evalsha", "script")
_RECV_SIZE = 1 << 16
#: in `Node.receive`'s replies, an array of bulk and simple strings checked without being parsed
PLAIN = ("an array of bulk and simple strings, unparsed",)
_COALESCE_BELOW = 1 << 16  # commands shorter than this are joined into one write (`coalesce`)
#: the smallest `proto-max-bulk-len` Redis accepts: a command no longer than this has no argument over any limit
_SMALLEST_BULK_LIMIT = 1 << 20
#: Redis' default `proto-max-bulk-len`, assumed where `CONFIG GET` is not allowed
DEFAULT_BULK_LIMIT = 512 << 20


def coalesce(commands: list[bytes]) -> list[bytes]:
    """The writes that send `commands`: the small ones joined, a large one (a transaction's XADDs) as it
    is. Joining a batch's hundreds of kilobytes into one more buffer cost a copy and fresh memory
    pages per batch, for one write call fewer."""
    writes: list[bytes] = []
    small: list[bytes] = []
    for command in commands:
        if len(command) < _COALESCE_BELOW:
            small.append(command)
            continue
        if small:
            writes.append(b"".join(small))
            small = []
        writes.append(command)
    if small:
        writes.append(b"".join(small))
    return writes


def largest_argument(commands: list[bytes]) -> tuple[int, list[bytes]]:
    """The size of the largest argument of the RESP commands joined in `commands`, with the arguments of
    the command holding it (for a message: the stream, field names, position and the large value)."""
    best = 0
    context: list[bytes] = []
    for packed in commands:
        at = 0
        while at < len(packed):
            eol = packed.index(b"\r\n", at)
            count = int(packed[at + 1:eol])  # *N
            at = eol + 2
            starts: list[tuple[int, int]] = []
            top = 0
            for _ in range(count):
                eol = packed.index(b"\r\n", at)
                size = int(packed[at + 1:eol])  # $len
                starts.append((eol + 2, size))
                top = max(top, size)
                at = eol + 2 + size + 2
            if top > best:
                best, context = top, [packed[start:start + size] for start, size in starts]
    return best, context


def _largest_field(record: bytes) -> str | None:
    """The name of the largest value of a JSON record (an entry's `data`), None if it is not one."""
    try:
        fields = orjson.loads(record)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(fields, dict) or not fields:
        return None
    return max(fields, key=lambda name: len(orjson.dumps(fields[name])))


def oversize_error(size: int, limit: int, args: list[bytes]) -> PublishError:
    """The error for an argument of `size` bytes that Redis' `proto-max-bulk-len` (`limit`) refuses."""
    where = ""
    if len(args) > 3 and args[0].upper() == b"XADD":
        pairs = list(zip(args[3::2], args[4::2]))
        fields = dict(pairs)
        where = f" in an entry of {args[1].decode(errors='replace')}"
        if fields.get(b"lsn", b"").isdigit():
            where += f" (source transaction at {lsn_text(int(fields[b'lsn']))})"
        big = next((name for name, value in pairs if len(value) == size), None)
        if big is not None:
            column = _largest_field(fields[big]) if big == b"data" else None
            where += f", field {column!r}" if column else f", entry field {big.decode(errors='replace')!r}"
    return PublishError(
        f"a value of {size} bytes{where} is larger than Redis accepts in one argument "
        f"(proto-max-bulk-len {limit}); the slot is held before its change",
        hint="raise proto-max-bulk-len in the Redis configuration above the value's size (CONFIG SET "
             "proto-max-bulk-len), or publish the column hashed (hash: hmac-sha256) or not at all in its mapping, "
             "then start the bridge again")


def classify(exc: Exception) -> Exception:
    """The error the bridge acts on: transient (reconnect and retry) or a clear publish error."""
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, BusyLoadingError, ReadOnlyError, OSError,
                        MovedError, AskError, TryAgainError, ClusterDownError)):
        return TransientError(f"redis unavailable: {exc}")
    if isinstance(exc, ResponseError):
        text = str(exc)
        if isinstance(exc, OutOfMemoryError) or text.startswith(TRANSIENT_REPLIES) or "maxmemory" in text:
            return TransientError(f"redis refused the write for now: {text}")
        if "NOPERM" in text:
            return PublishError(f"redis denied a command: {text}",
                                hint="grant the bridge's ACL user " + ", ".join(c.upper() for c in WRITE_COMMANDS)
                                + " on its keys (deploy/redis/redis.conf has the rule)")
        return PublishError(f"redis rejected the batch: {text}")
    return exc


class Node:
    """One Redis server and the one connection kept to it for raw pipelines."""

    def __init__(self, name: str, pool: redis.ConnectionPool) -> None:
        self.name = name
        self.pool = pool
        self.conn = None
        self._reader: hiredis.Reader | None = None
        #: connections made so far: state kept on a connection (WATCH) is gone when this changes
        self.connects = 0
        #: the commands longer than any bulk limit of the latest send holding one: judged only if a write fails
        self._large: list[bytes] = []

    def connection(self):
        if self.conn is None:
            try:
                self.conn = self.pool.get_connection()
                self.conn.connect()
            except Exception as exc:
                self.conn = None
                raise classify(exc) from exc
            self._reader = hiredis.Reader(replyError=BaseParser.parse_error)
            self.connects += 1
        return self.conn

    def drop(self) -> None:
        if self.conn is not None:
            self.conn.disconnect()
            self.pool.release(self.conn)
            self.conn = None
            self._reader = None

    def send(self, commands: list[bytes]) -> None:
        conn = self.connection()
        large = [command for command in commands if len(command) > _SMALLEST_BULK_LIMIT]
        if large:
            self._large = large
        try:
            conn.send_packed_command(coalesce(commands), check_health=False)
        except Exception as exc:
            self.drop()
            raise self._failure(exc) from exc

    def _failure(self, exc: Exception) -> Exception:
        """What a failed write or read means: a value over Redis' bulk limit (the server closes the
        connection on one: retrying would fail for ever), else `classify`'s answer."""
        error = classify(exc)
        large, self._large = self._large, []
        if not large or not isinstance(error, TransientError):
            return error
        size, args = largest_argument(large)
        if size <= _SMALLEST_BULK_LIMIT:
            return error
        limit = self._bulk_limit()
        return oversize_error(size, limit, args) if limit is not None and size > limit else error

    def _bulk_limit(self) -> int | None:
        """The server's `proto-max-bulk-len` (its default where `CONFIG GET` is not allowed); None when the
        server cannot be asked now."""
        try:
            conn = self.pool.get_connection()
        except Exception:
            return None
        try:
            conn.send_command("CONFIG", "GET", "proto-max-bulk-len")
            reply = conn.read_response()
            pairs = dict(reply) if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2]))
            value = pairs.get(b"proto-max-bulk-len", pairs.get("proto-max-bulk-len"))
            return DEFAULT_BULK_LIMIT if value is None else int(value)
        except ResponseError:
            return DEFAULT_BULK_LIMIT
        except Exception:
            conn.disconnect()
            return None
        finally:
            self.pool.release(conn)

    def receive(self, n: int, expect: bytes = b"", plain: tuple[int, Callable[[bytes, int], int]] | None = None
                ) -> tuple[list, bool]:
        """Read `n` replies; error replies are returned, not raised.

        When the replies are expected to begin with the bytes `expect` (the OK and
        QUEUED of a transaction: thousands of replies the caller only needs to
        know were all accepted), those bytes are compared at once instead of being
        parsed one by one: the result is then the replies after them, and True.
        Otherwise every reply is parsed and returned, with False. `plain`, (count,
        `plain_array_end`), goes on past `expect` the same way: when the next reply is
        an array of count bulk or simple strings (an EXEC's entry IDs), it is
        checked in place and given as `PLAIN`, not parsed into count objects.
        """
        conn = self.connection()
        reader = self._reader
        try:
            skipped = False
            replies: list = []
            if expect:
                data = b""
                while len(data) < len(expect) and data == expect[: len(data)]:
                    data += self._recv(conn)
                skipped = data.startswith(expect)
                if skipped:
                    n -= expect.count(b"\r\n")
                    data = data[len(expect):]
                    if plain is not None:
                        data = self._plain(conn, data, plain, replies)
                reader.feed(data)
            gets = reader.gets
            append = replies.append
            while True:
                while len(replies) < n:
                    reply = gets()
                    if reply is False:
                        break
                    append(reply)
                if len(replies) == n:
                    self._large = []
                    return replies, skipped
                reader.feed(self._recv(conn))
        except TimeoutError as exc:  # the socket timeout: a silent connection
            self.drop()
            raise TransientError(f"no answer from redis in {conn.socket_timeout:g}s; reconnecting") from exc
        except Exception as exc:
            self.drop()
            raise self._failure(exc) from exc

    def _plain(self, conn, data: bytes, plain: tuple[int, Callable[[bytes, int], int]], replies: list) -> bytes:
        """`data` after the array `plain` expects at its start (appending `PLAIN` to `replies`), or all of
        it when the next reply is anything else; read on until that is known."""
        count, array_end = plain
        end = array_end(data, count)
        while end == -2:
            data += self._recv(conn)
            end = array_end(data, count)
        if end < 0:
            return data
        replies.append(PLAIN)
        return data[end:]

    @staticmethod
    def _recv(conn) -> bytes:
        data = conn._sock.recv(_RECV_SIZE)
        if not data:
            raise RedisConnectionError("connection closed by the server")
        return data

    def round_trip(self, commands: list[bytes]) -> list:
        self.send(commands)
        return self.receive(len(commands))[0]

    def close(self) -> None:
        if self.conn is not None:
            self.pool.release(self.conn)
            self.conn = None
            self._reader = None
        self.pool.disconnect()
