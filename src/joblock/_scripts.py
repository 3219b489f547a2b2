"""The Lua scripts behind compare-and-act operations, and their SHA1 digests.

Each compares the lock's value with the lease's token first, so a lease can only
touch a lock that is still its own. Scripts go out as EVALSHA; a NOSCRIPT reply
makes the connection load the script once and redo the affected commands.
"""

from __future__ import annotations

import hashlib

# 1: deleted (ours). 0: the key is gone (expired). -1: someone else holds it now.
# Distinguishing 0 from -1 lets a release retried after a lost reply count "gone" as
# its own earlier delete.
RELEASE = b"""\
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then return redis.call('DEL', KEYS[1]) end
if v then return -1 end
return 0
"""

# 1: the ttl was reset to ARGV[2] ms. 0: the lock is no longer ours.
EXTEND = b"""\
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# Milliseconds left while the lock is ours, else -2 (as PTTL says of a missing key).
REMAINING = b"""\
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PTTL', KEYS[1]) end
return -2
"""

# Grants the lock and the next fencing number in one step; KEYS[2] is the counter, in
# the lock key's hash slot. A retry that finds its own token gets its number back
# (the counter only moves on a grant, so while we hold the lock it is still ours).
FENCED_ACQUIRE = b"""\
local v = redis.call('GET', KEYS[1])
if not v then
  local f = redis.call('INCR', KEYS[2])
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return f
end
if v == ARGV[1] then return tonumber(redis.call('GET', KEYS[2])) end
return false
"""

# redis-py's Lock.extend semantics for joblock.compat: ARGV[2] ms added to the ttl
# left, or replacing it when ARGV[3] is "1". 1: done. 0: not ours (or no ttl).
EXTEND_ADD = b"""\
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then return 0 end
if ARGV[3] == '1' then ttl = 0 end
redis.call('PEXPIRE', KEYS[1], ttl + ARGV[2])
return 1
"""

SCRIPTS = {
    hashlib.sha1(body).hexdigest().encode(): body
    for body in (RELEASE, EXTEND, REMAINING, FENCED_ACQUIRE, EXTEND_ADD)
}
RELEASE_SHA, EXTEND_SHA, REMAINING_SHA, FENCED_ACQUIRE_SHA, EXTEND_ADD_SHA = SCRIPTS
