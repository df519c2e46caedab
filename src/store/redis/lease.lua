-- burstgate token leases. Mirrors src/bucket/lease.rs operation for operation: change one,
-- change both, and the differential test will tell if they still agree to the last bit.
--
-- KEYS[1]  the bucket, as bucket.lua stores it (24 bytes, or 32 with a halt, which a lease
--          drops), or, while tokens are out on lease, 24 + 24n bytes (1 <= n <= 64):
--          struct.pack('<ddd', t, ts, keep) and then n leases, struct.pack('<ddd', holder,
--          amount, expiry) each: the holder's id, the tokens it holds, and the time its lease
--          ends (ms, on the stored times' timeline). When the last lease ends, the value goes
--          back to the 24 bytes the bucket script reads; bucket.lua refuses a value with leases.
-- ARGV[1]  104 bytes, struct.pack('<ddddddddddddd', op, now, tokens, interval, capacity, lead,
--          most_debt, holder, ret, keep, want, least, span): op 1 renew, 2 peek; the limit as
--          bucket.lua takes it; then the renewal: ret tokens given back, keep kept, want more
--          wanted but none unless least of them can be had, for a lease of span ms (a peek
--          reads none of them).
-- Returns  for a renewal, struct.pack('<ddddd', granted, kept, wait, remaining, at); for a peek,
--          which writes nothing, struct.pack('<dddddd', allowed, next, remaining, reset, at,
--          out), bucket.lua's peek with out the tokens on lease; all whole numbers.
--
-- Leases that end at or before the call's time are dropped, their tokens lost. What is out on
-- lease counts against the capacity: the bucket refills up to capacity - out, so that what it
-- holds and what is out are never more than the burst together. The key is kept until the last
-- lease ends, plus the time to refill from what the bucket holds, plus one interval.

local MAX_TIME = 9007199254740991
local MAX_TOKENS = 4294967296

local key = KEYS[1]
local op, now, tokens, interval, capacity, lead, most_debt, holder, ret, keep_asked, want, least,
  span = struct.unpack('<ddddddddddddd', ARGV[1])

if now > MAX_TIME then now = MAX_TIME end

local t, ts = capacity, now
local leases = {}
local stored = redis.call('GET', key)
if stored then
  local len = #stored
  if len == 24 or len == 32 then
    t, ts = struct.unpack('<dd', stored)
  elseif len > 32 and len <= 1560 and (len - 24) % 24 == 0 then
    t, ts = struct.unpack('<dd', stored)
    for at = 25, len, 24 do
      local h, a, e = struct.unpack('<ddd', stored, at)
      if not (h >= 0 and h <= MAX_TIME and h % 1 == 0
          and a >= 0 and a <= MAX_TOKENS and a % 1 == 0
          and e >= 0 and e <= MAX_TIME and e % 1 == 0) then
        return redis.error_reply('BURSTGATE_CORRUPT burstgate: the value at the key is not one a bucket script writes')
      end
      leases[#leases + 1] = {h, a, e}
    end
  else
    return redis.error_reply('WRONGTYPE burstgate: the value at the key is not a bucket')
  end
  if not (t >= -most_debt and t <= MAX_TOKENS
      and ts >= 0 and ts <= MAX_TIME and ts % 1 == 0) then
    return redis.error_reply('BURSTGATE_CORRUPT burstgate: the value at the key is not one a bucket script writes')
  end
end

-- A stored time far ahead is moved back, as bucket.lua moves it.
if ts > now and ts > now + lead then ts = now end
local ts2 = ts
if now > ts then ts2 = now end

local live = {}
local out = 0
local mine = nil
for _, l in ipairs(leases) do
  if l[3] > ts2 then
    live[#live + 1] = l
    out = out + l[2]
    if mine == nil and l[1] == holder then mine = #live end
  end
end
local held = 0
if mine then held = live[mine][2] end

local room = capacity - out
if not (room > 0) then room = 0 end
local elapsed = now - ts
if not (elapsed > 0) then elapsed = 0 end
local avail = t + elapsed * tokens / interval
if not (avail < room) then avail = room end

-- ts plus the least whole e >= 0 with t + refill(e) >= target (bucket.lua's).
local function ready_at(t, ts, target)
  if t >= target then return ts end
  local e = (target - t) * interval / tokens
  local whole = e - e % 1
  if whole < e then e = whole + 1 else e = whole end
  local n = 0
  while n < 8 and t + e * tokens / interval < target do e = e + 1; n = n + 1 end
  while n < 8 and e > 0 and t + (e - 1) * tokens / interval >= target do e = e - 1; n = n + 1 end
  return ts + e
end

if op == 2 then
  -- bucket.lua's peek, up to the room the leases leave: no token before the last of them
  -- ends while they leave room for none.
  local left = 0
  if avail > 0 then left = avail - avail % 1 end
  local next_in = 0
  if not (avail >= 1) then
    next_in = ready_at(t, ts, 1) - ts2
    if room < 1 then
      local others = ts2
      for _, l in ipairs(live) do
        if l[3] > others then others = l[3] end
      end
      if others - ts2 > next_in then next_in = others - ts2 end
    end
  end
  local reset = ready_at(t, ts, room) - ts2
  if not (reset > 0) then reset = 0 end
  return struct.pack('<dddddd', avail >= 1 and 1 or 0, next_in, left, reset, ts2, out)
elseif op ~= 1 then
  return redis.error_reply('burstgate: unknown operation')
end
local back = held
if ret < held then back = ret end
local kept = held - back
if keep_asked < kept then kept = keep_asked end
local t1 = avail + back
local whole_t1 = 0
if t1 > 0 then whole_t1 = t1 - t1 % 1 end
local granted = want
if whole_t1 < want then granted = whole_t1 end
local capped = mine == nil and #live >= 64
if granted < least or capped then granted = 0 end
local t2 = t1 - granted
local amount = kept + granted
local expiry = ts2 + span
if expiry > MAX_TIME then expiry = MAX_TIME end
if mine then
  if amount > 0 then
    live[mine] = {holder, amount, expiry}
  else
    table.remove(live, mine)
  end
elseif amount > 0 then
  live[#live + 1] = {holder, amount, expiry}
end

local last = ts2
local out2 = 0
for _, l in ipairs(live) do
  if l[3] > last then last = l[3] end
  out2 = out2 + l[2]
end

local keep = last + (ready_at(t2, ts2, capacity) - ts2) + interval
local wait = 0
if granted == 0 and least > 0 then
  wait = ready_at(t2, ts2, least) - ts2
  if capacity - out2 < least then
    local others = ts2
    for _, l in ipairs(live) do
      if l[1] ~= holder and l[3] > others then others = l[3] end
    end
    if others - ts2 > wait then wait = others - ts2 end
  end
  if capped then
    local first = live[1][3]
    for _, l in ipairs(live) do
      if l[3] < first then first = l[3] end
    end
    if first - ts2 > wait then wait = first - ts2 end
  end
end

local value = struct.pack('<ddd', t2, ts2, keep)
for _, l in ipairs(live) do
  value = value .. struct.pack('<ddd', l[1], l[2], l[3])
end
redis.call('SET', key, value, 'PX', string.format('%d', keep - ts2))

local left = 0
if t2 > 0 then left = t2 - t2 % 1 end
return struct.pack('<ddddd', granted, kept, wait, left, ts2)
