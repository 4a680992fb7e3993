-- idem RedisStore::purge_expired, per record: deletes the record if it is past retention.
--
-- KEYS[1]  the record's hash
-- ARGV[1]  now, ms since the Unix epoch (the sweeper's clock)
--
-- Returns 1 if the record's retain_until is at or before ARGV[1] and it was deleted, else 0. The
-- check and the delete are one step, so a key claimed afresh since the scan found it is kept.
local retain = tonumber(redis.call('HGET', KEYS[1], 'retain'))
if retain ~= nil and retain <= tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
