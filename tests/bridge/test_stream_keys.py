"""A stream key the bridge cannot account for: a key of another type where a stream belongs (exit 5, the
batch refused whole, nothing moved), and a stream whose history vanished (exit 6, never re-created; cdc check
reports it, cdc recover rebuilds it and the bridge runs again)."""

from __future__ import annotations

import orjson
import pytest

from cdc.demo.local import wait_for
from conftest import read_stream
from replay import replay

pytestmark = pytest.mark.integration

MODES = ["transaction", "script"]
ENTITIES = ("a", "b", "c")


def three_streams(env, append: str):
    """Tables a, b, c, each mapped to its stream cdc:<name>, and the bridge set up with `append`."""
    for name in ENTITIES:
        env.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v text NOT NULL)")
        env.write_mapping(f"{name}.yaml", f"entity: {name}\ntable: public.{name}\nkey: [id]\nfields: {{id: id, v: v}}\n")
    # one batch per source transaction here (no timer cuts one under load): a transaction refused for a
    # vanished stream then appends nothing to the others either, as the assertions below expect
    env.write_config("batch: {max_delay_ms: 60000}\n", redis=f", append: {append}")
    env.cdc("init", check=True)
    return env


def write(env, tables: tuple[str, ...], ids: range, v: str = "x") -> None:
    """One transaction inserting (or updating) `ids` in each of `tables`."""
    with env.connect() as conn, conn.transaction():
        for t in tables:
            conn.execute(f"INSERT INTO {t} SELECT g, %s FROM generate_series(%s::int, %s::int) g "
                         "ON CONFLICT (id) DO UPDATE SET v = excluded.v", (v, ids.start, ids.stop - 1))


def table(env, name: str) -> dict:
    return {i: {"id": i, "v": v} for i, v in env.execute(f"SELECT id, v FROM {name}")}


def exact(env) -> None:
    """Every stream replays to its table, from its start and from its marker, each position once."""
    for name in ENTITIES:
        entries = read_stream(env.redis, f"cdc:{name}")
        positions = [(int(e["lsn"]), int(e["seq"])) for e in entries]
        assert positions == sorted(set(positions)), f"cdc:{name} holds a position twice or out of order"
        assert replay(entries) == replay(entries, reset_at_marker=True) == table(env, name), f"cdc:{name}"


def error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("cdc: error:")]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


def marks_follow_entries(env, *streams: str) -> bool:
    """Each mark is the position of its stream's last entry: a mark moved only with its entries."""
    for name in streams:
        last = env.redis.xrevrange(f"cdc:{name}", count=1)[0][1]
        if env.redis.get(f"{{cdc:{name}}}:hwm") != b"%020d%010d" % (int(last[b"lsn"]), int(last[b"seq"])):
            return False
    return True


def record(env) -> int:
    return int(env.redis.get(f"cdc:bridge:{env.slot}:flushed"))


def commit_lsn_of_entry(env, stream: str, index: int) -> int:
    """The commit LSN of the transaction of a stream's index-th entry."""
    return int(env.redis.xrange(stream)[index][1][b"lsn"])


