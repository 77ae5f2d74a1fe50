"""Lua scripts only the worker runs: admission, results, heartbeats, hand-backs and dead letters.

A result is written only while the job's hash is not final, and the owning entry is acked and deleted in
the same script, so a job ends with exactly one result however many times it was delivered. The Lua
helpers (`COMMON`) and the registration (`ScriptSet`) are the producer's, shared with its scripts.
"""
from __future__ import annotations

from producer.protocol import RESULTS_FEED_MAXLEN, Keys
from producer.scripts import COMMON, ScriptSet, finish_keys

# KEYS: job, tokens, done, results, stream. ARGV: job_id, entry_id, worker, deadline_s ('' = none),
# ttl, maxlen, cancelled_result, cancelled_end, expired_result, expired_end.
# Returns {outcome, attempts, queue_ms}; outcome: run | final | duplicate | cancelled | expired.
START = COMMON + """
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
FINISH = COMMON + """
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
HEARTBEAT = COMMON + """
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
HANDBACK = COMMON + """
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
DEAD_LETTER = COMMON + """
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


class WorkerScripts(ScriptSet):
    """The scripts the worker's reader and writer threads run."""

    SOURCES = {"start": START, "finish": FINISH, "heartbeat": HEARTBEAT, "append_deltas": APPEND_DELTAS,
               "handback": HANDBACK, "dead_letter": DEAD_LETTER}

    def finish_job(self, keys: Keys, job_id: str, stream: str, entry_id: str, status: str, result: str, end: str,
                   ttl: int, client=None):
        """FINISH one job (every caller's one way to): returns 1 if this wrote its result."""
        return self.finish(keys=finish_keys(keys, job_id, stream),
                           args=[job_id, entry_id, status, result, end, ttl, RESULTS_FEED_MAXLEN], client=client)
