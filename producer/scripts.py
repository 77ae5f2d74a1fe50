"""Lua scripts: every state change of a job that must be atomic.

A job's hash is the source of truth. Its `entry` field names the stream entry that owns the job; a
result is written only while the hash is not final, and the owning entry is acked and deleted in the
same script, so a job ends with exactly one result however many times it was delivered.
Key arguments always come from `protocol.Keys`; all keys of a queue share one cluster slot.
"""
from __future__ import annotations

from .protocol import GROUP, TOKENS_TTL_S

_COMMON = """
local GROUP = '%s'
local TOKENS_TTL = %d
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function is_final(status)
  return status == 'succeeded' or status == 'failed' or status == 'cancelled' or status == 'expired'
end
local function entry_ms(id)
  return tonumber(string.match(id, '^(%%d+)'))
end
local function ack(stream, id)
  redis.call('XACK', stream, GROUP, id)
  redis.call('XDEL', stream, id)
end
-- keys: job hash, token stream, done list, results feed
local function finish(job, tokens, done, results, job_id, status, result_json, end_json, ttl, maxlen)
  redis.call('HSET', job, 'status', status, 'result', result_json, 'finished_ms', now_ms())
  redis.call('XADD', tokens, '*', 'data', end_json)
  redis.call('RPUSH', done, '1')
  redis.call('EXPIRE', job, ttl)
  redis.call('EXPIRE', tokens, math.min(tonumber(ttl), TOKENS_TTL))
  redis.call('EXPIRE', done, ttl)
  redis.call('XADD', results, 'MAXLEN', '~', maxlen, '*', 'job_id', job_id, 'status', status)
end
""" % (GROUP, TOKENS_TTL_S)

# KEYS: the job streams of every priority, then one job hash per job. ARGV: per job, its index into
# KEYS for the stream, its id and its JSON. Returns per job 1 if enqueued, 0 if the id already exists.
SUBMIT = _COMMON + """
local first = #KEYS - #ARGV / 3
local out = {}
for n = 1, #ARGV / 3 do
  local job, stream = KEYS[first + n], KEYS[tonumber(ARGV[3 * n - 2])]
  if redis.call('EXISTS', job) == 1 then
    out[n] = 0
  else
    local id = redis.call('XADD', stream, '*', 'job_id', ARGV[3 * n - 1], 'job', ARGV[3 * n])
    redis.call('HSET', job, 'status', 'queued', 'entry', id, 'stream', stream,
               'enqueued_ms', entry_ms(id), 'attempts', 0)
    out[n] = 1
  end
end
return out
"""

# KEYS: job, tokens, done, results, stream. ARGV: job_id, entry_id, worker, deadline_s ('' = none),
# ttl, maxlen, cancelled_result, cancelled_end, expired_result, expired_end.
# Returns {outcome, attempts, queue_ms}; outcome: run | final | duplicate | cancelled | expired.
START = _COMMON + """
local st = redis.call('HMGET', KEYS[1], 'status', 'entry', 'enqueued_ms', 'cancel')
local status, entry, enq, cancel = st[1], st[2], st[3], st[4]
if is_final(status) then ack(KEYS[5], ARGV[2]); return {'final', 0, 0} end
if entry and entry ~= ARGV[2] then ack(KEYS[5], ARGV[2]); return {'duplicate', 0, 0} end
local now = now_ms()
enq = tonumber(enq) or entry_ms(ARGV[2])
if cancel == '1' then
  finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], 'cancelled', ARGV[7], ARGV[8], ARGV[5], ARGV[6])
  ack(KEYS[5], ARGV[2]); return {'cancelled', 0, now - enq}
end
if ARGV[4] ~= '' and now > enq + tonumber(ARGV[4]) * 1000 then
  finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], 'expired', ARGV[9], ARGV[10], ARGV[5], ARGV[6])
  ack(KEYS[5], ARGV[2]); return {'expired', 0, now - enq}
end
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'status', 'running', 'entry', ARGV[2], 'stream', KEYS[5],
           'worker', ARGV[3], 'started_ms', now, 'enqueued_ms', enq)
if attempts > 1 then
  redis.call('XADD', KEYS[2], '*', 'data',
             '{"index":0,"restart":true,"attempt":' .. attempts .. '}')
end
return {'run', attempts, now - enq}
"""

# KEYS: job, tokens, done, results, stream. ARGV: job_id, entry_id, status, result, end, ttl, maxlen.
# Writes the result unless the job is final or owned by another entry; acks the entry either way.
FINISH = _COMMON + """
local st = redis.call('HMGET', KEYS[1], 'status', 'entry')
local written = 0
if not is_final(st[1]) and (not st[2] or st[2] == ARGV[2]) then
  if not st[2] then redis.call('HSET', KEYS[1], 'entry', ARGV[2], 'stream', KEYS[5]) end
  finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
  written = 1
end
ack(KEYS[5], ARGV[2])
return written
"""