@pytest.mark.parametrize("append", MODES)
def test_a_string_where_a_stream_belongs_fails_the_batch_whole_and_a_replay_is_exact(env, append):
    three_streams(env, append)
    bridge = env.start_bridge()
    write(env, ("a", "b"), range(1, 11))
    wait_for(lambda: env.redis.xlen("cdc:a") == env.redis.xlen("cdc:b") == 10, 30, "the first rows")
    env.redis.set("cdc:c", "not a stream")  # while the bridge runs, between batches
    write(env, ("a", "b", "c"), range(11, 21))  # one transaction over the three streams
    write(env, ("a", "c"), range(5, 25), v="y")
    assert bridge.wait(60) == 5
    line = error_line(bridge.log_path.read_text())
    assert line == ("cdc: error: redis key cdc:c holds a string, not a stream, stream of entity c; the bridge appended "
                    "nothing; rename or delete that key (redis-cli TYPE/DEL cdc:c) and run cdc run again")
    # the bridge may have appended a piece of the transaction before the failing one (a large transaction
    # goes in pieces): the other streams' marks moved only with their entries, the failed one's not at all
    assert env.redis.get("{cdc:c}:hwm") is None and marks_follow_entries(env, "a", "b")
    held = record(env)  # the flushed record may follow keepalives, never past the failed transaction
    assert env.redis.get("cdc:c") == b"not a stream"

    result = env.cdc("check")  # reports it before a run does
    assert result.returncode == 5 and "redis key cdc:c holds a string" in result.stderr
    result = env.cdc("run", "--until-caught-up")
    assert result.returncode == 5 and error_line(result.stderr) == line
    env.redis.delete("cdc:c")  # the fix
    env.cdc("run", "--until-caught-up", check=True)
    exact(env)
    assert env.redis.xlen("cdc:a") == 10 + 10 + 20 and env.redis.xlen("cdc:c") == 10 + 20
    assert held <= commit_lsn_of_entry(env, "cdc:a", 10) == commit_lsn_of_entry(env, "cdc:c", 0)


@pytest.mark.parametrize("append", MODES)
def test_a_stream_deleted_while_running_or_stopped_is_a_data_loss_until_recovered(env, append):
    three_streams(env, append)
    bridge = env.start_bridge()
    write(env, ENTITIES, range(1, 11))
    wait_for(lambda: all(env.redis.xlen(f"cdc:{n}") == 10 for n in ENTITIES), 30, "the first rows")
    mark = env.redis.get("{cdc:b}:hwm").decode()
    lsn = int(mark[:20])
    lost_to = f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"
    env.redis.delete("cdc:b")  # while running
    write(env, ("a", "b", "c"), range(11, 16))
    assert bridge.wait(60) == 6
    line = error_line(bridge.log_path.read_text())
    assert line.startswith(f"cdc: error: stream cdc:b (stream of entity b) is gone from redis, but its mark "
                           f"{{cdc:b}}:hwm says it held entries up to {lost_to} (seq {int(mark[20:])})")
    assert "run cdc recover" in line
    assert not env.redis.exists("cdc:b"), "a vanished stream was re-created"
    assert env.redis.get("{cdc:b}:hwm").decode() == mark and marks_follow_entries(env, "a", "c")
    loss = orjson.loads(env.cdc("status", "--json", check=True).stdout)["bridge"]["data_loss"]
    assert loss["to_lsn"] == lost_to and "cdc:b" in loss["message"]
    assert "REDIS DATA LOSS" in env.cdc("status", check=True).stdout
    result = env.cdc("check")
    assert result.returncode == 6 and "stream cdc:b (stream of entity b) is gone from redis" in result.stderr
    result = env.cdc("run", "--until-caught-up")  # at session start too
    assert result.returncode == 6 and "stream cdc:b (stream of entity b) is gone" in error_line(result.stderr)

    result = env.cdc("recover")
    assert result.returncode == 0, result.stderr
    assert f"cdc:b: the stream is gone from redis (its mark said it held entries up to {lost_to}): rebuilt from its table" \
        in result.stdout
    assert orjson.loads(env.cdc("status", "--json", check=True).stdout)["bridge"]["data_loss"] is None
    env.cdc("run", "--until-caught-up", check=True)
    exact(env)
    # the failed transaction (ids 11-15) appended nothing: after the 10 rows, cdc:a holds the rebuild
    assert [e["op"] for e in read_stream(env.redis, "cdc:a")[10:12]] == ["x", "r"]

    env.redis.delete("cdc:a")  # while stopped
    write(env, ("b",), range(16, 20))
    result = env.cdc("check")
    assert result.returncode == 6 and "stream cdc:a (stream of entity a) is gone from redis" in result.stderr
    result = env.cdc("run", "--until-caught-up")
    assert result.returncode == 6 and "stream cdc:a (stream of entity a) is gone" in error_line(result.stderr)
    assert not env.redis.exists("cdc:a")
    env.cdc("recover", check=True)
    env.cdc("run", "--until-caught-up", check=True)
    exact(env)
    assert env.cdc("check").returncode == 0


