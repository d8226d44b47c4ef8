"""Server-side Lua: the writer's one call per flush, and the reader's one call per score.

Both scripts derive block and record keys from the namespace prefix passed in
ARGV; KEYS[1] (the namespace's executor set) pins the call to the
namespace's slot, and every derived key shares its hash tag.

APPLY — ARGV: prefix, lease_ms, retention_ms, gc_cap, num_sections, sections…
  B executor_id incarnation batch num_ops blob step   a batch of KV events, packed in one string:
      S<hash><parent><depth><block_id><tier><n><tokens>  stored (F: the same without parent)
      X<hash>                                            removed
      C                                                  all cleared
      hashes are 64 hex digits, depth/block_id/n 8 hex digits, tier one
      letter (d device, c cpu), tokens n bytes (uint32 LE)
      applied only when the record's incarnation is ours and batch == last_batch + 1;
      replies ok | dup (batch <= last: a retry, no-op) | gap (resync needed) |
      stale (another incarnation's record: rejected) | missing (no record: resync)
      step: '' or the step_id written as the record's last_step_id when the batch
      is applied (step fencing: every event of that step is in this or an earlier batch)
  R executor_id incarnation batch num_fields field value…   (re)start an executor's record:
      fences every earlier incarnation at once, retires the old reverse indexes
      for cleanup, last_batch = batch; the caller follows with B batches
  H executor_id incarnation address   renew the lease (ok | stale | missing)
  D executor_id incarnation           drop the record ('' = whatever incarnation)
  Then at most gc_cap members of retired reverse indexes are cleaned: an
  owner field is deleted unless the executor's current index holds the hash.
  Reply: one status per section, then the number of retired indexes left.

DUMP — ARGV: prefix, executor_id, incarnation, start, stop (reverse-index ranks)
  Restart recovery's page read: every listed block whose owner field is this
  incarnation on the device tier. Reply: {entries looked at, blob} with blob
  = (<hash><parent or 64 '-'><depth><block_id><n><tokens>)*, fields as above.

SCORE — ARGV: prefix, max_blocks, num_wanted, wanted executor ids…, hashes (64 hex digits each, concatenated)
  For every live executor (lease not expired by Redis's clock, status live)
  the number of consecutive leading hashes whose block record has its field
  with the executor's current incarnation. Reply: id, hits, id, hits, …
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

_COMMON = r"""
local P = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function exkey(e) return P .. 'ex:' .. e end
local function xkey(e, inc) return P .. 'x:' .. e .. ':' .. inc end
local function bkey(h) return P .. 'b:' .. h end
"""

APPLY = r"""
if redis.replicate_commands then pcall(redis.replicate_commands) end
""" + _COMMON + r"""
local lease_ms = tonumber(ARGV[2])
local retention_ms = tonumber(ARGV[3])
local gc_cap = tonumber(ARGV[4])
local EXS = KEYS[1]
local GCL, GCO = P .. 'gc', P .. 'gco'
local function num(x) return string.format('%.0f', x) end
local sub = string.sub
local TIERS = {d = 'device', c = 'cpu'}

local function unown(h, e)
  local k = bkey(h)
  redis.call('HDEL', k, 'e:' .. e)
  if redis.call('HLEN', k) <= 3 then redis.call('DEL', k) end  -- only p, d, t left
end

local function retire(e, inc)  -- queue a reverse index for cleanup (O(1) now)
  local x = xkey(e, inc)
  if redis.call('EXISTS', x) == 1 then
    local g = P .. 'gc:' .. redis.call('INCR', P .. 'gcseq')
    redis.call('RENAME', x, g)
    redis.call('PERSIST', g)
    redis.call('RPUSH', GCL, g)
    redis.call('HSET', GCO, g, e)
  end
end

