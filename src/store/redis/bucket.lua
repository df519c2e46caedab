-- burstgate token bucket, format v3. Mirrors src/bucket.rs operation for operation: change one,
-- change both, and the differential test will tell if they still agree to the last bit.
--
-- KEYS[1]  the bucket: one 24-byte string, struct.pack('<ddd', t, ts, keep): t = tokens at ts,
--          ts = milliseconds since the Unix epoch, keep = the time until which the key is kept
--          (its expiry, on the callers' clock), each an IEEE 754 double, little-endian; or, while
--          the bucket has a halt, 32 bytes, struct.pack('<dddd', t, ts, keep, halt): halt = the
--          time of the first token after the latest drain or block, before which no reservation
--          granted before it may go (bucket.rs's halt); a set drops it. A 24-byte value has no
--          halt
-- ARGV[1]  72 bytes, struct.pack('<ddddddddd', op, now, tokens, interval, capacity, x, max_wait,
--          lead, most_debt): op 1 acquire, 2 peek, 3 refund, 4 drain, 5 set, 6 block, 7 lower;
--          interval and max_wait in milliseconds; x is the cost for acquire and refund, the
--          deadline for drain and block, the tokens the bucket is set to for set (the caller
--          keeps them within the burst) and lowered to for lower; max_wait is read by acquire, and carries the reservation's slot (ms) for
--          refund; lead (how far a stored time may lead now, ms) and most_debt (tokens) are the
--          limit's, as bucket.rs's Params derives them, passed so that no call works them out
--          again. A reset is no operation of the script: the store deletes the key
-- Returns  one string, or an array of one. An acquire admitted with no wait returns the 24-byte
--          value it stored: the caller works out remaining and reset from it with the same
--          arithmetic, since wait is 0, which spares Redis the packing of four numbers on the
--          busiest path. An acquire denied with max_wait 0 returns {stored}, the value it read,
--          and the caller works out the denial from it. Any other call returns
--          struct.pack('<ddddd', allowed, wait, remaining, reset, at), all whole numbers (at is the
--          time the waits count from, ts2 below; for a refund, allowed says whether the tokens
--          went back, for a block or a lower whether it wrote), and a denial (one that was allowed to wait,
--          not long enough) appends the stored value, as it was read (64 or 72 bytes in all); a
--          peek appends the halt (0 for none), 48 bytes in all.
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
local MAX_TOKENS = 4294967296

local key = KEYS[1]
local op, now, tokens, interval, capacity, x, max_wait, lead, most_debt =
  struct.unpack('<ddddddddd', ARGV[1])

if now > MAX_TIME then now = MAX_TIME end

-- A missing bucket is a full one, with no halt.
local t, ts, keep, halt = capacity, now, 0, 0
local stored = redis.call('GET', key)
if stored then
  if #stored == 24 then
    t, ts, keep = struct.unpack('<ddd', stored)
  elseif #stored == 32 then
    t, ts, keep, halt = struct.unpack('<dddd', stored)
    -- Checked here, where there is one, so that the common value pays nothing for it.
    if not (halt >= 0 and halt <= MAX_TIME and halt % 1 == 0) then
      return redis.error_reply('BURSTGATE_CORRUPT burstgate: the value at the key is not one a bucket script writes')
    end
    -- A halt further behind than the lead bound (from ts2, the later of now and ts) can stop no
    -- reservation still waiting: forgotten, and the next write goes back to 24 bytes. (A ts
    -- moved back below drops the halt anyway.)
    if not (halt + lead > (now > ts and now or ts)) then halt = 0 end
  elseif #stored > 32 and (#stored - 24) % 24 == 0 then
    -- lease.lua's value, with tokens out on lease: decided by that script alone.
    return redis.error_reply('BURSTGATE_LEASED burstgate: tokens of the bucket are out on lease')
  else
    return redis.error_reply('WRONGTYPE burstgate: the value at the key is not a bucket')
  end
  -- Only a value a script could have written is decided on (bucket.rs's sound and sound_halt):
  -- finite, at most the largest burst, no more debt than reservations and drains leave, whole
  -- times in range. Any other, written by someone else, could make the walks below run on and
  -- hang Redis. keep needs no check: a write trusts it only within an interval of what it
  -- needs, which no NaN, negative or far value is, and otherwise sets it again.
  if not (t >= -most_debt and t <= MAX_TOKENS
      and ts >= 0 and ts <= MAX_TIME and ts % 1 == 0) then
    return redis.error_reply('BURSTGATE_CORRUPT burstgate: the value at the key is not one a bucket script writes')
  end
  -- A stored time that leads now by more than lead (the refill time, rounded up, plus one
  -- interval) is moved back to now: no write leads its writer's clock by that much, so this is
  -- a clock that stepped back here, or a writer whose clock ran far ahead. A sound ts is at most
  -- MAX_TIME, so a lead_max beyond it moves nothing.
  local lead_max = now + lead
  -- Stored at once by every operation but peek, even a denial, so that the refill runs from the
  -- moved time: a bound that moved with each caller's clock would never let it start. Kept until
  -- full by the first estimate, as a plain admission keeps it. The halt was set on the clock that
  -- ran ahead, and goes with it.
  if ts > lead_max then
    ts = now
    halt = 0
    if op ~= 2 then
      local e = (capacity - t) * interval / tokens
      local whole = e - e % 1
      if whole < e then e = whole + 1 end
      if e < 0 then e = 0 end
      keep = ts + e + interval + interval
      stored = struct.pack('<ddd', t, ts, keep)
      redis.call('SET', key, stored, 'PX', string.format('%d', keep - ts))
    end
  end
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
  -- The stored keep is trusted only up to one interval beyond what this write needs: a keep
  -- further out was set on another clock (a host far ahead, a clock stepped back), and the
  -- expiry is set again, from this write's time.
  local need = ts2 + e + interval
  if need <= keep and keep <= need + interval then
    local stored2 = halt == 0 and struct.pack('<ddd', t2, ts2, keep)
      or struct.pack('<dddd', t2, ts2, keep, halt)
    redis.call('SET', key, stored2, 'KEEPTTL')
    return stored2
  end
  local stored2 = halt == 0 and struct.pack('<ddd', t2, ts2, need + interval)
    or struct.pack('<dddd', t2, ts2, need + interval, halt)
  redis.call('SET', key, stored2, 'PX', string.format('%d', need + interval - ts2))
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
  -- Both walks together take at most 8 steps, as bucket.rs's (WALK).
  local n = 0
  while n < 8 and t + e * tokens / interval < target do e = e + 1; n = n + 1 end
  while n < 8 and e > 0 and t + (e - 1) * tokens / interval >= target do e = e - 1; n = n + 1 end
  return ts + e
end

-- Every other path: the admission after a wait, the denial, peek, refund, drain, set, block and
-- lower. Those that write set t2 and wait, and fall through to the write at the end, made at ts2. Waits
-- count from ts2, the later of now and the stored time.
local t2, wait
if op == 1 then
  if max_wait > MAX_WAIT then max_wait = MAX_WAIT end
  -- Not enough now: the tokens are due at ready.
  local ready = ready_at(t, ts, x)
  -- Served at a whole millisecond: what the bucket would hold above capacity then is lost.
  local over = t + (ready - ts) * tokens / interval - capacity
  if not (over > 0) then over = 0 end
  wait = ready - ts2
  if not (wait <= max_wait) then
    -- The stored value goes back with a denial, for the caller's deny cache. A denial always
    -- has one: a missing bucket is full, and a cost never exceeds the capacity.
    local left = 0
    if avail > 0 then left = avail - avail % 1 end
    return struct.pack('<ddddd', 0, wait, left, ready_at(t, ts, capacity) - ts2, ts2) .. stored
  end
  t2 = avail - x - over
elseif op == 2 then
  local left = 0
  if avail > 0 then left = avail - avail % 1 end
  -- A token available now is available now. Otherwise it is due after ts2.
  local next_in = 0
  if not (avail >= 1) then next_in = ready_at(t, ts, 1) - ts2 end
  local reset = ready_at(t, ts, capacity) - ts2
  if not (reset > 0) then reset = 0 end
  return struct.pack('<dddddd', avail >= 1 and 1 or 0, next_in, left, reset, ts2, halt)
elseif op == 3 then
  -- max_wait is the reservation's slot. One still ahead goes back only while it is the last
  -- queued (what the bucket holds then is about 0: within half a token of it, and half a token
  -- short of the cost), and only under a limit that refills at most a quarter token a
  -- millisecond; one already due only while the bucket is in no debt; otherwise nothing is
  -- written (bucket.rs's refund).
  if max_wait > MAX_TIME then max_wait = MAX_TIME end
  local applies
  if max_wait > ts2 then
    local held = t + (max_wait - ts) * tokens / interval
    applies = tokens / interval <= 0.25 and held > -0.5 and held < x - 0.5
  else
    applies = avail >= 0
  end
  if not applies then
    local left = 0
    if avail > 0 then left = avail - avail % 1 end
    local reset = ready_at(t, ts, capacity) - ts2
    if not (reset > 0) then reset = 0 end
    return struct.pack('<ddddd', 0, 0, left, reset, ts2)
  end
  -- t2 = min(capacity, avail + x)
  t2 = avail + x
  if not (t2 < capacity) then t2 = capacity end
  wait = 0
elseif op == 4 then
  -- Debt that refills to zero at the deadline x (at most MAX_WAIT ahead), unless the bucket owes
  -- more already: t2 = min(avail, floor).
  if x > MAX_TIME then x = MAX_TIME end
  if x > ts2 + MAX_WAIT then x = ts2 + MAX_WAIT end
  local floor = 0
  if x > ts2 then floor = -((x - ts2) * tokens / interval) end
  t2 = avail
  if floor < avail then t2 = floor end
  -- The halt: the first token after the drain, from the debt it leaves on an empty queue (at
  -- most the latest time), unless a later one is kept already.
  local first = ready_at(floor, ts2, 1)
  if first > MAX_TIME then first = MAX_TIME end
  if first > halt then halt = first end
  wait = 0
elseif op == 5 then
  -- Exactly x tokens from ts2 on: the debt of queued reservations and the halt are forgotten
  -- (bucket.rs's set).
  t2 = x
  halt = 0
  wait = 0
elseif op == 6 then
  -- No token before the deadline x (at most MAX_WAIT ahead), the first at it: the level is one
  -- token less the midpoint of the refills to x and to 1 ms before it, unless the bucket owes
  -- more already (bucket.rs's block_until). A deadline not ahead writes nothing.
  local deadline = x
  if deadline > MAX_TIME then deadline = MAX_TIME end
  if deadline > ts2 + MAX_WAIT then deadline = ts2 + MAX_WAIT end
  if not (deadline > ts2) then
    local whole_left = 0
    if avail > 0 then whole_left = avail - avail % 1 end
    local to_full = ready_at(t, ts, capacity) - ts2
    if not (to_full > 0) then to_full = 0 end
    return struct.pack('<ddddd', 0, 0, whole_left, to_full, ts2)
  end
  local span = deadline - ts2
  local level = 1 - (span * tokens / interval + (span - 1) * tokens / interval) / 2
  t2 = avail
  if level < avail then t2 = level end
  -- The halt: the deadline, which is the first token after the block on an empty queue, unless
  -- a later one is kept already.
  if deadline > halt then halt = deadline end
  wait = 0
elseif op == 7 then
  -- Down to x whole tokens from ts2 on when the bucket holds more whole tokens, its fraction of
  -- the next one kept, and the halt; a bucket holding x whole tokens or fewer (one in debt) is
  -- never raised, and nothing is written (bucket.rs's lower).
  if not (x + 1 <= avail) then
    local held = 0
    if avail > 0 then held = avail - avail % 1 end
    local until_full = ready_at(t, ts, capacity) - ts2
    if not (until_full > 0) then until_full = 0 end
    return struct.pack('<ddddd', 0, 0, held, until_full, ts2)
  end
  t2 = x + avail % 1
  wait = 0
else
  return redis.error_reply('burstgate: unknown operation')
end

local full = ready_at(t2, ts2, capacity)
local need = full + interval
if need <= keep and keep <= need + interval then
  local stored2 = halt == 0 and struct.pack('<ddd', t2, ts2, keep)
    or struct.pack('<dddd', t2, ts2, keep, halt)
  redis.call('SET', key, stored2, 'KEEPTTL')
else
  keep = need + interval
  local stored2 = halt == 0 and struct.pack('<ddd', t2, ts2, keep)
    or struct.pack('<dddd', t2, ts2, keep, halt)
  redis.call('SET', key, stored2, 'PX', string.format('%d', keep - ts2))
end
local left = 0
if t2 > 0 then left = t2 - t2 % 1 end
return struct.pack('<ddddd', 1, wait, left, full - ts2, ts2)
