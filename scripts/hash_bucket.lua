-- A common token bucket in Redis, for comparison only: what many rate limiters run. It keeps a
-- hash {tokens, ts}, reads it with HMGET, and writes it with HSET and PEXPIRE on every call,
-- denials included, with its numbers as decimal arguments and text. scripts/redis_cpu.sh runs it
-- beside burstgate's own script to compare what a call costs Redis.
--
-- KEYS[1] the bucket; ARGV: tokens per millisecond, capacity, now (ms), cost.
-- Returns {allowed (1 or 0), tokens left}.

local key = KEYS[1]
local rate = tonumber(ARGV[1])
local capacity = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local requested = tonumber(ARGV[4])
local data = redis.call('HMGET', key, 'tokens', 'ts')
local tokens = tonumber(data[1])
local ts = tonumber(data[2])
if tokens == nil then
  tokens = capacity
  ts = now
end
local delta = math.max(0, now - ts)
local filled = math.min(capacity, tokens + delta * rate)
local allowed = filled >= requested
local new_tokens = filled
if allowed then new_tokens = filled - requested end
redis.call('HSET', key, 'tokens', new_tokens, 'ts', now)
redis.call('PEXPIRE', key, math.ceil(capacity / rate * 2))
return {allowed and 1 or 0, new_tokens}
