-- idem's Redis stores, complete and release: settles a claim that is still current.
--
-- KEYS[1]  the record's key, `<prefix>:{<tag>}`
-- ARGV[1]  the caller's fencing token (its 8 stored bytes)
-- ARGV[2]  to complete: the response, encoded as a completed record's tail (blob.rs), appended to
--          the header (SET KEEPTTL keeps the key's TTL); absent to release: the state byte becomes
--          'R' (released; SETRANGE keeps the key's TTL, and the record keeps its times)
--
-- Returns 1 if the record was in flight under ARGV[1] and is now completed or released, 0 if not (no
-- record, another token, or already completed), -1 if the key holds something that is not a record
-- of layout version 1; in the last two cases nothing changed.
--
-- If the record is watched (a duplicate announced itself, announce.lua), publishes <tag> on
-- `<prefix>:done`, both read from the key (the prefix has no braces). With many instances every
-- message reaches every instance, so records nobody waits for publish nothing.
local cur = redis.call('GET', KEYS[1])
if not cur then
  return 0
end
if #cur < 75 or string.byte(cur, 1) ~= 1 then
  return -1
end
if string.byte(cur, 2) ~= 70 or string.sub(cur, 4, 11) ~= ARGV[1] then -- 70 is 'F'
  return 0
end
if #cur ~= 75 then
  return -1
end
if ARGV[2] then
  redis.call('SET', KEYS[1], '\1D' .. string.sub(cur, 3) .. ARGV[2], 'KEEPTTL')
else
  redis.call('SETRANGE', KEYS[1], 1, 'R')
end
if string.byte(cur, 3) == 1 then
  local open = string.find(KEYS[1], '{', 1, true)
  redis.call('PUBLISH', string.sub(KEYS[1], 1, open - 2) .. ':done', string.sub(KEYS[1], open + 1, -2))
end
return 1
