"""Typed settings from a YAML file, each key overridable from the environment.

``CDC_<SECTION>_<KEY>`` overrides ``section.key`` (``CDC_POSTGRES_DSN``,
``CDC_REDIS_URL``, ``CDC_BATCH_MAX_ENTRIES``); top-level keys drop the section
(``CDC_MAPPINGS``). ``CDC_..._FILE`` reads the value from a file instead, so a
secret such as a DSN with a password never has to appear in a command line or
in the config file.

Every value is checked as it is loaded, with where it came from (file:line or the
variable): its type, its range (`RANGES`, per numeric setting: NaN and infinities
never pass), its form, and for connection strings that they parse as written
(`check_dsn`), their passwords registered with `cdc.redact` before anything can
quote them. A ``CDC_`` variable that is neither a setting's nor listed in
`OTHER_VARIABLES` is an error, as an unknown key in the file is.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import redact, speedups
from .errors import ConfigError
from .yamlsrc import LocatedDict, load_yaml_file, where

__all__ = [
    "BatchSettings", "HttpSettings", "OTHER_VARIABLES", "PostgresSettings", "RANGES", "Range", "ReconcileSettings",
    "RedisSettings", "Settings", "TransactionsSettings", "TrimSettings", "check_dsn", "check_environment", "setting_variables",
]


@dataclass(frozen=True)
class PostgresSettings:
    #: the source database, a libpq URI or key=value string; its keyword values (`sslmode`, `port`, ...) and its
    #: password are checked at load
    dsn: str = "postgresql://localhost/postgres"
    #: the logical replication slot
    slot: str = "cdc"
    #: the publication of the mapped tables
    publication: str = "cdc"
    #: seconds without any message from the server before the connection is deemed dead
    receive_timeout_s: float = 30.0
    #: when nothing arrives for this long, write a logical message so the slot keeps advancing (0: never)
    heartbeat_interval_s: float = 30.0
    #: seconds between checks of the slot (retained WAL, invalidation)
    slot_check_interval_s: float = 10.0
    #: retained-WAL alarm levels in bytes (0: half and four fifths of max_slot_wal_keep_size, else 1 GiB and 10 GiB)
    retained_wal_warn_bytes: int = 0
    #: see `retained_wal_warn_bytes`; when both are set, warn must be below critical
    retained_wal_critical_bytes: int = 0
    #: ask the server to stream large transactions while they run (pgoutput streaming, PostgreSQL 14+):
    #: the bridge holds their changes until the commit, spilling to its own disk instead of the server's
    streaming: bool = False
    #: `cdc init` creates the slot as a failover slot (PostgreSQL 17+; ignored on older servers), or makes an
    #: existing slot one, so physical standbys with sync_replication_slots keep a copy a promoted standby resumes from
    failover_slot: bool = True
    #: the standbys that could be promoted, whose copies of the slot `cdc status`, `cdc check` and the bridge read
    #: to judge failover readiness: a connection string naming their hosts (``host=db-b,db-c port=5432,5432``;
    #: its other keywords override the DSN's); empty: every host of `dsn` other than the primary
    standbys: str = ""
    #: where the slot lives and is decoded: a physical standby (PostgreSQL 16+) spares the primary the decoding;
    #: the bridge's writes (heartbeats, backfill bookkeeping and watermarks) still go to `dsn`, the primary,
    #: and reach the standby in WAL order; empty: `dsn`
    slot_dsn: str = ""
    #: a spare copy of the slot (same name) on another server of the cluster, the primary or a second standby:
    #: `cdc init` creates it, the bridge keeps it no further than what Redis holds, and carries on from it when
    #: the server of `slot_dsn` cannot be reached for `spare_after_s` or its slot is lost; empty: none
    spare_slot_dsn: str = ""
    #: seconds the server holding the slot may stay unreachable before the bridge carries on from the spare slot
    spare_after_s: float = 30.0

    @property
    def slot_server(self) -> str:
        """The connection string of the server holding the slot (`slot_dsn`, else `dsn`)."""
        return self.slot_dsn or self.dsn


@dataclass(frozen=True)
class RedisSettings:
    #: `redis://`, `rediss://` (TLS), `unix://`, or `redis+sentinel://` / `rediss+sentinel://`; checked at load,
    #: with its query options
    url: str = "redis://localhost:6379/0"
    #: a Redis Cluster: each stream's batch goes to the node owning its hash slot
    cluster: bool = False
    #: pause reading when used memory reaches this fraction of maxmemory (0: never)
    pause_at_memory_fraction: float = 0.9
    #: resume below this fraction (below `pause_at_memory_fraction` when that is not 0)
    resume_at_memory_fraction: float = 0.8
    #: acknowledge the slot only once this many replicas have the batch (Redis WAIT; 0: don't wait)
    wait_replicas: int = 0
    #: how long Redis WAIT waits for `wait_replicas` (never 0, which would wait forever)
    wait_timeout_ms: int = 1000
    #: how a batch is appended atomically with its marks: "transaction" (MULTI/EXEC under WATCH)
    #: or "script" (the Lua append script, more Redis CPU per entry)
    append: str = "transaction"
    #: with a redis+sentinel:// url: the sentinels' own user (the url's user and password are the data nodes')
    sentinel_username: str = ""
    #: the sentinels' own password (`CDC_REDIS_SENTINEL_PASSWORD_FILE` for the secret); never shown
    sentinel_password: str = field(default="", repr=False)


@dataclass(frozen=True)
class HttpSettings:
    #: where /metrics, /healthz and /readyz are served by `cdc run`
    host: str = "0.0.0.0"
    #: the port of /metrics, /healthz and /readyz (0: not served)
    port: int = 9187


@dataclass(frozen=True)
class BatchSettings:
    #: most entries written to Redis in one round trip
    max_entries: int = 2000
    #: longest a change waits in the batch while more keeps arriving, in milliseconds: the bound of latency traded
    #: for CPU. While transactions come closer together than this, a batch waits for more up to it (one EXEC for
    #: many transactions; measured with pgbench at about 5,500 transactions/s: 5 ms one EXEC per 33 transactions, 20 ms
    #: one per 120); a batch goes sooner once the server has sent nothing for 1 ms and transactions come further
    #: apart than this, or after a pause of 4 of their usual gaps (0: at once). The default keeps the p99 of
    #: commit-to-stream within 10 ms at 10,000 and 50,000 changes/s; 20 costs about 0.6 of its CPU per live transaction
    max_delay_ms: int = 5
    #: seconds between standby status updates to PostgreSQL when idle
    status_interval_s: float = 1.0
    #: rows per snapshot/backfill chunk (one transaction and one WAL message each)
    backfill_chunk_rows: int = 1000
    #: memory for streamed transactions still running, in MiB; past it their changes spill to disk
    stream_buffer_mb: int = 64
    #: where streamed transactions spill, relative to the config file (empty: $TMPDIR, else /tmp)
    spill_dir: str = ""


@dataclass(frozen=True)
class TrimSettings:
    #: seconds between consumer-aware trims of every mapped stream by `cdc run` (0: never)
    interval_s: float = 60.0
    #: hard cap: keep at most this many entries per stream, even unconsumed ones (0: none)
    max_len: int = 0
    #: hard cap: drop entries older than this many seconds, even unconsumed ones (0: none)
    max_age_s: float = 0.0


@dataclass(frozen=True)
class TransactionsSettings:
    #: the stream taking one END record per source transaction that produced entries (empty: none written)
    stream: str = ""
    #: the most source transactions one END record covers. 1: one END per transaction (format 1). More: the
    #: transactions a batch carries share END records (format 2, read by consumers of cdc 0.2.0 and later), so a
    #: consumer in transaction mode reads one END per batch, not one per transaction (with one change per
    #: transaction, about twice as many entries a second); the transactions one END covers are handed over, retried
    #: and dead-lettered together
    max_per_end: int = 1


@dataclass(frozen=True)
class ReconcileSettings:
    #: a folder of reconciliation specs (*.yaml), or one file; relative to the config file
    specs: str = "reconcile"
    #: where Spark runs: local[*] on this machine, or a cluster's master URL (spark://host:7077, yarn, k8s://...)
    master: str = "local[*]"
    #: the PostgreSQL JDBC driver (Debian: libpostgresql-jdbc-java)
    jdbc_jar: str = "/usr/share/java/postgresql.jar"
    #: the Spark driver's memory (spark.driver.memory)
    driver_memory: str = "2g"
    #: on a cluster: each executor's memory (spark.executor.memory); empty: Spark's own
    executor_memory: str = ""
    #: on a cluster: each executor's cores (spark.executor.cores); 0: Spark's own
    executor_cores: int = 0
    #: where the consumers' state and checkpoints live (empty: postgres.dsn; a spec's state.dsn wins)
    state_dsn: str = ""
    #: seconds to wait for the bridge to publish everything before the snapshot's position
    wait_for_bridge_s: float = 300.0
    #: seconds the reset waits for a consumer's checkpoint rows (a consumer mid-batch holds them)
    lock_timeout_s: float = 60.0


@dataclass(frozen=True)
class Settings:
    postgres: PostgresSettings = field(default_factory=PostgresSettings)
    redis: RedisSettings = field(default_factory=RedisSettings)
    batch: BatchSettings = field(default_factory=BatchSettings)
    trim: TrimSettings = field(default_factory=TrimSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    reconcile: ReconcileSettings = field(default_factory=ReconcileSettings)
    transactions: TransactionsSettings = field(default_factory=TransactionsSettings)
    #: a folder of *.yaml mappings (one mapping per file, a list, or several documents), or one file; relative to
    #: the config file
    mappings: Path = Path("mappings")
    #: the file holding the secret that keys hmac-sha256 fields (relative to the config file; CDC_HASH_KEY_FILE)
    hash_key_file: str = ""
    #: that secret (or CDC_HASH_KEY's value); empty when none is set; never shown
    hash_key: bytes = field(default=b"", repr=False)
    source: str = "<defaults>"
    #: where transactions.stream was set (file:line or its variable), named when it clashes with a mapping's key
    transactions_origin: str = ""

    @classmethod
    def from_file(cls, path: str | Path, env: Mapping[str, str] | None = None) -> "Settings":
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} not found", hint="pass --config with the path of your cdc.yaml")
        docs = load_yaml_file(path)
        if len(docs) > 1:
            raise ConfigError(f"{path}: expected one YAML document, found {len(docs)}")
        raw = docs[0] if docs else LocatedDict()
        if not isinstance(raw, dict):
            raise ConfigError(f"{where(raw)}: the config must be a mapping of sections (postgres, redis, mappings)")
        return cls.from_dict(raw, base_dir=path.parent, env=os.environ if env is None else env, source=str(path))

    @classmethod
    def from_dict(
        cls,
        raw: Mapping[str, Any],
        *,
        base_dir: Path = Path("."),
        env: Mapping[str, str] | None = None,
        source: str = "<dict>",
    ) -> "Settings":
        env = {} if env is None else env
        check_environment(env)
        speedups.check(env)  # CDC_IMPL=compiled where it is not built: refused at start, never a silent fall-back
        sections: dict[str, Any] = {}
        known = {f.name for f in dataclasses.fields(cls)} - {"source", "hash_key", "transactions_origin"}
        for key in raw:
            if key not in known:
                raise ConfigError(
                    f"{where(raw, key)}: unknown config key {key!r}",
                    hint=f"expected one of: {', '.join(sorted(known))}",
                )
        for f in dataclasses.fields(cls):
            if f.name in ("source", "mappings", "hash_key_file", "hash_key", "transactions_origin"):
                continue
            section_cls = f.type if isinstance(f.type, type) else globals()[f.type]
            sections[f.name] = _section(section_cls, f.name, raw.get(f.name) or {}, raw, env)
        mappings = _override(env, "CDC_MAPPINGS", raw.get("mappings", "mappings"))
        mappings_path = Path(str(mappings))
        if not mappings_path.is_absolute():
            mappings_path = base_dir / mappings_path
        specs = Path(sections["reconcile"].specs)
        if not specs.is_absolute():
            sections["reconcile"] = dataclasses.replace(sections["reconcile"], specs=str(base_dir / specs))
        spill = sections["batch"].spill_dir
        if spill and not Path(spill).is_absolute():
            sections["batch"] = dataclasses.replace(sections["batch"], spill_dir=str(base_dir / spill))
        if sections["redis"].cluster and sections["redis"].url.split("://", 1)[0].lower().endswith("+sentinel"):
            raise ConfigError(f"{where(raw.get('redis') or {}, 'cluster')}: redis.cluster cannot be used with a "
                              "redis+sentinel:// url", hint="a cluster fails over by itself: give one node's redis:// url")
        key_file, key = _hash_key(raw, base_dir, env)
        tx_origin = _origin(env, "transactions", "stream", raw.get("transactions") or {})
        return cls(**sections, mappings=mappings_path, hash_key_file=key_file, hash_key=key, source=source,
                   transactions_origin=tx_origin)


#: shortest hash key accepted, in bytes: a short secret can be found by trying keys against one known value
HASH_KEY_MIN_BYTES = 16


def _hash_key(raw: Mapping[str, Any], base_dir: Path, env: Mapping[str, str]) -> tuple[str, bytes]:
    """(the key file, the key): CDC_HASH_KEY's value, else the content of CDC_HASH_KEY_FILE or
    hash_key_file (whitespace around it removed); the key itself is never put in a message."""
    if env.get("CDC_HASH_KEY"):
        origin, key_file, text = "CDC_HASH_KEY", "", env["CDC_HASH_KEY"]
    else:
        key_file = env.get("CDC_HASH_KEY_FILE") or raw.get("hash_key_file") or ""
        if not isinstance(key_file, str):
            raise ConfigError(f"{where(raw, 'hash_key_file')}: hash_key_file must be a file name")
        if not key_file:
            return "", b""
        origin = "CDC_HASH_KEY_FILE" if env.get("CDC_HASH_KEY_FILE") else f"{where(raw, 'hash_key_file')}: hash_key_file"
        if not Path(key_file).is_absolute():
            key_file = str(base_dir / key_file)
        try:
            text = Path(key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f"{origin}: cannot read the hash key file {key_file}: {reason}",
                              hint="point it at a readable file holding the key") from None
    key = text.strip().encode()
    if len(key) < HASH_KEY_MIN_BYTES:
        raise ConfigError(f"{origin}: the hash key is {len(key)} bytes, shorter than {HASH_KEY_MIN_BYTES}",
                          hint="use a random key, e.g. made with: head -c 32 /dev/urandom | base64 > hash.key")
    return key_file, key


#: each section's name and settings class
_SECTIONS: dict[str, type] = {
    "postgres": PostgresSettings, "redis": RedisSettings, "batch": BatchSettings, "trim": TrimSettings,
    "http": HttpSettings, "reconcile": ReconcileSettings, "transactions": TransactionsSettings,
}


def _override(env: Mapping[str, str], name: str, default: Any) -> Any:
    """`name`'s value from the environment (or the file `name`_FILE names), else `default`."""
    file_var = name + "_FILE"
    if name in env and file_var in env:
        raise ConfigError(f"{name} and {file_var} are both set", hint=f"keep one: unset {name} or {file_var}")
    if name in env:
        return env[name]
    if file_var in env:
        file_name = env[file_var]
        if not file_name.strip():
            raise ConfigError(f"{file_var} is empty", hint="set it to the path of the file holding the value, or unset it")
        try:
            return Path(file_name).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"{file_var}: cannot read {file_name}: {exc.strerror}",
                              hint="name a readable file holding the value") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{file_var}: {file_name} is not UTF-8 text", hint="save the file as UTF-8") from None
    return default


