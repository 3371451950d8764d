"""YAML loading that remembers where each value came from (file:line).

Errors in configuration and mappings name the exact place to fix, so every
mapping and list loaded here carries its source position.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .errors import CdcError, ConfigError

__all__ = ["Located", "LocatedDict", "LocatedList", "load_yaml_documents", "where", "yaml_files"]


class Located:
    """Mixin: a source file and 1-based line, plus the line of each key."""

    source: str = "<unknown>"
    line: int = 0

    def where(self, key: object = None) -> str:
        lines = getattr(self, "key_lines", {})
        return f"{self.source}:{lines.get(key, self.line)}"


class LocatedDict(dict, Located):
    key_lines: dict


class LocatedList(list, Located):
    pass


def where(value: object, key: object = None) -> str:
    """`file:line` of `value` (or of `key` inside it) when known."""
    if isinstance(value, Located):
        return value.where(key)
    return "<unknown>"


class _Loader(yaml.SafeLoader):
    source = "<string>"
    error: type[CdcError] = ConfigError  # what a mistake in this file is (a mapping's: MappingError)


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> LocatedDict:
    loader.flatten_mapping(node)
    result = LocatedDict()
    result.source, result.line = loader.source, node.start_mark.line + 1
    result.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise loader.error(f"{loader.source}:{key_node.start_mark.line + 1}: a key must be a plain value") from None
        if key in result:
            raise loader.error(
                f"{loader.source}:{key_node.start_mark.line + 1}: duplicate key {key!r}",
                hint="each key may appear once in a mapping",
            )
        result[key] = loader.construct_object(value_node, deep=True)
        result.key_lines[key] = key_node.start_mark.line + 1
    return result


def _construct_sequence(loader: _Loader, node: yaml.SequenceNode) -> LocatedList:
    result = LocatedList(loader.construct_object(child, deep=True) for child in node.value)
    result.source, result.line = loader.source, node.start_mark.line + 1
    return result


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


def load_yaml_documents(text: str, source: str, error: type[CdcError] = ConfigError) -> list[Any]:
    """Every document in `text`; syntax errors become `error` (a ConfigError by default) with file:line."""

    class Loader(_Loader):
        pass

    Loader.source = source
    Loader.error = error
    try:
        return [doc for doc in yaml.load_all(text, Loader=Loader) if doc is not None]
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise error(f"{source}{line}: invalid YAML: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise error(f"{source}: invalid YAML: {exc}") from None


def yaml_files(path: Path, what: str, hint: str) -> list[Path]:
    """The ``*.yaml``/``*.yml`` files in a folder (sorted), or the one file `path` names."""
    path = Path(path)
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    if path.is_file():
        return [path]
    raise ConfigError(f"{what} path {path} does not exist", hint=hint)


def load_yaml_file(path: Path, error: type[CdcError] = ConfigError) -> list[Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})", hint="save the file as UTF-8") from None
    return load_yaml_documents(text, str(path), error)
