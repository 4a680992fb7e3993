-- idem RedisStore::claim: claims one idempotency record in one atomic step.
--
-- KEYS[1]  the record's hash
-- ARGV[1]  now, ms since the Unix epoch (the engine's clock; Redis's own clock is never read)
-- ARGV[2]  the request's fingerprint (64 hex digits)
-- ARGV[3]  the claim's fencing token (decimal; compared as a string, since 63-bit tokens do not fit
--          a Lua number exactly)
-- ARGV[4]  lease_until, ms
-- ARGV[5]  expires_at, ms
-- ARGV[6]  retain_until, ms
-- ARGV[7]  retain_until - now in ms (at least 1): the PEXPIRE that makes Redis delete the record
--          itself once retention ends
--
-- Returns one of:
--   {"claimed"}     there was no record, or only one past retention at ARGV[1]: a fresh in-flight
--                   record now carries the caller's token
--   {"taken_over"}  the record was in flight, its lease had run out, same fingerprint, not expired:
--                   its token and lease were replaced (created/expires/retain and the TTL are kept)
--   {"existing", state, fp, tok, created, expires, retain, lease, status, headers, body}
--                   the record as it stands, unchanged (absent fields are nil), so that a replay
--                   costs this one round trip
local FIELDS = {'state', 'fp', 'tok', 'created', 'expires', 'retain', 'lease', 'status', 'headers', 'body'}
local r = redis.call('HMGET', KEYS[1], unpack(FIELDS))
local now = tonumber(ARGV[1])

local exists = false
for i = 1, #FIELDS do
  if r[i] then exists = true end
end

local retain = tonumber(r[6])
local forgotten = exists and retain ~= nil and retain <= now

if exists and not forgotten then
  local expires = tonumber(r[5])
  local lease = tonumber(r[7])
  if r[1] == 'inflight' and lease ~= nil and lease <= now and r[2] == ARGV[2]
      and expires ~= nil and now < expires then
    redis.call('HSET', KEYS[1], 'tok', ARGV[3], 'lease', ARGV[4])
    return {'taken_over'}
  end
  -- A record we cannot read (say, no retain field) is returned too: the caller reports it as corrupt
  -- rather than this script overwriting it.
  local out = {'existing'}
  for i = 1, #FIELDS do out[i + 1] = r[i] end
  return out
end

if exists then
  redis.call('DEL', KEYS[1])
end
redis.call('HSET', KEYS[1], 'state', 'inflight', 'fp', ARGV[2], 'tok', ARGV[3], 'created', ARGV[1],
  'expires', ARGV[5], 'retain', ARGV[6], 'lease', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
return {'claimed'}
