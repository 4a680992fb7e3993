-- The simulated card network's charges (src/card.rs), deduplicated by the idempotency key the
-- service passes on, and each payment's charge: a payment is recorded once per charge, so a run that
-- takes over a crashed one finds the payment the first run recorded instead of adding a second.
CREATE TABLE IF NOT EXISTS card_charges (
    seq             BIGINT  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    idempotency_key TEXT    NOT NULL UNIQUE,
    id              TEXT    NOT NULL UNIQUE,
    owner           TEXT    NOT NULL,
    amount          BIGINT  NOT NULL,
    currency        TEXT    NOT NULL,
    attempts        BIGINT  NOT NULL,
    refunded        BOOLEAN NOT NULL DEFAULT false
);

CREATE INDEX IF NOT EXISTS card_charges_owner ON card_charges (owner, seq);

ALTER TABLE payments ADD COLUMN IF NOT EXISTS charge_id TEXT;
CREATE UNIQUE INDEX IF NOT EXISTS payments_charge_id ON payments (charge_id);
