"""cdc: PostgreSQL changes into Redis Streams, exactly once (the distribution pg-redis-cdc).

The version is written here only: the build reads it (pyproject.toml) and ``cdc --version`` prints it.
"""

__version__ = "0.2.0"
