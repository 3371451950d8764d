-- Least privilege for the bridge's role (sql/00_roles.sql): read the mapped tables, nothing else.
-- `cdc init` (publication, slot) runs as the tables' owner; `cdc run` as cdc_bridge.
GRANT USAGE ON SCHEMA public TO cdc_bridge;
GRANT SELECT ON public.riders, public.rides, public.rockets TO cdc_bridge;
-- Backfill bookkeeping (created by `cdc init`): the bridge reads it and records progress.
-- Run this file again after `cdc init` if the table did not exist yet.
DO $$
BEGIN
    IF to_regclass('public.cdc_backfills') IS NOT NULL THEN
        GRANT SELECT, UPDATE ON public.cdc_backfills TO cdc_bridge;
    END IF;
END
$$;
