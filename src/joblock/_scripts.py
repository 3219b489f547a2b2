"""The Lua scripts behind compare-and-act operations, and their SHA1 digests.

Each compares the lock's value with the lease's token first, so a lease can only
touch a lock that is still its own. Scripts go out as EVALSHA; a NOSCRIPT reply
makes the connection load the script once and redo the affected commands.
"""

from __future__ import annotations

import hashlib

# What a waiter appends to the value of a plain lock it queues for (see below): a NUL
# byte, which no token of joblock's has, so no holder's token can be mistaken for it.
MARK = b"\x00w"

# Waiting (``acquire(..., wait=)``): a lock's waiters queue in a list at "<key>:waiters"
# (in the lock key's hash slot, as the fencing counter is), in the order they came.
# Each is "<client id>:<number> <deadline ms> <ttl ms> <counter> <limit> <token>":
# its client's 16-character id and a number of the client's, the wall-clock time after
# which it no longer waits, and what its own acquire would ask (<counter>: the key of
# its fencing counter, which a release would not know, or 0 when not fenced). Its
# client listens on the channel "joblock:wake:<client id>" (in a Cluster, on one in the
# lock key's slot: see ``_LISTENING``). A release hands the lock
# straight to the first live waiter (SET with its token and ttl, as its acquire would,
# a fenced one's number after it) and publishes
# "<number> <its acquire's reply> <length of the holder> <holder><key>" on that
# channel: nobody polls, only that one waiter is woken, and no fresh caller can slip in
# between. A waiter is live while its client listens (PUBSUB NUMSUB or SHARDNUMSUB): a dead process's
# are passed over; a fair acquire also passes over those past their deadline. A lock
# that frees by expiry publishes nothing: its first waiter looks again when it would
# expire.
# A plain lock that a waiter queued for holds its token followed by MARK: its holder's
# compare-and-delete (a native DELIFEQ, or RELEASE_PLAIN) then finds another value and
# the release takes the hand-off path (RELEASE), while a lock nobody waits for is
# released by the plain command alone. The queue step marks the lock in the same
# script that queues the waiter, and a hand-off marks the new holder's lock while
# waiters remain, so no release can miss a waiter. A holder that a release handed the
# lock releases and extends by the scripts at once: that lock is marked, or likely to be
# by the time it is released (a waiter that queues after the hand-off marks it), and the
# plain command's round trip would find the mark. Every comparison of a lock's value
# with a token takes the marked value as the token's.
# The scripts are put together from these pieces, each script with only those it
# runs: a piece's functions are made anew at every call of a script, so the release of
# a lock nobody waits for makes none of the taking functions (they are inside handoff),
# and a hand-off to a plain waiter none of those of fencing, counting and readers.
_CLOCK = b"""\
local function now_ms()
  local t = redis.call('TIME')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end
"""
_TAGGED = b"""\
-- The key of ``k``'s hash slot named ``k`` and ``suffix``; false for a key with a "}"
-- but no hash tag (none exists: nobody waits for or fences such a lock, the clients
-- refuse to).
local function tagged(k, suffix)
  local s = string.find(k, '{', 1, true)
  if s then
    local e = string.find(k, '}', s + 1, true)
    if e and e > s + 1 then return k .. suffix end
  end
  if string.find(k, '}', 1, true) then return false end
  return '{' .. k .. '}' .. suffix
end
"""
# ``is_mine(v, token)``: the lock's value ``v`` is ``token``'s, marked or not; ``mark(key,
# kind)``: the plain lock at ``key`` is marked, for the waiters that queue for it (its
# callers know they do; ``kind``: the key's type, when the caller has just read it);
# ``unmark(key)``, once the last has left.
MARKS = b"""\
local MARK = '\\0w'
local function is_mine(v, token)
  return v == token or v == token .. MARK
end
local function mark(key, kind)
  if (kind or redis.call('TYPE', key).ok) ~= 'string' then return end
  local v = redis.call('GET', key)
  if string.sub(v, -2) ~= MARK then redis.call('SET', key, v .. MARK, 'KEEPTTL') end
end
local function unmark(key)
  if redis.call('TYPE', key).ok ~= 'string' then return end
  local v = redis.call('GET', key)
  if string.sub(v, -2) == MARK then redis.call('SET', key, string.sub(v, 1, -3), 'KEEPTTL') end
end
"""
_WRONGTYPE = b"""\
local WRONGTYPE = 'WRONGTYPE Operation against a key holding the wrong kind of value'
"""
# A waiter's client listens on "joblock:wake:<id>", or, a Cluster client on a server with
# sharded pub/sub, on a channel in the lock key's hash slot, "joblock:wake:<id>:<key>"
# ("{<key>}" for a key without a hash tag), by SSUBSCRIBE on the slot's primary: its
# messages go by SPUBLISH and never cross the cluster bus. ``wake_channel`` finds which
# one the client listens on (the command that publishes there, and the channel), or
# none: the waiter is not live.
_LISTENING = b"""\
local WAITER = '^(%x+):(%d+) (%d+) (%d+) (%S+) (%d+) (.+)$'
local function wake_channel(id, key)
  local classic = 'joblock:wake:' .. id
  if tonumber(redis.call('PUBSUB', 'NUMSUB', classic)[2]) > 0 then return 'PUBLISH', classic end
  local sharded = classic .. ':' .. (tagged(key, '') or key)
  local n = redis.pcall('PUBSUB', 'SHARDNUMSUB', sharded)  -- an error before Redis 7.0
  if type(n) == 'table' and n[2] and tonumber(n[2]) > 0 then return 'SPUBLISH', sharded end
  return false
end
local function publish(id, key, message)
  local how, channel = wake_channel(id, key)
  if how then redis.call(how, channel, message) end
end
"""

