-- Least privilege for the bridge's role (sql/00_roles.sql): read the mapped tables, nothing else.
-- `cdc init` (publication, slot) runs as the tables' owner; `cdc run` as cdc_bridge.
GRANT USAGE ON SCHEMA public TO cdc_bridge;
GRANT SELECT ON public.riders, public.rides, public.rockets TO cdc_bridge;
