"""The ``cdc`` command line: arguments, logging and how a command ends, around the library.

Nothing outside this package imports it: `cdc.source`, `cdc.mapping`, `cdc.sink`, `cdc.bridge`,
`cdc.consume`, `cdc.reconcile` and `cdc.ops` are library code a consumer author can import
without the command line. `main` (`cdc.cli.entry`) is the entry point; each subcommand's
implementation is in the module named after the package it drives (`bridge.py`: run and
backfill; `consume.py`: consume, replay, read, dlq; `ops.py`: init, check, recover, schema,
status, trim; `reconcile.py`), `args.py` is the grammar, `common.py` what they share and
`progress.py` the progress display of `cdc backfill --wait` and `cdc reconcile`.
"""

from .entry import build_parser, main

__all__ = ["build_parser", "main"]
