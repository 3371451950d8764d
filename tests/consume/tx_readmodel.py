"""A read model of orders and their lines, kept by a transaction-mode consumer.

Every source transaction keeps `orders.total = sum(order_lines.amount)` per order and never leaves a line
without its order, so a read model that showed part of a transaction breaks one of the two. Importable as
`cdc consume --handler tx_readmodel:apply` with this folder on PYTHONPATH.
"""

from __future__ import annotations

SCHEMA = """
CREATE TABLE rm_orders (id bigint PRIMARY KEY, total bigint NOT NULL);
CREATE TABLE rm_lines (id bigint PRIMARY KEY, order_id bigint NOT NULL, amount bigint NOT NULL);
"""
#: read-model rows that no whole number of source transactions can give
BROKEN = """
SELECT 'total' AS what, o.id FROM rm_orders o LEFT JOIN rm_lines l ON l.order_id = o.id
GROUP BY o.id, o.total HAVING o.total <> coalesce(sum(l.amount), 0)
UNION ALL
SELECT 'orphan line', l.id FROM rm_lines l LEFT JOIN rm_orders o ON o.id = l.order_id WHERE o.id IS NULL
"""
_UPSERT = {
    "cdc:order": ("INSERT INTO rm_orders (id, total) VALUES (%(id)s, %(total)s) "
                  "ON CONFLICT (id) DO UPDATE SET total = EXCLUDED.total"),
    "cdc:order_line": ("INSERT INTO rm_lines (id, order_id, amount) VALUES (%(id)s, %(order_id)s, %(amount)s) "
                       "ON CONFLICT (id) DO UPDATE SET order_id = EXCLUDED.order_id, amount = EXCLUDED.amount"),
}
_DELETE = {"cdc:order": "DELETE FROM rm_orders WHERE id = %(id)s", "cdc:order_line": "DELETE FROM rm_lines WHERE id = %(id)s"}


def apply(conn, entries, consumer: str) -> None:
    for e in entries:
        if e.op == "d":
            conn.execute(_DELETE[e.stream], {"id": int(e.key["id"])})
        elif e.op in ("c", "u", "r"):
            conn.execute(_UPSERT[e.stream], {k: int(v) for k, v in e.data.items()})
        else:
            raise ValueError(f"unexpected op {e.op!r} in {e.stream} {e.id}")
