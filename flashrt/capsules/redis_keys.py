"""Keys of the Redis tier (capsules/redis_tier.py) and the Lua scripts that change them: each
runs atomically on the one slot of a fingerprint ({fp} hash tag), so values, index entries and
bookkeeping never disagree.

Every script gets ARGV[1] = the key prefix "<ns>:{<fp>}:". Keys under it:
    m:<id>              meta JSON {id, n, d, b, k, u, p, x}   (TTL)   liveness of capsule <id>
    c:<id>:<u>:<i>      chunk i of upload u                   (TTL)   the capsule file's bytes
    i:<d>               index: id of the capsule holding the prefix with digest d    (TTL)
    lru                 zset id -> last use (ms);  info: hash id -> meta JSON (bookkeeping)
    bytes               bytes of live capsules;    pins: set of pinned ids
    lens / lenrc        zset and refcounts of the prefix lengths that have an index entry
    kids                hash id -> number of stored delta children (a parent is never evicted)
    names               hash name -> id of the capsule stored under that name (RedisTier.put_named)
    r::<ns>:<key>       a record of store namespace <ns> (RedisTier.put_record: e.g. a serve
                        response's token history; its own TTL, outside the budget)
Meta fields: n tokens, d prefix digest, b value bytes, k chunks, u upload nonce, p parent id
("" for none), x = 1 when this capsule owns its index entry; a named capsule's also c = the
capsule's own id (its id here is a fresh "n<hex>", so each name owns its value).
A named capsule is in `pins` and not in `lru`: never evicted, no TTL, no index entry.
"""

import hashlib
import json

import numpy as np

from .types import FINGERPRINT_KEYS


