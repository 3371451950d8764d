-- The sample "rocket rides" domain used by the demo and the tests.
CREATE TABLE IF NOT EXISTS public.riders (
    id          bigserial PRIMARY KEY,
    name        text NOT NULL,
    email       text NOT NULL,
    phone       text,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS public.rides (
    id          bigserial PRIMARY KEY,
    rider_id    bigint NOT NULL REFERENCES public.riders (id),
    distance_m  numeric(12, 3) NOT NULL,
    status      text NOT NULL DEFAULT 'done',
    created_at  timestamptz NOT NULL DEFAULT now(),
    internal_note text  -- never mapped: must never reach Redis
);
-- consumers keeping totals need the old distance of updated and deleted rides
ALTER TABLE public.rides REPLICA IDENTITY FULL;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_type WHERE typname = 'rocket_class') THEN
        CREATE TYPE public.rocket_class AS ENUM ('suborbital', 'orbital', 'lunar');
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_type WHERE typname = 'positive_kg') THEN
        CREATE DOMAIN public.positive_kg AS numeric CHECK (VALUE > 0);
    END IF;
END
$$;

-- A table with wide and varied column types.
CREATE TABLE IF NOT EXISTS public.rockets (
    id            uuid PRIMARY KEY,
    name          varchar(80) NOT NULL,
    class         public.rocket_class NOT NULL,
    dry_mass      public.positive_kg NOT NULL,
    thrust_kn     double precision,
    stages        smallint NOT NULL,
    launched_on   date,
    launch_window tstzrange,
    burn_time     interval,
    countdown_at  time,
    built_at      timestamp,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    reusable      boolean NOT NULL DEFAULT false,
    specs         jsonb,
    tags          text[],
    payload_kg    numeric[],
    checksum      bytea,
    manual        text,          -- large: stored out of line (TOAST)
    owner_email   text
);
ALTER TABLE public.rockets REPLICA IDENTITY FULL;