# What ends a hold from outside the holder (an operator's ``joblock release``, the locks
# page, ``joblock.testing``) tells: ``wake_first`` has the lock's first waiter look again
# (the lock was not handed over as a release hands it); ``tell_lost`` tells the holder's
# client, if it guards the lease, why it lost it (joblock.lost), on "joblock:wake:lost",
# where every listening client subscribes, or, in a Cluster with sharded pub/sub, on
# "joblock:wake:lost:<key>" in the key's slot. Each publishes only where someone listens.
TELLING = (
    _TAGGED
    + _LISTENING
    + b"""\
local function wake_first(key)
  local q = tagged(key, ':waiters')
  local id, seq = string.match(q and redis.call('LINDEX', q, 0) or '', '^(%x+):(%d+) ')
  if id then publish(id, key, seq .. ' ?') end
end
local function tell_lost(key, message)
  local classic = 'joblock:wake:lost'
  if tonumber(redis.call('PUBSUB', 'NUMSUB', classic)[2]) > 0 then redis.call('PUBLISH', classic, message) end
  local sharded = classic .. ':' .. (tagged(key, '') or key)
  local n = redis.pcall('PUBSUB', 'SHARDNUMSUB', sharded)
  if type(n) == 'table' and n[2] and tonumber(n[2]) > 0 then redis.call('SPUBLISH', sharded, message) end
end
"""
)

# An operator's release told (KEYS[1]: the lock's key; ARGV[1]: "1" to wake its first
# waiter, then the lost notices for its holders' clients, ``waits.lost_message``).
TELL = (
    TELLING
    + b"""\
local key = KEYS[1]
if ARGV[1] == '1' then wake_first(key) end
for i = 2, #ARGV do tell_lost(key, ARGV[i]) end
"""
)

