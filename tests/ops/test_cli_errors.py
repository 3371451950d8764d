"""Every subcommand, given garbage for each argument, ends with one `cdc: error:` line and
the documented exit code, never a traceback; `--version`, `--help`; the exit code table."""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cdc import cli, errors
from cdc.cli import args as cliargs
from cdc.demo.local import free_port
from cdc.exits import EXIT_CODES

ROOT = Path(__file__).resolve().parents[2]
NOT_SWEPT = {
    # free-form: any text is a valid name, so no value of it is garbage
    "--name": "any text names a consumer", "--group": "any text names a group",
    # only read once Spark has started (tests/reconcile covers the job's failures)
    "--master": "read by Spark (tests/reconcile covers a failing job)",
    # read only with --metrics-port (tests/consume/test_consumer_metrics.py gives it an address that cannot be bound)
    "--metrics-host": "read only with --metrics-port",
    # cdc demo's folder: any path names one (the demo makes it)
    "--root": "any path names a folder the demo makes",
}
GARBAGE = {
    "--entity": ["nosuch", ""],
    "--start": ["yesterday", "1-2-3", "2026-13-01T00:00:00Z", "2026-11-21T00:00:00"],
    "--from": ["yesterday", "-5"],
    "--to": ["tomorrow", "1-x"],
    "--handler": ["nomodule", "no.such.module:f", "cdc.demo.rocketrides:nosuch", ":"],
    "--sink": ["", "public."],
    "--transactions": ["cdc:ride", ""],
    "--state-dsn": ["postgresql:/u:S3cret-state@db/app", "not a dsn", "postgresql://u:S3cret-state@h/db?nosuch=1"],
    "--where": ["1 =;", "no_such_column > 0"],
    "--spec": ["nosuch"],
    "--report": ["/nonexistent/folder/report.json"],
    "--metrics-file": ["/nonexistent/folder/cdc.prom"],
    "--log-level": ["loud"],
    "--log-format": ["xml"],
    "--role": ["", "r" * 64, "two\nlines"],
    "--file": ["nosuch.sql", "../cdc.yaml"],
    "--pg-port": ["abc", "-1", "65536"], "--redis-port": ["abc", "-1", "65536"], "--http-port": ["abc", "-1", "65536"],
    "--rate": ["abc", "0", "-1", "nan", "inf"],
    "--seconds": ["abc", "-1", "nan", "inf"],
}
NUMBERS = ["abc", "-1", "1e999x", "nan", "inf", "-inf"]


