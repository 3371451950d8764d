"""Array values: ``array_out``'s text parsed into nested lists of converted elements."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["parse_array", "array_converter"]

Converter = Callable[[str], object]


# --- arrays -------------------------------------------------------------------------

_WS = " \t\n\r\v\f"  # what array_in skips and array_out quotes (array_isspace)


def parse_array(text: str, convert: Converter = str, delim: str = ",") -> list:
    """Parse an array literal as ``array_out`` prints it into nested lists.

    Handles ``{}``, nesting for several dimensions, unquoted ``NULL`` (any
    case) as None against quoted ``"NULL"`` as a string, double-quoted
    elements with backslash escapes, a leading dimension decoration such as
    ``[0:1]=`` (dropped), the element type's delimiter, and, as ``array_in``
    does, whitespace around elements and backslash escapes in unquoted ones.
    Every non-NULL element is passed through ``convert``.

    One scanning loop over the text, longer than most functions here: its state
    (depth, position, the list being filled) would otherwise pass through a call
    per element.
    """
    n = len(text)
    i = _after_opening_brace(text)
    root: list = []
    cur = root
    stack: list[list] = []
    at_item = True  # just after '{' or a delimiter: an element or '{' comes next
    opened = True  # just after '{': '}' may close an empty array
    while True:
        while i < n and text[i] in _WS:
            i += 1
        if i >= n:
            raise _malformed(text, i, "unterminated array")
        c = text[i]
        if at_item and c != "}":
            if c == "{":
                new: list = []
                cur.append(new)
                stack.append(cur)
                cur = new
                i += 1
                opened = True
                continue
            if c == '"':
                value, i = _quoted(text, i + 1)
                cur.append(convert(value))
            else:
                value, is_null, i = _unquoted(text, i, delim)
                cur.append(None if is_null else convert(value))
            at_item = opened = False
            continue
        if c == "}":
            if at_item and not opened:
                raise _malformed(text, i, "missing element")
            i += 1
            if not stack:
                while i < n and text[i] in _WS:
                    i += 1
                if i != n:
                    raise _malformed(text, i, "junk after array")
                return root
            cur = stack.pop()
            at_item = opened = False
            continue
        if c == delim:
            i += 1
            at_item = True
            continue
        raise _malformed(text, i, f"expected {delim!r} or '}}'")


def _after_opening_brace(text: str) -> int:
    """Where the elements start: past leading whitespace, a dimension decoration (``[0:1]=``) and '{'."""
    n = len(text)
    i = 0
    while i < n and text[i] in _WS:
        i += 1
    if i < n and text[i] == "[":
        eq = text.find("=", i)
        if eq < 0 or text[i:eq].strip(_WS).strip("[]0123456789:+-") != "":
            raise _malformed(text, i, "bad dimension decoration")
        i = eq + 1
        while i < n and text[i] in _WS:
            i += 1
    if i >= n or text[i] != "{":
        raise _malformed(text, i, "expected '{'")
    return i + 1


def _quoted(text: str, i: int) -> tuple[str, int]:
    """The element starting after an opening quote at i-1, and the index after its closing quote."""
    q = text.find('"', i)
    b = text.find("\\", i, q) if q >= 0 else -1
    if b < 0 <= q:
        return text[i:q], q + 1
    parts = []
    n = len(text)
    while True:
        q = text.find('"', i)
        if q < 0:
            raise _malformed(text, i, "unterminated quoted element")
        b = text.find("\\", i, q)
        if b < 0:
            parts.append(text[i:q])
            return "".join(parts), q + 1
        if b + 1 >= n:
            raise _malformed(text, b, "backslash at end")
        parts.append(text[i:b])
        parts.append(text[b + 1])
        i = b + 2


def _unquoted(text: str, i: int, delim: str) -> tuple[str, bool, int]:
    """An unquoted element starting at i (not whitespace): (value, is NULL, index of its end)."""
    close = text.find("}", i)
    if close < 0:
        raise _malformed(text, i, "unterminated array")
    d = text.find(delim, i, close)
    end = close if d < 0 else d
    token = text[i:end]
    if "\\" in token:
        return _unquoted_escaped(text, i, delim)
    if '"' in token or "{" in token:
        raise _malformed(text, i, "stray quote or brace")
    token = token.rstrip(_WS)
    if not token:
        raise _malformed(text, i, "missing element")
    return token, len(token) == 4 and token.upper() == "NULL", end


def _unquoted_escaped(text: str, i: int, delim: str) -> tuple[str, bool, int]:
    chars: list[str] = []
    keep = 0  # length of chars up to the last escaped or non-space character
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            if i + 1 >= n:
                raise _malformed(text, i, "backslash at end")
            chars.append(text[i + 1])
            keep = len(chars)
            i += 2
            continue
        if c == delim or c == "}":
            return "".join(chars[:keep]), False, i
        if c == '"' or c == "{":
            raise _malformed(text, i, "stray quote or brace")
        chars.append(c)
        if c not in _WS:
            keep = len(chars)
        i += 1
    raise _malformed(text, i, "unterminated array")


def _malformed(text: str, at: int, why: str) -> ValueError:
    shown = text if len(text) <= 80 else text[:77] + "..."
    return ValueError(f"malformed array literal at {at}: {why}: {shown!r}")


def array_converter(convert: Converter, delim: str) -> Converter:
    """A converter for array text whose elements convert with ``convert``."""
    doubled = delim + delim

    def simple(inner: str) -> bool:
        # One dimension, nothing quoted or escaped, no whitespace, no empty
        # element: a plain split is exact.  Anything else (quoted elements,
        # nesting, odd characters) takes the general parser.
        return (
            '"' not in inner
            and "{" not in inner
            and "}" not in inner
            and "\\" not in inner
            and " " not in inner
            and inner.isprintable()
            and doubled not in inner
            and inner[0] != delim
            and inner[-1] != delim
        )

    if convert is str:

        def convert_array(text: str) -> list:
            if text[:1] == "{" and text[-1:] == "}":
                inner = text[1:-1]
                if not inner:
                    return []
                if simple(inner):
                    return [
                        None if len(x) == 4 and x.upper() == "NULL" else x
                        for x in inner.split(delim)
                    ]
            return parse_array(text, str, delim)

    else:

        def convert_array(text: str) -> list:
            if text[:1] == "{" and text[-1:] == "}":
                inner = text[1:-1]
                if not inner:
                    return []
                if simple(inner):
                    return [
                        None if len(x) == 4 and x.upper() == "NULL" else convert(x)
                        for x in inner.split(delim)
                    ]
            return parse_array(text, convert, delim)

    return convert_array
