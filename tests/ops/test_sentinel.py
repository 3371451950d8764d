"""Redis behind Sentinel: a redis+sentinel:// url for the bridge and every command, exactly once
through a failover (with redis.wait_replicas), and a replica that was behind caught as a loss
(without it) and repaired by cdc recover."""

from __future__ import annotations

import random
import re
import signal
import time

import pytest
import redis

from cdc.config import RedisSettings, Settings
from cdc.demo.local import wait_for
from cdc.errors import ConfigError, TransientError
from cdc.redact import redact
from cdc.sink import redisconn
from cdc.sink.publisher import Publisher
from cdc.source.lsn import Lsn
from conftest import ROOT, read_stream
from ride_consumers import RideTraffic, state, truth
from sentinels import LocalSentinelGroup
from replay import replay, ride_rows

SENTINEL_PASSWORD = "sentinel-secret-7f3a"
LOSS_MARKERS = ("redis lost entries", "redis has no record")


class CurrentMaster:
    """Stands for Env's Redis server: whichever node the sentinels name now."""

    def __init__(self, group: LocalSentinelGroup) -> None:
        self.group = group

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.group.current_master().port}/0"


@pytest.fixture
def group(servers_root, env, monkeypatch, request):
    monkeypatch.setenv("CDC_REDIS_SENTINEL_PASSWORD", SENTINEL_PASSWORD)  # for every cdc command started
    options = {"sentinel_password": SENTINEL_PASSWORD, **getattr(request, "param", {})}
    g = LocalSentinelGroup(servers_root / f"sentinel-{env.dbname}", **options)
    g.start()
    env.redis_server = CurrentMaster(g)
    yield g
    env.close()
    g.stop()


SENTINEL_ENV = {"CDC_REDIS_SENTINEL_PASSWORD": SENTINEL_PASSWORD}


# -- the url, at load ------------------------------------------------------------------------

def test_a_sentinel_url_names_the_sentinels_the_service_and_the_data_nodes_login():
    t = redisconn.parse_sentinel_url(
        "rediss+sentinel://cdc-bridge:p%40ss@h1:26379,h2:26380,[::1]:26381/mymaster/3?ssl_ca_certs=/ca.crt")
    assert t.sentinels == (("h1", 26379), ("h2", 26380), ("::1", 26381))
    assert (t.service, t.db, t.tls, t.username, t.password) == ("mymaster", 3, True, "cdc-bridge", "p@ss")
    assert t.options["ssl_ca_certs"] == "/ca.crt"
    assert redisconn.parse_sentinel_url("redis+sentinel://h1/mymaster").sentinels == (("h1", 26379),)
    odd = redisconn.parse_sentinel_url("redis+sentinel://:a/b,c@h1:1,h2:2/svc")
    assert (odd.password, odd.sentinels, odd.service) == ("a/b,c", (("h1", 1), ("h2", 2)), "svc")
    assert "p@ss" not in repr(t) and "p%40ss" not in t.describe()


@pytest.mark.parametrize("url, message", [
    ("redis+sentinel://h1:26379,h2:26379", "names no sentinel service"),
    ("redis+sentinel://h1:26379,h2:x/mymaster/0", "sentinel address 'h2:x' is not host:port"),
    ("redis+sentinel://h1:26379/mymaster/zero", "'mymaster/zero' is not <service>/<database number>"),
    ("redis+sentinel://:26379/mymaster/0", "sentinel address ':26379' is not host:port"),
])
def test_a_malformed_sentinel_url_is_refused_at_load_with_its_line(tmp_path, url, message):
    path = tmp_path / "cdc.yaml"
    path.write_text(f"postgres: {{dsn: 'postgresql://localhost/app'}}\nredis:\n  url: '{url}'\n")
    with pytest.raises(ConfigError) as err:
        Settings.from_file(path, env={})
    assert str(err.value).startswith(f"redis.url (from {path}:3)") and message in str(err.value)
    assert err.value.exit_code == 2


def test_sentinel_and_cluster_together_are_refused(tmp_path):
    path = tmp_path / "cdc.yaml"
    path.write_text("redis: {url: 'redis+sentinel://h1:26379/mymaster/0', cluster: true}\n")
    with pytest.raises(ConfigError, match="redis.cluster cannot be used with a redis\\+sentinel:// url"):
        Settings.from_file(path, env={})


