"""SQL an operator writes (`cdc backfill --where`, a reconcile spec's `source.query`), kept data.

Such text is never spliced into a statement. A backfill condition is tokenized
and parsed here into a small tree of an allowlisted grammar (columns of the
mapped table, literals, comparison/boolean/arithmetic operators, IS [NOT] NULL,
IN lists, BETWEEN, LIKE/ILIKE, casts to plain types and a few immutable or
stable functions without side effects), and the SQL that runs is composed from
that tree with every identifier quoted and every literal escaped by psycopg.
Anything else (subqueries, ``;``, comments, dollar quotes, unicode escapes,
unknown names or functions) is refused with the position of the token.

A reconcile query is a whole SELECT, so it cannot be confined to a grammar this
small: `check_select` checks it lexically (one statement that stays inside its
subquery, no comments or quoting tricks, no data-modifying or locking keywords;
a WITH may only hold SELECTs, which the same keyword check ensures)
and lists the functions and operators it calls, which `volatile_calls` looks up
in the live catalog (a volatile function is the only kind that may have side
effects; every built-in one that writes, `pg_logical_emit_message` among them,
is volatile). The query then runs in READ ONLY transactions.

Pure: no I/O except `volatile_calls`, which takes a connection.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from psycopg import sql

from .errors import ConfigError

__all__ = ["WHERE_FUNCTIONS", "WHERE_TYPES", "Condition", "SqlRefused", "check_select", "parse_where", "volatile_calls"]

#: functions a --where may call: immutable or stable, no side effects
WHERE_FUNCTIONS = {
    "lower": (1, 1), "upper": (1, 1), "length": (1, 1), "char_length": (1, 1), "btrim": (1, 2),
    "substr": (2, 3), "abs": (1, 1), "round": (1, 2), "floor": (1, 1), "ceil": (1, 1),
    "coalesce": (1, 32), "nullif": (2, 2), "greatest": (1, 32), "least": (1, 32),
    "date_trunc": (2, 2), "now": (0, 0),
}
_SYNTAX_FUNCTIONS = ("coalesce", "nullif", "greatest", "least")
#: types a --where may cast to
WHERE_TYPES = (
    "text", "varchar", "boolean", "bool", "smallint", "integer", "int", "int2", "int4", "int8", "bigint",
    "numeric", "decimal", "real", "float4", "float8", "double precision", "date", "time", "timestamp",
    "timestamptz", "timestamp with time zone", "timestamp without time zone", "interval", "uuid",
)
_KEYWORDS = {"and", "or", "not", "is", "null", "true", "false", "in", "between", "like", "ilike", "cast", "as",
             "distinct", "from", "current_date", "current_timestamp"}
_COMPARISONS = ("=", "<>", "!=", "<", "<=", ">", ">=")

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<string>'(?:[^']|'')*'(?!'))
  | (?P<qident>"(?:[^"]|"")+"(?!"))
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>::|<=|>=|<>|!=|\|\||[=<>+\-*/%(),.])
""", re.VERBOSE)
#: any operator PostgreSQL can lex (a query may use json, array or regex operators)
_ANY_OPERATOR = re.compile(r"[+\-*/<>=~!@#%^&|`?]+|[\[\]:]")


@dataclass(frozen=True)
class Token:
    kind: str  # number, string, qident, ident, op, end
    text: str
    pos: int  # 1-based character position in the input

    @property
    def word(self) -> str:
        return self.text.lower() if self.kind == "ident" else ""


class SqlRefused(ConfigError):
    """Operator SQL outside what may run; the message names the token and its position."""


def _refuse(what: str, text: str, pos: int, reason: str, hint: str) -> SqlRefused:
    shown = text[pos - 1:pos + 19]
    return SqlRefused(f"{what}: {reason} at character {pos} ({shown!r})", hint=hint)


def _lex_trap(text: str, i: int) -> str | None:
    """Why the text at `i` is refused before tokenizing, or None."""
    rest = text[i:]
    if rest.startswith("--") or rest.startswith("/*"):
        return "a comment"
    if rest.startswith(";"):
        return "a statement separator ';'"
    if rest.startswith("$"):
        return "a dollar quote or parameter"
    if re.match(r"[uU]&['\"]", rest):
        return "a unicode escape"
    if re.match(r"[eEbBxXnN]'", rest):
        return "an escape, bit or national string (write a plain 'string')"
    if rest.startswith("\\"):
        return "a backslash"
    return None


