-- A caller id is whatever its bearer token says, of any length: a B-tree index row is limited to
-- about 2.7 kB, and a longer owner failed every insert (a 500 no retry could fix). Hash indexes have
-- no such limit and serve the equality lookups by owner; the sort by `seq` follows them.
CREATE INDEX IF NOT EXISTS payments_owner_hash ON payments USING hash (owner);
DROP INDEX IF EXISTS payments_owner;
CREATE INDEX IF NOT EXISTS card_charges_owner_hash ON card_charges USING hash (owner);
DROP INDEX IF EXISTS card_charges_owner;
