-- idem's idempotency records on MySQL 8 and MariaDB 10.11 (InnoDB): one row per (scope, key), in
-- the pool's own database, every table named `idem_…`. Times are milliseconds since the Unix epoch
-- (BIGINT), set and judged by the server's clock (see src/store/mysql.rs).
--
-- The statements are idempotent (IF NOT EXISTS): MySQL's DDL commits at once and cannot roll back,
-- so a migration interrupted half-way must be able to run again.
--
-- Keys are VARBINARY: compared byte for byte (no collation folds case, accents or trailing spaces,
-- as utf8mb4_bin's PAD SPACE would). Each part is at most `RecordKey::MAX_PART + 1` = 256 bytes, so
-- the primary key takes at most 512 bytes, within InnoDB's 3072-byte index limit (and its 767-byte
-- limit per column on the old COMPACT row format).
CREATE TABLE IF NOT EXISTS idem_records (
    scope        VARBINARY(256) NOT NULL,
    `key`        VARBINARY(256) NOT NULL,
    -- SHA-256 of the request.
    fingerprint  BINARY(32)     NOT NULL,
    -- The current claim's fencing token.
    token        BIGINT         NOT NULL,
    created_at   BIGINT         NOT NULL,
    expires_at   BIGINT         NOT NULL,
    retain_until BIGINT         NOT NULL,
    state        VARCHAR(9) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    -- In flight only: when the claim may be taken over.
    lease_until  BIGINT         NULL,
    -- Whether a duplicate announced that it waits for this record (`Store::announce_waiter`): only
    -- then does completing or releasing it write a wake-up row. Never cleared while the row lives.
    watched      BOOLEAN        NOT NULL DEFAULT FALSE,
    -- Completed only: the stored response. Headers are a JSON array of [name, value] pairs.
    status       INT            NULL,
    headers      LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    body         LONGBLOB       NULL,
    PRIMARY KEY (scope, `key`),
    -- The sweeper deletes through this index, oldest first, in batches.
    KEY idem_records_retain_until (retain_until),
    CONSTRAINT idem_records_state CHECK (state IN ('in_flight', 'completed', 'released')),
    CONSTRAINT idem_records_lease CHECK ((state = 'in_flight') = (lease_until IS NOT NULL)),
    CONSTRAINT idem_records_response
        CHECK ((state = 'completed') = (status IS NOT NULL AND headers IS NOT NULL AND body IS NOT NULL))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Completions and releases of awaited records, for waiters on other instances: MySQL has no
-- LISTEN/NOTIFY, so each instance with waiters polls this table by `at` (the server's time of the
-- insert). Rows are deleted by the purge once no poller can still need them.
CREATE TABLE IF NOT EXISTS idem_wakeups (
    id    BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    scope VARBINARY(256)  NOT NULL,
    `key` VARBINARY(256)  NOT NULL,
    at    BIGINT          NOT NULL,
    PRIMARY KEY (id),
    KEY idem_wakeups_at (at)
) ENGINE = InnoDB;
