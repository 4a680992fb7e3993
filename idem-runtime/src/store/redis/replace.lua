-- idem RedisStore::claim, when the record found is past retention or may be taken over: replaces it,
-- if it is still the one the claim decoded. (A fresh claim and a replay need no script: they are one
-- `SET key <in-flight record> NX GET PX <ttl>`.)
--
-- KEYS[1]  the record's key
-- ARGV[1]  the fencing token of the record the claim decoded (its 8 stored bytes)
-- ARGV[2]  that record's state byte: 'F' (in flight) or 'D' (done)
-- ARGV[3]  the new record: an in-flight record (75 bytes, layout in blob.rs); its watched byte is
--          replaced by the current record's, so that a duplicate already announced is still told
-- ARGV[4]  the TTL in ms for a record past retention, replaced by a fresh one; "" for a takeover,
--          which keeps the key's TTL (and the record's created/expires/retain, which ARGV[3] carries)
--
-- Returns 1 if the record was replaced; 0 if the key no longer holds that record (deleted, completed,
-- or claimed by another token meanwhile), in which case nothing changed and the claim starts over.
-- The token and state identify the record: nothing changes a record in place but completion (state)
-- and announcement (the watched byte, kept).
local cur = redis.call('GET', KEYS[1])
if not cur or #cur < 75 or string.byte(cur, 1) ~= 1 or string.sub(cur, 2, 2) ~= ARGV[2]
    or string.sub(cur, 4, 11) ~= ARGV[1] then
  return 0
end
local new = string.sub(ARGV[3], 1, 2) .. string.sub(cur, 3, 3) .. string.sub(ARGV[3], 4)
if ARGV[4] == '' then
  redis.call('SET', KEYS[1], new, 'KEEPTTL')
else
  redis.call('SET', KEYS[1], new, 'PX', ARGV[4])
end
return 1
