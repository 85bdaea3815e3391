"""The Lua scripts of ``state_backend: redis``: the decisions replicas must take atomically, run inside Redis
(text only; kvgate.shared.redis_state registers and calls them). Each script's comment gives its KEYS and
ARGV; the keys themselves are described in kvgate.shared.redis_state.
"""

from __future__ import annotations

# The shared queue's arrival counter outlives any wait (waits end by max_wait); it restarts only after a
# day without waiters.
QUEUE_SEQ_TTL_S = 86400

# Grant a lease against every ceiling it counts against (the fleet's, and its engine's or DP rank's when
# known), atomically: leases whose expiry passed are dropped first (a dead replica's leases go by TTL), then
# the lease is granted when each place's live reservations plus it fit that place's ceiling, or nothing is
# reserved there (a request larger than the whole ceiling still runs alone, as in the ledger).
# The tokens of lease (or waiter) members "<replica>:<lease>|<tokens>", and the live tokens of one lease set
# (its expired members dropped first): shared by the scripts below.
LUA_TOKENS = """
local function tokens_of(members)
  local sum = 0
  for _, m in ipairs(members) do sum = sum + tonumber(string.match(m, '|(%d+)$')) end
  return sum
end
local function live_tokens(key, now)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  return tokens_of(redis.call('ZRANGE', key, 0, -1))
end
"""

# KEYS: one sorted set per place (member "<replica>:<lease>|<tokens>", score = expiry, epoch s);
# ARGV: now, expiry, member, tokens, key ttl (s), then one ceiling per key.
LEASE_GRANT = LUA_TOKENS + """
local now = tonumber(ARGV[1])
local tokens = tonumber(ARGV[4])
for i = 1, #KEYS do
  local sum = live_tokens(KEYS[i], now)
  if sum > 0 and sum + tokens > tonumber(ARGV[5 + i]) then return 0 end
end
for i = 1, #KEYS do
  redis.call('ZADD', KEYS[i], ARGV[2], ARGV[3])
  redis.call('EXPIRE', KEYS[i], ARGV[5])
end
return 1
"""

