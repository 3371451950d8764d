"""The upgrade from the previous release, as docs/how-to/upgrading.md says, while a writer commits throughout.

0.1.0 (the distribution `cdc`, the last commit before the rename to pg-redis-cdc) is built from this repository's
history, installed into a fresh virtualenv in an empty folder, and deployed as it documented: its demo schema
(sql/10_rocket_rides.sql), its demo mappings (mappings/: rides with key changes, riders with hashed and redacted
fields, rockets in two partition streams with their before-images, ride events as logical messages), `cdc init`,
`cdc run`. Then, without stopping the writer: `pip uninstall cdc`, `pip install pg-redis-cdc` (the checkout's
wheel) in the same virtualenv, `cdc --version`, `cdc init`, `cdc check`, SIGTERM to the old bridge, the new
`cdc run`. Once the writer stopped and the new bridge caught up, every stream holds each committed change once,
in commit order, and replays to its table.

The 0.1.0 wheel (compiled hot path included) is built once and kept in pytest's cache, keyed by the commit and the
interpreter; the checkout's wheel and the dependencies' wheelhouse come from the `built` fixture (tests/conftest.py,
shared with tests/test_install.py).
"""

from __future__ import annotations

import hmac
import random
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import uuid
from decimal import Decimal
from hashlib import sha256
from pathlib import Path

import orjson
import psycopg
import pytest

from cdc import __version__
from cdc.demo.local import wait_for
from conftest import ROOT, read_stream
from installs import build_wheel, fresh_venv, run, start, stop
from replay import replay, ride_rows

pytestmark = [pytest.mark.slow, pytest.mark.integration]

#: 0.1.0: the last commit before the rename to pg-redis-cdc
PREVIOUS = "27d1a2919714d8f16d5adad0b83310bddfa55f26"
HASH_KEY = "upgrade-test-hash-key-0123456789"
#: the streams of the 0.1.0 demo mappings; the rocket's partitions are compared with its changes as one
STREAMS = {"cdc:ride": ["cdc:ride"], "cdc:rider": ["cdc:rider"], "cdc:rocket": ["cdc:rocket:p0", "cdc:rocket:p1"],
           "cdc:ride_event": ["cdc:ride_event"]}
#: the riders rides refer to (never deleted); riders the writer adds after them come and go
FIXED_RIDERS = 5
#: entries each bridge must have streamed of the writer's changes before the upgrade goes on
STREAMED = 200


@pytest.fixture(scope="session")  # before `built`: a missing commit fails before the checkout's wheel is built
def previous_release(tmp_path_factory, request) -> tuple[Path, Path]:
    """(0.1.0's files, `git archive` of its commit; the folder holding its wheel, `pip wheel --no-deps` of them)."""
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{PREVIOUS}^{{commit}}"], capture_output=True).returncode:
        pytest.fail(f"the commit of 0.1.0, {PREVIOUS}, is not in this repository (a shallow clone?): fetch the full "
                    "history (git fetch --unshallow) to run the upgrade test", pytrace=False)
    source = tmp_path_factory.mktemp("cdc-0.1.0")
    subprocess.run(f"git -C {shlex.quote(str(ROOT))} archive {PREVIOUS} | tar -x -C {shlex.quote(str(source))}",
                   shell=True, check=True, timeout=120)
    key = f"upgrade-wheel-{PREVIOUS[:12]}-{sys.implementation.cache_tag}-{sysconfig.get_platform()}"
    dist = Path(request.config.cache.mkdir(key))
    if not list(dist.glob("cdc-0.1.0-*.whl")):  # once: the commit does not change
        wheel = build_wheel(source, tmp_path_factory.mktemp("dist-0.1.0"), "cdc-0.1.0-*.whl")
        shutil.copy(wheel, dist / f".{wheel.name}")
        (dist / f".{wheel.name}").rename(dist / wheel.name)
    return source, dist


