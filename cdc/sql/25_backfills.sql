-- Snapshot and backfill bookkeeping (cdc/bridge/backfill.py): one row per snapshot or backfill,
-- with its progress. `cdc init` creates it too when missing; creating it here lets the grants
-- (`cdc sql`, or 30_grants.sql for the demo) give the bridge's role what it needs before `cdc init` runs.
CREATE TABLE IF NOT EXISTS public.cdc_backfills (
    id          bigserial PRIMARY KEY,
    slot        text NOT NULL,
    entity      text NOT NULL,
    where_sql   text,
    status      text NOT NULL DEFAULT 'pending',   -- pending, running, done, failed, superseded, cancelled
    error       text,                               -- why it failed or was superseded
    last_key    jsonb,                              -- resume after this key (text values, key order)
    chunks      bigint NOT NULL DEFAULT 0,
    rows_done   bigint NOT NULL DEFAULT 0,
    rows_total  bigint,                             -- estimate, for progress
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- a table made before failures were recorded
ALTER TABLE public.cdc_backfills ADD COLUMN IF NOT EXISTS error text;
