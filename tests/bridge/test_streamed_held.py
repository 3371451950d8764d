"""The held messages of streamed transactions: order, aborts, spilling (no servers)."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc.bridge.held_transactions import OVERHEAD, StreamedTransactions
from cdc.errors import SourceError, TransientError


def streamed(kind: str, xid: int, body: bytes) -> bytes:
    """A pgoutput message as a streamed block carries it: kind, (sub)transaction xid, body."""
    return kind.encode() + struct.pack(">I", xid) + body


def plain(message: bytes) -> bytes:
    return message[:1] + message[5:]


# one step: (op, top-level transaction 0..2, subtransaction 0..2 (0: the top-level one), kind, body)
steps = st.lists(
    st.tuples(st.sampled_from(["add", "add", "add", "abort", "commit"]), st.integers(0, 2), st.integers(0, 2),
              st.sampled_from("IUDTMR"), st.binary(max_size=40)),
    max_size=80,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # files are anonymous
@given(steps=steps, limit=st.sampled_from([0, 60, 200, 1 << 20]))
def test_commit_returns_what_an_unstreamed_transaction_carries(tmp_path, steps, limit):
    """Against a model: a commit gives back its transaction's messages in order without their xid,
    less the changes of aborted subtransactions (a Relation stays); an aborted one gives nothing.
    Whatever the memory limit, so with messages spilled at any point."""
    held = StreamedTransactions(limit, str(tmp_path))
    model: dict[int, list[tuple[int, bytes]]] = {}
    ended: set[int] = set()  # aborted subtransactions: an xid that ended sends nothing more
    for op, top, sub, kind, body in steps:
        xid = 100 + top
        subxid = xid if sub == 0 else 1000 + 10 * top + sub
        if op == "add" and subxid in ended:
            continue
        if op == "add":
            first = xid not in model
            held.start(xid, first)
            model.setdefault(xid, [])
            message = streamed(kind, subxid, body)
            held.add(xid, message)
            model[xid].append((subxid, message))
        elif op == "abort":
            held.abort(xid, subxid)
            if xid in model:
                if subxid == xid:
                    del model[xid]
                else:
                    model[xid] = [(s, m) for s, m in model[xid] if s != subxid or m[:1] == b"R"]
                    ended.add(subxid)
        else:
            got = list(held.commit(xid))
            assert got == [plain(m) for _, m in model.pop(xid, [])]
        assert held.size == sum(h.size for h in held.held.values())
        assert held.size <= max(limit, 0) or not held.held
        assert set(held.held) == set(model)
    held.close()
    assert held.size == 0 and not held.held


def test_spilled_messages_come_back_before_those_still_in_memory(tmp_path):
    held = StreamedTransactions(limit=3 * (OVERHEAD + 10), directory=str(tmp_path))
    held.start(7, True)
    messages = [streamed("I", 7, bytes([n]) * 5) for n in range(10)]
    for m in messages:
        held.add(7, m)
    assert held.spilled_bytes > 0 and held.held[7].messages  # some on disk, the last ones in memory
    assert os.listdir(tmp_path) == []  # spill files have no name: nothing is left behind, even by kill -9
    assert list(held.commit(7)) == [plain(m) for m in messages]
    assert held.committed == 1 and not held.held


def test_a_block_continuing_a_transaction_never_started_is_refused():
    held = StreamedTransactions(1 << 20)
    with pytest.raises(SourceError, match="never received"):
        held.start(5, first=False)


def test_a_change_outside_a_block_is_refused():
    held = StreamedTransactions(1 << 20)
    with pytest.raises(SourceError, match="outside"):
        held.add(None, streamed("I", 5, b"x"))


def test_a_spill_directory_that_cannot_be_written_names_the_fix(tmp_path):
    held = StreamedTransactions(0, str(tmp_path / "missing"))
    held.start(5, True)
    with pytest.raises(TransientError, match="batch.spill_dir"):
        held.add(5, streamed("I", 5, b"x"))
