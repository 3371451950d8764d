"""The product as a pip user gets it: the wheel built from what the checkout holds, installed into a fresh
virtualenv, run in an empty folder (no checkout on sys.path, PYTHONPATH unset), following docs/getting-started.md
as written: `pip install pg-redis-cdc`, `cdc --version`, `cdc demo` until entries arrive (and `cdc status` on
its config meanwhile), then "On your own database" from `cdc sql` to `cdc consume` against the test suite's
PostgreSQL and Redis.

The dependencies are real wheels of the versions pip resolves for the package, fetched once into a wheelhouse
kept in pytest's cache (keyed by the package's requirements); every later run installs with --no-index from it
(the `built` fixture of tests/conftest.py, helpers in tests/installs.py, shared with tests/test_upgrade.py).
"""

from __future__ import annotations

import re
import shutil
import signal
import tempfile
import time
import zipfile
from decimal import Decimal
from pathlib import Path

import pytest

from cdc import __version__
from cdc.demo.local import wait_for
from conftest import ROOT
from installs import fresh_venv, run, start, stop

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PAGE = ROOT / "docs" / "getting-started.md"


def sections() -> dict[str, str]:
    """The page's level-2 sections by title."""
    parts = re.split(r"^## (.+)$", PAGE.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def commands(text: str) -> list[str]:
    """The shell lines of a section, comments dropped."""
    return [re.sub(r"\s+#.*$", "", line).strip() for block in blocks(text, "sh") for line in block.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_the_wheel_carries_what_runs_and_nothing_else(built):
    (wheel,) = built[0].glob("pg_redis_cdc-*.whl")
    assert wheel.name.startswith(f"pg_redis_cdc-{__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith((".c", ".pyx", ".pxd"))]
    assert not [n for n in names if not n.startswith(("cdc/", f"pg_redis_cdc-{__version__}.dist-info/"))]
    for packaged in ("cdc/sql/00_roles.sql", "cdc/sql/10_rocket_rides.sql", "cdc/sql/20_consumer_state.sql",
                     "cdc/sql/25_backfills.sql", "cdc/sql/30_grants.sql", "cdc/demo/mappings/ride.yaml",
                     "cdc/demo/mappings/rider.yaml", "cdc/demo/reconcile/ride_totals.yaml", "cdc/bridge/_changes.pyi"):
        assert packaged in names, packaged


@pytest.mark.timeout(900)
def test_a_pip_user_follows_getting_started_in_an_empty_folder(built, env):
    started = time.monotonic()
    dist, house = built
    page = sections()
    # an empty folder the server's OS user can enter (the demo's PostgreSQL runs as `postgres` when we are root)
    work = Path(tempfile.mkdtemp(prefix="cdc-install-"))
    try:
        work.chmod(0o755)
        venv = work.parent / f"{work.name}-venv"
        user = fresh_venv(venv)

        install, version = commands(page["Install it"])
        assert install == "pip install pg-redis-cdc"
        run(f"{install} --quiet --no-index --find-links {dist} --find-links {house}", work, user)  # the index: the build
        where = run("python -c 'import cdc; print(cdc.__file__)'", work, user).stdout.strip()
        assert where.startswith(str(venv)), where  # the installed package, not the checkout
        assert run(version, work, user).stdout == f"cdc {__version__}\n"

        demo_line, status_line = commands(page["Try the demo"])
        assert demo_line == "cdc demo"
        demo = start(demo_line, work, user)
        lines: list[str] = []
        try:
            def arrived() -> bool:
                lines.append(demo.stdout.readline())
                return " op=" in lines[-1]

            wait_for(arrived, 120, "the demo's first entry", interval=0)
            status = run(status_line, work, user)
            assert "cdc:ride" in status.stdout
        finally:
            out = stop(demo, signal.SIGINT)  # Ctrl-C
        shown = "".join(lines) + out
        assert "stopped postgres and redis" in out and "failover" not in shown, shown
        assert (work / "cdc-demo" / "cdc.yaml").exists()

        own = page["On your own database"]
        config, mapping = blocks(own, "yaml")
        config = re.sub(r"dsn: '[^']*'", f"dsn: '{env.dsn}'", config)  # the test's servers
        config = re.sub(r"url: '[^']*'", f"url: '{env.redis_server.url}'", config)
        (work / "cdc.yaml").write_text(config)
        (work / "mappings").mkdir()
        (work / "mappings" / "ride.yaml").write_text(mapping)
        lines = commands(own)
        assert [line.split(" --")[0].split(" >")[0] for line in lines] == [
            "cdc sql", "cdc sql", "cdc sql", 'psql "$ADMIN_DSN" -v ON_ERROR_STOP=1 -f rocket_rides.sql -f consumer_state.sql -f cdc-grants.sql',
            "cdc init", "cdc check", "cdc run", "cdc run", "cdc consume"]
        sql_lines, psql, init, check, once, streaming, consume = lines[:3], lines[3], *lines[4:]
        for line in sql_lines:
            run(line, work, user)
        assert "GRANT SELECT ON public.rides TO cdc_bridge;" in (work / "cdc-grants.sql").read_text()
        run(psql, work, {**user, "ADMIN_DSN": env.dsn})
        run(init, work, user)
        assert "cdc check: 1 mapping(s) valid" in run(check, work, user).stdout
        env.execute("INSERT INTO riders (id, name, email) VALUES (1, 'a', 'a@x'), (2, 'b', 'b@x')")
        env.execute("INSERT INTO rides (rider_id, distance_m) SELECT 1 + g % 2, g FROM generate_series(1, 10) g")
        run(once, work, user)  # --until-caught-up
        assert env.redis.xlen("cdc:ride") == 10

        bridge = start(streaming, work, user)
        try:
            env.execute("INSERT INTO rides (rider_id, distance_m) VALUES (2, 45)")
            wait_for(lambda: env.redis.xlen("cdc:ride") == 11, 60, "the ride written while cdc run streams")
        finally:
            stop(bridge)
        consumer = start(consume, work, user)
        try:
            def totals() -> dict:
                return dict(env.execute("SELECT rider_id, total_distance FROM consumer_states WHERE consumer = 'ride-totals'"))

            expected = {0: Decimal(100), 1: Decimal(30), 2: Decimal(70)}  # rider 0: the overall total
            wait_for(lambda: totals() == expected, 60, "the consumer's totals")
        finally:
            stop(consumer)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(work.parent / f"{work.name}-venv", ignore_errors=True)
    print(f"\ninstall test: {time.monotonic() - started:.1f}s (the wheel built before it, in the session fixture)")
