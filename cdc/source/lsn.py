"""Log sequence numbers: a position in PostgreSQL's write-ahead log.

`Lsn` is an `int` (so it compares, hashes and sorts for free) that formats as
PostgreSQL does, ``X/Y`` in upper-case hex, and parses from that form.
"""

from __future__ import annotations

__all__ = ["Lsn", "INVALID_LSN", "lsn_text"]


class Lsn(int):
    __slots__ = ()

    @classmethod
    def parse(cls, text: str) -> "Lsn":
        """Parse ``'16/B374D848'`` (as PostgreSQL prints it) into an Lsn."""
        high, sep, low = text.strip().partition("/")
        if not sep or not high or not low:
            raise ValueError(f"invalid lsn {text!r}: expected 'X/Y' in hex")
        try:
            hi, lo = int(high, 16), int(low, 16)
        except ValueError:
            raise ValueError(f"invalid lsn {text!r}: expected 'X/Y' in hex") from None
        if not (0 <= hi <= 0xFFFFFFFF and 0 <= lo <= 0xFFFFFFFF):
            raise ValueError(f"invalid lsn {text!r}: each half must fit in 32 bits")
        return cls((hi << 32) | lo)

    def __str__(self) -> str:
        return f"{self >> 32:X}/{self & 0xFFFFFFFF:X}"

    def __repr__(self) -> str:
        return f"Lsn('{self}')"


INVALID_LSN = Lsn(0)


def lsn_text(value: int | None) -> str | None:
    """A position as PostgreSQL prints it (``0/1A2B3C4``) for a person to read; None stays None.

    Redis keeps positions as decimal integers (the marks, the flushed record): every human output
    formats them through here, so a position reads the same in `cdc status`, errors and logs."""
    return None if value is None else str(Lsn(int(value)))
