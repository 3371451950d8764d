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
