"""Trimming streams without losing what a consumer group still needs.

A stream is trimmed up to the oldest entry any group still needs: its oldest
pending entry, or the first entry after its last-delivered ID. Entries before
that point have been delivered to and acknowledged by every group; a hold (set by
`cdc reconcile` while it runs, see `keys.holds_key`) keeps everything after it as
well. A stream with no group is left alone. An optional hard cap (length or age) bounds a stream
whose group died; when the cap would drop entries some group still needs, that
is logged loudly and counted, and where the stream then starts is recorded
(`keys.TRIM_ACCOUNTED`): entries a group had not
consumed that are missing below that point were dropped knowingly. Missing
anywhere else, they vanished: `removed_unconsumed` finds them.

Each trim and its count go in one script: the stream's `keys.removed_key` hash counts every entry the
bridge removed itself ("count"). Redis counts every entry ever added to a stream (XINFO STREAM
`entries-added`); what it added, less what it holds, less what the bridge removed or `cdc recover`
accepted, was removed by someone else (XDEL, XTRIM by hand). Such a hole anywhere a consumer group
had not consumed yet is a loss: XDEL leaves the largest ID it deleted (`max-deleted-entry-id`), a trim
leaves the stream starting later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import redis

from .. import keys
from ..errors import DataLossError
from ..source.lsn import Lsn
from .entry import next_stream_id, parse_stream_id, reply_text
from ..mapping.model import Mapping

__all__ = ["TrimPolicy", "TrimResult", "UnconsumedRemoved", "accept_removed", "account_removed", "active_holds",
           "counted_trim", "foreign_removals", "removal_reads", "removed_by_others", "removed_unconsumed",
           "safe_trim_point", "trim_mapped", "trim_stream", "unconsumed_loss_error"]

log = logging.getLogger("cdc.trim")


@dataclass(frozen=True)
class TrimPolicy:
    #: keep at most this many entries even if unconsumed (0: no cap)
    max_len: int = 0
    #: drop entries older than this many seconds even if unconsumed (0: no cap)
    max_age_s: float = 0


@dataclass
class TrimResult:
    stream: str
    trimmed: int = 0
    forced: int = 0  # unconsumed entries dropped by the hard cap
    safe_point: str | None = None
    groups: dict = field(default_factory=dict)


def oldest_pending(client: redis.Redis, stream: str, group: dict) -> str | None:
    """The oldest entry `group` (its XINFO GROUPS reply) has pending, or None. None too when its consumers
    acknowledged everything pending after XINFO GROUPS answered (XPENDING's summary then has no min): those
    entries were consumed, never a loss."""
    if not group["pending"]:
        return None
    low = client.xpending(stream, reply_text(group["name"]))["min"]
    return None if low is None else reply_text(low)


def safe_trim_point(client: redis.Redis, stream: str) -> tuple[str | None, dict]:
    """The smallest ID any group still needs (None: no group, so nothing is known to be consumed)."""
    groups = client.xinfo_groups(stream)
    if not groups:
        return None, {}
    needed: list[tuple[int, int]] = []
    info = {}
    for g in groups:
        name = reply_text(g["name"])
        first_undelivered = next_stream_id(reply_text(g["last-delivered-id"]))
        candidates = [parse_stream_id(first_undelivered)]
        oldest = oldest_pending(client, stream, g)
        if oldest is not None:  # (the delivered ID read with XINFO GROUPS is older than any acknowledged since)
            candidates.append(parse_stream_id(oldest))
        point = min(candidates)
        needed.append(point)
        info[name] = f"{point[0]}-{point[1]}"
    for holder, held in active_holds(client, stream).items():
        needed.append(parse_stream_id(next_stream_id(held)))
        info[f"hold:{holder}"] = held
    low = min(needed)
    return f"{low[0]}-{low[1]}", info


def active_holds(client: redis.Redis, stream: str) -> dict[str, str]:
    """Unexpired holds on `stream`: holder -> the last entry ID it lets go (it keeps every later one)."""
    now_ms = int(time.time() * 1000)
    holds = {}
    for holder, value in client.hgetall(keys.holds_key(stream)).items():
        entry_id, _, expires = reply_text(value).partition(" ")
        if expires and int(expires) < now_ms:
            continue  # its holder died: the hash itself expires a day after the last hold
        holds[reply_text(holder)] = entry_id
    return holds


# KEYS: the stream, its removed_key; ARGV: MINID or MAXLEN, its value, and what an older bridge counted (the
# count's start, when the stream has none yet). The trim and its count, atomically: a count short of a trim would
# read as entries someone else removed.
TRIM_SCRIPT = """
local n = redis.call('XTRIM', KEYS[1], ARGV[1], ARGV[2])
if not redis.call('HMGET', KEYS[2], 'count')[1] then redis.call('HSET', KEYS[2], 'count', ARGV[3]) end
if n > 0 then redis.call('HINCRBY', KEYS[2], 'count', n) end
return n
"""


def counted_trim(client: redis.Redis, stream: str, how: str, value: str | int) -> int:
    """XTRIM `stream` (`how`: MINID or MAXLEN, exact) and count what it removed as the bridge's own. A stream
    an older bridge trimmed starts its count at that bridge's trim counter (`keys.TRIM_STATS`)."""
    older = client.hmget(keys.TRIM_STATS, f"{stream}:trimmed")[0]
    return int(client.eval(TRIM_SCRIPT, 2, stream, keys.removed_key(stream), how, str(value), int(older or 0)))


def trim_stream(client: redis.Redis, stream: str, policy: TrimPolicy = TrimPolicy()) -> TrimResult:
    result = TrimResult(stream)
    point, result.groups = safe_trim_point(client, stream)
    result.safe_point = point
    safe = counted_trim(client, stream, "MINID", point) if point is not None else 0
    dropped = 0  # by the hard cap: what is older than max_age_s, then what exceeds max_len
    if policy.max_age_s:
        dropped += counted_trim(client, stream, "MINID", f"{int((time.time() - policy.max_age_s) * 1000)}-0")
    if policy.max_len:
        dropped += counted_trim(client, stream, "MAXLEN", policy.max_len)
    if dropped and point is not None:
        # everything before the safe point is gone already: what the cap drops, a group still needed
        result.forced = dropped
        log.error(
            "hard cap on %s dropped %d entries a consumer group had not consumed (groups need from: %s)",
            stream, dropped, result.groups,
        )
    result.trimmed = safe + dropped
    if result.trimmed or result.forced:
        pipe = client.pipeline(transaction=False)
        pipe.hincrby(keys.TRIM_STATS, f"{stream}:trimmed", result.trimmed)
        pipe.hincrby(keys.TRIM_STATS, f"{stream}:forced", result.forced)
        pipe.execute()
    if dropped:
        account_removed(client, stream)
    return result


def account_removed(client: redis.Redis, stream: str) -> None:
    """Record that every entry missing before where `stream` starts now was removed knowingly (by the cap,
    or accepted by cdc recover): `removed_unconsumed` reports no loss below that point."""
    info = client.xinfo_stream(stream)
    first = info.get("first-entry")
    start = reply_text(first[0]) if first else next_stream_id(info["last-generated-id"])
    client.hset(keys.TRIM_ACCOUNTED, stream, start)


def accept_removed(client: redis.Redis, stream: str) -> None:
    """Account for every entry missing from `stream` now, wherever it was, as removed knowingly (cdc recover,
    which rebuilds the stream behind a marker): only removals after this one are reported."""
    info = client.xinfo_stream(stream)
    client.hset(keys.removed_key(stream), mapping={
        "count": int(info["entries-added"]) - int(info["length"]),
        "deleted": reply_text(info.get("max-deleted-entry-id") or b"0-0")})
    account_removed(client, stream)


def removal_reads(pipe, stream: str) -> None:
    """Queue on `pipe` the two reads `removed_by_others` judges with (see `foreign_removals`)."""
    pipe.hmget(keys.removed_key(stream), "count", "deleted")
    pipe.hmget(keys.TRIM_STATS, f"{stream}:trimmed")


def foreign_removals(info: dict, account: list, older: list) -> tuple[int, str | None]:
    """How many entries someone other than the bridge removed from a stream (`info`: its XINFO STREAM;
    `account`, `older`: the replies of `removal_reads`), and the largest ID deleted (XDEL) not yet accepted
    (None: none). A stream without the count (written by an older bridge) is judged against the trim counter
    that bridge kept."""
    (count, accepted), (trimmed,) = account, older
    removed = int(info.get("entries-added") or 0) - int(info["length"])
    known = int(count) if count is not None else int(trimmed or 0)
    deleted = reply_text(info.get("max-deleted-entry-id") or b"0-0")
    if deleted == "0-0" or (accepted is not None and parse_stream_id(deleted) <= parse_stream_id(reply_text(accepted))):
        return removed - known, None
    return removed - known, deleted


def removed_by_others(client: redis.Redis, stream: str, info: dict) -> tuple[int, str | None]:
    """`foreign_removals` of `stream`, read now."""
    pipe = client.pipeline(transaction=False)
    removal_reads(pipe, stream)
    account, older = pipe.execute()
    return foreign_removals(info, account, older)


@dataclass(frozen=True)
class UnconsumedRemoved:
    """Entries of `stream` that group `group` had not consumed, removed: IDs from `after` (exclusive; the
    group's last delivered or first pending) up to `before` (exclusive, where the stream starts now), or up to
    `through` (inclusive: the largest ID deleted, XDEL, anywhere in the stream)."""
    stream: str
    group: str
    after: str
    before: str
    count: int | None  # how many, when Redis can tell
    pending: bool  # a delivered, unacknowledged entry is among them
    through: str | None = None


def removed_unconsumed(client: redis.Redis, stream: str, info: dict | None = None,
                       only: str | None = None) -> list[UnconsumedRemoved]:
    """Entries some group (or group `only`) still needed (pending, or not delivered yet) that are gone from
    `stream`: from its start, other than below where the bridge's cap or a recovery accounted for removals;
    or anywhere, removed by someone other than the bridge (`removed_by_others`). `info`: the stream's XINFO
    STREAM, if the caller read it already (for many streams, in one round trip)."""
    if info is None:
        info = client.xinfo_stream(stream)
    if not info.get("groups"):
        return []
    first = info.get("first-entry")
    start = reply_text(first[0]) if first else next_stream_id(info["last-generated-id"])
    accounted = client.hmget(keys.TRIM_ACCOUNTED, stream)[0]
    head_accounted = accounted is not None and parse_stream_id(start) <= parse_stream_id(accounted)
    foreign, deleted = removed_by_others(client, stream, info)
    if head_accounted and foreign <= 0:
        return []
    found = []
    for g in client.xinfo_groups(stream):
        name, delivered = reply_text(g["name"]), reply_text(g["last-delivered-id"])
        if only is not None and name != only:
            continue
        low = oldest_pending(client, stream, g)
        needed = min([parse_stream_id(next_stream_id(delivered))] + ([parse_stream_id(low)] if low else []))
        after = low if low is not None and parse_stream_id(low) == needed else delivered
        pending = after == low
        if not head_accounted:
            if low is not None and parse_stream_id(low) < parse_stream_id(start):
                found.append(UnconsumedRemoved(stream, name, low, start, None, True))
                continue
            lag = g.get("lag")
            if lag is not None and parse_stream_id(delivered) < parse_stream_id(start) and lag > info["length"]:
                found.append(UnconsumedRemoved(stream, name, delivered, start, lag - info["length"], False))
                continue
        if foreign <= 0:
            continue
        if head_accounted:  # the head up to where the stream starts is the cap's (or a recovery's) doing
            if deleted is not None and parse_stream_id(deleted) >= max(needed, parse_stream_id(start)):
                found.append(UnconsumedRemoved(stream, name, after, start, foreign, pending, deleted))
        elif deleted is not None and parse_stream_id(deleted) >= needed:
            found.append(UnconsumedRemoved(stream, name, after, start, foreign, pending, deleted))
        elif needed < parse_stream_id(start) and (g.get("entries-read") is None or g.get("lag") is None
                                                  or g["lag"] > info["length"]):
            # Redis cannot tell (a group never delivered anything estimates its lag from what is left)
            found.append(UnconsumedRemoved(stream, name, after, start, foreign, pending))
    return found


def unconsumed_loss_error(client: redis.Redis, gone: UnconsumedRemoved, what: str,
                          mark: bytes | None = None) -> DataLossError:
    """The one-line loss for `gone`, `what` naming the stream's role."""
    after = gone.through and next_stream_id(gone.through)
    first = client.xrange(gone.stream, min=after, count=1) if after else client.xrange(gone.stream, count=1)
    fields = first[0][1] if first else None
    lsn = Lsn(int(fields[b"lsn"])) if fields else Lsn(int(mark[:20])) if mark else Lsn(0)
    what_ids = (f"from ID {gone.after} (delivered to it, not acknowledged)" if gone.pending else f"after ID {gone.after}")
    if gone.through:
        where = f"IDs {what_ids} up to ID {gone.through} (deleted, XDEL)"
        count = f" ({gone.count} entries removed from the stream other than by the bridge)" if gone.count else ""
    else:
        where = f"IDs {what_ids} up to before {gone.before}"
        count = f" ({gone.count} entries)" if gone.count else ""
    error = DataLossError(
        f"stream {gone.stream} ({what}) lost entries consumer group {gone.group} had not consumed: "
        f"{where}{count}, committed before {lsn}, were removed from it, "
        "not by the bridge's trimming (its cap accounts for no such drop)",
        hint="restore Redis from a backup holding them, or stop the bridge and run cdc recover to rebuild the stream "
        "from its table (its consumers reset at the marker)",
    )
    setattr(error, "lost_stream", gone.stream)  # what the bridge records for cdc status
    setattr(error, "lost_to", lsn)
    return error


def trim_mapped(client: redis.Redis, mappings: Iterable[Mapping], policy: TrimPolicy, entity: str | None = None,
                also: Iterable[str] = ()) -> Iterator[TrimResult]:
    """Trim every existing stream of the mapped entities (or of `entity` only), and the streams in `also`
    (the transactions stream) unless one entity is named."""
    if not entity:
        for stream in also:
            if stream and client.exists(stream):
                yield trim_stream(client, stream, policy)
    for m in mappings:
        if entity and m.entity != entity:
            continue
        for stream in m.stream_keys():
            if client.exists(stream):
                yield trim_stream(client, stream, policy)
