//! The Lua scripts, one an operation, and how one is invoked on a record's slot.

use redis::Script;

use super::Located;
use crate::store::history::{HISTORY_LIMIT, HISTORY_REFUSALS};

/// The Lua shared by every script: the server's clock, reading and writing a record, its
/// history, and keeping the bucket's reconciliation index in step with it.
///
/// `KEYS[1]` is the record, `KEYS[2]` the bucket's uncertain set (records awaiting
/// reconciliation, by last change), `KEYS[3]` its pending set (in-progress records that
/// would await reconciliation if their holder died, by lease end; moved to the uncertain set
/// once their lease is over, when the bucket is listed); `ARGV[1]` the record's member.
const PRELUDE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function fmt(n) return string.format('%.0f', n) end
local function load(k)
  local flat = redis.call('HGETALL', k)
  if #flat == 0 then return nil end
  local r = {}
  for i = 1, #flat, 2 do r[flat[i]] = flat[i + 1] end
  return r
end
local function watched(r) return r.es == '1' or r.roe == '1' end
local function expired(r)
  if tonumber(r.ea) > now then return false end
  if r.st == 'completed' or r.st == 'released' then return true end
  return r.st == 'in_progress' and not watched(r)
end
local function uncertain(r)
  return r.st == 'needs_reconciliation'
    or (r.st == 'in_progress' and watched(r) and tonumber(r.lu) <= now)
end
local function entry(attempt, token, event)
  return attempt .. ' ' .. token .. ' ' .. fmt(now) .. ' ' .. event .. ';'
end
local function appended(h, e, cap)
  local _, n = string.gsub(h, ';', '')
  if n < cap then return h .. e end
  if cap == @REFUSALS@ then return h end
  return (string.match(h, '^(.*;)[^;]*;$') or '') .. e
