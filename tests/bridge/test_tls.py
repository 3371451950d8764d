"""TLS to PostgreSQL (verify-full against our CA) and to Redis (rediss://, CA, client certificate)."""

from __future__ import annotations

import pytest
import redis

from cdc.demo.local import LocalPostgres, LocalRedis
from certs import make_certs

pytestmark = [pytest.mark.integration, pytest.mark.one_path]


def test_bridge_streams_over_tls_on_both_ends(servers_root, env):
    certs = make_certs(servers_root / "certs")
    pg = LocalPostgres(servers_root / "tls-pg", ssl_files=(certs.server_cert, certs.server_key))
    rd = LocalRedis(servers_root / "tls-redis", tls_files=(certs.ca, certs.server_cert, certs.server_key))
    pg.start()
    rd.start()
    try:
        import psycopg

        with psycopg.connect(f"host={pg.sockdir} port={pg.port} user=postgres dbname=postgres", autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int PRIMARY KEY, name text)")
        tls_dsn = f"postgresql://postgres@127.0.0.1:{pg.port}/postgres?sslmode=verify-full&sslrootcert={certs.ca}"
        tls_url = f"{rd.url}&ssl_certfile={certs.client_cert}&ssl_keyfile={certs.client_key}"
        env.write_mapping("t.yaml", "entity: t\ntable: public.t\nkey: [id]\nfields: {id: id, name: name}\n")
        env.write_config(dsn=tls_dsn, redis_url=tls_url)
        env.cdc("init", check=True)
        with psycopg.connect(tls_dsn, autocommit=True) as conn:
            assert conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()[0] is True
            conn.execute("INSERT INTO t VALUES (1, 'over tls'), (2, 'still encrypted')")
        env.cdc("run", "--until-caught-up", check=True)
        client = redis.Redis.from_url(tls_url)
        assert [f[b"data"] for _, f in client.xrange("cdc:t")] == [
            b'{"id":1,"name":"over tls"}', b'{"id":2,"name":"still encrypted"}',
        ]
        client.close()
        # plain text is refused on both ends, with a clear line
        env.write_config(dsn=f"postgresql://postgres@127.0.0.1:{pg.port}/postgres?sslmode=disable", redis_url=tls_url)
        result = env.cdc("run", "--until-caught-up")
        assert result.returncode == 4 and "no pg_hba.conf entry" in result.stderr
        no_client_cert = redis.Redis.from_url(rd.url)
        with pytest.raises(redis.exceptions.ConnectionError):
            no_client_cert.ping()
    finally:
        rd.stop()
        pg.stop("immediate")
