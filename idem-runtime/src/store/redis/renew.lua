-- idem RedisStore::renew: moves the lease of a claim that is still current.
--
-- KEYS[1]  the record's key, `<prefix>:{<tag>}`
-- ARGV[1]  the caller's fencing token (its 8 stored bytes)
-- ARGV[2]  the lease, ms (decimal): the new lease_until is now plus the lease
-- ARGV[3]  now, ms since the Unix epoch, when the store was given a clock; "" to read the server's
--          TIME
--
-- Returns 1 if the record was in flight under ARGV[1] and now carries the new lease, 0 if not (no
-- record, another token, or completed), -1 if the key holds something that is not a record of
-- layout version 1; in the last two cases nothing changed. SETRANGE keeps the key's TTL.
local cur = redis.call('GETRANGE', KEYS[1], 0, 10)
if #cur == 0 then
  return 0
end
if #cur < 11 or string.byte(cur, 1) ~= 1 then
  return -1
end
if string.byte(cur, 2) ~= 70 or string.sub(cur, 4, 11) ~= ARGV[1] then -- 70 is 'F'
  return 0
end
local now
if ARGV[3] ~= '' then
  now = tonumber(ARGV[3])
else
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end
redis.call('SETRANGE', KEYS[1], 35, struct.pack('>i8', now + tonumber(ARGV[2])))
return 1
