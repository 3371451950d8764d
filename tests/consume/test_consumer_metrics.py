"""A consumer's /metrics, /healthz and /readyz against real Redis and PostgreSQL: the counters move as
entries are handled, fail and are dead-lettered; the group's lag (entries and seconds) and pending
entries show while the consumer is stopped or its handler paused; `cdc consume --metrics-port` serves them."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from cdc.consume.checkpoint import ResetCount, TransactionalHandler
from cdc.consume.consumer import Consumer
from cdc.demo.local import free_port, wait_for

from failing_handlers import totals_except_fives

pytestmark = pytest.mark.integration

KEY = (("group", "g"), ("stream", "cdc:ride"))


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample as (name, sorted labels) -> value."""
    _, text = get(port, "/metrics")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(port: int, name: str, labels: tuple = KEY) -> float | None:
    return scrape(port).get((name, labels))


def publish_rides(env, first: int, last: int) -> None:
    env.execute("INSERT INTO rides (id, rider_id, distance_m) SELECT g, 1 + g %% 3, g FROM generate_series(%s::int, %s::int) g",
                (first, last))
    env.cdc("run", "--until-caught-up", check=True)


@pytest.fixture
def rides(env):
    env.init_rides("ride.yaml", sql=("10_rocket_rides.sql", "20_consumer_state.sql"), config="trim: {interval_s: 0}\n",
                   riders=3)
    publish_rides(env, 1, 100)
    return env


def test_the_numbers_move_as_entries_are_handled_fail_and_wait(rides):
    env = rides
    client = redis.Redis.from_url(env.redis_server.url)
    consumer = Consumer(client, ["cdc:ride"], "g", "c1", count=10, max_deliveries=2, lease_ttl_ms=60_000)
    consumer.create_group("0")
    paused, resume = threading.Event(), threading.Event()

    def apply(conn, entries, name):  # rides divisible by 5 fail; while `paused`, a batch waits in the handler
        if paused.is_set():
            resume.wait(60)
        totals_except_fives(conn, entries, name)

    handler = TransactionalHandler(env.dsn, "g", apply, epoch_of=consumer.epoch)
    server = consumer.serve_metrics(0, "127.0.0.1", refresh_s=0.1, slot=env.slot, resets=ResetCount(env.dsn, "g"))
    port, stop = server.port, threading.Event()
    try:
        # not started: the whole stream waits, since the rides' commit
        wait_for(lambda: sample(port, "cdc_consumer_lag_entries") == 100, 10, "the lag of a group not reading")
        assert sample(port, "cdc_consumer_lag_seconds") > 0
        assert get(port, "/readyz") == (503, "not ready: starting\n")
        assert get(port, "/healthz") == (200, "ok\n")
        assert sample(port, "cdc_redis_data_loss", (("slot", env.slot),)) == 0

        thread = threading.Thread(target=consumer.run, args=(handler, stop))
        thread.start()
        wait_for(lambda: sample(port, "cdc_consumer_dead_letters_total") == 20, 60, "the 20 failing rides dead-lettered")
        wait_for(lambda: sample(port, "cdc_consumer_lag_entries") == 0 and sample(port, "cdc_consumer_pending_entries") == 0,
                 30, "the group to settle")
        numbers = scrape(port)
        assert numbers[("cdc_consumer_entries_total", KEY)] == 80
        assert numbers[("cdc_consumer_failures_total", KEY)] == 40  # each failing ride twice (max_deliveries 2)
        assert numbers[("cdc_consumer_handler_seconds_count", (("group", "g"),))] >= 10
        assert numbers[("cdc_consumer_lag_seconds", KEY)] == 0
        assert numbers[("cdc_consumer_oldest_pending_idle_seconds", KEY)] == 0
        assert numbers[("cdc_consumer_resets_total", (("group", "g"),))] == 0
        assert get(port, "/readyz") == (200, "ready: reading 1 of 1 stream(s) for group g\n")

        # paused in its handler: the batch in hand is pending, what came after it waits undelivered
        paused.set()
        publish_rides(env, 101, 110)  # ten: one batch, in the handler
        wait_for(lambda: sample(port, "cdc_consumer_pending_entries") == 10, 30, "the paused batch to be pending")
        publish_rides(env, 111, 113)
        wait_for(lambda: sample(port, "cdc_consumer_lag_entries") == 3, 30, "the rides behind the paused batch")
        first = scrape(port)
        wait_for(lambda: sample(port, "cdc_consumer_lag_seconds") > first[("cdc_consumer_lag_seconds", KEY)] + 0.3, 10,
                 "the lag in seconds to grow while paused")
        assert sample(port, "cdc_consumer_oldest_pending_idle_seconds") > 0
        paused.clear()
        resume.set()
        wait_for(lambda: sample(port, "cdc_consumer_entries_total") == 80 + 11, 30, "the paused rides handled")  # 101..113 but 105, 110
        wait_for(lambda: sample(port, "cdc_consumer_lag_entries") == 0 and sample(port, "cdc_consumer_pending_entries") == 0,
                 30, "the group to settle again")
        assert sample(port, "cdc_consumer_dead_letters_total") == 22  # 105 and 110 too

        # a reset the reconciliation applied, and a data loss the bridge recorded
        env.execute("INSERT INTO cdc_reconcile_runs (spec, consumer, position, snapshot, started_at, dry_run, status, "
                    "source_rows, truth_keys, keys_compared, keys_drifted, caught_up, replayed, report) "
                    "VALUES ('s', 'g', 1, 'x', now(), false, 'repaired', 0, 0, 0, 0, 0, 0, '{}')")
        client.hset(f"cdc:bridge:{env.slot}:state", "data_loss_at_ms", 1)
        wait_for(lambda: sample(port, "cdc_consumer_resets_total", (("group", "g"),)) == 1, 10, "the reset counted")
        wait_for(lambda: sample(port, "cdc_redis_data_loss", (("slot", env.slot),)) == 1, 10, "the data loss shown")

        # stopped: not ready, still alive, and the lag still measured
        stop.set()
        thread.join(30)
        assert get(port, "/readyz") == (503, "not ready: stopped\n")
        publish_rides(env, 114, 120)
        wait_for(lambda: sample(port, "cdc_consumer_lag_entries") == 7, 30, "the lag of a stopped consumer")
        assert get(port, "/healthz")[0] == 200
    finally:
        stop.set()
        resume.set()
        server.close()
        handler.close()