def test_the_sentinel_login_comes_from_its_own_keys_and_is_never_shown(tmp_path):
    secret = tmp_path / "sentinel.pw"
    secret.write_text("from-a-file-pw\n")
    path = tmp_path / "cdc.yaml"
    path.write_text("redis: {url: 'redis+sentinel://h1:26379/mymaster/0', sentinel_username: watcher}\n")
    settings = Settings.from_file(path, env={"CDC_REDIS_SENTINEL_PASSWORD_FILE": str(secret)})
    assert (settings.redis.sentinel_username, settings.redis.sentinel_password) == ("watcher", "from-a-file-pw")
    assert "from-a-file-pw" not in repr(settings)
    shown = redact("cannot reach redis+sentinel://cdc-bridge:bridge-pw@h1:26379,h2:26379/mymaster/0")
    assert "bridge-pw" not in shown and "h1:26379,h2:26379/mymaster/0" in shown


# -- against real sentinels ------------------------------------------------------------------

#: the sentinels' user the documentation gives (docs/how-to/redis-sentinel.md), with its password replaced
README_SENTINEL_USER = next(line.strip() for line in (ROOT / "docs" / "how-to" / "redis-sentinel.md").read_text().splitlines()
                            if line.strip().startswith("user cdc-sentinel "))


@pytest.mark.parametrize("group", [{"sentinel_users": (README_SENTINEL_USER,)}], indirect=True, ids=["readme-acl"])
def test_cdc_check_reports_the_sentinels_the_master_and_the_replicas(env, group):
    env.write_config(redis_url=group.url, redis=", wait_replicas: 2, sentinel_username: cdc-sentinel")
    as_readme_user = {"CDC_REDIS_SENTINEL_PASSWORD": "change-me-sentinel"}
    env.apply_sql("10_rocket_rides.sql")
    env.copy_mappings("ride.yaml")
    env.cdc("init", check=True, env=as_readme_user)  # cdc init through the sentinels, as the README's user
    result = env.cdc("check", env=as_readme_user)
    master, replica = group.current_master().port, group.replica.port
    out = result.stdout + result.stderr
    assert "3 of 3 sentinels answer for 'mymaster'" in out
    assert f"the sentinels name 127.0.0.1:{master} as the master of 'mymaster'" in out
    assert f"replica 127.0.0.1:{replica}: link ok" in out
    assert "has 1 connected replica(s) but redis.wait_replicas is 2" in out
    assert "'mymaster' has 1 replica(s) and redis.wait_replicas is 2: after a failover the promoted master has 0" in out
    assert result.returncode == 0, out

    group.sentinels[0].stop()
    assert "change-me-sentinel" not in out
    result = env.cdc("check", env={"CDC_REDIS_SENTINEL_PASSWORD": "not-the-password"})
    out = result.stdout + result.stderr
    assert result.returncode == 5, out
    assert f"sentinel 127.0.0.1:{group.sentinels[1].port} refused the login" in out
    assert f"sentinel 127.0.0.1:{group.sentinels[0].port} is unreachable" in out
    assert "not-the-password" not in out and SENTINEL_PASSWORD not in out
    result = env.cdc("status", env={"CDC_REDIS_SENTINEL_PASSWORD": "not-the-password"})
    # (the bridge's lanes classify every refused connection as transient, a refused login included)
    assert result.returncode in (5, 75), result.stderr
    assert "check redis.sentinel_username and redis.sentinel_password" in result.stderr
    assert "not-the-password" not in result.stdout + result.stderr


def test_a_server_that_is_not_the_master_is_never_written_to(env, group, monkeypatch):
    """Sentinels lag a failover: when they name a replica (or a demoted master), ROLE refuses it, as a
    transient connection error (resolve again), on redis-py's path and on the bridge's raw lanes."""
    replica = ("127.0.0.1", group.replica.port)
    monkeypatch.setattr(redisconn._Sentinels, "discover_master", lambda self, service: replica)
    settings = RedisSettings(url=group.url, sentinel_password=SENTINEL_PASSWORD)
    client = redisconn.connect_redis(settings)
    with pytest.raises(redis.ConnectionError, match=f"redis at 127.0.0.1:{group.replica.port} is a slave, not the "
                                                    "master of 'mymaster'"):
        client.set("cdc:probe", 1)
    publisher = Publisher(group.url, settings=settings)
    with pytest.raises(TransientError, match="is a slave, not the master"):
        publisher.ping()
    publisher.close()
    monkeypatch.undo()
    client = redisconn.connect_redis(settings)
    assert client.set("cdc:probe", 1) and client.role()[0] == b"master"


def _mark(client: redis.Redis) -> int:
    raw = client.get("{cdc:ride}:hwm")
    return int(raw[:20]) if raw else 0


