"""Drift: how a consumer's state differs from what it should hold, per key and value. Pure.

For sums and counts a missing row is a zero (a rider whose rides were all
deleted may keep a 0 row, or none); for min and max a missing row is missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from .spec import Aggregate

__all__ = ["DriftReport", "KeyDrift", "compare", "render_table"]


@dataclass(frozen=True)
class KeyDrift:
    key: tuple
    column: str
    expected: Any
    actual: Any

    @property
    def difference(self) -> Any:
        """expected - actual, when both are numbers."""
        if isinstance(self.expected, (int, Decimal, float)) and isinstance(self.actual, (int, Decimal, float)):
            return self.expected - self.actual
        return None

    def as_json(self, key_columns: Sequence[str]) -> dict:
        return {
            "key": dict(zip(key_columns, (_plain(k) for k in self.key))),
            "column": self.column,
            "expected": _plain(self.expected),
            "actual": _plain(self.actual),
            "difference": _plain(self.difference),
        }


@dataclass
class DriftReport:
    keys_compared: int = 0
    drifted: list[KeyDrift] = field(default_factory=list)
    #: keys the truth has and the state lacks, and the reverse, with the sums of their additive values
    only_truth: int = 0
    only_state: int = 0
    only_truth_totals: dict[str, Any] = field(default_factory=dict)
    only_state_totals: dict[str, Any] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not self.drifted

    @property
    def keys_drifted(self) -> int:
        return len({d.key for d in self.drifted})

    def as_json(self, key_columns: Sequence[str]) -> dict:
        return {
            "keys_compared": self.keys_compared,
            "keys_drifted": self.keys_drifted,
            "only_in_truth": {"keys": self.only_truth, "totals": {k: _plain(v) for k, v in self.only_truth_totals.items()}},
            "only_in_state": {"keys": self.only_state, "totals": {k: _plain(v) for k, v in self.only_state_totals.items()}},
            "drift": [d.as_json(key_columns) for d in self.drifted],
        }


def _plain(value: Any) -> Any:
    """JSON-friendly and exact: decimals as strings, keys as they are."""
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)


def _empty(aggregate: Aggregate) -> Any:
    return Decimal(0) if aggregate.additive else None


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return a == b


def compare(expected: dict[tuple, tuple], actual: dict[tuple, tuple], values: Sequence[Aggregate]) -> DriftReport:
    """Compare per key and value; missing rows count as zero for additive values."""
    report = DriftReport()
    for a in values:
        if a.additive:
            report.only_truth_totals[a.name] = Decimal(0)
            report.only_state_totals[a.name] = Decimal(0)
    empty = tuple(_empty(a) for a in values)
    for key in sorted(expected.keys() | actual.keys(), key=_sort_key):
        report.keys_compared += 1
        exp, act = expected.get(key), actual.get(key)
        if act is None:
            report.only_truth += 1
            for a, v in zip(values, exp):
                if a.additive and v is not None:
                    report.only_truth_totals[a.name] += v
        elif exp is None:
            report.only_state += 1
            for a, v in zip(values, act):
                if a.additive and v is not None:
                    report.only_state_totals[a.name] += v
        for a, e, v in zip(values, exp or empty, act or empty):
            if a.additive:
                e = Decimal(0) if e is None else e
                v = Decimal(0) if v is None else v
            if not _same(e, v):
                report.drifted.append(KeyDrift(key, a.name, e, v))
    return report


def _sort_key(key: tuple) -> tuple:
    return tuple((0, k) if isinstance(k, (int, float, Decimal)) else (1, str(k)) for k in key)


def render_table(report: DriftReport, key_columns: Sequence[str], limit: int = 20) -> str:
    """The largest drifts as an aligned text table (most first), and a line for the rest."""
    if not report.drifted:
        return "no drift"
    rows = sorted(report.drifted, key=lambda d: -abs(d.difference) if d.difference is not None else 0)
    header = [*key_columns, "value", "expected", "actual", "difference"]
    body = [[*(str(k) for k in d.key), d.column, _text(d.expected), _text(d.actual), _text(d.difference)]
            for d in rows[:limit]]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *body]]
    if len(rows) > limit:
        lines.append(f"... and {len(rows) - limit} more")
    return "\n".join(lines)


def _text(value: Any) -> str:
    return "-" if value is None else str(value)
