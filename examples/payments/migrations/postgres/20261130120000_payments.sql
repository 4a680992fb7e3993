-- The payments ledger, in the connection's default schema (idem keeps its records in `idem`).
CREATE TABLE IF NOT EXISTS payments (
    seq      BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id       TEXT   NOT NULL UNIQUE,
    owner    TEXT   NOT NULL,
    amount   BIGINT NOT NULL,
    currency TEXT   NOT NULL,
    status   TEXT   NOT NULL
);

CREATE INDEX IF NOT EXISTS payments_owner ON payments (owner, seq);