def subcommands() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every (sub)command's parser, by its words: ('dlq', 'show'), ('run',), ..."""
    found = {}

    def walk(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs and words:
            found[words] = parser
        for sub in subs:
            for name, child in sub.choices.items():
                walk(child, (*words, name))

    walk(cli.build_parser(), ())
    return found


def has_config(parser: argparse.ArgumentParser) -> bool:
    """Every command reads a config but `cdc demo`, which writes its own."""
    return any("--config" in a.option_strings for a in parser._actions)


def required(parser: argparse.ArgumentParser, skip: str) -> list[str]:
    """Valid values for the parser's required options (other than `skip`), so only one argument is garbage."""
    args = []
    for action in parser._actions:
        if action.required and action.option_strings and action.option_strings[0] != skip:
            args += [action.option_strings[0], {"--entity": "ride", "--from": "0"}.get(action.option_strings[0], "g")]
    return args


def cases(config: str) -> list[tuple[list[str], str]]:
    """(argv, what is wrong) for every argument of every subcommand, and the generic mistakes."""
    out: list[tuple[list[str], str]] = [([], "no command"), (["bogus"], "unknown command"),
                                        (["--log-level", "loud", "status"], "bad global option")]
    for words, parser in subcommands().items():
        base = [*words, "--config", config] if has_config(parser) else [*words]
        if has_config(parser):
            out += [([*words, "--config", "/nonexistent/cdc.yaml", *required(parser, "")], "missing config"),
                    ([*words, "--config", str(ROOT), *required(parser, "")], "config is a folder")]
        out += [([*base, *required(parser, ""), "--bogus"], "unknown option"),
                ([*base, *required(parser, ""), "extra"], "extra positional")]
        if any(a.required for a in parser._actions if a.option_strings):
            out.append((base, "missing required option"))
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or action.dest in ("help", "config"):
                if not action.option_strings and action.dest == "ids":
                    out.append(([*base, *required(parser, ""), "not-an-id"], "unknown dead letter"))
                continue
            option = action.option_strings[0]
            if option in NOT_SWEPT:
                continue
            values = NUMBERS if action.type in (int, float, cliargs.number) else GARBAGE.get(option)
            assert values, f"{' '.join(words)} {option}: no garbage listed for it (add it to GARBAGE or NOT_SWEPT)"
            for value in values:
                extra = ["--handler", "cdc.demo.rocketrides:ride_totals"] if words == ("consume",) and option not in (
                    "--handler", "--sink") else []
                out.append(([*base, *required(parser, option), *extra, option, value], f"{option} {value!r}"))
    return out


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_garbage_for_every_argument_ends_in_one_error_line_and_exit_2(env, capsys):
    env.init_rides("ride.yaml", riders=1)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}

    class Accepted(BaseException):
        """The command took the garbage and kept running (not an Exception: nothing in cdc catches it)."""

    def accepted(signum, frame):
        raise Accepted()

    signal.signal(signal.SIGALRM, accepted)
    garbage_configs = {"binary": b"\x00\xff\xfe garbage", "a list": b"[1, 2]\n", "unknown section": b"postgress: {}\n",
                       "a wrong type": b"batch: {max_entries: lots}\n", "two documents": b"redis: {}\n---\nhttp: {}\n"}
    extra = []
    for name, content in garbage_configs.items():
        path = env.tmp / f"{name}.yaml"
        path.write_bytes(content)
        extra += [([*words, "--config", str(path), *required(parser, "")], f"config: {name}")
                  for words, parser in subcommands().items() if has_config(parser)]
    bad = []
    try:
        for argv, what in cases(str(env.config_path)) + extra:
            signal.alarm(20)
            try:
                code = cli.main(["--log-format", "text", *argv] if argv and argv[0] != "--log-level" else argv)
            except Accepted:
                code = None
            signal.alarm(0)
            out, err = capsys.readouterr()
            lines = err.splitlines()
            if code != 2 or len(lines) != 1 or not lines[0].startswith("cdc: error: ") or "Traceback" in err \
                    or "S3cret" in out + err:
                bad.append(f"{what}: cdc {' '.join(argv)} -> {code}\n{err}")
    finally:
        signal.alarm(0)
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert not bad, "\n".join(bad)


def test_the_sweep_covers_every_subcommand():
    assert {w[0] for w in subcommands()} == {"init", "check", "run", "consume", "trim", "replay", "read", "dlq",
                                             "backfill", "schema", "reconcile", "status", "recover", "sql", "demo"}
    assert {("dlq", "list"), ("dlq", "show"), ("dlq", "replay")} <= set(subcommands())


def test_version_and_every_help_says_what_defaults_and_an_example(capsys):
    assert cli.main(["--version"]) == 0
    assert re.fullmatch(r"cdc \d+\.\d+\.\d+\n", capsys.readouterr().out)
    for words, parser in subcommands().items():
        assert cli.main([*words, "--help"]) == 0
        text = capsys.readouterr().out
        assert parser.description and parser.description.split(".")[0] in " ".join(text.split()), words
        assert "config file (default: cdc.yaml)" in text or not has_config(parser), words
        example = text.split("example:\n", 1)[1].strip()
        assert example.startswith("cdc " + " ".join(words)), (words, example)
        for action in parser._actions:
            if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) and action.help:
                assert "default" in parser.format_help(), (words, action.dest)


def test_internal_errors_are_one_line_with_exit_1(monkeypatch, capsys, tmp_path):
    def boom(args):
        raise RuntimeError("boom postgresql://u:pw-internal@h/db")

    monkeypatch.setattr("cdc.cli.ops.cmd_status", boom)
    assert cli.main(["status", "--config", str(tmp_path / "x.yaml")]) == 1
    err = capsys.readouterr().err
    assert err == "cdc: error: internal error: RuntimeError: boom postgresql://u:***@h/db; set CDC_TRACEBACK=1 to see where\n"