# Fencing numbers come from one counter per hash slot (the core's fence_key names it),
# so their keys stay at most 16,384 however many keys are fenced: a lock's numbers grow
# because its slot's counter only grows. A fenced plain lock holds "<token>#<number>",
# as a fenced counting lock's holder is named, so a retried acquire finds its number.
# ``next_fence`` first folds in the per-key counter "<key>:fence" (in the key's hash tag)
# that earlier releases kept, so that no lock's number goes back. Neither that key nor
# (in a hand-over) the counter is among the script's KEYS, so Redis Cluster does not
# redirect for them: in a slot in migration, a script that touches a key of the slot
# that is not on this node fails. Read first (pcall), such a key makes the grant answer
# TRYAGAIN, which the client retries until the migration ends, as Redis does for KEYS.
_FENCING = b"""\
local function fence_of(v, token)
  if string.sub(v, 1, #token + 1) ~= token .. '#' then return false end
  return tonumber(string.match(v, '^%d+', #token + 2))
end
local function next_fence(key, counter)
  local old = tagged(key, ':fence')
  local was, now = old and redis.pcall('GET', old), redis.pcall('GET', counter)
  if type(was) == 'table' or type(now) == 'table' then
    return redis.error_reply('TRYAGAIN the fencing counter of a hash slot in migration')
  end
  if was then
    if tonumber(was) > tonumber(now or '0') then redis.call('SET', counter, was) end
    redis.call('DEL', old)
  end
  return redis.call('INCR', counter)
end
"""
_COUNTING = b"""\
local function counting_mine(key, value, fenced)
  if fenced then
    local mine = value .. '#'
    for _, m in ipairs(redis.call('ZRANGE', key, 0, -1)) do
      if string.sub(m, 1, #mine) == mine then return tonumber(string.sub(m, #mine + 1)) end
    end
  elseif redis.call('ZSCORE', key, value) then
    return redis.status_reply('OK')
  end
  return false
end
local function counting_take(key, fkey, value, ms, limit, fenced, retry, t)
  local kind = redis.call('TYPE', key).ok
  if kind == 'zset' then
    local held = tonumber(redis.call('ZSCORE', key, 'limit'))
    if not held then return redis.error_reply(WRONGTYPE) end
    if held ~= -limit then return redis.error_reply('JOBLOCKLIMIT ' .. -held .. ' ' .. limit) end
    if retry then
      local mine = counting_mine(key, value, fenced)
      if mine then return mine end
    end
    local n = redis.call('ZCARD', key) - 1
    if n >= limit and n - redis.call('ZREMRANGEBYSCORE', key, 0, t) >= limit then return false end
  elseif kind == 'string' then
    return redis.error_reply('JOBLOCKLIMIT 1 ' .. limit)
  elseif kind ~= 'none' then
    return redis.error_reply(WRONGTYPE)
  end
  local member, granted = value, redis.status_reply('OK')
  if fenced then
    granted = next_fence(key, fkey)
    if type(granted) == 'table' then return granted end
    member = value .. '#' .. granted
  end
  local expiry = string.format('%d', t + ms)
  redis.call('ZADD', key, -limit, 'limit', expiry, member)
  if kind == 'none' or redis.call('PTTL', key) < ms then redis.call('PEXPIREAT', key, expiry) end
  return granted
end
"""
_SET = b"""\
-- A plain lock's SET; ttl 0 (joblock.compat's lock without a timeout) sets no expiry.
local function set(key, value, ms, ...)
  if tonumber(ms) > 0 then return redis.call('SET', key, value, 'PX', ms, ...) end
  return redis.call('SET', key, value, ...)
end
"""
_TAKING = b"""\
-- Not free: false and the key's type.
local function plain_take(key, fkey, value, ms, fenced)
  local kind = redis.call('TYPE', key).ok
  if kind == 'string' then return false, kind end
  if kind == 'zset' then
    local held = tonumber(redis.call('ZSCORE', key, 'limit'))
    if held == 0 then return false, kind end  -- readers hold it
    if held then return redis.error_reply('JOBLOCKLIMIT ' .. -held .. ' 1') end
  end
  if kind ~= 'none' then return redis.error_reply(WRONGTYPE) end
  local granted = redis.status_reply('OK')
  if fenced then
    granted = next_fence(key, fkey)
    if type(granted) == 'table' then return granted end
    value = value .. '#' .. granted
  end
  set(key, value, ms)
  return granted
end
-- A reader's place (limit 0): readers share a sorted set as a counting lock's holders
-- do, with "limit" scored 0; a writer is a plain lock at the key.
local function reader_take(key, value, ms)
  local kind = redis.call('TYPE', key).ok
  if kind == 'string' then return false end
  if kind == 'zset' then
    local held = tonumber(redis.call('ZSCORE', key, 'limit'))
    if not held then return redis.error_reply(WRONGTYPE) end
    if held ~= 0 then return redis.error_reply('JOBLOCKLIMIT ' .. -held .. ' 0') end
  elseif kind ~= 'none' then
    return redis.error_reply(WRONGTYPE)
  end
  local expiry = string.format('%d', now_ms() + ms)
  redis.call('ZADD', key, 0, 'limit', expiry, value)
  if kind == 'none' or redis.call('PTTL', key) < ms then redis.call('PEXPIREAT', key, expiry) end
  return redis.status_reply('OK')
end
local function take(key, fkey, value, ms, fenced, limit)
  if limit > 1 then return counting_take(key, fkey, value, ms, limit, fenced, false, now_ms()) end
  if limit == 0 then return reader_take(key, value, ms) end
  return plain_take(key, fkey, value, ms, fenced)
end
"""
_HANDOFF = b"""\
-- Hands the place just freed at ``key`` to the first live waiter (and the readers
-- queued behind a reader, together); ``plain``: the plain lock there is still set (its
-- holder is releasing it), and a plain waiter's SET replaces it. Whether that plain
-- lock was replaced or deleted.
local function handoff(key, plain)
  local q = tagged(key, ':waiters')
  if not q then return false end
  local waiter = redis.call('LPOP', q)
  if not waiter then return false end
  local handed = false
  --LISTENING--
  -- What a fenced, counting or reader's grant needs, made when one comes: a plain
  -- waiter's hand-off makes none of it (6-9% of its time at the server).
  local next_fence, take
  local function taking()
    if take then return end
    next_fence, take = (function()
      --TAKE--
      return next_fence, take
    end)()
  end
  while waiter do
    local id, seq, _, ms, counter, limit, value = string.match(waiter, WAITER)
    -- Its process listens (one that died does not). A waiter that left without leaving
    -- the queue (its last step failed) but whose process lives is handed the lock too:
    -- the message names the lock and its holder, and that process releases it.
    local how, channel
    if id then how, channel = wake_channel(id, key) end
    if how then
      local granted, marked
      if plain and limit == '1' then
        granted = redis.status_reply('OK')
        local held = value
        if counter ~= '0' then
          taking()
          granted = next_fence(key, counter)
          if type(granted) == 'number' then held = value .. '#' .. granted end
        end
        if type(granted) == 'number' or granted.ok then  -- else TRYAGAIN, below
          -- Marked in the same SET while waiters remain (what ``mark`` would do after it).
          marked = redis.call('LINDEX', q, 0) ~= false
          if marked then held = held .. MARK end
          set(key, held, ms)
          plain = false
        end
      else
        if plain then
          redis.call('DEL', key)
          plain = false
        end
        taking()
        granted = take(key, counter, value, tonumber(ms), counter ~= '0', tonumber(limit))
        if not granted then
          -- Not free for it yet (other readers, or holders of a counting lock, remain):
          -- it keeps its place, and looks again to learn when the lock would expire now.
          redis.call('LPUSH', q, waiter)
          redis.call(how, channel, seq .. ' ?')
          return true
        end
      end
      if type(granted) == 'table' and granted.err and string.find(granted.err, '^TRYAGAIN') then
        -- Its counter is not all on this node (a Cluster slot in migration): it keeps its
        -- place and looks again, meeting TRYAGAIN until the slot has moved. (Redis refuses
        -- the LPUSH when its queue went with it, the last waiter: its look queues it again.)
        redis.pcall('LPUSH', q, waiter)
        redis.call(how, channel, seq .. ' ?')
        return handed or not plain
      end
      handed = true
      -- A waiter for another kind of lock is told to look again, and meets the mismatch.
      if type(granted) == 'table' then granted = granted.ok or '?' end
      local holder = value
      if counter ~= '0' and granted ~= '?' then holder = value .. '#' .. granted end
      local message = seq .. ' ' .. granted .. ' ' .. #holder .. ' ' .. holder .. key
      redis.call(how, channel, message)
      if granted ~= '?' and limit ~= '0' then
        -- The next waiter's turn comes by this holder's release too.
        -- (A plain grant was marked in its SET, if waiters remain.)
        if limit == '1' and marked == nil and redis.call('LINDEX', q, 0) then mark(key) end
        return true
      end
    end
    waiter = redis.call('LPOP', q)
  end
  return handed
end
"""


