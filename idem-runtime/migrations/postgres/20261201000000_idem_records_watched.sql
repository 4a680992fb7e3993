-- Whether a duplicate has announced that it waits for this record (`Store::announce_waiter`).
-- Completion and release send a NOTIFY only for such records: PostgreSQL takes a database-wide lock
-- at the commit of every transaction that notified, so notifying on every completion serialises all
-- completing commits. Set by waiters, never cleared while the row lives; a fresh claim starts false.
-- A constant default makes this a catalogue-only change on PostgreSQL 11 and later (no table rewrite).
ALTER TABLE idem.records ADD COLUMN watched BOOLEAN NOT NULL DEFAULT false;
