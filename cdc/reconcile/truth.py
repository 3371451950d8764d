"""The truth, computed by Spark: a reconciliation spec's aggregates over the source as of one snapshot.

Spark reads the source over JDBC in parallel (``partitionColumn``/``numPartitions``,
``fetchsize`` > 0 so that the PostgreSQL dialect turns autocommit off), and every
partition's connection imports the one exported snapshot in its
``sessionInitStatement``. Each partition's query also returns
``pg_current_snapshot()``; the job refuses the result unless every partition
reports exactly the snapshot a reference session got by importing it, so a
partition that silently read "now" instead is caught.

Only the columns the spec names are read. Numeric values stay exact: a
``numeric(p, s)`` column arrives as Decimal(p, s), and an unconstrained
``numeric`` must be given ``decimal: [p, s]``; it is cast on the server, and a
value that would be rounded by that cast fails the job instead. This is the only
module that imports pyspark.
"""

from __future__ import annotations

import logging
import atexit
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

from ..errors import CdcError, ConfigError
from .exported_snapshot import session_init_statement
from .read_tasks import ReadTasks
from .source_read import (  # re-exported: how the source is read
    NUMERIC_OID,
    SNAPSHOT_COLUMN,
    describe_source,
    jdbc_url,
    partition_bounds,
    source_from,
    source_query,
    split,
)
from .spec import ReconcileSpec

__all__ = ["NUMERIC_OID", "Truth", "compute_truth", "describe_source", "jdbc_url", "partition_bounds", "source_from", "source_query", "start_spark"]

log = logging.getLogger("cdc.truth")

#: the shells' loggers: given a level of their own, Spark does not announce its default level on start
_SHELL_LOGGERS = ("org.apache.spark.repl.Main", "org.apache.spark.api.python.PythonGatewayServer",
                  "org.apache.spark.deploy.SparkSubmit", "org.apache.spark.SparkContext")


def _log4j_properties() -> str:
    """Spark's own log lines: errors only, on stderr, prefixed so they read as Spark's."""
    lines = [
        "rootLogger.level = error",
        "rootLogger.appenderRef.stderr.ref = console",
        "appender.console.type = Console",
        "appender.console.name = console",
        "appender.console.target = SYSTEM_ERR",
        "appender.console.layout.type = PatternLayout",
        "appender.console.layout.pattern = spark: %p %c{1}: %m%n",
    ]
    for n, name in enumerate(_SHELL_LOGGERS):
        lines += [f"logger.shell{n}.name = {name}", f"logger.shell{n}.level = error"]
    return "\n".join(lines) + "\n"