@pytest.mark.one_path
def test_a_stream_replaced_by_another_type_is_a_data_loss_and_recover_never_deletes_the_key(env):
    three_streams(env, "transaction")
    write(env, ENTITIES, range(1, 6))
    env.cdc("run", "--until-caught-up", check=True)
    env.redis.rename("cdc:c", "saved")
    env.redis.hset("cdc:c", "f", "v")
    write(env, ("c",), range(6, 8))
    result = env.cdc("run", "--until-caught-up")
    assert result.returncode == 6
    line = error_line(result.stderr)
    assert line.startswith("cdc: error: redis key cdc:c holds a hash, not a stream, stream of entity c, and its mark")
    assert "redis-cli RENAME cdc:c <new name>" in line and "DEL" not in line
    result = env.cdc("recover")
    assert result.returncode == 5
    assert error_line(result.stderr) == (
        "cdc: error: redis key cdc:c holds a hash, not a stream, stream of entity c; cdc recover changed nothing; "
        "rename that key away (redis-cli RENAME cdc:c <new name>; cdc recover never deletes it), then run cdc recover again")
    assert env.redis.hgetall("cdc:c") == {b"f": b"v"}
    env.redis.delete("cdc:c")
    env.redis.rename("saved", "cdc:c")  # the stream was only moved away: putting it back is the whole fix
    env.cdc("run", "--until-caught-up", check=True)
    exact(env)


@pytest.mark.one_path
def test_entries_a_group_had_not_consumed_removed_are_a_data_loss_unless_the_trim_cap_dropped_them(env):
    three_streams(env, "transaction")
    write(env, ("a",), range(1, 21))
    env.cdc("run", "--until-caught-up", check=True)
    client = env.redis
    client.xgroup_create("cdc:a", "g", id="0")
    read = client.xreadgroup("g", "c1", {"cdc:a": ">"}, count=5)[0][1]
    client.xack("cdc:a", "g", *[entry_id for entry_id, _ in read])
    assert env.cdc("check").returncode == 0
    client.xtrim("cdc:a", maxlen=5, approximate=False)  # by hand: 10 entries the group had not read
    start = client.xrange("cdc:a", count=1)[0][0].decode()
    result = env.cdc("check")
    assert result.returncode == 6
    assert (f"stream cdc:a (stream of entity a) lost entries consumer group g had not consumed: IDs after ID "
            f"{read[-1][0].decode()} up to before {start} (10 entries)") in result.stderr
    result = env.cdc("run", "--until-caught-up")
    assert result.returncode == 6 and "lost entries consumer group g had not consumed" in error_line(result.stderr)
    assert "cdc:a" in orjson.loads(env.cdc("status", "--json", check=True).stdout)["bridge"]["data_loss"]["message"]
    env.cdc("recover", check=True)
    assert env.cdc("check").returncode == 0
    write(env, ("a",), range(21, 31))
    env.cdc("run", "--until-caught-up", check=True)
    exact(env)

    # the bridge's own cap drops what the group has not read: counted as forced, no loss
    env.write_config(extra="trim: {max_len: 3}\n", redis=", append: transaction")
    env.cdc("trim", check=True)
    assert int(client.hget("cdc:stats:trim", "cdc:a:forced")) > 0
    assert env.cdc("check").returncode == 0
    write(env, ("a",), range(31, 33))
    env.cdc("run", "--until-caught-up", check=True)


def plain_consumer(env, name: str = "consumer"):
    """`cdc consume` of entity a in group g from its start, without transaction mode (a table mirror)."""
    return env._start(name, "consume", "--entity", "a", "--group", "g", "--start", "0", "--sink", "public.a_mirror",
                      env=None)