def _indented(spaces: int, *pieces: bytes) -> bytes:
    return b"".join(
        b"".join(b" " * spaces + line if line.strip() else line for line in piece.splitlines(True))
        for piece in pieces
    )


_HANDOFF = _HANDOFF.replace(b"  --LISTENING--\n", _indented(2, _LISTENING, _SET)).replace(
    b"      --TAKE--\n", _indented(6, _WRONGTYPE, _FENCING, _COUNTING, _TAKING)
)


# A counting lock (``limit=N``, N > 1) is a sorted set at the lock's key: each holder's
# token scored by its expiry in milliseconds of the server's clock (TIME), and the
# member "limit" scored -N, so every use of the key can check it means the same N.
# The key itself expires with its longest-lived holder.
#
# Release, extend and remaining serve both kinds, told apart by the token: a counting
# lock's holder has "~" after its 32 random hex digits (``holder_suffix``). Each reads
# its kind's way (GET, or ZSCORE of its token), so neither kind meets an error reply
# on the way (Redis counts those in INFO errorstats). A lock of the other kind at the
# key is someone else's; any other value there is the WRONGTYPE it is.
_READ = (
    _CLOCK
    + MARKS
    + b"""\
local key, token = KEYS[1], ARGV[1]
local counting = string.byte(token, 33) == 126
local function settle()
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[1] == 'limit' then redis.call('DEL', key) else redis.call('PEXPIREAT', key, last[2]) end
end
local v
if counting then v = redis.pcall('ZSCORE', key, token) else v = redis.pcall('GET', key) end
local theirs = false
if type(v) == 'table' then
  if redis.call('TYPE', key).ok ~= (counting and 'string' or 'zset') then return v end
  theirs, v = true, false
end
if not counting and v and is_mine(v, token) then v = token end
"""
)

