-- idem's Redis stores, get: the record's value with the store's time of the read.
--
-- KEYS[1]  the record's key
-- ARGV[1]  now, ms since the Unix epoch, when the store was given a clock; "" to read the server's
--          TIME
--
-- Returns {now, value} (value nil if there is no record). Judging retention, expiry and the lease
-- against the time read here, on the server that holds the record, is what keeps instances whose
-- clocks disagree in agreement.
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end
return {now, redis.call('GET', KEYS[1])}
