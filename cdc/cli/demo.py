"""`cdc demo`: the demo (`cdc.demo.run`), loaded only when it runs."""

from __future__ import annotations

import argparse

__all__ = ["cmd_demo"]


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo.run import demo

    return demo(args)
