"""Every Redis key name the bridge writes, in one place.

A stream's high-water mark lives in a key sharing the stream's Redis Cluster hash
slot, so a batch and its mark can be written by one atomic script on any topology:
when the stream key already has a hash tag (``cdc:{ride}:0``) the mark reuses it;
otherwise the whole stream key becomes the tag (``{cdc:ride}:hwm``), which hashes
exactly like the plain stream key.
"""

from __future__ import annotations

__all__ = ["DEAD_LETTER_PREFIX", "DEFAULT_STREAM_TEMPLATE", "has_hash_tag", "holds_key", "mark_key", "owned_key_clash",
           "removed_key", "reserved_name", "stream_key", "written_streams"]

DEFAULT_STREAM_TEMPLATE = "cdc:{entity}"
PARTITIONED_STREAM_TEMPLATE = "cdc:{entity}:{partition}"
MARK_SUFFIX = ":hwm"
#: a hash of trimming counters: "<stream>:trimmed" and "<stream>:forced" (unconsumed entries dropped by a cap)
TRIM_STATS = "cdc:stats:trim"
#: a hash: stream -> the entry ID below which entries missing from it were removed knowingly (by the trim
#: cap, or accepted by cdc recover); unconsumed entries missing anywhere else vanished (`cdc.sink.trim`)
TRIM_ACCOUNTED = "cdc:stats:trim:accounted"
#: a hash: slot -> the server, database and publication its bridge reads (`cdc.sink.claims`); one hash tag
#: with `STREAM_OWNERS`, so one script judges and claims both on a Redis Cluster
BRIDGE_SLOTS = "{cdc:bridge}:slots"
#: a hash: stream -> the slot whose bridge writes it (`cdc.sink.claims`); a stream has one writer
STREAM_OWNERS = "{cdc:bridge}:streams"


def has_hash_tag(key: str) -> bool:
    """True when Redis Cluster would hash only part of `key` (a non-empty ``{...}``)."""
    start = key.find("{")
    if start < 0:
        return False
    end = key.find("}", start + 1)
    return end > start + 1


def mark_key(stream: str) -> str:
    """The key holding `stream`'s high-water mark, in the same cluster slot."""
    if has_hash_tag(stream):
        return stream + MARK_SUFFIX
    return "{" + stream + "}" + MARK_SUFFIX


PLACEHOLDERS = ("entity", "schema", "table", "partition")


def stream_key(template: str, **fields: object) -> str:
    """Fill a stream key template.

    Only the placeholders in `PLACEHOLDERS` are replaced; any other brace text is
    kept, so ``cdc:{{entity}}`` gives ``cdc:{ride}``, a key with a hash tag.
    """
    key = template
    for name, value in fields.items():
        key = key.replace("{" + name + "}", str(value))
    return key


def dead_letter_key(group: str) -> str:
    """Where `group`'s entries go after too many failed deliveries (one stream per group)."""
    return DEAD_LETTER_PREFIX + group


def dead_letter_index_key(group: str) -> str:
    """A hash in the dead-letter stream's cluster slot: "<source stream> <entry ID>" -> the dead letter written for it
    while the entry is not acknowledged yet, so that a consumer redoing the move (after a crash between writing the
    letter and acknowledging the entry, on a cluster where the two are on different nodes) reuses it."""
    stream = dead_letter_key(group)
    return stream + ":index" if has_hash_tag(stream) else "{" + stream + "}:index"


def removed_key(stream: str) -> str:
    """A hash (same cluster slot as `stream`) accounting for entries removed from `stream` knowingly:
    "count", how many the bridge's own trimming removed (each trim and its count in one script) plus those
    `cdc recover` accepted; "deleted", the largest ID deleted (XDEL) that `cdc recover` accepted. Entries
    missing beyond that were removed by someone else (`cdc.sink.trim.removed_unconsumed`)."""
    return mark_key(stream)[: -len(MARK_SUFFIX)] + ":removed"


def lease_key(stream: str, group: str) -> str:
    """The lease giving one consumer of `group` exclusive use of `stream` (same slot as the stream)."""
    return mark_key(stream)[: -len(MARK_SUFFIX)] + f":lease:{group}"


def lease_epoch_key(stream: str, group: str) -> str:
    """A counter: each new lease holder gets a higher epoch, used to fence old holders."""
    return lease_key(stream, group) + EPOCH_SUFFIX


#: what a group's lease epoch adds to its lease key (`lease_epoch_key`)
EPOCH_SUFFIX = ":epoch"


def group_problem(group: str) -> str | None:
    """Why `group` cannot name a consumer group, or None: empty, or shaped like another group's companion key
    (group ``g:epoch``'s lease would be group ``g``'s lease epoch counter)."""
    if not group.strip():
        return "a consumer group name cannot be empty"
    if group.endswith(EPOCH_SUFFIX):
        base = group[: -len(EPOCH_SUFFIX)]
        return (f"consumer group {group!r} ends with {EPOCH_SUFFIX}: its lease key would be the lease epoch counter "
                f"of group {base!r}; choose another name")
    return None


def failures_key(stream: str, group: str) -> str:
    """A hash of handler failures of `group` on `stream` (field: entry ID, value: how many times the
    handler failed on it; field "<entry ID>:error": the last error). Same cluster slot as the stream."""
    return mark_key(stream)[: -len(MARK_SUFFIX)] + f":failures:{group}"


def bridge_state_key(slot: str) -> str:
    """A hash of what the bridge of `slot` knows and `cdc status` shows: paused for Redis memory
    (``paused``, ``memory_ratio``, ``paused_since_ms``) and detected Redis data loss (``data_loss_from``,
    ``data_loss_to``, ``data_loss_at_ms``; ``data_loss_diverged`` when Redis holds changes the server's history
    lacks, which holds the bridge until cdc recover)."""
    return f"cdc:bridge:{slot}:state"


