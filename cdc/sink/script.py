"""Appending with one Lua script call per stream and batch (``redis.append: script``).

The script reads the stream's high-water mark, appends only the entries past
it and moves the mark, atomically. It needs no watch between batches and costs
Redis more CPU per entry than a transaction (unpacking MessagePack and calling
XADD from Lua); it stays as the reference the transaction path is tested
against, and for Redis setups that forbid MULTI.

Positions are fixed-width decimal strings, so the script compares them as
strings: Lua numbers are doubles and cannot hold an LSN.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import hiredis
import msgpack
from redis.exceptions import NoScriptError

from .node import Node, classify

__all__ = ["APPEND_SCRIPT", "ScriptLane"]

# ARGV[1]: a MessagePack array of entries; each entry is its field/value list
# followed by its position. One packed argument per stream keeps the client's
# per-argument packing cost off the hot path.
APPEND_SCRIPT = b"""
local mark = redis.call('GET', KEYS[2])
local entries = cmsgpack.unpack(ARGV[1])
local last = false
local added = 0
for i = 1, #entries do
  local e = entries[i]
  local n = #e
  local pos = e[n]
  if (not mark) or pos > mark then
    redis.call('XADD', KEYS[1], '*', unpack(e, 1, n - 1))
    last = pos
    added = added + 1
  end
end
if last then
  redis.call('SET', KEYS[2], last)
end
return added
"""
APPEND_SHA = hashlib.sha1(APPEND_SCRIPT).hexdigest()

_packb = msgpack.Packer(use_bin_type=False).pack  # the old spec: what Redis' cmsgpack reads


#: SET KEYS[1] to ARGV[1] unless it holds a larger number: a record that only moves forward
FORWARD_SCRIPT = b"""
local held = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) > held then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""


def record_forward_command(key: str, value: int) -> bytes:
    """``EVAL`` of the forward-only record (LSNs stay far below 2^53, exact as Lua numbers)."""
    return hiredis.pack_command((b"EVAL", FORWARD_SCRIPT, 1, key, str(value)))


class ScriptLane:
    """One connection appending to its streams with the append script."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._sent: tuple[list[bytes], list[bytes], list[bytes]] | None = None

    def reserve(self) -> int:
        """A script call needs no room beyond what it appends."""
        return 0

    def send(self, group: Sequence[tuple[str, str, list]], flushed: tuple[str, int] | None,
             after: list[bytes]) -> None:
        """One script call per stream; then `flushed` (key, LSN) moved forward only; then `after`."""
        scripts = [hiredis.pack_command((b"EVALSHA", APPEND_SHA, 2, stream, mark, _packb(entries)))
                   for stream, mark, entries in group]
        inside = [] if flushed is None else [record_forward_command(*flushed)]
        self.node.send(scripts + inside + after)
        self._sent = (scripts, inside, after)

    def confirm(self) -> tuple[list[int], list]:
        if self._sent is None:
            return [], []
        scripts, inside, after = self._sent
        self._sent = None
        n = len(scripts)
        replies = self.node.receive(n + len(inside) + len(after))[0]
        if any(isinstance(r, NoScriptError) for r in replies[:n]):
            # Redis restarted or flushed its script cache: load and resend; the marks make it safe.
            self.node.round_trip([hiredis.pack_command((b"SCRIPT", b"LOAD", APPEND_SCRIPT))])
            replies = self.node.round_trip(scripts + inside + after)
        for reply in replies[: n + len(inside)]:
            if isinstance(reply, Exception):
                raise classify(reply)
        return list(replies[:n]), replies[n + len(inside):]
