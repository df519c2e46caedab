-- burstgate token bucket, format v2. Mirrors src/bucket.rs operation for operation: change one,
-- change both, and the differential test will tell if they still agree to the last bit.
--
-- KEYS[1]  the bucket: one 16-byte string, struct.pack('<dd', t, ts): t = tokens at ts, then
--          ts = milliseconds since the Unix epoch, each an IEEE 754 double, little-endian
-- ARGV[1]  56 bytes, struct.pack('<ddddddd', op, now, tokens, interval, capacity, x, max_wait):
--          op 1 acquire, 2 peek, 3 refund, 4 drain; interval and max_wait in milliseconds; x is
--          the cost for acquire and refund, the deadline for drain; max_wait is read by acquire
-- Returns  one string, struct.pack('<dddd', allowed, wait, remaining, reset), all whole
--          numbers; a denial appends the stored value, as it was read (48 bytes in all).
--
-- Numbers cross the boundary as their own 8 bytes, both ways, so they round-trip exactly, with
-- no decimal formatting or parsing (Lua's tostring would keep only 14 digits, and Redis
-- truncates a returned Lua number to an integer). All times are whole milliseconds at most
-- 2^53 - 1, exact in a double.
--
-- Written for Redis's CPU time: one GET, then on a write one SET with PX, and nothing else. Measured
-- with callgrind on redis-server, one packed argument instead of seven decimal ones saves a
-- strtod per number and the growth of the ARGV table, and one string reply instead of an array
-- saves Redis converting a Lua table. The script body runs as a new function on every call, so
-- each local function is a new closure each time: bucket.rs's min, max and refill are written
-- out in place, with their exact rules (min(a, b) is b only when b < a, max(a, b) is b only when
-- b > a, refill(e) is e * tokens / interval, multiplied first), and only ready_at stays a
-- function, for the paths that are not a plain admit.

local MAX_TIME = 9007199254740991
local MAX_WAIT = 17592186044416

local key = KEYS[1]
local op, now, tokens, interval, capacity, x, max_wait = struct.unpack('<ddddddd', ARGV[1])

-- ts plus the least whole e >= 0 with t + refill(e) >= target.
local function ready_at(t, ts, target)
  if t >= target then return ts end
  local e = math.ceil((target - t) * interval / tokens)
  while t + e * tokens / interval < target do e = e + 1 end
  while e > 0 and t + (e - 1) * tokens / interval >= target do e = e - 1 end
  return ts + e
end

if now > MAX_TIME then now = MAX_TIME end

-- A missing bucket is a full one.
local t, ts = capacity, now
local stored = redis.call('GET', key)
if stored then
  if #stored ~= 16 then
    return redis.error_reply('WRONGTYPE burstgate: the value at the key is not a bucket')
  end
  t, ts = struct.unpack('<dd', stored)
end

-- elapsed = max(0, now - ts); avail = min(capacity, t + refill(elapsed)); ts2 = max(ts, now)
local elapsed = now - ts
if not (elapsed > 0) then elapsed = 0 end
local avail = t + elapsed * tokens / interval
if not (avail < capacity) then avail = capacity end
local ts2 = ts
if now > ts then ts2 = now end

if op == 1 then
  if max_wait > MAX_WAIT then max_wait = MAX_WAIT end
  local wait = 0
  local over = 0
  if not (avail >= x) then
    local ready = ready_at(t, ts, x)
    -- Served at a whole millisecond: what the bucket would hold above capacity then is lost.
    over = t + (ready - ts) * tokens / interval - capacity
    if not (over > 0) then over = 0 end
    wait = ready - now
  end
  if wait <= max_wait then
    local t2 = avail - x - over
    -- full = ready_at(t2, ts2, capacity), in place: the one call on the common path.
    local full = ts2
    if not (t2 >= capacity) then
      local e = math.ceil((capacity - t2) * interval / tokens)
      while t2 + e * tokens / interval < capacity do e = e + 1 end
      while e > 0 and t2 + (e - 1) * tokens / interval >= capacity do e = e - 1 end
      full = ts2 + e
    end
    -- Kept until full, plus one interval. '%d': a bare Lua number may reach Redis in exponent
    -- form, which PX refuses.
    redis.call('SET', key, struct.pack('<dd', t2, ts2), 'PX',
      string.format('%d', full - now + interval))
    local left = 0
    if t2 > 0 then left = math.floor(t2) end
    return struct.pack('<dddd', 1, wait, left, full - now)
  end
  -- The stored value goes back with a denial, for the caller's deny cache. A denial always has
  -- one: a missing bucket is full, and a cost never exceeds the capacity.
  local left = 0
  if avail > 0 then left = math.floor(avail) end
  return struct.pack('<dddd', 0, wait, left, ready_at(t, ts, capacity) - now) .. stored
elseif op == 2 then
  local left = 0
  if avail > 0 then left = math.floor(avail) end
  -- A token available now is available now, even when the clock is behind the stored time.
  -- Otherwise the token is due after now, whichever of now and ts is later.
  local next_in = 0
  if not (avail >= 1) then next_in = ready_at(t, ts, 1) - now end
  local reset = ready_at(t, ts, capacity) - now
  if not (reset > 0) then reset = 0 end
  return struct.pack('<dddd', avail >= 1 and 1 or 0, next_in, left, reset)
elseif op == 3 or op == 4 then
  local t2, ts3
  if op == 3 then
    -- t2 = min(capacity, avail + x)
    t2 = avail + x
    if not (t2 < capacity) then t2 = capacity end
    ts3 = ts2
  else
    if x > MAX_TIME then x = MAX_TIME end
    -- t2 = min(avail, 0); ts3 = max(ts2, x)
    t2 = avail
    if avail > 0 then t2 = 0 end
    ts3 = ts2
    if x > ts2 then ts3 = x end
  end
  local full = ready_at(t2, ts3, capacity)
  redis.call('SET', key, struct.pack('<dd', t2, ts3), 'PX',
    string.format('%d', full - now + interval))
  local left = 0
  if t2 > 0 then left = math.floor(t2) end
  return struct.pack('<dddd', 1, 0, left, full - now)
end
return redis.error_reply('burstgate: unknown operation')
