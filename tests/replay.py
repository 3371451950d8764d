"""A stream applied to an empty table by its `id` key, as the simplest consumer would, and the rides table to
compare it with."""

from __future__ import annotations


def replay(entries: list[dict], reset_at_marker: bool = False, strict_reads: bool = False) -> dict:
    """The rows a stream leaves, by key id. A truncate empties the table; so does cdc recover's marker (x) when
    `reset_at_marker`. With `strict_reads`, a snapshot read (r) must agree with what the stream already says. An
    update that changed the key (its `before` holds the old one) moves the row."""
    rows: dict = {}
    for e in entries:
        op = e["op"]
        if op == "r" and strict_reads and e["key"]["id"] in rows:
            assert rows[e["key"]["id"]] == e["data"], f"stale snapshot row for {e['key']['id']}: {e['data']}"
        if op == "u" and e.get("before") and e["before"]["id"] != e["key"]["id"]:
            rows.pop(e["before"]["id"], None)
        if op in ("c", "u", "r"):
            rows[e["key"]["id"]] = e["data"]
        elif op == "d":
            rows.pop(e["key"]["id"], None)
        elif op == "t" or (op == "x" and reset_at_marker):
            rows.clear()
    return rows


def brought_in_order(entries: list[dict]) -> dict:
    """The rows a stream's entries after its last resync marker make, applied strictly, as a consumer summing
    differences needs them (docs/concepts/cannot-account.md): a c or r only for a row the stream does not hold, a
    u or d only for one it holds (its before-image, when whole, that row), a u never onto a row held."""
    last = max(i for i, e in enumerate(entries) if e["op"] == "x" and e["data"].get("resync"))
    rows: dict = {}
    for e in entries[last + 1:]:
        op, key = e["op"], e["key"].get("id")
        if op in ("c", "r"):
            assert key not in rows, f"{e}: brought twice"
            rows[key] = e["data"]
        elif op in ("u", "d"):
            before = e.get("before") or {}
            old = before.get("id", key)
            assert old in rows, f"{e}: a change of a row the stream has not brought"
            if len(before) > 1:
                assert rows[old] == before, f"{e}: its before-image is not the row the stream brought"
            del rows[old]
            if op == "u":
                assert key not in rows, f"{e}: moved onto a row the stream holds"
                rows[key] = e["data"]
        elif op == "t":
            rows.clear()
    return rows


def ride_rows(env) -> dict:
    """public.rides as the ride mapping publishes it, by id."""
    rows = env.execute("SELECT id, distance_m, rider_id FROM rides")
    return {i: {"id": i, "distance": f"{d:.3f}", "rider": r} for i, d, r in rows}
