-- idem RedisStore::purge_expired, per record: deletes the record if it is past retention.
--
-- KEYS[1]  the record's key
-- ARGV[1]  now, ms since the Unix epoch, when the store was given a clock (decimal); "" to read the
--          server's TIME (the normal case: no instance's clock decides what is purged)
--
-- Returns 1 if the record's retain_until is at or before now and it was deleted, else 0. The
-- check and the delete are one step, so a key claimed afresh since the scan found it is kept. Reads
-- the header up to retain_until (bytes 27..35, big-endian, signed; blob.rs). A key that does not hold
-- a record of layout version 1 (another type included: it is not an error, so one foreign key does
-- not stop every purge) is left alone. Lua numbers are doubles: exact for every time below 2^53 ms
-- (the year 287396), and in the right order beyond.
if redis.call('TYPE', KEYS[1])['ok'] ~= 'string' then
  return 0
end
local head = redis.call('GETRANGE', KEYS[1], 0, 34)
if #head ~= 35 or string.byte(head, 1) ~= 1 then
  return 0
end
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end
if struct.unpack('>i8', head, 28) <= now then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
