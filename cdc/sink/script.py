"""Appending with one Lua script call per lane and batch (``redis.append: script``).

The script judges every stream key of the batch first (its TYPE against its
mark, `cdc.sink.streamkeys`) and refuses the whole call before writing
anything when one may not be appended to. Then, per stream, it reads the
high-water mark, appends only the entries past it and moves the mark; last, it
moves the flushed record forward. All of it atomically: a batch either goes in
whole, or nothing of it, marks and record included. It needs no watch between
batches and costs Redis more CPU per entry than a transaction (unpacking
MessagePack and calling XADD from Lua); it stays as the reference the
transaction path is tested against, and for Redis setups that forbid MULTI.

Positions are fixed-width decimal strings, so the script compares them as
strings: Lua numbers are doubles and cannot hold an LSN.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import hiredis
import msgpack
from redis.exceptions import NoScriptError, ResponseError

from .node import Node, classify
from .streamkeys import stream_key_error

__all__ = ["APPEND_SCRIPT", "SCRIPT_MODE_BLIND", "ScriptLane"]

#: what `cdc run` (at start) and `cdc check` warn of in this mode
SCRIPT_MODE_BLIND = (
    "redis.append is script: a Redis emptied under the running bridge (FLUSHALL, FLUSHDB) goes undetected: the script "
    "re-creates each stream holding only the later entries, with marks and a flushed record that agree with them; "
    "redis.append: transaction (the default) refuses the batch instead (exit 6)")


# KEYS: stream 1, its mark, stream 2, its mark, ..., then the flushed record's key if it is moved.
# ARGV[1]: how many streams; then per stream a MessagePack array of entries, each its field/value
# list followed by its position (one packed argument per stream keeps the client's per-argument
# packing cost off the hot path); then the flushed record's value if it is moved.
# Returns the entries appended per stream, or the error CDCKEY <stream index> <type> <mark or ->
# when a stream key may not be appended to (nothing written).
APPEND_SCRIPT = b"""
local n = tonumber(ARGV[1])
local marks = {}
for i = 1, n do
  local mark = redis.call('GET', KEYS[2 * i])
  local t = redis.call('TYPE', KEYS[2 * i - 1])['ok']
  if t ~= 'stream' and (t ~= 'none' or mark) then
    return redis.error_reply('CDCKEY ' .. i .. ' ' .. t .. ' ' .. (mark or '-'))
  end
  marks[i] = mark
end
local counts = {}
for i = 1, n do
  local mark = marks[i]
  local entries = cmsgpack.unpack(ARGV[i + 1])
  local last = false
  local added = 0
  for j = 1, #entries do
    local e = entries[j]
    local m = #e
    local pos = e[m]
    if (not mark) or pos > mark then
      redis.call('XADD', KEYS[2 * i - 1], '*', unpack(e, 1, m - 1))
      last = pos
      added = added + 1
    end
  end
  if last then
    redis.call('SET', KEYS[2 * i], last)
  end
  counts[i] = added
end
if #KEYS > 2 * n then
  local held = tonumber(redis.call('GET', KEYS[2 * n + 1]) or '0')
  if tonumber(ARGV[n + 2]) > held then redis.call('SET', KEYS[2 * n + 1], ARGV[n + 2]) end
end
return counts
"""
APPEND_SHA = hashlib.sha1(APPEND_SCRIPT).hexdigest()

_packb = msgpack.Packer(use_bin_type=False).pack  # the old spec: what Redis' cmsgpack reads


def _refuse(stream: str, key_type: str, mark: str) -> None:
    error = stream_key_error(stream, key_type, mark)
    if error is not None:
        raise error


class ScriptLane:
    """One connection appending to its streams with the append script."""

    def __init__(self, node: Node, judge=_refuse) -> None:
        self.node = node
        #: raises when a stream may not be appended to, given its key's type and its mark (`cdc.sink.streamkeys`)
        self.judge = judge
        self._sent: tuple[list[bytes], list[bytes], Sequence] | None = None

    def reserve(self) -> int:
        """A script call needs no room beyond what it appends."""
        return 0

    def send(self, group: Sequence[tuple[str, str, list, object]], flushed: tuple[str, int] | None,
             after: list[bytes]) -> None:
        """One script call appending every stream's entries past its mark and moving `flushed` (key, LSN)
        forward only, or nothing at all; then `after`. The entries are lists: batches sent by script are
        never packed (their `packed` is None)."""
        if any(packed is not None and packed.count for _, _, _, packed in group):
            raise ValueError("the script lane takes entry lists, not packed commands")
        names = [k for stream, mark, _, _ in group for k in (stream, mark)]
        args = [_packb(entries) for _, _, entries, _ in group]
        if flushed is not None:
            names.append(flushed[0])
            args.append(str(flushed[1]))
        script = [hiredis.pack_command((b"EVALSHA", APPEND_SHA, len(names), *names, len(group), *args))]
        self.node.send(script + after)
        self._sent = (script, after, [stream for stream, _, _, _ in group])  # the entries are let go

    def confirm(self) -> tuple[list[int], list]:
        if self._sent is None:
            return [], []
        script, after, streams = self._sent
        self._sent = None
        replies = self.node.receive(1 + len(after))[0]
        if isinstance(replies[0], NoScriptError):
            # Redis restarted or flushed its script cache: load and resend; the marks make it safe.
            self.node.round_trip([hiredis.pack_command((b"SCRIPT", b"LOAD", APPEND_SCRIPT))])
            replies = self.node.round_trip(script + after)
        reply = replies[0]
        if isinstance(reply, ResponseError) and str(reply).startswith("CDCKEY "):
            _, index, key_type, mark = str(reply).split(" ", 3)
            stream = streams[int(index) - 1]
            self.judge(stream, key_type, "" if mark == "-" else mark)
        if isinstance(reply, Exception):
            raise classify(reply)
        return list(reply), replies[1:]
