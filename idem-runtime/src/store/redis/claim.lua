-- idem's Redis stores, claim: applies `Claim::decide` at the store's time, in one step.
--
-- KEYS[1]  the record's key, `<prefix>:{<tag>}`
-- ARGV[1]  the claim's fencing token (its 8 stored bytes)
-- ARGV[2]  the request's fingerprint (32 bytes)
-- ARGV[3]  the lease, ms (decimal)
-- ARGV[4]  the ttl, ms
-- ARGV[5]  the retention, ms (at least the ttl; also the key's TTL when a fresh record is written)
-- ARGV[6]  now, ms since the Unix epoch, when the store was given a clock; "" to read the server's
--          TIME (the normal case: the server's clock decides, never an instance's)
--
-- Returns {rule, now, record}: rule 1 (inserted a fresh record), 2 (took an in-flight record whose
-- lease ran out over), 3 (resumed a record the same request released), 4 (the key already holds
-- this very claim: a client resent the script after a lost reply), each with the record as it now
-- stands; or 0 with the value found, unchanged (kept; the caller decodes it, and reports a value that
-- is not a record as corrupt). The layout is blob.rs's: the fields sit at fixed offsets (Lua counts
-- from 1): state at 2, watched at 3, token 4..11, created 12, expires 20, retain 28, lease 36 (8
-- bytes each, big-endian, signed), fingerprint 44..75. A takeover or a resume keeps the record's
-- times and the key's TTL; a fresh record gets a fresh TTL. The watched byte is kept, so that a
-- duplicate already announced is still told.
local now
if ARGV[6] ~= '' then
  now = tonumber(ARGV[6])
else
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end
local lease, ttl, retain = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local cur = redis.call('GET', KEYS[1])
local watched = '\0'
local rule = 1
if cur then
  local state = string.sub(cur, 2, 2)
  local valid = #cur >= 75 and string.byte(cur, 1) == 1 and string.byte(cur, 3) <= 1
    and (((state == 'F' or state == 'R') and #cur == 75) or (state == 'D' and #cur > 75))
  if not valid then
    return {0, now, cur}
  end
  watched = string.sub(cur, 3, 3)
  if state == 'F' and string.sub(cur, 4, 11) == ARGV[1] then
    return {4, now, cur}
  end
  if struct.unpack('>i8', cur, 28) > now then
    local same = string.sub(cur, 44, 75) == ARGV[2] and now < struct.unpack('>i8', cur, 20)
    if state == 'R' and same then
      rule = 3
    elseif state == 'F' and same and struct.unpack('>i8', cur, 36) <= now then
      rule = 2
    elseif state ~= 'R' then
      return {0, now, cur}
    end
  end
end
local new
if rule == 1 then
  new = '\1F' .. watched .. ARGV[1] .. struct.pack('>i8>i8>i8>i8', now, now + ttl, now + retain,
    now + lease) .. ARGV[2]
  redis.call('SET', KEYS[1], new, 'PX', math.max(retain, 1))
else
  new = '\1F' .. watched .. ARGV[1] .. string.sub(cur, 12, 35) .. struct.pack('>i8', now + lease)
    .. string.sub(cur, 44, 75)
  redis.call('SET', KEYS[1], new, 'KEEPTTL')
end
return {rule, now, new}