def test_a_closed_pipe_ends_quietly(env):
    env.init_rides("ride.yaml")
    pipe = env.redis.pipeline()
    for i in range(3000):
        pipe.xadd("cdc:dlq:billing", {"source_stream": "cdc:ride", "source_id": f"{i}-0", "deliveries": "5",
                                      "error": "ValueError: " + "x" * 80})
    pipe.execute()
    command = (f"{sys.executable} -m cdc dlq list --config {env.config_path} --group billing | head -1; "
               "echo ${PIPESTATUS[0]} >&2")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert result.stdout.count("\n") == 1 and "deliveries=5" in result.stdout
    assert result.stderr == "0\n"  # no traceback, no "Exception ignored", exit 0


def test_the_exit_code_table_is_the_code():
    page = (ROOT / "docs" / "reference" / "exit-codes.md").read_text()
    table = {int(m[1]): m[2] for m in re.finditer(r"^\| `?(\d+)`? \| (.+?) \|$", page, re.M)}
    assert set(table) == set(EXIT_CODES)
    kinds = {errors.UsageError: 2, errors.ConfigError: 2, errors.MappingError: 3, errors.SourceError: 4,
             errors.SlotError: 4, errors.PrivilegeError: 4, errors.PublishError: 5, errors.DataLossError: 6,
             errors.TransientError: 75, errors.CdcError: 1}
    for kind, code in kinds.items():
        assert kind("x").exit_code == code and code in table, kind


@pytest.mark.integration
def test_each_kind_of_failure_exits_with_its_code(env):
    env.init_rides("ride.yaml")
    # a mapping's YAML syntax: 3, with file:line
    broken = env.write_mapping("broken.yaml", "entity: x\ntable: [public.rides\n")
    result = env.cdc("check")
    assert result.returncode == 3 and result.stderr.startswith(f"cdc: error: {broken}:3: invalid YAML"), result.stderr
    broken.unlink()
    # the config's YAML syntax, and a malformed DSN: 2, with file:line
    env.config_path.write_text("postgres: {dsn: 'x'\n")
    result = env.cdc("status")
    assert result.returncode == 2 and f"{env.config_path}:2: invalid YAML" in result.stderr
    env.write_config(dsn="postgresql:/cdc_bridge:pw@db/app")
    result = env.cdc("status")
    assert result.returncode == 2 and f"postgres.dsn (from {env.config_path}:1) is not a valid connection string" in result.stderr
    # a missing slot: 4; a server that does not answer: 75
    env.write_config()
    result = env.cdc("run", env={"CDC_POSTGRES_SLOT": "nosuchslot"})
    assert result.returncode == 4 and "replication slot 'nosuchslot' does not exist" in result.stderr
    env.write_config(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    result = env.cdc("trim")
    assert result.returncode == 75 and result.stderr.startswith("cdc: error: redis unavailable")
    # a wrong Redis password: 5, not transient
    env.write_config(redis_url=f"redis://nosuchuser:pw@127.0.0.1:{env.redis_server.port}/0")
    result = env.cdc("trim")
    assert result.returncode == 5 and f"redis at 127.0.0.1:{env.redis_server.port} refused the login" in result.stderr, \
        result.stderr
    # an argument: 2
    env.write_config()
    result = env.cdc("read", "--entity", "ride", "--from", "yesterday")
    assert result.returncode == 2 and result.stderr.count("\n") == 1


@pytest.mark.integration
def test_dlq_ids_are_accepted_after_the_options(env):
    env.init_rides("ride.yaml")
    env.redis.xadd("cdc:dlq:billing", {"source_stream": "cdc:ride", "source_id": "1-0", "deliveries": "5",
                                       "error": "boom"}, id="1795394575651-0")
    shown = env.cdc("dlq", "show", "--group", "billing", "1795394575651-0")  # cdc dlq --config F show ...
    assert shown.returncode == 0 and '"error": "boom"' in shown.stdout, shown.stderr
    config = str(env.config_path)
    for argv in (["dlq", "show", "--config", config, "--group", "billing", "1795394575651-0"],
                 ["dlq", "show", "--group", "billing", "1795394575651-0", "--config", config]):
        shown = subprocess.run([sys.executable, "-m", "cdc", *argv], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and '"error": "boom"' in shown.stdout, shown.stderr
    missing = env.cdc("dlq", "replay", "--group", "billing", "1-1")
    assert missing.returncode == 2 and "no dead letter 1-1 for group billing" in missing.stderr