class Writer(threading.Thread):
    """Transactions of one to four changes over the demo's tables, from one connection (commit order is program
    order) until `finish()`: rides inserted, updated, given a new key and deleted; riders inserted, updated and
    deleted; rockets inserted, updated and deleted; ride events emitted as transactional logical messages; one
    transaction in twenty rolled back. `expected` holds, per stream, the (op, key) of each committed change in
    commit order, `events` the content of each committed message."""

    def __init__(self, dsn: str, seed: int = 7) -> None:
        super().__init__(name="upgrade-writer", daemon=True)
        self.dsn = dsn
        self.rng = random.Random(seed)
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self.expected: dict[str, list[tuple[str, dict]]] = {name: [] for name in STREAMS}
        self.events: list[dict] = []
        self.rides: set[int] = set()
        self.riders: set[int] = set()
        self.rockets: set[str] = set()
        self.next_ride = self.next_rider = 1
        self.transactions = 0

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                self._commit(conn, [self._new_rider for _ in range(FIXED_RIDERS)], may_roll_back=False)
                while not self.stopped.is_set():
                    self._commit(conn, [self._choose() for _ in range(self.rng.randint(1, 4))])
                    self.stopped.wait(0.005)  # pacing, so the changes span the upgrade without piling up
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def finish(self) -> None:
        self.stopped.set()
        self.join(60)
        assert not self.is_alive(), "the writer did not stop"
        if self.error is not None:
            raise AssertionError(f"the writer failed: {self.error!r}") from self.error

    def _choose(self):
        roll = self.rng.random()
        if roll < 0.30 or not self.rides:
            return self._new_ride
        if roll < 0.42:
            return self._ride_update
        if roll < 0.50:
            return self._ride_key_change
        if roll < 0.57:
            return self._ride_delete
        if roll < 0.64:
            return self._new_rider
        if roll < 0.72:
            return self._rider_update
        if roll < 0.76 and len(self.riders) > FIXED_RIDERS:
            return self._rider_delete
        if roll < 0.84 or not self.rockets:
            return self._new_rocket
        if roll < 0.90:
            return self._rocket_update
        if roll < 0.94:
            return self._rocket_delete
        return self._event

    def _commit(self, conn: psycopg.Connection, steps: list, may_roll_back: bool = True) -> None:
        """Run the steps in one transaction; what they changed counts once it committed."""
        saved = (set(self.rides), set(self.riders), set(self.rockets), self.next_ride, self.next_rider)
        changes: list[tuple[str, str, dict]] = []
        events: list[dict] = []
        rollback = may_roll_back and self.rng.random() < 0.05
        try:
            with conn.transaction():
                for step in steps:
                    step(conn, changes, events)
                if rollback:
                    raise psycopg.Rollback()
        finally:
            if rollback:
                self.rides, self.riders, self.rockets, self.next_ride, self.next_rider = saved
        if not rollback:
            for stream, op, key in changes:
                self.expected[stream].append((op, key))
            self.events.extend(events)
            self.transactions += 1

    def _new_ride(self, conn, changes, events) -> None:
        ride, self.next_ride = self.next_ride, self.next_ride + 1
        conn.execute("INSERT INTO rides (id, rider_id, distance_m) VALUES (%s, %s, %s)",
                     (ride, self.rng.randint(1, FIXED_RIDERS), Decimal(self.rng.randint(1, 10**6)) / 1000))
        self.rides.add(ride)
        changes.append(("cdc:ride", "c", {"id": ride}))

    def _ride_update(self, conn, changes, events) -> None:
        ride = self.rng.choice(sorted(self.rides))
        conn.execute("UPDATE rides SET distance_m = distance_m + 1, rider_id = %s WHERE id = %s",
                     (self.rng.randint(1, FIXED_RIDERS), ride))
        changes.append(("cdc:ride", "u", {"id": ride}))

    def _ride_key_change(self, conn, changes, events) -> None:
        ride, new = self.rng.choice(sorted(self.rides)), self.next_ride
        self.next_ride += 1
        conn.execute("UPDATE rides SET id = %s WHERE id = %s", (new, ride))
        self.rides.discard(ride)
        self.rides.add(new)
        changes.append(("cdc:ride", "u", {"id": new}))

    def _ride_delete(self, conn, changes, events) -> None:
        ride = self.rng.choice(sorted(self.rides))
        conn.execute("DELETE FROM rides WHERE id = %s", (ride,))
        self.rides.discard(ride)
        changes.append(("cdc:ride", "d", {"id": ride}))

    def _new_rider(self, conn, changes, events) -> None:
        rider, self.next_rider = self.next_rider, self.next_rider + 1
        conn.execute("INSERT INTO riders (id, name, email, phone, created_at) "
                     "VALUES (%s, %s, %s, %s, to_timestamp(%s))",  # whole seconds: since is a whole number of milliseconds
                     (rider, f"rider {rider}", f"r{rider}@example.com", None if rider % 3 else f"+1-555-{rider:04}",
                      1_767_225_600 + rider))
        self.riders.add(rider)
        changes.append(("cdc:rider", "c", {"id": rider}))

    def _rider_update(self, conn, changes, events) -> None:
        rider, n = self.rng.choice(sorted(self.riders)), self.rng.randint(1, 10**6)
        conn.execute("UPDATE riders SET name = %s, email = %s, phone = %s WHERE id = %s",
                     (f"rider {rider} ({n})", f"r{rider}.{n}@example.com", None if n % 2 else f"+1-555-{n}", rider))
        changes.append(("cdc:rider", "u", {"id": rider}))

    def _rider_delete(self, conn, changes, events) -> None:
        rider = self.rng.choice(sorted(self.riders - set(range(1, FIXED_RIDERS + 1))))
        conn.execute("DELETE FROM riders WHERE id = %s", (rider,))
        self.riders.discard(rider)
        changes.append(("cdc:rider", "d", {"id": rider}))

    def _new_rocket(self, conn, changes, events) -> None:
        rocket = str(uuid.UUID(int=self.rng.getrandbits(128)))
        conn.execute("INSERT INTO rockets (id, name, class, dry_mass, stages) VALUES (%s, %s, %s, %s, %s)",
                     (rocket, f"rocket {rocket[:8]}", self.rng.choice(["suborbital", "orbital", "lunar"]),
                      Decimal(self.rng.randint(1, 10**7)) / 10, self.rng.randint(1, 3)))
        self.rockets.add(rocket)
        changes.append(("cdc:rocket", "c", {"id": rocket}))

    def _rocket_update(self, conn, changes, events) -> None:
        rocket = self.rng.choice(sorted(self.rockets))
        conn.execute("UPDATE rockets SET stages = stages %% 3 + 1, dry_mass = dry_mass + 0.5, updated_at = now() "
                     "WHERE id = %s", (rocket,))
        changes.append(("cdc:rocket", "u", {"id": rocket}))

    def _rocket_delete(self, conn, changes, events) -> None:
        rocket = self.rng.choice(sorted(self.rockets))
        conn.execute("DELETE FROM rockets WHERE id = %s", (rocket,))
        self.rockets.discard(rocket)
        changes.append(("cdc:rocket", "d", {"id": rocket}))

    def _event(self, conn, changes, events) -> None:
        content = {"n": self.transactions, "event": "booked"}
        conn.execute("SELECT pg_logical_emit_message(true, 'ride_events', %s)", (orjson.dumps(content).decode(),))
        events.append(content)
        changes.append(("cdc:ride_event", "m", {}))


