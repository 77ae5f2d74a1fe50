"""Lua scripts: every state change of a job that must be atomic. Here: the helpers every script starts
with, the scripts a producer runs (submit, cancel, requeue) and their registration (`ScriptSet`); the
scripts only the worker runs are in `worker.scripts`, built on the same two.

A job's hash is the source of truth. Its `entry` field names the stream entry that owns the job; a
result is written only while the hash is not final, and the owning entry is acked and deleted in the
same script, so a job ends with exactly one result however many times it was delivered.
Key arguments always come from `protocol.Keys`; all keys of a queue share one cluster slot.
"""
from __future__ import annotations

from redis.asyncio.cluster import ClusterPipeline as AsyncClusterPipeline
from redis.cluster import ClusterPipeline as SyncClusterPipeline

from .protocol import GROUP, TOKENS_TTL_S, Keys

# the Lua helpers every script starts with, the worker's (worker.scripts) too
COMMON = """
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



def finish_keys(keys: Keys, job_id: str, *more: str) -> list[str]:
    """The KEYS of a script that ends a job with the Lua `finish` helper (FINISH, START, DEAD_LETTER, CANCEL):
    the four that helper writes (job hash, token stream, done list, results feed), then the script's `more`."""
    return [keys.job(job_id), keys.tokens(job_id), keys.done(job_id), keys.results, *more]


# KEYS: the job streams of every priority, then one job hash per job. ARGV: per job, its index into
# KEYS for the stream, its id and its JSON. Returns per job 1 if enqueued, 0 if the id already exists.
SUBMIT = COMMON + """
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

# KEYS: job, tokens, done, results, cancels, streams of every priority. ARGV: job_id, result, end, ttl,
# maxlen. A queued job ends at once as cancelled; a running one is announced on the cancels stream.
# Returns 1 if the cancel was recorded, 0 if the job is unknown or already final.
CANCEL = COMMON + """
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
REQUEUE = COMMON + """
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
local id = redis.call('XADD', KEYS[5], '*', 'job_id', ARGV[2], 'job', ARGV[3])
redis.call('HSET', KEYS[2], 'status', 'queued', 'entry', id, 'stream', KEYS[5],
           'enqueued_ms', entry_ms(id), 'attempts', 0)
return 1
"""


class Script:
    """One Lua script registered on a redis client: `script(keys=..., args=..., client=pipe)`.

    On a Redis Cluster pipeline it is queued whole (EVAL): such a pipeline cannot load a script before it
    runs, and a replica promoted by a failover starts with no scripts loaded. Called directly, redis-py
    loads it (on every primary of a cluster) when the server answers NOSCRIPT.
    """

    def __init__(self, client, source: str) -> None:
        self.source = source
        self.registered = client.register_script(source)

    def __call__(self, keys=(), args=(), client=None):
        if isinstance(client, AsyncClusterPipeline):
            return _awaitable(client.execute_command("EVAL", self.source, len(keys), *keys, *args))
        if isinstance(client, SyncClusterPipeline):  # its node named, or it asks a server for the keys of each EVAL
            return client.execute_command("EVAL", self.source, len(keys), *keys, *args,
                                          target_nodes=client.get_node_from_key(keys[0]))
        return self.registered(keys=keys, args=args, client=client)


async def _awaitable(value):
    return value


class ScriptSet:
    """Lua scripts registered on one redis client (sync or asyncio): each entry of `SOURCES` becomes an
    attribute of that name, a `Script` called as `scripts.name(keys=..., args=..., client=pipe)`."""

    SOURCES: dict[str, str] = {}

    def __init__(self, client) -> None:
        for name, source in self.SOURCES.items():
            setattr(self, name, Script(client, source))


class ClientScripts(ScriptSet):
    """The scripts `Client` and `AsyncClient` run."""

    SOURCES = {"submit": SUBMIT, "cancel": CANCEL, "requeue": REQUEUE}
