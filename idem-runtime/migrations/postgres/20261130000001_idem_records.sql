-- idem's idempotency records (PostgreSQL). Everything lives in the `idem` schema, which the store
-- creates before running its migrations; its migration history is `idem._sqlx_migrations`, so it never
-- meets an application's own `_sqlx_migrations` table.
--
-- Times are milliseconds since the Unix epoch (BIGINT), as idem's clock stamps them.
CREATE TABLE idem.records (
    scope        TEXT    NOT NULL,
    key          TEXT    NOT NULL,
    fingerprint  BYTEA   NOT NULL,
    token        BIGINT  NOT NULL,
    created_at   BIGINT  NOT NULL,
    expires_at   BIGINT  NOT NULL,
    retain_until BIGINT  NOT NULL,
    state        TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed')),
    -- Set while in flight only.
    lease_until  BIGINT,
    -- Set once completed only: the stored response.
    status       INTEGER,
    headers      TEXT,
    body         BYTEA,
    PRIMARY KEY (scope, key),
    CHECK ((state = 'in_flight') = (lease_until IS NOT NULL)),
    CHECK ((state = 'completed') = (status IS NOT NULL AND headers IS NOT NULL AND body IS NOT NULL))
) WITH (fillfactor = 90); -- room for the completing update to stay on the page (HOT update)

-- The sweeper deletes through this index, oldest first, in batches.
CREATE INDEX records_retain_until ON idem.records (retain_until);
