-- Bookkeeping for consumers that keep their state in PostgreSQL (cdc.checkpoint).
-- A consumer's state and its checkpoint commit in one transaction.
CREATE TABLE IF NOT EXISTS public.cdc_checkpoints (
    consumer    text        NOT NULL,   -- whose state this is (usually the consumer group)
    stream      text        NOT NULL,
    entry_id    text        NOT NULL DEFAULT '0-0',  -- last stream entry applied
    lsn         numeric(20) NOT NULL DEFAULT 0,      -- its source position: (commit LSN, seq)
    seq         bigint      NOT NULL DEFAULT -1,
    epoch       bigint      NOT NULL DEFAULT 0,      -- lease epoch of the last writer (fencing)
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, stream)
);

-- Dead letters replayed to a consumer, so a replay is applied once.
CREATE TABLE IF NOT EXISTS public.cdc_replays (
    consumer    text NOT NULL,
    replay_of   text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, replay_of)
);

-- State of the rocket-rides example consumers: total distance per rider,
-- and overall under rider_id 0.
CREATE TABLE IF NOT EXISTS public.consumer_states (
    consumer        text    NOT NULL,
    rider_id        bigint  NOT NULL,
    total_distance  numeric NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer, rider_id)
);

-- Nightly reconciliation (cdc reconcile), in the same database as the consumer's state.
-- The position of the newest reset applied to each consumer: an older reset is refused.
CREATE TABLE IF NOT EXISTS public.cdc_reset_fences (
    consumer    text        PRIMARY KEY,
    position    numeric(20) NOT NULL DEFAULT 0,   -- LSN of the newest reset applied
    applied_at  timestamptz
);

-- History: one row per consumer and run, with the JSON drift report, and one row per drifted value.
CREATE TABLE IF NOT EXISTS public.cdc_reconcile_runs (
    id             bigserial   PRIMARY KEY,
    spec           text        NOT NULL,
    consumer       text        NOT NULL,
    position       numeric(20) NOT NULL,   -- the snapshot's LSN: the truth holds every commit before it
    snapshot       text        NOT NULL,
    started_at     timestamptz NOT NULL,
    finished_at    timestamptz NOT NULL DEFAULT now(),
    dry_run        boolean     NOT NULL,
    status         text        NOT NULL,   -- clean | repaired | drift | stale | failed | never
    reason         text        NOT NULL DEFAULT '',
    source_rows    bigint      NOT NULL,
    truth_keys     bigint      NOT NULL,
    keys_compared  bigint      NOT NULL,
    keys_drifted   bigint      NOT NULL,
    caught_up      bigint      NOT NULL,   -- entries before the position applied for a lagging consumer
    replayed       bigint      NOT NULL,   -- entries after the position applied on top of the truth
    report         jsonb       NOT NULL
);
CREATE TABLE IF NOT EXISTS public.cdc_drift (
    run_id      bigint  NOT NULL REFERENCES public.cdc_reconcile_runs (id) ON DELETE CASCADE,
    key         jsonb   NOT NULL,
    value       text    NOT NULL,
    expected    text,
    actual      text,
    difference  numeric
);
CREATE INDEX IF NOT EXISTS cdc_drift_run ON public.cdc_drift (run_id);