def fingerprint_digest(fp: dict) -> str:
    """The key component for a model fingerprint: equal only where all five fields are."""
    text = json.dumps([fp.get(k) for k in FINGERPRINT_KEYS], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def prefix_digests(tokens, lengths) -> dict:
    """{n: digest of tokens[:n]} for each n in lengths, in one incremental pass."""
    arr = np.asarray(tokens, dtype="<i8")
    h, done, out = hashlib.blake2b(digest_size=16), 0, {}
    for n in sorted(set(lengths)):
        h.update(arr[done:n].tobytes())
        done = n
        out[n] = h.copy().hexdigest()
    return out


COMMON = r"""
local P = ARGV[1]
local function chunkkeys(m)
  local t = {}
  for i = 0, m.k - 1 do t[#t + 1] = P .. 'c:' .. m.id .. ':' .. m.u .. ':' .. i end
  return t
end
local function del_all(keys)
  for i = 1, #keys, 512 do redis.call('DEL', unpack(keys, i, math.min(i + 511, #keys))) end
end
local function expire_all(m, ttl, persist)
  local keys = chunkkeys(m)
  keys[#keys + 1] = P .. 'm:' .. m.id
  if m.x == 1 and redis.call('GET', P .. 'i:' .. m.d) == m.id then keys[#keys + 1] = P .. 'i:' .. m.d end
  for _, k in ipairs(keys) do
    if persist or ttl <= 0 then redis.call('PERSIST', k) else redis.call('PEXPIRE', k, ttl) end
  end
end
-- drop every key and all bookkeeping of id (live or already expired)
local function forget(id)
  local raw = redis.call('HGET', P .. 'info', id)
  redis.call('ZREM', P .. 'lru', id)
  if not raw then return 0 end
  local m = cjson.decode(raw)
  local keys = chunkkeys(m)
  keys[#keys + 1] = P .. 'm:' .. id
  del_all(keys)
  if m.x == 1 then
    if redis.call('GET', P .. 'i:' .. m.d) == id then redis.call('DEL', P .. 'i:' .. m.d) end
    if redis.call('HINCRBY', P .. 'lenrc', m.n, -1) <= 0 then
      redis.call('HDEL', P .. 'lenrc', m.n)
      redis.call('ZREM', P .. 'lens', m.n)
    end
  end
  if m.p ~= '' and redis.call('HINCRBY', P .. 'kids', m.p, -1) <= 0 then
    redis.call('HDEL', P .. 'kids', m.p)
  end
  redis.call('HDEL', P .. 'info', id)
  redis.call('SREM', P .. 'pins', id)
  redis.call('DECRBY', P .. 'bytes', m.b)
  return 1
end
-- last use of id and its ancestors := now, TTLs renewed; a pinned capsule's ancestors persist
local function touch(id, now, ttl)
  local pinned, depth = false, 0
  while id ~= '' and depth < 256 do
    local raw = redis.call('HGET', P .. 'info', id)
    if not raw or redis.call('EXISTS', P .. 'm:' .. id) == 0 then return 0 end
    local m = cjson.decode(raw)
    pinned = pinned or redis.call('SISMEMBER', P .. 'pins', id) == 1
    redis.call('ZADD', P .. 'lru', now, id)
    expire_all(m, ttl, pinned)
    id, depth = m.p, depth + 1
  end
  return 1
end
-- bookkeeping of capsules whose keys expired (TTL): found among the least recently used
local function reconcile(now, ttl)
  if ttl <= 0 then return end
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. 'lru', '-inf', now - ttl, 'LIMIT', 0, 64)) do
    if redis.call('EXISTS', P .. 'm:' .. id) == 0 then forget(id) end
  end
end
local function over(budget)
  return budget >= 0 and tonumber(redis.call('GET', P .. 'bytes') or '0') > budget
end
-- least recently used first; never pinned capsules or parents of stored children
local function evict(budget)
  if not over(budget) then return end
  for _, id in ipairs(redis.call('ZRANGE', P .. 'lru', 0, 4095)) do
    local kids = tonumber(redis.call('HGET', P .. 'kids', id) or '0')
    if redis.call('SISMEMBER', P .. 'pins', id) == 0 and kids <= 0 then
      forget(id)
      if not over(budget) then return end
    end
  end
end
"""

# ARGV: P, meta JSON, now ms, ttl ms, budget (-1: none), pin 0/1, force 0/1 (store even when
# another capsule owns the prefix: a child needs this one as its parent)
COMMIT = COMMON + r"""
local m = cjson.decode(ARGV[2])
local now, ttl, budget = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local pin, force = ARGV[6] == '1', ARGV[7] == '1'
reconcile(now, ttl)
local ks, total = chunkkeys(m), 0
for _, k in ipairs(ks) do total = total + redis.call('STRLEN', k) end
if total ~= m.b then del_all(ks); return 'incomplete' end
if redis.call('EXISTS', P .. 'm:' .. m.id) == 1 then        -- idempotent: already published
  del_all(ks)
  if pin then redis.call('SADD', P .. 'pins', m.id) end
  touch(m.id, now, ttl)
  return 'exists'
end
if m.p ~= '' and redis.call('EXISTS', P .. 'm:' .. m.p) == 0 then del_all(ks); return 'noparent' end
local cur = redis.call('GET', P .. 'i:' .. m.d)
m.x = 1
if cur and redis.call('EXISTS', P .. 'm:' .. cur) == 1 then
  if not force then del_all(ks); return 'dup' end            -- first writer of a prefix wins
  m.x = 0
elseif cur then
  forget(cur)                                                -- dangling entry: replace it
  redis.call('DEL', P .. 'i:' .. m.d)
end
local raw = cjson.encode(m)
redis.call('SET', P .. 'm:' .. m.id, raw)
redis.call('HSET', P .. 'info', m.id, raw)
if m.x == 1 then
  redis.call('SET', P .. 'i:' .. m.d, m.id)
  if redis.call('HINCRBY', P .. 'lenrc', m.n, 1) == 1 then redis.call('ZADD', P .. 'lens', m.n, m.n) end
end
if m.p ~= '' then redis.call('HINCRBY', P .. 'kids', m.p, 1) end
redis.call('INCRBY', P .. 'bytes', m.b)
if pin then redis.call('SADD', P .. 'pins', m.id) end
touch(m.id, now, ttl)
evict(budget)
if redis.call('EXISTS', P .. 'm:' .. m.id) == 0 then return 'evicted' end
if over(budget) and not pin then forget(m.id); return 'full' end
return 'ok'
"""

# ARGV: P, now ms, ttl ms, id
TOUCH = COMMON + r"""
return touch(ARGV[4], tonumber(ARGV[2]), tonumber(ARGV[3]))
"""

# ARGV: P, id, prefix digest ("" if unknown): forget a damaged or dangling capsule
DROP = COMMON + r"""
local n = forget(ARGV[2])
if ARGV[3] ~= '' and redis.call('GET', P .. 'i:' .. ARGV[3]) == ARGV[2] then
  redis.call('DEL', P .. 'i:' .. ARGV[3])
  n = n + 1
end
return n
"""

# ARGV: P, meta JSON, name, now ms, ttl ms, budget (-1: none). A taken name is refused; room is
# made by evicting unpinned capsules only when the pinned ones leave enough, else refused.
NAME = COMMON + r"""
local m = cjson.decode(ARGV[2])
local name, now, ttl, budget = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
reconcile(now, ttl)
local ks, total = chunkkeys(m), 0
for _, k in ipairs(ks) do total = total + redis.call('STRLEN', k) end
if total ~= m.b then del_all(ks); return 'incomplete' end
local cur = redis.call('HGET', P .. 'names', name)
if cur then
  if redis.call('EXISTS', P .. 'm:' .. cur) == 1 then del_all(ks); return 'taken' end
  forget(cur)                                                -- dangling name: replace it
end
if budget >= 0 then
  local held = 0
  for _, id in ipairs(redis.call('SMEMBERS', P .. 'pins')) do
    local raw = redis.call('HGET', P .. 'info', id)
    if raw then held = held + cjson.decode(raw).b end
  end
  if held + m.b > budget then del_all(ks); return 'full' end
  evict(budget - m.b)
  if over(budget - m.b) then del_all(ks); return 'full' end
end
m.x = 0
local raw = cjson.encode(m)
redis.call('SET', P .. 'm:' .. m.id, raw)
redis.call('HSET', P .. 'info', m.id, raw)
redis.call('HSET', P .. 'names', name, m.id)
redis.call('INCRBY', P .. 'bytes', m.b)
redis.call('SADD', P .. 'pins', m.id)
expire_all(m, ttl, true)                                     -- the chunks' upload TTL removed
return 'ok'
"""

# ARGV: P, name -> {id, meta JSON ("" when the capsule is gone)}, or nil when no such name
NAMED = r"""
local id = redis.call('HGET', ARGV[1] .. 'names', ARGV[2])
if not id then return false end
return {id, redis.call('GET', ARGV[1] .. 'm:' .. id) or ''}
"""

# ARGV: P, name, id ("": whichever): forget the name and its capsule -> 1, or 0 when it names
# no capsule (or another one than id: replaced meanwhile)
UNNAME = COMMON + r"""
local id = redis.call('HGET', P .. 'names', ARGV[2])
if not id or (ARGV[3] ~= '' and id ~= ARGV[3]) then return 0 end
redis.call('HDEL', P .. 'names', ARGV[2])
forget(id)
return 1
"""