def _bq(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


class Truth:
    """Per key (a tuple in the spec's key order): the aggregate values, in the spec's value order.

    The rows go to a temporary file as they arrive from Spark, in pickled chunks,
    so the driver's memory does not grow with the number of keys; `items()` reads
    them back, one chunk at a time.
    """

    CHUNK = 10_000

    def __init__(self, partitions: int = 0) -> None:
        self.partitions = partitions
        self.source_rows = 0
        self.skipped_null_keys = 0
        self.keys = 0
        self._file = tempfile.TemporaryFile(prefix="cdc-truth-")
        self._chunk: list[tuple[tuple, tuple]] = []

    def add(self, key: tuple, values: tuple) -> None:
        self._chunk.append((key, values))
        self.keys += 1
        if len(self._chunk) >= self.CHUNK:
            self._flush()

    def _flush(self) -> None:
        if self._chunk:
            self._file.seek(0, os.SEEK_END)
            pickle.dump(self._chunk, self._file, protocol=pickle.HIGHEST_PROTOCOL)
            self._chunk = []

    def items(self) -> Iterator[tuple[tuple, tuple]]:
        """Every (key, values), in the order they arrived."""
        self._flush()
        self._file.seek(0)
        while True:
            try:
                chunk = pickle.load(self._file)  # noqa: S301 (our own file, written above)
            except EOFError:
                return
            yield from chunk

    def __len__(self) -> int:
        return self.keys

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Truth:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_spark(master: str, jdbc_jar: str, driver_memory: str = "2g", executor_memory: str = "",
                executor_cores: int = 0):
    """A SparkSession with the PostgreSQL JDBC driver; missing pieces become one clear error.

    The driver runs here (client mode). `spark.jars` names the driver's own copy of the JDBC
    jar: the driver serves it, and each executor fetches it from the driver when it starts."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise ConfigError("pyspark is not installed", hint="run: make reconcile-deps (pyspark, a Java runtime and the JDBC driver), "
                          "or pip install 'cdc[reconcile]'") from None
    if not os.environ.get("JAVA_HOME") and not shutil.which("java"):
        raise ConfigError("java is not installed: Spark needs a Java 17 runtime",
                          hint="run: apt-get install default-jre-headless")
    if not Path(jdbc_jar).is_file():
        raise ConfigError(f"the PostgreSQL JDBC driver {jdbc_jar} does not exist",
                          hint="run: apt-get install libpostgresql-jdbc-java, or set spark.jdbc_jar")
    if not os.environ.get("SPARK_CONF_DIR"):
        # unless the operator brings a Spark configuration, Spark logs errors only
        conf_dir = Path(tempfile.mkdtemp(prefix="cdc-spark-conf-"))
        (conf_dir / "log4j2.properties").write_text(_log4j_properties())
        os.environ["SPARK_CONF_DIR"] = str(conf_dir)
        atexit.register(shutil.rmtree, conf_dir, True)  # read by the JVM at its start; gone with this process
    builder = (
        SparkSession.builder.master(master)
        .appName("cdc-reconcile")
        .config("spark.jars", jdbc_jar)
        .config("spark.driver.memory", driver_memory)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
    )
    if executor_memory:
        builder = builder.config("spark.executor.memory", executor_memory)
    if executor_cores:
        builder = builder.config("spark.executor.cores", str(executor_cores))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def compute_truth(
    spark,
    spec: ReconcileSpec,
    dsn: str,
    snapshot: str,
    reference_snapshot: str,
    bounds: tuple[Any, Any] | None,
    types: dict[str, tuple[int, int | None, int | None]],
    progress: Callable[[int, int], None] | None = None,
) -> Truth:
    """Read the source under `snapshot` in parallel and aggregate it per key."""
    url, props = jdbc_url(dsn)
    reader = spark.read.format("jdbc").option("url", url).options(**props)
    reader = reader.option("dbtable", source_query(spec, types)).option("fetchsize", str(spec.fetch_size))
    reader = reader.option("sessionInitStatement", session_init_statement(snapshot))
    partitions = 1
    if spec.partition_column and bounds is not None and bounds[0] is not None and spec.partitions > 1:
        partitions, low, high = split(spec, *bounds)
        if partitions > 1:
            reader = (reader.option("partitionColumn", spec.partition_column).option("numPartitions", str(partitions))
                      .option("lowerBound", low).option("upperBound", high))
    try:
        df = reader.load()  # connects once, for the schema
    except Exception as exc:
        raise spark_error(exc) from None
    view = f"cdc_source_{spec.name.replace('-', '_').replace('.', '_')}"
    df.createOrReplaceTempView(view)

    group = [_bq(c) for c in spec.group_by]
    aggs = []
    for a in spec.values:
        arg = "1" if a.column is None else _bq(a.column)
        aggs.append(f"{a.function}({arg}) AS {_bq(a.name)}")
    rounded = [c for c in spec.source_columns if any(a.column == c and a.decimal for a in spec.values)]
    aggs += [f"max({_bq('__cdc_rounded_' + c)}) AS {_bq('__rounded_' + c)}" for c in rounded]
    aggs += ["count(1) AS __rows", f"min({SNAPSHOT_COLUMN}) AS __snap_min", f"max({SNAPSHOT_COLUMN}) AS __snap_max"]
    if spec.group_by and spec.overall is not None:
        sql = (f"SELECT {', '.join(group)}, grouping_id() AS __gid, {', '.join(aggs)} FROM {view} "
               f"GROUP BY GROUPING SETS (({', '.join(group)}), ())")
    elif spec.group_by:
        sql = f"SELECT {', '.join(group)}, 0 AS __gid, {', '.join(aggs)} FROM {view} GROUP BY {', '.join(group)}"
    else:
        sql = f"SELECT 1 AS __gid, {', '.join(aggs)} FROM {view}"

    truth = Truth(partitions=partitions)
    try:
        _collect(spark, spec, sql, rounded, reference_snapshot, truth, progress and ReadTasks(spark, progress, partitions))
    except BaseException:
        truth.close()
        raise
    return truth


def _collect(spark, spec: ReconcileSpec, sql: str, rounded: list[str], reference_snapshot: str, truth: Truth,
             watcher: ReadTasks | None) -> None:
    """Stream the aggregate's rows into `truth`, checking the snapshot and the rounding on the way."""
    overall_key = tuple(v for _, v in spec.overall) if spec.overall is not None else None
    snapshots: set[str] = set()
    rounded_cols: set[str] = set()
    if watcher:
        watcher.start()
    read = False
    try:
        grouped_rows = 0
        overall_rows = None
        n_keys = len(spec.group_by)
        for row in _rows(spark, sql):
            if row["__rows"] == 0:
                continue
            snapshots.update(s for s in (row["__snap_min"], row["__snap_max"]) if s is not None)
            rounded_cols.update(c for c in rounded if row["__rounded_" + c])
            values = tuple(_value(row[a.name], a.additive) for a in spec.values)
            if row["__gid"] == 0 and n_keys:
                key = tuple(row[c] for c in spec.group_by)
                grouped_rows += row["__rows"]
                if any(k is None for k in key):
                    truth.skipped_null_keys += row["__rows"]
                    continue
                if key == overall_key:
                    raise ConfigError(f"{spec.where}: the overall key {dict(spec.overall)} is also a key of the source's "
                                      "own rows, so the two totals would share one state row",
                                      hint="choose an overall key no source row has (for example 0 or -1)")
                truth.add(key, values)
            else:
                overall_rows = row["__rows"]
                truth.add(overall_key, values)
        read = True
    finally:
        if watcher:
            watcher.finish(read)
    truth.source_rows = overall_rows if overall_rows is not None else grouped_rows
    if overall_key is not None and overall_rows is None:  # no source rows: the overall row is all zeros
        truth.add(overall_key, tuple(_value(None, a.additive) for a in spec.values))
    if rounded_cols:
        raise CdcError(f"{spec.where}: values of {', '.join(sorted(rounded_cols))} need a larger scale than declared",
                       hint="raise the scale in decimal: [precision, scale]")
    if truth.source_rows and snapshots != {reference_snapshot}:
        raise CdcError(
            f"the Spark partitions did not all read snapshot {reference_snapshot}: they saw {sorted(snapshots)}",
            hint="the JDBC read must run with fetchsize > 0 so each partition imports the snapshot in a transaction",
        )


def _rows(spark, sql: str):
    """The aggregate's rows, streamed to the driver; Spark's failures become one clear error."""
    try:
        yield from spark.sql(sql).toLocalIterator()
    except Exception as exc:  # py4j/pyspark errors carry the Java stack; keep its cause line
        raise spark_error(exc) from None


def spark_error(exc: BaseException) -> CdcError:
    """The most telling line of a Spark/JDBC failure (the innermost "Caused by", else the first)."""
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    causes = [ln[len("Caused by: "):] for ln in lines if ln.startswith("Caused by: ")]
    message = causes[-1] if causes else (lines[0] if lines else type(exc).__name__)
    hint = None
    if "connect" in message.lower() or "UnknownHost" in message:
        hint = "check the host and port in postgres.dsn; Spark's executors must reach PostgreSQL too"
    elif "password authentication failed" in message:
        hint = "check the user and password in postgres.dsn"
    elif "permission denied" in message:
        hint = "grant SELECT on the source to the reconciliation's role"
    return CdcError(f"the Spark read failed: {message[:500]}", hint=hint)


def _value(value: Any, additive: bool) -> Any:
    if value is None:
        return Decimal(0) if additive else None
    return value