def _setup_rides(env, group, redis_settings: str) -> None:
    env.apply_sql("10_rocket_rides.sql", "20_consumer_state.sql")
    env.copy_mappings("ride.yaml")
    env.write_config("batch: {max_entries: 40, max_delay_ms: 5, status_interval_s: 0.5}\n", redis_url=group.url,
                     redis=redis_settings, postgres=", receive_timeout_s: 5")
    env.cdc("init", check=True, env=SENTINEL_ENV)
    env.execute("INSERT INTO riders (id, name, email) SELECT g, 'r' || g, 'e' FROM generate_series(1, 20) g")


def _assert_stream_exact(env) -> None:
    entries = read_stream(env.redis, "cdc:ride")
    positions = [(int(e["lsn"]), int(e["seq"])) for e in entries]
    assert positions == sorted(set(positions)), "a change is in the stream twice, or out of order"
    assert replay(entries, reset_at_marker=True) == ride_rows(env)


def _waiting(procs, check, timeout: float, what: str):
    """`wait_for`, failing with the processes' last log lines."""
    try:
        return wait_for(check, timeout, what)
    except TimeoutError as exc:
        logs = "\n".join(f"--- {p.log_path.name}\n{p.log_path.read_text()[-2000:]}" for p in procs)
        raise AssertionError(f"{exc}\n{logs}") from None


@pytest.mark.slow
@pytest.mark.parametrize("group", [{"replicas": 2}], indirect=True, ids=["two-replicas"])
def test_a_failover_mid_stream_with_wait_replicas_loses_and_duplicates_nothing(env, group):
    """WAIT 1 needs a replica after the failover too: the second replica follows the promoted one."""
    _setup_rides(env, group, ", wait_replicas: 1, wait_timeout_ms: 1000")
    traffic = RideTraffic(env.dsn, riders=20, seed=11)
    traffic.start()
    bridge = env.start_bridge(env=SENTINEL_ENV)
    consumer = env.start_consumer("totals", env=SENTINEL_ENV)
    first = group.client_of(group.master)
    wait_for(lambda: first.xlen("cdc:ride") > 200, 60, "the bridge to stream through the sentinels' master")
    time.sleep(random.Random().uniform(0.0, 1.5))  # a random moment of the stream, not a wait for a condition

    faulted = time.monotonic()
    old = group.kill_master()
    # what each replica holds once it saw its master go (it applied all it had received): after that,
    # what the promoted one gains is new
    wait_for(lambda: not any(group.link_up(r) for r in group.replicas), 10, "the replicas to lose their master")
    held_by = {r.port: _mark(group.client_of(r)) for r in group.replicas}
    new = group.wait_promoted(old)
    held = held_by[new.port]
    promoted = time.monotonic()
    _waiting([bridge, consumer], lambda: _mark(group.client_of(new)) > held, 60, "a new entry on the promoted master")
    recovered = time.monotonic()
    print(f"\nfailover: promoted {promoted - faulted:.2f}s after kill -9, first new entry after {recovered - faulted:.2f}s")

    target = env.current_wal()
    _waiting([bridge], lambda: _mark(group.client_of(new)) > target, 60, "the bridge to keep streaming after the failover")
    traffic.stop()
    target = env.current_wal()
    wait_for(lambda: env.confirmed_flush() >= target or _mark(env.redis) >= target, 60, "the bridge to catch up")
    expected = {k: v for k, v in truth(env).items() if v != 0}
    _waiting([consumer], lambda: state(env, "totals") == expected, 90, "the consumer to reach the exact totals")

    assert bridge.poll() is None, bridge.log_path.read_text()[-3000:]
    for proc in (bridge, consumer):
        text = proc.log_path.read_text()
        assert not any(m in text for m in LOSS_MARKERS), f"false data-loss alarm: {text[-3000:]}"
        assert SENTINEL_PASSWORD not in text
    assert b"data_loss" not in env.redis.hgetall(f"cdc:bridge:{env.slot}:state")
    _assert_stream_exact(env)
    assert traffic.transactions > 100
    for proc in (bridge, consumer):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.log_path.read_text()[-3000:]


