-- New keys, as new_keys.lua, but each connection waits between requests: the load a rate,
-- not as many as the server can answer. The run id and the pause in milliseconds come from
-- the command line (wrk ... -- RUN PAUSE_MS).
local threads = 0

function setup(thread)
   threads = threads + 1
   thread:set("tid", threads)
end

function init(args)
   prefix = (args[1] or "run") .. "-" .. tostring(tid) .. "-"
   pause = tonumber(args[2] or "0")
   counter = 0
   wrk.method = "POST"
   wrk.body = '{"sku":"A-1","quantity":2}'
   wrk.headers["Content-Type"] = "application/json"
end

function delay()
   return pause
end

function request()
   counter = counter + 1
   wrk.headers["Idempotency-Key"] = prefix .. counter
   return wrk.format()
end
