"""The reference pages of the documentation, generated from the code so that they cannot drift.

``python -m cdc.cli.docgen`` rewrites the generated blocks of ``docs/reference/*.md``; with
``--check`` it changes nothing and exits 1 naming the pages that differ. A generated block sits
between two markers, so the prose around it stays hand-written::

    <!-- generated: settings (python -m cdc.cli.docgen) -->
    ...
    <!-- end of generated: settings -->

What each block is read from:

- ``settings``: the settings dataclasses of `cdc.config` (each field's ``#:`` comment is its
  description), `cdc.config.RANGES`, its choices and forms, and the ``CDC_`` variable of each;
- ``environment``: `cdc.config.OTHER_VARIABLES`;
- ``cli``: the argparse parser of `cdc.cli` (every command, its options, defaults and example);
- ``exit-codes``: `cdc.exits.EXIT_CODES` and the exception classes of `cdc.errors`;
- ``metrics``: every metric definition in the package, found in the source (a ``counter``,
  ``gauge`` or ``histogram`` call whose first argument is a ``cdc_`` name, or a
  ``prometheus_client`` ``Counter``/``Gauge``/``Histogram``/``Summary``), with its labels.

Only the documentation needs this module: nothing at run time imports it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["PAGES", "main", "render", "stale_pages"]

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "cdc"

#: each page and the blocks it holds
PAGES: dict[str, tuple[str, ...]] = {
    "docs/reference/configuration.md": ("settings", "environment"),
    "docs/reference/cli.md": ("cli",),
    "docs/reference/exit-codes.md": ("exit-codes",),
    "docs/reference/metrics.md": ("metrics",),
}

REGENERATE = ".venv/bin/python -m cdc.cli.docgen"
_BLOCK = re.compile(r"(<!-- generated: (?P<name>[a-z-]+) \(python -m cdc\.cli\.docgen\) -->\n)(?P<body>.*?)"
                    r"(<!-- end of generated: (?P=name) -->)", re.S)


def _text(text: str) -> str:
    """`text` as Markdown: ``<`` and ``>`` outside code spans escaped (``<group>`` is no HTML tag)."""
    parts = str(text).split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;").replace(">", "&gt;") for i, part in enumerate(parts))


def _cell(text: str) -> str:
    """`text` fit for one cell of a Markdown table."""
    return _text(" ".join(str(text).split()).replace("|", "\\|"))


# -- settings ---------------------------------------------------------------------------------

#: where the documentation says more about a setting (relative to docs/reference/)
SEE_ALSO: dict[str, tuple[str, str]] = {
    "postgres.failover_slot": ("PostgreSQL high availability", "../how-to/postgres-ha.md"),
    "postgres.streaming": ("Streaming of large in-progress transactions", "../performance.md#streaming-of-large-in-progress-transactions"),
    "redis.url": ("Redis Sentinel", "../how-to/redis-sentinel.md"),
    "redis.sentinel_username": ("Redis Sentinel", "../how-to/redis-sentinel.md"),
    "redis.append": ("Exactly once across crashes", "../concepts/guarantees.md#exactly-once-across-crashes"),
    "redis.cluster": ("Redis Cluster", "../how-to/redis-cluster.md"),
    "trim.max_len": ("Trimming", "../how-to/consuming.md#trimming-that-never-loses-unconsumed-entries"),
    "hash_key_file": ("Hashed fields", "mappings.md#hashed-fields"),
    "transactions.stream": ("Transaction END records", "../concepts/stream-entry-contract.md#transaction-end-records"),
    "mappings": ("Mapping keys", "mappings.md"),
    "reconcile.master": ("Reconciliation on a Spark cluster", "../how-to/spark-cluster.md"),
}


def field_comments(cls: type) -> dict[str, str]:
    """Each field's ``#:`` comment (the lines right above it), as Sphinx reads attribute docs."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        match = re.match(r"\s+([a-z_]+)\s*:", line)
        if match and pending:
            comments[match[1]] = " ".join(pending)
        pending = []
    return comments


def _shown_default(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (str, Path)):
        return f'"{value}"'
    return repr(value)


def settings_block() -> str:
    """Every setting, a section at a time: one list item each, readable at any window width."""
    from .. import config

    lines: list[str] = []
    for section, cls in config._SECTIONS.items():
        lines += ["", f"### `{section}`", ""]
        comments = field_comments(cls)
        for f in dataclasses.fields(cls):
            name = f"{section}.{f.name}"
            limits = config.RANGES.get((section, f.name))
            choices = config._CHOICES.get((section, f.name))
            form = config._FORMS.get((section, f.name))
            shown = str(limits) if limits else ", ".join(choices) if choices else form[1] if form else ""
            lines.append(_setting_item(name, type(f.default).__name__, _shown_default(f.default), shown,
                                       f"CDC_{section}_{f.name}".upper(), comments.get(f.name, "")))
    lines += ["", "### Top level", ""]
    top = field_comments(config.Settings)
    for f in dataclasses.fields(config.Settings):
        if f.name in config._SECTIONS or f.name in ("source", "hash_key", "transactions_origin"):
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc,operator]
        lines.append(_setting_item(f.name, "str", _shown_default(default), "", f"CDC_{f.name}".upper(),
                                   top.get(f.name, "")))
    return "\n".join(lines[1:]) + "\n"