# 1: released (ours; handed to its first waiter if it has one). 0: the key is gone
# (expired). -1: someone else holds it now.
# Distinguishing 0 from -1 lets a release retried after a lost reply count "gone" as
# its own earlier delete. A counting lock's holder that is gone or expired is 0; the
# last holder out deletes the key.
RELEASE = (
    _READ
    + _TAGGED
    + _HANDOFF
    + b"""\
if theirs then return -1 end
if not v then
  -- Expired before its release: the lock is free, and its first waiter is handed it now
  -- rather than when it would look again.
  handoff(key, false)
  return 0
end
if counting then
  if redis.call('ZCARD', key) <= 2 then
    -- The last holder: the key, which expires with it, is still there, so it has not expired.
    redis.call('DEL', key)
    handoff(key, false)
    return 1
  end
  redis.call('ZREM', key, token)
  settle()
  handoff(key, false)
  if tonumber(v) <= now_ms() then return 0 end
  return 1
end
if v == token then
  if not handoff(key, true) then redis.call('DEL', key) end
  return 1
end
if v then return -1 end
return 0
"""
)

# 1: the ttl was reset to ARGV[2] ms. 0: the lock is gone (expired); -1: another holder
# has it (the lease's loss says which: joblock.LockLost's cause).
EXTEND = (
    _READ
    + b"""\
if counting then
  local t = now_ms()
  if not v or tonumber(v) <= t then return 0 end
  redis.call('ZADD', key, 'XX', string.format('%d', t + ARGV[2]), token)
  settle()
  return 1
end
if v == token then return redis.call('PEXPIRE', key, ARGV[2]) end
if v or theirs then return -1 end
return 0
"""
)

# Milliseconds left while the lock is ours, else -2 (as PTTL says of a missing key).
REMAINING = (
    _READ
    + b"""\
if counting then
  local left = v and tonumber(v) - now_ms()
  if left and left > 0 then return left end
  return -2
end
if v == token then return redis.call('PTTL', key) end
return -2
"""
)

# Takes one of ARGV[3] holder slots of a counting lock for ARGV[2] ms: OK, or (with
# ARGV[4] == "1") the next fencing number from the counter KEYS[2], the holder's
# member then being its token, "#" and that number. False when all slots are held;
# expired holders are dropped when the slots look full. Sent again after a lost reply
# (ARGV[5] == "1"), it finds its own member and answers as the lost reply did. A plain
# lock at the key, or another limit, is the error "JOBLOCKLIMIT <the key's limit, 1
# for a plain lock> <ARGV[3]>".
COUNTING_ACQUIRE = (
    _CLOCK
    + _TAGGED
    + _WRONGTYPE
    + _FENCING
    + _COUNTING
    + b"""\
local t = redis.call('TIME')
return counting_take(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4] == '1',
  ARGV[5] == '1', t[1] * 1000 + math.floor(t[2] / 1000))
"""
)