def _section(section_cls: type, name: str, raw: Any, parent: Mapping, env: Mapping[str, str]) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where(parent, name)}: {name!r} must be a mapping of settings")
    fields = {f.name: f for f in dataclasses.fields(section_cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError(
                f"{where(raw, key)}: unknown setting {name}.{key}",
                hint=f"{name} accepts: {', '.join(fields)}",
            )
    values: dict[str, Any] = {}
    for key, f in fields.items():
        env_name = f"CDC_{name}_{key}".upper()
        value = _override(env, env_name, raw.get(key, f.default))
        origin = _origin(env, name, key, raw)
        check = _CONNECTION_STRINGS.get((name, key))
        if check is not None and isinstance(value, str):
            redact.register(value)  # before anything can quote it, however malformed
        kind = type(f.default)
        try:
            values[key] = _coerce(value, kind)
        except (TypeError, ValueError):
            shown = (redact.redact(repr(value)) if check is None or not isinstance(value, str)
                     else "a malformed value")
            shown = "nothing (null)" if value is None else shown
            raise ConfigError(f"{origin}: {name}.{key} must be {_KIND_NAMES[kind]}, got {shown}",
                              hint=_range_hint(f.default)) from None
        limits = RANGES.get((name, key))
        if limits is not None and not limits.admits(values[key]):
            raise ConfigError(f"{origin}: {name}.{key} must be {limits}, got {value!r}", hint=_range_hint(f.default))
        choices = _CHOICES.get((name, key))
        if choices and values[key] not in choices:
            raise ConfigError(f"{origin}: {name}.{key} must be one of {', '.join(choices)}, got {value!r}")
        form = _FORMS.get((name, key))
        if form and not re.fullmatch(form[0], values[key], re.IGNORECASE if name == "reconcile" else 0):
            raise ConfigError(f"{origin}: {name}.{key} must be {form[1]}, got {values[key]!r}", hint=_range_hint(f.default))
        if (name, key) in _REQUIRED and not values[key].strip():
            raise ConfigError(f"{origin}: {name}.{key} is empty", hint=f"set it, or unset {origin}" if origin.startswith(
                "CDC_") else "set it, or remove the key for the default")
        if check is not None and values[key]:
            check(values[key], f"{name}.{key} (from {_source(env, origin)})")
    for rule in _SECTION_RULES.get(name, ()):
        rule(values, lambda key: _origin(env, name, key, raw))
    return section_cls(**values)


def _origin(env: Mapping[str, str], section: str, key: str, raw: Any) -> str:
    """Where `section.key`'s value came from: its variable, or file:line."""
    env_name = f"CDC_{section}_{key}".upper()
    if env_name in env:
        return env_name
    if env_name + "_FILE" in env:
        return env_name + "_FILE"
    return where(raw, key)


def _source(env: Mapping[str, str], origin: str) -> str:
    """An `_origin` as a connection string's error names it: file:line, env VAR, or file PATH (VAR)."""
    if origin.endswith("_FILE") and origin in env:
        return f"file {env[origin]} named by {origin}"
    if origin.startswith("CDC_") and origin in env:
        return f"env {origin}"
    return origin


def _range_hint(default: Any) -> str:
    return f"the default is {default!r}; see docs/reference/configuration.md"


def _pause_above_resume(values: dict[str, Any], origin) -> None:
    pause, resume = values["pause_at_memory_fraction"], values["resume_at_memory_fraction"]
    if pause and resume >= pause:
        raise ConfigError(f"{origin('resume_at_memory_fraction')}: redis.resume_at_memory_fraction ({resume:g}) must be "
                          f"below redis.pause_at_memory_fraction ({pause:g})",
                          hint="for example pause at 0.9 and resume at 0.8; pause 0 turns pausing off")


def _warn_below_critical(values: dict[str, Any], origin) -> None:
    warn, critical = values["retained_wal_warn_bytes"], values["retained_wal_critical_bytes"]
    if warn and critical and warn >= critical:
        raise ConfigError(f"{origin('retained_wal_warn_bytes')}: postgres.retained_wal_warn_bytes ({warn}) must be "
                          f"below postgres.retained_wal_critical_bytes ({critical})",
                          hint="or set both to 0 for levels from max_slot_wal_keep_size")


def _spare_beside_a_standby(values: dict[str, Any], origin) -> None:
    spare, slot_dsn = values["spare_slot_dsn"], values["slot_dsn"]
    if spare and not slot_dsn:
        raise ConfigError(f"{origin('spare_slot_dsn')}: postgres.spare_slot_dsn needs postgres.slot_dsn: a spare slot "
                          "stands in for a standby that decodes, while the primary's own slot has failover slots",
                          hint="set postgres.slot_dsn to the standby that decodes, or remove postgres.spare_slot_dsn")
    if spare and spare == slot_dsn:
        raise ConfigError(f"{origin('spare_slot_dsn')}: postgres.spare_slot_dsn names the server of postgres.slot_dsn; "
                          "a spare on the same server is lost with it",
                          hint="name the primary or a second standby in postgres.spare_slot_dsn")


#: checks across the settings of one section, after each is in its range
_SECTION_RULES = {"redis": (_pause_above_resume,), "postgres": (_warn_below_critical, _spare_beside_a_standby)}


_DSN_HINT = ("write it as postgresql://user@host:5432/dbname (password in CDC_POSTGRES_DSN_FILE); in a URL, "
             "percent-encode a password's special characters (%40 for @, %2F for /, %20 for a space); in "
             "key=value form, put it in single quotes, with a backslash before a quote or a backslash in it")

#: libpq keywords whose values are one of a few words (libpq refuses others only when connecting)
_DSN_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "target_session_attrs": ("any", "read-write", "read-only", "primary", "standby", "prefer-standby"),
    "load_balance_hosts": ("disable", "random"),
    "sslnegotiation": ("postgres", "direct"),
    "sslcertmode": ("disable", "allow", "require"),
    "ssl_min_protocol_version": ("TLSv1", "TLSv1.1", "TLSv1.2", "TLSv1.3"),
    "ssl_max_protocol_version": ("TLSv1", "TLSv1.1", "TLSv1.2", "TLSv1.3"),
    "sslcompression": ("0", "1"),
    "sslsni": ("0", "1"),
    "keepalives": ("0", "1"),
}
#: libpq keywords whose values are whole numbers of at least 0 (seconds, milliseconds or counts)
_DSN_COUNTS = ("connect_timeout", "keepalives_idle", "keepalives_interval", "keepalives_count", "tcp_user_timeout")


def check_dsn(value: str, what: str) -> None:
    """A PostgreSQL connection string libpq can parse (a URI or key=value pairs), read as written,
    with a valid value for each keyword libpq would otherwise only refuse when connecting.

    Every message shows the string's password as ``***``, even a part a parser cut off.
    """
    from psycopg import conninfo

    redact.register(value)
    try:
        params = conninfo.conninfo_to_dict(value)
    except Exception as exc:  # psycopg.ProgrammingError: libpq's own words, which may quote the password
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "cannot be parsed"
        hint = ("fix: write every setting as keyword=value, an = sign after each keyword (never a colon); " + _DSN_HINT
                if 'missing "="' in reason else "fix: " + _DSN_HINT)
        raise ConfigError(f"{what} is not a valid connection string: {redact.drop_quoted(reason)}", hint=hint) from None
    written = redact.written_password(value)
    if written is not None and params.get("password") != written:
        raise ConfigError(f"{what}: libpq would not read its password as written (a character in it, such as "
                          "@, / or a space, ends it early)", hint=_DSN_HINT)
    for key, got in params.items():
        shown = redact.redact(repr(got))
        if key in _DSN_CHOICES and got not in _DSN_CHOICES[key]:
            raise ConfigError(f"{what}: {key}={shown} is not one of {', '.join(_DSN_CHOICES[key])}",
                              hint=f"fix {key} in the connection string")
        if key in _DSN_COUNTS and not _is_count(got):
            raise ConfigError(f"{what}: {key}={shown} is not a whole number of at least 0",
                              hint=f"fix {key} in the connection string")
        if key == "port":
            for port in got.split(","):
                if port.strip() and not (_is_count(port) and 1 <= int(port) <= 65535):
                    raise ConfigError(f"{what}: port {redact.redact(repr(port))} is not a port number (1 to 65535)",
                                      hint="fix the port in the connection string (PostgreSQL's default is 5432)")


def _is_count(text: str) -> bool:
    return text.strip().isascii() and text.strip().isdigit()


def _check_redis_url(value: str, what: str) -> None:
    """A Redis URL redis-py accepts: redis://, rediss:// or unix://, with a host and a numeric database,
    its password read as written, and query options redis-py knows."""
    from urllib.parse import parse_qs, unquote, urlsplit

    from redis.connection import parse_url

    redact.register(value)
    hint = "write it as redis://user:password@host:6379/0, or rediss:// for TLS, unix:///path.sock for a socket"
    if value.split("://", 1)[0].lower() in ("redis+sentinel", "rediss+sentinel"):
        from .sentinel_url import parse_sentinel_url

        parse_sentinel_url(value, what)
        return
    encode = "percent-encode a password's special characters in a URL (%2F for /, %3F for ?, %23 for #, %40 for @)"
    try:
        url = urlsplit(value)
        password = url.password
    except ValueError as exc:
        raise ConfigError(f"{what} is not a valid URL: {redact.drop_quoted(str(exc))}",
                          hint=f"fix: {hint}; {encode}") from None
    written = redact.written_password(value)
    if written is not None and (password is None or unquote(password) != written):
        raise ConfigError(f"{what}: its password would not be read as written (a character in it, such as /, ? or #, "
                          "ends it early)", hint=encode)
    try:
        url.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as exc:
        raise ConfigError(f"{what} is not a valid URL: {redact.drop_quoted(str(exc))}", hint=f"fix: {hint}") from None
    if url.scheme not in ("redis", "rediss", "unix"):
        got = f"scheme {url.scheme + '://'!r}" if url.scheme else "no scheme"
        raise ConfigError(f"{what} has {got}; Redis URLs start with redis://, rediss:// or unix://", hint=hint)
    if url.scheme != "unix" and not url.hostname:
        raise ConfigError(f"{what} names no host", hint=hint)
    db = url.path.lstrip("/") if url.scheme != "unix" else ""
    if db and not db.isdigit():
        raise ConfigError(f"{what}: database {redact.redact(repr(db))} is not a number", hint=hint)
    for option, choices in _REDIS_URL_CHOICES.items():
        for got in parse_qs(url.query).get(option, []):
            if got.lower() not in choices:
                raise ConfigError(f"{what}: {option}={redact.redact(repr(got))} is not one of {', '.join(choices)}",
                                  hint=f"fix {option} in the URL")
    try:
        parse_url(value)  # redis-py's own reading: its query options (ssl_cert_reqs=..., socket_timeout=...)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{what} is not a valid URL: {redact.drop_quoted(str(exc))}", hint=f"fix: {hint}") from None


#: query options of a Redis URL whose values are one of a few words (redis-py refuses others only when connecting)
_REDIS_URL_CHOICES = {"ssl_cert_reqs": ("none", "optional", "required")}

#: settings that may not be empty (an empty override is more likely an unset variable than a wish)
_REQUIRED = {("postgres", "dsn"), ("redis", "url"), ("postgres", "slot"), ("postgres", "publication")}

_CONNECTION_STRINGS = {
    ("postgres", "dsn"): check_dsn,
    ("postgres", "standbys"): check_dsn,
    ("postgres", "slot_dsn"): check_dsn,
    ("postgres", "spare_slot_dsn"): check_dsn,
    ("reconcile", "state_dsn"): check_dsn,
    ("redis", "url"): _check_redis_url,
}


@dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts: `least` to `most` (finite: never NaN or an infinity),
    or exactly `off`, a value outside them that switches the setting off."""

    least: float
    most: float
    off: float | None = None

    def admits(self, value: float) -> bool:
        return math.isfinite(value) and (value == self.off or self.least <= value <= self.most)

    def __str__(self) -> str:
        span = f"from {_number(self.least)} to {_number(self.most)}"
        return span if self.off is None else f"{_number(self.off)} (off) or {span}"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


_FOREVER_BYTES = 2**63 - 1
#: every numeric setting's range, by (section, key); docs/reference/configuration.md shows them (python -m cdc.cli.docgen)
RANGES: dict[tuple[str, str], Range] = {
    ("postgres", "receive_timeout_s"): Range(1, 3600),
    ("postgres", "heartbeat_interval_s"): Range(0.1, 86400, off=0),
    ("postgres", "slot_check_interval_s"): Range(0.1, 3600),
    ("postgres", "spare_after_s"): Range(0, 86400),
    ("postgres", "retained_wal_warn_bytes"): Range(0, _FOREVER_BYTES),
    ("postgres", "retained_wal_critical_bytes"): Range(0, _FOREVER_BYTES),
    ("redis", "pause_at_memory_fraction"): Range(0, 1),
    ("redis", "resume_at_memory_fraction"): Range(0, 1),
    ("redis", "wait_replicas"): Range(0, 100),
    ("redis", "wait_timeout_ms"): Range(1, 3_600_000),
    ("http", "port"): Range(0, 65535),
    ("batch", "max_entries"): Range(1, 1_000_000),
    ("transactions", "max_per_end"): Range(1, 10_000),
    ("batch", "max_delay_ms"): Range(0, 60_000),
    ("batch", "status_interval_s"): Range(0.01, 60),
    ("batch", "backfill_chunk_rows"): Range(1, 10_000_000),
    ("batch", "stream_buffer_mb"): Range(1, 1_048_576),
    ("trim", "interval_s"): Range(0.1, 86400, off=0),
    ("trim", "max_len"): Range(0, _FOREVER_BYTES),
    ("trim", "max_age_s"): Range(0, 315_360_000),
    ("reconcile", "executor_cores"): Range(0, 1024),
    ("reconcile", "wait_for_bridge_s"): Range(0, 86400),
    ("reconcile", "lock_timeout_s"): Range(0.001, 86400),
}

#: ``CDC_`` variables that are not settings, and what reads them: any other ``CDC_`` name that is not
#: a setting's (``CDC_<SECTION>_<KEY>``, ``CDC_MAPPINGS``, each also as ``..._FILE``) is an error.
#: A ``*`` stands for any text.
OTHER_VARIABLES: dict[str, str] = {
    "CDC_IMPL": "which implementation runs the hot path: pure, or compiled (an error at start where it is not "
                "built); unset, the compiled one where built, else the pure one (cdc.speedups)",
    "CDC_PURE_PYTHON": "1: the same as CDC_IMPL=pure (cdc.speedups)",
    "CDC_TRACEBACK": "print the traceback of a failure (cdc.exits)",
    "CDC_HASH_KEY*": "keys of keyed hashing in mappings",
    "CDC_*_SALT": "a mapping's hash salt (salt_env); other salt variables are named without CDC_",
    "CDC_PG_BIN": "where the demo and the tests find PostgreSQL's programs (cdc.demo.local)",
    "CDC_DEMO_*": "the demo's ports (cdc demo, cdc.demo.options)",
    "CDC_IMAGE_CACHE": "where make image keeps the Debian-made base image (deploy/buildah-build.sh; default "
                       "~/.cache/cdc/image)",
    "CDC_FAULT_*": "faults injected by the tests (cdc.bridge.loop, cdc.cli.consume)",
}


def setting_variables() -> dict[str, str]:
    """Every variable that overrides a setting, and the setting: {"CDC_POSTGRES_DSN": "postgres.dsn", ...}."""
    found = {"CDC_MAPPINGS": "mappings"}
    for section, section_cls in _SECTIONS.items():
        for f in dataclasses.fields(section_cls):
            found[f"CDC_{section}_{f.name}".upper()] = f"{section}.{f.name}"
    return found


def _other_variable(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, known) for known in OTHER_VARIABLES)


def _grouped(names: Mapping[str, str]) -> str:
    """CDC_MAPPINGS, CDC_POSTGRES_{DSN,SLOT,...}, ...: the settings' variables, short."""
    by_section: dict[str, list[str]] = {}
    for name, setting in names.items():
        section, _, key = setting.rpartition(".")
        by_section.setdefault(section, []).append(key.upper())
    return ", ".join(f"CDC_{section.upper()}_{{{','.join(keys)}}}" if section else f"CDC_{keys[0]}"
                     for section, keys in by_section.items())


def check_environment(env: Mapping[str, str]) -> None:
    """Every ``CDC_`` variable in `env` is one cdc reads: a misspelt override is an error, never ignored."""
    settings = setting_variables()
    for name in sorted(env):
        if name.upper().startswith("CDC_") and not name.startswith("CDC_"):  # cdc_postgres_dsn: never read
            raise ConfigError(f"environment variable {name}: cdc's variables are upper-case",
                              hint=f"rename it {name.upper()}")
        if not name.startswith("CDC_") or _other_variable(name):
            continue
        base = name[: -len("_FILE")] if name.endswith("_FILE") else name
        if base in settings:
            continue
        close = difflib.get_close_matches(base, list(settings) + list(OTHER_VARIABLES), n=1, cutoff=0.75)
        guess = f" (did you mean {close[0]}{name[len(base):]}?)" if close else ""
        raise ConfigError(
            f"environment variable {name}: not a cdc setting{guess}",
            hint=f"unset it or fix its name; cdc reads {_grouped(settings)} (each also as <name>_FILE), and "
                 f"{', '.join(OTHER_VARIABLES)}",
        )


_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
#: settings that take one of a few words
_CHOICES = {("redis", "append"): ("transaction", "script")}
#: text settings with a form, and that form in words (PostgreSQL's rules for a slot name; Spark's for memory)
_FORMS: dict[tuple[str, str], tuple[str, str]] = {
    ("postgres", "slot"): (r"[a-z0-9_]{1,63}", "1 to 63 lower-case letters, digits or _"),
    ("postgres", "publication"): (r"(?s).{1,63}", "a name of 1 to 63 characters"),
    ("reconcile", "driver_memory"): (r"[0-9]+[kmgtp]?", "a size such as 512m or 2g"),
    ("reconcile", "executor_memory"): (r"([0-9]+[kmgtp]?)?", "empty, or a size such as 512m or 2g"),
    ("transactions", "stream"): (r"([!-~]{1,512})?", "empty, or a Redis key of printable ASCII without spaces"),
}


def _coerce(value: Any, kind: type) -> Any:
    """`value` (from YAML or the environment) as `kind`; nothing else silently becomes one
    (a list is no boolean, null no string, true no number)."""
    if value is None or isinstance(value, (list, dict)):
        raise TypeError(value)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(value)
    if isinstance(value, bool):
        raise TypeError(value)
    if kind is int and isinstance(value, float):
        raise TypeError(value)
    return kind(value)
