"""The compiled batch packer against its specification: the entries past a mark, packed as the reference does.

`cdc.sink._resp.pack_past` must give what `cdc.sink.lane.pack_past` gives
(the joined XADD commands of the entries whose position is past the mark, and
their positions) for any batch, including entries the compiled code
hands to `xadd_command`, and the same exception for what cannot be packed.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc.sink import lane
from test_compiled_resp import SETTINGS, compiled_resp, entries, streams

# both twins side by side in one process, whichever path the run picked: once is enough
pytestmark = pytest.mark.one_path

position_digits = st.integers(0, 40).map(lambda n: f"{n:030d}")


@st.composite
def batches(draw):
    batch = []
    for entry in draw(st.lists(entries(), max_size=8)):
        if draw(st.booleans()):
            entry[-1] = draw(position_digits)  # a position as the bridge writes them
        batch.append(entry if draw(st.integers(0, 5)) else tuple(entry))
    return batch


def outcome(pack, stream, batch, held):
    try:
        return pack(stream, [list(e) if isinstance(e, list) else e for e in batch], held)
    except Exception as exc:
        return (type(exc), str(exc))


@settings(max_examples=400, **SETTINGS)
@given(streams, batches(), st.one_of(st.just(""), position_digits))
def test_compiled_pack_past_matches_the_reference(stream, batch, held):
    compiled = compiled_resp()
    assert outcome(compiled.pack_past, stream, batch, held) == outcome(lane.pack_past, stream, batch, held)


def test_pack_past_keeps_only_what_the_mark_does_not_hold():
    compiled = compiled_resp()
    batch = [[b"op", b"c", f"{n:030d}"] for n in range(1, 6)]
    for pack in (lane.pack_past, compiled.pack_past):
        packed, positions = pack(b"s", batch, f"{3:030d}")
        assert positions == [f"{4:030d}", f"{5:030d}"]
        assert packed == lane.xadd_command(b"s", batch[3]) + lane.xadd_command(b"s", batch[4])
        assert lane.command_ends(packed, 2) == [len(lane.xadd_command(b"s", batch[3])), len(packed)]
        assert pack(b"s", batch, f"{9:030d}") == (b"", [])


@settings(max_examples=200, **SETTINGS)
@given(streams, batches())
def test_command_ends_walks_the_packed_commands(stream, batch):
    """What an aborted transaction filters again by: each packed entry's command, found by its lengths."""
    try:
        packed, positions = lane.pack_past(stream, batch, "")
    except Exception:
        return
    ends, at = [], 0
    for entry in batch:
        if not entry[-1] > "":
            continue
        at += len(lane.xadd_command(stream, entry))
        ends.append(at)
    assert lane.command_ends(packed, len(positions)) == ends
