"""The interface of the compiled `cdc.sink._resp` (built from ``_resp.pyx``).

Both functions have pure-Python twins of the same names and signatures in
`cdc.sink.lane`, the specification they must agree with byte for byte;
`cdc.speedups` picks which runs. tests/bridge/test_compiled.py holds both modules
to this file.
"""

from collections.abc import Sequence

__all__ = ["xadd_command", "pack_past", "plain_array_end"]

def xadd_command(stream: bytes, entry: Sequence) -> bytes: ...
def pack_past(stream: bytes, entries: Sequence[Sequence], held: str) -> tuple[bytes, list[str]]: ...
def plain_array_end(data: bytes, count: int) -> int: ...