def consumer_error(proc) -> str:
    assert proc.wait(60) == 6, proc.log_path.read_text()
    return error_line(proc.log_path.read_text())


def fix_and_run_again(env) -> None:
    """The advised fix, followed literally: cdc recover; then the bridge and the plain consumer run again."""
    env.cdc("recover", check=True)
    assert env.cdc("check").returncode == 0
    write(env, ("a",), range(21, 31), v="y")
    env.cdc("run", "--until-caught-up", check=True)
    exact(env)
    proc = plain_consumer(env, "consumer-again")
    client = env.redis

    def caught_up() -> bool:
        [g] = client.xinfo_groups("cdc:a")
        return g["last-delivered-id"] == client.xrevrange("cdc:a", count=1)[0][0] and g["pending"] == 0

    wait_for(caught_up, 60, "the plain consumer to read the rebuilt stream to its end")
    assert proc.poll() is None, proc.log_path.read_text()


@pytest.mark.one_path
def test_entries_deleted_mid_stream_a_group_had_not_read_stop_run_check_and_a_plain_consumer(env):
    three_streams(env, "transaction")
    write(env, ("a",), range(1, 21))
    env.cdc("run", "--until-caught-up", check=True)
    client = env.redis
    client.xgroup_create("cdc:a", "g", id="0")
    read = client.xreadgroup("g", "c1", {"cdc:a": ">"}, count=5)[0][1]
    client.xack("cdc:a", "g", *[entry_id for entry_id, _ in read])
    assert env.cdc("check").returncode == 0
    ids = [entry_id.decode() for entry_id, _ in client.xrange("cdc:a")]
    client.xdel("cdc:a", *ids[9:12])  # in the middle, not read yet by g: Redis reports the lag unknown
    hole = (f"stream cdc:a (stream of entity a) lost entries consumer group g had not consumed: IDs after ID {ids[4]} "
            f"up to ID {ids[11]} (deleted, XDEL) (3 entries removed from the stream other than by the bridge)")
    result = env.cdc("check")
    assert result.returncode == 6 and hole in result.stderr, result.stderr
    result = env.cdc("run", "--until-caught-up")
    assert result.returncode == 6 and hole in error_line(result.stderr)
    assert "cdc:a" in orjson.loads(env.cdc("status", "--json", check=True).stdout)["bridge"]["data_loss"]["message"]
    line = consumer_error(plain_consumer(env))
    assert (f"stream cdc:a (read by consumer group g) lost entries consumer group g had not consumed: IDs after ID "
            f"{ids[4]} up to ID {ids[11]} (deleted, XDEL)") in line
    assert client.xinfo_groups("cdc:a")[0]["last-delivered-id"].decode() == ids[4], "the consumer read nothing past it"
    fix_and_run_again(env)


@pytest.mark.one_path
def test_entries_trimmed_by_hand_before_any_delivery_stop_run_check_and_a_plain_consumer(env):
    three_streams(env, "transaction")
    write(env, ("a",), range(1, 21))
    env.cdc("run", "--until-caught-up", check=True)
    client = env.redis
    client.xgroup_create("cdc:a", "g", id="0")  # nothing delivered yet
    assert env.cdc("check").returncode == 0
    client.xtrim("cdc:a", maxlen=15, approximate=False)  # Redis then reports the lag of what is left
    assert client.xinfo_groups("cdc:a")[0]["lag"] == 15
    start = client.xrange("cdc:a", count=1)[0][0].decode()
    hole = (f"stream cdc:a (stream of entity a) lost entries consumer group g had not consumed: IDs after ID 0-0 "
            f"up to before {start} (5 entries)")
    result = env.cdc("check")
    assert result.returncode == 6 and hole in result.stderr, result.stderr
    result = env.cdc("run", "--until-caught-up")
    assert result.returncode == 6 and hole in error_line(result.stderr)
    assert "up to before " + start in consumer_error(plain_consumer(env))
    assert client.xinfo_groups("cdc:a")[0]["last-delivered-id"] == b"0-0", "the consumer read nothing past it"
    fix_and_run_again(env)


