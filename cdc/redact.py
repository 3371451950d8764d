"""Keeping secrets out of messages: passwords in DSNs and URLs, however mistyped.

Every line the CLI prints about a failure, and every log line, passes through
`redact`. It hides:

- the password of anything shaped ``[scheme:[//]]user:password@host``, even when
  the scheme is mistyped (``postgresql:/user:pw@db``) or absent;
- ``password=...`` in a libpq key/value connection string (quoted or not) and a
  ``password`` query parameter in a URL;
- every secret registered with `register` (the raw values of the configured DSN
  and URL, read from the environment or a file), wherever they appear verbatim.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

__all__ = ["MASK", "redact", "register", "register_secret", "secrets_of"]

MASK = "***"

# user:password@ inside anything URL-like; the user part may be empty (redis://:pw@host)
_USERINFO = re.compile(r"(?P<lead>(?:[A-Za-z][A-Za-z0-9+.-]*:/{0,3})?[^\s:/@'\"]*:)(?P<pw>[^\s@'\"/][^\s@'\"]*)(?=@)")
# password=... in a conninfo string or a query string
_KEYWORD = re.compile(r"(?P<lead>\bpassword\s*=\s*)(?P<pw>'(?:[^'\\]|\\.)*'|[^\s&'\"]+)", re.IGNORECASE)

_registered: set[str] = set()


def secrets_of(value: str) -> set[str]:
    """The password-like parts of a DSN or URL, as written and percent-decoded (for `register`)."""
    found: set[str] = set()
    for match in _USERINFO.finditer(value):
        found.add(match.group("pw"))
    for match in _KEYWORD.finditer(value):
        found.add(match.group("pw").strip("'"))
    try:
        password = urlsplit(value.strip()).password
    except ValueError:
        password = None
    if password:
        found.add(password)
    found |= {unquote(s) for s in found}
    return {s for s in found if len(s) >= 3}


def register(value: str | None) -> None:
    """Remember the secrets inside a configured DSN or URL, to hide them wherever they appear."""
    if value:
        _registered.update(secrets_of(value))


def register_secret(value: str) -> None:
    """Remember a bare secret (the hash key) to hide wherever it appears."""
    if value:
        _registered.add(value)


def redact(text: str) -> str:
    """`text` with every password it holds replaced by ``***``."""
    text = _USERINFO.sub(lambda m: m.group("lead") + MASK, text)
    text = _KEYWORD.sub(lambda m: m.group("lead") + MASK, text)
    for secret in sorted(_registered, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text
