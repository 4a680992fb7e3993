-- idem's Redis stores, list_in_flight and stats (an operator's), per record: its header.
--
-- KEYS[1]  the record's key (found by a scan)
--
-- Returns the value's first 75 bytes (the header, blob.rs: all of an in-flight or released record)
-- if the key holds a string, else nil, so that one foreign key does not fail a listing.
if redis.call('TYPE', KEYS[1])['ok'] ~= 'string' then
  return false
end
return redis.call('GETRANGE', KEYS[1], 0, 74)
