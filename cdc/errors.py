"""One exception tree, grouped by what the operator must do.

The CLI turns any `CdcError` into one line on stderr and the error's `exit_code`
(the table is in docs/reference/exit-codes.md); anything else is a bug, reported as
one line with exit code 1 (``CDC_TRACEBACK=1`` shows its traceback).
"""

from __future__ import annotations

__all__ = [
    "SlotTaken",
    "CdcError",
    "ConfigError",
    "UsageError",
    "MappingError",
    "CastRefused",
    "SourceError",
    "SlotError",
    "PrivilegeError",
    "PublishError",
    "DataLossError",
    "TransientError",
]


class CdcError(Exception):
    """Base of every error the bridge reports to an operator."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}; {self.hint}"
        return self.message


class ConfigError(CdcError):
    """The configuration file or environment is wrong: fix the config."""

    exit_code = 2


class UsageError(ConfigError):
    """The command line is wrong: an unknown option, a bad value, a missing argument."""


class MappingError(CdcError):
    """A mapping is invalid or no longer matches its table: fix the mapping."""

    exit_code = 3


class CastRefused(MappingError):
    """A value a field's cast cannot write exactly (docs/reference/mappings.md#casts): the bridge stops on
    its change, the slot held before it, rather than publish a value rounded or cut; change or drop the cast."""


class SourceError(CdcError):
    """PostgreSQL is not set up for logical replication as needed: fix the server."""

    exit_code = 4


class SlotError(SourceError):
    """The replication slot or publication is missing or unusable."""


class PrivilegeError(SourceError):
    """The database role lacks a privilege the bridge needs."""


class PublishError(CdcError):
    """Redis refused the data for a reason that retrying will not fix."""

    exit_code = 5


class DataLossError(PublishError):
    """Redis no longer holds entries the slot was told it holds: restore it, or rebuild the streams (cdc recover)."""

    exit_code = 6


class TransientError(CdcError):
    """A failure worth retrying: a connection dropped, a server restarting."""

    exit_code = 75


class SlotTaken(TransientError):
    """Another bridge started streaming the slot first, between `cdc run`'s look at who holds it and
    its own START_REPLICATION: running again later may succeed (exit 75), but this run never streamed,
    so it stops instead of retrying as a standby nobody declared."""
