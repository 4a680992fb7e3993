-- idem's Redis stores, erase_scope (an operator's), per record: deletes it, whatever it holds.
--
-- KEYS[1]  the record's key (found by a scan of the scope's keys)
--
-- Returns 1 if the key existed and was deleted, else 0. A watched record publishes <tag> on
-- `<prefix>:done` as settle.lua does, so that waiters in every instance re-read it (and find
-- nothing).
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then
  return 0
end
if kind == 'string' then
  local head = redis.call('GETRANGE', KEYS[1], 0, 2)
  if #head == 3 and string.byte(head, 1) == 1 and string.byte(head, 3) == 1 then
    local open = string.find(KEYS[1], '{', 1, true)
    redis.call('PUBLISH', string.sub(KEYS[1], 1, open - 2) .. ':done',
      string.sub(KEYS[1], open + 1, -2))
  end
end
redis.call('DEL', KEYS[1])
return 1