# A waiting (or fair, or reader's) acquire's step (ARGV: token, ttl ms, fenced 0|1,
# limit (0: a reader of a read-write lock), the waiter as queued, patience ms, fair 0|1,
# again 0|1). The lock, answered as the acquire of its kind would, when it is free and
# the caller may take it: anyone may, but with ``fair`` (and a reader, always) only the
# first live waiter, or anyone while none waits; ``again``
# (every step after the first) also finds a lock handed over already. Else, with
# patience > 0, the waiter queues (keeping its place) and the reply is {ms until the
# lock would expire, for the first waiter; else -1}, or {-3} when its client does not
# listen on this server. With patience 0 it leaves the queue: nil.
QUEUE = (
    _CLOCK
    + MARKS
    + _TAGGED
    + _WRONGTYPE
    + _LISTENING
    + _FENCING
    + _COUNTING
    + _SET
    + _TAKING
    + _HANDOFF
    + b"""\
local key, fkey, value, ms = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
local fenced, limit, waiter, patience = ARGV[3] == '1', tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local fair, again = ARGV[7] == '1', ARGV[8] == '1'
local q = tagged(key, ':waiters')
-- Leaves the queue; the waiter now first, if it was, looks again: it is the one to take
-- the lock when it would expire, and only the first waiter learns when that is.
local function leave()
  local first = redis.call('LINDEX', q, 0) == waiter
  redis.call('LREM', q, 1, waiter)
  if first then
    local head = redis.call('LINDEX', q, 0)
    local id, seq = string.match(head or '', WAITER)
    if id then publish(id, key, seq .. ' ?') end
    if not head then unmark(key) end  -- the last waiter left: its holder's release is plain again
  end
end
if again then
  local mine = false
  if limit ~= 1 then
    if redis.call('TYPE', key).ok == 'zset' then mine = counting_mine(key, value, fenced) end
  elseif redis.call('TYPE', key).ok == 'string' then
    local v = redis.call('GET', key)
    if fenced then
      mine = fence_of(v, value)
    elseif is_mine(v, value) then
      mine = redis.status_reply('OK')
    end
  end
  if mine then
    leave()
    return mine
  end
end
local may = true
if fair or limit == 0 then  -- a reader passes no waiter: writers are not starved
  -- The first live waiter, after dropping the dead before it.
  local t = tonumber(redis.call('TIME')[1]) * 1000
  while true do
    local head = redis.call('LINDEX', q, 0)
    if not head or head == waiter then break end
    local id, _, deadline = string.match(head, WAITER)
    if id and tonumber(deadline) > t and wake_channel(id, key) then
      may = false
      break
    end
    redis.call('LPOP', q)
  end
end
local kind  -- the key's type, when a take just read it
if may then
  local granted
  if limit == 1 and not fenced and again then
    granted = set(key, value, ms, 'NX')  -- the key's kind was checked by the first step
  else
    granted, kind = take(key, fkey, value, ms, fenced, limit)
  end
  if granted then
    if type(granted) == 'table' and granted.err then return granted end
    if again or fair then leave() end
    if limit ~= 1 then
      handoff(key, false)
    elseif redis.call('LINDEX', q, 0) then
      mark(key)
    end
    return granted
  end
end
if patience <= 0 then
  if again then leave() end
  return false
end
local first
if again then
  if not wake_channel(string.match(waiter, '^%x+'), key) then return {-3} end
  local at = redis.call('LPOS', q, waiter)
  if not at then at = redis.call('RPUSH', q, waiter) - 1 end
  first = at == 0
else
  first = redis.call('RPUSH', q, waiter) == 1
end
mark(key, kind)  -- before the holder's release: that release hands the lock over
if not first then return {-1} end
redis.call('PEXPIRE', q, patience + 60000)
if limit > 1 then
  local soonest = redis.call('ZRANGE', key, 1, 1, 'WITHSCORES')[2]
  return {soonest and math.max(0, tonumber(soonest) - now_ms()) or -1}
end
return {redis.call('PTTL', key)}
"""
)


# Grants the lock and the next fencing number in one step; KEYS[2] is the counter of
# the lock key's hash slot. A retry that finds its own token gets its number back from
# the lock's value.
FENCED_ACQUIRE = (
    _TAGGED
    + _FENCING
    + b"""\
local v = redis.call('GET', KEYS[1])
if not v then
  local f = next_fence(KEYS[1], KEYS[2])
  if type(f) == 'table' then return f end
  redis.call('SET', KEYS[1], ARGV[1] .. '#' .. f, 'PX', ARGV[2])
  return f
end
return fence_of(v, ARGV[1])
"""
)

# redis-py's Lock.extend semantics for joblock.compat: ARGV[2] ms added to the ttl
# left, or replacing it when ARGV[3] is "1". 1: done. 0: not ours (or no ttl).
EXTEND_ADD = (
    MARKS
    + b"""\
if not is_mine(redis.call('GET', KEYS[1]), ARGV[1]) then return 0 end
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then return 0 end
if ARGV[3] == '1' then ttl = 0 end
redis.call('PEXPIRE', KEYS[1], ttl + ARGV[2])
return 1
"""
)

