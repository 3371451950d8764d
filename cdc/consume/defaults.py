"""A consumer's tunables and their defaults, apart from the consumer: the command line states them in
``cdc consume --help`` without loading the consumer (`cdc.consume.consumer` uses them)."""

from __future__ import annotations

__all__ = ["BLOCK_MS", "CLAIM_IDLE_MS", "COUNT", "GC_YOUNG_THRESHOLD", "LEASE_POLL_S", "LEASE_TTL_MS", "MAX_DELIVERIES",
           "TRANSACTION_WAIT_MS"]

#: entries per read and per batch: a read returns what has arrived, up to this many, so a larger count costs
#: live traffic nothing and lets a consumer with a round trip per batch (a `TransactionalHandler`) keep up
#: with a backlog (batches of 100 applied about half of 50,000 changes/s; docs/performance.md)
COUNT = 1000
#: defaults, chosen so that a group stalls about two seconds when one of its consumers dies
BLOCK_MS = 1000
CLAIM_IDLE_MS = 5_000
MAX_DELIVERIES = 5
LEASE_TTL_MS = 2_000
#: transaction mode: how long a transaction whose END record was read may stay incomplete (entries on their
#: way) before the consumer stops; entries waiting for an END the bridge has not written yet are logged after it
TRANSACTION_WAIT_MS = 10_000
#: how often, at most, leases are renewed and free ones sought (and shared mode reaps)
LEASE_POLL_S = 0.25
#: `cdc consume`: allocations of container objects between two collections of the youngest generation
#: (Python: 700), as the bridge's; every entry makes a few short-lived dicts and none makes a cycle
GC_YOUNG_THRESHOLD = 20_000
