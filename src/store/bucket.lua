-- burstgate token bucket, format v3. Mirrors src/bucket.rs operation for operation: change one,
-- change both, and the differential test will tell if they still agree to the last bit.
--
-- KEYS[1]  the bucket: one 24-byte string, struct.pack('<ddd', t, ts, keep): t = tokens at ts,
--          ts = milliseconds since the Unix epoch, keep = the time until which the key is kept
--          (its expiry, on the callers' clock), each an IEEE 754 double, little-endian
-- ARGV[1]  56 bytes, struct.pack('<ddddddd', op, now, tokens, interval, capacity, x, max_wait):
--          op 1 acquire, 2 peek, 3 refund, 4 drain; interval and max_wait in milliseconds; x is
--          the cost for acquire and refund, the deadline for drain; max_wait is read by acquire
-- Returns  one string, or an array of one. An acquire admitted with no wait returns the 24-byte
--          value it stored: the caller works out remaining and reset from it with the same
--          arithmetic, since wait is 0, which spares Redis the packing of four numbers on the
--          busiest path. An acquire denied with max_wait 0 returns {stored}, the value it read,
--          and the caller works out the denial from it. Any other call returns
--          struct.pack('<dddd', allowed, wait, remaining, reset), all whole numbers, and a
--          denial (one that was allowed to wait, not long enough) appends the stored value, as
--          it was read (56 bytes in all).
--
-- Numbers cross the boundary as their own 8 bytes, both ways, so they round-trip exactly, with
-- no decimal formatting or parsing (Lua's tostring would keep only 14 digits, and Redis
-- truncates a returned Lua number to an integer). All times are whole milliseconds at most
-- 2^53 - 1, exact in a double.
--
-- Written for Redis's CPU time: one GET, then on a write one SET, and nothing else. A write keeps
-- the key at least until the bucket is full plus one interval. When the stored keep already
-- covers that, the SET keeps the key's expiry (KEEPTTL), which spares Redis the update of its
-- expiry table and the script the formatting of a number; otherwise it sets keep one interval
-- further than needed (PX), so that the writes of the next interval keep it. Measured
-- with callgrind on redis-server, one packed argument instead of seven decimal ones saves a
-- strtod per number and the growth of the ARGV table, and one string reply instead of an array
-- saves Redis converting a Lua table. The script body runs as a new function on every call, so
-- each local function is a new closure each time: bucket.rs's min, max and refill are written
-- out in place, with their exact rules (min(a, b) is b only when b < a, max(a, b) is b only when
-- b > a, refill(e) is e * tokens / interval, multiplied first), the plain admit comes before
-- ready_at is made, and every write shares one tail instead of a function. Whole parts are
-- x - x % 1, the floor of x, exact for any double (Lua's % is x - floor(x / 1) * 1), with no
-- call into the math library.

local MAX_TIME = 9007199254740991
local MAX_WAIT = 17592186044416

local key = KEYS[1]
local op, now, tokens, interval, capacity, x, max_wait = struct.unpack('<ddddddd', ARGV[1])

if now > MAX_TIME then now = MAX_TIME end

-- A missing bucket is a full one.
local t, ts, keep = capacity, now, 0
local stored = redis.call('GET', key)
if stored then
  if #stored ~= 24 then
    return redis.error_reply('WRONGTYPE burstgate: the value at the key is not a bucket')
  end
  t, ts, keep = struct.unpack('<ddd', stored)
end

-- elapsed = max(0, now - ts); avail = min(capacity, t + refill(elapsed)); ts2 = max(ts, now)
local elapsed = now - ts
if not (elapsed > 0) then elapsed = 0 end
local avail = t + elapsed * tokens / interval
if not (avail < capacity) then avail = capacity end
local ts2 = ts
if now > ts then ts2 = now end

-- The plain admit, the common path, comes first and is written out in full: the functions
-- below are new closures on every call, which this path does not pay for.
if op == 1 and avail >= x then
  local t2 = avail - x
  -- Kept until full, plus one interval. Only the expiry needs the refill time here, so the
  -- first estimate does, without ready_at's walk to the exact millisecond: it is at most 1 ms
  -- off either way, and the interval of margin covers 1 ms short. '%d': a bare Lua number may
  -- reach Redis in exponent form, which PX refuses.
  local e = (capacity - t2) * interval / tokens
  local whole = e - e % 1
  if whole < e then e = whole + 1 end
  local need = ts2 + e + interval
  if need <= keep then
    local stored2 = struct.pack('<ddd', t2, ts2, keep)
    redis.call('SET', key, stored2, 'KEEPTTL')
    return stored2
  end
  local stored2 = struct.pack('<ddd', t2, ts2, need + interval)
  redis.call('SET', key, stored2, 'PX', string.format('%d', need + interval - now))
  return stored2
end

-- An acquire that may not wait and cannot go now is denied (its wait is at least 1 ms), and
-- writes nothing. The stored value alone goes back, as a one-element array, and the caller
-- works out the denial from it with the same arithmetic: that spares Redis both walks to a
-- refill time and the packing of the answer. The bucket exists: a missing one is full, and
-- a cost never exceeds the capacity.
if op == 1 and max_wait == 0 then return {stored} end

-- ts plus the least whole e >= 0 with t + refill(e) >= target.
local function ready_at(t, ts, target)
  if t >= target then return ts end
  local e = (target - t) * interval / tokens
  local whole = e - e % 1
  if whole < e then e = whole + 1 else e = whole end
  while t + e * tokens / interval < target do e = e + 1 end
  while e > 0 and t + (e - 1) * tokens / interval >= target do e = e - 1 end
  return ts + e
end

-- Every other path: the admission after a wait, the denial, peek, refund and drain. Those that
-- write set t2, ts3 and wait, and fall through to the write at the end.
local t2, ts3, wait
if op == 1 then
  if max_wait > MAX_WAIT then max_wait = MAX_WAIT end
  -- Not enough now: the tokens are due at ready.
  local ready = ready_at(t, ts, x)
  -- Served at a whole millisecond: what the bucket would hold above capacity then is lost.
  local over = t + (ready - ts) * tokens / interval - capacity
  if not (over > 0) then over = 0 end
  wait = ready - now
  if not (wait <= max_wait) then
    -- The stored value goes back with a denial, for the caller's deny cache. A denial always
    -- has one: a missing bucket is full, and a cost never exceeds the capacity.
    local left = 0
    if avail > 0 then left = avail - avail % 1 end
    return struct.pack('<dddd', 0, wait, left, ready_at(t, ts, capacity) - now) .. stored
  end
  t2, ts3 = avail - x - over, ts2
elseif op == 2 then
  local left = 0
  if avail > 0 then left = avail - avail % 1 end
  -- A token available now is available now, even when the clock is behind the stored time.
  -- Otherwise the token is due after now, whichever of now and ts is later.
  local next_in = 0
  if not (avail >= 1) then next_in = ready_at(t, ts, 1) - now end
  local reset = ready_at(t, ts, capacity) - now
  if not (reset > 0) then reset = 0 end
  return struct.pack('<dddd', avail >= 1 and 1 or 0, next_in, left, reset)
elseif op == 3 then
  -- t2 = min(capacity, avail + x)
  t2 = avail + x
  if not (t2 < capacity) then t2 = capacity end
  ts3, wait = ts2, 0
elseif op == 4 then
  if x > MAX_TIME then x = MAX_TIME end
  -- t2 = min(avail, 0); ts3 = max(ts2, x)
  t2 = avail
  if avail > 0 then t2 = 0 end
  ts3 = ts2
  if x > ts2 then ts3 = x end
  wait = 0
else
  return redis.error_reply('burstgate: unknown operation')
end

local full = ready_at(t2, ts3, capacity)
local need = full + interval
if need <= keep then
  redis.call('SET', key, struct.pack('<ddd', t2, ts3, keep), 'KEEPTTL')
else
  keep = need + interval
  redis.call('SET', key, struct.pack('<ddd', t2, ts3, keep), 'PX', string.format('%d', keep - now))
end
local left = 0
if t2 > 0 then left = t2 - t2 % 1 end
return struct.pack('<dddd', 1, wait, left, full - now)
