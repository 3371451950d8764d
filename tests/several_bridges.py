"""Two bridges on disjoint tables of one database into one Redis, each killed with kill -9 at random
instants while a writer runs: each stream must end exact (`run_two_bridges`)."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

from cdc.demo.local import wait_for
from conftest import Env
from workload import MixedWorkload

RIDER_MAPPING = """
entity: rider
table: public.riders
key: [id]
fields: {id: id, name: name}
"""


def second_env(env: Env, tmp: Path, name: str) -> Env:
    """Another config on `env`'s database and Redis, with its own slot and publication."""
    tmp.mkdir()
    other = Env(env.postgres, env.redis_server, env.dbname, tmp)
    other.slot, other.publication = f"{env.slot}_{name}", f"cdc_{name}"
    return other


def ride_and_rider_bridges(env: Env, tmp: Path, *, redis_url: str | None = None, redis: str = "") -> tuple[Env, Env]:
    """Bridge `a` maps rides, bridge `b` riders; both configs initialised."""
    env.apply_sql("10_rocket_rides.sql")
    env.publication = "cdc_a"
    b = second_env(env, tmp, "b")
    env.copy_mappings("ride.yaml")
    b.write_mapping("rider.yaml", RIDER_MAPPING)
    for e in (env, b):
        e.write_config("batch: {max_entries: 40, max_delay_ms: 5}\n", redis_url=redis_url, redis=redis)
        e.cdc("init", check=True)
    return env, b


def _attach(e: Env):
    proc = e.start_bridge()
    wait_for(lambda: e.slot_active() or proc.poll() is not None, 30, f"the bridge of {e.slot} to attach")
    assert proc.poll() is None, proc.log_path.read_text()
    return proc


def run_two_bridges(a: Env, b: Env, *, rounds: int, seed: int, transactions: int) -> MixedWorkload:
    """Both bridges stream while the workload writes; each round kills one of them (-9) at a random instant
    and starts it again. Ends with both caught up (`cdc run --until-caught-up`)."""
    workload = MixedWorkload(a.dsn, transactions=transactions, seed=seed, big_every=50, big_size=300, rate=150)
    rng = random.Random(seed)
    procs = {a.slot: _attach(a), b.slot: _attach(b)}
    kills = {a.slot: 0, b.slot: 0}
    workload.start()
    try:
        while not workload.done.is_set() and sum(kills.values()) < rounds:  # crashes while the writer runs
            e = rng.choice((a, b))
            time.sleep(rng.uniform(0.05, 0.5))  # a random crash instant, not a wait for a condition
            procs[e.slot].send_signal(signal.SIGKILL)
            procs[e.slot].wait(10)
            kills[e.slot] += 1
            e.wait_slot_inactive()
            procs[e.slot] = _attach(e)
        assert min(kills.values()) >= 2, f"each bridge killed while the writer ran: {kills}"
        assert workload.done.wait(300), "the workload to finish"
        assert workload.error is None, workload.error
    finally:
        workload.stopped.set()
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            proc.wait(30)
    for e in (a, b):
        e.wait_slot_inactive()
        e.cdc("run", "--until-caught-up", check=True, timeout=300)
    return workload


def assert_exact(client, workload: MixedWorkload) -> None:
    """Each stream holds exactly what its table went through, in commit order, once."""
    import orjson

    for stream, expected in workload.expected.items():
        entries = [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in client.xrange(stream)]
        positions = [(int(e["lsn"]), int(e["seq"])) for e in entries]
        assert len(set(positions)) == len(positions), f"{stream}: duplicate source positions"
        assert positions == sorted(positions), f"{stream}: entries out of source order"
        got = [(e["op"], orjson.loads(e["key"]), orjson.loads(e["data"]) if "data" in e else None) for e in entries]
        assert len(got) == len(expected), f"{stream}: {len(got)} entries, expected {len(expected)}"
        assert got == expected, f"{stream}: content differs"