def flushed_key(slot: str) -> str:
    """The highest LSN whose changes Redis holds, written before the slot is told so.

    On start the bridge compares it with the slot's confirmed position: a Redis
    that restarted without persistence, or a failover to a lagging replica, shows
    up as a value behind the slot, and the missing LSN range is exactly between.
    """
    return f"cdc:bridge:{slot}:flushed"


def source_key(slot: str) -> str:
    """A hash of the server history the flushed record's positions belong to (``system_id``: PostgreSQL's
    system identifier, ``timeline``): positions of another system, or past the point where the server's
    timeline branched off, name transactions the server does not have (see `cdc.source.history`)."""
    return f"cdc:bridge:{slot}:source"


def bound_tables_key(slot: str) -> str:
    """A hash of the mapped tables the bridge of `slot` bound (field: "<schema>.<table>", value:
    "<oid> <since LSN> <leaf partition OIDs, comma-separated>"): a table found with another OID
    was dropped and re-created (see `cdc.bridge.gate`). Its field ``publish-gap`` (no dot: no table's) records what
    a reading found the publication leaving out (operations, or ``publish_via_partition_root``, or a change to its
    catalog rows), until `cdc recover`; ``publication-oid`` the publication's OID, and ``publication-rows`` its
    catalog rows for the mapped tables as the last passing reading (or `cdc init`) found them."""
    return f"cdc:bridge:{slot}:tables"


def resync_key(slot: str) -> str:
    """A hash of the mapped tables whose streams the bridge of `slot` is resyncing (`on_unaccountable: resync`;
    field: "<schema>.<table>", value: JSON with the cause, the last position the bridge vouched for and the
    state), written before the slot may move past the change it could not account for (see `cdc.bridge.gate`)."""
    return f"cdc:bridge:{slot}:resync"


def holds_key(stream: str) -> str:
    """A hash of holds on `stream` (field: who holds, value: "<entry id> <expiry ms>"): trimming keeps
    every entry after the lowest unexpired hold, so a reconciliation can re-read what consumers already
    acknowledged. Same cluster slot as the stream."""
    return mark_key(stream)[: -len(MARK_SUFFIX)] + ":holds"


#: what errors and `cdc status` name as the owner of the transactions stream (where a stream's entity goes)
TRANSACTIONS_OWNER = "transactions (END records)"

#: where a group's dead letters go: this prefix and the group's name (`dead_letter_key`)
DEAD_LETTER_PREFIX = "cdc:dlq:"
#: prefixes of keys the bridge and the consumers own beside the streams (state, records, statistics, dead
#: letters, the claims of slots and streams); no stream may be named with one of them
OWNED_PREFIXES = ("cdc:bridge:", "cdc:stats:", DEAD_LETTER_PREFIX, "{cdc:bridge}:")
#: how the keys kept beside a stream end, after its hash tag: its high-water mark, its holds and the count of
#: entries removed from it knowingly
COMPANION_SUFFIXES = (MARK_SUFFIX, ":holds", ":removed")
#: what the keys kept beside a stream hold after its hash tag: leases (and their epochs) and failure counts
COMPANION_PARTS = (":lease:", ":failures:")


def reserved_name(key: str) -> str | None:
    """Why no stream may be named `key`, or None: a key the bridge or its consumers keep for themselves has
    that shape (`OWNED_PREFIXES`), or one kept beside a stream does (`COMPANION_SUFFIXES`, `COMPANION_PARTS`
    after a hash tag, as `mark_key`, `holds_key`, `lease_key` and `failures_key` make them)."""
    for prefix in OWNED_PREFIXES:
        if key.startswith(prefix):
            return f"names starting {prefix} belong to the bridge and its consumers"
    if has_hash_tag(key):
        tail = key[key.index("}", key.index("{") + 1):]
        for suffix in COMPANION_SUFFIXES:
            if tail.endswith(suffix):
                return (f"names with a hash tag ending {suffix} belong to the keys kept beside a stream (its mark, its "
                        "holds, its removal count)")
        for part in COMPANION_PARTS:
            if part in tail:
                return (f"names with a hash tag followed by {part}... belong to the keys kept beside a stream "
                        "(its consumers' leases and failure counts)")
    return None


def _companions(stream: str) -> str:
    """The start every key kept beside `stream` shares (its mark, holds, leases, failures)."""
    return mark_key(stream)[: -len(MARK_SUFFIX)] + ":"


def owned_key_clash(key: str, streams: dict[str, str]) -> str | None:
    """Why `key` (a stream the bridge writes beside the mapped ones) would collide with a key the bridge
    or a consumer owns, or None: `streams` maps each mapped stream key to its entity."""
    if key in streams:
        return f"it is the stream of entity {streams[key]}"
    reserved = reserved_name(key)
    if reserved is not None:
        return reserved
    for stream, entity in streams.items():
        if key.startswith(_companions(stream)):
            return f"it is named like a key kept beside the stream {stream} of entity {entity} (its mark, holds, leases)"
        if stream.startswith(_companions(key)):
            return f"the stream {stream} of entity {entity} is named like a key kept beside it (its mark, holds, leases)"
    return None


def written_streams(settings, mappings) -> dict[str, str]:
    """Every stream `cdc run` writes -> its entity (the transactions stream's owner: `TRANSACTIONS_OWNER`)."""
    streams = {s: m.entity for m in mappings for s in m.stream_keys()}
    if settings.transactions.stream:
        streams[settings.transactions.stream] = TRANSACTIONS_OWNER
    return streams
