-- idem RedisStore::release: deletes a claim that is still current, so that a retry runs again.
--
-- KEYS[1]  the record's hash
-- ARGV[1]  the caller's fencing token (decimal, compared as a string)
-- ARGV[2]  the store's notification channel
-- ARGV[3]  the message to publish: the record's key tag
--
-- Returns 1 if the record was in flight under ARGV[1] and is now deleted (and the channel was told);
-- 0 if not (no record, another token, or completed), in which case nothing changed.
local r = redis.call('HMGET', KEYS[1], 'state', 'tok')
if r[1] ~= 'inflight' or r[2] ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
