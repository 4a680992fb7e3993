-- idem's Redis stores, forget (an operator's): deletes a record if it is still as it was read.
--
-- KEYS[1]  the record's key, `<prefix>:{<tag>}`
-- ARGV[1]  the fencing token the record was read with (its 8 stored bytes)
-- ARGV[2]  the state byte it was read in: 'F', 'D' or 'R'
--
-- Returns 1 if the key held a record of layout version 1 with that token in that state and it was
-- deleted, else 0 (nothing changed: it was claimed, completed or released since, or is gone). If the
-- record was watched, publishes <tag> on `<prefix>:done` as settle.lua does, so that waiters in
-- every instance re-read it.
if redis.call('TYPE', KEYS[1])['ok'] ~= 'string' then
  return 0
end
local head = redis.call('GETRANGE', KEYS[1], 0, 10)
if #head ~= 11 or string.byte(head, 1) ~= 1 or string.sub(head, 2, 2) ~= ARGV[2]
    or string.sub(head, 4, 11) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
if string.byte(head, 3) == 1 then
  local open = string.find(KEYS[1], '{', 1, true)
  redis.call('PUBLISH', string.sub(KEYS[1], 1, open - 2) .. ':done', string.sub(KEYS[1], open + 1, -2))
end
return 1
