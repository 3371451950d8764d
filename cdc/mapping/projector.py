"""Applying a mapping to decoded rows: the allowlist projection, casts, filter, key.

A `Projector` is a mapping bound to one shape of its table (the columns of the
latest Relation message, or of the live catalog for `cdc check`): column names
are resolved to positions and converters chosen once, so projecting a row is a
loop over the mapped fields only. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from typing import Any, NamedTuple

import orjson

from ..errors import CastRefused, MappingError
from .judge import INTEGER_OIDS, NUMBER_OIDS, base_oid as _base_oid, judge, old_row_missing
from .model import REDACTED, Condition, FieldSpec, Mapping
from ..source.lsn import Lsn
from ..source.pgoutput import UNCHANGED_TOAST
from ..source.shapes import ColumnShape, TableShape
from ..source.values import TypeCatalog, converter_for, type_name

__all__ = ["CastRefused", "PlanField", "Projected", "Projector", "ProjectorPlan", "Unjudgeable", "hmac_sha256",
           "message_entry"]

BOOL_OID = 16
EMPTY_KEY = b"{}"


class Projected(NamedTuple):
    """One change ready for its stream: partition number and the entry's leading fields.

    A named tuple rather than a dataclass: one is built per change, and tuples build fastest.
    """

    partition: int
    fields: list


class PlanField(NamedTuple):
    """A mapped column's field: its name in the entry, its column's position in the row, its converter
    (the value's text to what the entry holds)."""

    name: str
    column: int
    convert: Callable[[str], Any]


@dataclass(frozen=True, slots=True)
class ProjectorPlan:
    """What a `Projector` writes, resolved once from its mapping and its table's shape.

    The one description of a projection that both implementations read: the pure
    methods of `Projector` and the compiled `cdc.bridge._changes` (which turns it into
    its own C form per target, and takes the reference path for a plan it cannot
    write, e.g. one with filters: `cdc.bridge._changes.refusal` says why).
    """

    #: the fields taken from columns, in the mapping's order
    fields: tuple[PlanField, ...]
    #: the constant fields (`const:`), written after the others; never changed after construction
    consts: dict[str, Any]
    #: the key's field names, in key order (the entry's `key` object)
    key_order: tuple[str, ...]
    #: the key's fields, in field order (a delete's key and `before`, read from the old row)
    key_fields: tuple[PlanField, ...]
    #: the row predicates of `filter:`, all of which a row must pass
    filters: tuple[Callable[[Sequence[Any]], bool], ...]
    #: the stream count, and the key fields that choose a change's stream when more than one
    partitions: int
    partition_by: tuple[str, ...]
    #: the operations written ("c", "u", "d", "t", "r")
    ops: frozenset[str]
    #: whether updates and deletes carry the `before` image (an update that changed the key carries
    #: the old key in `before` even without it)
    before: bool


# Projected(partition, fields) on the hot path: one C call, not NamedTuple's Python-level __new__,
# and no _partition() call for the usual single partition
_new_projected = tuple.__new__


# -- casts: exact or refused ---------------------------------------------------------------------


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_DAY_US = 86_400_000_000
# PostgreSQL's ISO output of date, timestamp and timestamptz (DateStyle=ISO, any TimeZone): the year
# has 4 digits or more, BC dates end in " BC", a timestamptz carries its offset (+HH[:MM[:SS]])
_MOMENT = re.compile(
    r"(\d{4,})-(\d\d)-(\d\d)(?: (\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?)?(?:([+-])(\d\d)(?::(\d\d)(?::(\d\d))?)?)?( BC)?"
)
_INFINITE = frozenset({"infinity", "-infinity"})
_fromisoformat = datetime.fromisoformat
_UNIX = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICRO = timedelta(microseconds=1)


def _days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date, any astronomical year (0 is 1 BC)."""
    year -= month <= 2
    era = year // 400
    yoe = year - era * 400
    doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    return era * 146097 + yoe * 365 + yoe // 4 - yoe // 100 + doy - 719468


def _civil_from_days(days: int) -> tuple[int, int, int]:
    """The proleptic Gregorian (astronomical year, month, day) of a count of days since 1970-01-01."""
    days += 719468
    era = days // 146097
    doe = days - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, day


def _micros(text: str, refused: Callable[[str], CastRefused]) -> int:
    """Microseconds since 1970-01-01 00:00 UTC of a date, timestamp or timestamptz in PostgreSQL's text,
    exactly, BC dates and years past 9999 included (a timestamp without time zone counts as UTC)."""
    m = _MOMENT.fullmatch(text)
    if m is None:
        if text in _INFINITE:
            raise refused(f"{text}, which is no point in time")
        raise refused("text that is not a date or time")
    year, month, day, hh, mi, ss, frac, sign, oh, om, osec, bc = m.groups()
    y = int(year)
    if bc:
        y = 1 - y  # 1 BC is year 0
    seconds = _days_from_civil(y, int(month), int(day)) * 86400
    if hh is not None:
        seconds += int(hh) * 3600 + int(mi) * 60 + int(ss)
    if sign is not None:
        offset = int(oh) * 3600 + int(om or 0) * 60 + int(osec or 0)
        seconds -= offset if sign == "+" else -offset
    return seconds * 1_000_000 + (int(frac.ljust(6, "0")) if frac else 0)


def _fraction(value: int, scale: int, digits: int) -> Any:
    """`value / scale` exactly: an int when whole, else its decimal digits as a JSON number (no double
    between: 1795256100500.123 would not survive one)."""
    whole, part = divmod(value, scale)
    if not part:
        return whole
    if value < 0:
        whole, part = divmod(-value, scale)
        return orjson.Fragment(f"-{whole}.{part:0{digits}d}".rstrip("0").encode())
    return orjson.Fragment(f"{whole}.{part:0{digits}d}".rstrip("0").encode())


def _epoch(text: str, scale: int, refused: Callable[[str], CastRefused]) -> Any:
    micros = None
    if text[4:5] == "-" and text[-1:] != "C":  # years 1-9999 AD: Python's own parser, in C
        try:
            moment = _fromisoformat(text)
        except ValueError:
            pass
        else:
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=timezone.utc)
            micros = (moment - _UNIX) // _MICRO
    if micros is None:
        micros = _micros(text, refused)
    if scale == 1000:
        return _fraction(micros, 1000, 3)
    return _fraction(micros, 1_000_000, 6)


def _date(text: str, refused: Callable[[str], CastRefused]) -> str:
    if len(text) == 10 and text[4] == "-" and text[:4].isdigit():
        return text  # a date of years 1-9999 as PostgreSQL prints it
    if text[10:] in (" 00:00:00", " 00:00:00+00") and text[:4].isdigit() and text[4] == "-":
        return text[:10]  # midnight (UTC), years 1-9999
    micros = _micros(text, refused)
    if micros % _DAY_US:
        raise refused("a time of day (or a UTC offset) the date would drop")
    year, month, day = _civil_from_days(micros // _DAY_US)
    if year < 1:
        raise refused("a date before year 1 (BC), which the YYYY-MM-DD form cannot write")
    if year > 9999:
        raise refused("a year past 9999, which the YYYY-MM-DD form cannot write")
    return f"{year:04d}-{month:02d}-{day:02d}"


def _integer(text: str, refused: Callable[[str], CastRefused]) -> int:
    try:
        value = int(text)  # every integer type, and numeric without a fraction
    except ValueError:
        try:
            number = Decimal(text)
        except InvalidOperation:
            raise refused("text that is not a number") from None
        if not number.is_finite():
            raise refused("NaN or infinity, which no integer holds") from None
        if number.adjusted() > 19:
            raise refused("a value beyond 64-bit integers") from None
        if number != number.to_integral_value():
            raise refused("a value with a fractional part, which an integer would drop") from None
        value = int(number)
    if _INT64_MIN <= value <= _INT64_MAX:
        return value
    raise refused("a value beyond 64-bit integers")


def _float(text: str, refused: Callable[[str], CastRefused]) -> float:
    try:
        value = float(text)
    except ValueError:
        raise refused("text that is not a number") from None
    if value - value != 0.0:
        raise refused("NaN or infinity, which JSON numbers cannot hold")
    if repr(value) == text:
        return value  # a double's shortest text, as PostgreSQL prints float8 (extra_float_digits=3)
    try:
        same = Decimal(repr(value)) == Decimal(text)
    except InvalidOperation:
        same = False
    if not same:
        raise refused("more significant digits than a double holds, which the number would round")
    return value


_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))


def hmac_sha256(key: bytes) -> Callable[[str], str]:
    """Hex HMAC-SHA256 (RFC 2104) of a value's text under `key`, the key's two pads hashed once:
    `hmac.digest` redoes them for every value (1.7 µs a value against 0.7 µs here)."""
    block = (hashlib.sha256(key).digest() if len(key) > 64 else key).ljust(64, b"\0")
    inner0, outer0 = hashlib.sha256(block.translate(_IPAD)), hashlib.sha256(block.translate(_OPAD))

    def digest(text: str) -> str:
        inner = inner0.copy()
        inner.update(text.encode())
        outer = outer0.copy()
        outer.update(inner.digest())
        return outer.hexdigest()

    return digest


def _cast_converter(spec: FieldSpec, col: ColumnShape, catalog: TypeCatalog, mapping: Mapping,
                    shape: TableShape) -> Callable[[str], Any]:
    """The field's converter; `judge` refused a cast that does not apply to the column's type, and a value
    the cast cannot write exactly is refused here (`CastRefused`)."""
    base = _base_oid(col.type_oid, catalog)
    if spec.hash == "hmac-sha256":
        return hmac_sha256(spec.key)
    if spec.hash == "sha256":  # unkeyed: true
        salt = spec.salt
        return lambda text: hashlib.sha256(salt + text.encode()).hexdigest()
    if spec.redact:
        return lambda text: REDACTED
    cast = spec.cast
    if cast is None:
        return converter_for(col.type_oid, catalog)
    if cast == "string":
        return str
    if cast == "integer" and base in INTEGER_OIDS:
        return int  # every value fits: written as the column's own integers are
    kind = type_name(col.type_oid, catalog)
    hint = (f"drop the cast from field {spec.name!r} (the column's value then goes as its type's JSON), or "
            "change it to one that holds this value, then run cdc run again: it resumes at this change")

    def refused(reason: str) -> CastRefused:
        return CastRefused(
            f"{spec.where}: entity {mapping.entity!r}: cast {cast!r} cannot write a value of column "
            f"{col.name!r} ({kind}) of {shape.schema}.{shape.name} exactly: {reason}",
            hint=hint,
        )

    if cast == "float":
        return lambda text: _float(text, refused)
    if cast == "integer":
        return lambda text: _integer(text, refused)
    if cast == "epoch_ms":
        return lambda text: _epoch(text, 1000, refused)
    if cast == "epoch_s":
        return lambda text: _epoch(text, 1, refused)
    return lambda text: _date(text, refused)


def _comparable(base: int) -> Callable[[Any], Any]:
    if base in NUMBER_OIDS:
        return lambda v: Decimal(str(v))
    if base == BOOL_OID:
        return lambda v: v in (True, "t", "true")
    return str


class Unjudgeable(MappingError):
    """A change lacks a value the filter needs (a TOASTed value the server did not resend): the filter cannot be
    judged on it, or its create would lack a field; no guess is published."""

    def __init__(self, message: str, table: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint or f"run: ALTER TABLE {table} REPLICA IDENTITY FULL (the old row then "
                                                "carries every value)")
        self.table = table


def _condition(cond: Condition, idx: int, base: int, table: str) -> Callable[[Sequence[Any]], bool]:
    """A predicate on a row; a row that lacks the value (unchanged TOAST) stops with `Unjudgeable`."""
    if cond.op == "is_null":
        want = cond.value

        def null_check(row: Sequence[Any]) -> bool:
            value = row[idx]
            if value is UNCHANGED_TOAST:
                raise _unjudgeable(cond, table)
            return (value is None) == want

        return null_check
    comp = _comparable(base)
    if cond.op in ("in", "not_in"):
        options = {comp(v) for v in cond.value}
        positive = cond.op == "in"
        test: Callable[[Any], bool] = lambda v: (v in options) == positive  # noqa: E731
    else:
        target = comp(cond.value)
        ops: dict[str, Callable[[Any], bool]] = {
            "eq": lambda v: v == target,
            "ne": lambda v: v != target,
            "gt": lambda v: v > target,
            "gte": lambda v: v >= target,
            "lt": lambda v: v < target,
            "lte": lambda v: v <= target,
        }
        test = ops[cond.op]

    def check(row: Sequence[Any]) -> bool:
        value = row[idx]
        if value is UNCHANGED_TOAST:
            raise _unjudgeable(cond, table)
        if value is None:
            return cond.op == "ne" or cond.op == "not_in"
        try:
            return test(comp(value))
        except (InvalidOperation, TypeError):
            return False

    return check


def _unjudgeable(cond: Condition, table: str) -> Unjudgeable:
    return Unjudgeable(
        f"{cond.where}: filter on column {cond.column!r}: a change of {table} did not carry the column's value (a "
        "TOASTed value the server did not resend), so the filter cannot be judged on it", table)


class Projector:
    """A mapping bound to one shape of its table."""

    def __init__(self, mapping: Mapping, shape: TableShape, catalog: TypeCatalog) -> None:
        self.mapping = mapping
        self.shape = shape
        self._full = shape.replica_identity == "f"  # REPLICA IDENTITY FULL: every update carries its old row
        self._filtered = frozenset(c.column for c in mapping.filter)
        #: [the columns an update without its old row is known to keep], though the table is described as FULL:
        #: the identity columns common to its partitions not FULL that the server described (the bridge's loop
        #: judged each and shares this list between a table's projectors); [None] while none was
        self.carried: list[frozenset[str] | None] = [None]
        judge(mapping, shape, catalog)  # every refusal of init, check and run: before anything is bound
        positions = {c.name: i for i, c in enumerate(shape.columns)}
        fields: list[PlanField] = []
        consts: dict[str, Any] = {}
        for spec in mapping.fields:
            if spec.column is None:
                consts[spec.name] = spec.const
                continue
            idx = positions[spec.column]
            fields.append(PlanField(spec.name, idx, _cast_converter(spec, shape.columns[idx], catalog, mapping, shape)))
        key_fields = tuple(f for f in fields if f.name in mapping.key)
        by_name = {f.name: f.column for f in fields}
        #: positions of the key columns in the table's rows, in key order
        self.key_positions = [by_name[n] for n in mapping.key]
        filters = tuple(
            _condition(c, positions[c.column], _base_oid(shape.columns[positions[c.column]].type_oid, catalog),
                       f"{shape.schema}.{shape.name}")
            for c in mapping.filter
        )
        #: what this projector writes: read by both implementations of the hot path
        self.plan = ProjectorPlan(
            fields=tuple(fields), consts=consts, key_order=tuple(mapping.key), key_fields=key_fields,
            filters=filters, partitions=mapping.partitions, partition_by=tuple(mapping.partition_by),
            ops=frozenset(mapping.ops), before=mapping.before,
        )

    # -- rows ----------------------------------------------------------------------

    def _row(self, values: Sequence[Any], fallback: Sequence[Any] | None) -> tuple[dict, list | None]:
        data: dict[str, Any] = {}
        unchanged = None
        plan = self.plan
        for name, idx, conv in plan.fields:
            value = values[idx]
            if value is None:
                data[name] = None
            elif value is UNCHANGED_TOAST:
                old = fallback[idx] if fallback is not None else UNCHANGED_TOAST
                if old is UNCHANGED_TOAST:
                    if unchanged is None:
                        unchanged = []
                    unchanged.append(name)
                else:
                    data[name] = None if old is None else conv(old)
            else:
                data[name] = conv(value)
        if plan.consts:
            data.update(plan.consts)
        return data, unchanged

    def _key(self, values: Sequence[Any]) -> dict:
        key = {}
        for name, idx, conv in self.plan.key_fields:
            value = values[idx]
            key[name] = None if value is None or value is UNCHANGED_TOAST else conv(value)
        return key

    def key_json(self, values: Sequence[Any]) -> bytes:
        """The key of a row as an insert's entry writes it (the key's order)."""
        key = self._key(values)
        return orjson.dumps({n: key[n] for n in self.plan.key_order})

    def placed(self, exc: CastRefused, values: Sequence[Any], lsn: str | None, seq: int | None) -> CastRefused:
        """A cast's refusal of a value of `values`, placed: the commit LSN of its transaction (decimal, as
        entries carry it; None for a read of the table), the change's seq in it, and the row's public key
        (as the entry would carry it: hashed or redacted where the mapping says so)."""
        try:
            key = orjson.dumps(self._key(values)).decode()
            row = f"row key {key if len(key) <= 200 else key[:200] + '...'}"
        except CastRefused:
            row = "row key not shown (a cast refuses it too)"
        at = f"in the transaction committed at LSN {Lsn(int(lsn))}, change {seq}" if lsn else "in a read of the table"
        return CastRefused(f"{exc.message}; {at}, {row}", hint=exc.hint)

    def _partition(self, key: dict) -> int:
        plan = self.plan
        if plan.partitions == 1:
            return 0
        return zlib.crc32(orjson.dumps([key[n] for n in plan.partition_by])) % plan.partitions

    def _passes(self, row: Sequence[Any]) -> bool:
        for check in self.plan.filters:
            if not check(row):
                return False
        return True

    # -- changes ----------------------------------------------------------------------

    def insert(self, new: Sequence[Any]) -> Projected | None:
        plan = self.plan
        if "c" not in plan.ops or (plan.filters and not self._passes(new)):
            return None
        data, unchanged = self._row(new, None)
        key = {n: data[n] for n in plan.key_order}
        fields = [b"op", b"c", b"key", orjson.dumps(key), b"data", orjson.dumps(data)]
        if unchanged:
            fields += [b"unchanged", orjson.dumps(unchanged)]
        return _new_projected(Projected, (0 if plan.partitions == 1 else self._partition(key), fields))

    def snapshot(self, row: Sequence[Any]) -> Projected | None:
        """A row read by a snapshot or backfill (op r)."""
        plan = self.plan
        if "r" not in plan.ops or (plan.filters and not self._passes(row)):
            return None
        data, _ = self._row(row, None)
        key = {n: data[n] for n in plan.key_order}
        fields = [b"op", b"r", b"key", orjson.dumps(key), b"data", orjson.dumps(data)]
        return _new_projected(Projected, (0 if plan.partitions == 1 else self._partition(key), fields))

    @property
    def table(self) -> tuple[str, str]:
        """(schema, name) of the table this projector is bound to."""
        return self.shape.schema, self.shape.name

    def key_values(self, row: Sequence[Any]) -> tuple:
        """The key columns' raw text values, to compare with a snapshot chunk's rows."""
        return tuple(row[i] for i in self.key_positions)

    def update(self, new: Sequence[Any], old: Sequence[Any] | None, old_full: bool) -> Projected | None:
        """An update; with a filter, judged as a transition of the filtered rows (`judge` made sure the old row
        carries every filter column): in before and after, `u`; only before, a delete (`d`) of the old key;
        only after, a create (`c`); neither, nothing. A mapping publishing neither updates nor deletes
        publishes no update (its filter may not be judged on them). Each only when its op is in `ops`."""
        plan = self.plan
        if plan.filters and plan.ops & _CHANGES:
            merged = new if not old_full or old is None else _merge(new, old)
            now = self._passes(merged)
            if old is not None:
                was = self._passes(old)
            elif not self._full or self._filtered <= (self.carried[0] or _NOTHING):
                was = now  # no old row: the identity columns (all the filter reads, as judged) did not change
            else:  # FULL always sends it: a partition's own identity is not full, and was not judged
                raise old_row_missing(self.mapping, self.shape)
            if was and not now:
                return self.delete(old if old is not None else new, old_full, judged=True)
            if now and not was:
                return self._create(merged)
            if not now:
                return None
        elif plan.filters or "u" not in plan.ops:
            return None
        if "u" not in plan.ops:
            return None
        data, unchanged = self._row(new, old if old_full else None)
        key = {n: data[n] for n in plan.key_order}
        fields = [b"op", b"u", b"key", orjson.dumps(key), b"data", orjson.dumps(data)]
        if old is not None:
            if plan.before:
                fields += [b"before", orjson.dumps(self._row(old, None)[0] if old_full else self._key(old))]
            elif not any(new[f.column] is UNCHANGED_TOAST for f in plan.key_fields):  # (a key not resent did not change)
                # the key changed: the old key is part of the change, whatever `before` says (compared as
                # JSON in field order, as the compiled path does)
                moved = orjson.dumps(self._key(old))
                if moved != orjson.dumps({f.name: data[f.name] for f in plan.key_fields}):
                    fields += [b"before", moved]
        if unchanged:
            fields += [b"unchanged", orjson.dumps(unchanged)]
        return _new_projected(Projected, (0 if plan.partitions == 1 else self._partition(key), fields))

    def _create(self, new: Sequence[Any]) -> Projected | None:
        """An update that brought a row into the filter, as a create (`c`) of the whole new row."""
        plan = self.plan
        if "c" not in plan.ops:
            return None
        data, unchanged = self._row(new, None)
        if unchanged:  # a create must carry every field: no earlier value to keep
            spec = next(f for f in self.mapping.fields if f.name == unchanged[0])
            raise Unjudgeable(
                f"{spec.where}: entity {self.mapping.entity!r}: an update brought a row of "
                f"{self.shape.schema}.{self.shape.name} into the filter without resending field {unchanged[0]!r} "
                "(an unchanged TOASTed value), so its create would lack it", f"{self.shape.schema}.{self.shape.name}")
        key = {n: data[n] for n in plan.key_order}
        fields = [b"op", b"c", b"key", orjson.dumps(key), b"data", orjson.dumps(data)]
        return _new_projected(Projected, (0 if plan.partitions == 1 else self._partition(key), fields))

    def delete(self, old: Sequence[Any], old_full: bool, judged: bool = False) -> Projected | None:
        """A delete: with a filter, published when the old row passed it (`judged`: the caller found it did)."""
        plan = self.plan
        if "d" not in plan.ops or (plan.filters and not judged and not self._passes(old)):
            return None
        key = self._key(old)
        fields = [b"op", b"d", b"key", orjson.dumps(key)]
        if plan.before and old_full:
            fields += [b"before", orjson.dumps(self._row(old, None)[0])]
        return _new_projected(Projected, (0 if plan.partitions == 1 else self._partition(key), fields))

    def truncate(self) -> list[Projected]:
        if "t" not in self.plan.ops:
            return []
        return [Projected(p, [b"op", b"t", b"key", EMPTY_KEY]) for p in range(self.plan.partitions)]


_CHANGES = frozenset({"u", "d"})
_NOTHING: frozenset[str] = frozenset()


def _merge(new: Sequence[Any], old: Sequence[Any]) -> list[Any]:
    """`new` with its unchanged-TOAST holes filled from `old`, for filtering."""
    return [o if n is UNCHANGED_TOAST else n for n, o in zip(new, old)]


def message_entry(prefix: str, content: bytes) -> list:
    """Entry fields for a logical decoding message: JSON content embedded, other text as a string."""
    try:
        orjson.loads(content)
        body: Any = orjson.Fragment(content)
    except orjson.JSONDecodeError:
        body = content.decode("utf-8", errors="replace")
    return [b"op", b"m", b"key", EMPTY_KEY, b"data", orjson.dumps({"prefix": prefix, "content": body})]
