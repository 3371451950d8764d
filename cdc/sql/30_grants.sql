-- Least privilege for the bridge's role (sql/00_roles.sql): read the mapped tables, keep the
-- snapshot and backfill bookkeeping, read the reconciliation history; nothing else.
-- `cdc init` (publication, slot) runs as the tables' owner; `cdc run`, `cdc backfill`,
-- `cdc status`, `cdc check` and `cdc trim` as cdc_bridge.
GRANT USAGE ON SCHEMA public TO cdc_bridge;
GRANT SELECT ON public.riders, public.rides, public.rockets TO cdc_bridge;
-- snapshots and backfills (sql/25_backfills.sql): `cdc backfill` queues (INSERT), `cdc run` reads and
-- records progress (SELECT, UPDATE), `cdc status` shows it
GRANT SELECT, INSERT, UPDATE ON public.cdc_backfills TO cdc_bridge;
GRANT USAGE ON SEQUENCE public.cdc_backfills_id_seq TO cdc_bridge;
-- `cdc status` shows each consumer's last reconciliation (sql/20_consumer_state.sql)
GRANT SELECT ON public.cdc_reconcile_runs TO cdc_bridge;
