"""Who owns what on a shared Redis, judged without a server (`cdc.sink.claims.judge`)."""

from __future__ import annotations

import pytest

from cdc.sink.claims import BridgeIdentity, judge

pytestmark = pytest.mark.one_path

A = BridgeIdentity("a", "7001", "app", "pub_a")


def test_a_standby_copy_of_the_same_config_is_no_clash():
    assert judge({"a": A.encode()}, {"cdc:ride": "a"}, A, {"cdc:ride": "ride"}) == []


def test_the_same_names_on_another_server_say_both_what_it_may_be_and_how_to_release_it():
    moved = BridgeIdentity("a", "7002", "app", "pub_a")
    (problem,) = judge({"a": A.encode()}, {}, moved, {})
    assert "is registered on this redis for publication 'pub_a' of database 'app' (system 7001)" in problem.message
    assert "but this server is system 7002: another server's bridge names the same postgres.slot" in problem.message
    assert "redis-cli HDEL {cdc:bridge}:slots a" in problem.hint and problem.exit_code == 2


def test_every_clash_is_named_at_once():
    other = BridgeIdentity("b", "7001", "app", "pub_a")  # a's publication, and a's stream
    problems = judge({"a": A.encode()}, {"cdc:ride": "a", "cdc:rider": "b"}, other,
                     {"cdc:ride": "ride", "cdc:rider": "rider"})
    assert [p.message.split(":")[0] for p in problems] == [
        "publication 'pub_a' of database 'app' (system 7001) is already read by slot 'a' on this redis",
        "stream cdc",
    ]
    assert "stream cdc:ride (entity ride) is written by the bridge of slot 'a'" in problems[1].message