def tokenize(text: str, what: str, hint: str, any_operator: bool = False) -> list[Token]:
    tokens: list[Token] = []
    i = 0
    while i < len(text):
        trap = _lex_trap(text, i)
        if trap is not None:
            raise _refuse(what, text, i + 1, trap, hint)
        m = _TOKEN.match(text, i)
        if any_operator and (m is None or m.lastgroup == "op") and (o := _ANY_OPERATOR.match(text, i)):
            if "--" in o.group() or "/*" in o.group():
                raise _refuse(what, text, i + 1 + max(o.group().find("--"), o.group().find("/*")), "a comment", hint)
            if m is None or len(o.group()) > len(m.group()):
                tokens.append(Token("op", o.group(), i + 1))
                i = o.end()
                continue
        if m is None:
            if text[i] in "'\"":
                raise _refuse(what, text, i + 1, "an unterminated quote", hint)
            raise _refuse(what, text, i + 1, f"character {text[i]!r} is not allowed", hint)
        kind = m.lastgroup
        if kind == "ident" and m.end() < len(text) and text[m.end()] in "$&'\"":
            raise _refuse(what, text, m.end() + 1, f"character {text[m.end()]!r} after a name", hint)
        if kind != "space":
            tokens.append(Token(kind, m.group(), i + 1))
        i = m.end()
    tokens.append(Token("end", "", len(text) + 1))
    return tokens


# -- --where: a boolean expression on one table's columns ------------------------------------------

WHERE_HINT = ("write one condition on the table's columns: comparisons, AND/OR/NOT, IS [NOT] NULL, IN (...), "
              "BETWEEN, LIKE/ILIKE, casts and a few functions (docs/how-to/snapshots-and-backfills.md lists them)")


@dataclass(frozen=True)
class Condition:
    """A parsed --where: the composed condition and the values of its placeholders (its string literals,
    sent as parameters: a '%' or quote in one never meets the query text)."""

    sql: sql.Composable
    params: tuple[str, ...]
    columns: frozenset[str]  # the table columns it reads


