"""A value larger than Redis accepts in one argument stops the bridge with the limit and the fix, slot held."""

from __future__ import annotations

import orjson
import pytest
import redis

from cdc.demo.local import LocalRedis, wait_for

pytestmark = pytest.mark.integration

MAPPING = """\
entity: doc
table: public.docs
key: [id]
fields:
  id: id
  body: body
"""


@pytest.fixture
def small_bulk_redis(servers_root, env):
    # Redis' smallest proto-max-bulk-len (1 MB) stands in for its 512 MB default
    server = LocalRedis(servers_root / f"small-bulk-{env.dbname}", appendonly=False,
                        extra=["--proto-max-bulk-len", "1mb"]).start()
    yield server
    server.stop()


def test_a_value_over_the_bulk_limit_stops_the_bridge_naming_the_limit_and_the_fix(env, small_bulk_redis):
    env.execute("CREATE TABLE docs (id int PRIMARY KEY, body text)")
    env.write_mapping("doc.yaml", MAPPING)
    env.write_config(redis_url=small_bulk_redis.url)
    env.cdc("init", check=True)
    client = redis.Redis.from_url(small_bulk_redis.url)
    env.execute("INSERT INTO docs VALUES (1, 'small')")
    held = env.current_wal()
    env.execute("INSERT INTO docs VALUES (2, repeat('x', 2 * 1024 * 1024))")
    env.execute("INSERT INTO docs VALUES (3, 'after')")
    proc = env.start_bridge()
    code = proc.wait(120)
    log = proc.log_path.read_text()
    assert code == 5, log
    assert "Traceback" not in log
    line = next(t for t in log.splitlines() if t.startswith("cdc: error:"))
    assert "proto-max-bulk-len" in line and "1048576" in line and "cdc:doc" in line, line
    assert "field 'body'" in line and "2097" in line, line
    # nothing from the large row on reached the stream (the first row may have shared its write), and the
    # slot was not told otherwise
    wait_for(lambda: not env.slot_active(), 30, "the slot to be released")
    assert [e[1][b"key"] for e in client.xrange("cdc:doc")] in ([], [b'{"id":1}'])
    assert env.confirmed_flush() <= held

    # the fix the message names: a larger bulk limit, then the bridge again; every row arrives once
    client.config_set("proto-max-bulk-len", str(4 * 1024 * 1024))
    proc = env.start_bridge()
    wait_for(lambda: client.xlen("cdc:doc") >= 3, 120, "the three rows in the stream")
    proc.terminate()
    assert proc.wait(60) == 0, proc.log_path.read_text()
    entries = client.xrange("cdc:doc")
    assert [e[1][b"key"] for e in entries] == [b'{"id":1}', b'{"id":2}', b'{"id":3}']
    assert len(orjson.loads(entries[1][1][b"data"])["body"]) == 2 * 1024 * 1024
