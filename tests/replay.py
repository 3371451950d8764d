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


def ride_rows(env) -> dict:
    """public.rides as the ride mapping publishes it, by id."""
    rows = env.execute("SELECT id, distance_m, rider_id FROM rides")
    return {i: {"id": i, "distance": f"{d:.3f}", "rider": r} for i, d, r in rows}