@pytest.mark.slow
def test_without_wait_replicas_a_replica_behind_is_a_loss_named_exactly_and_cdc_recover_repairs_it(env, group):
    _setup_rides(env, group, ", wait_replicas: 0")
    bridge = env.start_bridge(env=SENTINEL_ENV)
    master, replica = group.client_of(group.master), group.client_of(group.replica)
    target = env.current_wal()
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 20, g * 1.5 FROM generate_series(1, 300) g")
    # the transaction spans several batches: all of them, and the record after them, on both
    _waiting([bridge], lambda: master.xlen("cdc:ride") == 300 and int(master.get(f"cdc:bridge:{env.slot}:flushed")) > target,
             60, "the first rides in redis")
    wait_for(lambda: replica.xlen("cdc:ride") == 300 and replica.get(f"cdc:bridge:{env.slot}:flushed") ==
             master.get(f"cdc:bridge:{env.slot}:flushed"), 30, "the replica to have them")

    # the replica stops applying what its master sends (it still answers the sentinels)
    assert replica.execute_command("CLIENT", "PAUSE", "120000", "WRITE")
    held = int(replica.get(f"cdc:bridge:{env.slot}:flushed"))
    env.execute("DELETE FROM rides WHERE id % 10 = 3")
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 20, g FROM generate_series(1, 50) g")
    target = env.current_wal()
    _waiting([bridge], lambda: env.confirmed_flush() >= target, 60, "the slot to be acknowledged past the lost range")
    assert int(replica.get(f"cdc:bridge:{env.slot}:flushed")) == held

    old = group.kill_master()
    # the replica dropped its master and, with it, what it had received but not applied; the pause
    # ends before the failover, which it would hold up
    wait_for(lambda: not group.link_up(group.replica), 10, "the replica to lose its master")
    replica.execute_command("CLIENT", "UNPAUSE")
    assert int(replica.get(f"cdc:bridge:{env.slot}:flushed")) == held
    new = group.wait_promoted(old)
    assert new is group.replica
    assert bridge.wait(90) == 6, bridge.log_path.read_text()[-3000:]
    log = bridge.log_path.read_text()
    found = re.search(r"redis lost entries: it holds changes up to (\S+), but slot '(\S+)' was acknowledged up to "
                      r"(\S+); entries of transactions committed in \((\S+), (\S+)\]", log)
    assert found, log[-3000:]
    assert found.group(1) == str(Lsn(held)) and found.group(2) == env.slot
    assert Lsn.parse(found.group(3)) >= Lsn(target)
    assert group.client_of(new).xlen("cdc:ride") == 300, "nothing is written past a detected loss"

    result = env.cdc("recover", env=SENTINEL_ENV)
    assert result.returncode == 0, result.stderr
    assert f"redis lost the entries of transactions committed in ({found.group(1)}, " in result.stdout
    env.execute("UPDATE rides SET distance_m = 7 WHERE id = 4")
    env.cdc("run", "--until-caught-up", check=True, env=SENTINEL_ENV)
    _assert_stream_exact(env)
    # the other commands through the sentinels, to the promoted master
    status = env.cdc("status", "--json", check=True)
    assert '"data_loss": null' in status.stdout
    env.cdc("trim", check=True)
    assert env.cdc("read", "--entity", "ride", "--limit", "1", check=True).stdout.strip()
    assert SENTINEL_PASSWORD not in log + result.stdout + result.stderr


@pytest.mark.slow
def test_with_one_replica_the_bridge_waits_after_a_failover_until_the_old_master_rejoins(env, group):
    """WAIT 1 on a promoted master with no replica: every batch is retried, nothing acknowledged past
    it, until the old master comes back (the sentinels make it a replica); then exact, no alarm."""
    _setup_rides(env, group, ", wait_replicas: 1, wait_timeout_ms: 500")
    bridge = env.start_bridge(env=SENTINEL_ENV)
    target = env.current_wal()
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 20, g FROM generate_series(1, 100) g")
    _waiting([bridge], lambda: _mark(group.client_of(group.master)) > target, 60, "the first rides in redis")
    old = group.kill_master()
    new = group.wait_promoted(old)
    env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 20, g FROM generate_series(1, 50) g")
    waiting = env.current_wal()
    _waiting([bridge], lambda: "only 0 of 1 redis replicas acknowledged" in bridge.log_path.read_text(), 60,
             "the bridge to wait for a replica of the promoted master")
    assert env.confirmed_flush() < waiting, "the slot was told about batches no replica holds"

    old.start()  # back with its own data; the sentinels turn it into a replica of the promoted master
    wait_for(lambda: group.client_of(old).role()[0] == "slave" and group.link_up(old), 60,
             "the old master to rejoin as a replica")
    _waiting([bridge], lambda: env.confirmed_flush() >= waiting, 60, "the bridge to resume once a replica is back")
    assert bridge.poll() is None and not any(m in bridge.log_path.read_text() for m in LOSS_MARKERS)
    assert group.current_master() is new
    _assert_stream_exact(env)
    assert len(read_stream(env.redis, "cdc:ride")) == 150