def watching(writer: Writer, bridge: subprocess.Popen, condition, what: str) -> None:
    """Wait for `condition`, failing at once when the writer failed or the running bridge exited."""
    def check():
        if writer.error is not None:
            raise AssertionError(f"the writer failed: {writer.error!r}")
        if bridge.poll() is not None:
            raise AssertionError(f"the bridge exited {bridge.returncode}:\n{bridge.log_path.read_text()[-4000:]}")  # type: ignore[attr-defined]
        return condition()

    wait_for(check, 120, what, fatal=(AssertionError,))


def caught_up(client, writer: Writer) -> bool:
    """Redis holds as many entries per stream of STREAMS (the rocket's partitions added up) as the writer committed
    changes, or more (which the checks then show)."""
    return all(sum(client.xlen(key) for key in keys) >= len(writer.expected[name]) for name, keys in STREAMS.items())


def rider_rows(env) -> dict:
    """public.riders as the 0.1.0 rider mapping publishes it, by id."""
    rows = env.execute("SELECT id, name, email, phone, (extract(epoch FROM created_at) * 1000)::bigint FROM riders")
    return {i: {"id": i, "name": name, "email": hmac.new(HASH_KEY.encode(), email.encode(), sha256).hexdigest(),
                "phone": None if phone is None else "***", "since": since} for i, name, email, phone, since in rows}


def rocket_rows(env) -> dict:
    """public.rockets' columns the writer sets, as the rocket mapping publishes them, by id."""
    rows = env.execute("SELECT id::text, name, class::text, dry_mass::text, stages FROM rockets")
    return {i: {"id": i, "name": name, "class": cls, "dry_mass": mass, "stages": stages} for i, name, cls, mass, stages in rows}