class _WhereParser:
    def __init__(self, text: str, columns: Iterable[str], table: str) -> None:
        self.text = text
        self.what = f"--where on {table}"
        self.tokens = tokenize(text, self.what, WHERE_HINT)
        self.i = 0
        self.columns = set(columns)
        self.table = table
        self.used: set[str] = set()
        self.params: list[str] = []

    # tokens
    @property
    def tok(self) -> Token:
        return self.tokens[self.i]

    def peek(self, n: int = 1) -> Token:
        return self.tokens[min(self.i + n, len(self.tokens) - 1)]

    def take(self) -> Token:
        tok = self.tok
        self.i += 1
        return tok

    def refuse(self, tok: Token, reason: str) -> SqlRefused:
        return _refuse(self.what, self.text, tok.pos, reason, WHERE_HINT)

    def accept(self, *words: str) -> bool:
        if self.tok.word in words or (self.tok.kind == "op" and self.tok.text in words):
            self.i += 1
            return True
        return False

    def expect(self, word: str) -> None:
        if not self.accept(word):
            got = "the end" if self.tok.kind == "end" else repr(self.tok.text)
            raise self.refuse(self.tok, f"expected {word.upper() if word.isalpha() else repr(word)}, found {got}")

    # grammar
    def parse(self) -> Condition:
        if self.tok.kind == "end":
            raise self.refuse(self.tok, "the condition is empty")
        tree = self.disjunction()
        if self.tok.kind != "end":
            raise self.refuse(self.tok, f"unexpected {self.tok.text!r} after the condition")
        return Condition(tree, tuple(self.params), frozenset(self.used))

    def disjunction(self) -> sql.Composable:
        parts = [self.conjunction()]
        while self.accept("or"):
            parts.append(self.conjunction())
        return parts[0] if len(parts) == 1 else sql.SQL("(") + sql.SQL(" OR ").join(parts) + sql.SQL(")")

    def conjunction(self) -> sql.Composable:
        parts = [self.negation()]
        while self.accept("and"):
            parts.append(self.negation())
        return parts[0] if len(parts) == 1 else sql.SQL("(") + sql.SQL(" AND ").join(parts) + sql.SQL(")")

    def negation(self) -> sql.Composable:
        if self.accept("not"):
            return sql.SQL("(NOT ") + self.negation() + sql.SQL(")")
        return self.predicate()

    def predicate(self) -> sql.Composable:
        left = self.arith()
        tok = self.tok
        if tok.kind == "op" and tok.text in _COMPARISONS:
            self.take()
            op = "<>" if tok.text == "!=" else tok.text
            return sql.SQL("(") + left + sql.SQL(f" {op} ") + self.arith() + sql.SQL(")")
        if self.accept("is"):
            negated = self.accept("not")
            if self.accept("null"):
                what = "NULL"
            elif self.accept("true"):
                what = "TRUE"
            elif self.accept("false"):
                what = "FALSE"
            elif self.accept("distinct"):
                self.expect("from")
                right = self.arith()
                return sql.SQL("(") + left + sql.SQL(" IS NOT DISTINCT FROM " if negated else " IS DISTINCT FROM ") + right + sql.SQL(")")
            else:
                raise self.refuse(self.tok, "IS must be followed by [NOT] NULL, TRUE, FALSE or DISTINCT FROM")
            return sql.SQL("(") + left + sql.SQL(f" IS {'NOT ' if negated else ''}{what})")
        negated = False
        if self.tok.word == "not" and self.peek().word in ("in", "between", "like", "ilike"):
            self.take()
            negated = True
        neg = sql.SQL(" NOT" if negated else "")
        if self.accept("in"):
            self.expect("(")
            if self.tok.word == "select":
                raise self.refuse(self.tok, "a subquery")
            items = [self.arith()]
            while self.accept(","):
                items.append(self.arith())
            self.expect(")")
            return sql.SQL("(") + left + neg + sql.SQL(" IN (") + sql.SQL(", ").join(items) + sql.SQL("))")
        if self.accept("between"):
            low = self.arith()
            self.expect("and")
            high = self.arith()
            return sql.SQL("(") + left + neg + sql.SQL(" BETWEEN ") + low + sql.SQL(" AND ") + high + sql.SQL(")")
        for word in ("like", "ilike"):
            if self.accept(word):
                return sql.SQL("(") + left + neg + sql.SQL(f" {word.upper()} ") + self.arith() + sql.SQL(")")
        return left

    def arith(self) -> sql.Composable:
        left = self.term()
        while self.tok.kind == "op" and self.tok.text in ("+", "-", "||"):
            op = self.take().text
            left = sql.SQL("(") + left + sql.SQL(f" {op} ") + self.term() + sql.SQL(")")
        return left

    def term(self) -> sql.Composable:
        left = self.unary()
        while self.tok.kind == "op" and self.tok.text in ("*", "/", "%"):
            op = self.take().text
            if op == "%":  # mod(): no '%' in a query that has placeholders
                left = sql.SQL("pg_catalog.mod(") + left + sql.SQL(", ") + self.unary() + sql.SQL(")")
            else:
                left = sql.SQL("(") + left + sql.SQL(f" {op} ") + self.unary() + sql.SQL(")")
        return left

    def unary(self) -> sql.Composable:
        if self.tok.kind == "op" and self.tok.text in ("-", "+"):
            op = self.take().text
            return sql.SQL(f"({op}") + self.unary() + sql.SQL(")")
        value = self.primary()
        while self.accept("::"):
            value = sql.SQL("CAST(") + value + sql.SQL(" AS ") + self.type_name() + sql.SQL(")")
        return value

    def type_name(self) -> sql.Composable:
        tok = self.tok
        if tok.kind != "ident":
            raise self.refuse(tok, "expected a type name")
        words = [self.take().word]
        if words[0] == "double" and self.accept("precision"):
            words.append("precision")
        elif words[0] == "timestamp" and self.tok.word in ("with", "without"):
            words.append(self.take().word)
            self.expect("time")
            self.expect("zone")
            words += ["time", "zone"]
        name = " ".join(words)
        if name not in WHERE_TYPES:
            raise self.refuse(tok, f"type {name!r} is not one a condition may cast to ({', '.join(WHERE_TYPES)})")
        modifiers = ""
        if name in ("numeric", "decimal", "varchar") and self.accept("("):
            numbers = [self.take()]
            while self.accept(","):
                numbers.append(self.take())
            if any(n.kind != "number" or not n.text.isdigit() for n in numbers) or len(numbers) > 2:
                raise self.refuse(numbers[0], "a type modifier must be one or two integers")
            self.expect(")")
            modifiers = "(" + ",".join(n.text for n in numbers) + ")"
        return sql.SQL(name + modifiers)

    def primary(self) -> sql.Composable:
        tok = self.tok
        if tok.kind == "number":
            self.take()
            return sql.SQL(tok.text)
        if tok.kind == "string":
            self.take()
            return self.literal(tok)
        if tok.kind == "op" and tok.text == "(":
            self.take()
            if self.tok.word in ("select", "with", "values", "table"):
                raise self.refuse(self.tok, "a subquery")
            inner = self.disjunction()
            self.expect(")")
            return inner
        if tok.word == "pg_catalog" and self.peek().text == "." and self.peek(3).text == "(":
            self.take()  # pg_catalog.lower(...): the functions are pg_catalog's anyway
            self.take()
            return self.call(self.tok)
        if tok.kind == "qident" and self.peek().text == "(":
            return self.call(tok)
        if tok.kind == "qident":
            self.take()
            return self.column(tok, tok.text[1:-1].replace('""', '"'))
        if tok.kind != "ident":
            raise self.refuse(tok, "expected a column, a value or '('" if tok.kind != "end" else "the condition ends too early")
        word = tok.word
        if word in ("true", "false", "null"):
            self.take()
            return sql.SQL(word.upper())
        if word in ("current_date", "current_timestamp"):
            self.take()
            return sql.SQL(word.upper())
        if word == "cast" and self.peek().text == "(":
            self.take()
            self.take()
            value = self.disjunction()
            self.expect("as")
            kind = self.type_name()
            self.expect(")")
            return sql.SQL("CAST(") + value + sql.SQL(" AS ") + kind + sql.SQL(")")
        if self.peek().kind == "op" and self.peek().text == "(":
            return self.call(tok)
        if self.peek().kind == "op" and self.peek().text == ".":
            raise self.refuse(tok, "a qualified name (write the column alone: the condition reads only the mapped table)")
        if self.peek().kind == "string" and " ".join([word]) in WHERE_TYPES:
            self.take()  # a typed literal: date '2024-01-01', interval '1 day'
            return sql.SQL("CAST(") + self.literal(self.take()) + sql.SQL(f" AS {word})")
        if word in _KEYWORDS or word == "select":
            raise self.refuse(tok, f"unexpected {tok.text!r}" if word != "select" else "a subquery")
        self.take()
        return self.column(tok, word)

    def literal(self, tok: Token) -> sql.Composable:
        self.params.append(tok.text[1:-1].replace("''", "'"))
        return sql.Placeholder()

    def column(self, tok: Token, name: str) -> sql.Composable:
        if name not in self.columns:
            raise self.refuse(tok, f"{name!r} is not a column of {self.table}")
        self.used.add(name)
        return sql.Identifier(name)

    def call(self, tok: Token) -> sql.Composable:
        name = tok.word if tok.kind == "ident" else tok.text[1:-1].replace('""', '"')
        if name not in WHERE_FUNCTIONS:
            raise self.refuse(tok, f"function {name!r} is not allowed in a condition")
        self.take()
        self.expect("(")
        args: list[sql.Composable] = []
        if not self.accept(")"):
            args.append(self.disjunction())
            while self.accept(","):
                args.append(self.disjunction())
            self.expect(")")
        least, most = WHERE_FUNCTIONS[name]
        if not least <= len(args) <= most:
            raise self.refuse(tok, f"{name}() takes {least}" + (f" to {most}" if most != least else "") + f" argument(s), not {len(args)}")
        if name in _SYNTAX_FUNCTIONS:  # grammar, not functions: nothing on the search_path can stand in for them
            return sql.SQL(name.upper() + "(") + sql.SQL(", ").join(args) + sql.SQL(")")
        # pg_catalog-qualified: a function of the same name in another schema on the search_path is never called
        return sql.SQL("pg_catalog.") + sql.Identifier(name) + sql.SQL("(") + sql.SQL(", ").join(args) + sql.SQL(")")


