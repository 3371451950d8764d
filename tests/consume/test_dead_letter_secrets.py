"""A handler's error that quotes a secret (a password, a token, credentials in a URL) is masked in the
dead letter written to Redis, in `cdc dlq list` / `cdc dlq show` and in the consumer's log."""

from __future__ import annotations

import itertools
import json
import os
import signal
import string
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from cdc.demo.local import wait_for

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent
RIDES = 6

#: where a secret sits in an error text, as handlers and client libraries write them
SHAPES = (
    "connection failed: password={}",
    "connection failed: password='{}'",
    "login refused (password:{})",
    "token={} rejected",
    "bad request: secret={}&x=1",
    "client_secret={}, access_token={}",
    "api_key={}",
    "HTTP 401 sending Authorization: Bearer {}",
    "HTTP 401 sending Authorization: Basic {}",
    "cannot reach redis://user:{}@cache:6379/0",
    "cannot reach redis://:{}@cache:6379/0",
    "could not connect to postgresql://app:{}@db:5432/app",
    "could not connect to postgres://app:{}@db/app?sslmode=require",
)
# a secret: a marker (so that no id, LSN or stream name can contain it by chance) and characters tokens use
secrets = st.text(string.ascii_letters + string.digits + "-_.~+/!$*", min_size=6, max_size=24).map(lambda s: "Sx7" + s)
error_texts = st.tuples(st.sampled_from(SHAPES), secrets, st.text(string.ascii_letters + " :", max_size=12)).map(
    lambda t: (t[2] + t[0].format(t[1], t[1]), t[1]))
groups = itertools.count()


@pytest.fixture
def rides(env):
    env.init_rides("ride.yaml", sql=("10_rocket_rides.sql", "20_consumer_state.sql"), riders=2)
    env.execute("INSERT INTO rides (id, rider_id, distance_m) SELECT g, 1 + g %% 2, g FROM generate_series(1, %s) g",
                (RIDES,))
    env.cdc("run", "--until-caught-up", check=True)
    return env


# each example runs a consumer: a few examples, not shrunk (a failing one is printed whole)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(errors=st.lists(error_texts, min_size=RIDES, max_size=RIDES))
@example(errors=[("connection failed: password=Hunter2Secret", "Hunter2Secret")] * RIDES)
def test_secrets_in_handler_errors_never_reach_dead_letters_or_output(rides, errors):
    group = f"s{next(groups)}"
    texts = rides.tmp / f"{group}.json"
    texts.write_text(json.dumps({str(i + 1): text for i, (text, _) in enumerate(errors)}))
    environ = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               "HANDLER_ERRORS_FILE": str(texts)}
    proc = rides._start(f"consumer-{group}", "consume", "--entity", "ride", "--group", group, "--start", "0",
                        "--count", "1", "--max-deliveries", "1", "--handler", "failing_handlers:raising_secrets",
                        env=environ)
    try:
        wait_for(lambda: rides.redis.xlen(f"cdc:dlq:{group}") == RIDES or proc.poll() is not None, 60,
                 "every ride dead-lettered")
        assert proc.poll() is None, proc.log_path.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    stored = [(entry_id.decode(), {k.decode(): v.decode() for k, v in fields.items()})
              for entry_id, fields in rides.redis.xrange(f"cdc:dlq:{group}")]
    assert len(stored) == RIDES
    assert all("***" in fields["error"] and fields["error"].startswith("RuntimeError: ") for _, fields in stored)
    listed = rides.cdc("dlq", "list", "--group", group, check=True)
    shown = rides.cdc("dlq", "show", "--group", group, *(entry_id for entry_id, _ in stored), check=True)
    assert len(orjson.loads("[" + shown.stdout.replace("}\n{", "},{") + "]")) == RIDES
    failures = [k.decode() for k in rides.redis.keys("*failures*")]
    outputs = {
        "dead letters in redis": json.dumps([fields for _, fields in stored]),
        "failure counts in redis": json.dumps([{k.decode(): v.decode() for k, v in rides.redis.hgetall(k).items()}
                                               for k in failures]),
        "cdc dlq list": listed.stdout + listed.stderr,
        "cdc dlq show": shown.stdout + shown.stderr,
        "the consumer's log": proc.log_path.read_text(),
    }
    for where, text in outputs.items():
        for error, secret in errors:
            assert secret not in text, f"{where} shows {secret!r} (from {error!r}):\n{text}"
    assert "dead-lettered" in outputs["the consumer's log"]
