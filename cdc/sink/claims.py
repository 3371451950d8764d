"""Which bridge owns what on a Redis shared by several bridges.

A database whose change rate outgrows one walsender splits its mappings across several
configs, each with its own slot and publication, into one Redis. They must never share:

- a stream: each bridge drops what is below its own high-water mark for that stream, so
  two bridges appending to one stream would each drop the other's entries;
- a slot name (its ``cdc:bridge:<slot>:*`` keys: the flushed record, the source history, the
  bound tables, the recorded losses), whether the other config reads another publication
  of the same database or the same name on another server;
- a publication of one database: each walsender would decode and send every table of it,
  and the bridges could not tell whose the tables are.

So each bridge registers its slot with the database and publication it reads
(`keys.BRIDGE_SLOTS`) and claims its streams (`keys.STREAM_OWNERS`), both atomically in one
script; `cdc check` judges the same records without writing. Anything another bridge holds
is refused (exit 2) with the bridge named and the fix, never shared silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import orjson
import redis

from .. import keys
from ..errors import ConfigError

__all__ = ["BridgeIdentity", "claim", "claim_problems", "judge", "other_bridges", "unmapped_owned"]

#: registers the slot and claims the streams only when nothing another bridge holds is among them (only
#: commands the bridge's ACL user has: a script runs with its caller's rights)
CLAIM_SCRIPT = """
local mine = redis.call('HMGET', KEYS[1], ARGV[1])[1]
if mine and mine ~= ARGV[2] then return 0 end
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] and all[i + 1] == ARGV[2] then return 0 end
end
for i = 3, #ARGV do
  local owner = redis.call('HMGET', KEYS[2], ARGV[i])[1]
  if owner and owner ~= ARGV[1] then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
for i = 3, #ARGV do redis.call('HSET', KEYS[2], ARGV[i], ARGV[1]) end
return 1
"""


@dataclass(frozen=True)
class BridgeIdentity:
    """What a slot reads: the publication of one database on one server (its system identifier)."""

    slot: str
    system_id: str
    database: str
    publication: str

    def encode(self) -> str:
        return orjson.dumps([self.system_id, self.database, self.publication]).decode()

    @staticmethod
    def describe(encoded: str) -> str:
        try:
            system_id, database, publication = orjson.loads(encoded)
        except (orjson.JSONDecodeError, ValueError, TypeError):
            return repr(encoded)
        return f"publication {publication!r} of database {database!r} (system {system_id})"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def judge(registered: Mapping[str, str], owners: Mapping[str, str], me: BridgeIdentity,
          streams: Mapping[str, str]) -> list[ConfigError]:
    """Why `me` may not read its slot and publication or write `streams` (stream -> entity), given the
    slots registered on the Redis (slot -> encoded identity) and the streams' owners (stream -> slot)."""
    problems: list[ConfigError] = []
    mine, theirs = me.encode(), registered.get(me.slot)
    if theirs is not None and theirs != mine:
        problems.append(_slot_taken(me, theirs))
    for slot, identity in sorted(registered.items()):
        if slot != me.slot and identity == mine:
            problems.append(ConfigError(
                f"{BridgeIdentity.describe(mine)} is already read by slot {slot!r} on this redis: two bridges on one "
                "publication would each decode and send every table of it",
                hint=f"give this config its own postgres.publication (cdc init creates it for the config's tables); if "
                f"slot {slot!r} is gone for good, run: redis-cli HDEL {keys.BRIDGE_SLOTS} {slot}"))
    for stream, entity in streams.items():
        owner = owners.get(stream)
        if owner is not None and owner != me.slot:
            problems.append(ConfigError(
                f"stream {stream} (entity {entity}) is written by the bridge of slot {owner!r} on this redis: two "
                "bridges appending to one stream would each drop the other's entries below its high-water mark",
                hint=f"map each table in one config only, or give this mapping its own stream (stream: in the mapping); "
                f"if slot {owner!r} no longer maps it, run: redis-cli HDEL {keys.STREAM_OWNERS} {stream}"))
    return problems


