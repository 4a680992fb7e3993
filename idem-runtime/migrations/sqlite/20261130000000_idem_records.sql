-- idem's records: one row per (scope, key). Times are milliseconds since the Unix epoch.
--
-- The statements are idempotent (IF NOT EXISTS) so that two processes migrating the same file at once
-- cannot fail on a half-created schema.
CREATE TABLE IF NOT EXISTS idem_records (
    scope        TEXT    NOT NULL,
    key          TEXT    NOT NULL,
    -- SHA-256 of the request (32 bytes).
    fingerprint  BLOB    NOT NULL,
    -- The current claim's fencing token.
    token        INTEGER NOT NULL,
    created_at   INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL,
    retain_until INTEGER NOT NULL,
    state        TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed')),
    -- In flight only: when the claim may be taken over.
    lease_until  INTEGER,
    -- How many times a dead worker's claim on this key was taken over (0 for a fresh claim).
    takeovers    INTEGER NOT NULL DEFAULT 0,
    -- Completed only: the stored response. Headers are a JSON array of [name, value] pairs.
    status       INTEGER,
    headers      TEXT,
    body         BLOB,
    PRIMARY KEY (scope, key)
);

-- Purging deletes by retain_until in batches; without this index every batch scans the table.
CREATE INDEX IF NOT EXISTS idem_records_retain_until ON idem_records (retain_until);