def parse_where(text: str, columns: Iterable[str], table: str) -> Condition:
    """A backfill condition on `table` (whose columns are `columns`), or `SqlRefused` naming the token."""
    return _WhereParser(text, columns, table).parse()


# -- a reconcile source.query: one SELECT that stays inside its subquery ---------------------------

SELECT_HINT = ("source.query must be one SELECT ... FROM ... (read as a subquery): no ';', comments, dollar quotes, "
               "unicode escapes, INTO, FOR UPDATE/SHARE, data-changing words or volatile functions")
#: words that never belong in a read-only subquery (outside quotes)
_WRITE_WORDS = {"insert", "update", "delete", "merge", "truncate", "create", "drop", "alter", "grant", "revoke",
                "copy", "into", "lock", "execute", "prepare", "begin", "commit", "rollback"}


@dataclass(frozen=True)
class SelectCheck:
    """What a checked query calls: function names and operator symbols, to look up in the catalog."""

    functions: frozenset[str]
    operators: frozenset[str]


def check_select(text: str, what: str = "source.query") -> SelectCheck:
    """Refuse a query that is not one SELECT staying inside the parentheses it is put between."""
    tokens = tokenize(text, what, SELECT_HINT, any_operator=True)
    if tokens[0].word not in ("select", "with"):
        raise _refuse(what, text, tokens[0].pos, "the query must start with SELECT (or WITH)", SELECT_HINT)
    depth = 0
    functions: set[str] = set()
    operators: set[str] = set()
    for n, tok in enumerate(tokens):
        if tok.kind == "op" and tok.text == "(":
            depth += 1
        elif tok.kind == "op" and tok.text == ")":
            depth -= 1
            if depth < 0:
                raise _refuse(what, text, tok.pos, "a ')' closing more than the query opened", SELECT_HINT)
        elif tok.word in _WRITE_WORDS:
            if tok.word == "update" and n > 0 and tokens[n - 1].word in ("for", "no"):
                raise _refuse(what, text, tokens[n - 1].pos, "a row lock (FOR UPDATE/SHARE)", SELECT_HINT)
            raise _refuse(what, text, tok.pos, f"{tok.text.upper()} has no place in a read-only query", SELECT_HINT)
        elif tok.word in ("share", "key") and n > 0 and tokens[n - 1].word in ("for", "no"):
            raise _refuse(what, text, tokens[n - 1].pos, "a row lock (FOR UPDATE/SHARE)", SELECT_HINT)
        if tok.kind in ("ident", "qident") and (tokens[n + 1].text == "(" or (n > 0 and tokens[n - 1].text == ".")):
            # name(...), or row.name: PostgreSQL's functional notation calls name(row)
            name = tok.text.lower() if tok.kind == "ident" else tok.text[1:-1].replace('""', '"')
            functions.add(name)
        elif tok.kind == "op" and tok.text not in ("(", ")", ",", ".", "::"):
            operators.add(tok.text)
    if depth != 0:
        raise _refuse(what, text, tokens[-1].pos, "an unclosed '('", SELECT_HINT)
    return SelectCheck(frozenset(functions), frozenset(operators))


def volatile_calls(conn, check: SelectCheck) -> list[str]:
    """The functions and operators of `check` that are volatile (may have side effects) in `conn`'s database.

    Every function of a name is looked at (overloads, every schema): a name is
    refused if any of its functions is volatile. Names that are SQL keywords
    with parentheses (COUNT, EXISTS, IN, ...) but no function are skipped.
    """
    rows = conn.execute(
        "SELECT DISTINCT p.proname FROM pg_catalog.pg_proc p WHERE p.proname = ANY(%s) AND p.provolatile = 'v' "
        "UNION SELECT DISTINCT 'operator ' || o.oprname FROM pg_catalog.pg_operator o "
        "JOIN pg_catalog.pg_proc p ON p.oid = o.oprcode WHERE o.oprname = ANY(%s) AND p.provolatile = 'v'",
        (sorted(check.functions), sorted(check.operators)),
    ).fetchall()
    return sorted(r[0] for r in rows)
