"""The interface of the compiled `cdc.sink._entries` (built from ``_entries.pyx``).

`parse_reply` has a pure-Python twin of the same name and signature in `cdc.sink.entry`, the
specification it must agree with (the same entries, the same errors); `cdc.consume.consumer`
picks which runs through `cdc.speedups`. tests/sink/test_compiled_entries.py holds both to it.
"""

from typing import Any

from .entry import Entry

__all__ = ["parse_reply"]

def parse_reply(reply: Any, gone: list[tuple[str, str]] | None = None) -> list[Entry]: ...
