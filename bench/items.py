"""The items table the benchmarks write: integer, float, text and timestamptz columns that a
mapping of five fields publishes, and one column (secret) that it leaves out."""

ITEMS_TABLE = """
CREATE TABLE items (id bigint PRIMARY KEY, qty int NOT NULL, price float8 NOT NULL, name text NOT NULL,
                    at timestamptz NOT NULL, secret text);
"""
ITEM_MAPPING = "entity: item\ntable: public.items\nkey: [id]\nfields: {id: id, qty: qty, price: price, name: name, at: at}\n"
#: the rows with ids lo..hi (format lo=, hi=), for INSERT INTO items
ITEM_ROWS = ("SELECT g, (g % 1000)::int, g * 0.25, 'item ' || g, timestamptz '2026-01-01 00:00:00+00' + g * interval '1 second', "
             "'secret ' || g FROM generate_series({lo}, {hi}) g")
