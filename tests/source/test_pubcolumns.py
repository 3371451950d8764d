"""The column list of a mapped table, judged without a server (cdc.source.pubcolumns)."""

from __future__ import annotations

import pytest

from cdc.source.coverage import Publication, TableCoverage
from cdc.source.pubcolumns import lacking, plan, sends_less, surplus

pytestmark = pytest.mark.one_path

PUB = Publication("cdc", exists=True)


def table(published=None, full=False, row_filter=False) -> TableCoverage:
    return TableCoverage("public", "t", 1, False, (1,), True, True, None, ("id", "a", "b", "note"), full, ("id",),
                         published, row_filter)


def test_the_list_is_the_mapped_columns_and_the_identity_in_table_order():
    assert plan(table(), ["b", "id"], PUB).wanted == ("id", "b")
    assert plan(table(), ["a"], PUB).wanted == ("id", "a")  # the identity, for updates and deletes


def test_where_the_server_cannot_leave_columns_out_the_plan_says_why():
    cases = {
        "PostgreSQL before 15": Publication("cdc", True, lists=False),
        "FOR ALL TABLES": Publication("cdc", True, all_tables=True),
        "FOR TABLES IN SCHEMA": Publication("cdc", True, schemas=True),
    }
    for why, pub in cases.items():
        p = plan(table(), ["a"], pub)
        assert p.wanted is None and why in p.reason
        assert surplus(p) == []  # nothing to warn of: it cannot be better
    p = plan(table(full=True), ["a"], PUB)
    assert p.wanted is None and "REPLICA IDENTITY FULL" in p.reason


def test_less_is_a_stop_and_more_a_surplus():
    assert lacking(table(published=("id", "b")), ["a", "b"]) == ["a"]
    assert lacking(table(published=("a",)), ["a"]) == ["id"]  # the identity
    assert lacking(table(published=("id", "a"), full=True), ["a"]) == ["b", "note"]  # FULL needs every column
    assert lacking(table(published=None), ["a"]) == []
    assert "column(s) a of mapped table public.t" in sends_less(table(published=("id",)), ["a"], "cdc", "s").message
    assert "filters the rows" in sends_less(table(row_filter=True), ["a"], "cdc").message
    assert sends_less(table(published=("id", "a")), ["a"], "cdc") is None
    assert surplus(plan(table(), ["a"], PUB)) == ["b", "note"]  # every column sent
    assert surplus(plan(table(published=("id", "a", "note")), ["a"], PUB)) == ["note"]