local out = {}
local i = 6
for _ = 1, tonumber(ARGV[5]) do
  local kind, e = ARGV[i], ARGV[i + 1]
  i = i + 2
  if kind == 'B' then
    local inc, b, blob, step = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 3], ARGV[i + 4]
    i = i + 5
    local rec = redis.call('HMGET', exkey(e), 'incarnation', 'last_batch')
    local status
    if not rec[1] then status = 'missing'
    elseif rec[1] ~= inc then status = 'stale'
    else
      local last = tonumber(rec[2]) or 0
      if b <= last then status = 'dup' elseif b > last + 1 then status = 'gap' else status = 'ok' end
    end
    local apply = status == 'ok'
    local x, field = xkey(e, inc), 'e:' .. e
    local pos, n = 1, (apply and #blob or 0)
    local z = {}  -- ZADD arguments, sent in one call before any removal and at the end
    local function zflush()
      if #z > 0 then
        redis.call('ZADD', x, unpack(z))
        z = {}
      end
    end
    while pos <= n do
      local op = sub(blob, pos, pos)
      if op == 'S' or op == 'F' then
        local h = sub(blob, pos + 1, pos + 64)
        pos = pos + 65
        local parent = ''
        if op == 'S' then
          parent = sub(blob, pos, pos + 63)
          pos = pos + 64
        end
        local depth = tonumber(sub(blob, pos, pos + 7), 16)
        local bid = tonumber(sub(blob, pos + 8, pos + 15), 16)
        local tier = TIERS[sub(blob, pos + 16, pos + 16)] or 'device'
        local tlen = tonumber(sub(blob, pos + 17, pos + 24), 16)
        local toks = sub(blob, pos + 25, pos + 24 + tlen)
        pos = pos + 25 + tlen
        redis.call('HSET', bkey(h), 'p', parent, 'd', depth, 't', toks, field, inc .. ':' .. tier .. ':' .. bid)
        z[#z + 1] = depth
        z[#z + 1] = h
        if #z >= 4000 then zflush() end  -- unpack() has a stack limit
      elseif op == 'X' then
        zflush()
        local h = sub(blob, pos + 1, pos + 64)
        pos = pos + 65
        unown(h, e)
        redis.call('ZREM', x, h)
      elseif op == 'C' then  -- everything this incarnation held is gone
        zflush()
        retire(e, inc)
        pos = pos + 1
      else
        return redis.error_reply('kvpager mirror: bad op ' .. op .. ' at ' .. pos)
      end
    end
    zflush()
    if apply then
      if step ~= '' then redis.call('HSET', exkey(e), 'last_batch', b, 'last_step_id', step)
      else redis.call('HSET', exkey(e), 'last_batch', b) end
    end
    out[#out + 1] = status
  elseif kind == 'R' then
    local inc, b, nf = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
    i = i + 3
    local k = exkey(e)
    local old = redis.call('HGET', k, 'incarnation')
    if old then retire(e, old) end
    if old ~= inc then retire(e, inc) end
    redis.call('DEL', k)
    local f = {'incarnation', inc, 'last_batch', b, 'heartbeat_ms', num(now),
               'lease_until_ms', num(now + lease_ms), 'status', 'live'}
    for j = 0, nf - 1 do
      f[#f + 1] = ARGV[i + 2 * j]
      f[#f + 1] = ARGV[i + 2 * j + 1]
    end
    i = i + 2 * nf
    redis.call('HSET', k, unpack(f))
    redis.call('PEXPIRE', k, retention_ms)
    redis.call('SADD', EXS, e)
    out[#out + 1] = 'ok'
  elseif kind == 'H' then
    local inc, addr = ARGV[i], ARGV[i + 1]
    i = i + 2
    local k = exkey(e)
    local cur = redis.call('HGET', k, 'incarnation')
    if not cur then out[#out + 1] = 'missing'
    elseif cur ~= inc then out[#out + 1] = 'stale'
    else
      redis.call('HSET', k, 'heartbeat_ms', num(now), 'lease_until_ms', num(now + lease_ms))
      if addr ~= '' then redis.call('HSET', k, 'address', addr) end
      redis.call('PEXPIRE', k, retention_ms)
      redis.call('PEXPIRE', xkey(e, inc), retention_ms)
      out[#out + 1] = 'ok'
    end
  elseif kind == 'D' then
    local inc = ARGV[i]
    i = i + 1
    local k = exkey(e)
    local cur = redis.call('HGET', k, 'incarnation')
    if cur and (inc == '' or cur == inc) then
      retire(e, cur)
      redis.call('DEL', k)
      redis.call('SREM', EXS, e)
      out[#out + 1] = 'ok'
    elseif cur then
      out[#out + 1] = 'stale'
    else
      if inc ~= '' then retire(e, inc) end
      redis.call('SREM', EXS, e)
      out[#out + 1] = 'missing'
    end
  else
    return redis.error_reply('kvpager mirror: unknown section ' .. tostring(kind))
  end
end

local budget = gc_cap
while budget > 0 do
  local g = redis.call('LINDEX', GCL, 0)
  if not g then break end
  local e = redis.call('HGET', GCO, g)
  local items = e and redis.call('ZPOPMIN', g, budget) or {}
  if #items == 0 then
    redis.call('LPOP', GCL)
    redis.call('HDEL', GCO, g)
    redis.call('DEL', g)
  else
    local cur = redis.call('HGET', exkey(e), 'incarnation')
    local x = cur and xkey(e, cur)
    for j = 1, #items, 2 do
      local h = items[j]
      if not (x and redis.call('ZSCORE', x, h)) then unown(h, e) end
      budget = budget - 1
    end
  end
end
out[#out + 1] = redis.call('LLEN', GCL)
return out
"""

SCORE = _COMMON + r"""
local cap = tonumber(ARGV[2])
local nwant = tonumber(ARGV[3])
local ids
if nwant > 0 then
  ids = {}
  for j = 1, nwant do ids[j] = ARGV[3 + j] end
else
  ids = redis.call('SMEMBERS', KEYS[1])
end
local hashes = ARGV[4 + nwant]  -- concatenated 64-hex-digit hashes
local live, prefixes, fields = {}, {}, {}
for _, e in ipairs(ids) do
  local r = redis.call('HMGET', exkey(e), 'incarnation', 'lease_until_ms', 'status')
  if r[1] and r[2] and tonumber(r[2]) > now and r[3] == 'live' then
    live[#live + 1] = e
    prefixes[#prefixes + 1] = r[1] .. ':'
    fields[#fields + 1] = 'e:' .. e
  end
end
local hits, alive = {}, {}
for j = 1, #live do hits[j] = 0; alive[j] = j end
local depth = 0
for a = 1, math.min(math.floor(#hashes / 64), cap) do
  if #alive == 0 then break end
  depth = a
  local f = {}
  for k, j in ipairs(alive) do f[k] = fields[j] end
  local vals = redis.call('HMGET', bkey(string.sub(hashes, 64 * a - 63, 64 * a)), unpack(f))
  local nxt = {}
  for k, j in ipairs(alive) do
    local v = vals[k]
    if v and string.sub(v, 1, #prefixes[j]) == prefixes[j] then
      hits[j] = depth
      nxt[#nxt + 1] = j
    end
  end
  alive = nxt
end
local out = {}
for j = 1, #live do
  out[#out + 1] = live[j]
  out[#out + 1] = hits[j]
end
return out
"""

DUMP = _COMMON + r"""
local e, inc = ARGV[2], ARGV[3]
local field, want = 'e:' .. e, inc .. ':device:'
local m = redis.call('ZRANGE', xkey(e, inc), ARGV[4], ARGV[5], 'WITHSCORES')
local parts = {}
local none = string.rep('-', 64)
for j = 1, #m, 2 do
  local h = m[j]
  local r = redis.call('HMGET', bkey(h), 't', 'p', field)
  local v = r[3]
  if r[1] and v and string.sub(v, 1, #want) == want then
    local p = r[2]
    if not p or p == '' then p = none end
    parts[#parts + 1] = h .. p .. string.format('%08x%08x%08x', tonumber(m[j + 1]),
                                                tonumber(string.sub(v, #want + 1)), #r[1]) .. r[1]
  end
end
return {#m / 2, table.concat(parts)}
"""


@dataclass(frozen=True, slots=True)
class Script:
    """Lua source and its SHA-1 (what EVALSHA names)."""

    source: str

    @property
    def sha(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()


APPLY_SCRIPT = Script(APPLY)
SCORE_SCRIPT = Script(SCORE)
DUMP_SCRIPT = Script(DUMP)