def _setting_item(name: str, kind: str, default: str, limits: str, variable: str, what: str) -> str:
    if not what:
        raise ValueError(f"setting {name} has no #: comment in cdc/config.py: write what it is there")
    see = SEE_ALSO.get(name)
    if see:
        what += f" (see [{see[0]}]({see[1]}))"
    facts = [kind, f"default `{default}`"] + ([_cell(limits)] if limits else []) + [f"`{variable}`"]
    return f"- **`{name}`** ({', '.join(facts)}): {_cell(what)}"


def environment_block() -> str:
    from .. import config

    lines = ["| variable | what reads it |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(what)} |" for name, what in config.OTHER_VARIABLES.items()]
    return "\n".join(lines) + "\n"


# -- the command line -------------------------------------------------------------------------

def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield path + (name,), sub
                yield from _commands(sub, path + (name,))


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = parser.formatter_class(prog=parser.prog, width=100)  # type: ignore[call-arg]
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.option_strings:
            value = action.metavar or action.dest.upper()
            value = f"[{value}]" if action.nargs == "?" else value
            names = ", ".join(f"`{o}`" if action.nargs == 0 else f"`{o} {value}`" for o in action.option_strings)
        else:
            names = f"`{action.metavar or action.dest}`" + (" ..." if action.nargs in ("*", "+") else "")
        if action.required:
            default = "required"
        elif isinstance(action, argparse._VersionAction):
            default = ""
        elif any(action.default is unset for unset in (None, False, argparse.SUPPRESS)) or action.nargs == 0:
            default = "off" if action.nargs in (0, "?") else ""
        else:
            default = f"`{action.default}`"
        if action.choices and not isinstance(action, argparse._SubParsersAction):
            default += f" (one of {', '.join(map(str, action.choices))})"
        text = action.help or ("print the version" if isinstance(action, argparse._VersionAction) else "")
        rows.append(f"| {names} | {_cell(default)} | {_cell(text)} |")
    return rows


def cli_block() -> str:
    from ..cli import build_parser

    parser = build_parser()
    out = ["### `cdc`", "", _text(parser.description or ""), "", "```", _usage(parser), "```", "",
           "| option | default | what it does |", "|---|---|---|", *_option_rows(parser), ""]
    for path, sub in _commands(parser):
        name = " ".join(path)
        out += [f"### `cdc {name}`", "", _text(sub.description or ""), "", "```", _usage(sub), "```", ""]
        rows = _option_rows(sub)
        if rows:
            out += ["| option | default | what it does |", "|---|---|---|", *rows, ""]
        example = (sub.epilog or "").removeprefix("example:").strip()
        if example:
            out += ["Example:", "", "```sh", example, "```", ""]
    return "\n".join(out)


# -- exit codes -------------------------------------------------------------------------------

def exit_codes_block() -> str:
    from .. import errors
    from ..exits import EXIT_CODES

    raised: dict[int, list[str]] = {}
    for name, cls in vars(errors).items():
        if isinstance(cls, type) and issubclass(cls, errors.CdcError):
            raised.setdefault(cls.exit_code, []).append(f"`{name}`")
    lines = ["| code | meaning | raised as |", "|---|---|---|"]
    for code, meaning in EXIT_CODES.items():
        lines.append(f"| {code} | {_cell(meaning)} | {', '.join(sorted(raised.get(code, [])))} |")
    return "\n".join(lines) + "\n"


# -- metrics ----------------------------------------------------------------------------------

_REGISTRY_CALLS = {"counter": "counter", "gauge": "gauge", "histogram": "histogram"}
_CLIENT_CLASSES = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Summary": "summary"}


@dataclasses.dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str
    help: str
    labels: tuple[str, ...]
    module: str


def _string(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _label_sources(node: ast.AST, defs: dict[str, list[ast.AST]]) -> list[ast.AST]:
    """Where a reader's labels are written: the definitions it names (a helper method such as
    ``self._by_stream``, a local ``outcomes = {...}``) first, then the reader itself."""
    named = {sub.attr for sub in ast.walk(node) if isinstance(sub, ast.Attribute)}
    named |= {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name)}
    return [d for name in sorted(named) for d in defs.get(name, ())] + [node]


