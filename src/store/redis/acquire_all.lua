-- burstgate: one request on several buckets at once, all or none, format v3 values. Mirrors
-- bucket.rs's evaluate_all operation for operation, and reads and writes each bucket as
-- bucket.lua does (see its header for the stored value): change one, change both, and the
-- differential test will tell if they still agree to the last bit.
--
-- KEYS     the buckets, 1 to 16 of them, all distinct (the store checks; on a Redis Cluster
--          they must share a hash slot), then the audit streams of the audited ones, if any
-- ARGV[1]  struct.pack('<dd', now, max_wait) followed, for each bucket in order, by
--          struct.pack('<dddddd', tokens, interval, capacity, cost, lead, most_debt): the
--          limit, the request's cost there, and the limit's lead bound and most debt, as in
--          bucket.lua. Its length says how many of the keys are buckets
-- ARGV[2]  with audit streams only: for each stream in order, struct.pack('<ddd', bucket,
--          cap, retain) followed by the bucket key's fingerprint (12 bytes): the stream's
--          bucket by its place among the buckets, from 1, the entries it keeps and how long it
--          is kept after the last (ms)
-- ARGV[3..] with audit streams only: each stream's process label, in order
-- Errors   name the key by its place in KEYS, from 1: 'WRONGTYPE burstgate: the value at key 2
--          ...', 'BURSTGATE_CORRUPT burstgate: the value at key 2 ...' and, for a bucket with
--          tokens out on lease (lease.lua's value), 'BURSTGATE_LEASED burstgate: ... at key 2 ...'
-- Returns  one string: for each key in order, struct.pack('<ddddddd', allowed, wait, remaining,
--          reset, at, t, ts), the first five whole numbers. allowed is the same for every key.
--          Admitted, wait is the request's (the largest of the keys' own waits), every key was
--          written, and t, ts are what it holds now; denied, wait is the key's own, nothing was
--          written but a stored time far ahead moved back, as bucket.lua moves it, and t, ts are
--          what the key holds (after that move), with ts -1 for a key that holds nothing. The
--          store's deny cache keeps them, to refuse the same request again without a call.
--
-- Each key is read once (GET) and, if it changes, written once (SET) or twice (a stored time
-- moved back, and then the admission). Every admission writes by bucket.lua's common tail: the
-- key is kept until the bucket is full plus one interval, with KEEPTTL when the stored keep
-- covers that by no more than one interval, and otherwise one interval further, with PX.

local MAX_TIME = 9007199254740991
local MAX_WAIT = 17592186044416
local MAX_TOKENS = 4294967296