@pytest.mark.one_path
def test_the_bridges_own_trimming_while_it_runs_is_no_hole(env):
    three_streams(env, "transaction")
    env.write_config("batch: {max_delay_ms: 60000}\ntrim: {max_len: 4, interval_s: 0.1}\n",
                     redis=", append: transaction")
    client = env.redis
    client.xgroup_create("cdc:a", "g", id="0", mkstream=True)
    for n in range(1, 6):
        write(env, ("a",), range(10 * n, 10 * n + 5))
        env.cdc("run", "--until-caught-up", check=True)
        read = client.xreadgroup("g", "c1", {"cdc:a": ">"}, count=3)
        if read:
            client.xack("cdc:a", "g", *[entry_id for entry_id, _ in read[0][1]])
        env.cdc("trim", check=True)
        assert env.cdc("check").returncode == 0
    assert int(client.hget("{cdc:a}:removed", "count")) > 0, "the bridge trimmed"


@pytest.mark.one_path
def test_a_mark_replaced_by_another_type_names_it_and_recover_rebuilds_behind_a_new_mark(env):
    three_streams(env, "transaction")
    write(env, ENTITIES, range(1, 6))
    env.cdc("run", "--until-caught-up", check=True)
    env.redis.delete("{cdc:a}:hwm")
    env.redis.rpush("{cdc:a}:hwm", "x")
    result = env.cdc("check")
    assert result.returncode == 5 and "redis key {cdc:a}:hwm holds a list, not the high-water mark of stream cdc:a" \
        in result.stderr
    result = env.cdc("run", "--until-caught-up")
    assert result.returncode == 5 and "redis key {cdc:a}:hwm holds a list" in error_line(result.stderr)
    env.redis.rename("{cdc:a}:hwm", "saved")
    env.cdc("recover", check=True)
    write(env, ("a",), range(6, 8))
    env.cdc("run", "--until-caught-up", check=True)
    entries = read_stream(env.redis, "cdc:a")
    assert replay(entries, reset_at_marker=True) == table(env, "a")


@pytest.mark.one_path
def test_recover_refuses_a_mark_key_of_another_type_and_changes_nothing(env):
    three_streams(env, "transaction")
    write(env, ENTITIES, range(1, 3))
    env.cdc("run", "--until-caught-up", check=True)
    env.redis.delete("{cdc:b}:hwm")
    env.redis.sadd("{cdc:b}:hwm", "x")
    flushed = env.redis.get(f"cdc:bridge:{env.slot}:flushed")
    result = env.cdc("recover")
    assert result.returncode == 5
    assert error_line(result.stderr).startswith(
        "cdc: error: redis key {cdc:b}:hwm holds a set, not the high-water mark of stream cdc:b (entity b); "
        "cdc recover changed nothing")
    assert env.redis.get(f"cdc:bridge:{env.slot}:flushed") == flushed and env.redis.type("{cdc:b}:hwm") == b"set"


@pytest.mark.one_path
def test_script_mode_says_at_start_that_it_cannot_detect_a_redis_emptied_under_it(env):
    three_streams(env, "script")
    warning = "redis.append is script: a Redis emptied under the running bridge (FLUSHALL, FLUSHDB) goes undetected"
    assert warning in env.cdc("check").stderr
    bridge = env.start_bridge()
    write(env, ("a",), range(1, 6))
    wait_for(lambda: env.redis.xlen("cdc:a") == 5, 30, "the first rows")
    env.redis.flushall()
    write(env, ("a",), range(6, 8))
    wait_for(lambda: env.redis.xlen("cdc:a") == 2, 30, "the later rows, in a re-created stream")
    assert bridge.poll() is None, "the loss this mode cannot see"
    assert warning in bridge.log_path.read_text()
    bridge.terminate()
    bridge.wait(30)
    env.write_config("batch: {max_delay_ms: 60000}\n", redis=", append: transaction")
    assert warning not in env.cdc("check").stderr
