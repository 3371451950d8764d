"""Keeping secrets out of messages: passwords in DSNs and URLs, however mistyped.

Every line the CLI prints about a failure, and every log line, passes through
`redact`. It hides:

- the password of anything shaped ``[scheme:[//]]user:password@host``, even when
  the scheme is mistyped (``postgresql:/user:pw@db``) or absent;
- ``password=...`` in a libpq key/value connection string (quoted or not) and a
  ``password`` query parameter in a URL; likewise every ``<name>=<value>`` whose name
  ends in ``password``, ``passwd``, ``pwd``, ``token``, ``secret`` or ``api_key``/``apikey``
  (``access_token=``, ``client_secret=``), and ``password:<value>`` (a colon for the ``=``);
- the credentials of an ``Authorization:`` header and of ``Bearer``/``Basic`` schemes;
- every secret registered with `register` (the raw values of the configured DSN
  and URL, read from the environment or a file), wherever they appear verbatim.

`register` reads a connection string *generously*: a password runs to the last
``@`` of a URL (so ``p@ss``, ``pa/ss`` or ``pa ss`` are hidden whole, even where a
parser would cut them short), and to the next libpq keyword in a key/value string
(so ``password=pa ss`` hides ``ss`` too); an unterminated quote runs to the end.
The pieces such a password splits into are registered too, since a parser's
complaint may quote one of them (``missing "=" after "ss"``). `mask_quoted`
hides a parser's quoted fragments by their position in the value they came from.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

__all__ = ["MASK", "NOT_SHOWN", "drop_quoted", "mask_quoted", "password_spans", "redact", "register", "register_password", "register_secret",
           "secrets_of", "written_password"]

MASK = "***"

# user:password@ inside anything URL-like; the user part may be empty (redis://:pw@host); the
# password runs to the last '@' of the word (p@ss@host)
_USERINFO = re.compile(r"(?P<lead>(?:[A-Za-z][A-Za-z0-9+.-]*:/{0,3})?[^\s:/@'\"]*:)(?P<pw>[^\s'\"/@][^\s'\"]*)(?=@[^\s@'\"]*)")
# password=... in a conninfo string or a query string, and any other secret-named setting (token=, secret=,
# client_secret=, api_key=); a password also after a colon (password:pw, a mistyped conninfo keyword)
_KEYWORD = re.compile(
    r"(?P<lead>\b\w*?(?:(?:password|passwd|pwd)\s*[=:]|(?:token|secret|api_?key)\s*=)\s*)"
    r"(?P<pw>'(?:[^'\\]|\\.)*'?|\"(?:[^\"\\]|\\.)*\"?|[^\s&'\",;]+)", re.IGNORECASE)
# an HTTP Authorization header's credentials, with or without a scheme, and a bare Bearer/Basic credential
_AUTHORIZATION = re.compile(r"(?P<lead>\bauthorization\s*[:=]\s*(?:(?:bearer|basic|digest|token)\s+)?)"
                            r"(?P<pw>[^\s'\",;]+)", re.IGNORECASE)
_BEARER = re.compile(r"(?P<lead>\bbearer\s+)(?P<pw>[A-Za-z0-9._~+/=-]{8,})", re.IGNORECASE)

# what a value looks like when it is a URL: a scheme, however mistyped (postgresql:/, redis:)
_SCHEME = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.-]*:/{0,3}")
# libpq's keywords: an unquoted password=... runs (generously) up to the next of them
_LIBPQ_KEYWORDS = (
    "host hostaddr port dbname user password passfile require_auth channel_binding connect_timeout "
    "client_encoding options application_name fallback_application_name keepalives keepalives_idle "
    "keepalives_interval keepalives_count tcp_user_timeout replication gssencmode sslmode sslnegotiation "
    "sslcompression sslcert sslkey sslkeylogfile sslpassword sslcertmode sslrootcert sslcrl sslcrldir sslsni "
    "requirepeer ssl_min_protocol_version ssl_max_protocol_version krbsrvname gsslib gssdelegation "
    "service target_session_attrs load_balance_hosts min_protocol_version max_protocol_version "
    "oauth_issuer oauth_client_id oauth_client_secret oauth_scope"
).split()
_NEXT_KEYWORD = re.compile(r"\s+(?:" + "|".join(_LIBPQ_KEYWORDS) + r")\s*=", re.IGNORECASE)
_NEXT_PARAMETER = re.compile(r"&(?:" + "|".join(_LIBPQ_KEYWORDS) + r"|ssl_\w+|socket_\w+|health_check_interval|"
                             r"client_name|protocol|db|username|retry_on_timeout|max_connections)=", re.IGNORECASE)
_KV_PASSWORD = re.compile(r"(?:^|\s)(?:password|sslpassword|oauth_client_secret)\s*=\s*", re.IGNORECASE)
_QUERY_PASSWORD = re.compile(r"[?&](?:password|sslpassword)=", re.IGNORECASE)
# where a password may be cut short by a parser: each piece is a secret too
_CUTS = re.compile(r"[\s@/:?#&='\"\\%]+")

_registered: set[str] = set()


def password_spans(value: str) -> list[tuple[int, int]]:
    """Where the passwords of one DSN or URL are, as (start, end) offsets, read generously."""
    spans: list[tuple[int, int]] = []
    scheme = _SCHEME.match(value)
    if scheme and "=" not in value[:scheme.end()]:
        start = scheme.end()
        at = value.rfind("@", start)
        if at > start:
            colon = value.find(":", start, at)
            if colon != -1:
                spans.append((colon + 1, at))
        for m in _QUERY_PASSWORD.finditer(value, start):
            following = _NEXT_PARAMETER.search(value, m.end())  # an '&' in it may cut it short: run to the next keyword
            spans.append((m.end(), following.start() if following else len(value)))
    else:
        for m in _KV_PASSWORD.finditer(value):
            start = m.end()
            if value[start:start + 1] == "'":
                i = start + 1
                while i < len(value) and value[i] != "'":
                    i += 2 if value[i] == "\\" else 1
                end = min(i + 1, len(value))  # an unterminated quote runs to the end
                if value[end:].strip():  # 'pw'more or 'pw' more: what a parser may split off, up to the next keyword
                    following = _NEXT_KEYWORD.search(value, end)
                    end = max(end, following.start() if following else len(value.rstrip()))
            else:
                following = _NEXT_KEYWORD.search(value, start)
                end = following.start() if following else len(value.rstrip())
            spans.append((start, end))
    return [(a, b) for a, b in spans if b > a]


def written_password(value: str) -> str | None:
    """The password as its writer meant it (percent-decoded in a URL, unquoted in key=value), or None."""
    spans = password_spans(value)
    if not spans:
        return None
    start, end = spans[0]
    text = value[start:end]
    scheme = _SCHEME.match(value)
    if scheme and "=" not in value[:scheme.end()]:
        return unquote(text)
    if text.startswith("'"):
        text = text[1:-1] if len(text) > 1 and text.endswith("'") else text[1:]
    return re.sub(r"\\(.)", r"\1", text)


def secrets_of(value: str) -> set[str]:
    """The password-like parts of a DSN or URL, as written and decoded, and their pieces (for `register`)."""
    found: set[str] = set()
    for start, end in password_spans(value):
        found.add(value[start:end])
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
    written = written_password(value)
    if written:
        found.add(written)
    found |= {unquote(s) for s in found}
    found |= {s.strip("'") for s in found}
    found |= {piece for s in found for piece in _CUTS.split(s) if piece.lower() not in _LIBPQ_KEYWORDS}
    return {s for s in found if len(s) >= 3}


def register(value: str | None) -> None:
    """Remember the secrets inside a configured DSN or URL, to hide them wherever they appear."""
    if value:
        _registered.update(secrets_of(value))


def register_secret(value: str) -> None:
    """Remember a bare secret (the hash key) to hide wherever it appears."""
    if value:
        _registered.add(value)


def register_password(value: str | None) -> None:
    """Remember a bare password (``PGPASSWORD``, which libpq and the JDBC properties use) to hide it."""
    if value and len(value) >= 3:
        _registered.add(value)


def mask_quoted(message: str, value: str) -> str:
    """A parser's `message` about `value`, each quoted fragment of `value` shown with its password parts masked.

    A fragment found in `value` keeps what lies outside the password; one that is not found but
    overlaps a password piece is masked whole.
    """
    spans = password_spans(value)
    if not spans:
        return redact(message)

    def secret_at(i: int) -> bool:
        return any(a <= i < b for a, b in spans)

    def masked(fragment: str) -> str:
        places = [m.start() for m in re.finditer(f"(?={re.escape(fragment)})", value)] if fragment else []
        overlapping = [at for at in places if any(secret_at(at + i) for i in range(len(fragment)))]
        at = (overlapping or places or [-1])[0]
        if at == -1:
            pieces = secrets_of(value) | {value[a:b] for a, b in spans}
            return MASK if any(p and (p in fragment or fragment in p) for p in pieces) else fragment
        out, hiding = [], False
        for i, char in enumerate(fragment):
            if secret_at(at + i):
                if not hiding:
                    out.append(MASK)
                hiding = True
            else:
                out.append(char)
                hiding = False
        return "".join(out)

    shown = re.sub(r'"([^"]*)"|\'([^\']*)\'',
                   lambda m: f'"{masked(m.group(1))}"' if m.group(1) is not None else f"'{masked(m.group(2))}'",
                   message)
    return redact(shown)


#: what stands for a quoted fragment a parser's message held (`drop_quoted`)
NOT_SHOWN = "(a part of it, not shown)"


def drop_quoted(message: str) -> str:
    """A parser's `message` about a connection string with every fragment it quotes left out.

    libpq and URL parsers quote pieces of the string they read (``missing "=" after "password:pw"``),
    and a piece of a mistyped string may hold its password whatever shape it has. A quoted lone
    punctuation mark (``"="``) stays; any other fragment is left out from its opening quote to the
    *last* quote of its kind (a quote inside the piece cannot end it early), or to the end.
    """
    out: list[str] = []
    i = 0
    while i < len(message):
        char = message[i]
        if char not in "\"'":
            out.append(char)
            i += 1
            continue
        if message[i + 2:i + 3] == char and not message[i + 1:i + 2].isalnum() and message[i + 1:i + 2] not in "\"'":
            out.append(message[i:i + 3])  # "=": libpq's own punctuation
            i += 3
            continue
        last = message.rfind(char)
        out.append(NOT_SHOWN)
        i = last + 1 if last > i else len(message)
    return redact("".join(out))


def redact(text: str) -> str:
    """`text` with every password it holds replaced by ``***``."""
    text = _USERINFO.sub(lambda m: m.group("lead") + MASK, text)
    text = _KEYWORD.sub(lambda m: m.group("lead") + MASK, text)
    text = _AUTHORIZATION.sub(lambda m: m.group("lead") + MASK, text)
    text = _BEARER.sub(lambda m: m.group("lead") + MASK, text)
    for secret in sorted(_registered, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text