def _labels(nodes: list[ast.AST]) -> tuple[str, ...]:
    """Labels in a reader: the keys of its ``(("label", value),)`` tuples, with their values when written out."""
    found: dict[str, list[str]] = {}
    for sub in (sub for node in nodes for sub in ast.walk(node)):
        if isinstance(sub, ast.Tuple) and len(sub.elts) == 2 and _string(sub.elts[0]) and isinstance(
                getattr(sub, "parent", None), ast.Tuple):
            values = found.setdefault(_string(sub.elts[0]), [])  # type: ignore[arg-type]
            value = _string(sub.elts[1])
            if value and value not in values:
                values.append(value)
    return tuple(f"{label} ({', '.join(values)})" if values else label for label, values in found.items())


def _metric(call: ast.Call, module: str, defs: dict[str, list[ast.AST]]) -> MetricDef | None:
    func = call.func
    name = _string(call.args[0]) if call.args else None
    if not name:
        return None
    if isinstance(func, ast.Attribute) and func.attr in _REGISTRY_CALLS and name.startswith("cdc_"):
        help_text = _string(call.args[1]) if len(call.args) > 1 else ""
        reader = call.args[2] if len(call.args) > 2 else None
        labels = _labels(_label_sources(reader, defs)) if reader is not None else ()
        return MetricDef(name, _REGISTRY_CALLS[func.attr], help_text or "", labels, module)
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if called in _CLIENT_CLASSES:
        help_text = _string(call.args[1]) if len(call.args) > 1 else ""
        label_node = call.args[2] if len(call.args) > 2 else next(
            (k.value for k in call.keywords if k.arg == "labelnames"), None)
        labels = tuple(s for s in (_string(e) for e in getattr(label_node, "elts", ())) if s)
        return MetricDef(name, _CLIENT_CLASSES[called], help_text or "", labels, module)  # type: ignore[arg-type]
    return None


def _definitions(tree: ast.AST) -> dict[str, list[ast.AST]]:
    """The module's functions and assigned names (``self.x = ...`` too), by name: where a reader's helpers are written."""
    defs: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs.setdefault(node.name, []).append(node)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, (ast.Name, ast.Attribute)):
                    name = target.id if isinstance(target, ast.Name) else target.attr
                    defs.setdefault(name, []).append(node.value)
    return defs


def metric_definitions(package: Path = PACKAGE) -> list[MetricDef]:
    """Every metric the package defines, wherever it is registered, sorted by name."""
    found: dict[str, MetricDef] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                child.parent = node  # type: ignore[attr-defined]
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        defs = _definitions(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                metric = _metric(node, module, defs)
                if metric is not None and metric.name not in found:
                    found[metric.name] = metric
    return sorted(found.values(), key=lambda m: m.name)


def metrics_block() -> str:
    lines = ["| metric | type | labels | meaning | defined in |", "|---|---|---|---|---|"]
    for m in metric_definitions():
        labels = ", ".join(f"`{label.split(' ')[0]}`{label[len(label.split(' ')[0]):]}" for label in m.labels)
        lines.append(f"| `{m.name}` | {m.kind} | {labels} | {_cell(m.help)} | `{m.module}` |")
    return "\n".join(lines) + "\n"


# -- pages ------------------------------------------------------------------------------------

BLOCKS: dict[str, Callable[[], str]] = {
    "settings": settings_block, "environment": environment_block, "cli": cli_block,
    "exit-codes": exit_codes_block, "metrics": metrics_block,
}


def render(text: str, blocks: dict[str, str]) -> str:
    """`text` with each generated block replaced by its current content."""
    return _BLOCK.sub(lambda m: m[1] + "\n" + blocks[m["name"]].strip("\n") + "\n\n" + m[4], text)


def _current(root: Path) -> dict[str, tuple[str, str]]:
    """{page: (its committed text, the text the code gives)}."""
    blocks = {name: make() for name, make in BLOCKS.items()}
    pages = {}
    for page, names in PAGES.items():
        text = (root / page).read_text(encoding="utf-8")
        present = {m["name"] for m in _BLOCK.finditer(text)}
        if present != set(names):
            raise SystemExit(f"{page}: expected the generated blocks {sorted(names)}, found {sorted(present)}")
        pages[page] = (text, render(text, blocks))
    return pages


def stale_pages(root: Path = ROOT) -> list[str]:
    """The pages whose generated blocks differ from what the code gives."""
    return [page for page, (text, fresh) in _current(root).items() if text != fresh]


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(prog="python -m cdc.cli.docgen", description=__doc__.split("\n\n")[0])
    args.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is out of date")
    options = args.parse_args(argv)
    stale = []
    for page, (text, fresh) in _current(ROOT).items():
        if text != fresh:
            stale.append(page)
            if not options.check:
                (ROOT / page).write_text(fresh, encoding="utf-8")
    if options.check and stale:
        print(f"out of date: {', '.join(stale)}; regenerate them: {REGENERATE}", file=sys.stderr)
        return 1
    for page in stale:
        print(f"regenerated {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