end
local function save(r)
  local flat = {}
  for f, v in pairs(r) do flat[#flat + 1] = f; flat[#flat + 1] = v end
  redis.call('HSET', KEYS[1], unpack(flat))
  local m = ARGV[1]
  if r.st == 'needs_reconciliation' then
    redis.call('ZREM', KEYS[3], m)
    redis.call('ZADD', KEYS[2], r.ua, m)
    redis.call('PERSIST', KEYS[1])
  elseif r.st == 'in_progress' and watched(r) then
    redis.call('ZREM', KEYS[2], m)
    redis.call('ZADD', KEYS[3], r.lu, m)
    redis.call('PERSIST', KEYS[1])
  else
    redis.call('ZREM', KEYS[2], m)
    redis.call('ZREM', KEYS[3], m)
    redis.call('PEXPIREAT', KEYS[1], r.ea)
  end
end
-- Bytewise order, as Redis orders a sorted set's members of one score (Lua's own `<` follows
-- the server's collation locale).
local function before(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
-- Tells the store's waiters (subscribed to `{prefix}:changed`) that this record moved on.
local function changed()
  -- pcall: the write stands whether or not this user may publish (Redis 7 ACLs give a new
  -- user no channels); its waiters then poll.
  redis.pcall('PUBLISH', (string.gsub(KEYS[2], ':{%d+}:u$', ':changed')), ARGV[1])
end
local function fenced(r, token)
  return r == nil or r.st ~= 'in_progress' or r.tok ~= token
end
";

/// `ARGV`: member, fingerprint, token, lease ms, ttl ms, reclaim (`1`/`0`), scope, key, and
/// `1` to ask again a claim that won (else nothing). Returns `{written, now, fields}`.
const CLAIM: &str = r"
local fp, tok = ARGV[2], ARGV[3]
local lease, ttl, reclaim = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] == '1'
local r = load(KEYS[1])
-- A won claim asked again (for its replicas' acknowledgement) renews its own record in
-- flight, and writes nothing else: landing late, after its give-back, it must not take the
-- key anew for nobody.
if ARGV[9] == '1' and not (r and not expired(r) and r.st == 'in_progress' and r.tok == tok) then
  return {0, fmt(now), redis.call('HGETALL', KEYS[1])}
end
if r and expired(r) then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  r = nil
end
-- This claim's own, landed before (its reply lost, so it is asked again): won, as it was.
-- Nothing ran under it, so even past its lease it is not another attempt's, nor uncertain.
if r and r.st == 'in_progress' and r.tok == tok then
  r.lu = fmt(math.max(tonumber(r.lu), now + lease)); r.ua = fmt(now)
  r.ea = fmt(math.max(tonumber(r.ea), now + math.max(lease, ttl)))
  save(r)
  return {1, fmt(now), redis.call('HGETALL', KEYS[1])}
end
-- This claim's own, already ended (run and recorded or released, or given back): the claim
-- timed out on its way and reached Redis late, after it was asked again. Nothing may start
-- under its token a second time (it would hold the key for nobody).
if r and r.tok == tok then
  return {0, fmt(now), redis.call('HGETALL', KEYS[1])}
end
local written = 0
local roe = '1'
if reclaim then roe = '0' end
if not r then
  r = {sc = ARGV[7], ky = ARGV[8], fp = fp, st = 'in_progress', tok = tok,
       lu = fmt(now + lease), at = '1', es = '0', ca = fmt(now), ua = fmt(now),
       ea = fmt(now + math.max(lease, ttl)), hist = entry('1', tok, 'claimed'), roe = roe}
  save(r)
  written = 1
else
  local same = r.fp == fp
  local lease_over = r.st == 'in_progress' and tonumber(r.lu) <= now
  -- A takeover needs both the holder's route (roe) and this claim's to reclaim.
  if same and (r.st == 'released' or (lease_over and reclaim and r.roe ~= '1' and r.es ~= '1')) then
    r.at = fmt(tonumber(r.at) + 1)
    -- An earlier attempt's downstream id names its effect, not this one's.
    if r.did then redis.call('HDEL', KEYS[1], 'did'); r.did = nil end
    r.st = 'in_progress'; r.tok = tok; r.lu = fmt(now + lease); r.roe = roe; r.ua = fmt(now)
    r.ea = fmt(math.max(tonumber(r.ea), now + math.max(lease, ttl)))
    r.hist = appended(r.hist, entry(r.at, tok, 'claimed'), @LIMIT@)
    save(r)
    written = 1
  elseif same and lease_over then
    r.st = 'needs_reconciliation'; r.ua = fmt(now)
    r.hist = appended(r.hist, entry(r.at, r.tok, 'lease_expired'), @LIMIT@)
    save(r)
    changed()
  end
end
return {written, fmt(now), redis.call('HGETALL', KEYS[1])}
";

/// `ARGV`: member, token, lease ms. Returns the new lease end, or nil when fenced.
const RENEW: &str = r"
local r = load(KEYS[1])
if fenced(r, ARGV[2]) then return false end
local lease = tonumber(ARGV[3])
-- Never shorter: renewals may overlap, and one sent earlier may land later.
r.lu = fmt(math.max(tonumber(r.lu), now + lease))
r.ea = fmt(math.max(tonumber(r.ea), now + lease)); r.ua = fmt(now)
save(r)
return r.lu
";

/// `ARGV`: member, token, response, ttl ms. Returns 1, or 0 when fenced.
const COMPLETE: &str = r"
local r = load(KEYS[1])
if r == nil or r.tok ~= ARGV[2] or not (r.st == 'in_progress' or r.st == 'completed'
    or r.st == 'needs_reconciliation') then
  return 0
end
r.st = 'completed'; r.resp = ARGV[3]; r.ea = fmt(now + tonumber(ARGV[4])); r.ua = fmt(now)
r.hist = appended(r.hist, entry(r.at, r.tok, 'completed'), @LIMIT@)
save(r)
changed()
return 1
";

/// `ARGV`: member, token. Releases (or moves to reconciliation past a started effect);
/// returns the status it ends in, or nil when fenced.
const RELEASE: &str = r"
local r = load(KEYS[1])
if fenced(r, ARGV[2]) then return false end
if r.es == '1' then r.st = 'needs_reconciliation' else r.st = 'released' end
r.ua = fmt(now)
r.hist = appended(r.hist, entry(r.at, r.tok, r.st), @LIMIT@)
save(r)
changed()
return r.st
";

/// `ARGV`: member, token. Returns 1, or 0 when fenced.
const MARK_UNCERTAIN: &str = r"
local r = load(KEYS[1])
if fenced(r, ARGV[2]) then return 0 end
-- The handler answered (only the layer's failed record marks so): its effect took place.
r.st = 'needs_reconciliation'; r.es = '1'; r.ua = fmt(now)
r.hist = appended(r.hist, entry(r.at, r.tok, 'needs_reconciliation'), @LIMIT@)
save(r)
changed()
return 1
";

/// `ARGV`: member, token, `es` or `did`, the downstream id. Returns 1, or 0 when fenced.
const MILESTONE: &str = r"
local r = load(KEYS[1])
if fenced(r, ARGV[2]) then return 0 end
local event = 'downstream_id'
if ARGV[3] == 'es' then r.es = '1'; event = 'effect_started' else r.did = ARGV[4] end
r.ua = fmt(now)
r.hist = appended(r.hist, entry(r.at, r.tok, event), @LIMIT@)
save(r)
return 1
";

/// `ARGV`: member. Returns `{now, fields}`, or nil when there is no live record; a record
/// that does not read as one (another type at its key, fields that do not parse) is returned
/// as `{now, fields, what}`: damage to show, not a failure of the store.
const LOOKUP: &str = r"
local flat = redis.pcall('HGETALL', KEYS[1])
if flat.err then
  -- Another type at the record's key is damage to show; any other error is the server's.
  if string.find(flat.err, 'WRONGTYPE', 1, true) ~= 1 then return redis.error_reply(flat.err) end
  return {fmt(now), {}, flat.err}
end
if #flat == 0 then return false end
local r = {}
for i = 1, #flat, 2 do r[flat[i]] = flat[i + 1] end
local fine, gone = pcall(expired, r)
if not fine then return {fmt(now), flat, 'its expiry does not read'} end
if gone then return false end
return {fmt(now), flat}
";

/// `ARGV`: member. Returns 1 if a record was deleted.
const REMOVE: &str = r"
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
local n = redis.call('DEL', KEYS[1])
if n == 1 then changed() end
return n
";

/// `ARGV`: member, token, `completed` or `released`, response or empty, whether there is a
/// response (`1`), ttl ms, new token, note or empty, whether there is a note. Returns 1, or 0
/// when refused.
const RESOLVE: &str = r"
local r = load(KEYS[1])
if r == nil or r.tok ~= ARGV[2] or not uncertain(r) then return 0 end
r.st = ARGV[3]
if ARGV[5] == '1' then r.resp = ARGV[4] end
-- This resolution's note, or none: never an earlier resolution's.
if ARGV[9] == '1' then
  r.note = ARGV[8]
else
  r.note = nil
  redis.call('HDEL', KEYS[1], 'note')
end
r.tok = ARGV[7]
-- Kept `ttl` from now either way, history and note with it: a record may have waited for its
-- reconciliation past the expiry its claim set.
if r.st == 'completed' then
  r.ea = fmt(now + tonumber(ARGV[6]))
else
  -- Not applied: the next attempt starts with no effect of its own.
  r.es = '0'
  r.ea = fmt(math.max(tonumber(r.ea), now + tonumber(ARGV[6])))
end
r.ua = fmt(now)
local event = 'reconciled_not_applied'
if r.st == 'completed' then event = 'reconciled_applied' end
r.hist = appended(r.hist, entry(r.at, r.tok, event), @LIMIT@)
save(r)
changed()
return 1
";

/// `ARGV`: member, event. Notes what a request saw, unfenced, within the refusal cap.
const APPEND_HISTORY: &str = r"
local r = load(KEYS[1])
if r == nil or expired(r) then return 0 end
redis.call('HSET', KEYS[1], 'hist', appended(r.hist, entry(r.at, r.tok, ARGV[2]), @REFUSALS@))
return 1
";

/// Moves the bucket's pending records whose lease is over to its uncertain set (a dead
/// holder's record is then listed), at most 1000 a call.
const PROMOTE: &str = r"
-- What a failed `load` raised, when it is another type at the record's key (damage, to be
-- listed unreadable); any other error (a node that no longer holds the key) is raised again.
local function wrong_type(e)
  local text = type(e) == 'table' and e.err or tostring(e)
  if string.find(text, 'WRONGTYPE', 1, true) then return text end
  error(e)
end
local function promote(prefix)
  local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 1000)
  for _, m in ipairs(due) do
    local ok, r = pcall(load, prefix .. m)
    if not ok then
      wrong_type(r)
      -- Another type at the record's key: listed, to be reported unreadable and removed.
      redis.call('ZADD', KEYS[2], now, m)
    elseif r and r.st == 'in_progress' and watched(r) then
      -- Listed at its last change; one that does not read, at now (never failing the call,
      -- which would leave the record out of both sets).
      local at = tonumber(r.ua) and r.ua or fmt(now)
      redis.call('ZADD', KEYS[2], at, m)
    end
    redis.call('ZREM', KEYS[3], m)
  end
end
";

/// On a bucket (`KEYS[1]` unused, `KEYS[2]`, `KEYS[3]` its sets). `ARGV`: unused member,
/// record key prefix, cursor score or empty, cursor member, limit, newest first (`1`).
/// Returns `{score, member, fields}` for each record of the page, in its order (and what is
/// wrong with it, fourth, when something other than a record is at its key).
const LIST: &str = r"
promote(ARGV[2])
local limit, newest = tonumber(ARGV[5]), ARGV[6] == '1'
local found, stale = {}, {}
local function take(m, s)
  if #found >= limit then return end
  local readable, r = pcall(load, ARGV[2] .. m)
  if not readable then
    -- Another type at the record's key: listed with no fields and what is wrong with it,
    -- reported unreadable.
    found[#found + 1] = {s, m, {}, wrong_type(r)}
    return
  end
  if r == nil then
    stale[#stale + 1] = m
    return
  end
  -- A damaged record is listed as it is, to be reported unreadable, never failing the page:
  -- one whose status is none of a record's is in the index and counted, so it is shown.
  local ok, listed = pcall(uncertain, r)
  local known = r.st == 'in_progress' or r.st == 'completed' or r.st == 'released'
    or r.st == 'needs_reconciliation'
  if listed or not ok or not known then
    found[#found + 1] = {s, m, redis.call('HGETALL', ARGV[2] .. m)}
  end
end
-- Index entries without a record do not use up the page: read on until it is full.
local function scan(from, to)
  local offset = 0
  while #found < limit do
    local batch
    if newest then
      batch = redis.call('ZREVRANGEBYSCORE', KEYS[2], from, to, 'WITHSCORES', 'LIMIT', offset, limit)
    else
      batch = redis.call('ZRANGEBYSCORE', KEYS[2], from, to, 'WITHSCORES', 'LIMIT', offset, limit)
    end
    if #batch == 0 then return end
    for i = 1, #batch, 2 do take(batch[i], batch[i + 1]) end
    offset = offset + #batch / 2
  end
end
if ARGV[3] == '' then
  if newest then scan('+inf', '-inf') else scan('-inf', '+inf') end
else
  local s, after = ARGV[3], ARGV[4]
  -- Records changed in the cursor's millisecond: past it by member, as Redis orders ties.
  local ties = redis.call('ZRANGEBYSCORE', KEYS[2], s, s, 'WITHSCORES')
  if newest then
    for i = #ties - 1, 1, -2 do
      if before(ties[i], after) then take(ties[i], ties[i + 1]) end
    end
    scan('(' .. s, '-inf')
  else
    for i = 1, #ties, 2 do
      if before(after, ties[i]) then take(ties[i], ties[i + 1]) end
    end
    scan('(' .. s, '+inf')
  end
end
for _, m in ipairs(stale) do redis.call('ZREM', KEYS[2], m) end
return found
";

/// On a bucket, as [`LIST`]. `ARGV`: unused member, record key prefix. Returns
/// `{count, oldest score or -1}`.
const COUNT: &str = r"
promote(ARGV[2])
local n = redis.call('ZCARD', KEYS[2])
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if #first == 0 then return {n, -1} end
return {n, tonumber(first[2])}
";

/// The scripts, compiled once per store (their SHA-1s are what travels).
pub(super) struct Scripts {
    /// The claim's and the completion's source, for inspection.
    pub(super) claim_source: String,
    pub(super) complete_source: String,
    pub(super) claim: Script,
    pub(super) renew: Script,
    pub(super) complete: Script,
    pub(super) release: Script,
    pub(super) mark_uncertain: Script,
    pub(super) milestone: Script,
    pub(super) lookup: Script,
    pub(super) remove: Script,
    pub(super) resolve: Script,
    pub(super) append_history: Script,
    pub(super) list: Script,
    pub(super) count: Script,
}

impl Scripts {
    pub(super) fn new() -> Self {
        let source = |body: &str| {
            format!("{PRELUDE}{PROMOTE}{body}")
                .replace("@LIMIT@", &HISTORY_LIMIT.to_string())
                .replace("@REFUSALS@", &HISTORY_REFUSALS.to_string())
        };
        let build = |body: &str| Script::new(&source(body));
        Self {
            claim_source: source(CLAIM),
            complete_source: source(COMPLETE),
            claim: build(CLAIM),
            renew: build(RENEW),
            complete: build(COMPLETE),
            release: build(RELEASE),
            mark_uncertain: build(MARK_UNCERTAIN),
            milestone: build(MILESTONE),
            lookup: build(LOOKUP),
            remove: build(REMOVE),
            resolve: build(RESOLVE),
            append_history: build(APPEND_HISTORY),
            list: build(LIST),
            count: build(COUNT),
        }
    }
}

impl Scripts {
    /// The scripts a write sends beside a `WAIT` (a won claim's re-ask, a milestone, a
    /// completion), loaded together: in a pipeline a script the server lacks still has its
    /// `WAIT` run, a whole timeout when replicas lag, so each is loaded before it is needed.
    pub(super) fn waited(&self) -> [&Script; 3] {
        [&self.claim, &self.milestone, &self.complete]
    }
}

/// `script`'s invocation on the located record's slot: its record, uncertain and pending
/// keys, then `args` after the member.
pub(super) fn invocation<'a>(
    script: &'a Script,
    at: &Located,
    args: &[&[u8]],
) -> redis::ScriptInvocation<'a> {
    let mut invocation = script.key(&at.record[..]);
    invocation
        .key(&at.uncertain)
        .key(&at.pending)
        .arg(&at.member[..]);
    for arg in args {
        invocation.arg(*arg);
    }
    invocation
}
