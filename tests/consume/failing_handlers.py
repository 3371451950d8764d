"""Apply functions that fail on a fixed subset of rides: the rides whose id is divisible by 5.

Importable by `cdc consume --handler failing_handlers:totals_except_fives` when this folder
is on PYTHONPATH."""

from __future__ import annotations

from cdc.demo.rocketrides import ride_totals


def fails(entry) -> bool:
    return int(entry.key["id"]) % 5 == 0


def totals_except_fives(conn, entries, consumer: str) -> None:
    for e in entries:
        if fails(e):
            raise ValueError(f"ride {e.key['id']} is divisible by 5")
    ride_totals(conn, entries, consumer)


def logged_totals_except_fives(conn, entries, consumer: str) -> None:
    """The same, and each applied ride's id in applied_rides, in the order applied (with the state,
    in the same transaction)."""
    totals_except_fives(conn, entries, consumer)
    conn.cursor().executemany("INSERT INTO applied_rides (ride) VALUES (%s)", [(int(e.key["id"]),) for e in entries])


def raising_secrets(conn, entries, consumer: str) -> None:
    """Fail on every ride with the error text the JSON file named by HANDLER_ERRORS_FILE holds for its id
    (texts that quote a password, a token, a URL with credentials...)."""
    import json
    import os

    with open(os.environ["HANDLER_ERRORS_FILE"]) as f:
        texts = json.load(f)
    for e in entries:
        raise RuntimeError(texts[str(e.key["id"])])
