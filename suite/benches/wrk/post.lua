-- wrk script for benches/http.rs served with BENCH_SERVE=1: POSTs a 1 KiB JSON body.
-- KEYS=unique sends a new Idempotency-Key per request, KEYS=repeated cycles through 64 keys
-- per thread (every request after the first 64 is a replay), KEYS unset sends none.
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("id", os.time() .. "-" .. threads)
end

local mode = os.getenv("KEYS")
local counter = 0
local body = '{"priority":2,"title":"' .. string.rep("x", 964) .. '"}'

request = function()
  counter = counter + 1
  local headers = { ["Content-Type"] = "application/json" }
  if mode == "unique" then
    headers["Idempotency-Key"] = id .. "-" .. counter
  elseif mode == "repeated" then
    headers["Idempotency-Key"] = id .. "-" .. (counter % 64)
  end
  return wrk.format("POST", "/tools/create_ticket", headers, body)
end