@pytest.mark.timeout(900)
def test_a_0_1_0_deployment_upgraded_while_a_writer_commits_streams_on_exactly(previous_release, built, env, tmp_path):
    started = time.monotonic()
    dist, house = built
    old_source, old_dist = previous_release
    work = tmp_path / "deployment"  # an empty folder: no checkout on sys.path
    work.mkdir()
    user = fresh_venv(tmp_path / "venv")
    run(f"pip install --quiet --no-index --find-links {old_dist} --find-links {house} cdc==0.1.0", work, user)
    assert run("cdc --version", work, user).stdout == "cdc 0.1.0\n"

    # the deployment as 0.1.0 made it: its schema and demo mappings, cdc init, cdc run
    env.execute((old_source / "sql" / "10_rocket_rides.sql").read_text())
    shutil.copytree(old_source / "mappings", work / "mappings")
    assert sorted(p.name for p in (work / "mappings").iterdir()) == ["ride.yaml", "ride_event.yaml", "rider.yaml", "rocket.yaml"]
    (work / "hash.key").write_text(HASH_KEY + "\n")
    (work / "cdc.yaml").write_text(f"postgres: {{dsn: '{env.dsn}', slot: {env.slot}, publication: cdc}}\n"
                                   f"redis: {{url: '{env.redis_server.url}'}}\n"
                                   "mappings: mappings/\nhash_key_file: hash.key\nhttp: {port: 0}\n")
    run("cdc init --config cdc.yaml", work, user)
    writer = Writer(env.dsn)
    bridges = [start("cdc run --config cdc.yaml", work, user, log=tmp_path / "bridge-0.1.0.log")]
    try:
        writer.start()
        watching(writer, bridges[0], lambda: env.redis.xlen("cdc:ride") >= STREAMED, "the 0.1.0 bridge streaming the writer's rides")

        # the upgrade as docs/how-to/upgrading.md says, the writer committing throughout
        before_upgrade = writer.transactions
        run("pip uninstall --yes --quiet cdc", work, user)
        run(f"pip install --quiet --no-index --find-links {dist} --find-links {house} pg-redis-cdc", work, user)
        assert run("cdc --version", work, user).stdout == f"cdc {__version__}\n"
        assert f"Version: {__version__}" in run("pip show pg-redis-cdc", work, user).stdout
        run("cdc init --config cdc.yaml", work, user)
        checked = run("cdc check --config cdc.yaml", work, user)
        assert "4 mapping(s) valid" in checked.stdout and "warning:" not in checked.stderr, checked.stdout + checked.stderr
        stop(bridges[0])  # SIGTERM: the batch in flight finished, exit 0
        handed_over = env.redis.xlen("cdc:ride")
        assert writer.transactions > before_upgrade, "the writer committed nothing while the upgrade went on"
        bridges.append(start("cdc run --config cdc.yaml", work, user, log=tmp_path / "bridge-new.log"))
        watching(writer, bridges[1], lambda: env.redis.xlen("cdc:ride") >= handed_over + STREAMED,
                 f"the {__version__} bridge streaming the writer's rides")
        writer.finish()
        watching(writer, bridges[1], lambda: caught_up(env.redis, writer), "the new bridge to catch up with the writer")
        stop(bridges[1])
        again = run("cdc run --config cdc.yaml --until-caught-up", work, user)  # nothing left: nothing written again
    finally:
        writer.stopped.set()
        for bridge in bridges:
            if bridge.poll() is None:
                bridge.kill()
                bridge.wait(10)
    assert "Traceback" not in again.stdout + again.stderr

    # exactly once across the upgrade: each committed change once, in commit order, replaying to its table
    streams = {name: sorted((e for key in keys for e in read_stream(env.redis, key)), key=lambda e: (int(e["lsn"]), int(e["seq"])))
               for name, keys in STREAMS.items()}
    for name, keys in STREAMS.items():
        for key in keys:
            positions = [(int(e["lsn"]), int(e["seq"])) for e in read_stream(env.redis, key)]
            assert positions == sorted(set(positions)), f"{key}: a source position twice, or out of source order"
        assert [(e["op"], e["key"]) for e in streams[name]] == writer.expected[name], name
    assert [e["data"] for e in streams["cdc:ride_event"]] == [{"prefix": "ride_events", "content": c} for c in writer.events]
    assert replay(streams["cdc:ride"]) == ride_rows(env)
    assert replay(streams["cdc:rider"]) == rider_rows(env)
    fields = ("id", "name", "class", "dry_mass", "stages")
    assert {i: {f: row[f] for f in fields} for i, row in replay(streams["cdc:rocket"]).items()} == rocket_rows(env)
    counts = {name: len(changes) for name, changes in writer.expected.items()}
    key_changes = sum(1 for e in streams["cdc:ride"] if e["op"] == "u" and e["before"]["id"] != e["key"]["id"])
    assert key_changes and all(counts.values()), counts
    print(f"\nupgrade test: {time.monotonic() - started:.1f}s ({writer.transactions} transactions, entries {counts}, "
          f"{key_changes} key changes; the wheels built before it, in the fixtures)")
