-- idem RedisStore::announce_waiter: marks an in-flight record watched, so that its completion or
-- release publishes its tag (settle.lua).
--
-- KEYS[1]  the record's key
--
-- Returns 1 if the record was in flight and unwatched and is now watched, else 0 (no record, a
-- completed one, one already watched, or something that is not a record of layout version 1), in
-- which case nothing changed. Only the first 3 bytes are read and only the watched byte is written
-- (SETRANGE keeps the key's TTL). Scripts run one at a time, so a completion runs wholly before this
-- script (the waiter's next read sees it) or wholly after it (and sees the flag): no wake-up is lost.
local head = redis.call('GETRANGE', KEYS[1], 0, 2)
if #head == 3 and string.byte(head, 1) == 1 and string.sub(head, 2, 2) == 'F'
    and string.byte(head, 3) == 0 then
  redis.call('SETRANGE', KEYS[1], 2, '\1')
  return 1
end
return 0
