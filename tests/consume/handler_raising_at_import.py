"""A handler module whose import fails (a setting it reads at import is missing)."""

raise RuntimeError("RIDES_STATE_SCHEMA is not set\n(the handler reads it at import)")


def apply(conn, entries, consumer) -> None:  # never reached
    pass
