-- The payments ledger. IF NOT EXISTS: ledgers created before the example used migrations already
-- have these, and two processes starting on one file cannot fail on a half-created schema.
CREATE TABLE IF NOT EXISTS payments (
    seq      INTEGER PRIMARY KEY AUTOINCREMENT,
    id       TEXT    NOT NULL UNIQUE,
    owner    TEXT    NOT NULL,
    amount   INTEGER NOT NULL,
    currency TEXT    NOT NULL,
    status   TEXT    NOT NULL
);

CREATE INDEX IF NOT EXISTS payments_owner ON payments (owner, seq);
