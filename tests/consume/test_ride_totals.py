"""The example totals consumer (`cdc.demo.rocketrides.ride_totals`) against a model: seeded random
rides, updates that move a ride to another rider, deletes, truncates and rebuild markers, applied in
batches of random sizes; after every batch each rider's total and the overall one (rider 0) equal the
model's sums, to the last digit."""

from __future__ import annotations

import random
from decimal import Decimal

import orjson
import pytest

from cdc.demo.rocketrides import ride_totals
from cdc.sink.entry import parse_entry

pytestmark = pytest.mark.integration


def entries(rng: random.Random, n: int) -> list:
    rides: dict[int, tuple[int, str]] = {}
    out = []
    for i in range(n):
        roll = rng.random()
        fields = {b"lsn": str(100 + i).encode(), b"seq": b"0"}
        if roll < 0.02:
            rides.clear()
            fields[b"op"] = rng.choice([b"t", b"x"])
        elif not rides or roll < 0.5:
            ride = i
            rides[ride] = (rng.randint(0, 6), f"{rng.randint(0, 10**6)}.{rng.randint(0, 999):03d}")
            fields.update({b"op": b"c", b"data": orjson.dumps({"id": ride, "rider": rides[ride][0], "distance": rides[ride][1]})})
        else:
            ride = rng.choice(sorted(rides))
            before = {"id": ride, "rider": rides[ride][0], "distance": rides[ride][1]}
            fields[b"before"] = orjson.dumps(before)
            if roll < 0.85:
                rides[ride] = (rng.randint(0, 6) if rng.random() < 0.3 else rides[ride][0], f"-{rng.randint(0, 999)}.5")
                fields.update({b"op": b"u", b"data": orjson.dumps({"id": ride, "rider": rides[ride][0], "distance": rides[ride][1]})})
            else:
                del rides[ride]
                fields[b"op"] = b"d"
        fields[b"key"] = b"{}"
        out.append(parse_entry("cdc:ride", f"{i + 1}-0", fields))
    return out


def model(applied: list) -> dict[int, Decimal]:
    rides: dict[int, tuple[int, Decimal]] = {}
    for e in applied:
        if e.op in ("t", "x"):
            rides.clear()
        elif e.op == "d":
            del rides[e.before["id"]]
        else:
            rides[e.data["id"]] = (int(e.data["rider"]), Decimal(e.data["distance"]))
    totals: dict[int, Decimal] = {}
    for rider, distance in rides.values():
        totals[rider] = totals.get(rider, Decimal(0)) + distance
        totals[0] = totals.get(0, Decimal(0)) + distance
    return totals


@pytest.mark.parametrize("seed", range(8))
def test_ride_totals_equal_the_sums_of_the_live_rides_after_every_batch(env, seed):
    env.apply_sql("20_consumer_state.sql")
    rng = random.Random(seed)
    workload = entries(rng, 400)
    with env.connect() as conn:
        done = 0
        while done < len(workload):
            batch = workload[done: done + rng.choice([1, 2, 7, 50, 400])]
            with conn.transaction():
                ride_totals(conn, batch, "c")
            done += len(batch)
            got = {rider: total for rider, total in conn.execute(
                "SELECT rider_id, total_distance FROM consumer_states WHERE consumer = 'c'")}
            want = model(workload[:done])
            # a rider whose rides all went away keeps a row of 0 (never read as missing)
            assert {r: t for r, t in got.items() if t != 0 or r in want} == want, (seed, done)