# The batch script: every write (and read-modify-write) a replica queued during one event-loop turn, applied
# in the order they were made (kvgate.shared.batch), in ONE call: redis-py's per-call CPU (110 to 170 us
# whatever the call carries) is paid once per batch, not once per write. Each op runs in its own pcall, so
# one failing op (its answer: "!<error>") neither stops the others nor undoes those before it.
# KEYS: queue (member -> arrival number), queue:exp (member -> expiry, epoch s), queue:seq, then every other
# key the ops touch, once; ARGV: the ops as JSON ([kind, [their keys' KEYS indexes], arguments...]), the
# session ttl (s), this replica's id, the replica heartbeat key prefix, the room channel.
# Returns one answer per op, in order.
#
# The ops:
#  turn {sess, place}, at, delta, started: a session's turns in flight on this replica move by delta (the
#    net of the turn starts and ends merged into it); last activity only moves forward; the session's
#    placement lives as long as its activity. When a start is among them (started = 1), a session that is
#    closing re-opens and its epoch is bumped (the closing replica's calls not sent yet are then dropped).
#    An end seen before its start (a batch that failed halfway) leaves -1, which the start brings to 0.
#  closed {sess, place}, reason: this replica closes the session, for that reason (client, idle, ...): mark it
#    so, if known, and forget its placement (a session that comes back is placed again by the rules, as on one
#    replica). Answers the session's epoch as the close began (0 when unknown).
#  idle {sess}, now, threshold: should this replica close the session as idle? The first replica to find it
#    idle marks it closing and gets 'close'; the others get 'elsewhere' with the reason the closing replica
#    recorded; 'busy' with the seconds since its last activity while it is active, or while a live replica
#    (heartbeat key there) has a turn in flight. Answers {verdict, seconds, reason ('' but for 'elsewhere')}.
#  grant {lease sets, the fleet's first}, now, lease expiry, member, tokens, key ttl, waiter expiry, arrival
#    number, backfill (0 | 1 | force), {ceilings}: the lease grant in one global FIFO of the waiters of every
#    replica. Granted only when no live waiter arrived before it (with backfill: or when the room left after
#    it still holds every earlier waiter on the fleet ceiling) and each place's live reservations plus it fit
#    that place's ceiling (or the place holds nothing: a request larger than the whole ceiling still runs
#    alone, as in the ledger); otherwise it waits in the queue, keeping its arrival number (0 on the first
#    ask: it takes the next one, after everyone waiting). 'force' is granted whatever it finds (a bypass
#    still reserves). Leases and waiters whose expiry passed (their replica died or stopped asking) are
#    dropped first. Answers {granted 0 | 1, arrival number (0 if granted without waiting)}.
#  release {lease sets}, member: a lease's request ended.
#  leave {}, member: a waiter goes without a grant (aged, cancelled).
#  link {link key}, field, session: session inference (a completed turn's fingerprint -> its session).
#  paused {prog key}, tokens, ttl / unpaused {prog key}: the program policy's pause marks.
# A release or a leave publishes on the room channel once per batch, when waiters are left to wake.
# A place's live tokens are summed once per batch and then kept up to date by the batch's own grants and
# releases (the sum scans the set: with many leases live it is most of the script's work).
BATCH = LUA_TOKENS + r"""
local ttl, replica, beats = ARGV[2], ARGV[3], ARGV[4]
local Q, QEXP, QSEQ = KEYS[1], KEYS[2], KEYS[3]
local freed = false
local sums = {}   -- lease set -> {now, live tokens at now}

local function live(key, now)
  local c = sums[key]
  if c and c[1] == now then return c[2] end
  local s = live_tokens(key, tonumber(now))
  sums[key] = {now, s}
  return s
end

local function moved(key, by)
  local c = sums[key]
  if c then c[2] = c[2] + by end
end

local OPS = {}

function OPS.turn(k, at, delta, started)
  local sess, place = KEYS[k[1]], KEYS[k[2]]
  local f = 'if:' .. replica
  local n = redis.call('HINCRBY', sess, f, delta)
  if n == 0 then redis.call('HDEL', sess, f) end
  if started == 1 then
    if redis.call('HGET', sess, 'state') == 'closing' then
      redis.call('HINCRBY', sess, 'epoch', 1)
      redis.call('HDEL', sess, 'reason')  -- re-opened: its next close records its own
    end
    redis.call('HSET', sess, 'state', 'active')
  end
  local last = tonumber(redis.call('HGET', sess, 'last') or '0')
  if tonumber(at) > last then redis.call('HSET', sess, 'last', at) end
  if not redis.call('HGET', sess, 'state') then redis.call('HSET', sess, 'state', 'active') end
  redis.call('EXPIRE', sess, ttl)
  redis.call('EXPIRE', place, ttl)
  return n
end

function OPS.closed(k, reason)
  local sess = KEYS[k[1]]
  if redis.call('EXISTS', sess) == 1 then
    redis.call('HSET', sess, 'state', 'closing', 'closer', replica, 'reason', reason or '')
  end
  redis.call('DEL', KEYS[k[2]])
  return tonumber(redis.call('HGET', sess, 'epoch') or '0')
end

function OPS.idle(k, now, threshold)
  local sess = KEYS[k[1]]
  if redis.call('EXISTS', sess) == 0 then
    redis.call('HSET', sess, 'state', 'closing', 'closer', replica, 'last', now, 'reason', 'idle')
    redis.call('EXPIRE', sess, ttl)
    return {'close', '0', ''}
  end
  local h = redis.call('HGETALL', sess)
  local state, last, reason = 'active', 0, ''
  for i = 1, #h, 2 do
    local f, v = h[i], h[i + 1]
    if f == 'state' then state = v
    elseif f == 'last' then last = tonumber(v)
    elseif f == 'reason' then reason = v
    elseif string.sub(f, 1, 3) == 'if:' and tonumber(v) > 0 then
      if redis.call('EXISTS', beats .. string.sub(f, 4)) == 1 then return {'busy', '0', ''} end
    end
  end
  if state ~= 'active' then return {'elsewhere', '0', reason} end
  local age = tonumber(now) - last
  if age <= tonumber(threshold) then return {'busy', tostring(age), ''} end
  redis.call('HSET', sess, 'state', 'closing', 'closer', replica, 'reason', 'idle')
  redis.call('EXPIRE', sess, ttl)
  return {'close', tostring(age), ''}
end

function OPS.grant(k, now, expiry, member, tokens, keyttl, wexpiry, seq, backfill, ceilings)
  local tnow = tonumber(now)
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', QEXP, '-inf', tnow)) do
    redis.call('ZREM', Q, m)
    redis.call('ZREM', QEXP, m)
  end
  local fits, fleet = true, 0
  for i = 1, #k do
    local sum = live(KEYS[k[i]], now)
    if i == 1 then fleet = sum end
    if sum > 0 and sum + tokens > ceilings[i] then fits = false end
  end
  local ahead
  if seq > 0 then
    ahead = redis.call('ZRANGEBYSCORE', Q, '-inf', '(' .. seq)
  else
    ahead = redis.call('ZRANGE', Q, 0, -1)
  end
  local go = fits
  if backfill == 'force' then
    go = true
  elseif fits and #ahead > 0 then
    go = false
    if backfill == '1' then
      local waiting = 0
      for _, m in ipairs(ahead) do
        if m ~= member then waiting = waiting + tonumber(string.match(m, '|(%d+)$')) end
      end
      go = fleet + tokens + waiting <= ceilings[1]
    end
  end
  if go then
    for i = 1, #k do
      if redis.call('ZADD', KEYS[k[i]], expiry, member) == 1 then moved(KEYS[k[i]], tokens) end
      redis.call('EXPIRE', KEYS[k[i]], keyttl)
    end
    redis.call('ZREM', Q, member)
    redis.call('ZREM', QEXP, member)
    return {1, seq}
  end
  if seq <= 0 then seq = redis.call('INCR', QSEQ) end
  redis.call('ZADD', Q, seq, member)
  redis.call('ZADD', QEXP, wexpiry, member)
  redis.call('EXPIRE', Q, keyttl)
  redis.call('EXPIRE', QEXP, keyttl)
  redis.call('EXPIRE', QSEQ, QUEUE_SEQ_TTL)
  return {0, seq}
end

function OPS.release(k, member)
  local tokens = tonumber(string.match(member, '|(%d+)$')) or 0
  for i = 1, #k do
    if redis.call('ZREM', KEYS[k[i]], member) == 1 then moved(KEYS[k[i]], -tokens) end
  end
  freed = true
  return 1
end

function OPS.leave(k, member)
  redis.call('ZREM', Q, member)
  redis.call('ZREM', QEXP, member)
  freed = true
  return 1
end

function OPS.link(k, field, sid)
  redis.call('HSET', KEYS[k[1]], field, sid)
  redis.call('EXPIRE', KEYS[k[1]], ttl)
  return 1
end

function OPS.paused(k, tokens, pttl)
  redis.call('SET', KEYS[k[1]], tokens, 'EX', pttl)
  return 1
end

function OPS.unpaused(k)
  redis.call('DEL', KEYS[k[1]])
  return 1
end

local out = {}
for i, op in ipairs(cjson.decode(ARGV[1])) do
  local ok, r = pcall(OPS[op[1]], unpack(op, 2))
  if ok then
    out[i] = r
  else
    out[i] = '!' .. (type(r) == 'table' and tostring(r.err) or tostring(r))
  end
end
if freed and redis.call('ZCARD', Q) > 0 then redis.call('PUBLISH', ARGV[5], '1') end
return out
""".replace("QUEUE_SEQ_TTL", str(QUEUE_SEQ_TTL_S))

# Lead the capacity poll: take the lease (KEYS[1]) when free, or renew it when this replica (ARGV[1])
# holds it, for ARGV[2] ms. Returns 1 when this replica leads.
CAPACITY_LEAD = """
local v = redis.call('GET', KEYS[1])
if (not v) or v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

# Live reservations (tokens) on one place. KEYS[1]: its sorted set; ARGV[1]: now.
LEASE_SUM = LUA_TOKENS + """
return tokens_of(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf'))
"""
