"""The interface of the compiled `cdc.bridge._changes` (built from ``_changes.pyx``).

`route_raw` and `burst` have pure-Python twins of the same names and signatures in
`cdc.bridge.changes`, the specification they must agree with byte for byte;
`cdc.speedups` picks which runs. `refusal` is the compiled module's own: why it
leaves a projector's changes to the reference. tests/bridge/test_compiled.py holds
both modules to this file.
"""

from collections.abc import Callable
from typing import Any

from ..mapping.projector import Projector
from ..source import pgoutput as pg
from .backfill import Windows
from .batcher import Batcher
from .changes import Target
from .positions import Transaction

__all__ = ["route_raw", "burst", "refusal"]

def route_raw(kind: int, raw: bytes, offset: int, targets: list[Target], tx: Transaction, batcher: Batcher, windows: Windows,
              decoder: pg.PgOutputDecoder) -> None: ...
def burst(stream: Any, targets: dict[int, list[Target]], tx: Transaction, batcher: Batcher, windows: Windows,
          decoder: pg.PgOutputDecoder, committed: Callable[[Any], object], streams: Any) -> tuple[int, bytes | None]: ...
def refusal(projector: Projector) -> str | None: ...
