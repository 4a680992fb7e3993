-- idem RedisStore::release: deletes a claim that is still current, so that a retry runs again.
--
-- KEYS[1]  the record's key, `<prefix>:{<tag>}`
-- ARGV[1]  the caller's fencing token (its 8 stored bytes)
--
-- Returns 1 if the record was in flight under ARGV[1] and is now deleted, 0 if not (no record, another
-- token, or completed), -1 if the key holds something that is not a record of layout version 1; in
-- the last two cases nothing changed. As in complete.lua, publishes <tag> on `<prefix>:done` only if
-- the record is watched.
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
redis.call('DEL', KEYS[1])
if string.byte(cur, 3) == 1 then
  local open = string.find(KEYS[1], '{', 1, true)
  redis.call('PUBLISH', string.sub(KEYS[1], 1, open - 2) .. ':done', string.sub(KEYS[1], open + 1, -2))
end
return 1