# The release and extend of a plain lock that nobody waits for: what a server's native
# compare-and-delete (DELIFEQ) and compare-and-set (SET IFEQ PX) do, for servers without
# them. 1: done; 0: not done, and the lease's RELEASE or EXTEND says why (a marked lock,
# one expired or someone else's); WRONGTYPE, as the GET meets it, the same.
RELEASE_PLAIN = b"""\
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
EXTEND_PLAIN = b"""\
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

SCRIPTS = {
    hashlib.sha1(body).hexdigest().encode(): body
    for body in (
        RELEASE, EXTEND, REMAINING, FENCED_ACQUIRE, EXTEND_ADD, COUNTING_ACQUIRE, QUEUE, RELEASE_PLAIN,
        EXTEND_PLAIN, TELL,
    )
}  # fmt: skip
(
    RELEASE_SHA,
    EXTEND_SHA,
    REMAINING_SHA,
    FENCED_ACQUIRE_SHA,
    EXTEND_ADD_SHA,
    COUNTING_ACQUIRE_SHA,
    QUEUE_SHA,
    RELEASE_PLAIN_SHA,
    EXTEND_PLAIN_SHA,
    TELL_SHA,
) = SCRIPTS

# joblock.frameworks' "debounce" lifetime keeps a hash at the job's lock key: "t", the
# token of the one pending message (the latest enqueue's), "f", when its burst began
# (the server's clock, TIME, in ms), and "ran", the token of the last message that ran.

# An enqueue (ARGV: its token, lock_debounce ms, lock_debounce_max ms or 0, lock_ttl
# ms): its token supersedes the pending one, and the reply is {the delay in ms, the
# token superseded (or nil)}: lock_debounce, cut so that the run comes at most
# lock_debounce_max after the burst began. The key outlives the delay by lock_ttl,
# time for the message to reach a worker. A retry after a lost reply finds its own
# token and supersedes nothing.
DEBOUNCE = b"""\
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local previous = redis.call('HGET', KEYS[1], 't')
local first = previous and tonumber(redis.call('HGET', KEYS[1], 'f')) or now
local delay = tonumber(ARGV[2])
if tonumber(ARGV[3]) > 0 then delay = math.max(0, math.min(delay, first + ARGV[3] - now)) end
redis.call('HSET', KEYS[1], 't', ARGV[1], 'f', string.format('%d', first))
local keep = delay + ARGV[4]
if redis.call('PTTL', KEYS[1]) < keep then redis.call('PEXPIRE', KEYS[1], keep) end
if previous == ARGV[1] then previous = false end
return {delay, previous}
"""

# A message at the worker (ARGV: its token, lock_ttl ms). 1: it is the pending one (or
# it ran already: a retry), so it runs, and "ran" keeps its token for lock_ttl. -1:
# superseded, a later enqueue's message runs (or ran) instead. 0: the key had expired
# (the message waited longer than lock_ttl past its due time): the first message to
# come claims it as 1 does, so that one of them runs.
DEBOUNCE_CLAIM = b"""\
local t = redis.call('HGET', KEYS[1], 't')
if t == ARGV[1] or redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'ran', ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if t then return 1 end
  return 0
end
if redis.call('HGET', KEYS[1], 'ran') == ARGV[1] then return 1 end
return -1
"""

# An enqueue whose message could not be sent (ARGV: its token, the token it superseded
# or ""): the superseded message is pending again, so that the burst still runs.
DEBOUNCE_UNDO = b"""\
if redis.call('HGET', KEYS[1], 't') ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('HDEL', KEYS[1], 't', 'f') else redis.call('HSET', KEYS[1], 't', ARGV[2]) end
return 1
"""

DEBOUNCE_SHA, DEBOUNCE_CLAIM_SHA, DEBOUNCE_UNDO_SHA = (
    hashlib.sha1(body).hexdigest().encode() for body in (DEBOUNCE, DEBOUNCE_CLAIM, DEBOUNCE_UNDO)
)
SCRIPTS.update({DEBOUNCE_SHA: DEBOUNCE, DEBOUNCE_CLAIM_SHA: DEBOUNCE_CLAIM, DEBOUNCE_UNDO_SHA: DEBOUNCE_UNDO})