local n = (#ARGV[1] - 16) / 48
local audits = #KEYS - n
if not (n >= 1 and n % 1 == 0 and audits >= 0 and audits <= n
    and #ARGV == (audits > 0 and 2 + audits or 1)
    and (audits == 0 or #ARGV[2] == 36 * audits)) then
  return redis.error_reply('burstgate: the arguments do not match the keys')
end
local now, max_wait = struct.unpack('<dd', ARGV[1])
if now > MAX_TIME then now = MAX_TIME end
if max_wait > MAX_WAIT then max_wait = MAX_WAIT end

-- ts plus the least whole e >= 0 with t + refill(e) >= target, as in bucket.lua.
local function ready_at(t, ts, target, tokens, interval)
  if t >= target then return ts end
  local e = (target - t) * interval / tokens
  local whole = e - e % 1
  if whole < e then e = whole + 1 else e = whole end
  local n = 0
  while n < 8 and t + e * tokens / interval < target do e = e + 1; n = n + 1 end
  while n < 8 and e > 0 and t + (e - 1) * tokens / interval >= target do e = e - 1; n = n + 1 end
  return ts + e
end

-- Every bucket read and checked before any is written: a value someone else wrote refuses the
-- whole request, with nothing changed.
local b = {}
for i = 1, n do
  local tokens, interval, capacity, cost, lead, most_debt =
    struct.unpack('<dddddd', ARGV[1], 17 + 48 * (i - 1))
  local t, ts, keep, halt = capacity, now, 0, 0
  -- pcall, so that a key of another type is named by its place, as the store reports it; any
  -- other error (an ACL's NOPERM, say) is Redis's own, and goes back as it is.
  local stored = redis.pcall('GET', KEYS[i])
  if type(stored) == 'table' and stored.err then
    if string.sub(stored.err, 1, 9) == 'WRONGTYPE' then
      return redis.error_reply('WRONGTYPE burstgate: the value at key ' .. i .. ' is not a bucket')
    end
    return stored
  end
  local moved = false
  if stored then
    if #stored == 24 then
      t, ts, keep = struct.unpack('<ddd', stored)
    elseif #stored == 32 then
      t, ts, keep, halt = struct.unpack('<dddd', stored)
      if not (halt >= 0 and halt <= MAX_TIME and halt % 1 == 0) then
        return redis.error_reply('BURSTGATE_CORRUPT burstgate: the value at key ' .. i .. ' is not one a bucket script writes')
      end
      if not (halt + lead > (now > ts and now or ts)) then halt = 0 end
    elseif #stored > 32 and (#stored - 24) % 24 == 0 then
      return redis.error_reply('BURSTGATE_LEASED burstgate: tokens of the bucket at key ' .. i .. ' are out on lease')
    else
      return redis.error_reply('WRONGTYPE burstgate: the value at key ' .. i .. ' is not a bucket')
    end
    if not (t >= -most_debt and t <= MAX_TOKENS
        and ts >= 0 and ts <= MAX_TIME and ts % 1 == 0) then
      return redis.error_reply('BURSTGATE_CORRUPT burstgate: the value at key ' .. i .. ' is not one a bucket script writes')
    end
    if ts > now + lead then
      ts = now
      halt = 0
      moved = true
    end
  end
  -- elapsed = max(0, now - ts); avail = min(capacity, t + refill(elapsed)); ts2 = max(ts, now)
  local elapsed = now - ts
  if not (elapsed > 0) then elapsed = 0 end
  local avail = t + elapsed * tokens / interval
  if not (avail < capacity) then avail = capacity end
  local ts2 = ts
  if now > ts then ts2 = now end
  local wait = 0
  if not (avail >= cost) then wait = ready_at(t, ts, cost, tokens, interval) - ts2 end
  b[i] = {tokens = tokens, interval = interval, capacity = capacity, cost = cost, t = t,
    ts = ts, keep = keep, halt = halt, moved = moved, avail = avail, ts2 = ts2, wait = wait,
    held = stored and ts or -1}
end

-- Every audit record checked, and an audit stream someone else wrote refusing the request,
-- before anything is written, as a bucket would: an append failing after the decision was
-- written would report an error for tokens already taken.
for j = 1, audits do
  local i, cap, retain = struct.unpack('<ddd', ARGV[2], 1 + 36 * (j - 1))
  if not (i >= 1 and i <= n and i % 1 == 0 and cap >= 1 and cap % 1 == 0
      and retain >= 1 and retain <= MAX_TIME and retain % 1 == 0) then
    return redis.error_reply('burstgate: the arguments do not match the keys')
  end
  local kind = redis.call('TYPE', KEYS[n + j])['ok']
  if kind ~= 'stream' and kind ~= 'none' then
    return redis.error_reply('BURSTGATE_AUDIT burstgate: the audit stream of the bucket at key ' .. string.format('%d', i) .. ' is not a stream')
  end
end

-- A stored time moved back is stored at once, even on a denial, kept by the first estimate of
-- the refill time, with no halt (bucket.lua's own move).
for i = 1, n do
  local k = b[i]
  if k.moved then
    local e = (k.capacity - k.t) * k.interval / k.tokens
    local whole = e - e % 1
    if whole < e then e = whole + 1 end
    if e < 0 then e = 0 end
    k.keep = k.ts + e + k.interval + k.interval
    redis.call('SET', KEYS[i], struct.pack('<ddd', k.t, k.ts, k.keep), 'PX',
      string.format('%d', k.keep - k.ts))
  end
end

-- The request's wait: the largest, the first of equal ones standing.
local request_wait = 0
for i = 1, n do
  if b[i].wait > request_wait then request_wait = b[i].wait end
end

-- Appends each audited bucket's decision to its stream, in the same call as the decision, so
-- the trail holds exactly what was decided: refused, or admitted now or after a wait, with the
-- wait and the tokens left (lefts), kept to its cap and expiring retain after the last entry.
local function audit(allowed, lefts)
  for j = 1, audits do
    local at = 1 + 36 * (j - 1)
    local i, cap, retain = struct.unpack('<ddd', ARGV[2], at)
    local k = b[i]
    local outcome, wait = 'refused', k.wait
    if allowed then
      wait = request_wait
      outcome = wait > 0 and 'waited' or 'admitted'
    end
    local stream = KEYS[n + j]
    redis.call('XADD', stream, 'MAXLEN', string.format('%d', cap), '*',
      't', string.format('%d', now), 'o', outcome, 'c', string.format('%d', k.cost),
      'w', string.format('%d', wait), 'r', string.format('%d', lefts[i]),
      'k', string.sub(ARGV[2], at + 24, at + 35), 'p', ARGV[2 + j])
    redis.call('PEXPIRE', stream, string.format('%d', retain))
  end
end

local reply = {}
local lefts = {}
if not (request_wait <= max_wait) then
  for i = 1, n do
    local k = b[i]
    local left = 0
    if k.avail > 0 then left = k.avail - k.avail % 1 end
    -- A bucket that had the tokens may be full, and full since before ts2.
    local reset = ready_at(k.t, k.ts, k.capacity, k.tokens, k.interval) - k.ts2
    if not (reset > 0) then reset = 0 end
    reply[i] = struct.pack('<ddddddd', 0, k.wait, left, reset, k.ts2, k.t, k.held)
    lefts[i] = left
  end
  if audits > 0 then audit(false, lefts) end
  return table.concat(reply)
end

for i = 1, n do
  local k = b[i]
  local tokens, interval, capacity = k.tokens, k.interval, k.capacity
  -- Debited as at the request's slot: a bucket whose own wait is the request's exactly as
  -- bucket.lua debits a reservation; any other loses what it would hold above capacity by then.
  local over = 0
  if request_wait == 0 then
    over = 0
  elseif k.wait == request_wait then
    over = k.t + (k.ts2 + k.wait - k.ts) * tokens / interval - capacity
  else
    over = k.avail + request_wait * tokens / interval - capacity
  end
  if not (over > 0) then over = 0 end
  local t2 = k.avail - k.cost - over
  local ts2 = k.ts2
  local full = ready_at(t2, ts2, capacity, tokens, interval)
  local need = full + interval
  local keep = k.keep
  local kept = need <= keep and keep <= need + interval
  if not kept then keep = need + interval end
  local stored2 = k.halt == 0 and struct.pack('<ddd', t2, ts2, keep)
    or struct.pack('<dddd', t2, ts2, keep, k.halt)
  if kept then
    redis.call('SET', KEYS[i], stored2, 'KEEPTTL')
  else
    redis.call('SET', KEYS[i], stored2, 'PX', string.format('%d', keep - ts2))
  end
  local left = 0
  if t2 > 0 then left = t2 - t2 % 1 end
  reply[i] = struct.pack('<ddddddd', 1, request_wait, left, full - ts2, ts2, t2, ts2)
  lefts[i] = left
end
if audits > 0 then audit(true, lefts) end
return table.concat(reply)
