"""`cdc consume`'s options: each one's default in --help and in docs/reference/cli.md, bad values refused in one line."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from cdc.cli import build_parser
from cdc.consume import consumer

COMMANDS = Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli.md"


def consume_parser() -> argparse.ArgumentParser:
    [commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices["consume"]


def test_help_names_every_default():
    text = " ".join(consume_parser().format_help().split())
    for option, default in [("--count", consumer.COUNT), ("--lease-ttl-ms", consumer.LEASE_TTL_MS),
                            ("--claim-idle-ms", consumer.CLAIM_IDLE_MS), ("--max-deliveries", consumer.MAX_DELIVERIES)]:
        assert re.search(rf"{option} \S+ .*?\(default {default}\)", text), option
    assert "(default: host-pid)" in text and "$ (new entries only, the default)" in text
    assert (consumer.LEASE_TTL_MS, consumer.CLAIM_IDLE_MS, consumer.COUNT) == (2000, 5000, 1000)


def test_the_docs_list_every_option_with_the_same_default():
    options = {a.option_strings[0] for a in consume_parser()._actions if a.option_strings and a.dest not in ("help", "config")}
    section = COMMANDS.read_text().split("### `cdc consume`", 1)[1].split("\n### ", 1)[0]
    rows = {m.group(1): m.group(2).strip().strip("`") for m in re.finditer(r"^\| `(--[a-z-]+)[^|]*\| ([^|]*)\|", section, re.M)}
    assert set(rows) - {"--config"} == options
    defaults = {a.option_strings[0]: a.default for a in consume_parser()._actions if a.option_strings}
    for option in ("--count", "--lease-ttl-ms", "--claim-idle-ms", "--max-deliveries"):
        assert rows[option] == str(defaults[option]), option


def test_a_value_below_one_is_one_line_with_the_fix(tmp_path):
    for option in ("--count", "--lease-ttl-ms", "--claim-idle-ms", "--max-deliveries"):
        result = subprocess.run([sys.executable, "-m", "cdc", "consume", "--config", str(tmp_path / "cdc.yaml"),
                                 "--entity", "ride", "--group", "g", option, "0"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2
        assert result.stderr == f"cdc: error: {option} 0: must be at least 1; see cdc consume --help for the defaults\n"