def test_cdc_consume_serves_its_metrics_and_refuses_a_port_in_use(rides):
    env = rides
    port = free_port()
    proc = env.start_consumer("totals", "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    wait_for(lambda: get(port, "/readyz")[0] == 200, 60, "the consumer to be ready")
    wait_for(lambda: sample(port, "cdc_consumer_entries_total", (("group", "totals"), ("stream", "cdc:ride"))) == 100,
             60, "the 100 rides counted")
    assert get(port, "/healthz") == (200, "ok\n")
    second = env.cdc("consume", "--entity", "ride", "--group", "other", "--sink", "public.m", "--metrics-port", str(port),
                     "--metrics-host", "127.0.0.1", timeout=60)
    assert second.returncode == 2
    assert second.stderr.strip().endswith(f"cdc: error: cannot serve metrics on 127.0.0.1:{port}: Address already in use; "
                                          "give --metrics-port a free port, or 0")
    nowhere = env.cdc("consume", "--entity", "ride", "--group", "other", "--sink", "public.m", "--metrics-port", "9",
                      "--metrics-host", "192.0.2.1", timeout=60)  # an address of no interface here
    assert nowhere.returncode == 2
    assert nowhere.stderr.strip().endswith("cdc: error: cannot serve metrics on 192.0.2.1:9: Cannot assign requested address; "
                                           "give --metrics-port a free port, or 0")
    proc.terminate()
    assert proc.wait(30) == 0, proc.log_path.read_text()


def test_the_lag_is_counted_where_redis_cannot_tell_it_and_shown_unknown_past_the_limit(env):
    """After an entry behind the group's last delivery was deleted, XINFO GROUPS lag is nil: the consumer
    counts the entries itself, up to LAG_COUNT_LIMIT; past it, the lag is left out and said to be unknown."""
    client, stream = env.redis, "cdc:ride"
    ids = [client.xadd(stream, {"op": "c", "ts_ms": 1}) for _ in range(100)]
    consumer = Consumer(client, [stream], "g", "c1")
    consumer.create_group(ids[9].decode())  # ten delivered, as it were
    client.xdel(stream, ids[49])
    assert client.xinfo_groups(stream)[0]["lag"] is None, "Redis cannot tell"
    server = consumer.serve_metrics(0, "127.0.0.1", refresh_s=0.1)
    try:
        wait_for(lambda: sample(server.port, "cdc_consumer_lag_entries") == 89, 10, "the lag counted")
        assert sample(server.port, "cdc_consumer_lag_unknown") == 0
        pipe = client.pipeline(transaction=False)
        for _ in range(10_000):
            pipe.xadd(stream, {"op": "c", "ts_ms": 1})
        pipe.execute()
        wait_for(lambda: sample(server.port, "cdc_consumer_lag_unknown") == 1, 10, "the lag unknown past the limit")
        assert sample(server.port, "cdc_consumer_lag_entries") is None
        assert sample(server.port, "cdc_consumer_lag_seconds") > 0, "always known"
    finally:
        server.close()
