-- A least-privilege role for the bridge: REPLICATION to read the slot, SELECT on the
-- mapped tables (needed by the publication's initial checks and by `cdc check`).
-- Run as a superuser; replace the password (or use a password file / certificate).
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'cdc_bridge') THEN
        CREATE ROLE cdc_bridge WITH LOGIN REPLICATION;
    END IF;
END
$$;
