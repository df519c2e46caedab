-- burstgate: spends a booked turn's one-time mark, in one atomic step.
--
-- KEYS[1]: the mark, `<bucket key>:t:<id>`, which a booking set to 'b' with its expiry.
-- Answers 1 when the mark was booked: it is spent now ('s'), keeping its expiry. 0 when it is
-- spent already, or holds anything else (a mark spent by a build that wrote no bookings holds
-- '1'; a key someone else wrote may not even be a string, hence pcall): spent, left as it is.
-- -1 when there is none: never booked, expired, or lost by Redis (a flush, a restart without
-- persistence, a failover to a replica that lacked it), which the caller refuses.
local found = redis.pcall('GET', KEYS[1])
if found == 'b' then
  redis.call('SET', KEYS[1], 's', 'KEEPTTL')
  return 1
end
if found == false then
  return -1
end
return 0
