-- burstgate token bucket, format v1. Mirrors src/bucket.rs operation for operation: change one,
-- change both, and the differential test will tell if they still agree to the last bit.
--
-- KEYS[1]  the bucket: a hash {t = tokens at ts, ts = milliseconds since the Unix epoch}
-- ARGV     op (1 acquire, 2 peek, 3 refund, 4 drain), now, tokens, interval (ms), capacity,
--          x (cost for acquire and refund, until for drain), max_wait (ms, acquire only)
-- Returns  {allowed, wait, remaining, reset}, whole numbers (Redis truncates Lua numbers).
--
-- Floats are stored with '%.17g', which round-trips a double exactly; Lua's own tostring keeps
-- only 14 digits. All times are whole milliseconds at most 2^53 - 1, exact in a double.

local MAX_TIME = 9007199254740991
local MAX_WAIT = 17592186044416

local key = KEYS[1]
local op = ARGV[1]
local now = tonumber(ARGV[2])
local tokens = tonumber(ARGV[3])
local interval = tonumber(ARGV[4])
local capacity = tonumber(ARGV[5])
local x = tonumber(ARGV[6])

-- On a tie the first argument wins, as in Lua's math.min/math.max and bucket.rs.
local function min(a, b)
  if b < a then return b end
  return a
end

local function max(a, b)
  if b > a then return b end
  return a
end

local function refill(e)
  return e * tokens / interval
end

-- ts plus the least whole e >= 0 with t + refill(e) >= target.
local function ready_at(t, ts, target)
  if t >= target then return ts end
  local e = math.ceil((target - t) * interval / tokens)
  while t + refill(e) < target do e = e + 1 end
  while e > 0 and t + refill(e - 1) >= target do e = e - 1 end
  return ts + e
end

if now > MAX_TIME then now = MAX_TIME end

local t, ts
local stored = redis.call('HMGET', key, 't', 'ts')
if stored[1] then
  t = tonumber(stored[1])
  ts = tonumber(stored[2])
else
  t = capacity
  ts = now
end

local elapsed = max(0, now - ts)
local avail = min(capacity, t + refill(elapsed))
local ts2 = max(ts, now)

-- Stores the new state with a TTL of "until full, plus one interval"; returns when it is full.
local function write(t2, ts3)
  local full = ready_at(t2, ts3, capacity)
  redis.call('HSET', key, 't', string.format('%.17g', t2), 'ts', string.format('%.17g', ts3))
  -- '%d': a bare Lua number may reach Redis in exponent form, which PEXPIRE refuses.
  redis.call('PEXPIRE', key, string.format('%d', full - now + interval))
  return full
end

if op == '1' then
  local max_wait = tonumber(ARGV[7])
  if max_wait > MAX_WAIT then max_wait = MAX_WAIT end
  local wait = 0
  local over = 0
  if not (avail >= x) then
    local ready = ready_at(t, ts, x)
    -- Served at a whole millisecond: what the bucket would hold above capacity then is lost.
    over = max(0, t + refill(ready - ts) - capacity)
    wait = ready - now
  end
  if wait <= max_wait then
    local t2 = avail - x - over
    local full = write(t2, ts2)
    return {1, wait, math.floor(max(0, t2)), full - now}
  end
  return {0, wait, math.floor(max(0, avail)), ready_at(t, ts, capacity) - now}
elseif op == '2' then
  return {avail >= 1 and 1 or 0, max(0, ready_at(t, ts, 1) - now), math.floor(max(0, avail)),
    max(0, ready_at(t, ts, capacity) - now)}
elseif op == '3' then
  local t2 = min(capacity, avail + x)
  local full = write(t2, ts2)
  return {1, 0, math.floor(max(0, t2)), full - now}
elseif op == '4' then
  if x > MAX_TIME then x = MAX_TIME end
  local t2 = min(avail, 0)
  local full = write(t2, max(ts2, x))
  return {1, 0, math.floor(max(0, t2)), full - now}
end
return redis.error_reply('burstgate: unknown operation')
