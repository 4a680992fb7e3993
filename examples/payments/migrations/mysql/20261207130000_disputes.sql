-- How many disputes the card network has reported for each payment (its `charge.disputed`
-- webhooks, each delivery id counted once).
ALTER TABLE payments ADD COLUMN disputes BIGINT NOT NULL DEFAULT 0;
