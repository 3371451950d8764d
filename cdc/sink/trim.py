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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import redis

from .. import keys
from .entry import next_stream_id, parse_stream_id, reply_text
from ..mapping.model import Mapping

__all__ = ["TrimPolicy", "TrimResult", "UnconsumedRemoved", "account_removed", "active_holds", "removed_unconsumed", "safe_trim_point",
           "trim_mapped", "trim_stream"]

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


def trim_stream(client: redis.Redis, stream: str, policy: TrimPolicy = TrimPolicy()) -> TrimResult:
    result = TrimResult(stream)
    point, result.groups = safe_trim_point(client, stream)
    result.safe_point = point
    safe = client.xtrim(stream, minid=point, approximate=False) if point is not None else 0
    dropped = 0  # by the hard cap: what is older than max_age_s, then what exceeds max_len
    if policy.max_age_s:
        dropped += client.xtrim(stream, minid=f"{int((time.time() - policy.max_age_s) * 1000)}-0", approximate=False)
    if policy.max_len:
        dropped += client.xtrim(stream, maxlen=policy.max_len, approximate=False)
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


@dataclass(frozen=True)
class UnconsumedRemoved:
    """Entries of `stream` that group `group` had not consumed, removed: IDs from `after` (exclusive; the
    group's last delivered or first pending) up to `before` (exclusive, where the stream starts now)."""
    stream: str
    group: str
    after: str
    before: str
    count: int | None  # how many, when Redis can tell
    pending: bool  # a delivered, unacknowledged entry is among them


def removed_unconsumed(client: redis.Redis, stream: str, info: dict | None = None) -> list[UnconsumedRemoved]:
    """Entries some group still needed (pending, or not delivered yet) that are gone from the start of
    `stream`, other than below where the bridge's cap or a recovery accounted for removals. `info`: the
    stream's XINFO STREAM, if the caller read it already (for many streams, in one round trip)."""
    if info is None:
        info = client.xinfo_stream(stream)
    if not info.get("groups"):
        return []
    first = info.get("first-entry")
    start = reply_text(first[0]) if first else next_stream_id(info["last-generated-id"])
    accounted = client.hmget(keys.TRIM_ACCOUNTED, stream)[0]
    if accounted is not None and parse_stream_id(start) <= parse_stream_id(accounted):
        return []
    found = []
    for g in client.xinfo_groups(stream):
        name, delivered = reply_text(g["name"]), reply_text(g["last-delivered-id"])
        low = oldest_pending(client, stream, g)
        if low is not None and parse_stream_id(low) < parse_stream_id(start):
            found.append(UnconsumedRemoved(stream, name, low, start, None, True))
            continue
        lag = g.get("lag")
        if lag is not None and parse_stream_id(delivered) < parse_stream_id(start) and lag > info["length"]:
            found.append(UnconsumedRemoved(stream, name, delivered, start, lag - info["length"], False))
    return found


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
