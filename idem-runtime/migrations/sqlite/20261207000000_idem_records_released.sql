-- A released record is kept (state 'released') for its request's retry to resume, so the state
-- check admits it; each record says how its current claim won it; in-flight records are listed
-- oldest first through an index of their own.
--
-- SQLite cannot change a CHECK constraint in place: the table is rebuilt and renamed, which keeps
-- its name and its primary key's index name. Triggers of yours on idem_records go with the old
-- table; create them again after this migration.
CREATE TABLE IF NOT EXISTS idem_records_v2 (
    scope        TEXT    NOT NULL,
    key          TEXT    NOT NULL,
    -- SHA-256 of the request (32 bytes).
    fingerprint  BLOB    NOT NULL,
    -- The current claim's fencing token.
    token        INTEGER NOT NULL,
    created_at   INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL,
    retain_until INTEGER NOT NULL,
    -- 'released': its handler failed; the same request's retry resumes it, any other replaces it.
    state        TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed', 'released')),
    -- In flight only: when the claim may be taken over.
    lease_until  INTEGER,
    -- How many times a dead worker's claim on this key was taken over (0 for a fresh claim).
    takeovers    INTEGER NOT NULL DEFAULT 0,
    -- How the current claim won the record: a fresh record, a takeover, or a resumed release.
    claimed_by   TEXT    NOT NULL DEFAULT 'insert'
                         CHECK (claimed_by IN ('insert', 'take_over', 'resume')),
    -- Completed only: the stored response. Headers are a JSON array of [name, value] pairs.
    status       INTEGER,
    headers      TEXT,
    body         BLOB,
    PRIMARY KEY (scope, key)
);

INSERT INTO idem_records_v2
    (scope, key, fingerprint, token, created_at, expires_at, retain_until, state, lease_until,
     takeovers, claimed_by, status, headers, body)
SELECT scope, key, fingerprint, token, created_at, expires_at, retain_until, state, lease_until,
       takeovers, CASE WHEN takeovers > 0 THEN 'take_over' ELSE 'insert' END, status, headers, body
FROM idem_records;

DROP TABLE idem_records;
ALTER TABLE idem_records_v2 RENAME TO idem_records;

-- Purging deletes by retain_until in batches; without this index every batch scans the table.
CREATE INDEX IF NOT EXISTS idem_records_retain_until ON idem_records (retain_until);
-- Operators list the claims in flight oldest first (and the oldest is counted) without a scan.
CREATE INDEX IF NOT EXISTS idem_records_in_flight ON idem_records (created_at, scope, key)
    WHERE state = 'in_flight';