def _slot_taken(me: BridgeIdentity, theirs: str) -> ConfigError:
    """`me`'s slot name registered for another server, database or publication."""
    mine, release = me.encode(), f"redis-cli HDEL {keys.BRIDGE_SLOTS} {me.slot}"
    try:
        moved = orjson.loads(theirs)[1:] == [me.database, me.publication]
    except (orjson.JSONDecodeError, TypeError):
        moved = False
    if moved:  # the same names on another server: a second server's bridge, or this database moved
        return ConfigError(
            f"slot {me.slot!r} is registered on this redis for {BridgeIdentity.describe(theirs)}, but this server is "
            f"system {me.system_id}: another server's bridge names the same postgres.slot, or this database moved to "
            "another server",
            hint=f"give each server's config its own postgres.slot; if this database moved here, run: {release}, then "
            "cdc check again (it names what redis holds that this server lacks, and the fix)")
    return ConfigError(
        f"slot {me.slot!r} is registered on this redis for {BridgeIdentity.describe(theirs)}, but this config reads "
        f"{BridgeIdentity.describe(mine)}: two configs name the same postgres.slot, and their bridges would share the "
        f"slot's records (cdc:bridge:{me.slot}:*)",
        hint=f"give each config its own postgres.slot and postgres.publication; if this config alone uses slot "
        f"{me.slot!r} and its database or publication changed, run: {release}, then cdc check again")


def _read(client: redis.Redis) -> tuple[dict[str, str], dict[str, str]]:
    """(slot -> its bridge's identity, stream -> the slot owning it), in one round trip (one hash slot)."""
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.BRIDGE_SLOTS)
    pipe.hgetall(keys.STREAM_OWNERS)
    slots, streams = pipe.execute()
    registered = {_text(k): _text(v) for k, v in slots.items()}
    owners = {_text(k): _text(v) for k, v in streams.items()}
    return registered, owners


def claim_problems(client: redis.Redis, me: BridgeIdentity, streams: Mapping[str, str]) -> list[ConfigError]:
    """What `claim` would refuse, without writing (`cdc check`)."""
    return judge(*_read(client), me, streams)


def claim(client: redis.Redis, me: BridgeIdentity, streams: Mapping[str, str]) -> None:
    """Register `me`'s slot and claim `streams` for it, atomically; raise the first thing another bridge holds."""
    for _ in range(3):
        claimed = client.eval(CLAIM_SCRIPT, 2, keys.BRIDGE_SLOTS, keys.STREAM_OWNERS, me.slot, me.encode(), *streams)
        if claimed:
            return
        problems = claim_problems(client, me, streams)
        if problems:
            raise problems[0]
    raise ConfigError(f"slot {me.slot!r}: the claims of bridges on this redis kept changing while this one registered",
                      hint="run it again")


def unmapped_owned(client: redis.Redis, slot: str, streams: Mapping[str, str]) -> list[str]:
    """Streams claimed by `slot` that none of this config's mappings writes (a removed mapping, or a second
    config naming the same slot and publication: its bridge would acknowledge past these streams' changes)."""
    _, owners = _read(client)
    return sorted(s for s, owner in owners.items() if owner == slot and s not in streams)



def other_bridges(client: redis.Redis, slot: str) -> list[dict]:
    """The bridges registered on this Redis besides `slot`'s: what each reads and the streams it writes
    (`cdc status`)."""
    registered, owners = _read(client)
    found = []
    for other, encoded in sorted(registered.items()):
        if other == slot:
            continue
        try:
            system_id, database, publication = orjson.loads(encoded)
        except (orjson.JSONDecodeError, ValueError, TypeError):
            system_id = database = publication = None
        found.append({"slot": other, "system_id": system_id, "database": database, "publication": publication,
                      "streams": sorted(s for s, owner in owners.items() if owner == other)})
    return found