# KEYS: token streams. ARGV: one TokenDelta JSON per stream.
APPEND_DELTAS = """
for i = 1, #KEYS do redis.call('XADD', KEYS[i], '*', 'data', ARGV[i]) end
return #KEYS
"""

# KEYS: stream. ARGV: consumer, entry ids. Resets the idle time of the entries this consumer still
# owns (XCLAIM JUSTID does not count a delivery) and returns the ids another consumer took over.
HEARTBEAT = _COMMON + """
local mine, lost = {}, {}
for i = 2, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], GROUP, ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[1] then mine[#mine + 1] = ARGV[i] else lost[#lost + 1] = ARGV[i] end
end
for i = 1, #mine, 500 do
  local args = {KEYS[1], GROUP, ARGV[1], 0}
  for j = i, math.min(i + 499, #mine) do args[#args + 1] = mine[j] end
  args[#args + 1] = 'JUSTID'
  redis.call('XCLAIM', unpack(args))
end
return lost
"""

# KEYS: job, stream. ARGV: job_id, entry_id. A draining worker gives a running job back: the entry is
# re-added at the end of its stream (a fresh delivery count) and the old one acked. Returns 1 if re-added.
HANDBACK = _COMMON + """
local st = redis.call('HMGET', KEYS[1], 'status', 'entry')
if is_final(st[1]) or (st[2] and st[2] ~= ARGV[2]) then ack(KEYS[2], ARGV[2]); return 0 end
local e = redis.call('XRANGE', KEYS[2], ARGV[2], ARGV[2])
if #e == 0 then ack(KEYS[2], ARGV[2]); return 0 end
local id = redis.call('XADD', KEYS[2], '*', unpack(e[1][2]))
redis.call('HSET', KEYS[1], 'status', 'queued', 'entry', id, 'stream', KEYS[2])
ack(KEYS[2], ARGV[2])
return 1
"""

# KEYS: job, tokens, done, results, stream, dead. ARGV: job_id, entry_id, deliveries, error, result,
# end, ttl, maxlen. Moves the entry to the dead-letter stream and writes the failed result.
DEAD_LETTER = _COMMON + """
local st = redis.call('HMGET', KEYS[1], 'status', 'entry')
if is_final(st[1]) or (st[2] and st[2] ~= ARGV[2]) then ack(KEYS[5], ARGV[2]); return 0 end
local e = redis.call('XRANGE', KEYS[5], ARGV[2], ARGV[2])
local job = ''
if #e > 0 then
  for i = 1, #e[1][2], 2 do if e[1][2][i] == 'job' then job = e[1][2][i + 1] end end
end
redis.call('XADD', KEYS[6], '*', 'job_id', ARGV[1], 'stream', KEYS[5], 'deliveries', ARGV[3],
           'error', ARGV[4], 'job', job)
finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], 'failed', ARGV[5], ARGV[6], ARGV[7], ARGV[8])
ack(KEYS[5], ARGV[2])
return 1
"""

# KEYS: job, tokens, done, results, cancels, streams of every priority. ARGV: job_id, result, end, ttl,
# maxlen. A queued job ends at once as cancelled; a running one is announced on the cancels stream.
# Returns 1 if the cancel was recorded, 0 if the job is unknown or already final.
CANCEL = _COMMON + """
local st = redis.call('HMGET', KEYS[1], 'status', 'entry', 'stream')
if not st[1] or is_final(st[1]) then return 0 end
redis.call('HSET', KEYS[1], 'cancel', '1')
if st[1] == 'queued' then
  finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], 'cancelled', ARGV[2], ARGV[3], ARGV[4], ARGV[5])
  for i = 6, #KEYS do if KEYS[i] == st[3] then redis.call('XDEL', KEYS[i], st[2]) end end
  return 1
end
redis.call('XADD', KEYS[5], 'MAXLEN', '~', 10000, '*', 'job_id', ARGV[1])
return 1
"""

# KEYS: dead, job, tokens, done, stream. ARGV: dead entry id, job_id, job_json.
# Puts a dead letter back on its stream as a fresh job (the old hash and token stream are dropped).
REQUEUE = _COMMON + """
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
local id = redis.call('XADD', KEYS[5], '*', 'job_id', ARGV[2], 'job', ARGV[3])
redis.call('HSET', KEYS[2], 'status', 'queued', 'entry', id, 'stream', KEYS[5],
           'enqueued_ms', entry_ms(id), 'attempts', 0)
return 1
"""


class Scripts:
    """The scripts registered on one redis client (sync or asyncio)."""

    def __init__(self, client) -> None:
        self.submit = client.register_script(SUBMIT)
        self.start = client.register_script(START)
        self.finish = client.register_script(FINISH)
        self.heartbeat = client.register_script(HEARTBEAT)
        self.append_deltas = client.register_script(APPEND_DELTAS)
        self.handback = client.register_script(HANDBACK)
        self.dead_letter = client.register_script(DEAD_LETTER)
        self.cancel = client.register_script(CANCEL)
        self.requeue = client.register_script(REQUEUE)
