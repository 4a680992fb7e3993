-- idem RedisStore::complete: stores the response of a claim that is still current.
--
-- KEYS[1]  the record's hash
-- ARGV[1]  the caller's fencing token (decimal, compared as a string)
-- ARGV[2]  the HTTP status
-- ARGV[3]  the replayable headers, a JSON array of [name, value] pairs
-- ARGV[4]  the body (binary)
-- ARGV[5]  the store's notification channel
-- ARGV[6]  the message to publish: the record's key tag, which names the record to every instance
--
-- Returns 1 if the record was in flight under ARGV[1] and is now completed (and the channel was
-- told); 0 if not (no record, another token, or already completed), in which case nothing changed.
-- HSET keeps the key's TTL, so the record still disappears at retain_until.
local r = redis.call('HMGET', KEYS[1], 'state', 'tok')
if r[1] ~= 'inflight' or r[2] ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'done', 'status', ARGV[2], 'headers', ARGV[3], 'body', ARGV[4])
redis.call('HDEL', KEYS[1], 'lease')
redis.call('PUBLISH', ARGV[5], ARGV[6])
return 1
